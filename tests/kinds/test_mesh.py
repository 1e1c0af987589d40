"""2D tensor parallelism (`tensor_mesh`, kinds/mesh): a stage's q x q tensor ranks run
Dense layers by SUMMA with activations in blocks; every layout trains to plain
`model.fit`'s weights."""

import os

import keras
import numpy as np
import pytest

import hyparflow
from conftest import check_resumes, max_diff, reference, train_ranks
from hyparflow.engine.local import run_ranks

REGION = ["up", "mid", "down"]


def mlp(optimizer="sgd"):
    """A Dense chain with ReLU, a residual Add inside the region and a head outside it."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu", name="up")(inp)
    g = keras.layers.Dense(18, name="mid")(h)
    g = keras.layers.Activation("gelu", name="act")(g)
    g = keras.layers.Dense(16, name="down")(g)
    r = keras.layers.Add(name="res")([h, g])
    r = keras.layers.ReLU(name="relu")(r)
    out = keras.layers.Dense(3, name="head")(r)
    model = keras.Model(inp, out)
    opt = keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=opt, loss="mse")
    return model


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def fit_ranks(build, x, y, start, ranks, **kwargs):
    """hf.fit on `ranks` thread-ranks: [(weights, bytes per sample kept for the backward)]."""

    def body(comm):
        model = build()
        model.set_weights(start)
        history = hyparflow.fit(model, x, y, epochs=2, batch_size=16, shuffle=False, verbose=0,
                                comm=comm, **kwargs)
        return model.get_weights(), history.kept_per_sample

    return run_ranks(ranks, body, timeout=300)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_on_a_2x2_mesh_trains_as_model_fit(optimizer):
    x, y = data()
    build = lambda: mlp(optimizer)  # noqa: E731
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    got = fit_ranks(build, x, y, start, 4, num_microbatches=2, num_tensor=4,
                    tensor_mesh=(2, 2), tensor_layers=REGION)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5


def test_predict_on_the_mesh_and_a_checkpoint_resumed_as_replicas(tmp_path):
    """Predictions at 2x2 are model.predict's; a checkpoint written at 2x2 (every
    rank's blocks of the weights and Adam's state put together) resumes at T=1 with
    4 replicas to model.fit's weights."""
    x, y = data()
    build = lambda: mlp("adam")  # noqa: E731
    model = build()
    start = model.get_weights()

    def body(comm):
        mine = build()
        mine.set_weights(start)
        return hyparflow.predict(mine, x, batch_size=16, verbose=0, comm=comm, num_tensor=4,
                                 tensor_mesh=(2, 2), tensor_layers=REGION)

    for got in run_ranks(4, body, timeout=120):
        assert np.abs(got - model.predict(x, verbose=0)).max() < 1e-5
    check_resumes(build, x, y, tmp_path, [
        (1, dict(num_tensor=4, tensor_mesh=(2, 2), tensor_layers=REGION)),
        (2, dict(resume=True, num_replicas=4))], batch_size=16, ranks=4, tol=2e-5)


def test_activations_kept_are_a_quarter_on_a_2x2_mesh_and_whole_in_1d():
    """Bytes per sample each rank keeps for the backward: the mesh region's values in
    blocks of 1/q of the rows and 1/q of the features, so 1/4 of one process's at 2x2;
    outside it (the head's input) whole; the 1D split at T=4 keeps everything whole."""
    x, y = data()
    start, want, _ = reference(mlp, x, y, epochs=2, batch_size=16)
    [(_, whole)] = fit_ranks(mlp, x, y, start, 1)
    oned = fit_ranks(mlp, x, y, start, 4, num_tensor=4, tensor_layers=REGION)
    mesh = fit_ranks(mlp, x, y, start, 4, num_tensor=4, tensor_mesh="2x2",
                     tensor_layers=REGION)
    head = 16 * 4  # the head's input: 16 float32 features, read outside the region
    assert whole == (12 + 16 + 18 + 18 + 16 + 16 + 16) * 4  # every layer's input, once
    for weights, kept in oned:
        assert kept == whole and max_diff(weights, want) < 2e-5
    for weights, kept in mesh:
        assert kept == (whole - head) / 4 + head and max_diff(weights, want) < 2e-5


