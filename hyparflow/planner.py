"""`hyparflow plan`: profile a model, search (stages, replicas, microbatches, schedule,
balance) and rank the plans by a cost model with an alpha-beta network.

Cost model, per plan (S stages, R replicas, M microbatches of m = B / (R M) samples):

- compute: each layer call's forward+backward time is affine in its batch, fitted
  from profiles at two batch sizes on this machine; a stage's microbatch takes the
  sum over its calls, one third forward and two thirds backward;
- pipeline: the schedule is played by `schedule.simulate` with those per-stage times,
  each message adding alpha + bytes * beta on the sending stage;
- gradients: a ring allreduce over the R replicas, 2 (R-1)/R * bytes * beta +
  2 (R-1) alpha, then the optimizer step (measured per parameter byte);
- memory per rank: the stage's weights and optimizer state plus the activations of
  the microbatches in flight (M with GPipe, S - s with 1F1B);
- tensor parallelism (T ranks per stage): a split layer's compute, weights and
  optimizer state are divided by T; each split call adds, per microbatch, an exchange
  between the T ranks forward and one backward ((T - 1) messages of its part, or of the
  whole output for a sum).

alpha and beta are measured with MPI (a ping-pong between two ranks, and on one
node every ring size with all the plan's ranks running: `measure_groups`) or given
(`--latency`, `--bandwidth`), which also projects a plan onto a cluster this machine
is not (`--nodes`, `--ranks-per-node`).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

__all__ = ["main", "Network", "predict", "search", "measure_network", "parse_bytes"]

UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
         "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "t": 1e12, "tb": 1e12}


def parse_bytes(text):
    """'12.5GB' -> 12.5e9; '4GiB' -> 4 * 2**30; a plain number is bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)(/s)?\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"Cannot read {text!r} as bytes (e.g. 4GB, 512MiB, 12.5GB/s).")
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def parse_seconds(text):
    match = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us|ns)?\s*", str(text))
    if not match:
        raise ValueError(f"Cannot read {text!r} as a time (e.g. 2us, 0.5ms).")
    return float(match.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1}[match.group(2)]


class Network:
    """alpha (seconds per message) and beta (seconds per byte) within and across nodes.

    `groups`: {g: (alpha, beta)} per round of a ring over g ranks, measured on this
    node with every rank of the plan running (`measure_groups`). They replace the
    two-rank figures for collectives of g ranks: with more ranks than cores, each
    round waits for its peers to be scheduled, which a two-rank ping-pong never sees."""

    def __init__(self, alpha, beta, alpha_inter=None, beta_inter=None, groups=None):
        self.alpha, self.beta = alpha, beta
        self.alpha_inter = alpha if alpha_inter is None else alpha_inter
        self.beta_inter = beta if beta_inter is None else beta_inter
        self.groups = dict(groups or {})

    def _terms(self, across, ranks=None):
        if across:
            return self.alpha_inter, self.beta_inter
        return self.groups.get(ranks, (self.alpha, self.beta))

    def message(self, nbytes, across=False, ranks=None):
        """One message, between two of `ranks` ranks that run together (default two)."""
        a, b = self._terms(across, ranks)
        return a + nbytes * b

    def allreduce(self, nbytes, ranks, across=False):
        if ranks <= 1:
            return 0.0
        a, b = self._terms(across, ranks)
        return 2 * (ranks - 1) / ranks * nbytes * b + 2 * (ranks - 1) * a


def _mpi_lines(ranks, function, prefix):
    from .launch import find_mpiexec

    mpiexec = find_mpiexec(os.environ)
    if not mpiexec:
        raise ValueError("No mpiexec to measure the network with; give --latency and --bandwidth.")
    out = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-c",
                          f"from hyparflow.planner import {function}; {function}()"],
                         capture_output=True, text=True, timeout=600)
    lines = [l.split()[1:] for l in out.stdout.splitlines() if l.startswith(prefix + " ")]
    if out.returncode or not lines:
        raise RuntimeError(f"network measurement failed: {out.stderr[-2000:]}")
    return lines


