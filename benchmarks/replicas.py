"""Time and bytes to a held-out accuracy: allreduce vs LocalSGD vs LeaderSGD.

    mpiexec -n 4 python benchmarks/replicas.py                 # R = 4 replicas, 1 stage
    mpiexec -n 4 python benchmarks/replicas.py --target 0.97 --max-epochs 20 --seed 1
    mpiexec -n 4 python benchmarks/replicas.py --workload resnet --target 0.9 --max-epochs 12

Two workloads (`--workload`). `digits`: the digits CNN of examples/digits_resnet.py
(BatchNorm included) on scikit-learn's digits, 360 of them held out. `resnet`: a
CIFAR-shaped ResNet-8 (He et al.'s CIFAR ResNet with one basic block per group, 16/32/64
filters, 78,330 weights) on CIFAR-shaped images made here (`cifar_like`: each of 10 classes
a smooth random colour pattern, each image its class's pattern shifted, scaled, tinted and
drowned in noise; `--samples` of them to train, 1,000 held out); nothing is downloaded.
Global batch 64 (16 per replica), Adam. Each method trains from the same
initial weights until the agreed model (allreduce: the model; LocalSGD: the replicas'
mean; LeaderSGD: the global leader's) reaches `--target` accuracy on the held-out
set, checked at every epoch end, or until `--max-epochs`. Printed per method (rank 0):
epochs and steps to the target, wall seconds to it (training and the epoch-end check),
and the bytes that came into a rank for the replicas to agree, per rank on average:
allreduce 2 (R-1)/R of the gradients every step (a ring's share), LocalSGD the same of
the weights and BatchNorm statistics at every averaging, LeaderSGD the leader's weights
into every other replica of the group at each pull (hyparflow.replicas counts them). With
`--groups 2` the multi-leader LeaderSGD splits the replicas into two groups, as two hosts
would; by default the groups are the hosts (`mpiexec -hosts h1:2,h2:2`: two leaders).
`--json FILE` writes the rows.

    HYPARFLOW_EMU_RATE=100mbit bash scripts/emulated-cluster.sh up 2
    eval "$(bash scripts/emulated-cluster.sh env)"
    mpiexec -hosts hfnode1:2,hfnode2:2 -n 4 python benchmarks/replicas.py
"""

import argparse
import json
import os
import sys
import time

import hyparflow as hf  # first: quiets TensorFlow and sets threads per rank
import keras
import numpy as np
from mpi4py import MPI
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import digits_resnet  # noqa: E402


class UntilTarget(keras.callbacks.Callback):
    """Stops at the first epoch end whose held-out accuracy reaches `target`; notes the
    wall time of every epoch end."""

    def __init__(self, target):
        super().__init__()
        self.target, self.reached, self.ends = target, None, []

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append((time.perf_counter() - self.start, logs["val_accuracy"]))
        if self.reached is None and logs["val_accuracy"] >= self.target:
            self.reached = epoch + 1
            self.model.stop_training = True


L = keras.layers


def _basic_block(x, filters, stride):
    y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    y = L.Activation("relu")(L.BatchNormalization(momentum=0.9)(y))
    y = L.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = L.BatchNormalization(momentum=0.9)(y)
    if stride != 1 or x.shape[-1] != filters:
        x = L.Conv2D(filters, 1, strides=stride, use_bias=False)(x)  # projection shortcut
    return L.Activation("relu")(L.Add()([x, y]))


