"""Reduced-precision exchanges of the replicas' gradient sums and the pipeline boundaries
(`communication_dtype`, `engine.wire`): against plain `model.fit`, within a drift bound
(the exact contract is left by design), half the bytes (counted), float32 unchanged;
float16's loss scale: an overflow is summed again in float32 (the step's result is
float32's), and gradients too small for float16 survive the scale."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from conftest import max_diff, reference
from hyparflow.engine import wire
from hyparflow.engine.comm import wait_all
from hyparflow.engine.local import run_ranks

L = keras.layers


def mlp(optimizer="sgd", loss_weight=1.0):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    h = L.Dense(24, activation="tanh")(inputs)
    h = L.Dense(24, activation="tanh")(h)
    model = keras.Model(inputs, L.Dense(2)(h))
    opt = {"sgd": lambda: keras.optimizers.SGD(0.1),
           "adam": lambda: keras.optimizers.Adam(0.01),
           "big": lambda: keras.optimizers.SGD(1e6)}[optimizer]()
    model.compile(optimizer=opt, loss="mse", loss_weights=[loss_weight])
    return model


def mlp_data(n=64):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 2)).astype("float32"),
            rng.uniform(0.5, 1.5, n).astype("float32"))


def tagger():
    """Tokens with a padding mask (`mask_zero`): the float activations and their
    gradients cross the stage boundary, the mask (bool) beside them, never cast."""
    keras.utils.set_random_seed(4)
    ids = keras.Input((6,), dtype="int32")
    x = L.Embedding(20, 8, mask_zero=True)(ids)
    x = L.Dense(16, activation="tanh")(x)
    x = L.Dense(16, activation="tanh")(x)
    model = keras.Model(ids, L.Dense(3)(x))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tagger_data(n=32):
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 20, (n, 6)).astype("int32")
    for row in range(n):
        ids[row, 1 + row % 6:] = 0
    return ids, rng.integers(0, 3, (n, 6)).astype("int32")


def _runs(build, x, y, start, dtypes, sample_weight=None, **layout):
    """Each rank's {dtype: (weights, history, exchanges)} for fits from `start`."""

    def body(comm):
        out = {}
        for name, dtype in dtypes.items():
            model = build()
            model.set_weights(start)
            history = hf.fit(model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                             comm=comm, sample_weight=sample_weight,
                             communication_dtype=dtype, **layout)
            out[name] = (model.get_weights(), history.history["loss"], history.exchanges)
        return out

    ranks = layout.get("num_stages", 1) * layout.get("num_replicas", 1)
    return run_ranks(ranks, body, timeout=300)


@pytest.mark.parametrize("optimizer,bound", [("sgd", 5e-4), ("adam", 0.03)])
def test_replicas_sum_in_bfloat16(optimizer, bound):
    """R = 2: the gradients travel in bfloat16, summed in float32: half the bytes,
    weights within the bound (Adam divides each gradient by its own scale, so its
    bound is looser and its loss stays within 1%); float32 is the old path, bit for bit."""
    x, y, sw = mlp_data()
    start, want, history = reference(lambda: mlp(optimizer), x, y, epochs=1, sample_weight=sw)
    runs = _runs(lambda: mlp(optimizer), x, y, start,
                 {"default": None, "float32": "float32", "bf16": "bfloat16"},
                 sample_weight=sw, num_replicas=2)
    for out in runs:
        (old, _, _), (same, _, full), (half, loss, ex) = (out["default"], out["float32"],
                                                          out["bf16"])
        assert max_diff(old, same) == 0.0
        assert max_diff(same, want) < 1e-5  # float32 round-off (Adam's)
        assert ex["replicas"]["dtype"] == "bfloat16" and ex["stages"]["bytes"] == 0
        assert full["replicas"]["bytes"] > 0
        assert ex["replicas"]["bytes"] * 2 == full["replicas"]["bytes"]
        drift = max_diff(half, want)
        assert 1e-7 < drift < bound, (optimizer, drift)
        np.testing.assert_allclose(loss, history["loss"], rtol=1e-2)
    assert max_diff(runs[0]["bf16"][0], runs[1]["bf16"][0]) == 0.0  # replicas agree


def test_stage_boundaries_in_bfloat16():
    """S = 2, M = 2, a padding mask across the cut: activations and their gradients in
    bfloat16 (half the bytes each way), the mask as it is; per path, the replicas'
    sums are left in float32."""
    x, y = tagger_data()
    start, want, history = reference(tagger, x, y, epochs=1)
    runs = _runs(tagger, x, y, start,
                 {"float32": None, "bf16": {"stages": "bfloat16", "replicas": "float32"}},
                 num_stages=2, num_microbatches=2)
    for out in runs:
        (exact, _, full), (half, loss, ex) = out["float32"], out["bf16"]
        assert max_diff(exact, want) < 1e-6
        assert ex["stages"]["dtype"] == "bfloat16" and ex["replicas"]["dtype"] == "float32"
        assert full["stages"]["bytes"] > 0 and ex["stages"]["bytes"] * 2 == full["stages"]["bytes"]
        drift = max_diff(half, want)
        assert 1e-7 < drift < 2e-4, drift
        np.testing.assert_allclose(loss, history["loss"], rtol=1e-2)


