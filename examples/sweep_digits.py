"""A learning-rate sweep of a small CNN on scikit-learn's digits, as one fused job.

    python examples/sweep_digits.py                      # 8 learning rates x 2 seeds, one process
    mpiexec -n 2 python examples/sweep_digits.py         # the 16 members shared out over 2 ranks
    hyparflow slurm --sweep configs.json --tasks-per-node 4 examples/sweep_digits.py

Every member is the model its own `model.fit` would train (the same weights); hf.sweep
trains them together, fused layer by layer. Prints a table of the final held-out
accuracies (learning rates down, seeds across) on rank 0.
"""

import argparse

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

LEARNING_RATES = [0.003, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5]


def build(config):
    """One member: a small CNN trained by SGD with momentum at the config's learning rate."""
    keras.utils.set_random_seed(config["seed"])
    inputs = keras.Input((8, 8, 1), name="image")
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(config.get("dropout", 0.1))(x)
    outputs = keras.layers.Dense(10, name="digit")(x)
    model = keras.Model(inputs, outputs, name="digits_cnn")
    model.compile(optimizer=keras.optimizers.SGD(config["learning_rate"], momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=2, help="seeds per learning rate")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)

    # The job's configs when `hyparflow slurm --sweep configs.json` launched this script.
    configs = hf.sweeps.job_configs([dict(learning_rate=lr, seed=seed)
                                     for lr in LEARNING_RATES for seed in range(args.seeds)])
    models, histories = hf.sweep(build, configs, x_train, y_train, batch_size=args.batch_size,
                                 epochs=args.epochs, validation_data=(x_test, y_test),
                                 verbose=2 if hf.is_main() else 0)

    if hf.is_main():
        # Every rank holds every trained member after the sweep.
        accuracy = [m.evaluate(x_test, y_test, verbose=0)[1] for m in models]
        rates = sorted({c["learning_rate"] for c in configs})
        seeds = sorted({c["seed"] for c in configs})
        print("\nheld-out accuracy: learning rate down, seed across")
        print("   rate  " + "  ".join(f"seed {s}" for s in seeds))
        for lr in rates:
            row = [next((a for c, a in zip(configs, accuracy)
                         if c["learning_rate"] == lr and c["seed"] == s), float("nan"))
                   for s in seeds]
            print(f"{lr:7.3g}  " + "  ".join(f"{a:6.4f}" for a in row))
        best = int(np.argmax(accuracy))
        print(f"sweep_digits: best learning rate {configs[best]['learning_rate']:g} (seed "
              f"{configs[best]['seed']}): test accuracy {accuracy[best]:.4f}, {len(configs)} "
              f"members on {hf.size()} rank(s)")


if __name__ == "__main__":
    main()
