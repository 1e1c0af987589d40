"""Render sbatch scripts from the templates in slurm/ and submit them."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

from .launch import LaunchError, layout, mesh_flag
from .. import settings

__all__ = ["TEMPLATES", "LAUNCHERS", "JobSpec", "template_dir", "template_path",
           "parse_time", "signal_lead", "read_sweep", "render", "submit"]

TEMPLATES = ("single", "hybrid", "array", "sweep", "node", "data_service")
LAUNCHERS = ("srun", "mpiexec")
TASK_TOKEN = "{task}"          # in script arguments: replaced by the array task's index
_PLACEHOLDER = re.compile(r"\$(?:\{([a-z_][a-z0-9_]*)\}|([a-z_][a-z0-9_]*))")


@dataclass
class JobSpec:
    """What to run and on what: the options of `hyparflow slurm`."""

    script: str
    script_args: List[str] = field(default_factory=list)
    nodes: int = 1
    tasks_per_node: int = 1
    stages: int | None = None             # None: the script's hf.fit decides (nothing exported)
    microbatches: int | None = None
    tensor: int | None = None             # tensor ranks per stage; None: the script's hf.fit decides
    mesh: str | None = None               # "QxQ": the tensor ranks as a 2D mesh (sets tensor)
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    job_name: str | None = None
    template: str | None = None           # single | hybrid | array | a file path; None: by nodes / array
    launcher: str = "srun"
    array: str | None = None
    log: str | None = None                # the job's output file (sbatch --output)
    overcommit: bool = False
    sbatch_options: List[str] = field(default_factory=list)
    workdir: str | None = None
    rendered_by: str = ""
    sweep: str | None = None              # a JSON file of configs: one job running hf.sweep
    replicas: int | None = None           # with sweep: ranks per group (HYPARFLOW_NUM_REPLICAS)


def template_dir() -> Path:
    """$HYPARFLOW_SLURM_TEMPLATES, else the repository's slurm/ beside the package (an
    editable install), else <prefix>/share/hyparflow/slurm (where a wheel puts them)."""
    configured = settings.slurm_templates()
    if configured:
        return Path(configured)
    beside = Path(__file__).resolve().parents[2] / "slurm"  # <repo>/hyparflow/cluster/
    if beside.is_dir():
        return beside
    return Path(sys.prefix) / "share" / "hyparflow" / "slurm"


def template_path(name: str) -> Path:
    """The file of template `name` (a built-in name or a path)."""
    if name not in TEMPLATES:
        path = Path(name)
        if not path.is_file():
            raise LaunchError(f"unknown template {name!r}: use one of {', '.join(TEMPLATES)} "
                              f"or the path of a template file.")
        return path
    path = template_dir() / f"{name}.sbatch"
    if not path.is_file():
        raise LaunchError(f"template {path} not found. The templates are in the repository's "
                          f"slurm/ directory; point HYPARFLOW_SLURM_TEMPLATES at a copy of it.")
    return path


def parse_time(text: str) -> int:
    """Seconds in a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise LaunchError(f"--time {text!r} is not a Slurm time limit (e.g. 01:30:00, 90, 1-12).")
    days, first, second, third = match.groups()
    if days is not None:   # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        total = int(days) * 86400 + hours * 3600 + minutes * 60 + seconds
    elif third is not None:
        total = int(first) * 3600 + int(second) * 60 + int(third)
    elif second is not None:
        total = int(first) * 60 + int(second)
    else:
        total = int(first) * 60
    if total <= 0:
        raise LaunchError(f"--time {text!r} must be longer than zero.")
    return total


