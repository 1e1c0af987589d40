"""The rank side of the planner's measurements: functions run on every rank under
mpiexec (started by `hyparflow.measure`), each result printed by rank 0 as one JSON
line, {"probe": name, ...fields}, which `measure` reads back."""

import json
import time

__all__ = ["report", "ping_pong", "rings", "compute", "tensor_stages", "strategy_steps"]


def report(probe, **fields):
    """One result, as one line of JSON on standard output."""
    print(json.dumps({"probe": probe, **fields}), flush=True)


def tensor_stages(source, function, batches, keys, repeats):
    from .. import _env

    _env.start_tensorflow()
    from mpi4py import MPI

    from .. import graph as G
    from . import profile
    from ..kinds import tensor as T
    from ..engine import timing
    from ..engine.comm import MPICommunicator
    from .measure import stage_for

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
        stage = stage_for(graph, model, key, shards)
        for b in batches:
            # Every group times its calls at the same time: each call exchanges with
            # the group, so all its ranks make the same number of them.
            _idle_barrier(world)
            ready = lambda: _idle_barrier(comm.comm)  # noqa: E731 - the group, warmed up
            every = world.allgather(timing.time(stage, b, fused=fused, repeats=repeats,
                                                ready=ready))
            _idle_barrier(world)
            # Then group 0 alone, the other ranks waiting for it.
            one = (timing.time(stage, b, fused=fused, repeats=repeats, ready=ready)
                   if rank < num_tensor else None)
            _waiting(world.Ibarrier())
            alone = [t for t in world.allgather(one) if t is not None]
            if rank == 0:
                mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
                report("stage", index=index, batch=b, forward=mean(every, 0),
                       backward=mean(every, 1), forward_alone=mean(alone, 0),
                       backward_alone=mean(alone, 1))
        comm.free()


def _idle_barrier(world):
    """A barrier that sleeps while it waits, leaving the cores to the ranks that work."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def _waiting(done, stretch=0.02):
    """Wait for request `done` as a pipeline stage waits for its next message: polls
    that back off to 1 ms sleeps (`comm.poll`), starting over every `stretch`
    seconds as a stage's waits do, each of whose wake-ups takes a core for a moment
    from the ranks that compute."""
    from ..engine.comm import poll

    while not done.Test():
        until = time.monotonic() + stretch
        poll(lambda: done.Test() or time.monotonic() > until, None, "a measurement", 0.0)


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


def compute(source, function, batches, sweeps=2):
    from .. import _env

    _env.start_tensorflow()  # the threads a rank of the plan gets on this node
    from mpi4py import MPI

    from .. import graph as G
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
            report("compute", busy=busy, batch=b, seconds=seconds)
    if getattr(model, "optimizer", None) is not None:
        step, nbytes = profile.optimizer_step(model)
        seconds = min(_together(world, world.Get_size(), step) for _ in range(sweeps))
        if rank0:
            report("optimizer", seconds_per_byte=seconds / nbytes)


def rings():
    from .. import _env

    _env.start_tensorflow()
    import numpy as np
    from mpi4py import MPI

    from ..engine.comm import MPICommunicator, wait_all
    from ..engine.overlap import BUCKET_BYTES

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
            report("ring", group=g, alpha=alpha, beta=max(beta, 1e-12))
        alpha, beta = _exchange(world, comm)
        if rank == 0:
            report("exchange", group=g, alpha=alpha, beta=max(beta, 1e-12))
        comm.free()
    wait = _wait(world)
    if rank == 0:
        report("wait", seconds=wait)


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

    from ..engine.comm import MPICommunicator, wait_all

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

    from ..clock import timed
    from ..kinds.tensor import Collectives

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
            cost[name] = timed(lambda: [fn(x) for _ in range(repeats)], 3) / repeats
        times[nbytes] = max(cost["summed"] - cost["alone"], 1e-6)
    return times[small], max(times[large] - times[small], 0.0) / (large - small)


def ping_pong():
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
        report("ping_pong", alpha=alpha, beta=max(beta, 1e-12))


def strategy_steps(source, function, path, batch, steps):
    """`hf.fit` of the model with the strategy file `path` for `steps` + 1 steps of
    random data (inputs normal, or ids within the model's Embedding vocabularies for
    integer inputs; targets of the output's shape, class indices when the loss is a
    sparse one): rank 0 reports the median step, the first (tracing) left
    out, timed from one step's end to the next's."""
    from .. import _env

    _env.start_tensorflow()
    import keras
    import numpy as np
    from mpi4py import MPI

    from .. import graph as G
    from ..loop.api import fit
    from . import profile

    model = profile.load_model(source, function)
    graph = G.from_model(model)
    rng = np.random.default_rng(0)
    n = batch * (steps + 1)

    def shaped(t):
        return (n,) + tuple(d or 8 for d in graph.tensors[t].shape[1:])

    # Ids for integer inputs, within every Embedding's vocabulary (a token model's
    # inputs); values for the others.
    vocab = min((int(n.op.input_dim) for n in graph.nodes
                 if isinstance(n.op, keras.layers.Embedding)), default=8)

    def made(t):
        if graph.tensors[t].dtype.startswith(("int", "uint")):
            return rng.integers(0, vocab, shaped(t)).astype(graph.tensors[t].dtype)
        return rng.normal(size=shaped(t)).astype("float32")

    xs = [made(t) for t in graph.inputs]
    out = shaped(graph.outputs[0])
    loss = str(getattr(model, "loss", "")).lower()
    y = (rng.integers(0, out[-1], out[:-1]) if "sparse" in loss
         else rng.normal(size=out).astype("float32"))
    ends = []

    class Timer(__import__("keras").callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            ends.append(time.perf_counter())

    fit(model, xs[0] if len(xs) == 1 else xs, y, batch_size=batch, epochs=1, shuffle=False,
           verbose=0, plan=path, callbacks=[Timer()])
    if MPI.COMM_WORLD.Get_rank() == 0:
        gaps = sorted(b - a for a, b in zip(ends[:-1], ends[1:]))
        report("strategy", seconds=gaps[len(gaps) // 2], steps=len(gaps))
