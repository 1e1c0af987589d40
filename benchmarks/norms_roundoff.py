"""How far the fused BatchNormalization (`engine/norms.py`) rounds from Keras's own operations.

    python benchmarks/norms_roundoff.py
    python benchmarks/norms_roundoff.py --counts 4 16 1024 --channels 64 --offset 3

One BatchNormalization training call, on the same float32 input and upstream gradient,
three ways: Keras's operations in float64 (the truth), Keras's operations in float32
(`keras.layers.BatchNormalization`), and the fused path in float32 (`norms.Fused`). Per
count of values per channel n (a batch of n/HW samples on HW-pixel maps), the table gives
each float32 path's largest error against the truth, relative to the largest value of that
quantity: the output y, the gradients of x, gamma and beta, and the moving variance after
the call, and "sum dx": what is left of the input gradient's sum over a channel (exactly
0), relative to the sum of its magnitudes. Inputs are `(offset + N(0, 1)) * scale` (a mean
far from zero against the spread is what a one-pass variance would lose). Both sides run
inside a tf.function, as a stage does (TensorFlow may swap in oneDNN's kernels there).
"""

import argparse

import numpy as np
import tensorflow as tf
import keras

from hyparflow.engine import norms


def layer(channels, dtype, epsilon):
    bn = keras.layers.BatchNormalization(epsilon=epsilon, momentum=0.0, dtype=dtype)
    bn.build((None, 1, 1, channels))
    rng = np.random.default_rng(1)
    bn.gamma.assign(rng.uniform(0.5, 1.5, channels).astype(dtype))
    bn.beta.assign(rng.normal(size=channels).astype(dtype))
    return bn


def training_call(bn, call, x, dy):
    """y and the gradients of sum(y * dy), traced as a stage traces its step (inside a
    tf.function TensorFlow may rewrite the kernels, e.g. to oneDNN's)."""

    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = call(x)
            loss = tf.reduce_sum(y * dy)
        return [y] + tape.gradient(loss, [x, bn.gamma, bn.beta])

    return [np.asarray(v, "float64") for v in step(x, dy) + [bn.moving_variance]]


def keras_call(bn, x, dy):
    return training_call(bn, lambda v: bn(v, training=True), x, dy)


def fused_call(bn, x, dy):
    fused = norms.Fused(bn)
    return training_call(bn, lambda v: fused([v], {}), x, dy)


def errors(got, want):
    return [float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30))
            for g, w in zip(got, want)]


def leak(dx):
    """A normalization's input gradient sums to zero over each channel (a shift of x
    does not change y): what is left of the sum, relative to the sum of |dx|. An
    upstream beta that reaches this layer through linear layers gets it as its gradient,
    whose exact value is 0, and Adam turns its sign into a full step."""
    axes = tuple(range(dx.ndim - 1))
    return float(np.max(np.abs(dx.sum(axes)) / np.abs(dx).sum(axes)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--offset", type=float, default=0.5)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--epsilon", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, default=5, help="inputs drawn per count (worst kept)")
    args = parser.parse_args()
    names = ["y", "dx", "dgamma", "dbeta", "moving var", "sum dx"]
    print(f"channels {args.channels}, x = ({args.offset} + N(0,1)) * {args.scale}, "
          f"epsilon {args.epsilon}; largest |float32 - float64| / largest |float64| over "
          f"{args.seeds} draws")
    head = "| n | " + " | ".join(f"Keras {n} | fused {n}" for n in names) + " |"
    print(head)
    print("|" + "---:|" * (1 + 2 * len(names)))
    for n in args.counts:
        worst = np.zeros((2, len(names)))
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            shape = (n, 1, 1, args.channels) if n <= 64 else (n // 64, 8, 8, args.channels)
            x = ((args.offset + rng.normal(size=shape)) * args.scale).astype("float32")
            dy = rng.normal(size=shape).astype("float32")
            truth = keras_call(layer(args.channels, "float64", args.epsilon),
                               tf.constant(x, tf.float64), tf.constant(dy, tf.float64))
            plain = keras_call(layer(args.channels, "float32", args.epsilon),
                               tf.constant(x), tf.constant(dy))
            fused = fused_call(layer(args.channels, "float32", args.epsilon),
                               tf.constant(x), tf.constant(dy))
            worst[0] = np.maximum(worst[0], errors(plain, truth) + [leak(plain[1])])
            worst[1] = np.maximum(worst[1], errors(fused, truth) + [leak(fused[1])])
        cells = " | ".join(f"{a:.1e} | {b:.1e}" for a, b in zip(worst[0], worst[1]))
        print(f"| {n} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
