"""A GPT-style language model with tied input/output embeddings (examples/gpt_text.py):
causal attention, sequences of any length, the embedding's matrix used on the first
and the last stage. Against plain Keras, with Adam."""

import functools
import os
import sys

import keras
import numpy as np
import pytest

from conftest import max_diff, reference, train_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import gpt_text  # noqa: E402


def build():
    return gpt_text.compile_model(gpt_text.build_model(context=16, dim=16, heads=2, blocks=2),
                                  learning_rate=1e-2)


def data():
    ids = gpt_text.encode(gpt_text.read_source(4000))
    return gpt_text.windows(ids, 16, 8)


class Copies(keras.callbacks.Callback):
    """The token embedding as this rank holds it after every step."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.get_layer("token_embedding").embeddings.numpy().copy())


@functools.cache  # one plain Keras run for every stage count (tests only read it)
def fit_reference(samples, epochs):
    """The weights before and after `model.fit` on the first `samples` windows."""
    x, y = data()
    start, end, _ = reference(build, x[:samples], y[:samples], epochs=epochs, batch_size=32)
    return start, end


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_tied_embeddings_across_stages(stages):
    x, y = data()
    x, y = x[:96], y[:96]
    start, expected = fit_reference(96, 2)
    copies = [Copies() for _ in range(stages)]
    from hyparflow.engine.local import run_ranks

    import hyparflow as hf

    def body(comm):
        m = build()
        m.set_weights(start)
        hf.fit(m, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, num_stages=stages,
               num_microbatches=2, callbacks=[copies[comm.rank]], comm=comm)
        return m.get_weights()

    results = run_ranks(stages, body, timeout=300)
    diff = max(max_diff(w, expected) for w in results)
    assert diff <= 1e-4, f"S={stages}: max weight difference {diff:g}"
    # The first stage (the lookup) and the last (the output projection) hold the same
    # matrix after every step.
    first, last = copies[0].seen, copies[-1].seen
    assert len(first) == len(last) == 6
    for a, b in zip(first, last):
        np.testing.assert_array_equal(a, b)


def test_sequences_of_any_length_share_one_model():
    """The model takes any length up to its context: a shorter window trains too."""
    x, y = data()
    model = build()
    start = model.get_weights()
    model.fit(x[:32, :10], y[:32, :10], batch_size=16, epochs=1, shuffle=False, verbose=0)
    (weights, _), *_ = train_ranks(build, x[:32, :10], y[:32, :10], num_stages=2,
                                   num_replicas=1, num_microbatches=2, weights=start,
                                   batch_size=16, epochs=1, shuffle=False)
    assert max_diff(weights, model.get_weights()) <= 1e-4


def test_a_tied_embedding_is_not_split():
    """Its matrix is also the output projection's: splitting it by rows would leave the
    projection without the whole matrix, so it is refused with the reason."""
    from hyparflow.engine.local import run_ranks

    import hyparflow as hf

    x, y = data()

    def body(comm):
        hf.fit(build(), x[:32], y[:32], batch_size=16, num_tensor=2, verbose=0,
               tensor_layers=["token_embedding"], comm=comm)

    with pytest.raises(ValueError, match="also used by layer 'logits' \\(tied weights\\)"):
        run_ranks(2, body, timeout=120)
