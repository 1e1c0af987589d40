"""What `hyparflow info` prints: versions, MPI, cores and threads, Slurm, and the
settings in the environment, for a bug report or a first look at a cluster."""

from __future__ import annotations

import os
import shutil
import sys
from typing import List, Mapping, Optional, Sequence, Tuple

from .launch import find_mpiexec, in_slurm_allocation, usable_cores

__all__ = ["report"]


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a report must not fail
        return "not installed"


def _slurm_query(argv: Sequence[str]) -> str:
    """A Slurm command's one-line answer, or why there is none (no config, no controller)."""
    import subprocess

    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unavailable ({type(error).__name__})"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["failed"])[-1]
        return f"unavailable ({last})"
    return out.stdout.strip() or "(empty)"


_MPI_QUERY = """
import os, mpi4py
mpi4py.rc.initialize = False   # the library version needs no MPI_Init
mpi4py.rc.finalize = False
from mpi4py import MPI
print("MPI library\t" + " ".join(MPI.Get_library_version().strip().splitlines()[0].split()))
text = MPI.Get_library_version()
for line in text.splitlines()[1:]:
    if line.startswith("MPICH Device"):
        print("MPI device\t" + line.split(":", 1)[1].strip())
if text.startswith("Open MPI"):
    # Open MPI chooses its transports per run; the components built in are what it can.
    import re, subprocess
    try:
        info = subprocess.run(["ompi_info", "--parsable"], capture_output=True, text=True,
                              timeout=30).stdout
    except OSError:
        info = ""
    for kind in ("pml", "btl", "mtl"):
        found = sorted(set(re.findall(r"^mca:%s:([A-Za-z0-9_-]+):" % kind, info, re.M)))
        if found:
            print("MPI %s\t%s" % (kind, " ".join(found)))
print("MPI standard\t%d.%d" % MPI.Get_version())
print("mpi4py\t%s (%s)" % (mpi4py.__version__, os.path.dirname(mpi4py.__file__)))
"""


def _mpi_facts() -> List[Tuple[str, str]]:
    """(key, value) pairs about the MPI library and mpi4py, from a child Python."""
    import subprocess

    try:
        out = subprocess.run([sys.executable, "-c", _MPI_QUERY], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return [("MPI library", f"unavailable ({type(error).__name__})"),
                ("mpi4py", _version("mpi4py"))]
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["failed"])[-1]
        return [("MPI library", f"unavailable ({last})"), ("mpi4py", _version("mpi4py"))]
    return [(key, value) for key, value in
            (line.split("\t", 1) for line in out.stdout.splitlines() if "\t" in line)]


def _launcher(environ: Mapping[str, str]) -> str:
    """The mpiexec `hyparflow run` would use, its MPI, and whether it is mpi4py's."""
    from . import dialect

    path = find_mpiexec(environ)
    if path is None:
        return "not found"
    speaks, built = dialect.of_mpiexec(path), dialect.library()
    note = ("mpi4py's" if speaks == built else
            f"NOT mpi4py's ({dialect.NAMES[built]}): ranks would each run alone"
            if dialect.UNKNOWN not in (speaks, built) else "")
    return f"{path} ({dialect.NAMES[speaks]}{', ' + note if note else ''})"


def report(environ: Optional[Mapping[str, str]] = None) -> str:
    """The `hyparflow info` text: what a bug report needs about this machine and setup.

    Imports hyparflow (hence TensorFlow, quietly); asks a child process about MPI, so
    that this one neither initialises MPI nor stops others from doing it.
    """
    environ = os.environ if environ is None else environ
    import platform

    lines: List[str] = []

    def add(key: str, value: object) -> None:
        lines.append(f"{key + ':':<22}{value}")

    from importlib import metadata

    from .. import _env

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    add("hyparflow", f"{metadata.version('hyparflow')} ({package})")
    add("python", f"{platform.python_version()} ({sys.executable})")
    add("platform", platform.platform())
    for key, value in _mpi_facts():
        add(key, value)
    _env.start_tensorflow()  # quietly, as a training process would
    import keras
    import numpy
    import tensorflow as tf

    add("tensorflow", tf.__version__)
    add("keras", keras.__version__)
    add("numpy", numpy.__version__)
    add("mpiexec", _launcher(environ))
    add("cores", f"{os.cpu_count()} on this machine, {usable_cores()} usable by this process")
    add("ranks per node", f"{_env.local_ranks()} (from the launcher's environment; 1 outside a launch)")
    add("threads per rank", f"{_env.threads_per_rank()} ({_env.threads_source()})")
    quota = _env.cpu_quota()
    add("cgroup CPU quota", "none" if quota is None else f"{quota:g} cores")
    try:
        threads = tf.config.threading.get_intra_op_parallelism_threads()
        add("TF intra-op threads", f"{threads} (this process)")
    except Exception:  # noqa: BLE001
        pass
    sbatch, srun = shutil.which("sbatch"), shutil.which("srun")
    slurm_tool = sbatch or srun
    if slurm_tool:
        add("slurm", f"sbatch {sbatch or 'not found'}, srun {srun or 'not found'}")
        add("slurm version", _slurm_query([slurm_tool, "--version"]))
        add("slurm partitions", _slurm_query(
            [shutil.which("sinfo") or "sinfo", "-h", "-o", "%P %a %D nodes %T"]).replace("\n", "; "))
    else:
        add("slurm", "not found (no sbatch or srun on PATH)")
    add("in Slurm allocation", "yes" if in_slurm_allocation(environ) else "no")
    for name in sorted(environ):
        if name.startswith("HYPARFLOW_") or name == "OMP_NUM_THREADS":
            add(name, environ[name])
    for name in ("SLURM_CONF", "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST",
                 "SLURM_JOB_NUM_NODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                 "SLURM_TASKS_PER_NODE", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE",
                 "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
                 "SLURM_MPI_TYPE"):
        if name in environ:
            add(name, environ[name])
    return "\n".join(lines)