def encoder_block(optimizer="adam"):
    """Tokens [batch, 4, 8]: a feed-forward pair, a residual and LayerNorm on the mesh,
    then pooling and a head that are not (the blocks gathered before them)."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((4, 8))
    h = keras.layers.Dense(16, activation="gelu", name="ffn_up")(inp)
    h = keras.layers.Dense(8, name="ffn_down")(h)
    h = keras.layers.Add(name="res")([inp, h])
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(8, activation="relu", name="proj")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(3, name="head")(h)
    model = keras.Model(inp, out)
    opt = keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=opt, loss="mse")
    return model


def test_encoder_block_with_layer_norm_on_the_mesh():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 4, 8)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    start, want, _ = reference(encoder_block, x, y, epochs=2, batch_size=8)
    got = train_ranks(encoder_block, x, y, num_stages=1, num_replicas=1, num_microbatches=2,
                      weights=start, num_tensor=4, tensor_mesh=(2, 2),
                      tensor_layers=["ffn_up", "ffn_down", "proj"], epochs=2, batch_size=8,
                      shuffle=False)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5


def test_two_stages_of_2x2_meshes_train_as_model_fit():
    """S=2 x a 2x2 mesh each: 8 thread-ranks, Adam, 2 microbatches."""
    x, y = data()
    build = lambda: mlp("adam")  # noqa: E731
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    got = fit_ranks(build, x, y, start, 8, num_stages=2, num_microbatches=2, num_tensor=4,
                    tensor_mesh=(2, 2), tensor_layers=REGION, balance=[3, 4])
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5


@pytest.mark.parametrize("mesh, tensor, words", [
    ((2, 3), 6, "not square"), ((2, 2), 8, "Pass num_tensor=4"), ((1, 1), 1, "one rank"),
    ("2by2", None, "QxQ"), ((2, 2.0), 4, "pair of equal integers")])
def test_bad_meshes_are_refused_with_the_fix(mesh, tensor, words):
    from hyparflow.layout import resolve

    with pytest.raises(ValueError, match=words):
        resolve(tensor or 4, num_tensor=tensor, tensor_mesh=mesh)


def test_a_layer_that_cannot_run_on_the_mesh_is_refused_with_the_reason():
    keras.utils.set_random_seed(1)
    inp = keras.Input((12,))
    out = keras.layers.Dense(8, activation="softmax", name="soft")(inp)
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((8, 12), "float32"), np.zeros((8, 8), "float32")

    def body(comm):
        hyparflow.fit(model, x, y, batch_size=8, verbose=0, comm=comm, num_tensor=4,
                      tensor_mesh=(2, 2), tensor_layers=["soft"])

    with pytest.raises(Exception, match="softmax"):
        run_ranks(4, body, timeout=120)


def test_the_launchers_pass_the_mesh_on(tmp_path):
    """`hyparflow run --tensor-mesh 2x2` and `hyparflow slurm --tensor-mesh 2x2` export
    HYPARFLOW_TENSOR_MESH (and T = 4), which fit's layout reads."""
    from hyparflow.cluster import launch, slurm
    from hyparflow.layout import resolve

    script = tmp_path / "train.py"
    script.write_text("")
    line = launch.command_line(str(script), ranks=4, mesh="2x2", launcher="mpiexec",
                               environ={"PATH": os.environ.get("PATH", "")})
    assert line.env["HYPARFLOW_TENSOR_MESH"] == "2x2"
    assert line.env["HYPARFLOW_NUM_TENSOR"] == "4"
    with pytest.raises(launch.LaunchError, match="give --tensor 4"):
        launch.command_line(str(script), ranks=4, tensor=2, mesh="2x2", launcher="mpiexec")
    text, _ = slurm.render(slurm.JobSpec(script=str(script), tasks_per_node=4, mesh="2x2"))
    assert "HYPARFLOW_TENSOR_MESH=2x2" in text and "HYPARFLOW_NUM_TENSOR=4" in text
    layout = resolve(4, environ=line.env)
    assert (layout.num_tensor, layout.tensor_mesh) == (4, (2, 2))
