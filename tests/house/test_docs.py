"""The documentation site builds with `mkdocs build --strict`: no broken links between
pages, every page in the nav, every docstring in the API reference rendered."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs or mkdocstrings is not installed (pip install -e \".[test]\" installs both)")


@pytest.mark.timeout(200)
def test_docs_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "WARNING" not in log, log[-5000:]
    for page in ("index.html", "reference/index.html", "performance/index.html",
                 "troubleshooting/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("hyparflow.loop.api.fit", "hyparflow.loop.api.is_main", "hyparflow.engine.checkpoint.export",
                 "hyparflow.engine.checkpoint.Preempted", "hyparflow.schedules.one_f_one_b",
                 "hyparflow.engine.timeline.bubble", "hyparflow.plan.read"):
        assert f'id="{name}"' in reference, f"{name} missing from the API reference"


def _documented_signatures(text):
    """{name: ast.arguments} of the `hyparflow.NAME(...)` signatures in python blocks."""
    import ast
    import re

    found = {}
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        for name, params in re.findall(r"^hyparflow\.(\w+)\((.*?)\)(?: -> [\w.]+)?$", block,
                                       re.S | re.M):
            found[name] = ast.parse(f"def {name}({params}): pass").body[0].args
    return found


def test_documented_defaults_are_the_codes():
    """docs/api.md's signatures of fit, evaluate and predict: every argument, with the
    default inspect.signature gives; the prose's default schedule is fit's."""
    import ast
    import inspect
    import re

    import hyparflow as hf

    text = open(os.path.join(ROOT, "docs", "api.md")).read()
    documented = _documented_signatures(text)
    assert sorted(documented) == ["evaluate", "fit", "predict"], sorted(documented)
    for name, args in documented.items():
        real = inspect.signature(getattr(hf, name)).parameters
        names = [a.arg for a in args.args + args.kwonlyargs]
        assert names == list(real), (name, names, list(real))
        defaults = dict(zip([a.arg for a in args.args][-len(args.defaults):] if args.defaults
                            else [], args.defaults))
        defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d})
        for arg, parameter in real.items():
            if parameter.default is inspect.Parameter.empty:
                assert arg not in defaults, (name, arg)
            else:
                assert ast.literal_eval(defaults[arg]) == parameter.default, (name, arg)
    # The argument table names real arguments of fit.
    fit_args = set(inspect.signature(hf.fit).parameters)
    table = re.findall(r"^\| `([^|]+?)` \|", text.split("## `hyparflow.evaluate`")[0], re.M)
    for cell in table:
        for arg in re.findall(r"(\w+)", cell):
            assert arg in fit_args, arg
    # Every statement of the default schedule in the docs agrees with fit's.
    from hyparflow.layout import DEFAULT_SCHEDULE

    assert inspect.signature(hf.fit).parameters["schedule"].default is None
    default = DEFAULT_SCHEDULE  # what None resolves to without a plan file
    for page in os.listdir(os.path.join(ROOT, "docs")):
        if page.endswith(".md"):
            prose = open(os.path.join(ROOT, "docs", page)).read()
            for claim in re.findall(r"schedule of a step is (\w+) by default", prose, re.I):
                assert claim.lower() == default, (page, claim)


def test_layout_figure_is_what_its_script_draws(tmp_path):
    """docs/concepts.md shows the stages/replicas/microbatches figure, drawn by
    scripts/draw_layout.py (reproducibly: the checked-in SVG is its output)."""
    concepts = open(os.path.join(ROOT, "docs", "concepts.md")).read()
    assert "](img/layout.svg)" in concepts and "┌" not in concepts
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "draw_layout.py"),
                          "--output", str(tmp_path / "layout.svg")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    drawn = (tmp_path / "layout.svg").read_text()
    assert drawn == open(os.path.join(ROOT, "docs", "img", "layout.svg")).read()
    for text in ("rank 3", "stage 1 of replica 1", "allreduce of stage 0", "mb 3"):
        assert text in drawn, text
