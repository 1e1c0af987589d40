"""ResNet-110 (CIFAR-style) on synthetic CIFAR-shaped data, pipelined with the 1F1B schedule.

    hyparflow run -n 2 --stages 2 --microbatches 4 examples/resnet110.py
    hyparflow run -n 4 --stages 2 --microbatches 4 examples/resnet110.py     # 2 x 2
    hyparflow run -n 2 --stages 2 examples/resnet110.py --samples 64 --epochs 1   # quick
    hyparflow run -n 2 --stages 2 --microbatches 4 examples/resnet110.py --trace run.json
    hyparflow trace run.json -o run.png                                            # the timeline

The network of He et al. (2016) for CIFAR-10: a 3x3 convolution, then 3 groups
of 18 basic blocks (two 3x3 convolutions with BatchNorm and a skip connection)
with 16, 32 and 64 filters, global average pooling and a 10-way softmax: 110
layers with weights, 1.7 M parameters. The data are 32x32x3 images made here:
each class is a fixed random pattern, each image that pattern plus noise.
Prints the throughput of the steps after the first (which compiles the stages).
"""

import argparse
import time

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np

L = keras.layers


def basic_block(x, filters, stride):
    y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    y = L.BatchNormalization()(y)
    y = L.Activation("relu")(y)
    y = L.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = L.BatchNormalization()(y)
    if stride != 1 or x.shape[-1] != filters:
        x = L.Conv2D(filters, 1, strides=stride, use_bias=False)(x)  # projection shortcut
    return L.Activation("relu")(L.Add()([x, y]))


def build_model(depth=110, classes=10):
    blocks = (depth - 2) // 6  # 18 for ResNet-110
    inputs = keras.Input((32, 32, 3), name="image")
    x = L.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = L.Activation("relu")(L.BatchNormalization()(x))
    for group, filters in enumerate((16, 32, 64)):
        for block in range(blocks):
            x = basic_block(x, filters, 2 if group and block == 0 else 1)
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(classes, activation="softmax", name="label")(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")


def make_data(samples, classes=10, seed=0):
    """CIFAR-shaped images: a fixed random 32x32x3 pattern per class, plus noise."""
    rng = np.random.default_rng(seed)
    patterns = rng.normal(size=(classes, 32, 32, 3)).astype("float32")
    y = rng.integers(0, classes, size=samples)
    x = patterns[y] + 1.5 * rng.normal(size=(samples, 32, 32, 3)).astype("float32")
    return x.astype("float32"), y.astype("int32")


class Throughput(keras.callbacks.Callback):
    """Times every step; the first (tracing and compiling the stages) is left out."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (default: hyparflow run --stages, else 1)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per replica (default: hyparflow run --microbatches, else 1)")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe", "zb-h1", "zb-batched", "auto"),
                        default="1f1b")
    parser.add_argument("--balance", choices=("estimate", "time", "params", "memory"),
                        default="estimate", help="how to cut the layers into stages (see docs/planning.md)")
    parser.add_argument("--recompute", action="store_true",
                        help="keep only each stage's inputs and recompute its forward in the backward")
    parser.add_argument("--depth", type=int, default=110, help="6n+2: 110, 56, 20 ...")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--trace", default=None,
                        help="write a timeline of every rank's actions here (JSON; draw it with "
                             "`hyparflow trace FILE -o FILE.png`)")
    parser.add_argument("--save", default="", help="path of a .keras file to write on rank 0")
    args = parser.parse_args()

    x, y = make_data(args.samples)
    keras.utils.set_random_seed(0)  # the same initial model on every rank
    model = build_model(args.depth)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    timer = Throughput()
    history = hf.fit(model, x, y, batch_size=args.batch_size, epochs=args.epochs,
                     num_stages=args.stages, num_microbatches=args.microbatches,
                     schedule=args.schedule, balance=args.balance, recompute=args.recompute, seed=0, callbacks=[timer], trace=args.trace,
                     verbose=2 if hf.is_main() else 0)

    if hf.is_main():
        steps = len(timer.ends) - 1
        if steps > 0:
            seconds = timer.ends[-1] - timer.ends[0]
            per_epoch = [min(args.batch_size, args.samples - i)
                         for i in range(0, args.samples, args.batch_size)]
            samples = sum((per_epoch * args.epochs)[1:len(timer.ends)])
            speed = f"{samples / seconds:.1f} samples/s ({seconds / steps:.3f} s/step over {steps} steps after the first)"
        else:
            speed = "n/a samples/s (one step only: give more --samples or --epochs)"
        print(f"{model.name}: {model.count_params():,} parameters, {len(model.layers)} layers; "
              f"final training accuracy {history.history['accuracy'][-1]:.3f}")
        print(f"resnet110: {speed}, schedule {args.schedule}, {hf.size()} ranks")
        if args.save:
            model.save(args.save)


if __name__ == "__main__":
    main()
