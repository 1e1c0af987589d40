"""1D tensor split (Megatron pairs) vs a 2x2 tensor mesh (Optimus/SUMMA) at T=4:
bytes each rank keeps for the backward and time per step, for a Dense stack.

    mpiexec -n 4 python benchmarks/mesh.py [--width 512] [--batches 32 64 128]

The model: input 512, two residual blocks Dense(512, relu) -> Dense(512) -> Add, a
Dense(10) head (not split); Adam, one microbatch, 8 steps per epoch. Each layout
trains 2 epochs; the second is timed (traces excluded), median step. "kept" is what
the runtime counts each rank keeps for the backward per microbatch
(`history.kept_per_sample` x rows: every layer call's inputs, once each, as this
rank holds them). On a machine with fewer cores than ranks the times are
oversubscribed: compare the bytes, and read the times as relative at best.
"""

import argparse
import os
import time

STEPS = 8


def build(width):
    import keras

    L = keras.layers
    keras.utils.set_random_seed(1)
    inp = keras.Input((width,))
    x = inp
    for b in range(2):
        h = L.Dense(width, activation="relu", name=f"up{b}")(x)
        x = L.Add(name=f"res{b}")([x, L.Dense(width, name=f"down{b}")(h)])
    model = keras.Model(inp, L.Dense(10, name="head")(x))
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def run(width, batch, **layout):
    import keras
    import numpy as np

    import hyparflow as hf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * STEPS, width)).astype("float32")
    y = rng.normal(size=(batch * STEPS, 10)).astype("float32")
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    names = [f"{k}{b}" for b in range(2) for k in ("up", "down")]
    history = hf.fit(build(width), x, y, batch_size=batch, epochs=2, verbose=0,
                     callbacks=[Clock()], tensor_layers=names, **layout)
    step = sorted(times[STEPS:])[STEPS // 2]
    return history.kept_per_sample * batch, step


def main():
    import hyparflow as hf

    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    args = p.parse_args()
    ranks = hf.size()
    rows = []
    for batch in args.batches:
        # One process's: T=1 keeps the same per sample at any replica count.
        whole, _ = run(args.width, batch, num_tensor=1)
        one_d = run(args.width, batch, num_tensor=4)
        mesh = run(args.width, batch, num_tensor=4, tensor_mesh=(2, 2))
        rows.append((batch, whole, one_d, mesh))
    if hf.is_main():
        cores = len(os.sched_getaffinity(0))
        print(f"\nDense stack width {args.width}, T=4 ({ranks} ranks on {cores} cores"
              + (": oversubscribed, times are relative at best)" if cores < ranks else ")"))
        print("| batch | kept, one process (MB) | kept per rank, 1D T=4 (MB) | kept per rank, "
              "2x2 mesh (MB) | 2x2 / 1D | ms/step 1D | ms/step 2x2 |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for batch, whole, (b1, t1), (b2, t2) in rows:
            print(f"| {batch} | {whole / 1e6:.2f} | {b1 / 1e6:.2f} | {b2 / 1e6:.2f} | "
                  f"{b2 / b1:.2f} | {t1 * 1e3:.1f} | {t2 * 1e3:.1f} |")


if __name__ == "__main__":
    main()
