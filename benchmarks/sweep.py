"""Sweeps: N small models trained at once, four ways, in samples/s summed over the members.

    python benchmarks/sweep.py                       # digits CNN and MLP-256, N = 1 4 8 16
    python benchmarks/sweep.py --models mlp --n 4 --epochs 3

- fused: `hf.sweep` on one process with every core (the members fused into one model);
- sequential: N `model.fit` calls one after the other in one process, every core;
- array: N concurrent single-thread processes, each its own `model.fit` (a Slurm job
  array's way: one job per config, each with a sliver of the node);
- fused x2: `hf.sweep` under `mpiexec -n 2`, one thread per rank, each rank a fused
  sub-array of N/2 members (N = 1: one member, data parallel over the 2 ranks).

Every run is a fresh process (or processes) on scikit-learn's digits (1797 samples, batch
32), with different learning rates per member. The first epoch (tracing, warm-up) is not
timed; the rate is the members' samples in the other epochs over their wall time (for the
concurrent ways: from a barrier after the first epoch to the last rank's end). Peak
resident memory is the largest process's. Prints a table and writes
benchmarks/sweep_results.json.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
BATCH = 32


# -- the models -----------------------------------------------------------------------------

def build(config):
    import keras

    keras.utils.set_random_seed(config["seed"])
    if config["model"] == "cnn":          # the digits CNN of examples/sweep_digits.py
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
    else:                                  # an MLP of width 256
        inputs = keras.Input((64,))
        x = keras.layers.Dense(256, activation="relu")(inputs)
        x = keras.layers.Dense(256, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(optimizer=keras.optimizers.SGD(config["lr"], momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(model):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")
    return (x[..., None] if model == "cnn" else x.reshape(len(x), 64)), digits.target


def configs(model, n):
    return [dict(model=model, seed=i, lr=0.01 * (1 + i % 8)) for i in range(n)]


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the workers (one fresh process, or ranks under mpiexec, each) ---------------------------

def _timer():
    import keras

    class Timer(keras.callbacks.Callback):
        """Wall time from the start of the second epoch to the end of the last; with
        `barrier`, the processes wait for each other after the first epoch."""

        def __init__(self, barrier=None):
            super().__init__()
            self.barrier, self.start, self.end = barrier, None, None

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                if self.barrier is not None:
                    self.barrier()
                self.start = time.time()
            self.end = time.time()

    return Timer


def worker(way, model, n, epochs):
    import hyparflow as hf

    x, y = data(model)
    samples = n * len(x) * (epochs - 1)
    Timer = _timer()
    if way == "fused":
        timer = Timer()
        hf.sweep(build, configs(model, n), x, y, batch_size=BATCH, epochs=epochs, verbose=0,
                 callbacks=lambda i, c: [timer] if i == 0 else [])
        return {"rate": samples / (timer.end - timer.start), "peak_mb": peak_mb()}
    if way == "sequential":
        seconds = 0.0
        for config in configs(model, n):
            timer = Timer()
            build(config).fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[timer])
            seconds += timer.end - timer.start
        return {"rate": samples / seconds, "peak_mb": peak_mb()}
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if way == "array":                    # rank r: member r alone
        timer = Timer(comm.Barrier)
        build(configs(model, n)[comm.rank]).fit(x, y, batch_size=BATCH, epochs=epochs,
                                                verbose=0, callbacks=[timer])
    else:                                 # "fused2": hf.sweep over 2 ranks
        import numpy as np

        firsts = {int(part[0]) for part in np.array_split(np.arange(n), min(n, comm.size))}
        timer = Timer(comm.Barrier)
        hf.sweep(build, configs(model, n), x, y, batch_size=BATCH, epochs=epochs, verbose=0,
                 num_replicas=2 if n == 1 else 1,
                 callbacks=lambda i, c: [timer] if i in firsts else [])
    times = comm.allgather((timer.start, timer.end, peak_mb()))
    if comm.rank == 0:
        return {"rate": samples / (max(t[1] for t in times) - min(t[0] for t in times)),
                "peak_mb": max(t[2] for t in times)}
    return None


# -- the driver ------------------------------------------------------------------------------

def measure(way, model, n, epochs):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("HYPARFLOW_THREADS", None)
    command = [sys.executable, __file__, "--worker", way, model, str(n), str(epochs)]
    if way in ("array", "fused2"):
        ranks = n if way == "array" else 2
        env["HYPARFLOW_THREADS"] = "1"
        command = [MPIEXEC, "-n", str(ranks)] + command
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


WAYS = (("fused", "fused, 1 process"), ("sequential", "N x model.fit"),
        ("array", "N processes x 1 thread"), ("fused2", "fused, 2 ranks x N/2"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=["cnn", "mlp"])
    parser.add_argument("--n", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--ways", nargs="+", default=[w for w, _ in WAYS],
                        choices=[w for w, _ in WAYS])
    parser.add_argument("--worker", nargs=4, metavar=("WAY", "MODEL", "N", "EPOCHS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        way, model, n, epochs = args.worker
        result = worker(way, model, int(n), int(epochs))
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    print(f"samples/s summed over the members (digits, batch {BATCH}, epochs 2..{args.epochs} "
          f"timed; {os.cpu_count()} cores); peak MB of the largest process in brackets")
    header = f"{'model':6} {'N':>3}  " + "  ".join(f"{label:>23}" for w, label in WAYS
                                                  if w in args.ways) + "  fused / best other"
    print(header)
    for model in args.models:
        for n in args.n:
            row = {"model": model, "n": n}
            for way in args.ways:
                row[way] = measure(way, model, n, args.epochs)
            results.append(row)
            others = [row[w]["rate"] for w in args.ways if w not in ("fused", "fused2")]
            cells = "  ".join(f"{row[w]['rate']:>15,.0f} ({row[w]['peak_mb']:>5.0f})"
                              for w in args.ways)
            gain = (f"{max(row[w]['rate'] for w in ('fused', 'fused2') if w in row) / max(others):.2f}x"
                    if others and ("fused" in row or "fused2" in row) else "")
            print(f"{model:6} {n:>3}  {cells}  {gain:>10}", flush=True)
    with open(os.path.join(HERE, "sweep_results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
