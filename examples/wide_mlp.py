"""A wide MLP whose weights and Adam state do not fit one rank's memory budget, split into stages.

    hyparflow run -n 2 --stages 2 examples/wide_mlp.py                # every rank fits
    hyparflow run -n 2 --tensor 2 examples/wide_mlp.py                # the wide layers split
    hyparflow run -n 1 examples/wide_mlp.py                           # one rank: over budget
    hyparflow run -n 2 --stages 2 examples/wide_mlp.py --samples 512 --epochs 1   # quick

The model's widest layers (--width units, --depth of them) hold most of its
parameters. With Adam every trainable weight has two slots of the same size, so
one rank needs 3x the weights' bytes. Each pipeline stage keeps only its own
layers' weights and optimizer state, so with 2 stages each rank holds about half;
with --tensor 2 both ranks run every layer but each holds half of every wide layer.
After training, every rank sums the bytes of its stage's trainable weights and of
its `model.optimizer.variables` (numpy nbytes), and rank 0 prints them next to the
budget (--budget-mb) and what one rank would need without stages.
"""

import argparse
import os
import resource

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np
from mpi4py import MPI

MB = 2 ** 20


def build_model(features, width, depth, outputs):
    inputs = keras.Input((features,), name="features")
    x = keras.layers.Dense(width // 4, activation="relu", name="narrow_in")(inputs)
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"wide_{i}")(x)
    x = keras.layers.Dense(width // 4, activation="relu", name="narrow_out")(x)
    y = keras.layers.Dense(outputs, name="target")(x)
    return keras.Model(inputs, y, name="wide_mlp")


def make_data(samples, features, outputs, seed=0):
    """A smooth nonlinear function of the inputs (a fixed random two-layer net) plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    w1 = rng.normal(size=(features, 64)) / np.sqrt(features)
    w2 = rng.normal(size=(64, outputs)) / np.sqrt(64)
    y = np.tanh(x @ w1) @ w2 + 0.05 * rng.normal(size=(samples, outputs))
    return x, y.astype("float32")


def nbytes(variables):
    return sum(v.numpy().nbytes for v in variables)


def stage_weights(model):
    """This rank's trainable weights and their bytes: those its optimizer keeps state for.

    hf.fit builds each rank's `model.optimizer` on its own stage's variables only (and
    on its part of each split layer), and Keras names a slot after its variable:
    `<path, "/" as "_">_<slot>` (`wide_0_kernel_momentum`); the longest matching path
    wins. Adam's first slot has the shape of what the rank trains, so its bytes are the
    rank's bytes of that weight."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", v) for v in model.trainable_weights),
                      key=lambda p: -len(p[0]))
    mine = {}
    for slot in model.optimizer.variables:
        for prefix, v in prefixes:
            if slot.name.startswith(prefix):
                mine.setdefault(v.path, slot.numpy().nbytes)
                break
    return mine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: hyparflow run --stages, else 1)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per replica (default: hyparflow run --microbatches, else 1)")
    parser.add_argument("--budget-mb", type=float, default=80.0,
                        help="memory per rank for weights + optimizer state, MiB (default 80)")
    parser.add_argument("--width", type=int, default=2048, help="units of the wide layers")
    parser.add_argument("--depth", type=int, default=3, help="number of wide layers")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--save", default="", help="path of a .keras file to write on rank 0")
    args = parser.parse_args()

    x, y = make_data(args.samples, args.features, outputs=8)
    keras.utils.set_random_seed(0)  # the same initial model on every rank
    model = build_model(args.features, args.width, args.depth, outputs=8)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")

    # balance="params" cuts the layers so that every stage holds about the same
    # number of parameters (the default balances estimated compute instead).
    history = hf.fit(model, x, y, batch_size=args.batch_size, epochs=args.epochs,
                     num_stages=args.stages, num_microbatches=args.microbatches,
                     balance="params", seed=0, verbose=2 if hf.is_main() else 0)

    stages = args.stages or int(os.environ.get("HYPARFLOW_NUM_STAGES") or 1)
    tensor = int(os.environ.get("HYPARFLOW_NUM_TENSOR") or 1)
    mine = stage_weights(model)
    rank = hf.rank()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak
    row = (rank, (rank // tensor) % stages, rank // (stages * tensor), list(mine),
           sum(mine.values()), nbytes(model.optimizer.variables), peak)
    rows = MPI.COMM_WORLD.gather(row, root=0)

    if hf.is_main():
        budget = args.budget_mb * MB
        # What one rank holds without stages: every weight plus a full Adam's state.
        whole = keras.optimizers.Adam()
        whole.build(model.trainable_variables)
        single = nbytes(model.trainable_variables) + nbytes(whole.variables)
        print(f"model: {model.count_params():,} parameters ({nbytes(model.trainable_variables) / MB:.1f} MiB "
              f"float32); final loss {history.history['loss'][-1]:.4f} (predicting the mean: "
              f"{float(y.var(axis=0).mean()):.4f})")
        print(f"per-rank weights + optimizer state, budget {args.budget_mb:g} MiB:")
        for rank, stage, replica, paths, w, o, peak in rows:
            layers = sorted({p.split("/")[0] for p in paths})
            print(f"  rank {rank} (stage {stage}, replica {replica}): weights {w / MB:6.1f} MiB + "
                  f"optimizer {o / MB:6.1f} MiB = {(w + o) / MB:6.1f} MiB  "
                  f"{'fits' if w + o <= budget else 'OVER BUDGET'}  (process peak "
                  f"{peak / MB:.0f} MiB)  [{', '.join(layers)}]")
        largest = max(w + o for *_, w, o, _ in rows)
        if largest <= budget:
            verdict = f"every rank fits the {args.budget_mb:g} MiB budget (largest {largest / MB:.1f} MiB)"
        else:
            verdict = (f"a rank is OVER the {args.budget_mb:g} MiB budget (largest "
                       f"{largest / MB:.1f} MiB; use more stages)")
        layout = f"{stages} stage(s)" + (f" x {tensor} tensor ranks" if tensor > 1 else "")
        print(f"wide_mlp: with {layout} {verdict}; one rank without stages would need "
              f"{single / MB:.1f} MiB ({'over' if single > budget else 'within'} budget)")
        if args.save:
            model.save(args.save)


if __name__ == "__main__":
    main()
