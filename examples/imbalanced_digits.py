"""Class-balanced feature mixing on step-imbalanced digits, hybrid-parallel.

    hyparflow run -n 2 --stages 2 examples/imbalanced_digits.py   # 2 stages (the default)
    python examples/imbalanced_digits.py --stages 1               # one process

scikit-learn's digits with a step imbalance: classes 0-4 keep every training sample,
classes 5-9 keep 10% of theirs (`--keep`). The same CNN is trained twice from the same
initial weights: without mixing, then with `hf.layers.ClassBalancedMix`, which mixes the
features of samples of the frequent classes with those of other samples of the batch
(rates from the class counts: the rare classes are not mixed). Prints the held-out
(balanced) accuracy of every class both ways, and the rare classes' mean, each the mean
over `--seeds` initialisations (the rare classes have a dozen training samples each, so
one run's accuracies swing by 0.2 from seed to seed).
"""

import argparse
import os

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

CLASSES = 10
RARE = range(5, 10)


def build_model(rates):
    """A small CNN whose penultimate features go through ClassBalancedMix (rates all 0:
    no mixing); the labels are a second input, read only in training."""
    image = keras.Input((8, 8, 1), name="image")
    label = keras.Input((1,), dtype="int32", name="label")
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(image)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(64, activation="relu", name="features")(x)
    x = hf.layers.ClassBalancedMix(rates, name="mix")([x, label])
    digit = keras.layers.Dense(CLASSES, activation="softmax", name="digit")(x)
    return keras.Model({"image": image, "label": label}, digit, name="imbalanced_digits")


def launched(name, default):
    """The count `hyparflow run` was given (--stages: HYPARFLOW_NUM_STAGES), else `default`."""
    return int(os.environ.get(f"HYPARFLOW_NUM_{name}") or default)


def step_imbalance(x, y, keep, seed=0):
    """Keep every sample of classes 0-4 and a `keep` share of those of classes 5-9."""
    rng = np.random.default_rng(seed)
    chosen = []
    for c in range(CLASSES):
        members = np.flatnonzero(y == c)
        if c in RARE:
            members = rng.choice(members, max(1, int(round(keep * len(members)))), replace=False)
        chosen.append(members)
    order = rng.permutation(np.concatenate(chosen))
    return x[order], y[order]


def per_class_accuracy(model, x, y):
    predicted = np.argmax(model.predict({"image": x, "label": np.zeros((len(x), 1), "int32")},
                                        verbose=0, batch_size=256), axis=1)
    return np.array([np.mean(predicted[y == c] == c) for c in range(CLASSES)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: the launcher's --stages, else 2)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches (default: the launcher's --microbatches, else 1: "
                             "the mixing partner comes from the whole batch)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--keep", type=float, default=0.1,
                        help="share of the rare classes' training samples kept (default 0.1)")
    parser.add_argument("--strength", type=float, default=0.3,
                        help="mixing rate of the most frequent class, at most (default 0.3)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="initialisations to average over (default 3)")
    args = parser.parse_args()
    stages = args.stages or launched("STAGES", 2)
    microbatches = args.microbatches or launched("MICROBATCHES", 1)

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.3, random_state=0, stratify=digits.target)
    x_train, y_train = step_imbalance(x_train, y_train, args.keep)
    counts = np.bincount(y_train, minlength=CLASSES)

    results = {}
    for name, rates in (("without mixing", [0.0] * CLASSES),
                        ("with mixing", hf.layers.ClassBalancedMix.from_counts(
                            counts, args.strength).rates)):
        runs = []
        for seed in range(args.seeds):
            keras.utils.set_random_seed(seed)  # the same initial model on every rank, both ways
            model = build_model(rates)
            model.compile(optimizer=keras.optimizers.Adam(2e-3),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
            hf.fit(model, {"image": x_train, "label": y_train[:, None].astype("int32")},
                   y_train, batch_size=args.batch_size, epochs=args.epochs, num_stages=stages,
                   num_microbatches=microbatches, seed=seed, verbose=0)
            runs.append(per_class_accuracy(model, x_test, y_test))  # every rank holds it
        results[name] = np.mean(runs, axis=0)

    if hf.is_main():
        print(f"training samples per class: {counts.tolist()} (classes 5-9 keep "
              f"{args.keep:.0%}); {stages} stages x {hf.size() // stages} replicas, "
              f"{microbatches} microbatch(es)")
        print("class          " + " ".join(f"{c:>5d}" for c in range(CLASSES)))
        for name, accuracy in results.items():
            print(f"{name:<15}" + " ".join(f"{a:5.2f}" for a in accuracy))
        rare = {name: float(np.mean(a[list(RARE)])) for name, a in results.items()}
        print(f"imbalanced_digits: rare classes' held-out accuracy {rare['without mixing']:.3f} "
              f"without mixing, {rare['with mixing']:.3f} with mixing (mean of {args.seeds} "
              f"seed{'s' if args.seeds != 1 else ''})")


if __name__ == "__main__":
    main()
