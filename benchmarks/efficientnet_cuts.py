"""EfficientNetB0 at S=2 M=2 over a spread of cuts, against plain Keras accumulating
the two microbatches, in float32 or float64 (issue 30, item 1).

    PYTHONPATH=. python benchmarks/efficientnet_cuts.py float64 [layer names to cut after]
    SIZE=64 PYTHONPATH=. python benchmarks/efficientnet_cuts.py float32 block3a_expand_conv
"""
import os
import sys
import time

os.environ.setdefault("HYPARFLOW_TIMEOUT", "300")
os.environ.setdefault("HYPARFLOW_INTER_OP_THREADS", "8")

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hyparflow import balance as B  # noqa: E402
from hyparflow import graph as G  # noqa: E402
from hyparflow.local import run_ranks  # noqa: E402

tf.get_logger().setLevel("ERROR")
DTYPE = sys.argv[1] if len(sys.argv) > 1 else "float64"
BATCH = int(os.environ.get("BATCH", 8))
SIZE = int(os.environ.get("SIZE", 32))


def compile_(model, accumulate=None, **kw):
    model.compile(**kw, optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=accumulate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build():
    keras.config.set_floatx(DTYPE)
    try:
        keras.utils.set_random_seed(1)
        base = keras.applications.EfficientNetB0(include_top=False, weights=None,
                                                 input_shape=(SIZE, SIZE, 3), pooling="avg")
        model = keras.Model(base.input, keras.layers.Dense(10)(base.output))
    finally:
        keras.config.set_floatx("float32")
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return compile_(model)


def max_diff(a, b):
    return max(float(np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).max())
               for p, q in zip(a, b))


t0 = time.time()
models = [build() for _ in range(3)]
rng = np.random.default_rng(0)
# Values float32 holds exactly: model.fit casts float inputs to floatx.
x = rng.uniform(0, 255, (BATCH, SIZE, SIZE, 3)).astype("float32").astype(DTYPE)
y = rng.integers(0, 10, BATCH)
reference = models[2]
start = reference.get_weights()
graph = G.from_model(models[0])
names = [n.name for n in graph.nodes]
n = len(names)
default = B.solve([node.cost for node in graph.nodes], 2)[0]

# Reference: plain Keras, batches of 4, two accumulated into one step of 8.
compile_(reference, accumulate=2)
reference.fit(x, y, batch_size=BATCH // 2, epochs=1, shuffle=False, verbose=0)
expected = reference.get_weights()
# Control: a compiled GradientTape over the two halves, summed, one step.
reference.set_weights(start)
compile_(reference)
variables = reference.trainable_variables


@tf.function
def gradients(xs, ys):
    with tf.GradientTape() as tape:
        loss = reference.compute_loss(x=xs, y=ys, y_pred=reference(xs, training=True)) * 0.5
    return tape.gradient(loss, variables)


h = BATCH // 2
summed = [a + b for a, b in zip(gradients(x[:h], y[:h]), gradients(x[h:], y[h:]))]
reference.optimizer.apply(summed, variables)
taped = reference.get_weights()
# hyparflow sums the microbatches' gradients (each times its share) in float32
# buffers: the same rounding on the tape's float64 gradients.
reference.set_weights(start)
halves = [[tf.cast(g, tf.float32) for g in gradients(x[:h], y[:h])],
          [tf.cast(g, tf.float32) for g in gradients(x[h:], y[h:])]]
reference.optimizer.apply([tf.cast(a + b, DTYPE) for a, b in zip(*halves)], variables)
taped32 = reference.get_weights()
control = max_diff(taped, expected)
update = max_diff(expected, start)
# How far a relative 1e-7 change of the inputs moves one step's update, on the tape.
reference.set_weights(start)
noisy = (x * (1 + 1e-7 * np.random.default_rng(9).standard_normal(x.shape))).astype(DTYPE)
reference.optimizer.apply([a + b for a, b in zip(gradients(noisy[:h], y[:h]),
                                                 gradients(noisy[h:], y[h:]))], variables)
print(f"{SIZE}x{SIZE}, batch {BATCH}: inputs moved by 1e-7 of themselves move the update by "
      f"{max_diff(reference.get_weights(), taped) / update:.2g} of it", flush=True)
worst = max(range(len(start)), key=lambda i: float(np.abs(reference.get_weights()[i] - expected[i]).max()))
print("control worst at", reference.weights[worst].path, flush=True)
reference.set_weights(start)
compile_(reference, accumulate=2, jit_compile=False)
reference.fit(x, y, batch_size=BATCH // 2, epochs=1, shuffle=False, verbose=0)
print("fit without XLA vs with:", max_diff(reference.get_weights(), expected), flush=True)
print(f"{DTYPE}: {n} layer calls, default cut {default} ({names[default - 1]} | "
      f"{names[default]}); largest update {update:.3g}; tape control {control:.3g} "
      f"({control / update:.2g} of it); built in {time.time() - t0:.0f} s", flush=True)

picks = sys.argv[2:] or [
    "rescaling", "normalization", "stem_conv", "block1a_activation", "block1a_se_squeeze",
    "block1a_se_expand", "block2a_project_bn", "block2b_drop",
    names[default - 1], "block3b_se_reduce", "block5a_expand_conv", "block6a_se_excite",
    "block6c_bn", "block7a_project_conv", "top_bn", "avg_pool"]
cuts = [names.index(p) + 1 if not p.isdigit() else int(p) for p in picks]


def again(model):
    return compile_(model)


def body(comm):
    out = []
    for k in cuts:
        model = again(models[comm.rank])
        model.set_weights(start)
        t = time.time()
        hf.fit(model, x, y, batch_size=BATCH, epochs=1, num_stages=2, num_microbatches=2,
               balance=[k, n - k], comm=comm, shuffle=False, verbose=0)
        out.append((model.get_weights(), time.time() - t))
    return out


results = run_ranks(2, body, timeout=3000)
for j, k in enumerate(cuts):
    diff = max(max_diff(rank[j][0], expected) for rank in results)
    tdiff = max(max_diff(rank[j][0], taped) for rank in results)
    t32 = max(max_diff(rank[j][0], taped32) for rank in results)
    off = max(sum(int((np.abs(np.asarray(p, np.float64) - q) > 1e-12 * update).sum())
                  for p, q in zip(rank[j][0], taped32)) for rank in results)
    crossing = sorted({graph.tensors[t].producer for node in graph.nodes[k:] for t in node.inputs
                       if graph.tensors[t].producer is not None
                       and graph.tensors[t].producer < k})
    print(f"cut {k:3d} after {names[k - 1]:28s} crossing from "
          f"{[names[c] for c in crossing]}: max diff {diff:.3g} = {diff / update:.2g} of the "
          f"update, from the tape's {tdiff:.3g}, from the tape rounded as hyparflow rounds {t32:.3g} ({off} of {sum(w.size for w in start)} values > 1e-12 of the update) ({results[0][j][1]:.0f} s)", flush=True)
