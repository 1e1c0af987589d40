"""The encoder-decoder that hung under mpiexec with one inter-op thread per rank: its
encoder's and decoder's self-attention split over T=2 (nothing else split), Adam. Run by
tests/cluster/test_mpi.py: `mpiexec -n 2 python branches_script.py`; prints the weights'
difference from model.fit."""

import hyparflow as hf
import keras
import numpy as np

L = keras.layers
SEQ, VOCAB, D = 8, 24, 16


def build():
    keras.utils.set_random_seed(5)
    src = keras.Input((SEQ,), dtype="int32")
    tgt = keras.Input((SEQ,), dtype="int32")
    e = L.Embedding(VOCAB, D, mask_zero=True)(src)
    a = L.MultiHeadAttention(2, 8, use_bias=False, name="enc_self")(e, e)
    x = L.LayerNormalization()(L.Add()([e, a]))
    h = L.Dense(D)(L.Dense(32, activation="relu")(x))
    enc = L.LayerNormalization()(L.Add()([x, h]))
    d = L.Embedding(VOCAB, D, mask_zero=True)(tgt)
    s = L.MultiHeadAttention(2, 8, use_bias=False, name="dec_self")(d, d, use_causal_mask=True)
    y = L.LayerNormalization()(L.Add()([d, s]))
    c = L.MultiHeadAttention(2, 8, use_bias=False)(y, enc)
    y = L.LayerNormalization()(L.Add()([y, c]))
    h = L.Dense(D)(L.Dense(32, activation="relu")(y))
    y = L.LayerNormalization()(L.Add()([y, h]))
    model = keras.Model([src, tgt], L.Dense(VOCAB)(y))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


rng = np.random.default_rng(1)
n = 64
src, tgt = rng.integers(1, VOCAB, (n, SEQ)), rng.integers(1, VOCAB, (n, SEQ))
for ids in (src, tgt):
    ids[np.arange(SEQ)[None] >= rng.integers(3, SEQ + 1, n)[:, None]] = 0
y = np.roll(tgt, -1, axis=1)
reference = build()
start = reference.get_weights()
reference.fit([src, tgt], y, batch_size=16, epochs=1, shuffle=False, verbose=0)
model = build()
model.set_weights(start)
hf.fit(model, [src, tgt], y, batch_size=16, epochs=1, shuffle=False, verbose=0, num_tensor=2,
       tensor_layers=["enc_self", "dec_self"])
diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
if hf.is_main():
    print(f"branches: max weight difference {diff:.3g}", flush=True)
