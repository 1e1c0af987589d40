"""One benchmark measurement (run by benchmarks/run.py): prints `RESULT {json}`.

    worker.py baseline WORKLOAD BATCH STEPS
    worker.py hf WORKLOAD BATCH STEPS S R M SCHEDULE TRACE.json [T]  (under mpiexec)
    worker.py transfer                                                (under mpiexec -n 2)
"""

import json
import resource
import statistics
import sys
import time

import hyparflow as hf
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import workloads  # noqa: E402


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def state_mb(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables) / 2**20


def baseline(workload, batch, steps):
    model, x, y = workloads.make(workload, batch * (steps + 1))
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # trace + warm up
    times = []
    model.fit(x[batch:], y[batch:], batch_size=batch, epochs=1, verbose=0, shuffle=False,
              callbacks=[workloads.BatchTimer(times)])
    step = statistics.median(times)
    state = state_mb(model.trainable_weights) + state_mb(model.optimizer.variables)
    return {"step_s": step, "samples_s": batch / step, "peak_mb": peak_mb(), "state_mb": state}


def hybrid(workload, batch, steps, s, r, m, schedule, trace, t=1, dtype=None):
    from hyparflow.engine import timeline

    model, x, y = workloads.make(workload, batch * (steps + 1))
    # "interleaved:2": the schedule and its model chunks per rank.
    name, _, chunks = schedule.partition(":")
    history = hf.fit(model, x, y, batch_size=batch, epochs=1, num_stages=s, num_replicas=r,
                     num_microbatches=m, schedule=name, verbose=0, shuffle=False, trace=trace,
                     num_tensor=t, num_chunks=int(chunks) if chunks else None,
                     communication_dtype=dtype)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    # This rank's parameters + optimizer state: the variables its optimizer steps (its
    # stage's, and only its parts of split layers) and the slots built for them.
    mine = state_mb(model.optimizer.variables) + state_mb(_stage_vars(model))
    peaks = comm.gather(peak_mb(), 0)
    # Bytes of floating values every rank sent per step: the replicas' gradient sums
    # (float32: a ring's share) and the pipeline boundaries (History.exchanges).
    ex = history.exchanges
    sent = comm.allreduce(ex["replicas"]["bytes"] + ex["stages"]["bytes"]) / (steps + 1)
    states = comm.gather(mine, 0)
    if comm.rank == 0:
        data = timeline.load(trace)
        rank_steps = {}
        # `auto` times each candidate schedule over its first steps, then marks its choice:
        # the steps after the marker are the chosen schedule's.
        chosen = [e["ts"] for e in data["traceEvents"]
                  if e.get("cat") == "step" and "times" in e.get("args", {})]
        for e in data["traceEvents"]:
            if e.get("cat") == "step" and "step" in e["args"] and e["ts"] >= max(chosen, default=0):
                rank_steps.setdefault(e["args"]["step"], []).append(e["dur"] / 1e6)
        per_step = [max(v) for k, v in sorted(rank_steps.items())]
        per_step = per_step[1:] if not chosen else per_step  # skip the traced first
        if not per_step:
            raise SystemExit(f"no step after auto's trials in {steps} steps: give --steps more")
        step = statistics.median(per_step)
        untraced, between = _untraced(data, min(chosen, default=0))
        # Gradient bytes rank 0 exchanged per step: its dense buckets and sparse pairs.
        sums = [e["args"].get("dense_bytes", 0) + e["args"].get("sparse_bytes", 0)
                for e in data["traceEvents"] if e.get("cat") == "allreduce" and e.get("tid") == 0]
        print("RESULT " + json.dumps({
            "stages": s, "replicas": r, "microbatches": m, "schedule": schedule, "tensor": t,
            "step_s": step, "samples_s": batch / step, "bubble": timeline.bubble(data),
            "theory_bubble": timeline.theoretical_bubble(
                s, m, int(schedule.partition(":")[2] or 1)), "peak_mb": peaks,
            "grad_mb": statistics.median(sums[1:] or sums or [0]) / 2**20,
            "state_mb": states, "untraced_s": untraced, "between_s": between,
            "dtype": dtype or "float32", "sent_mb": sent / 2**20}), flush=True)


def _untraced(data, after=0):
    """The time the trace does not show, per step (median over the steps after the
    first, the slowest rank's): inside a step's event but in none of its actions, and
    between one step's end and the next one's start (the trainer's own work: slicing
    the batch, logs, callbacks). Both near zero mean the actions account for the step."""
    events = [e for e in data["traceEvents"] if e.get("ph") == "X" and e["ts"] >= after]
    inside, gaps = {}, {}
    for rank in {e["tid"] for e in events}:
        mine = sorted((e for e in events if e["tid"] == rank), key=lambda e: e["ts"])
        steps = [e for e in mine if e["cat"] == "step" and "step" in e["args"]]
        for k, st in enumerate(steps[1:], 1):
            lo, hi = st["ts"], st["ts"] + st["dur"]
            busy = sum(e["dur"] for e in mine if e["cat"] != "step" and lo <= e["ts"] <= hi)
            key = st["args"]["step"]
            inside[key] = max(inside.get(key, 0.0), (st["dur"] - busy) / 1e6)
            prev = steps[k - 1]
            gaps[key] = max(gaps.get(key, 0.0), (lo - prev["ts"] - prev["dur"]) / 1e6)
    if not inside:
        return 0.0, 0.0
    return statistics.median(inside.values()), statistics.median(gaps.values())


def _stage_vars(model):
    opt = model.optimizer
    return getattr(opt, "_trainable_variables", [])


def transfer():
    from mpi4py import MPI

    from hyparflow.engine.comm import MPICommunicator, wait_all

    world = MPI.COMM_WORLD
    hfc = MPICommunicator(world)
    rank, peer = world.Get_rank(), 1 - world.Get_rank()
    rows = []
    for nbytes in [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        buf = np.ones(nbytes // 4, np.float32)
        repeats = max(5, min(200, (256 << 20) // nbytes))

        def raw():
            if rank == 0:
                world.Send(buf, dest=peer, tag=1)
                world.Recv(buf, source=peer, tag=2)
            else:
                world.Recv(buf, source=peer, tag=1)
                world.Send(buf, dest=peer, tag=2)

        def ours():
            # What the executor does for a boundary tensor: Irecv posted, Isend, polled wait.
            if rank == 0:
                wait_all([hfc.isend(buf, peer, 3)])
                wait_all([hfc.irecv(buf, peer, 4)])
            else:
                wait_all([hfc.irecv(buf, peer, 3)])
                wait_all([hfc.isend(buf, peer, 4)])

        result = {}
        for name, fn in (("raw_s", raw), ("hf_s", ours), ("raw_s", raw), ("hf_s", ours)):
            times = []
            for _ in range(repeats):
                world.Barrier()
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) / 2)
            result[name] = min(result.get(name, 1e9), statistics.median(times))
        rows.append({"bytes": nbytes, **result})
    if rank == 0:
        print("RESULT " + json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "baseline":
        print("RESULT " + json.dumps(baseline(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    elif kind == "hf":
        w, b, n, s, r, m, sched, trace = sys.argv[2:10]
        hybrid(w, int(b), int(n), int(s), int(r), int(m), sched, trace,
               int(sys.argv[10]) if len(sys.argv) > 10 else 1,
               sys.argv[11] if len(sys.argv) > 11 else None)
    elif kind == "transfer":
        transfer()
