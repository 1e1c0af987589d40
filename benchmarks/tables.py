"""Step time, bytes per step and peak memory per rank of examples/dlrm.py's model on
the ranks of one mpiexec run: each sharding kind for every table ("table", "row",
"column"), the planner's "auto" (by cost) and the first planner's plan (by bytes),
"auto" with the whole tables kept in Keras during fit (as before they were dropped:
`kinds/tables/whole.py`), "auto" and "column" with bfloat16 exchanges, today's
replicated tables (their gradient pairs gathered over the replicas), then plain Keras
`model.fit` on rank 0 alone with all the cores (the other ranks wait without spinning).

    mpiexec -n 2 python benchmarks/tables.py --largest 2000000

Bytes per step: what rank 0 sent for the tables' lookups (ids, rows, gradients:
`Router.bytes`; rows and gradients alone: `Router.payload`), or the sparse pairs it
received (replicated), from the run's trace. Memory, the most of any rank: the
resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs at the
first step, read at the last: the steps' peak, not the model's building, when Keras
makes every table whole on every rank), and the table bytes the rank holds during
fit (weights and the optimizer's slots: the whole tables' Keras storage, the parts
it trains). The last column: the planner's estimate of the tables' milliseconds per
step for the run's placement (`kinds/tables/cost.py`)."""

import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hyparflow as hf  # noqa: E402
from dlrm import DIM, click_data, dlrm, sizes  # noqa: E402
from hyparflow.kinds.tables import whole  # noqa: E402


def _hwm():
    """This process's resident set high-water mark, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)


def _table_bytes(model):
    """The bytes of table weights and their optimizer slots this rank holds now."""
    held = 0
    slots = {id(v): v for v in model.optimizer.variables}
    for layer in model.layers:
        if not isinstance(layer, keras.layers.Embedding):
            continue
        held += layer.embeddings.numpy().nbytes  # the Keras storage (no rows when dropped)
        part = layer.__dict__.get("_hyparflow_table_part")
        trained = part.variable if part is not None else layer.embeddings
        if part is not None:
            held += part.nbytes
        prefix = trained.path.replace("/", "_") + "_"
        held += sum(v.numpy().nbytes for v in slots.values() if v.name.startswith(prefix))
    return held


class Clock(keras.callbacks.Callback):
    """Step times; the steps' peak resident set and the table bytes held."""

    def __init__(self):
        self.times = []
        self.peak = self.held = 0

    def on_train_batch_begin(self, batch, logs=None):
        if not self.times:
            _reset_hwm()
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)
        self.peak = _hwm()
        if len(self.times) == 1:
            self.held = _table_bytes(self.model)


def _most(value):
    """The largest of `value` over the ranks of the run."""
    from mpi4py import MPI

    return max(MPI.COMM_WORLD.allgather(value))


def _pairs(trace):
    """Bytes of sparse pairs and of dense gradients in the replicas' sums (trace)."""
    if not os.path.exists(trace):
        return 0, 0
    with open(trace) as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    total = lambda key: sum(e.get("args", {}).get(key, 0) for e in events  # noqa: E731
                            if e.get("name") == "allreduce")
    return total("sparse_bytes"), total("dense_bytes")


def _keras_alone(run):
    """`run()` on rank 0 while the others wait in a barrier they test every 50 ms (a
    blocking MPI barrier would spin on a core)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.rank == 0:
        run()
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.05)


def _tables(model):
    from hyparflow.kinds.tables import plan

    return [plan.Table(layer.name, layer.input_dim, layer.output_dim, 4,
                       plan.storage_factor(type(model.optimizer).__name__))
            for layer in model.layers if isinstance(layer, keras.layers.Embedding)]


def _by_bytes(model):
    """The first planner's kinds (by bytes alone), as a dict `fit` places alike."""
    from hyparflow.kinds.tables import plan

    return plan.by_bytes(_tables(model), hf.size())


