"""1D tensor split (Megatron pairs) vs a 2x2 tensor mesh (Optimus/SUMMA) at T=4: what
each rank holds (weights, Adam's state, activations kept for the backward, as the
runtime counts them: `History.memory`), the largest batch under a per-rank budget,
bytes exchanged per step against the formulas, and time per step; plain Keras on one
thread and on all cores in the same run.

    mpiexec -n 4 python benchmarks/mesh.py [--model gpt|dense] [--batches 32 64 128]

`--model gpt` (default): a GPT-style stack of 2 pre-norm blocks, width 512, sequence
128, 8 heads with a causal mask, feed-forward 2048 (GELU), and a per-token Dense(16)
head, MSE. The split layers in both layouts are the attention layers (1D: heads over
the ranks, a column/row pair; the mesh: projections by SUMMA, heads over its columns)
and the feed-forward pairs (`up*`, `down*`); on the mesh each block is then one region
(attention, residuals, LayerNormalizations, feed-forward), gathered whole only for the
head. `--attention whole` leaves attention whole (replicated) in both, the feed-forward
region alone on the mesh. `--model dense`: input
512, two residual blocks Dense(512, relu) -> Dense(512) -> Add, a Dense(10) head.

Adam, one microbatch, `--steps` steps per epoch, 2 epochs; the second is timed (traces
excluded), median step. "kept" is what the runtime counts each rank keeps for the
backward per microbatch (every layer call's inputs, once each, as this rank holds
them; an attention's own intermediates are not layer-call inputs and not counted).
"state + kept" is the weights and optimizer state plus kept x batch: the planner's
memory model for one microbatch, as the runtime holds it (the process's resident size
adds TensorFlow's own, the same in both layouts, and in one process cannot be told
apart per layout). On a machine with fewer cores than ranks the times are
oversubscribed: compare the bytes, and read the times as relative at best.
"""

import argparse
import json
import os
import subprocess
import sys
import time

Q = 2


