"""Attention split by heads over real MPI messages; run under mpiexec by tests/cluster/test_mpi.py
(with the rest of tests/mpi):

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_attention_mpi.py
"""

import hyparflow as hf
import keras
import numpy as np
import pytest
from mpi4py import MPI

SIZE = MPI.COMM_WORLD.Get_size()
L = keras.layers
SEQ = 8


def encoder():
    """Features -> Dense, a padding-masked causal attention block (4 heads) with an FFN
    pair, mean over positions, a softmax head."""
    keras.utils.set_random_seed(21)
    ids = keras.Input((SEQ,), dtype="int32")
    features = keras.Input((SEQ, 5))
    x = L.Dense(16)(features)
    mask = keras.ops.expand_dims(keras.ops.not_equal(ids, 0), 1)
    a = L.MultiHeadAttention(4, 8, name="attn")(x, x, attention_mask=mask, use_causal_mask=True)
    x = L.LayerNormalization()(L.Add()([x, a]))
    h = L.Dense(16, name="ffn_down")(L.Dense(32, activation="relu", name="ffn_up")(x))
    x = L.LayerNormalization()(L.Add()([x, h]))
    out = L.Dense(3, activation="softmax")(L.GlobalAveragePooling1D()(x))
    model = keras.Model([ids, features], out)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def data(n=64):
    rng = np.random.default_rng(22)
    ids = rng.integers(1, 20, (n, SEQ)).astype("int32")
    ids[np.arange(SEQ)[None, :] >= rng.integers(3, SEQ + 1, n)[:, None]] = 0
    features = rng.normal(size=(n, SEQ, 5)).astype("float32") * (ids > 0)[..., None]
    return [ids, features], (ids[:, 0] % 3).astype("int32")


@pytest.mark.mpi(min_size=2)
def test_attention_heads_split_same_weights_as_one_process():
    configs = {2: [(1, 2, 1, 2, [3, 1])], 4: [(2, 2, 1, 2, None), (1, 2, 2, 1, [1, 3])]}
    x, y = data()
    reference = encoder()
    start = reference.get_weights()
    expected_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                                     verbose=0).history
    expected = reference.get_weights()
    for s, t, r, m, shares in configs.get(SIZE, []):
        model = encoder()
        model.set_weights(start)
        history = hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=s, num_tensor=t,
                         num_replicas=r, num_microbatches=m, shuffle=False, verbose=0,
                         tensor_layers=["attn", "ffn_up", "ffn_down"], tensor_shares=shares)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        if hf.is_main():
            print(f"\nattention (S,T,R,M)={(s, t, r, m)} shares={shares} max weight difference "
                  f"{diff:.3g}")
        assert diff <= 1e-5, f"(S,T,R,M)={(s, t, r, m)}: {diff}"
        for key, values in expected_history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
