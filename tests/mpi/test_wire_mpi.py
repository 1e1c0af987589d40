"""Reduced-precision exchanges over real MPI (`communication_dtype`, `engine.wire`,
`kinds/tables/lookup.pack`): float16 everywhere with sharded tables and a short last
batch (the replicas' 16-bit sums with their loss scale, the tables' per-message scales,
an idle replica serving lookups), and a pipeline's boundaries in bfloat16 with float16
replicas; each within a drift bound of `model.fit` (the exact contract is left by
design: tests/engine/test_wire.py, tests/kinds/test_tables.py bound it in process).

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_wire_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from conftest import max_diff, reference  # noqa: E402
from test_tables import tables_data, tables_model  # noqa: E402
from test_wire import mlp, mlp_data  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()
BIG = {"user": 64, "item": 300, "cat": 12}


@pytest.mark.mpi(min_size=2)
def test_float16_tables_and_replicas_with_a_short_batch():
    """257 samples in batches of 128: the last batch of one sample leaves every replica
    but the first idle, serving the others' lookups in float16."""
    build = lambda: tables_model("sgd", dim=256, bag=8, rows=BIG)  # noqa: E731
    x, y = tables_data(n=257, bag=8, rows=BIG)
    start, want, _ = reference(build, x, y, batch_size=128, epochs=2)
    model = build()
    model.set_weights(start)
    history = hf.fit(model, x, y, batch_size=128, epochs=2, shuffle=False, verbose=0,
                     num_microbatches=2, communication_dtype="float16",
                     embedding_sharding={"user": "table", "item": "row", "cat": "column"})
    diff = max_diff(model.get_weights(), want)
    ex = history.exchanges
    if hf.is_main():
        print(f"\nfloat16 tables and replicas R={SIZE}: max weight difference {diff:.3g}, "
              f"table bytes {ex['tables']['bytes']:,}, replica bytes {ex['replicas']['bytes']:,}")
    assert ex["tables"]["dtype"] == ex["replicas"]["dtype"] == "float16"
    assert ex["tables"]["bytes"] > 0 and ex["replicas"]["bytes"] > 0
    assert diff <= 5e-4


@pytest.mark.mpi(min_size=4)
def test_pipeline_boundaries_in_bfloat16_with_float16_replicas():
    x, y, _ = mlp_data(n=64)
    start, want, _ = reference(mlp, x, y, batch_size=32, epochs=2)
    model = mlp()
    model.set_weights(start)
    history = hf.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                     num_stages=2, num_replicas=SIZE // 2, num_microbatches=2,
                     communication_dtype={"stages": "bfloat16", "replicas": "float16"})
    diff = max_diff(model.get_weights(), want)
    ex = history.exchanges
    if hf.is_main():
        print(f"\nbfloat16 boundaries, float16 replicas S=2 R={SIZE // 2}: max weight "
              f"difference {diff:.3g}")
    assert ex["stages"]["bytes"] > 0 and ex["stages"]["dtype"] == "bfloat16"
    assert diff <= 5e-4