def build(kind, width, seq):
    import keras

    L = keras.layers
    keras.utils.set_random_seed(1)
    if kind == "dense":
        inp = keras.Input((width,))
        x = inp
        for b in range(2):
            h = L.Dense(width, activation="relu", name=f"up{b}")(x)
            x = L.Add(name=f"res{b}")([x, L.Dense(width, name=f"down{b}")(h)])
        out = L.Dense(10, name="head")(x)
    else:
        inp = keras.Input((seq, width))
        x = inp
        for b in range(2):
            h = L.LayerNormalization(name=f"ln{b}a")(x)
            h = L.MultiHeadAttention(8, width // 8, name=f"attn{b}")(h, h, use_causal_mask=True)
            x = L.Add(name=f"res{b}a")([x, h])
            h = L.LayerNormalization(name=f"ln{b}b")(x)
            h = L.Dense(4 * width, activation="gelu", name=f"up{b}")(h)
            x = L.Add(name=f"res{b}b")([x, L.Dense(width, name=f"down{b}")(h)])
        out = L.Dense(16, name="head")(L.LayerNormalization(name="lnf")(x))
    model = keras.Model(inp, out)
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    return model


def data(kind, width, seq, batch, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (width,) if kind == "dense" else (seq, width)
    x = rng.normal(size=(batch * steps, *shape)).astype("float32")
    y = rng.normal(size=(batch * steps, *shape[:-1], 10 if kind == "dense" else 16))
    return x, y.astype("float32")


def clock(times):
    import keras

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    return Clock()


class Counter:
    """Bytes this rank sends point to point (every split layer's exchange is made of
    `isend`s) during the second epoch."""

    def __init__(self):
        from hyparflow.engine import comm

        self.on, self.sent, self.cls = False, 0, comm.MPICommunicator
        original = self.cls.isend

        def isend(this, buf, dest, tag):
            if self.on:
                self.sent += getattr(buf, "nbytes", 0)
            return original(this, buf, dest, tag)

        self.cls.isend = isend

    def callback(self, steps):
        import keras

        counter = self

        class Count(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                counter.on, counter.sent = epoch == 1, 0

            def on_epoch_end(self, epoch, logs=None):
                counter.per_step = counter.sent / steps
                counter.on = False

        return Count()


def run(args, batch, counter, **layout):
    import hyparflow as hf

    x, y = data(args.model, args.width, args.seq, batch, args.steps)
    times = []
    kinds = ("up", "down") + (("attn",) if args.attention == "split" else ())
    names = [f"{k}{b}" for b in range(2) for k in kinds if args.model == "gpt" or k != "attn"]
    history = hf.fit(build(args.model, args.width, args.seq), x, y, batch_size=batch, epochs=2,
                     verbose=0, callbacks=[clock(times), counter.callback(args.steps)],
                     tensor_layers=names if layout.get("num_tensor", 1) > 1 else None,
                     **layout)
    step = sorted(times[args.steps:])[args.steps // 2]
    return dict(history.memory, step=step, sent=counter.per_step)


def formula(args, batch, mesh):
    """Bytes a rank sends per step by the formulas, for the split layers: the mesh's
    3 (q - 1) / q^2 (X + W) per SUMMA product (`costmodel.summa_bytes`; attention makes
    four, of a quarter of its weights each), 1D's 2 (T - 1) / T of the whole activation
    per sum (a pair's output forward, its input's gradient backward; attention is one
    pair), as a ring allreduce would send it."""
    from hyparflow.planning.costmodel import summa_bytes

    rows = batch * (1 if args.model == "dense" else args.seq)
    hidden = args.width * (1 if args.model == "dense" else 4)
    total = 0.0
    attention = args.model == "gpt" and args.attention == "split"
    for _ in range(2):
        if mesh:
            for fan_in, fan_out in ((args.width, hidden), (hidden, args.width)):
                total += summa_bytes(Q, 4 * rows * fan_in, 4 * fan_in * fan_out)
            if attention:
                w = args.width
                total += 4 * summa_bytes(Q, 4 * rows * w, 4 * w * w)
        else:
            pairs = 2 if attention else 1
            total += pairs * 2 * 2 * (Q * Q - 1) / (Q * Q) * 4 * rows * args.width
    return total


def keras_row(args, batch, threads):
    """Plain model.fit in a process of its own with `threads` intra-op threads (no MPI:
    the launcher's variables removed), while the ranks wait asleep."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "HYDRA_", "MPI", "OMPI_", "PMIX_"))}
    out = subprocess.run([sys.executable, __file__, "--keras", str(threads), "--model",
                          args.model, "--width", str(args.width), "--seq", str(args.seq),
                          "--steps", str(args.steps), "--batches", str(batch)],
                         capture_output=True, text=True, env=env, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(lines[-1])["step"]


def keras_main(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.keras)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    [batch] = args.batches
    x, y = data(args.model, args.width, args.seq, batch, args.steps)
    times = []
    build(args.model, args.width, args.seq).fit(x, y, batch_size=batch, epochs=2, verbose=0,
                                                shuffle=False, callbacks=[clock(times)])
    print(json.dumps({"step": sorted(times[args.steps:])[args.steps // 2]}))


def waiting(fn):
    """`fn()` on rank 0 while the others wait asleep (MPICH's blocking barrier spins,
    which would take the cores the plain Keras rows are timed on)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    result = fn() if world.Get_rank() == 0 else None
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01)
    return world.bcast(result, root=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["gpt", "dense"], default="gpt")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--attention", choices=["split", "whole"], default="split")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--memory-limit", type=float, default=256 * 2 ** 20,
                   help="bytes per rank for the largest-batch column (default 256 MiB)")
    p.add_argument("--keras", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.keras:
        return keras_main(args)
    import hyparflow as hf

    counter = Counter()
    ranks, cores = hf.size(), len(os.sched_getaffinity(0))
    rows = []
    started = time.perf_counter()

    def done(what):  # progress, on standard error: a run takes minutes
        if hf.is_main():
            print(f"batch {batch}: {what} at {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)

    for batch in args.batches:
        one_d = run(args, batch, counter, num_tensor=Q * Q)
        done(f"1D {one_d['step'] * 1e3:.0f} ms/step")
        mesh = run(args, batch, counter, num_tensor=Q * Q, tensor_mesh=(Q, Q))
        done(f"2x2 {mesh['step'] * 1e3:.0f} ms/step")
        plain = [waiting(lambda: keras_row(args, batch, n)) for n in (1, cores)]
        done(f"Keras {plain[0] * 1e3:.0f} / {plain[1] * 1e3:.0f} ms/step")
        rows.append((batch, one_d, mesh, plain))
    if not hf.is_main():
        return
    shape = (f"GPT-style stack, 2 blocks, width {args.width}, sequence {args.seq}, "
             f"attention {args.attention}"
             if args.model == "gpt" else f"Dense stack width {args.width}")
    print(f"\n{shape}, T=4 ({ranks} ranks on {cores} cores"
          + (": oversubscribed, times are relative at best)" if cores < ranks else ")"))
    mb = lambda v: f"{v / 2 ** 20:.1f}"  # noqa: E731
    print("| batch | kept/rank 1D (MiB) | kept/rank 2x2 | 2x2 / 1D | state + kept 1D (MiB) "
          "| state + kept 2x2 | sent/step 1D (MiB), formula | sent/step 2x2, formula "
          "| ms/step 1D | ms/step 2x2 | Keras 1 thread | Keras all cores |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, a, b, (k1, kn) in rows:
        peak = [r["weights"] + r["optimizer"] + r["kept_per_sample"] * batch for r in (a, b)]
        print(f"| {batch} | {mb(a['kept_per_sample'] * batch)} | {mb(b['kept_per_sample'] * batch)}"
              f" | {b['kept_per_sample'] / a['kept_per_sample']:.2f} | {mb(peak[0])} | "
              f"{mb(peak[1])} | {mb(a['sent'])}, {mb(formula(args, batch, False))} | "
              f"{mb(b['sent'])}, {mb(formula(args, batch, True))} | {a['step'] * 1e3:.0f} | "
              f"{b['step'] * 1e3:.0f} | {k1 * 1e3:.0f} | {kn * 1e3:.0f} |")
    limit = args.memory_limit
    a, b = rows[-1][1], rows[-1][2]
    fit = [int((limit - r["weights"] - r["optimizer"]) // r["kept_per_sample"]) for r in (a, b)]
    print(f"\nper rank: weights {mb(a['weights'])} MiB 1D, {mb(b['weights'])} MiB 2x2; Adam's "
          f"state {mb(a['optimizer'])} / {mb(b['optimizer'])} MiB; kept per sample "
          f"{a['kept_per_sample'] / 2 ** 10:.0f} / {b['kept_per_sample'] / 2 ** 10:.0f} KiB")
    print(f"largest batch within memory_limit {mb(limit)} MiB per rank (one microbatch): "
          f"1D {fit[0]}, 2x2 {fit[1]} ({fit[1] / max(fit[0], 1):.2f}x)")


if __name__ == "__main__":
    main()