def measure_network(ranks=None):
    """alpha, beta from a ping-pong of two ranks under this venv's mpiexec; with
    `ranks`, also each ring size's own alpha and beta (`measure_groups`)."""
    alpha, beta = map(float, _mpi_lines(2, "_ping_pong", "ALPHA_BETA")[-1])
    return Network(alpha, beta, groups=measure_groups(ranks) if ranks and ranks >= 2 else None)


def measure_groups(ranks):
    """{g: (alpha, beta) per ring round} for every g > 1 dividing `ranks`: all `ranks`
    processes start on this node, split into rings of g, and sum buffers at once with
    hyparflow's own allreduce (buckets, ring and waits), as the replicas of a plan do."""
    groups = {}
    for g, alpha, beta in _mpi_lines(ranks, "_group_allreduce", "GROUP"):
        groups[int(g)] = (float(alpha), float(beta))
    return groups


def _group_allreduce():
    import numpy as np
    from mpi4py import MPI

    from .comm import MPICommunicator, wait_all
    from .overlap import BUCKET_BYTES

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    small, large = 64 << 10, 32 << 20
    for g in [g for g in range(2, size + 1) if size % g == 0]:
        comm = MPICommunicator(world.Split(rank // g, rank))
        times = {}
        for nbytes in (small, large):
            buf = np.ones(nbytes // 4, np.float32)
            parts = np.array_split(buf, max(1, nbytes // BUCKET_BYTES))
            runs = []
            for _ in range(5):
                world.Barrier()
                start = time.perf_counter()
                wait_all([comm.iallreduce(p) for p in parts])
                runs.append(time.perf_counter() - start)
            times[nbytes] = sorted(runs)[2]
        comm.free()
        rounds = 2 * (g - 1)
        alpha = times[small] / rounds
        beta = max(times[large] - times[small], 0.0) / (rounds / g * (large - small))
        if rank == 0:
            print(f"GROUP {g} {alpha:.3e} {max(beta, 1e-12):.3e}", flush=True)


def _ping_pong():
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    points = []
    for nbytes in (8, 1 << 20, 16 << 20):
        buf = np.zeros(max(1, nbytes // 4), np.float32)
        reps = 50 if nbytes < (1 << 20) else 10
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                comm.Send(buf, peer)
                comm.Recv(buf, peer)
            else:
                comm.Recv(buf, peer)
                comm.Send(buf, peer)
        points.append((buf.nbytes, (time.perf_counter() - start) / reps / 2))
    if rank == 0:
        alpha = points[0][1]
        beta = (points[-1][1] - points[1][1]) / (points[-1][0] - points[1][0])
        print(f"ALPHA_BETA {alpha:.3e} {max(beta, 1e-12):.3e}", flush=True)


def profile_model(graph, model, batches=(8, 32)):
    """Per layer call: (intercept s, slope s/sample, param bytes, optimizer bytes,
    activation bytes/sample), from profiles at two batch sizes; and the optimizer
    step's seconds per parameter byte."""
    import numpy as np
    import tensorflow as tf

    from .profile import profile

    small, large = (profile(graph, model, batch=b, repeats=3) for b in batches)
    rows = []
    for p, q in zip(small, large):
        slope = max(0.0, (q.seconds - p.seconds) / (batches[1] - batches[0]))
        rows.append((max(0.0, p.seconds - slope * batches[0]), slope, p.param_bytes,
                     p.optimizer_bytes, p.activation_bytes))
    rows = _calibrate(graph, model, rows, batches[1])
    variables = model.trainable_weights
    probe = model.optimizer.__class__.from_config(model.optimizer.get_config())
    copies = [tf.Variable(v.numpy()) for v in variables]
    grads = [tf.zeros_like(v) for v in copies]
    step = tf.function(lambda: probe.apply(grads, copies))
    step()
    start = time.perf_counter()
    for _ in range(3):
        step()
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in variables) or 1
    return rows, (time.perf_counter() - start) / 3 / nbytes


def _calibrate(graph, model, rows, batch):
    """Scale the per-call profiles (eager, one call at a time) so that they add up to
    the model's measured compiled forward+backward: stages run compiled, with less
    overhead per call than the profiles see."""
    import tensorflow as tf

    from .profile import _dummy

    xs = [_dummy(graph.tensors[t], batch) for t in graph.inputs]
    variables = model.trainable_weights

    @tf.function
    def step(xs):
        with tf.GradientTape() as tape:
            out = model(xs[0] if len(xs) == 1 else xs, training=True)
            flat = [o for o in tf.nest.flatten(out) if o.dtype.is_floating]
            target = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in flat])
        return tape.gradient(target, variables)

    step(xs)
    start = time.perf_counter()
    for _ in range(3):
        step(xs)
    measured = (time.perf_counter() - start) / 3
    profiled = sum(r[0] + r[1] * batch for r in rows)
    factor = min(1.0, measured / profiled) if profiled > 0 else 1.0
    return [(a * factor, b * factor, *rest) for a, b, *rest in rows]


def _elements(graph, t):
    from .graph import numel

    return numel(graph.tensors[t].shape)


def _tensor_costs(graph, num_tensor, m, network):
    """{node: (compute divisor, forward exchange s, backward exchange s)} of the calls
    `num_tensor` ranks would split (the default choice: by size)."""
    from . import tensor as T

    if num_tensor == 1:
        return {}
    out = {}
    for i, split in T.choose(graph, range(len(graph.nodes)), num_tensor).items():
        node = graph.nodes[i]
        out_bytes, in_bytes = (4 * m * _elements(graph, t) for t in (node.outputs[0], node.inputs[0]))
        peers, T = num_tensor - 1, num_tensor
        if split.kind in ("row", "rows"):
            forward = peers * network.message(out_bytes, ranks=T)   # a sum of whole outputs
        elif split.gather:
            forward = peers * network.message(out_bytes / num_tensor, ranks=T)
        else:
            forward = 0.0                                       # its row partner sums
        backward = (peers * network.message(in_bytes, ranks=T)
                    if split.kind in ("column", "filters") else 0.0)
        out[i] = (num_tensor, forward, backward)
    return out


def predict(graph, rows, opt_per_byte, network, counts, batch, replicas, micro, schedule,
            ranks_per_node=None, cores=None, num_tensor=1):
    """Predicted step time and its parts, and peak memory per stage, for one plan.

    `cores`: cores per node; when a node runs more ranks than it has cores, every
    computation takes that many times longer (the ranks share the cores)."""
    from . import schedule as sched
    from .partition import partition

    stages = len(counts)
    part = partition(graph, stages, counts)
    m = batch / (replicas * micro)
    on_node = ranks_per_node or stages * replicas * num_tensor
    share = max(1.0, on_node / cores) if cores else 1.0
    starts = [sum(counts[:s]) for s in range(stages)]
    split = _tensor_costs(graph, num_tensor, m, network)
    div = lambda i: split[i][0] if i in split else 1  # noqa: E731
    compute = [share * sum((rows[i][0] + rows[i][1] * m) / div(i) for i in range(a, a + c))
               for a, c in zip(starts, counts)]
    exchange_f = [sum(split[i][1] for i in range(a, a + c) if i in split)
                  for a, c in zip(starts, counts)]
    exchange_b = [sum(split[i][2] for i in range(a, a + c) if i in split)
                  for a, c in zip(starts, counts)]
    send = [0.0] * stages
    for e in part.edges:
        send[e.src] += network.message(_elements(graph, e.tensor) * 4 * m)
    per_stage_f = [c / 3 + s + x for c, s, x in zip(compute, send, exchange_f)]
    per_stage_b = [2 * c / 3 + s + x for c, s, x in zip(compute, send, exchange_b)]
    lowered = sched.lower(sched.build(schedule, stages, micro),
                          [p.sources for p in part.stages], [p.dests for p in part.stages])
    sim = sched.simulate(lowered, per_stage_f, per_stage_b)
    params = [sum(rows[i][2] / div(i) for i in range(a, a + c)) for a, c in zip(starts, counts)]
    across = ranks_per_node is not None and ranks_per_node < stages * replicas * num_tensor
    reduce = [network.allreduce(p, replicas, across) + share * p * opt_per_byte for p in params]
    step = sim.makespan + max(reduce)
    memory = []
    for s, (a, c) in enumerate(zip(starts, counts)):
        in_flight = micro if schedule == "gpipe" else min(stages - s, micro)
        memory.append(sum((rows[i][2] + rows[i][3]) / div(i) for i in range(a, a + c)) +
                      sum(rows[i][4] for i in range(a, a + c)) * m * in_flight)
    return {"step_s": step, "pipeline_s": sim.makespan, "bubble": sim.bubble,
            "comm_s": max(s + f + b for s, f, b in zip(send, exchange_f, exchange_b)) * micro
            + max(network.allreduce(p, replicas, across) for p in params),
            "tensor_layers": sorted(graph.nodes[i].op.name for i in split),
            "memory_bytes": memory, "samples_s": batch / step}


def search(graph, rows, opt_per_byte, network, batch, ranks, memory_limit=None,
           microbatches=(1, 2, 4, 8, 16), schedules=("gpipe", "1f1b"), ranks_per_node=None,
           cores=None, tensor=(1, 2, 4)):
    """Every plan for `ranks` ranks, predicted, best first (plans over the memory
    limit last). `tensor`: the numbers of tensor ranks per stage to try (only those
    that split some layer)."""
    from . import balance as B
    from . import tensor as T

    shapes = []
    for t in tensor:
        if ranks % t == 0 and (t == 1 or T.choose(graph, range(len(graph.nodes)), t)):
            shapes += [(s, t) for s in range(1, ranks // t + 1)
                       if (ranks // t) % s == 0 and s <= len(graph.nodes)]
    plans = []
    for stages, num_tensor in shapes:
        replicas = ranks // (stages * num_tensor)
        for micro in microbatches:
            if batch < replicas * micro:
                continue
            m = batch / (replicas * micro)
            costs = [r[0] + r[1] * m for r in rows]
            counts = B.solve(costs, stages)
            for schedule in (schedules if stages > 1 else ("1f1b",)):
                p = predict(graph, rows, opt_per_byte, network, counts, batch, replicas, micro,
                            schedule, ranks_per_node, cores, num_tensor)
                p.update(stages=stages, tensor=num_tensor, replicas=replicas, microbatches=micro,
                         schedule=schedule, counts=counts,
                         fits=memory_limit is None or max(p["memory_bytes"]) <= memory_limit)
                plans.append(p)
    return sorted(plans, key=lambda p: (not p["fits"], p["step_s"]))


def _load_model(source, function):
    import keras

    if source.endswith(".keras"):
        return keras.saving.load_model(source)
    namespace = {"__name__": "hyparflow_plan_model", "__file__": source}
    with open(source) as f:
        exec(compile(f.read(), source, "exec"), namespace)  # the user's own model file
    if function not in namespace:
        raise ValueError(f"{source} defines no function {function!r} (use --function NAME).")
    return namespace[function]()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hyparflow plan", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .keras file, or a Python file with a function that "
                                      "returns a compiled model")
    parser.add_argument("--function", default="build_model")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--ranks", type=int, help="ranks to plan for (default nodes x ranks-per-node)")
    parser.add_argument("--memory-per-rank", help="e.g. 4GB; plans over it are marked")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--ranks-per-node", type=int)
    parser.add_argument("--bandwidth", help="e.g. 12.5GB/s (default: measured with MPI here)")
    parser.add_argument("--latency", help="e.g. 2us (default: measured with MPI here)")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores per node (ranks beyond them share cores)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                        choices=["gpipe", "1f1b"])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", help="write every ranked plan here")
    parser.add_argument("--profile-cache", help="reuse (or write) the layer profiles here: "
                                                "profile once, plan for many clusters")
    parser.add_argument("--output", help="write the best plan that fits here (JSON)")
    args = parser.parse_args(argv)
    from . import _env
    _env.start_tensorflow()
    from . import graph as G
    from . import plan as P

    model = _load_model(args.model, args.function)
    graph = G.from_model(model)
    ranks = args.ranks or args.nodes * (args.ranks_per_node or 1)
    if args.bandwidth or args.latency:
        here = measure_network() if not (args.bandwidth and args.latency) else None
        network = Network(parse_seconds(args.latency) if args.latency else here.alpha,
                          1 / parse_bytes(args.bandwidth) if args.bandwidth else here.beta)
    else:
        network = measure_network(ranks if args.nodes == 1 else None)
    print(f"network: alpha {network.alpha * 1e6:.2f} us, bandwidth {1 / network.beta / 1e9:.2f} GB/s",
          flush=True)
    for g, (alpha, beta) in sorted(network.groups.items()):
        print(f"  rings of {g} of the {ranks} ranks: {alpha * 1e6:.1f} us per round, "
              f"{1 / beta / 1e9:.2f} GB/s", flush=True)
    if args.profile_cache and os.path.exists(args.profile_cache):
        with open(args.profile_cache) as f:
            cached = json.load(f)
        if len(cached["rows"]) != len(graph.nodes):
            raise ValueError(f"{args.profile_cache} profiles another model.")
        rows, opt_per_byte = [tuple(r) for r in cached["rows"]], cached["optimizer_s_per_byte"]
    else:
        print(f"profiling {len(graph.nodes)} layer calls of {model.name} ...", flush=True)
        rows, opt_per_byte = profile_model(graph, model)
        if args.profile_cache:
            with open(args.profile_cache, "w") as f:
                json.dump({"rows": rows, "optimizer_s_per_byte": opt_per_byte}, f)
    limit = parse_bytes(args.memory_per_rank) if args.memory_per_rank else None
    plans = search(graph, rows, opt_per_byte, network, args.batch_size, ranks, limit,
                   microbatches=args.microbatches, schedules=args.schedules,
                   ranks_per_node=args.ranks_per_node if args.nodes > 1 else None,
                   cores=args.cores if args.nodes == 1 else None)
    one = [p for p in search(graph, rows, opt_per_byte, network, args.batch_size, 1,
                             tensor=(1,))][0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plans": plans, "one_rank": one}, f, indent=1)
    print(f"\n{'rank':>4} {'S':>3} {'T':>2} {'R':>4} {'M':>3} {'schedule':>8} {'step s':>9} {'samples/s':>10} "
          f"{'speed-up':>8} {'bubble':>6} {'comm s':>8} {'peak MB/rank':>12} fits")
    for k, p in enumerate(plans[:args.top], 1):
        print(f"{k:>4} {p['stages']:>3} {p['tensor']:>2} {p['replicas']:>4} {p['microbatches']:>3} {p['schedule']:>8} "
              f"{p['step_s']:>9.4f} {p['samples_s']:>10.1f} {one['step_s'] / p['step_s']:>8.2f} "
              f"{p['bubble']:>6.3f} {p['comm_s']:>8.4f} {max(p['memory_bytes']) / 2**20:>12.1f} "
              f"{'yes' if p['fits'] else 'no'}")
    print(f"\nscaling efficiency of the best plan: "
          f"{one['step_s'] / plans[0]['step_s'] / ranks:.2f} ({ranks} ranks)")
    if args.output:
        best = next((p for p in plans if p["fits"]), plans[0])
        P.write(args.output, graph, best["counts"], best["replicas"], best["microbatches"],
                best["schedule"], predicted={k: best[k] for k in ("step_s", "bubble", "comm_s",
                                                                 "samples_s")},
                num_tensor=best["tensor"], tensor_layers=best["tensor_layers"] or None)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
