"""What the planner measures under this venv's mpiexec, with the plan's ranks running
on this node: the network (a two-rank ping-pong; hyparflow's own allreduce in rings
of every size) and compute (the model's compiled step with 1, 2, ... of the ranks
computing at once, and the optimizer step with all of them).

Each function here runs `ranks` processes and reads back the lines rank 0 prints;
the cost model that uses the numbers is `planner`'s.
"""

import os
import subprocess
import sys
import time

__all__ = ["ping_pong", "rings", "compute", "stage_costs", "StageTimer", "tensor_stages"]

# A pipeline stage's call follows a wait for its input, and on this host a compiled
# call after 5-70 ms asleep took 4-7% longer than the same call back to back (the
# median of 36 each: 7.0 ms back to back, 7.3-7.5 ms after a sleep). The stages of
# a pipeline are timed each call after this long asleep, as they run.
IDLE = 0.01


def _mpi_lines(ranks, function, prefix, *args, hosts=None):
    from .launch import find_mpiexec

    mpiexec = find_mpiexec(os.environ)
    if not mpiexec:
        raise ValueError("No mpiexec to measure this machine with; give --latency and "
                         "--bandwidth.")
    where = ["-hosts", hosts] if hosts else []
    out = subprocess.run([mpiexec, *where, "-n", str(ranks), sys.executable, "-c",
                          f"from hyparflow.measure import {function}; {function}(*{args!r})"],
                         capture_output=True, text=True, timeout=1200)
    lines = [l.split()[1:] for l in out.stdout.splitlines() if l.startswith(prefix + " ")]
    if out.returncode or not lines:
        raise RuntimeError(f"measurement under mpiexec failed: {out.stderr[-2000:]}")
    return lines


def ping_pong(hosts=None):
    """(alpha s, beta s/byte) between two ranks: here, or on `hosts` ("h1:2" for two
    ranks within host h1, "h1:1,h2:1" for the link between h1 and h2)."""
    alpha, beta = map(float, _mpi_lines(2, "_ping_pong", "ALPHA_BETA", hosts=hosts)[-1])
    return alpha, beta


def rings(ranks):
    """For every g > 1 dividing `ranks`, all `ranks` processes started on this node and
    split into groups of g: ({g: (alpha, beta) per ring round}, {g: (alpha, beta) per
    exchange}, wait). Rings sum buffers with hyparflow's own allreduce (buckets, ring
    and waits), as the replicas of a plan do; exchanges are a split layer's sum
    (`tensor.Collectives.sum`) inside a compiled function, as tensor ranks do. `wait`:
    seconds from a send until a rank that waited for it has it, with the other ranks
    computing (`_wait`)."""
    found, wait = {"GROUP": {}, "EXCHANGE": {}}, 0.0
    for kind, *values in _mpi_lines(ranks, "_rings", "MEASURED"):
        if kind == "WAIT":
            wait = float(values[0])
        else:
            g, a, b = values
            found[kind][int(g)] = (float(a), float(b))
    return found["GROUP"], found["EXCHANGE"], wait


def compute(ranks, source, function, batches):
    """The model's compiled forward and backward with the plan's ranks on this node
    (each with the threads a rank of the plan gets): {n: {batch: seconds}} with n of
    them computing at once, n = 1 .. ranks; and seconds per parameter byte of the
    optimizer step with all of them stepping at once. Ranks that share cores or
    memory bandwidth slow each other down; this is how much, for this model."""
    times, optimizer = {}, None
    for kind, *values in _mpi_lines(ranks, "_compute", "COMPUTE", source, function,
                                    list(batches)):
        if kind == "optimizer":
            optimizer = float(values[0])
        else:
            times.setdefault(int(kind), {})[int(values[0])] = float(values[1])
    return times, optimizer


