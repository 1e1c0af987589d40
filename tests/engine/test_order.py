"""The collectives of split layers in independent branches are in one order in the graph,
forward and backward (hyparflow.engine.order): TensorFlow's gradient code builds the
backward sums of two branches with nothing between them, so a rank with one inter-op
thread could run either first and its peer the other (tests/mpi/test_order_mpi.py runs
such models under mpiexec). Built in a plain graph, which orders nothing by itself, and
never run: what is checked is that every collective depends on the one before."""

from types import SimpleNamespace

import tensorflow as tf

from hyparflow.kinds.mesh.grid import Mesh
from hyparflow.kinds.tensor.collectives import Collectives, site_tag, ENTER, SUM


def _ancestors(op, memo):
    if op in memo:
        return memo[op]
    memo[op] = set()
    found = set()
    for t in op.inputs:
        found.add(t.op)
        found |= _ancestors(t.op, memo)
    for c in op.control_inputs:
        found.add(c)
        found |= _ancestors(c, memo)
    memo[op] = found
    return found


def _collectives(graph):
    return [op for op in graph.get_operations() if op.type == "EagerPyFunc"]


def _assert_one_order(ops):
    """Every pair of collectives is ordered by a path in the graph: a chain."""
    memo = {}
    for a in ops:
        for b in ops:
            if a is not b:
                assert a in _ancestors(b, memo) or b in _ancestors(a, memo), \
                    f"{a.name} and {b.name} may run in either order"


def _branches(coll, x1, x2):
    """Two branches, each a column split's entry (a backward sum) and a row split's
    sum (a forward sum), joined at the end."""
    w1 = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    w2 = tf.constant([[0.5, 1.0], [1.5, 2.0]])
    a = coll.sum(tf.matmul(coll.enter(x1, "a", site_tag(0, ENTER)), w1), "a", site_tag(0, SUM))
    b = coll.sum(tf.matmul(coll.enter(x2, "b", site_tag(1, ENTER)), w2), "b", site_tag(1, SUM))
    c = coll.gather(a * b, [2, 2], "c", tag=site_tag(2, 0))
    return tf.reduce_sum(c * c)


def test_split_layers_collectives_form_one_chain_forward_and_backward():
    graph = tf.Graph()
    with graph.as_default():
        x1 = tf.compat.v1.placeholder(tf.float32, (None, 2))
        x2 = tf.compat.v1.placeholder(tf.float32, (None, 2))
        loss = _branches(Collectives(SimpleNamespace(rank=0, size=2)), x1, x2)
        forward = _collectives(graph)
        tf.gradients(loss, [x1, x2])
        backward = [op for op in _collectives(graph) if op not in forward]
    assert len(forward) == 3 and len(backward) == 2  # sums and gather; the entries' sums
    _assert_one_order(forward + backward)


def test_mesh_group_collectives_form_one_chain():
    """The mesh's group sums (row and column groups) in two branches, both directions."""
    graph = tf.Graph()
    with graph.as_default():
        mesh = Mesh.__new__(Mesh)  # only its graph-building methods are used: never run
        x1 = tf.compat.v1.placeholder(tf.float32, (None, 2))
        x2 = tf.compat.v1.placeholder(tf.float32, (None, 2))
        a = Mesh.group_sum(mesh, x1, lambda: [0, 1], "a", (16, 17))
        b = Mesh.group_sum(mesh, x2, lambda: [0, 1], "b", (18, 19))
        c = Mesh.shared(mesh, a + b, lambda: [0, 1], "c", 20)
        tf.gradients(tf.reduce_sum(c * c), [x1, x2])
        ops = _collectives(graph)
    assert len(ops) == 5
    _assert_one_order(ops)


def test_two_ranks_in_different_collectives_are_named_within_seconds(monkeypatch):
    """What no order can fix (a collective a user's layer makes, different inputs on the
    ranks): rank 0 waits in one split layer's sum, rank 1 in another's. Both are named
    after HYPARFLOW_ORDER_SECONDS, long before the watchdog."""
    import time

    import numpy as np
    import pytest

    from hyparflow.engine.local import run_ranks
    from hyparflow.kinds.tensor.collectives import CollectiveOrderError, _named

    monkeypatch.setenv("HYPARFLOW_ORDER_SECONDS", "1")
    monkeypatch.setenv("HYPARFLOW_TIMEOUT", "60")
    _named(site_tag(3, SUM), "layer 'enc_self'")
    _named(site_tag(4, SUM), "layer 'dec_self'")

    def rank(comm):
        coll = Collectives(comm)
        name, tag = [("layer 'enc_self'", site_tag(3, SUM)),
                     ("layer 'dec_self'", site_tag(4, SUM))][comm.rank]
        coll.exchange(np.ones(3, np.float32), [(3,)] * 2, name, tag)

    start = time.monotonic()
    with pytest.raises(CollectiveOrderError) as error:
        run_ranks(2, rank, timeout=60)
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert "enc_self" in message and "dec_self" in message, message
