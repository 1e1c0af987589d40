"""Cost of the set-up check for rows that interact (docs/models.md, "Samples that
interact"): `engine.coupling.coupled` on every model of tests/zoo.py, one process, first
call (eager forwards of six rows whole and in two parts) and a second one.

    PYTHONPATH=$PWD python benchmarks/coupling_cost.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import zoo  # noqa: E402
from hyparflow import graph as G  # noqa: E402
from hyparflow.engine import coupling  # noqa: E402
from hyparflow import readers as _data  # noqa: E402

for name, make in sorted(zoo.ZOO.items()):
    model, (x, y) = make()
    if isinstance(x, dict):
        x, y = [x[k] for k in ("left", "right")], [y[k] for k in ("p", "q")]
    graph = G.from_model(model)
    data = _data.prepare_data(graph, x, y)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        found = coupling.coupled(model, graph, data)
        seconds.append(time.perf_counter() - start)
    print(f"{name:14s} flagged={found} first {seconds[0] * 1e3:.0f} ms, "
          f"again {seconds[1] * 1e3:.0f} ms", flush=True)
