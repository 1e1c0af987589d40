"""A small GPT-style language model on Python's own source code, pipeline- and tensor-parallel.

    hyparflow run -n 2 --stages 2 --microbatches 2 examples/gpt_text.py
    hyparflow run -n 4 --stages 2 --tensor 2 --microbatches 2 examples/gpt_text.py
    hyparflow run -n 2 --stages 2 examples/gpt_text.py --chars 100000 --epochs 1   # quick

The text is the standard library's own `.py` files, read at run time (nothing is
downloaded), as characters: the vocabulary is printable ASCII plus newline
(anything else becomes `?`). The model predicts each next character:

- a token embedding, plus a learned position embedding whose positions come from
  the input itself (`keras.ops`), so any sequence length up to --context works;
- --blocks pre-norm Transformer decoder blocks: causal MultiHeadAttention
  (`use_causal_mask=True`) and a Dense feed-forward pair, with residuals;
- the output projection is the token embedding reversed (`TiedOutput`): one weight
  matrix for input and output, as GPT-2 does. With several stages the two uses sit
  on the first and the last stage; hyparflow sums both gradients, so the two
  copies stay identical after every step.

Prints the loss and perplexity on held-out text (`hf.evaluate`), then a few lines
sampled from the trained model on rank 0.
"""

import argparse
import os
import sysconfig

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np

L = keras.layers
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 characters
UNKNOWN = ALPHABET.index("?")


def read_source(chars):
    """About `chars` characters of the standard library's Python source, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    pieces, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            text = f.read()
        pieces.append(text)
        total += len(text)
        if total >= chars:
            break
    return "".join(pieces)[:chars]


def encode(text):
    table = np.full(128, UNKNOWN, np.int32)
    for i, c in enumerate(ALPHABET):
        table[ord(c)] = i
    codes = np.frombuffer(text.encode("ascii", errors="replace"), np.uint8)
    return table[np.minimum(codes, 127)]


def decode(ids):
    return "".join(ALPHABET[i] for i in ids)


def windows(ids, context, stride):
    """(inputs, next-character targets) of `context` characters, every `stride`."""
    starts = np.arange(0, len(ids) - context - 1, stride)
    x = np.stack([ids[s:s + context] for s in starts])
    y = np.stack([ids[s + 1:s + context + 1] for s in starts])
    return x.astype("int32"), y.astype("int32")


@keras.saving.register_keras_serializable(package="hyparflow_examples")
class TiedOutput(L.Layer):
    """Logits from the token embedding's own matrix: h @ E^T (GPT-2's tied weights).

    It holds the Embedding layer itself, so the embedding's variable is among its
    weights: hyparflow then knows the variable is used on two stages."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))

    def get_config(self):
        return {**super().get_config(),
                "embedding": keras.saving.serialize_keras_object(self.embedding)}

    @classmethod
    def from_config(cls, config):
        config["embedding"] = keras.saving.deserialize_keras_object(config["embedding"])
        return cls(**config)


def decoder_block(x, dim, heads, name):
    h = L.LayerNormalization(epsilon=1e-5, name=f"{name}_norm1")(x)
    h = L.MultiHeadAttention(heads, dim // heads, name=f"{name}_attention")(
        h, h, use_causal_mask=True)
    x = L.Add(name=f"{name}_add1")([x, h])
    h = L.LayerNormalization(epsilon=1e-5, name=f"{name}_norm2")(x)
    h = L.Dense(4 * dim, activation="gelu", name=f"{name}_ff1")(h)
    h = L.Dense(dim, name=f"{name}_ff2")(h)
    return L.Add(name=f"{name}_add2")([x, h])


def build_model(vocab=len(ALPHABET), context=64, dim=64, heads=4, blocks=2, seed=0):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((None,), dtype="int32", name="tokens")  # any length <= context
    positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1
    embedding = L.Embedding(vocab, dim, name="token_embedding")
    x = L.Add(name="embed")([embedding(tokens),
                             L.Embedding(context, dim, name="position_embedding")(positions)])
    for b in range(blocks):
        x = decoder_block(x, dim, heads, name=f"block{b}")
    x = L.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = TiedOutput(embedding, name="logits")(x)
    return keras.Model(tokens, logits, name="gpt_text")


def compile_model(model, learning_rate=3e-3):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def sample(model, prompt, length, context, temperature, rng):
    ids = list(encode(prompt))
    for _ in range(length):
        window = np.array([ids[-context:]], np.int32)
        logits = np.asarray(model(window, training=False))[0, -1] / temperature
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return decode(ids)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: hyparflow run --stages, else 1)")
    parser.add_argument("--tensor", type=int, default=None,
                        help="tensor ranks per stage (default: hyparflow run --tensor, else 1)")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--chars", type=int, default=400_000, help="characters of source text")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=3, help="lines to sample at the end")
    args = parser.parse_args()

    ids = encode(read_source(args.chars))
    cut = int(len(ids) * 0.9)
    x, y = windows(ids[:cut], args.context, args.context // 2)
    vx, vy = windows(ids[cut:], args.context, args.context)
    model = compile_model(build_model(context=args.context, dim=args.dim, heads=args.heads,
                                      blocks=args.blocks))
    # With tensor ranks: every block's attention split by heads and its feed-forward
    # pair by columns then rows (these layers are too small to be chosen by size).
    split = [f"block{b}_{part}" for b in range(args.blocks)
             for part in ("attention", "ff1", "ff2")]
    layout = dict(num_stages=args.stages, num_tensor=args.tensor,
                  num_microbatches=args.microbatches, tensor_layers=split)
    hf.fit(model, x, y, batch_size=args.batch_size, epochs=args.epochs, seed=1,
           verbose=2 if hf.is_main() else 0, **layout)
    loss = hf.evaluate(model, vx, vy, batch_size=args.batch_size,
                       **{k: v for k, v in layout.items() if k != "num_microbatches"})
    if hf.is_main():
        rng = np.random.default_rng(0)
        for _ in range(args.samples):
            line = sample(model, "def ", 60, args.context, 0.8, rng)
            print("sample: " + line.splitlines()[0][:80])
        print(f"gpt_text: held-out loss {loss:.3f}, perplexity {np.exp(loss):.2f} per character "
              f"on {len(vx)} windows of {args.context}")


if __name__ == "__main__":
    main()
