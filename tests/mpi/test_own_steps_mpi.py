"""A model's own train_step over real MPI (issue 62, item 3): the VAE (one optimizer, its
own trackers) and the GAN (two optimizers) of tests/loop/test_own_steps.py, noise from
the data, at R = the world size (2 and 4), against `model.fit` on one process; and with
random draws inside the step, two runs under `set_random_seed` repeat the weights bit
for bit.

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_own_steps_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from test_own_steps import gan, gan_data, vae, vae_data  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in zip(a, b))


# 72 rows in batches of 16: the last of 8 (2 rows a replica at R=4); 70 in batches of
# 15: unequal slices every step (8 and 7 at R=2; 4, 4, 4, 3 at R=4), weights only (a
# tracker's mean of the replicas' means is not the batch's then).
CASES = {
    "vae": (vae, lambda: vae_data(72), 16, True),
    "vae_unequal": (vae, lambda: vae_data(70), 15, False),
    "gan": (gan, lambda: gan_data(72), 16, True),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_own_train_step_as_one_process(case):
    build, data, batch, logs = CASES[case]
    x = data()
    reference = build()
    start = reference.get_weights()
    expected_history = reference.fit(x, batch_size=batch, epochs=2, shuffle=False,
                                     verbose=0).history
    model = build()
    model.set_weights(start)
    history = hf.fit(model, x, batch_size=batch, epochs=2, num_stages=1, num_microbatches=1,
                     shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), reference.get_weights())
    if hf.is_main():
        print(f"\nown train_step {case} R={SIZE}: max weight difference {diff:.3g}")
    assert diff <= 1e-6, f"{case} R={SIZE}: {diff}"
    if logs:
        for key, values in expected_history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=2e-6, atol=1e-7,
                                       err_msg=key)


@pytest.mark.mpi(min_size=2)
def test_own_train_step_with_random_draws_repeats():
    x = vae_data(128)

    def run():
        keras.utils.set_random_seed(4)
        model = vae(random_noise=True)
        history = hf.fit(model, x, batch_size=16, epochs=4, num_stages=1,
                         num_microbatches=1, verbose=0)   # shuffled, in model.fit's order
        return model.get_weights(), history.history

    (w0, h0), (w1, h1) = run(), run()
    assert h0["loss"][-1] < 0.8 * h0["loss"][0], h0["loss"]
    assert max_diff(w0, w1) == 0.0
    # The weights repeat bit for bit; the loss log may move by one float32 ulp, as plain
    # model.fit's does between two runs (tests/loop/test_own_steps.py says more).
    for key in h0:
        np.testing.assert_allclose(h1[key], h0[key], rtol=1e-6, err_msg=key)
    everyone = MPI.COMM_WORLD.allgather([a.tobytes() for a in w0])
    assert all(other == everyone[0] for other in everyone)


@pytest.mark.mpi(min_size=2)
def test_own_train_step_from_a_pydataset_read_on_rank_0():
    """Keras's own step through the override (compiled loss and metrics, sample
    weights), fed by a PyDataset on two threads: rank 0 reads each batch once and
    broadcasts it, every replica slices its rows; model.fit's weights and logs, and the
    other processes' copies read nothing."""
    from test_own_steps import Rows, keras_step

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(70, 4)).astype("float32"), rng.normal(size=(70, 3)).astype("float32")
    w = np.linspace(0.5, 2.0, 70).astype("float32")
    reference = keras_step()
    start = reference.get_weights()
    expected = reference.fit(Rows(x, y, w, workers=2), epochs=2, shuffle=False,
                             verbose=0).history
    model = keras_step()
    model.set_weights(start)
    data = Rows(x, y, w, workers=2)
    history = hf.fit(model, data, epochs=2, num_stages=1, num_microbatches=1, shuffle=False,
                     verbose=0)
    diff = max_diff(model.get_weights(), reference.get_weights())
    reads = MPI.COMM_WORLD.allgather(len(data.reads))
    if hf.is_main():
        print(f"\nown train_step from a PyDataset R={SIZE}: max weight difference {diff:.3g}, "
              f"reads per rank {reads}")
    assert diff <= 1e-6, diff
    assert reads == [len(data) * 2] + [0] * (SIZE - 1), reads
    for key, values in expected.items():
        np.testing.assert_allclose(history.history[key], values, rtol=2e-6, atol=1e-7,
                                   err_msg=key)
