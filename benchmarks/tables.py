"""Step time and bytes per step of examples/dlrm.py's model: sharded tables
("auto"), today's replicated tables (their gradient pairs gathered over the
replicas), and plain Keras `model.fit` on one process.

    mpiexec -n 2 python benchmarks/tables.py            # the hyparflow rows
    python benchmarks/tables.py --keras                  # the model.fit row

Bytes per step: what rank 0 sent for the tables' lookups (sharded), or the sparse
pairs it received (replicated), from the run's trace."""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hyparflow as hf  # noqa: E402
from dlrm import click_data, dlrm, sizes  # noqa: E402


class Clock(keras.callbacks.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keras", action="store_true")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--largest", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    rows = sizes(args.features, args.largest)
    x, y = click_data(args.batch * args.steps, rows)
    if args.keras:
        model, clock = dlrm(rows), Clock()
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[clock])
        print(f"model.fit, 1 process: {np.median(clock.times[2:]) * 1e3:.1f} ms/step")
        return
    for name, sharding in (("sharded (auto)", "auto"), ("replicated (data)", None)):
        model, clock = dlrm(rows), Clock()
        trace = os.path.join(tempfile.gettempdir(), f"tables_bench_{hf.rank()}.json")
        hf.fit(model, x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
               embedding_sharding=sharding, callbacks=[clock], trace=trace)
        sent = 0
        part = [layer.__dict__.get("_hyparflow_table_part") for layer in model.layers]
        routers = {id(q.router): q.router for q in part if q is not None}
        sent = sum(r.bytes for r in routers.values())
        pairs = 0
        if os.path.exists(trace):
            with open(trace) as f:
                events = json.load(f)
            events = events.get("traceEvents", events) if isinstance(events, dict) else events
            pairs = sum(e.get("args", {}).get("sparse_bytes", 0) for e in events
                        if e.get("name") == "allreduce")
            dense = sum(e.get("args", {}).get("dense_bytes", 0) for e in events
                        if e.get("name") == "allreduce")
        if hf.is_main():
            print(f"{name}, {hf.size()} ranks: {np.median(clock.times[2:]) * 1e3:.1f} ms/step, "
                  f"table bytes/step {(sent + pairs) / args.steps:,.0f} "
                  f"(lookups {sent / args.steps:,.0f}, gathered pairs {pairs / args.steps:,.0f}), "
                  f"dense allreduce {dense / args.steps:,.0f}")


if __name__ == "__main__":
    main()
