"""Attention split by heads: time per step of a Transformer classifier, one process vs
2 replicas vs 2 tensor ranks (attention and feed-forward split, or feed-forward only).

    python benchmarks/attention_split.py [--epochs 3]

The model: Embedding(1000, 256), 2 post-norm encoder blocks (MultiHeadAttention with
8 heads of 32, Dense 1024 / 256 feed-forward pair), mean over positions, a softmax head;
Adam, batch 32 of sequences of 64, 512 samples. Each epoch after the first is timed
(traces excluded) and the fastest is reported, per step.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
SEQ, DIM, HEADS, FF, VOCAB, N, BATCH = 64, 256, 8, 1024, 1000, 512, 32


def build():
    import keras

    L = keras.layers
    keras.utils.set_random_seed(1)
    ids = keras.Input((SEQ,), dtype="int32")
    x = L.Embedding(VOCAB, DIM)(ids)
    for b in range(2):
        a = L.MultiHeadAttention(HEADS, DIM // HEADS, name=f"attn{b}")(x, x)
        x = L.LayerNormalization()(L.Add()([x, a]))
        h = L.Dense(FF, activation="relu", name=f"up{b}")(x)
        x = L.LayerNormalization()(L.Add()([x, L.Dense(DIM, name=f"down{b}")(h)]))
    out = L.Dense(4, activation="softmax")(L.GlobalAveragePooling1D()(x))
    model = keras.Model(ids, out)
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def worker(mode, epochs):
    import hyparflow as hf
    import keras
    import numpy as np

    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch >= 1:
                times.append((time.perf_counter() - self.start) / (N // BATCH))

    rng = np.random.default_rng(0)
    x, y = rng.integers(1, VOCAB, (N, SEQ)).astype("int32"), rng.integers(0, 4, N)
    layers = {"tensor": ["attn0", "up0", "down0", "attn1", "up1", "down1"],
              "tensor-ffn": ["up0", "down0", "up1", "down1"]}.get(mode)
    kwargs = dict(num_tensor=2, tensor_layers=layers) if layers else {}
    hf.fit(build(), x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False,
           callbacks=[Timer()], **kwargs)
    if hf.is_main():
        print(f"RESULT {mode} {1000 * min(times):.1f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.epochs)
    runs = [("one process", 1, "one"), ("2 replicas", 2, "replicas"),
            ("T=2: attention + feed-forward", 2, "tensor"),
            ("T=2: feed-forward only", 2, "tensor-ffn")]
    print(f"{'layout':32s} ms/step")
    for label, ranks, mode in runs:
        command = [sys.executable, HERE, "--worker", mode, "--epochs", str(args.epochs)]
        if ranks > 1:
            command = [MPIEXEC, "-n", str(ranks)] + command
        out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
        if out.returncode or not lines:
            sys.exit(f"{label} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
        print(f"{label:32s} {float(lines[0].split()[2]):7.1f}", flush=True)


if __name__ == "__main__":
    main()
