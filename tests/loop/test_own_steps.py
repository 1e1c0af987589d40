"""A model's own `train_step` / `test_step` (issue 62, item 3), in one process: at S=1
each replica runs the step on its rows and every optimizer sums the gradients before
its update, so the weights are `model.fit`'s on the global batch (Adam); the trackers'
results are global; random draws inside the step repeat under `set_random_seed`; other
layouts are refused naming the one that works. tests/mpi/test_own_steps_mpi.py runs
the same models at R=2 and R=4 under mpiexec."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import hyparflow as hf
from conftest import max_diff
from hyparflow.engine.local import run_ranks

pytestmark = pytest.mark.timeout(300)

F, L = 6, 2   # features, latent size


def _mean(name):
    return keras.metrics.Mean(name=name)


class VAE(keras.Model):
    """keras.io's VAE (its train_step, trackers and KL), shrunk, with its noise epsilon
    taken from the data (the last L columns of x) instead of keras.random.normal."""

    def __init__(self, random_noise=False, **kwargs):
        super().__init__(**kwargs)
        inp = keras.Input((F,))
        h = keras.layers.Dense(8, activation="tanh")(inp)
        self.encoder = keras.Model(inp, [keras.layers.Dense(L)(h), keras.layers.Dense(L)(h)])
        z = keras.Input((L,))
        self.decoder = keras.Model(z, keras.layers.Dense(F)(
            keras.layers.Dense(8, activation="tanh")(z)))
        self.random_noise = random_noise
        self.seed_generator = keras.random.SeedGenerator(11)
        self.total_loss_tracker = _mean("total_loss")
        self.reconstruction_loss_tracker = _mean("reconstruction_loss")
        self.kl_loss_tracker = _mean("kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def _terms(self, data):
        x, eps = data[:, :F], data[:, F:]
        if self.random_noise:   # each replica draws its own
            eps = keras.random.normal(ops.shape(eps), seed=self.seed_generator)
        z_mean, z_log_var = self.encoder(x)
        reconstruction = self.decoder(z_mean + ops.exp(0.5 * z_log_var) * eps)
        rec = ops.mean(ops.sum(ops.square(x - reconstruction), axis=1))
        kl = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        kl = ops.mean(ops.sum(kl, axis=1))
        return rec + kl, rec, kl

    def _track(self, total, rec, kl):
        self.total_loss_tracker.update_state(total)
        self.reconstruction_loss_tracker.update_state(rec)
        self.kl_loss_tracker.update_state(kl)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}

    def train_step(self, data):
        with tf.GradientTape() as tape:
            total, rec, kl = self._terms(data)
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return self._track(total, rec, kl)

    def test_step(self, data):
        return self._track(*self._terms(data))


def vae(random_noise=False):
    keras.utils.set_random_seed(1)
    model = VAE(random_noise)
    model.compile(keras.optimizers.Adam(0.01))
    return model


def vae_data(n=70, seed=0):
    """Rows near a 2-dimensional surface (what a VAE learns), then L columns of noise."""
    rng = np.random.default_rng(seed)
    z, surface = rng.normal(size=(n, 2)), np.random.default_rng(99).normal(size=(2, F))
    return np.concatenate([2 * np.tanh(z @ surface), rng.normal(size=(n, L))],
                          axis=1).astype("float32")


class GAN(keras.Model):
    """keras.io's GAN (two optimizers, its trackers), shrunk, its two latent draws taken
    from the data (x = [real, z_discriminator, z_generator]) and no label noise."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.discriminator = keras.Sequential([
            keras.Input((F,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        self.generator = keras.Sequential([
            keras.Input((L,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(F)])
        self.d_loss_tracker = _mean("d_loss")
        self.g_loss_tracker = _mean("g_loss")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real, z1, z2 = data[:, :F], data[:, F:F + L], data[:, F + L:]
        n = ops.shape(real)[0]
        combined = ops.concatenate([self.generator(z1), real], axis=0)
        labels = ops.concatenate([ops.ones((n, 1)), ops.zeros((n, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(ops.zeros((n, 1)), self.discriminator(self.generator(z2)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan():
    keras.utils.set_random_seed(2)
    model = GAN()
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02))
    return model


def gan_data(n=64, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, F + 2 * L)).astype("float32")


def reference(build, x, **kwargs):
    """model.fit on one process, the global batches in order: (start, end, history)."""
    model = build()
    start = model.get_weights()
    history = model.fit(x, shuffle=False, verbose=0, **kwargs).history
    return start, model.get_weights(), history


def fit_ranks(build, x, start, replicas, **kwargs):
    def body(comm):
        model = build()
        model.set_weights(start)
        history = hf.fit(model, x, num_stages=1, num_replicas=replicas, num_microbatches=1,
                         comm=comm, verbose=0, **kwargs)
        return model.get_weights(), history.history

    return run_ranks(replicas, body, timeout=300)


def check_history(got, expected):
    assert sorted(got) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=2e-6, atol=1e-7, err_msg=key)


def test_vae_with_its_trackers_is_model_fit_at_two_replicas():
    """One optimizer; 70 rows in batches of 16 (the last of 6: 3 rows a replica); a
    validation set through the model's test_step."""
    x, val = vae_data(), vae_data(20, seed=5)
    kwargs = dict(batch_size=16, epochs=2, validation_data=(val,), validation_batch_size=10)
    start, expected, history = reference(vae, x, **kwargs)
    for weights, got in fit_ranks(vae, x, start, 2, shuffle=False, **kwargs):
        assert max_diff(weights, expected) <= 1e-6
        check_history(got, history)


def test_unequal_slices_weigh_by_rows():
    """Batches of 15 rows: 8 and 7 a replica, every step; the combined gradient is the
    global batch's mean, not the mean of the replicas' means."""
    x = vae_data()
    start, expected, _ = reference(vae, x, batch_size=15, epochs=2)
    for weights, _ in fit_ranks(vae, x, start, 2, shuffle=False, batch_size=15, epochs=2):
        assert max_diff(weights, expected) <= 1e-6


def test_gan_with_two_optimizers_is_model_fit_at_two_replicas():
    x = gan_data()
    start, expected, history = reference(gan, x, batch_size=16, epochs=2)
    results = fit_ranks(gan, x, start, 2, shuffle=False, batch_size=16, epochs=2)
    for weights, got in results:
        assert max_diff(weights, expected) <= 1e-6
        check_history(got, history)


def test_shuffled_in_model_fits_order():
    """shuffle=True, no seed: model.fit's own order under set_random_seed."""
    x = gan_data()
    model = gan()
    start = model.get_weights()
    keras.utils.set_random_seed(9)
    model.fit(x, batch_size=16, epochs=2, shuffle=True, verbose=0)
    expected = model.get_weights()

    def body(comm):
        m = gan()
        m.set_weights(start)
        keras.utils.set_random_seed(9)
        hf.fit(m, x, num_stages=1, num_microbatches=1, comm=comm, verbose=0,
               batch_size=16, epochs=2, shuffle=True)
        return m.get_weights()

    for weights in run_ranks(2, body, timeout=300):
        assert max_diff(weights, expected) <= 1e-6


def test_random_draws_inside_the_step_train_and_repeat():
    """keras.random.normal with a SeedGenerator: each replica draws its own noise (not
    model.fit's bits); the loss falls, the replicas end equal, and a second run under
    the same set_random_seed repeats the first bit for bit."""
    x = vae_data(128)
    start = vae().get_weights()   # thread-ranks share Python's generator, which
    # Keras's initializers draw from: the weights come in, the draws are the step's

    def run():
        def body(comm):
            keras.utils.set_random_seed(4)
            model = vae(random_noise=True)
            model.set_weights(start)
            # In order: Keras's shuffling draws from TensorFlow's process-wide seed,
            # which thread-ranks share (tests/mpi/test_own_steps_mpi.py shuffles).
            history = hf.fit(model, x, num_stages=1, num_microbatches=1, comm=comm,
                             verbose=0, batch_size=16, epochs=4, shuffle=False)
            return model.get_weights(), history.history["loss"], \
                model.seed_generator.state.numpy()

        return run_ranks(2, body, timeout=300)

    first, second = run(), run()
    (w0, loss, seeds0), (w1, _, seeds1) = first
    assert loss[-1] < 0.8 * loss[0], loss   # model.fit: 10.4 to 6.5
    assert max_diff(w0, w1) == 0.0 and np.array_equal(seeds0, seeds1)
    assert all(max_diff(w, w0) == 0.0 for w, _, _ in second)
    # The loss log may move by one float32 ulp between runs whose weights are equal bit
    # for bit: plain model.fit does the same here (one process, 4 runs of this VAE under
    # set_random_seed: 11.141997, 11.141998, 11.141998, 11.141999, the same weights);
    # with TensorFlow's graph optimizer off (disable_meta_optimizer) both repeat exactly.
    np.testing.assert_allclose(second[0][1], loss, rtol=1e-6)


def test_replicas_draw_their_own_noise():
    """The two replicas' seeds differ during the step (their draws are not the same
    noise for different rows): a step whose loss is its eps shows it."""

    class Draws(VAE):
        def train_step(self, data):
            eps = keras.random.normal((1,), seed=self.seed_generator)
            self.total_loss_tracker.update_state(eps[0])
            return {"eps": eps[0]}

    def body(comm):
        keras.utils.set_random_seed(4)
        model = Draws()
        model.compile(keras.optimizers.Adam(0.01))
        seen = []
        cb = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: seen.append(logs["eps"]))
        hf.fit(model, vae_data(32), num_stages=1, num_microbatches=1, comm=comm, verbose=0,
               batch_size=16, epochs=1, callbacks=[cb])
        return seen

    mine, theirs = run_ranks(2, body, timeout=300)
    assert mine != theirs   # the step's raw logs are each replica's own draws


def test_evaluate_runs_the_models_test_step():
    x, val = vae_data(), vae_data(30, seed=3)
    model = vae()
    model.fit(x, batch_size=16, epochs=1, shuffle=False, verbose=0)
    weights = model.get_weights()
    expected = model.evaluate(val, batch_size=10, verbose=0, return_dict=True)

    def body(comm):
        m = vae()
        m.set_weights(weights)
        return hf.evaluate(m, val, batch_size=10, num_stages=1, comm=comm, verbose=0,
                           return_dict=True)

    for got in run_ranks(2, body, timeout=300):
        assert sorted(got) == sorted(expected)
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=2e-6, err_msg=key)


@pytest.mark.parametrize("layout,said", [
    (dict(num_stages=2, num_replicas=1, num_microbatches=1), "num_stages=2"),
    (dict(num_stages=1, num_replicas=1, num_microbatches=2), "num_microbatches=2"),
])
def test_other_layouts_refused_naming_what_works(layout, said):
    def body(comm):
        hf.fit(gan(), gan_data(), comm=comm, verbose=0, batch_size=16, **layout)

    with pytest.raises(Exception) as info:
        run_ranks(layout["num_stages"] * layout["num_replicas"], body, timeout=120)
    message = str(info.value)
    assert "overrides train_step (in GAN)" in message and said in message
    assert "num_stages=1, num_tensor=1, num_microbatches=1" in message


def test_options_it_cannot_honour_refused():
    def body(comm):
        hf.fit(gan(), gan_data(), comm=comm, verbose=0, batch_size=16, num_stages=1,
               checkpoint_dir="/nonexistent")

    with pytest.raises(Exception) as info:
        run_ranks(1, body, timeout=120)
    assert "checkpoint_dir with a model that overrides train_step" in str(info.value)


class KerasStep(keras.Model):
    """A Functional subclass whose train_step is Keras's own, through the override: the
    compiled loss, its tracker and the compiled metrics, with (x, y, sample_weight)."""

    def train_step(self, data):
        return super().train_step(data)


def keras_step():
    keras.utils.set_random_seed(5)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(inp)
    model = KerasStep(inp, keras.layers.Dense(3)(h))
    model.compile(keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def test_compiled_loss_and_metrics_with_sample_weights():
    """Batches of 15 (8 and 7 rows a replica): the compiled loss tracker weighs by rows
    and the compiled metrics sum their states, so even the logs are model.fit's."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(70, 4)).astype("float32"), rng.normal(size=(70, 3)).astype("float32")
    sw = np.linspace(0.5, 2.0, 70).astype("float32")
    model = keras_step()
    start = model.get_weights()
    history = model.fit(x, y, sample_weight=sw, batch_size=15, epochs=2, shuffle=False,
                        verbose=0).history

    def body(comm):
        m = keras_step()
        m.set_weights(start)
        h = hf.fit(m, x, y, sample_weight=sw, batch_size=15, epochs=2, shuffle=False,
                   num_stages=1, num_microbatches=1, comm=comm, verbose=0)
        return m.get_weights(), h.history

    for weights, got in run_ranks(2, body, timeout=300):
        assert max_diff(weights, model.get_weights()) <= 1e-6
        check_history(got, history)


def test_a_dataset_of_global_batches():
    x = gan_data()
    start, expected, history = reference(gan, tf.data.Dataset.from_tensor_slices(x).batch(16),
                                         epochs=2)

    def body(comm):
        m = gan()
        m.set_weights(start)
        h = hf.fit(m, tf.data.Dataset.from_tensor_slices(x).batch(16), epochs=2,
                   num_stages=1, num_microbatches=1, comm=comm, verbose=0)
        return m.get_weights(), h.history

    for weights, got in run_ranks(2, body, timeout=300):
        assert max_diff(weights, expected) <= 1e-6
        check_history(got, history)


class Rows(keras.utils.PyDataset):
    """A PyDataset of (x, y, sample_weight) batches of 15 rows, counting its reads."""

    def __init__(self, x, y, sw, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.sw, self.reads = x, y, sw, []

    def __len__(self):
        return -(-len(self.x) // 15)

    def __getitem__(self, i):
        self.reads.append(i)
        s = slice(15 * i, 15 * (i + 1))
        return self.x[s], self.y[s], self.sw[s]


@pytest.mark.parametrize("form", ["pydataset", "generator"])
def test_a_pydataset_or_generator_read_once_on_rank_0(form):
    """Keras's own step through the override, fed by a PyDataset (threads) or a
    generator: model.fit's weights and logs; each batch read once in the job."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(70, 4)).astype("float32"), rng.normal(size=(70, 3)).astype("float32")
    sw = np.linspace(0.5, 2.0, 70).astype("float32")

    def data():
        if form == "pydataset":
            return Rows(x, y, sw, workers=2), {}
        return (Rows(x, y, sw)[i % 5] for i in range(10)), {"steps_per_epoch": 5}

    model = keras_step()
    start = model.get_weights()
    given, kwargs = data()
    history = model.fit(given, epochs=2, shuffle=False, verbose=0, **kwargs).history
    given, kwargs = data()

    def body(comm):
        m = keras_step()
        m.set_weights(start)
        h = hf.fit(m, given, epochs=2, shuffle=False, num_stages=1, num_microbatches=1,
                   comm=comm, verbose=0, **kwargs)
        return m.get_weights(), h.history

    for weights, got in run_ranks(2, body, timeout=300):
        assert max_diff(weights, model.get_weights()) <= 1e-6
        check_history(got, history)
    if form == "pydataset":
        assert sorted(given.reads) == sorted(list(range(5)) * 2)


class OwnTest(keras.Model):
    """Keras's own train_step, its own test_step."""

    def test_step(self, data):
        return super().test_step(data)


def own_test():
    keras.utils.set_random_seed(5)
    inp = keras.Input((4,))
    model = OwnTest(inp, keras.layers.Dense(3)(keras.layers.Dense(8, name="h")(inp)))
    model.compile(keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.mark.parametrize("call,said", [
    # hf.evaluate runs a test_step override at S=1 only.
    ("evaluate", "overrides test_step (in OwnTest), which hyparflow runs only whole"),
    # fit with hyparflow's own step cannot validate through it, at any layout.
    ("fit", "overrides test_step (in OwnTest), but hyparflow runs its own evaluation"),
])
def test_test_step_refused_where_it_cannot_run(call, said):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")

    def body(comm):
        model = own_test()
        if call == "evaluate":
            hf.evaluate(model, x, y, batch_size=16, num_stages=2, num_microbatches=2,
                        comm=comm, verbose=0)
        else:
            hf.fit(model, x, y, batch_size=16, num_stages=2, num_microbatches=2, comm=comm,
                   verbose=0, validation_data=(x, y))

    with pytest.raises(Exception) as info:
        run_ranks(2, body, timeout=120)
    assert said in str(info.value)
    assert "num_stages=1, num_tensor=1, num_microbatches=1" in str(info.value)
