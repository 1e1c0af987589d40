"""The numerical contract, in one process: S x R x M ranks as threads against plain Keras."""

import numpy as np
import pytest

import models
from conftest import max_diff, reference, train_ranks

CONFIGS = [(1, 1, 1), (2, 1, 4), (1, 2, 1), (2, 2, 2), (4, 1, 4), (3, 1, 3)]
EPOCHS, BATCH = 3, 16



def check(build, data, configs, tol, balance=None, **kwargs):
    x, y = data
    start, expected, expected_history = reference(build, x, y, epochs=EPOCHS, batch_size=BATCH,
                                                  **kwargs)
    report = []
    for s, r, m in configs:
        results = train_ranks(build, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                              weights=start, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                              balance=balance(s) if balance else None, **kwargs)
        diff = max(max_diff(w, expected) for w, _ in results)
        report.append(((s, r, m), diff))
        assert diff <= tol, f"(S,R,M)={(s, r, m)}: max weight difference {diff:g} > {tol:g}"
        # Every rank ends with the same weights and the same history.
        for w, h in results[1:]:
            assert max_diff(w, results[0][0]) == 0.0
            assert h == results[0][1]
        history = results[0][1]
        assert sorted(history) == sorted(expected_history)
        for key, values in expected_history.items():
            np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    print("max weight difference per (S,R,M):", report)
    return report


@pytest.mark.parametrize("optimizer,tol", [("sgd", 1e-5), ("adam", 1e-4)])
def test_mlp(optimizer, tol):
    check(lambda: models.mlp(optimizer), models.mlp_data(), CONFIGS, tol)


def test_cnn_skip_crosses_two_boundaries():
    check(models.skip_cnn, models.skip_cnn_data(), CONFIGS, 1e-5,
          balance=lambda s: models.SKIP_CNN_BALANCE.get(s))


def test_two_inputs_two_outputs():
    check(models.two_in_two_out, models.two_in_two_out_data(), CONFIGS, 1e-5)


def test_sample_and_class_weight():
    x, y = models.mlp_data()
    sw = np.linspace(0.5, 2.0, len(x)).astype("float32")
    check(models.mlp, (x, y), [(2, 2, 2)], 1e-5, sample_weight=sw)
    check(models.mlp, (x, y), [(2, 1, 2)], 1e-5, class_weight={0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5})


def test_partial_last_batch_smaller_than_replicas_times_microbatches():
    # 100 samples, batch 16: the last batch has 4 samples for R*M = 8 slices.
    x, y = models.mlp_data(100)
    check(models.mlp, (x, y), [(2, 2, 4)], 1e-5)
