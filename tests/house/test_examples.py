"""Every example in examples/ runs under `hyparflow run -n 2 --stages 2` (digits_resnet:
`--stages 1`) with its shortest settings, exits 0, prints its final line on rank 0, and
takes its layout from the launcher."""

import os
import re
import subprocess
import sys

import pytest

from hyparflow.cluster import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")

# script -> (its shortest settings, a regex the last line of stdout must match)
CASES = {
    # The launcher's layout, not the example's own (2 stages): 1 stage x 2 replicas.
    "digits_resnet.py": (["--epochs", "1"],
                         r"^test accuracy [0-9.]+ \(loss [0-9.]+\) on 360 held-out digits, "
                         r"1 stages x 2 replicas$"),
    "image_files.py": (["--epochs", "1", "--size", "16", "--crop", "16"],
                       r"^image_files: held-out accuracy [0-9.]+; waiting for data: [0-9.]+% "
                       r"of each step on rank 0 \([0-9.]+ ms a step\)$"),
    "wide_mlp.py": (["--samples", "256", "--epochs", "1"],
                    r"^wide_mlp: with 2 stage\(s\) every rank fits the 80 MiB budget \(largest "
                    r"[0-9.]+ MiB\); one rank without stages would need [0-9.]+ MiB \(over budget\)$"),
    "resnet110.py": (["--samples", "64", "--epochs", "1"],
                     r"^resnet110: [0-9.]+ samples/s \(.* over 1 steps after the first\), "
                     r"schedule 1f1b, 2 ranks$"),
    "gpt_text.py": (["--chars", "20000", "--epochs", "1", "--samples", "1"],
                    r"^gpt_text: held-out loss [0-9.]+, perplexity [0-9.]+ per character on "
                    r"\d+ windows of 64$"),
    # Two ranks: two groups of the sweep's members (a sweep takes no stages).
    "sweep_digits.py": (["--epochs", "1", "--seeds", "1"],
                        r"^sweep_digits: best learning rate [0-9.e-]+ \(seed 0\): test accuracy "
                        r"[0-9.]+, 8 members on 2 rank\(s\)$"),
    "imbalanced_digits.py": (["--epochs", "1", "--seeds", "1"],
                             r"^imbalanced_digits: rare classes' held-out accuracy [0-9.]+ "
                             r"without mixing, [0-9.]+ with mixing \(mean of 1 seed\)$"),
    "masked_segmentation.py": (["--samples", "64", "--epochs", "1"],
                               r"^masked_segmentation: final loss [0-9.]+; accuracy [0-9.]+ "
                               r"inside the mask, [0-9.]+ outside$"),
    "dlrm.py": (["--samples", "2048", "--epochs", "1"],
                r"^dlrm: held-out AUC [0-9.]+, log loss [0-9.]+ on 4096 samples; 8 tables "
                r"sharded over 2 ranks$"),
    "transformer_text.py": (["--samples", "256", "--epochs", "1"],
                            r"^transformer_text: test accuracy [0-9.]+ \(loss [0-9.]+\) on 1000 "
                            r"held-out sequences$"),
}

# `hyparflow run --stages` for each example (default 2): digits_resnet's own default is
# 2 stages, so 1 from the launcher shows that the launcher's layout is taken.
LAUNCHED_STAGES = {"digits_resnet.py": "1", "dlrm.py": "1"}  # dlrm: tables over replicas


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == sorted(CASES)


@pytest.mark.mpiexec
@pytest.mark.skipif(launch.find_mpiexec() is None, reason="no mpiexec beside python or on PATH")
@pytest.mark.timeout(330)
@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs(script):
    args, last_line = CASES[script]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HYPARFLOW_NUM_", "SLURM_"))}  # mpiexec here, our layout only
    stages = LAUNCHED_STAGES.get(script, "2")
    command = [sys.executable, "-m", "hyparflow", "run", "-n", "2", "--stages", stages,
               "--microbatches", "2", os.path.join(EXAMPLES, script), *args]
    try:
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} did not finish in 300 s; stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    report = f"exit {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, report
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines and re.match(last_line, lines[-1]), report
