"""Reading Keras graphs and cutting them into stages."""

import keras

import models
from hyparflow import graph as G
from hyparflow.engine.partition import partition


def test_skip_tensor_goes_straight_to_its_consumer():
    g = G.from_model(models.skip_cnn())
    assert [n.name for n in g.nodes][:2] == ["stem", g.nodes[1].name]
    part = partition(g, 3, balance=models.SKIP_CNN_BALANCE[3])
    stem_out = g.nodes[0].outputs[0]
    # The stem's output is sent from stage 0 to stage 1 and, directly, to stage 2.
    assert {(e.src, e.dst) for e in part.edges if e.tensor == stem_out} == {(0, 1), (0, 2)}
    assert part.stages[2].sources == [0, 1]


def test_outputs_of_early_stages_reach_the_last():
    g = G.from_model(models.two_in_two_out())
    part = partition(g, len(g.nodes))
    last = part.stages[-1]
    assert set(last.outputs) == set(g.outputs)
    for t in g.outputs:
        producer_stage = g.tensors[t].producer
        if producer_stage != len(g.nodes) - 1:
            assert any(e.tensor == t and e.dst == len(g.nodes) - 1 for e in part.edges)
    # Model inputs are read from data by the stages that use them, never sent.
    assert all(g.tensors[e.tensor].producer is not None for e in part.edges)


def test_sequential_and_a_layer_called_twice():
    keras.utils.set_random_seed(0)
    seq = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    assert [n.name for n in G.from_model(seq).nodes] == [l.name for l in seq.layers]

    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    out = shared(keras.layers.Dense(4)(shared(inp)))
    g = G.from_model(keras.Model(inp, out))
    assert [n.name for n in g.nodes] == ["shared", g.nodes[1].name, "shared#2"]
    part = partition(g, 3)
    kernel = shared.kernel
    assert part.users[id(kernel)] == (0, 2) and part.owner[id(kernel)] == 0


def test_default_balance_follows_estimated_compute():
    keras.utils.set_random_seed(0)
    inp = keras.Input((64,))
    h = keras.layers.Dense(512)(inp)        # 33k weights, the heaviest call
    for _ in range(4):
        h = keras.layers.Dense(32)(h)       # small ones
    model = keras.Model(inp, keras.layers.Dense(2)(h))
    part = partition(G.from_model(model), 2)
    assert part.counts[0] == 1


def test_what_a_model_returns_is_read_off_its_graph_as_keras_traces_it():
    """The compiled loss and metrics are built on what the model returns for a batch. A
    functional graph whose outputs are static past the batch gives it without tracing
    the whole model on every rank (a second of ResNet50 per rank): the same shapes,
    dtypes and structure as Keras's own trace. Where the graph cannot tell (a length
    the data sets, a `call` of the model's own, data that does not fit), the trace."""
    from hyparflow import _compat
    from hyparflow.engine.prepare import _outputs

    def spec(model, shapes, rows=8):
        functional = _compat.functional_of(model)
        inputs = keras.tree.flatten(_compat.input_structure(functional))
        x = [_compat.symbolic((rows,) + s, i.dtype) for s, i in zip(shapes, inputs)]
        read = _outputs(model, functional, x, rows)
        arg = keras.tree.pack_sequence_as(_compat.input_structure(functional), x)
        return read, _compat.compute_output_spec(model, arg, training=False)

    def described(value):
        return keras.tree.map_structure(lambda t: (tuple(t.shape), t.dtype), value)

    seq = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    half = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="float16")])
    for model, shapes in [(models.two_in_two_out(), [(6,), (5,)]),
                          (models.skip_cnn(), [(8, 8, 1)]), (seq, [(5,)]), (half, [(4,)])]:
        read, traced = spec(model, shapes)
        assert read is not None, model.name
        assert described(read) == described(traced), model.name

    tokens = keras.Input((None,), dtype="int32")
    lm = keras.Model(tokens, keras.layers.Dense(7)(keras.layers.Embedding(11, 4)(tokens)))
    read, traced = spec(lm, [(12,)])
    assert read is None and tuple(traced.shape) == (8, 12, 7)

    class Own(keras.Model):
        def call(self, x):
            return super().call(x) * 2.0

    inp = keras.Input((5,))
    assert spec(Own(inp, keras.layers.Dense(3)(inp)), [(5,)])[0] is None

    functional = _compat.functional_of(seq)
    assert _outputs(seq, functional, [_compat.symbolic((8, 6), "float32")], 8) is None
