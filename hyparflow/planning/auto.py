"""`hyparflow run train.py` without `-n`: the script run once to capture its model and
batch (`loop/capture.py`), the node planned for them (`hyparflow plan --ranks auto`,
ranks x threads measured here) or the plan cached for the same model structure, batch,
core count and CPU model taken, and the choice said in one line; the command then
launches the plan's ranks with its threads (`cli.py`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence

from .. import settings
from ..cluster.launch import LaunchError

__all__ = ["Choice", "choose", "cpu_model", "cache_key"]


class Choice(NamedTuple):
    """The plan file to launch, and the line that says what it is."""
    plan: str
    line: str
    planned: bool   # False: a cached plan, no profiling


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(structure: str, batch: int, cores: int, cpu: str) -> str:
    """One cached plan per model structure, batch, core count and CPU model."""
    text = json.dumps([structure, batch, cores, cpu])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _capture(script: str, script_args: Sequence[str], python: str,
             environ: Mapping[str, str]) -> Dict[str, Any]:
    """Run the script until its first `fit` (which writes the capture and exits)."""
    directory = tempfile.mkdtemp(prefix="hyparflow-capture-")
    # Neither a launcher's counts nor a plan: the script's own hf.fit arguments are read.
    env = {k: v for k, v in environ.items()
           if not k.startswith(("HYPARFLOW_NUM_", "SLURM_")) and k != "HYPARFLOW_PLAN"}
    env.update(HYPARFLOW_CAPTURE=directory, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([python, script, *script_args], env=env, capture_output=True,
                         text=True)
    path = os.path.join(directory, "capture.json")
    if not os.path.exists(path):
        tail = (out.stderr or out.stdout)[-2000:]
        raise LaunchError(
            f"`hyparflow run` without -n runs {script} once to read the model its hf.fit "
            f"trains, but it exited with code {out.returncode} before calling hf.fit:\n{tail}\n"
            f"Give the ranks yourself (`hyparflow run -n N {script}`).")
    with open(path) as f:
        record: Dict[str, Any] = json.load(f)
    if record.get("saved"):
        raise LaunchError(
            f"`hyparflow run` without -n plans from the model {script}'s hf.fit trains, "
            f"saved as a .keras file, which failed: {record['saved']}. Give the ranks "
            f"yourself (`hyparflow run -n N {script}`), or plan a build function with "
            "`hyparflow plan model.py --output plan.json` and `hyparflow run --plan plan.json`.")
    if record.get("given"):
        given = ", ".join(f"{k}={v}" for k, v in record["given"].items())
        raise LaunchError(
            f"{script}'s hf.fit fixes its layout ({given}), which a plan of this node would "
            f"contradict. Give the ranks it needs (`hyparflow run -n N {script}`), or leave "
            "those arguments out for `hyparflow run` to plan them.")
    return record


def _plan(record: Mapping[str, Any], cores: int, directory: str, key: str,
          python: str, environ: Mapping[str, str]) -> None:
    """`hyparflow plan --ranks auto` on the captured model, into the cache (its output
    in KEY.log beside the plan)."""
    argv = [python, "-m", "hyparflow", "plan", record["model"], "--batch-size",
            str(record["batch_size"]), "--cores", str(cores), "--output",
            os.path.join(directory, key + ".json"), "--json",
            os.path.join(directory, key + ".plans.json")]
    if record.get("length"):
        argv += ["--length", str(record["length"])]
    if cores > 1:
        argv += ["--ranks", "auto"]
    log = os.path.join(directory, key + ".log")
    print(f"hyparflow: planning this node ({cores} cores) for the model of this script, "
          f"batch {record['batch_size']}: minutes, once (the plan is cached; progress in "
          f"{log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=dict(environ))
    if done.returncode != 0 or not os.path.exists(os.path.join(directory, key + ".json")):
        with open(log) as f:
            tail = f.read()[-2000:]
        raise LaunchError(f"planning the node failed (exit code {done.returncode}):\n{tail}\n"
                          "Give the ranks yourself (`hyparflow run -n N ...`).")


def _line(directory: str, key: str, cores: int, batch: int, cached: bool) -> str:
    """The choice and its predicted speed against one rank with every core."""
    with open(os.path.join(directory, key + ".plans.json")) as f:
        ranked = json.load(f)
    best = next((p for p in ranked["plans"] if p["fits"]), ranked["plans"][0])
    one, ranks, threads = ranked["one_rank"], ranked["ranks"], ranked["threads_per_rank"]
    tensor = best["tensor"] if not best.get("tensor_mesh") else "x".join(
        map(str, best["tensor_mesh"]))
    return (f"hyparflow: {ranks} rank{'s' if ranks != 1 else ''} x {threads} "
            f"thread{'s' if threads != 1 else ''} (S={best['stages']} T={tensor} "
            f"R={best['replicas']} M={best['microbatches']} {best['schedule']}), "
            f"predicted {best['step_s'] * 1e3:.1f} ms per step of {batch} samples, "
            f"{one['step_s'] / best['step_s']:.2f}x one rank with all {cores} cores "
            f"({one['step_s'] * 1e3:.1f} ms); "
            + ("the cached plan " if cached else "planned now, cached as ")
            + os.path.join(directory, key + ".json"))


def choose(script: str, script_args: Sequence[str], cores: int, *,
           python: Optional[str] = None,
           environ: Optional[Mapping[str, str]] = None) -> Choice:
    """Capture the script's model, then the cached plan for it on this node or a new
    one (`hyparflow plan --ranks auto`, cached)."""
    environ = os.environ if environ is None else environ
    python = python or sys.executable
    if not os.path.isfile(script):
        raise LaunchError(f"script not found: {script!r} (from {os.getcwd()})")
    record = _capture(script, script_args, python, environ)
    directory = settings.plan_cache(environ)
    os.makedirs(directory, exist_ok=True)
    key = cache_key(record["structure"], record["batch_size"], cores, cpu_model())
    cached = all(os.path.exists(os.path.join(directory, key + ext))
                 for ext in (".json", ".plans.json"))
    if not cached:
        _plan(record, cores, directory, key, python, environ)
    line = _line(directory, key, cores, record["batch_size"], cached)
    return Choice(os.path.join(directory, key + ".json"), line, not cached)