def signal_lead(limit_seconds: int) -> int:
    """Seconds before the limit for USR1: 120, or a fifth of a limit under 10 minutes
    (a signal due at start would requeue the job for ever)."""
    return 120 if limit_seconds >= 600 else max(10, limit_seconds // 5)


def _quote_arg(arg: str, array: bool) -> str:
    if array and TASK_TOKEN in arg:
        pieces = arg.split(TASK_TOKEN)
        return '"$SLURM_ARRAY_TASK_ID"'.join(shlex.quote(p) if p else "" for p in pieces)
    return shlex.quote(arg)


def _command(spec: JobSpec, python: str, array: bool) -> str:
    args = [_quote_arg(a, array) for a in spec.script_args]
    if array and not any(TASK_TOKEN in a for a in spec.script_args):
        args.append('"$SLURM_ARRAY_TASK_ID"')
    return " ".join([shlex.quote(python), shlex.quote(spec.script), *args])


def _launch_lines(spec: JobSpec, command: str) -> Tuple[str, str]:
    srun = f"srun --mpi=pmi2 --kill-on-bad-exit=1 --distribution=block:block {command}"
    mpiexec = f'mpiexec -n "$SLURM_NTASKS" {command}'
    if spec.launcher == "srun":
        return srun, f"or, with the MPI's own launcher (it reads the allocation from Slurm): {mpiexec}"
    return mpiexec, f"or, started by Slurm through PMI-2: {srun}"


def _environment_lines() -> Tuple[str, str]:
    prefix = Path(sys.prefix)
    activate = prefix / "bin" / "activate"
    if activate.is_file():
        return f"source {shlex.quote(str(activate))}", "python"
    bindir = os.path.dirname(sys.executable)
    return f'export PATH={shlex.quote(bindir)}:"$PATH"', sys.executable


def _choose_template(spec: JobSpec) -> str:
    if spec.template:
        return spec.template
    if spec.sweep:
        return "sweep"
    if spec.array:
        return "array"
    return "single" if spec.nodes == 1 else "hybrid"


def _layout_text(ntasks: int, spec: JobSpec, replicas: int) -> str:
    if spec.stages is None:
        text = f"{ntasks} ranks; stages and replicas as the script's hf.fit says"
        if spec.tensor is not None:
            text += f", {spec.tensor} tensor ranks per stage"
    elif spec.tensor is not None:
        text = (f"{ntasks} ranks = {spec.stages} stages x {spec.tensor} tensor ranks x "
                f"{replicas} replicas")
    else:
        text = f"{ntasks} ranks = {spec.stages} stages x {replicas} replicas"
    if spec.microbatches is not None:
        text += f", {spec.microbatches} microbatches"
    return text


def _layout_exports(spec: JobSpec) -> str:
    """Only what was asked for: a replica count derived here from --stages would be
    imposed on a script that chooses its own stages (fit derives it where S is known)."""
    exports = [f"HYPARFLOW_NUM_{name}={value}" for name, value in
               (("STAGES", spec.stages), ("MICROBATCHES", spec.microbatches),
                ("TENSOR", spec.tensor)) if value is not None]
    if spec.mesh is not None:
        exports.append(f"HYPARFLOW_TENSOR_MESH={spec.mesh}")
    if not exports:
        return "# (none given: the script's hf.fit arguments, else its defaults)"
    return "export " + " ".join(exports)


def read_sweep(path: str) -> List[Dict[str, Any]]:
    """The configs of a sweep file: a non-empty JSON list of objects (any JSON values)."""
    import json

    try:
        with open(path) as f:
            configs: Any = json.load(f)
    except OSError as error:
        raise LaunchError(f"--sweep {path}: cannot read it ({error.strerror or error}).") from None
    except ValueError as error:
        raise LaunchError(f"--sweep {path} is not JSON: {error}.") from None
    if not isinstance(configs, list) or not configs or \
            not all(isinstance(c, dict) for c in configs):
        raise LaunchError(f"--sweep {path} must hold a non-empty JSON list of objects (one "
                          "config per member), e.g. [{\"learning_rate\": 0.01}, ...].")
    return configs


class SweepShape(NamedTuple):
    """How a --sweep job spreads its members over its ranks."""

    text: str          # the layout sentence
    exports: str       # the `export ...` line
    members: int
    groups: int
    replicas: int      # ranks per group


def _sweep_layout(spec: JobSpec, sweep: str, ntasks: int, warnings: List[str]) -> SweepShape:
    """The shape of a --sweep job of the configs in file `sweep`."""
    members = len(read_sweep(sweep))
    replicas = spec.replicas or 1
    if not isinstance(replicas, int) or replicas < 1 or ntasks % replicas:
        raise LaunchError(f"--replicas {spec.replicas} must divide the {ntasks} ranks.")
    groups = ntasks // replicas
    if groups > members:
        raise LaunchError(
            f"{ntasks} ranks with --replicas {replicas} make {groups} groups for {members} "
            f"members: every group needs a member. Use --replicas "
            f"{-(-ntasks // members)} or more, or fewer tasks.")
    if members % groups:
        warnings.append(f"{members} members over {groups} groups: some groups train "
                        f"{members // groups + 1} members, others {members // groups}.")
    text = (f"{members} members over {ntasks} ranks = {groups} groups x {replicas} "
            f"replica(s), about {members / groups:.3g} members per group")
    exports = "export HYPARFLOW_SWEEP_CONFIGS=" + shlex.quote(
        os.path.abspath(os.path.join(spec.workdir or os.getcwd(), sweep)))
    if spec.replicas:
        exports += f" HYPARFLOW_NUM_REPLICAS={spec.replicas}"
    return SweepShape(text, exports, members, groups, replicas)


def render(spec: JobSpec) -> Tuple[str, List[str]]:
    """The sbatch script for `spec`, and warnings (a list of str) about it."""
    warnings: List[str] = []
    if spec.mesh is not None:
        tensor, mesh = mesh_flag(spec.mesh, spec.tensor)  # with a mesh: Q * Q, an int
        spec = replace(spec, tensor=None if tensor is None else int(tensor), mesh=mesh)
    for name in ("nodes", "tasks_per_node", "stages", "microbatches", "tensor"):
        value = getattr(spec, name)
        if value is None and name in ("stages", "microbatches", "tensor"):
            continue
        if not isinstance(value, int) or value < 1:
            raise LaunchError(f"--{name.replace('_', '-')} must be a positive integer. "
                              f"Received: {value!r}")
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise LaunchError(f"--cpus-per-task must be a positive integer. Received: {spec.cpus_per_task!r}")
    if spec.launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}. Received: {spec.launcher!r}")
    if spec.sweep and (spec.array or spec.stages or spec.microbatches or spec.tensor):
        raise LaunchError("--sweep runs one job of hf.sweep: it takes no --array, --stages, "
                          "--microbatches or --tensor (use --replicas for data parallelism "
                          "within each member).")
    if spec.template == "node" and (spec.nodes != 1 or spec.stages or spec.tensor
                                    or spec.microbatches or spec.array or spec.sweep):
        raise LaunchError("the node template plans one node's ranks x threads: it takes "
                          "no --nodes, --stages, --tensor, --microbatches, --array or --sweep.")
    ntasks = spec.nodes * spec.tasks_per_node
    shape = layout(ntasks, spec.stages, None, spec.microbatches, environ={}, tensor=spec.tensor)
    stages, replicas = shape.num_stages, shape.num_replicas
    template = _choose_template(spec)
    if template == "single" and spec.nodes != 1:
        raise LaunchError(f"the single template is for one node (--nodes {spec.nodes}); "
                          f"use --template hybrid.")
    if template == "data_service" and (spec.launcher != "srun" or spec.array or spec.sweep):
        raise LaunchError("the data_service template starts its ranks with srun on the job's "
                          "first component: it takes no --launcher mpiexec, --array or --sweep.")
    if template == "sweep" and not spec.sweep:
        raise LaunchError("the sweep template needs --sweep CONFIGS.json.")
    if spec.replicas is not None and not spec.sweep:
        raise LaunchError("--replicas is for --sweep jobs (hf.fit derives its replicas from "
                          "the ranks and --stages).")
    sweep = _sweep_layout(spec, spec.sweep, ntasks, warnings) if spec.sweep else None
    if template == "array" and not spec.array:
        raise LaunchError("the array template needs --array, e.g. --array 0-7 or --array 1,3,5%2.")
    if spec.array and template in ("single", "hybrid"):
        raise LaunchError(f"--array needs the array template, not {template}.")
    if spec.array and not re.fullmatch(r"[0-9,\-:%]+", spec.array):
        raise LaunchError(f"--array {spec.array!r} is not a Slurm array spec (e.g. 0-7, 1,3,5, 0-15%4).")
    pipeline = stages * (spec.tensor or 1)
    if (spec.stages or spec.tensor) and spec.tasks_per_node % pipeline \
            and pipeline % spec.tasks_per_node:
        flags = " x ".join(f"--{n} {v}" for n, v in (("stages", spec.stages),
                                                      ("tensor", spec.tensor)) if v)
        warnings.append(
            f"--tasks-per-node {spec.tasks_per_node} is not a multiple of {flags}: some "
            f"pipelines will span two nodes and send activations over the network every "
            f"microbatch. Prefer --tasks-per-node "
            f"{pipeline * max(1, spec.tasks_per_node // pipeline)}.")
    if not os.path.isfile(os.path.join(spec.workdir or os.getcwd(), spec.script)):
        warnings.append(f"{spec.script} is not a file here; the job will look for it in "
                        f"{spec.workdir or os.getcwd()}.")
    limit = parse_time(spec.time)

    job_name = spec.job_name or Path(spec.script).stem or "hyparflow"
    array = template == "array" or bool(spec.array)
    log = spec.log or (f"{job_name}-%A_%a.out" if array else f"{job_name}-%j.out")
    options: List[str] = []
    if spec.partition:
        options.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        options.append(f"#SBATCH --account={spec.account}")
    if spec.cpus_per_task:
        options.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}")
    if spec.overcommit:
        options.append("#SBATCH --overcommit")
    for option in spec.sbatch_options:
        option = option.strip()
        if option:
            options.append(option if option.startswith("#SBATCH") else f"#SBATCH {option}")
    activate, python = _environment_lines()
    launch, other = _launch_lines(spec, _command(spec, python, array))
    if template == "node":   # `hyparflow run` plans the node and starts its ranks
        script = _command(spec, python, False).split(" ", 1)[1]
        launch = f"{shlex.quote(python)} -m hyparflow run {script}"
        other = f"or with the ranks fixed: {shlex.quote(python)} -m hyparflow run -n N {script}"
    values: Dict[str, Union[str, int]] = {
        "job_name": job_name, "nodes": spec.nodes, "tasks_per_node": spec.tasks_per_node,
        "ntasks": ntasks, "stages": spec.stages or "S",
        "replicas": (sweep.replicas if sweep else replicas) if (spec.stages or sweep) else "N // S",
        "microbatches": spec.microbatches or "M",
        "layout": sweep.text if sweep else _layout_text(ntasks, spec, replicas),
        "layout_exports": _layout_exports(spec),
        "sweep_exports": sweep.exports if sweep else "",
        "members": sweep.members if sweep else "", "groups": sweep.groups if sweep else "",
        "time": spec.time, "log": log, "workdir": spec.workdir or os.getcwd(),
        "signal_lead": signal_lead(limit), "sbatch_options": "\n".join(options),
        "activate": activate, "launch": launch, "other_launch": other,
        "array": spec.array or "", "rendered_by": spec.rendered_by or "Rendered by hyparflow slurm.",
    }
    text = template_path(template).read_text()
    unknown = sorted({a or b for a, b in _PLACEHOLDER.findall(text)} - set(values))
    if unknown:
        raise LaunchError(f"template {template} uses unknown placeholders: {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(values))}).")
    # safe_substitute leaves the shell's own $VARIABLES and ${VAR:-} alone.
    return string.Template(text).safe_substitute(values), warnings


def submit(text: str, *, path: Union[str, Path, None] = None,
           sbatch: Optional[str] = None) -> str:
    """sbatch the script (the file at `path`, else `text` on stdin); return the job id."""
    sbatch = sbatch or shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError("sbatch not found on PATH: --submit needs a Slurm login node.")
    argv = [sbatch, "--parsable"] + ([str(path)] if path else [])
    out = subprocess.run(argv, input=None if path else text, capture_output=True, text=True)
    if out.returncode != 0:
        raise LaunchError(f"sbatch failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]
