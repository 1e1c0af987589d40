"""A small Transformer text classifier on a synthetic token task, pipeline-parallel.

    hyparflow run -n 2 --stages 2 --microbatches 2 examples/transformer_text.py
    hyparflow run -n 2 --stages 2 examples/transformer_text.py --samples 512 --epochs 1   # quick

The task: sequences of --length random tokens; a sequence is positive when the
marker token appears in its first half. Negatives hold no marker or a marker in
the second half only, so the model must use positions, not just the tokens.

The model is made of Keras layers and `keras.ops` only (no Lambda, no custom
layer): token embedding plus a learned position embedding (positions computed
from the input with `keras.ops`), --blocks Transformer encoder blocks
(MultiHeadAttention, LayerNormalization, a Dense feed-forward, residuals),
average pooling and a sigmoid. Prints the held-out accuracy, computed with
`hf.evaluate` (pipeline-parallel, like the training).
"""

import argparse

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np

L = keras.layers
MARKER = 1  # token 0 is unused, 1 is the marker, 2.. are ordinary words


def make_data(samples, length, vocab, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(2, vocab, size=(samples, length))
    y = rng.integers(0, 2, size=samples)
    half = length // 2
    for i in range(samples):
        if y[i]:                                    # a marker in the first half
            x[i, rng.integers(0, half)] = MARKER
            if rng.random() < 0.5:                  # and maybe another later
                x[i, rng.integers(half, length)] = MARKER
        elif rng.random() < 0.67:                   # negatives: a marker in the second half
            x[i, rng.integers(half, length)] = MARKER
    return x.astype("int32"), y.astype("float32")


def encoder_block(x, dim, heads, ff, name):
    attended = L.MultiHeadAttention(heads, dim // heads, name=f"{name}_attention")(x, x)
    x = L.LayerNormalization(name=f"{name}_norm1")(L.Add()([x, attended]))
    h = L.Dense(ff, activation="relu", name=f"{name}_ff1")(x)
    h = L.Dense(dim, name=f"{name}_ff2")(h)
    return L.LayerNormalization(name=f"{name}_norm2")(L.Add()([x, h]))


def build_model(length, vocab, dim, heads, ff, blocks):
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    # Positions 0..length-1 for every sequence, from the input itself so that they
    # are part of the graph (and can be cut into any stage).
    positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1
    x = L.Add(name="embed")([L.Embedding(vocab, dim, name="token_embedding")(tokens),
                             L.Embedding(length, dim, name="position_embedding")(positions)])
    for b in range(blocks):
        x = encoder_block(x, dim, heads, ff, name=f"block{b}")
    x = L.GlobalAveragePooling1D()(x)
    x = L.Dense(dim, activation="relu", name="head")(x)
    outputs = L.Dense(1, activation="sigmoid", name="positive")(x)
    return keras.Model(tokens, outputs, name="transformer_text")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: hyparflow run --stages, else 1)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per replica (default: hyparflow run --microbatches, else 1)")
    parser.add_argument("--samples", type=int, default=4000, help="training sequences")
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--save", default="", help="path of a .keras file to write on rank 0")
    args = parser.parse_args()

    x_train, y_train = make_data(args.samples, args.length, args.vocab, seed=0)
    x_test, y_test = make_data(1000, args.length, args.vocab, seed=1)

    keras.utils.set_random_seed(0)  # the same initial model on every rank
    model = build_model(args.length, args.vocab, args.dim, args.heads, 2 * args.dim, args.blocks)
    model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="binary_crossentropy",
                  metrics=["accuracy"])
    hf.fit(model, x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
           num_stages=args.stages, num_microbatches=args.microbatches, seed=0,
           verbose=2 if hf.is_main() else 0)

    # Every rank calls evaluate (it is pipeline-parallel too); all get the same numbers.
    results = hf.evaluate(model, x_test, y_test, batch_size=250, num_stages=args.stages,
                          num_microbatches=args.microbatches, return_dict=True)
    if hf.is_main():
        print(f"{model.name}: {model.count_params():,} parameters, {args.blocks} blocks")
        print(f"transformer_text: test accuracy {results['accuracy']:.4f} "
              f"(loss {results['loss']:.4f}) on {len(x_test)} held-out sequences")
        if args.save:
            model.save(args.save)


if __name__ == "__main__":
    main()