def stage_costs(graph, model, rows, batches, repeats=5):
    """What a stage pays besides its layers' fused forward and backward, measured in
    this process on hyparflow's own `Stage` (all the model's calls but the last, which
    is how every stage but a fused last one runs): `taped`, how many times longer
    than those layers' share of the model's compiled step its forward and backward
    take (a separate compiled forward kept on a tape, the backward from it, the
    gradients summed into the stage's buffers), and `forward`, the forward's share.
    None for a model of one call. The last stage adds only the summing, at
    `add_s_per_byte`."""
    import numpy as np

    from . import profile
    from .partition import partition
    from .stage import Stage

    n = len(graph.nodes)
    if n < 2:
        return None
    buf = np.zeros(1 << 22, np.float32)
    out = {"batches": list(batches), "taped": [], "forward": [],
           "add_s_per_byte": profile.timed(lambda: np.add(buf, buf, out=buf), repeats) / buf.nbytes}
    part = partition(graph, 2, [n - 1, 1])
    stage = Stage(graph, part.stages[0], model, part, is_last=False)
    for b in batches:
        # Those layers' share of the fused step: `rows` were fitted to the model's
        # compiled step at these very batch sizes (`profile.fit_model`).
        fused = sum(r[0] + r[1] * b for r in rows[:-1])
        ahead, whole = _taped(stage, b, repeats)
        out["taped"].append(max(1.0, whole / max(fused, 1e-12)))
        out["forward"].append(min(0.9, ahead / whole))
    return out


def _taped(stage, batch, repeats, idle=0.0):
    """(forward, forward and backward) seconds of `stage` on `batch` random samples, as
    the executor runs it: the forward kept on a tape, the backward from it with the
    gradients of its outputs (ones), the weights' gradients summed into its buffers."""
    import numpy as np

    from . import profile

    graph = stage.graph
    import tensorflow as tf

    inputs = [profile._dummy(graph.tensors[t], batch) for t in stage.input_ids]
    inputs += [tf.ones((batch,) + tuple(d or 8 for d in graph.tensors[t].mask[1:]), tf.bool)
               for t in stage.mask_ids]
    seeds = {t: np.ones((batch,) + tuple(d or 8 for d in graph.tensors[t].shape[1:]), np.float32)
             for t in stage.output_ids if graph.tensors[t].floating}

    def forward():
        stage.forward(0, inputs)

    def both():
        stage.forward(0, inputs)
        stage.backward(0, seeds)
        stage.reset_grads()

    both()
    whole = profile.timed(both, repeats, idle) * profile.slowdown()
    ahead = profile.timed(forward, repeats, idle) * profile.slowdown()
    stage._saved.clear()
    return ahead, whole


