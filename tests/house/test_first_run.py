"""What a newcomer meets first: the README's snippet runs as its launch lines say, the
docs promise no timing they cannot keep, and the first step says it is compiling."""

import os
import re

import keras
import numpy as np

import hyparflow as hf
import models
from conftest import train_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_the_readme_snippet_runs_on_one_process(tmp_path, monkeypatch):
    """README: `python train.py  # one process, as model.fit`: its snippet, run here (one
    process, no launcher), trains."""
    text = _readme()
    assert re.search(r"^python train\.py +# one process", text, re.M)
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith("HYPARFLOW_NUM_")]:
        monkeypatch.delenv(name)
    rng = np.random.default_rng(0)

    def build_my_model():
        inp = keras.Input((8,))
        return keras.Model(inp, keras.layers.Dense(10, activation="softmax")(inp))

    scope = {"build_my_model": build_my_model, "x": rng.normal(size=(512, 8)).astype("float32"),
             "y": rng.integers(0, 10, 512)}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert len(scope["history"].history["loss"]) == 5
    assert (tmp_path / "trained.keras").is_file()


def test_the_readme_promises_no_run_times():
    """Run times depend on the machine: the README states none ("about 30 s", "a minute
    or less" were 2-4 times off on 2 cores)."""
    text = _readme()
    assert not re.search(r"about \d+ ?s\b|minute or less|\bin \d+ ?s\b", text), \
        re.findall(r".{40}(?:about \d+ ?s\b|minute or less).{20}", text)


def test_models_page_builds_a_sequential_without_an_input():
    """A Sequential needs no Input (tests/loop/test_keras_loop.py trains one unbuilt over 2
    stages); docs/models.md says so."""
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        row = next(line for line in f if line.startswith("| Sequential |"))
    assert "give an `Input`" not in row and "built from the first batch" in row


def test_the_first_step_says_it_compiles(capsys):
    """The first step traces and compiles every stage (13-30 s for a large model): rank 0
    says so when it prints progress; verbose=0 prints nothing."""
    x, y = models.mlp_data(32)
    start = models.mlp().get_weights()
    train_ranks(models.mlp, x, y, num_stages=2, num_replicas=1, num_microbatches=1,
                weights=start, batch_size=16, epochs=1)
    assert "compiling" not in capsys.readouterr().out

    def body(comm):
        model = models.mlp()
        hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=2, comm=comm, verbose=2)

    from hyparflow.engine.local import run_ranks

    run_ranks(2, body, timeout=120)
    out = capsys.readouterr().out
    assert out.count("hyparflow: compiling the stages") == 1, out
    assert out.index("Epoch 1/2") < out.index("compiling the stages") < out.index("Epoch 2/2")