def test_float16_overflow_is_summed_again_in_float32(monkeypatch):
    """A loss scale far too large: every float16 gradient overflows, so every step's
    sum is done again in float32 (the float32 run's weights, bit for bit, at R = 2)
    and the scale halves each step; at the stage boundary the gradients are sent
    again in float32 too, and only the activations' rounding is left."""
    monkeypatch.setenv("HYPARFLOW_LOSS_SCALE", "1e30")
    x, y, _ = mlp_data()
    start = mlp().get_weights()
    steps = len(x) // 16
    for out in _runs(mlp, x, y, start, {"float32": None, "f16": "float16"}, num_replicas=2):
        ex = out["f16"][2]["replicas"]
        assert max_diff(out["f16"][0], out["float32"][0]) == 0.0
        assert ex["redone"] == steps and ex["scales"] == [1e30 / 2 ** steps]
    _, want, _ = reference(mlp, x, y, epochs=1)
    for out in _runs(mlp, x, y, start, {"f16": "float16"}, num_stages=2, num_microbatches=2):
        weights, _, ex = out["f16"]
        assert ex["stages"]["redone"] == steps
        assert max_diff(weights, want) < 1e-4


def test_float16_scale_keeps_tiny_gradients(monkeypatch):
    """Gradients around 1e-9 (a loss weighted by 1e-8) flush to zero in float16
    without a scale; with the default scale (2**15) they arrive to float16's
    precision, at R = 2."""
    x, y, _ = mlp_data()
    build = lambda: mlp("big", loss_weight=1e-8)  # noqa: E731
    start, want, _ = reference(build, x, y, epochs=1)
    moved = max_diff(want, start)
    errors = {}
    for scale in ("1", "32768"):
        monkeypatch.setenv("HYPARFLOW_LOSS_SCALE", scale)
        out = _runs(build, x, y, start, {"f16": "float16"}, num_replicas=2)[0]
        errors[scale] = max_diff(out["f16"][0], want) / moved
        assert out["f16"][2]["replicas"]["redone"] == 0
    assert errors["1"] > 0.5, errors  # underflow: the update is lost
    assert errors["32768"] < 2e-3, errors


def test_bad_names_and_paths_name_the_choices():
    assert wire.resolve(None) == {"tables": "float32", "replicas": "float32",
                                  "stages": "float32"}
    assert wire.resolve({"stages": "float16"})["stages"] == "float16"
    with pytest.raises(ValueError, match=r"communication_dtype='bf16'.*'float32', "
                                         r"'bfloat16', 'float16'"):
        wire.resolve("bf16")
    with pytest.raises(ValueError, match=r"\['pipeline'\].*'tables', 'replicas', 'stages'"):
        wire.resolve({"pipeline": "bfloat16"})
    with pytest.raises(ValueError, match=r"\{'replicas': \.\.\.\}: 'half'"):
        wire.resolve({"replicas": "half"})


@pytest.mark.parametrize("mode", ["gather", "scatter"])
def test_sum_both_ways(mode):
    """`engine.wire.Sum` on 3 ranks: every rank gets the same bits, within 16-bit
    rounding of the float32 sum; the trailing flags exact; a float16 overflow is
    summed again in float32 (exactly the float32 sum in rank order)."""

    class Counter:
        sent = 0

    def body(comm):
        rng = np.random.default_rng(comm.rank)
        flags = np.array([1.0, 0.0], np.float32)
        grads = np.concatenate([rng.normal(size=1000).astype(np.float32), flags])
        everyone = [np.concatenate([np.random.default_rng(r).normal(size=1000)
                                    .astype(np.float32), flags]) for r in range(3)]
        exact = everyone[0] + everyone[1] + everyone[2]
        out = {}
        for name, scale in (("bfloat16", 1.0), ("float16", 1024.0), ("float16", 1e30)):
            buf, counter = grads.copy(), Counter()
            s = wire.Sum(comm, buf, 1000, wire.numpy_dtype(name), scale, wire.SUM_TAG,
                         counter, mode)
            wait_all([s], 60.0, "the sum")
            out[(name, scale)] = (buf, s.overflowed, counter.sent)
        return exact, out

    results = run_ranks(3, body, timeout=60)
    for exact, out in results:
        for (name, scale), (buf, overflowed, sent) in out.items():
            assert overflowed == (scale == 1e30)
            assert np.array_equal(buf, results[0][1][(name, scale)][0])  # same bits
            assert np.array_equal(buf[1000:], [3.0, 0.0])
            tol = 0 if overflowed else (3e-2 if name == "bfloat16" else 4e-3)
            np.testing.assert_allclose(buf, exact, atol=tol, rtol=0 if overflowed else tol)
        sent = out[("bfloat16", 1.0)][2]
        assert sent == (2 * 1002 * 2 if mode == "gather" else 2 * 2 * 2 * 334)