def _estimate(model, sharding, dtype, x, batch):
    """The planner's estimate of the tables' seconds per step (`cost.step_seconds`),
    the owners' load from the first 8 batches' ids, as `fit` costs "auto"."""
    from hyparflow.graph import from_model
    from hyparflow.kinds import tables as T
    from hyparflow.kinds.tables import cost as C

    graph = from_model(model)
    names = [t.name for t in _tables(model)]
    ids = {n: a[:8 * batch] for n, a in zip(names, x[1:])}
    wire = 2 if dtype else 4
    placed = T.placements_for(model, graph, sharding or {}, hf.size(), batch_size=batch,
                              ids=ids, wire_bytes=wire)
    per_sample = T.lookups_per_sample(graph)
    rows = C.costs(placed, hf.size(), {k: v * batch for k, v in per_sample.items()}, ids,
                   wire_bytes=wire)
    return C.step_seconds(rows, hf.size())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--largest", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", type=str, default=None,
                   help="comma-separated run numbers (0-9; 9: model.fit) to run, without the "
                        "header: each in a process of its own, for its own peak memory")
    args = p.parse_args()
    only = None if args.only is None else {int(k) for k in args.only.split(",")}
    rows = sizes(args.features, args.largest)
    x, y = click_data(args.batch * args.steps, rows)
    names = [f"table{k}" for k in range(len(rows))]
    runs = [(f'"{kind}" (every table)', {n: kind for n in names}, None)
            for kind in ("table", "row", "column")]
    runs += [('"auto"', "auto", None),
             ('"auto" by bytes (the first planner)', _by_bytes(dlrm(rows)), None),
             ('"auto", whole tables kept in Keras', "auto", "keep"),
             ('"auto", bfloat16 exchanges', "auto", "bfloat16"),
             ('"column", bfloat16 exchanges', {n: "column" for n in names}, "bfloat16"),
             ("replicated tables (no sharding)", None, None)]
    if hf.is_main() and (only is None or 0 in only):
        print(f"{len(rows)} tables of {min(rows):,} to {max(rows):,} rows, "
              f"{sum(rows) * DIM * 4 / 2**20:,.0f} MiB of weights; Adagrad, batch {args.batch}")
        print(f"| {hf.size()} ranks | ms / step | table bytes / step (rank 0) | of them rows "
              "and gradients | dense allreduce bytes / step | peak RSS / rank (MiB) | "
              "table MiB held / rank | tables' est. ms |"
              "\n|---|---:|---:|---:|---:|---:|---:|---:|")
    empty = whole.empty
    plans = {}
    for k, (name, sharding, dtype) in enumerate(runs):
        if only is not None and k not in only:
            continue
        # "keep": the whole tables stay in the Keras variables, as before they were
        # dropped during fit (for the comparison only).
        whole.empty = (lambda part: None) if dtype == "keep" else empty
        dtype = None if dtype == "keep" else dtype
        model, clock = dlrm(rows), Clock()
        trace = os.path.join(tempfile.gettempdir(), f"tables_bench_{hf.rank()}.json")
        if os.path.exists(trace):
            os.remove(trace)
        hf.fit(model, x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
               embedding_sharding=sharding, communication_dtype=dtype, callbacks=[clock],
               trace=trace)
        parts = [layer.__dict__.get("_hyparflow_table_part") for layer in model.layers]
        routers = {id(q.router): q.router for q in parts if q is not None}
        sent = sum(r.bytes for r in routers.values())
        payload = sum(r.payload for r in routers.values())
        pairs, dense = _pairs(trace)
        peak, held = _most(clock.peak), _most(clock.held)
        kinds = {layer.name: getattr(layer.__dict__.get("_hyparflow_table_part"), "placement",
                                     None) for layer in model.layers
                 if isinstance(layer, keras.layers.Embedding)}
        plans[name] = {k: "data" if p is None else f"{p.kind} {p.ranks}"
                       for k, p in kinds.items()}
        if hf.is_main():
            print(f"| {name} | {np.median(clock.times[2:]) * 1e3:.1f} | "
                  f"{(sent + pairs) / args.steps:,.0f} | "
                  f"{(payload + pairs) / args.steps:,.0f} | {dense / args.steps:,.0f} | "
                  f"{peak / 2**20:,.0f} | {held / 2**20:,.1f} | "
                  f"{_estimate(model, sharding, dtype, x, args.batch) * 1e3:.2f} |", flush=True)
    whole.empty = empty

    if hf.is_main():
        for name in ('"auto"', '"auto" by bytes (the first planner)'):
            if name in plans:
                print(f"{name}: {plans[name]}", flush=True)

    def keras_fit():
        model, clock = dlrm(rows), Clock()
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[clock])
        print(f"| `model.fit`, 1 process, all cores | {np.median(clock.times[2:]) * 1e3:.1f} "
              f"| - | - | - | {clock.peak / 2**20:,.0f} | {clock.held / 2**20:,.1f} | - |",
              flush=True)

    if only is None or len(runs) in only:
        _keras_alone(keras_fit)


if __name__ == "__main__":
    main()
