"""Train a small ResNet-style CNN on scikit-learn's digits, hybrid-parallel.

    mpiexec -n 4 python examples/digits_resnet.py            # 2 stages x 2 replicas
    hyparflow run -n 4 --stages 1 examples/digits_resnet.py  # 4 replicas: the launcher's
    python examples/digits_resnet.py --stages 1              # one process

Prints the progress on rank 0 and the held-out accuracy at the end.
"""

import argparse
import os

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def build_model():
    def block(x, filters):
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        y = keras.layers.BatchNormalization(momentum=0.9)(y)
        y = keras.layers.Activation("relu")(y)
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization(momentum=0.9)(y)
        if x.shape[-1] != filters:
            x = keras.layers.Conv2D(filters, 1, use_bias=False)(x)
        return keras.layers.Activation("relu")(keras.layers.Add()([x, y]))

    inputs = keras.Input((8, 8, 1), name="image")
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = block(x, 32)
    x = block(x, 32)
    x = keras.layers.MaxPooling2D()(x)
    x = block(x, 64)
    x = block(x, 64)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="digit")(x)
    return keras.Model(inputs, outputs, name="digits_resnet")


def launched(name, default):
    """The count `hyparflow run` was given (--stages: HYPARFLOW_NUM_STAGES), else `default`."""
    return int(os.environ.get(f"HYPARFLOW_NUM_{name}") or default)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: the launcher's --stages, else 2)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches (default: the launcher's --microbatches, else 4)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--save", default="", help="path of a .keras file to write on rank 0")
    args = parser.parse_args()
    # This command line's layout, else the launcher's, else this example's own.
    stages = args.stages or launched("STAGES", 2)
    microbatches = args.microbatches or launched("MICROBATCHES", 4)

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)

    keras.utils.set_random_seed(0)  # the same initial model on every rank
    model = build_model()
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    hf.fit(model, x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
           num_stages=stages, num_microbatches=microbatches, seed=0,
           verbose=2 if hf.is_main() else 0)

    if hf.is_main():
        # Every rank holds the whole trained model after fit.
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(f"test accuracy {accuracy:.4f} (loss {loss:.4f}) on {len(x_test)} held-out digits, "
              f"{stages} stages x {hf.size() // stages} replicas")
        if args.save:
            model.save(args.save)


if __name__ == "__main__":
    main()
