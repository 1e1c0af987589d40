"""Which MPI is installed, and how to say things to its launcher.

MPICH's `mpiexec` (hydra; Intel MPI's too) and Open MPI's take different flags for the
same things, and the `mpiexec` that starts the ranks must be the MPI that mpi4py was
built with: ranks of another MPI each see a world of one and train alone. So the MPI
is read from mpi4py (`library`), the launcher from its `--version` (`of_mpiexec`), and
`Dialect` writes the flags:

              MPICH / hydra            Open MPI
  hosts       -hosts h1:2,h2:2         --host h1:2,h2:2
  more ranks  (allowed)                --oversubscribe (else "not enough slots")
  than cores
  binding     none by default          --bind-to none (Open MPI binds each rank to a core
                                       or socket, which a rank's threads then share)
  environment all of it, to every      only with -x NAME on other hosts
              host

Slurm's srun starts the ranks through the MPI's process-management interface: PMI-2 for
MPICH, PMIx for Open MPI (Debian's has no PMI-2), when Slurm has it (`srun_mpi`).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

__all__ = ["MPICH", "OPENMPI", "UNKNOWN", "NAMES", "of_text", "of_mpiexec", "library",
           "library_version", "Dialect", "find_mpiexec", "srun_mpi", "FORWARDED"]

MPICH, OPENMPI, UNKNOWN = "mpich", "openmpi", "unknown"
NAMES = {MPICH: "MPICH", OPENMPI: "Open MPI", UNKNOWN: "an unknown MPI"}


def of_text(text: str) -> str:
    """The MPI family a version text names (MPI_Get_library_version, `mpiexec --version`)."""
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi.org" in text:
        return OPENMPI
    # Intel MPI and MVAPICH are MPICH's descendants, with hydra's flags.
    if any(word in text for word in ("MPICH", "HYDRA", "Intel(R) MPI", "MVAPICH")):
        return MPICH
    return UNKNOWN


@functools.lru_cache(maxsize=16)
def _version_text(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def of_mpiexec(path: str) -> str:
    """The MPI family of a launcher, from its `--version`."""
    return of_text(_version_text(os.path.realpath(path)))


_QUERY = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
          "from mpi4py import MPI; print(MPI.Get_library_version())")


@functools.lru_cache(maxsize=4)
def _library_text(python: str) -> str:
    if python == sys.executable and "mpi4py.MPI" in sys.modules:
        return str(sys.modules["mpi4py.MPI"].Get_library_version())
    try:
        # A child: importing mpi4py here could set how MPI starts in this process.
        out = subprocess.run([python, "-c", _QUERY], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def library_version(python: Optional[str] = None) -> str:
    """MPI_Get_library_version of the MPI mpi4py was built with ("" if unknown)."""
    return _library_text(python or sys.executable)


def library(python: Optional[str] = None) -> str:
    """The MPI family mpi4py was built with (UNKNOWN without mpi4py)."""
    return of_text(library_version(python))


def find_mpiexec(environ: Optional[Mapping[str, str]] = None,
                 python: Optional[str] = None) -> Optional[str]:
    """The launcher of the MPI mpi4py was built with: `mpiexec` (or Open MPI's `mpirun`)
    beside this Python (the `mpich` wheel's), else on PATH, the first of the same family
    as mpi4py's library; the first found when neither tells."""
    environ = os.environ if environ is None else environ
    python = python or sys.executable
    found: List[str] = []
    for name in ("mpiexec", "mpirun"):
        beside = os.path.join(os.path.dirname(python), name)
        if os.path.isfile(beside) and os.access(beside, os.X_OK):
            found.append(beside)
    for name in ("mpiexec", "mpirun"):
        on_path = shutil.which(name, path=environ.get("PATH"))
        if on_path is not None and on_path not in found:
            found.append(on_path)
    if not found:
        return None
    wanted = library(python)
    if wanted != UNKNOWN:
        for path in found:
            if of_mpiexec(path) == wanted:
                return path
    return found[0]


def srun_mpi(family: str, srun: str) -> Optional[str]:
    """srun's --mpi for the family: pmi2 for MPICH; pmix for Open MPI when this Slurm has
    it (`srun --mpi=list`), else None (then Open MPI's mpiexec starts the ranks, inside
    the allocation)."""
    if family != OPENMPI:
        return "pmi2"
    try:
        out = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=20,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "pmix" if "pmix" in out.stdout + out.stderr else None


# What reaches the ranks on other hosts under Open MPI (-x): hydra forwards the whole
# environment; these are what a run needs of it (names, or prefixes ending in "_").
FORWARDED = ("HYPARFLOW_", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "PATH",
             "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_", "TF_", "KERAS_", "XLA_FLAGS",
             "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Dialect:
    """The flags of one launcher family (MPICH, OPENMPI; UNKNOWN speaks MPICH's, the
    flags most launchers take)."""

    family: str

    def argv(self, mpiexec: str, ranks: int, command: Sequence[str],
             hosts: Optional[Sequence[Tuple[str, int]]] = None,
             environ: Optional[Mapping[str, str]] = None,
             env: Optional[Mapping[str, str]] = None, local: bool = True) -> List[str]:
        """`mpiexec` starting `command` on `ranks` ranks, on `hosts` [(name, slots)]
        filled in order, or here (`local`: every rank on this machine, however many
        cores it has). `env`: the variables the run sets; `environ`: the rest of the
        environment (what Open MPI must be told to pass to other hosts)."""
        if self.family != OPENMPI:
            spread = ["-hosts", ",".join(f"{h}:{s}" for h, s in hosts)] if hosts else []
            return [mpiexec, *spread, "-n", str(ranks), *command]
        argv = [mpiexec]
        if hosts:
            argv += ["--host", ",".join(f"{h}:{s}" for h, s in hosts), "--map-by", "slot"]
            names = sorted({*(env or {}), *(n for n in (environ or {})
                                            if n in FORWARDED or n.startswith(
                                                tuple(p for p in FORWARDED if p.endswith("_"))))})
            for name in names:
                argv += ["-x", name]
        elif local:
            argv.append("--oversubscribe")
        return [*argv, "--bind-to", "none", "-n", str(ranks), *command]