class StageTimer:
    """Each stage of a plan timed as hyparflow runs it: its layers compiled into a
    `Stage`, forward kept on a tape and backward from it, or both in one call for a
    last stage under 1F1B, the gradients summed into its buffers. Layer profiles
    share the model's step out among its calls only roughly (one eager call at a
    time), and a stage pays more than its calls' share (its own compiled calls, the
    tape, the sums); this times the whole.

    `timer(counts, s, m, fused)` -> (forward, backward) seconds of stage `s` of a
    partition into `counts` on `m` samples: measured at the two `batches` and
    interpolated between them, each stage (first call, length, fused) in two passes
    over all of them (`prepare`), in this process. A last stage is timed with the sum
    of its outputs for the loss, as `profile.model_step` times the whole model: the
    planner has no targets to feed the user's loss.

    `timer(counts, s, m, fused, num_tensor)`, with the model's `source` and
    `function` and the plan's `ranks` given: stage `s` with its layers split over
    `num_tensor` ranks, timed under mpiexec (`tensor_stages`), its split layers'
    exchanges included, as they run inside the compiled stage, between ranks that
    share this node's cores: (forward, backward) with all `ranks` running it at once
    in groups of `num_tensor`, then (forward, backward) with one group running it.
    `prepare` times many such stages in one run."""

    def __init__(self, graph, model, batches, repeats=9, source=None, function=None,
                 ranks=None):
        # The median of 9 calls: a stage's call of a few milliseconds varied twofold
        # over 5 on this shared host (other machines' spells take its cores).
        self.graph, self.model, self.repeats = graph, model, repeats
        self.batches = sorted(set(int(b) for b in batches))
        self.source, self.function, self.ranks = source, function, ranks
        self._cache = {}

    @property
    def splits(self):
        """Whether stages with split layers can be timed (under mpiexec) here."""
        return self.source is not None and bool(self.ranks)

    def key(self, counts, s, fused, num_tensor=1):
        return sum(counts[:s]), counts[s], len(counts) - 1 == s, bool(fused), num_tensor

    def prepare(self, wanted, sweeps=2):
        """Time every (counts, s, fused, num_tensor) of `wanted` not timed yet: the
        stages with split layers in one run under mpiexec; the others here, in
        `sweeps` passes over all of them, each stage's faster pass kept. This host's
        slow spells last seconds, longer than a stage's nine calls: timed in one go,
        the same pipeline of 2 stages came out 0.058 to 0.084 s from one planner run
        to the next."""
        keys = {self.key(c, s, f, t) for c, s, f, t in wanted}
        keys = sorted(k for k in keys if k not in self._cache)
        split = [k for k in keys if k[-1] > 1]
        if split:
            self._cache.update(tensor_stages(self.ranks, self.source, self.function,
                                             self.batches, split, self.repeats))
        stages = {k: _stage_for(self.graph, self.model, k) for k in keys if k[-1] == 1}
        for _ in range(sweeps):
            for key, stage in stages.items():
                found = [_stage_time(stage, key[3], b, self.repeats, IDLE) for b in self.batches]
                known = self._cache.get(key, found)
                self._cache[key] = [min(a, b, key=sum) for a, b in zip(known, found)]

    def __call__(self, counts, s, m, fused, num_tensor=1):
        key = self.key(counts, s, fused, num_tensor)
        if key not in self._cache:
            self.prepare([(counts, s, fused, num_tensor)])
        points = self._cache[key]
        if len(points) == 1:
            return points[0]
        x = (self.batches[0], self.batches[-1])
        return tuple(_between(x, (points[0][k], points[-1][k]), m)
                     for k in range(len(points[0])))


def _stage_for(graph, model, key, shards=None):
    """hyparflow's `Stage` for the stage `key` (`StageTimer.key`: its first call, how
    many, whether it is the last); with `shards`, its split layers' parts
    (`tensor.shard`)."""
    from .partition import partition
    from .stage import Stage

    first, count, last = key[:3]
    counts = [c for c in (first, count, len(graph.nodes) - first - count) if c]
    part = partition(graph, len(counts), counts)
    plan = part.stages[1 if first else 0]
    stage = Stage(graph, plan, model, part, is_last=False, shards=shards)
    if last:
        stage.output_ids = list(plan.outputs)  # the model's outputs: the loss's inputs
    return stage


def _stage_time(stage, fused, batch, repeats, idle=0.0):
    """(forward, backward) seconds of `stage` on `batch` samples: taped, or in one
    call (`fused`); each call after `idle` seconds asleep."""
    import tensorflow as tf

    from . import profile

    graph = stage.graph
    if not fused:
        ahead, total = _taped(stage, batch, repeats, idle)
        ahead = min(ahead, total)
        return ahead, total - ahead
    inputs = [profile._dummy(graph.tensors[t], batch) for t in stage.input_ids]
    diff = stage._diff
    sources = list(stage.trainable)

    @tf.function
    def both(xs):
        with tf.GradientTape() as tape:
            for k in diff:
                tape.watch(xs[k])
            outs, contribution = stage._compute(xs, [], [], tf.constant(1.0), "train")
            target = contribution + tf.add_n(
                [tf.reduce_sum(tf.cast(o, tf.float32)) for o in outs
                 if o.dtype.is_floating] or [tf.zeros(())])
        return tape.gradient(target, sources + [xs[k] for k in diff],
                             unconnected_gradients=tf.UnconnectedGradients.NONE)

    def step():
        stage._ready()
        stage._accumulate(both(inputs), [inputs[k] for k in diff])
        stage.reset_grads()

    step()
    return 0.0, profile.timed(step, repeats, idle) * profile.slowdown()


