"""Sharded embedding tables over real MPI (issue 34): messages past 64 KB each way
(rows of 256 values, bags of 8 ids per sample), table-, row- and column-wise, against
`model.fit` on one process (the replicated "data" path has tests of its own). SGD:
with Adam (lr 0.05) this 772-wide model ends 1.7e-5 from model.fit with
sharded tables and, alike to the digit, with today's replicated tables (the summation
order of the Dense layer's 772 inputs, amplified by Adam's division); the in-process
tests cover Adam on a narrower model.

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_tables_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import keras  # noqa: E402
from conftest import max_diff, reference  # noqa: E402
from test_tables import tables_data, tables_model  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()
BIG = {"user": 64, "item": 300, "cat": 12}


def _fit(dim, **layout):
    """hf.fit of the tables model with rows of `dim` values on this rank's data, from
    model.fit's start: (max weight difference from model.fit, this rank's routers)."""
    build = lambda: tables_model("sgd", dim=dim, bag=8, rows=BIG)  # noqa: E731
    x, y = tables_data(n=256, bag=8, rows=BIG)
    start, want, _ = reference(build, x, y, batch_size=128, epochs=2)
    model = build()
    model.set_weights(start)
    routers = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            routers[:] = [model.get_layer(n).__dict__["_hyparflow_table_part"].router
                          for n in BIG if "_hyparflow_table_part" in model.get_layer(n).__dict__]

    hf.fit(model, x, y, batch_size=128, epochs=2, shuffle=False, verbose=0,
           embedding_sharding={"user": "table", "item": "row", "cat": "column"},
           callbacks=[Look()], **layout)
    return max_diff(model.get_weights(), want), routers


@pytest.mark.mpi(min_size=2)
def test_sharded_tables_under_mpiexec():
    diff, routers = _fit(256)
    if hf.is_main():
        print(f"\nsharded tables R={SIZE}: max weight difference {diff:.3g}, largest "
              f"message {routers[0].largest:,} bytes, {routers[0].bytes:,} bytes sent")
    assert diff <= 2e-6
    assert routers[0].largest > 64 * 1024


@pytest.mark.mpi(min_size=4)
def test_pipelined_tables_under_mpiexec():
    """S=2 stages x R=SIZE/2 replicas, tables in both stages (user and item in stage 0,
    cat in stage 1) sharded over the replicas of their stage, each on a communicator of
    its own, while the pipeline's activations (past 64 KB too) cross between the stages:
    model.fit's weights under zb-h1 (B and W apart) with 2 microbatches. Rows of 1280
    values: the pooled and column-wise messages carry one (part of a) vector per
    sample of a 32-sample microbatch, past 64 KB on every rank."""
    diff, routers = _fit(1280, num_stages=2, num_replicas=SIZE // 2, num_microbatches=2,
                         balance=(3, 7), schedule="zb-h1")
    largest = max(r.largest for r in routers)
    if hf.is_main():
        print(f"\npipelined sharded tables S=2 R={SIZE // 2}: max weight difference "
              f"{diff:.3g}, largest table message {largest:,} bytes")
    assert diff <= 2e-6
    assert largest > 64 * 1024
