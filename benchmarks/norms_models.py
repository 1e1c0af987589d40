"""How far keras.applications models end from `model.fit` with and without the fused
BatchNormalization (`engine/norms.py`), in process, at S=2 M=2.

    python benchmarks/norms_models.py --model MobileNetV3Small
    python benchmarks/norms_models.py --model DenseNet121 --steps 1

The model: `--model` at 32x32 from raw pixels (no weights, average pooling, a Dense(10)
head), Adam(1e-3) (`--optimizer sgd`: SGD(0.01)), float32. hf.fit with S=2 M=2 on
`--batch` rows per step against `model.fit(batch_size=batch // 2)` accumulating two
batches' gradients (BatchNormalization normalises each microbatch by its own statistics).
Rows: the fused path (the default), `HYPARFLOW_FUSED_NORM=0`, and Keras's own
sensitivity: model.fit again on inputs moved by 1e-7 of themselves. Each row's distance
is given from model.fit and from the same model.fit in float64 (the truth each float32
run rounds away from). Each distance is the largest weight difference (trainable and
moving statistics); the three variables farthest from model.fit follow.
"""

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import hyparflow  # noqa: E402
from hyparflow.engine.local import run_ranks  # noqa: E402

tf.get_logger().setLevel("ERROR")


OPTIMIZERS = {"adam": lambda a: keras.optimizers.Adam(1e-3, gradient_accumulation_steps=a),
              "sgd": lambda a: keras.optimizers.SGD(0.01, gradient_accumulation_steps=a)}
OPTIMIZER = ["adam"]


def build(name, accumulate=None, floatx="float32"):
    keras.utils.set_random_seed(1)
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(floatx)
    base = getattr(keras.applications, name)(include_top=False, weights=None,
                                             input_shape=(32, 32, 3), pooling="avg")
    model = keras.Model(base.input, keras.layers.Dense(10)(base.output))
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")
    model.compile(optimizer=OPTIMIZERS[OPTIMIZER[0]](accumulate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def worst(got, want, paths, k=3):
    """The `k` variables farthest from model.fit's, as 'path diff'."""
    diffs = sorted(((float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), p)
                    for u, v, p in zip(got, want, paths)), reverse=True)
    return ", ".join(f"{p} {d:.2g}" for d, p in diffs[:k])


def reference(name, x, y, batch, floatx="float32", start=None):
    model = build(name, 2, floatx)
    if start is None:
        start = model.get_weights()
    model.set_weights([w.astype(floatx) for w in start])
    model.fit(x.astype(floatx), y, batch_size=batch // 2, epochs=1, shuffle=False, verbose=0)
    return start, model.get_weights()


def hf_fit(name, start, x, y, batch, stages, micro, fused):
    os.environ["HYPARFLOW_FUSED_NORM"] = "1" if fused else "0"

    def body(comm):
        model = build(name)
        model.set_weights(start)
        hyparflow.fit(model, x, y, batch_size=batch, epochs=1, num_stages=stages,
                      num_microbatches=micro, shuffle=False, verbose=0, comm=comm)
        return model.get_weights()

    return run_ranks(stages, body, timeout=3000)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="MobileNetV3Small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--rows", nargs="+", default=["fused", "off", "jitter"])
    args = parser.parse_args()
    OPTIMIZER[0] = args.optimizer
    paths = [v.path for v in build(args.model).weights]
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (args.batch * args.steps, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, args.batch * args.steps)
    began = time.perf_counter()
    start, want = reference(args.model, x, y, args.batch)
    update = max_diff(want, start)
    truth = reference(args.model, x, y, args.batch, "float64", start)[1]
    print(f"{args.model} 32x32, batch {args.batch}, {args.steps} {args.optimizer} steps, "
          f"S={args.stages} M={args.micro}; largest update {update:.3g} "
          f"(model.fit {time.perf_counter() - began:.0f} s); model.fit in float32 is "
          f"{max_diff(want, truth):.3g} from model.fit in float64", flush=True)
    for row in args.rows:
        began = time.perf_counter()
        if row == "jitter":
            _, got = reference(args.model, x * np.float32(1 + 1e-7), y, args.batch)
            label = "model.fit, inputs x (1 + 1e-7)"
        else:
            got = hf_fit(args.model, start, x, y, args.batch, args.stages, args.micro,
                         row == "fused")
            label = "hf.fit, fused kernel" if row == "fused" else "hf.fit, HYPARFLOW_FUSED_NORM=0"
        print(f"  {label}: {max_diff(got, want):.3g} from model.fit, "
              f"{max_diff(got, truth):.3g} from model.fit in float64 "
              f"({time.perf_counter() - began:.0f} s); farthest: {worst(got, want, paths)}",
              flush=True)


if __name__ == "__main__":
    main()