def tensor_stages(ranks, source, function, batches, keys, repeats=5):
    """{key: [(forward, backward, forward alone, backward alone) seconds at each of
    `batches`]} for stages `keys` (`StageTimer.key`) whose layers are split over their
    tensor ranks: `ranks` processes on this node run each stage at once, in groups of
    its tensor ranks, as the ranks of a plan with that many tensor ranks per stage
    do; then one group runs it, the other ranks waiting as pipeline stages wait (a
    stage of a pipeline runs while the others wait for it)."""
    found = {}
    for k, b, *times in _mpi_lines(ranks, "_tensor_stages", "STAGE", source, function,
                                   list(batches), [list(k) for k in keys], repeats):
        key = keys[int(k)]
        found.setdefault(key, {})[int(b)] = tuple(float(t) for t in times)
    return {key: [found[key][b] for b in sorted(found[key])] for key in found}


def _tensor_stages(source, function, batches, keys, repeats):
    from . import _env

    _env.start_tensorflow()
    from mpi4py import MPI

    from . import graph as G
    from . import profile
    from . import tensor as T
    from .comm import MPICommunicator

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    model = profile.load_model(source, function)
    graph = G.from_model(model)
    for index, key in enumerate(keys):
        first, count, last, fused, num_tensor = key = tuple(key)
        comm = MPICommunicator(world.Split(rank // num_tensor, rank))
        collectives = T.Collectives(comm)
        shares = T.shares_of(None, num_tensor)
        nodes = range(first, first + count)
        shards = {i: T.shard(graph.nodes[i].op, split, comm.rank, shares, collectives)
                  for i, split in T.choose(graph, nodes, num_tensor).items()}
        stage = _stage_for(graph, model, key, shards)
        for b in batches:
            # Every group times its calls at the same time: each call exchanges with
            # the group, so all its ranks make the same number of them.
            _idle_barrier(world)
            every = world.allgather(_stage_time(stage, fused, b, repeats))
            _idle_barrier(world)
            # Then group 0 alone, the other ranks waiting for it.
            one = _stage_time(stage, fused, b, repeats) if rank < num_tensor else None
            _waiting(world.Ibarrier())
            alone = [t for t in world.allgather(one) if t is not None]
            if rank == 0:
                mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
                print(f"STAGE {index} {b} {mean(every, 0):.6e} {mean(every, 1):.6e} "
                      f"{mean(alone, 0):.6e} {mean(alone, 1):.6e}", flush=True)
        comm.free()


def _between(points, values, x):
    """`values` at `points` (two batch sizes), linear in between and beyond (a stage's
    time is affine in its batch), never below a tenth of the nearer one."""
    (x0, x1), (y0, y1) = points, values
    if x1 == x0:
        return y0
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 0.1 * (y0 if x < x0 else y1 if x > x1 else min(y0, y1)))


def _idle_barrier(world):
    """A barrier that sleeps while it waits, leaving the cores to the ranks that work."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def _waiting(done, stretch=0.02):
    """Wait for request `done` as a pipeline stage waits for its next message: polls
    that back off to 1 ms sleeps (`comm._poll`), starting over every `stretch`
    seconds as a stage's waits do, each of whose wake-ups takes a core for a moment
    from the ranks that compute."""
    from .comm import _poll

    while not done.Test():
        until = time.monotonic() + stretch
        _poll(lambda: done.Test() or time.monotonic() > until, None, "a measurement", 0.0)


def _together(world, busy, fn, repeats=5, window=0.3):
    """Seconds per call of `fn` on ranks 0 .. busy-1 running it at the same time (one
    untimed call first, so the timed ones all overlap), while the other ranks wait
    as pipeline stages do (`_waiting`): the slowest of those ranks' mean call over at
    least `repeats` calls and `window` seconds, since a step waits for its slowest
    rank at every message and allreduce. The window, not a few calls: more ranks
    than cores take turns in time slices of a few milliseconds, so a short call
    runs now alone, now shared, and a handful of them said anything from 2x to 4x
    for four ranks on two cores from one run to the next. A rank done with its
    timed calls goes on calling `fn` until every busy rank is done: time-slicing
    lets some ranks finish first, and the others, left with the cores to
    themselves, would time less contention than a training step has."""
    _idle_barrier(world)
    mine = None
    if world.Get_rank() < busy:
        fn()
        calls, start = 0, time.perf_counter()
        while calls < repeats or time.perf_counter() - start < window:
            fn()
            calls += 1
        mine = (time.perf_counter() - start) / calls
        done = world.Ibarrier()
        while not done.Test():
            fn()
    else:
        _waiting(world.Ibarrier())
    _idle_barrier(world)  # MPICH's blocking calls spin: the last ones would lose cores
    return max(t for t in world.allgather(mine) if t is not None)


def _compute(source, function, batches, sweeps=2):
    from . import _env

    _env.start_tensorflow()  # the threads a rank of the plan gets on this node
    from mpi4py import MPI

    from . import graph as G
    from . import profile

    world = MPI.COMM_WORLD
    model = profile.load_model(source, function)
    graph = G.from_model(model)
    steps = {b: profile.model_step(graph, model, b) for b in batches}
    rank0 = world.Get_rank() == 0
    # Two sweeps, the faster of each kept: this node's cores are shared with other
    # machines, which slow everything on it for seconds at a time, and one sweep
    # caught in such a spell would skew the slowdowns it gives the others.
    found = {}
    for _ in range(sweeps):
        for busy in range(1, world.Get_size() + 1):
            for b, fn in steps.items():
                seconds = _together(world, busy, fn) * profile.slowdown()
                found[busy, b] = min(found.get((busy, b), seconds), seconds)
    if rank0:
        for (busy, b), seconds in sorted(found.items()):
            print(f"COMPUTE {busy} {b} {seconds:.6e}", flush=True)
    if getattr(model, "optimizer", None) is not None:
        step, nbytes = profile.optimizer_step(model)
        seconds = min(_together(world, world.Get_size(), step) for _ in range(sweeps))
        if rank0:
            print(f"COMPUTE optimizer {seconds / nbytes:.6e}", flush=True)


def _rings():
    from . import _env

    _env.start_tensorflow()
    import numpy as np
    from mpi4py import MPI

    from .comm import MPICommunicator, wait_all
    from .overlap import BUCKET_BYTES

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    small, large = 64 << 10, 32 << 20
    work = _fixed_work()
    for g in [g for g in range(2, size + 1) if size % g == 0]:
        comm = MPICommunicator(world.Split(rank // g, rank))
        times = {}
        for nbytes in (small, large):
            buf = np.ones(nbytes // 4, np.float32)
            parts = np.array_split(buf, max(1, nbytes // BUCKET_BYTES))
            # The allreduce as a step meets it: right after the same computation on
            # every rank, which ranks sharing cores finish at different moments, the
            # ring waiting for the last. Its cost is what it adds to that computation.
            runs = {False: [], True: []}
            for _ in range(5):
                for reduce in (False, True):
                    world.Barrier()
                    start = time.perf_counter()
                    work()
                    if reduce:
                        wait_all([comm.iallreduce(p) for p in parts])
                    runs[reduce].append(time.perf_counter() - start)
            times[nbytes] = max(sorted(runs[True])[2] - sorted(runs[False])[2], 1e-6)
        rounds = 2 * (g - 1)
        alpha = times[small] / rounds
        beta = max(times[large] - times[small], 0.0) / (rounds / g * (large - small))
        if rank == 0:
            print(f"MEASURED GROUP {g} {alpha:.3e} {max(beta, 1e-12):.3e}", flush=True)
        alpha, beta = _exchange(world, comm)
        if rank == 0:
            print(f"MEASURED EXCHANGE {g} {alpha:.3e} {max(beta, 1e-12):.3e}", flush=True)
        comm.free()
    wait = _wait(world)
    if rank == 0:
        print(f"MEASURED WAIT {wait:.3e}", flush=True)


def _fixed_work(calls=32):
    """The same computation on every rank (a fixed number of products: 20 ms alone
    here, about a step's compute), after which ranks meet in a collective."""
    import tensorflow as tf

    w = tf.random.normal((192, 192))
    step = tf.function(lambda a: tf.matmul(tf.matmul(tf.matmul(a, w), w), w) / 192.0)
    step(w).numpy()

    def work():
        for _ in range(calls):
            step(w).numpy()
    return work


def _wait(world, work=0.01, repeats=15):
    """Median seconds from a send until its receiver, which waited for it the way a
    pipeline stage does (`comm.wait_all`: polls that sleep when the node is
    oversubscribed), has it, while every other rank computes. With more ranks than
    cores the woken rank waits for a core as well as for its next poll; a pipeline
    pays this on every receive that waits, which a ping-pong between idle ranks never
    shows. Rank 0 computes `work` seconds, then sends to rank 1."""
    import numpy as np
    import tensorflow as tf

    from .comm import MPICommunicator, wait_all

    comm = MPICommunicator(world)
    rank = comm.rank
    x = tf.random.normal((128, 128))
    step = tf.function(lambda a: tf.matmul(a, a))
    step(x).numpy()

    def compute(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            step(x).numpy()

    stamp = np.zeros(1, np.float64)
    delays = []
    for i in range(repeats):
        comm.barrier()
        if rank == 0:
            compute(work)
            stamp[0] = time.perf_counter()  # one clock for every process of the node
            wait_all([comm.isend(stamp, 1, i)])
        elif rank == 1:
            wait_all([comm.irecv(stamp, 0, i)])
            delays.append(time.perf_counter() - stamp[0])
        else:
            compute(work * 1.5)  # busy for the whole wait
    found = comm.bcast_obj(sorted(delays)[len(delays) // 2] if rank == 1 else None, 1)
    comm.free()
    return found


def _exchange(world, comm, small=16 << 10, large=1 << 20, repeats=9):
    """(seconds, seconds per byte) a split layer's sum over `comm` adds to a compiled
    function that computes before it, as a stage does between two exchanges: the
    Python call, the messages, and the wait for the slowest peer, which on shared
    cores is as late as the scheduler makes it. Timed against the same function
    without the sum, both with every rank of the node running (back-to-back sums
    would time only ranks waiting for each other, not a step)."""
    import tensorflow as tf

    from . import profile
    from .tensor import Collectives

    collectives = Collectives(comm)
    w = tf.random.normal((192, 192))

    def work(x):
        y = w
        for _ in range(8):  # about a millisecond: a layer's worth of compute
            y = tf.matmul(y, w) / 192.0
        return x + y[0, 0] * 0.0

    alone = tf.function(work)
    summed = tf.function(lambda x: collectives.sum(work(x), "a measurement"))
    times = {}
    for nbytes in (small, large):
        x = tf.ones((nbytes // 4,))
        cost = {}
        for name, fn in (("alone", alone), ("summed", summed)):
            fn(x)
            world.Barrier()
            cost[name] = profile.timed(lambda: [fn(x) for _ in range(repeats)], 3) / repeats
        times[nbytes] = max(cost["summed"] - cost["alone"], 1e-6)
    return times[small], max(times[large] - times[small], 0.0) / (large - small)


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