def resnet_model(depth=8, width=16):
    """He et al.'s CIFAR ResNet: 3 groups of (depth - 2) / 6 basic blocks with width, 2 x width
    and 4 x width filters. BatchNorm momentum 0.9 (Keras's 0.99 leaves the held-out accuracy
    of these short runs to moving statistics that lag the weights by epochs)."""
    inputs = keras.Input((32, 32, 3), name="image")
    x = L.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    x = L.Activation("relu")(L.BatchNormalization(momentum=0.9)(x))
    for group, filters in enumerate((width, 2 * width, 4 * width)):
        for block in range((depth - 2) // 6):
            x = _basic_block(x, filters, 2 if group and block == 0 else 1)
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(10, activation="softmax", name="label")(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")


def cifar_like(samples, seed, classes=10, noise=2.0, shift=8):
    """`samples` CIFAR-shaped images (32x32x3 float32) and their labels (int32). The classes
    are the same for every seed: each a smooth random colour pattern (8x8 normal values
    blown up to 32x32 and blurred). An image is its class's pattern moved by up to `shift`
    pixels either way (wrapping round), scaled by 0.5..1.5, tinted (a normal offset per
    channel, sd 0.5) and given normal noise of sd `noise` per value: learnable by a small
    ResNet in a few epochs (translation is what convolutions and pooling are for), not by
    reading single pixels. `seed` draws the images."""
    task = np.random.default_rng(2019)
    patterns = np.kron(task.normal(size=(classes, 8, 8, 3)), np.ones((1, 4, 4, 1)))
    for axis in (1, 2):
        patterns = (patterns + np.roll(patterns, 1, axis) + np.roll(patterns, -1, axis)) / 3
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, samples)
    dy, dx = rng.integers(-shift, shift + 1, (2, samples, 1, 1))
    rows = (np.arange(32)[None, :, None] - dy) % 32
    cols = (np.arange(32)[None, None, :] - dx) % 32
    x = patterns[y[:, None, None], rows, cols]
    x = x * rng.uniform(0.5, 1.5, (samples, 1, 1, 1)) + rng.normal(0, 0.5, (samples, 1, 1, 3))
    x = x + rng.normal(0, noise, x.shape)
    return x.astype("float32"), y.astype("int32")


def workload(name, samples=4000):
    """(label, model builder, (x_train, y_train, x_test, y_test)) of `--workload name`."""
    if name == "digits":
        digits = load_digits()
        x = (digits.images / 16.0).astype("float32")[..., None]
        x_train, x_test, y_train, y_test = train_test_split(
            x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
        return "digits CNN", digits_resnet.build_model, (x_train, y_train, x_test, y_test)
    if name == "resnet":
        x_train, y_train = cifar_like(samples, seed=1)
        x_test, y_test = cifar_like(1000, seed=2)
        return ("CIFAR-shaped ResNet-8", resnet_model, (x_train, y_train, x_test, y_test))
    raise ValueError(f"--workload {name!r}: give 'digits' or 'resnet'")


def methods(groups, every):
    where = f"{groups} groups" if groups else "a group per host"
    return {
        "allreduce": "allreduce",
        f"LocalSGD(every={every})": hf.LocalSGD(every=every),
        f"LeaderSGD single leader (every {every})": hf.LeaderSGD(
            pull=0.2, local_every=None, global_every=every),
        f"LeaderSGD {where} (local {every}, global {4 * every})": hf.LeaderSGD(
            pull=0.2, local_every=every, global_every=4 * every, groups=groups or None),
    }


def run(name, method, build, data, args):
    x_train, y_train, x_test, y_test = data
    keras.utils.set_random_seed(args.seed)
    model = build()
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    stop = UntilTarget(args.target)
    history = hf.fit(model, x_train, y_train, batch_size=args.batch_size, epochs=args.max_epochs,
                     num_stages=1, validation_data=(x_test, y_test), callbacks=[stop],
                     replica_sync=method, seed=args.seed, verbose=0)
    ranks = hf.size()
    steps_per_epoch = -(-len(x_train) // args.batch_size)
    epochs = stop.reached or len(stop.ends)
    if method == "allreduce":
        per_rank = 2 * (ranks - 1) / ranks * 4 * trainable * steps_per_epoch * epochs
    else:
        per_rank = np.mean(MPI.COMM_WORLD.allgather(history.replicas["received_bytes"]))
    return {"method": name, "reached": stop.reached is not None, "epochs": epochs,
            "steps": epochs * steps_per_epoch, "seconds": stop.ends[epochs - 1][0],
            "bytes_per_rank": float(per_rank), "accuracy": stop.ends[epochs - 1][1],
            "curve": [round(a, 4) for _, a in stop.ends]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--max-epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--every", type=int, default=4, help="steps between meetings")
    parser.add_argument("--groups", type=int, default=0,
                        help="groups of the multi-leader run (default: one per host)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=("digits", "resnet"), default="digits")
    parser.add_argument("--samples", type=int, default=4000,
                        help="training images of --workload resnet (1,000 more are held out)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    label, build, data = workload(args.workload, args.samples)
    x_train, y_train, x_test, y_test = data
    # Untimed: the process's first fit starts TensorFlow's kernels and thread pools,
    # which would be charged to whichever method came first.
    warm = build()
    warm.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    hf.fit(warm, x_train, y_train, batch_size=args.batch_size, epochs=1, steps_per_epoch=3,
           num_stages=1, validation_data=(x_test, y_test), verbose=0)
    rows = [run(name, method, build, data, args)
            for name, method in methods(args.groups, args.every).items()]
    if hf.is_main():
        print(f"{label}, {hf.size()} replicas, batch {args.batch_size}, target held-out "
              f"accuracy {args.target} (max {args.max_epochs} epochs), seed {args.seed}")
        print(f"{'method':<48} {'epochs':>6} {'steps':>6} {'seconds':>8} {'MB/rank':>8} "
              f"{'accuracy':>8}")
        for row in rows:
            mark = "" if row["reached"] else "  (not reached)"
            print(f"{row['method']:<48} {row['epochs']:>6} {row['steps']:>6} "
                  f"{row['seconds']:>8.1f} {row['bytes_per_rank'] / 1e6:>8.2f} "
                  f"{row['accuracy']:>8.3f}{mark}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "ranks": hf.size(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
