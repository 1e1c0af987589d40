"""Layer calls named by Keras ('dense_3') are matched by position and class between
processes (the ranks' set-up check, a plan file written by another process); the names
the user gave are matched as names. Under mpiexec: tests/mpi/test_autonames_mpi.py."""

import keras
import pytest

from hyparflow import _compat, graph as _graph, plan as _plan
from hyparflow.engine import prepare


def mlp(first="up"):
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, name=first)(inp)
    h = keras.layers.Dense(8)(h)
    h = keras.layers.LayerNormalization()(h)
    return keras.Model(inp, keras.layers.Dense(2)(h))


def test_auto_names_are_told_from_given_ones():
    assert _compat.auto_named(keras.layers.Dense(2))
    assert _compat.auto_named(keras.layers.LayerNormalization())
    assert not _compat.auto_named(keras.layers.Dense(2, name="up"))
    assert not _compat.auto_named(keras.layers.Dense(2, name="layer_normalization"))
    # Keras keeps no record: a given name of the auto form counts as made up.
    assert _compat.auto_named(keras.layers.Dense(2, name="dense_7"))


def test_identities_ignore_auto_names_and_keep_given_ones():
    here = _graph.from_model(mlp())
    mlp()   # another model built in between: the next auto-names are numbered on
    there = _graph.from_model(mlp())
    every = range(len(here.nodes))
    assert [n.name for n in here.nodes] != [n.name for n in there.nodes]
    assert prepare.identities(here, every) == prepare.identities(there, every)
    renamed = _graph.from_model(mlp(first="up2"))
    assert prepare.identities(here, every) != prepare.identities(renamed, every)


def test_a_plan_written_elsewhere_is_matched_by_position():
    written = _graph.from_model(mlp())
    mlp()
    here = _graph.from_model(mlp())
    plan = {"stages": [{"layers": [n.name for n in written.nodes[:2]]},
                       {"layers": [n.name for n in written.nodes[2:]]}],
            "tensor_layers": [written.nodes[1].name]}
    assert _plan.counts_for(plan, here) == [2, len(here.nodes) - 2]
    local = _plan.local_names(plan, here)
    assert local[written.nodes[1].name] == here.nodes[1].name != written.nodes[1].name
    with pytest.raises(ValueError, match="not this model's.*up2"):
        _plan.counts_for(plan, _graph.from_model(mlp(first="up2")))
    assert _plan.local_keys({written.nodes[1].name: "row"}, plan, here) == {
        here.nodes[1].name: "row"}
