"""The fastest a two-stage pipeline of the MLP benchmark can run on this machine.

    mpiexec -n 2 python benchmarks/bound.py            # the table
    mpiexec -n 2 python benchmarks/bound.py --steps 20 --microbatches 2 4 8

Issue 40 asks the MLP's pipelines (S=2, M=4 and M=8) to reach 1.0x and 0.9x of plain
Keras `model.fit` on all cores. This measures the ceiling no schedule can pass: each
rank times, at the same moment as the other (so both cores are busy, as in a pipeline),
exactly the work its stage does in one step: M forward and backward passes of its half
of the model (4 Dense(1024) + ReLU) on microbatches of 256 / M rows, with TensorFlow on
one intra-op thread (what each rank runs), then the SGD step on its half of the
weights. The bound's step is the slower rank's sum: a pipeline with no bubble, no
message and no Python between kernels. Stage 0 does not compute its input's gradient
(its input is data); stage 1 takes the loss. The same run times plain `model.fit` on one
process with every core (rank 1 idles without spinning meanwhile).

If the bound's speed relative to `model.fit` is under a target, no schedule reaches
that target on this machine: the per-core kernels at the microbatch's size, not the
pipeline, decide it.
"""

import argparse
import os
import sys
import time

COMM = None
RANK = 0

BATCH, WIDTH, LAYERS = 256, 1024, 8


def idle_barrier():
    """A barrier that sleeps: a spinning wait would take the core the other rank times on."""
    request = COMM.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def stage_work(tf, keras, rows, microbatches, first):
    """A function running one step of a stage: `microbatches` forward and backward passes
    of LAYERS // 2 Dense layers on `rows` rows, then SGD on the stage's weights."""
    keras.utils.set_random_seed(RANK)
    layers = [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS // 2)]
    stage = keras.Sequential([keras.Input((WIDTH,))] + layers)
    optimizer = keras.optimizers.SGD(0.001)
    optimizer.build(stage.trainable_variables)
    x = tf.random.normal((microbatches, rows, WIDTH))
    dy = tf.random.normal((microbatches, rows, WIDTH))

    @tf.function
    def step():
        grads = [tf.zeros_like(v) for v in stage.trainable_variables]
        for k in range(microbatches):
            xk = x[k]
            with tf.GradientTape() as tape:
                tape.watch(xk)
                y = stage(xk, training=True)
                # The last stage's loss is MSE; the first stage receives dy.
                loss = tf.reduce_sum(y * dy[k])
            wanted = stage.trainable_variables if first else [xk] + stage.trainable_variables
            got = tape.gradient(loss, wanted)
            grads = [a + b for a, b in zip(grads, got[-len(grads):])]
        optimizer.apply(grads, stage.trainable_variables)
    return step


def timed(fn, steps):
    fn()
    fn()
    idle_barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def keras_step(tf, keras, steps):
    """Plain model.fit's step on every core (the default thread pools)."""
    import numpy as np
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workloads import mlp
    model, _, _ = mlp()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * (steps + 2), WIDTH)).astype("float32")
    y = rng.standard_normal((BATCH * (steps + 2), WIDTH)).astype("float32")
    model.fit(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, epochs=1, verbose=0)
    start = time.perf_counter()
    model.fit(x[2 * BATCH:], y[2 * BATCH:], batch_size=BATCH, epochs=1, verbose=0,
              shuffle=False)
    return (time.perf_counter() - start) / steps


def main():
    global COMM, RANK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, nargs="*", default=[1, 2, 4, 8])
    args = parser.parse_args()
    from mpi4py import MPI
    COMM, RANK = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    if COMM.Get_size() != 2:
        sys.exit("run it on 2 ranks: mpiexec -n 2 python benchmarks/bound.py")

    # Plain Keras on all cores, in a process of its own (TF fixes its thread pools at
    # first use; this process keeps one intra-op thread, as a rank does).
    reference = _keras_in_child(args.steps) if RANK == 0 else None
    idle_barrier()
    import keras
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows = {}
    for m in args.microbatches:
        step = stage_work(tf, keras, BATCH // m, m, first=(RANK == 0))
        rows[m] = COMM.gather(timed(step, args.steps), root=0)
    if RANK == 0:
        print(f"plain Keras model.fit, all cores: {reference * 1e3:.1f} ms / step "
              f"(batch {BATCH})")
        print("| M | rows | stage 0 ms | stage 1 ms | bound ms / step | bound vs Keras "
              "all cores |")
        print("|---|---:|---:|---:|---:|---:|")
        for m, (s0, s1) in rows.items():
            bound = max(s0, s1)
            print(f"| {m} | {BATCH // m} | {s0 * 1e3:.1f} | {s1 * 1e3:.1f} | "
                  f"{bound * 1e3:.1f} | {reference / bound:.2f}x |")


def _keras_in_child(steps):
    import subprocess
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI", "HYDRA"))}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--keras", str(steps)],
                         capture_output=True, text=True, timeout=600,
                         env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--keras":
        import keras
        import tensorflow as tf
        print(keras_step(tf, keras, int(sys.argv[2])))
    else:
        main()
