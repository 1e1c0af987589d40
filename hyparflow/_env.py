"""Process set-up done once at import: quiet TensorFlow, threads per rank."""

import contextlib
import os
import sys
import tempfile
from typing import Iterator, List, Optional

from . import settings

__all__ = ["run_as_module", "quiet_tensorflow", "threads_per_rank", "configure_threads",
           "local_ranks", "start_tensorflow", "oversubscribed", "derive_threads", "cpu_quota",
           "my_cores", "threads_source", "configured_threads"]


def run_as_module(argv: Optional[List[str]] = None) -> bool:
    """Whether this interpreter was started as `python -m hyparflow ...` (`argv`:
    `sys.orig_argv`). Such a process is the command, as the console script's is,
    and needs no TensorFlow. Only the interpreter's own options before `-m` count:
    `python train.py -m hyparflow` is a script with arguments."""
    args = list(getattr(sys, "orig_argv", []) if argv is None else argv)[1:]
    with_value = ("-W", "-X", "--check-hash-based-pycs")
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "-c"):
        if args[i] == "-m":
            return args[i + 1:i + 2] == ["hyparflow"]
        i += 2 if args[i] in with_value else 1
    return False


def quiet_tensorflow() -> None:
    """Silence TensorFlow's start-up noise unless the user asked for it.

    Must run before TensorFlow is first imported: the C++ logger reads the
    variable once.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # absl's "All log messages before absl::InitializeLog()" line.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def local_ranks() -> int:
    """How many ranks share this node, from the launcher's environment."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return max(1, int(value))
    # Slurm: SLURM_STEP_TASKS_PER_NODE looks like "4" or "4(x2),3".
    value = os.environ.get("SLURM_STEP_TASKS_PER_NODE") if "SLURM_STEP_ID" in os.environ else None
    if value:
        head = value.split(",")[0].split("(")[0]
        if head.isdigit():
            return max(1, int(head))
    if any(name in os.environ for name in ("PMI_RANK", "PMIX_RANK", "PMI_SIZE")):
        return _shared_split()  # a launcher that does not say: ask MPI
    return 1


_SPLIT: List[int] = []


def _shared_split() -> int:
    """The ranks on this node from MPI's shared-memory split (COMM_TYPE_SHARED), for
    launchers that set no local count. Starts MPI (this runs before TensorFlow does,
    at import); 1 when MPI is not to be started here (`mpi4py.rc.initialize` off)."""
    if not _SPLIT:
        try:
            import mpi4py

            if not mpi4py.rc.initialize and "mpi4py.MPI" not in sys.modules:
                return 1
            from mpi4py import MPI

            if not MPI.Is_initialized() or MPI.Is_finalized():
                return 1
            node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            _SPLIT.append(node.Get_size())
            node.Free()
        except Exception:  # noqa: BLE001 - no MPI: one rank
            _SPLIT.append(1)
    return _SPLIT[0]


def derive_threads(cores: int, node_cores: int, local: int, quota: Optional[float] = None,
                   slurm_cpus: Optional[int] = None) -> int:
    """Threads per rank from what the node allows (pure: tested as a table).

    `cores`: the cores this rank may run on (its affinity); `node_cores`: the node's;
    `local`: the ranks on this node; `quota`: the cgroup's CPU quota in cores (cpu.max,
    shared by every rank of the container), if any; `slurm_cpus`: SLURM_CPUS_PER_TASK
    inside a Slurm step (Slurm gives and binds each task that many). A rank whose
    affinity is narrower than the node was bound by its launcher: its cores are its own.
    Otherwise the ranks of the node share them.
    """
    if slurm_cpus:
        return max(1, min(slurm_cpus, cores))
    share = float(cores) if cores < node_cores else cores / max(1, local)
    if quota is not None:
        share = min(share, quota / max(1, local))
    return max(1, int(share))


def cpu_quota(root: str = "/sys/fs/cgroup") -> Optional[float]:
    """The cgroup's CPU quota in cores (cgroup v2 cpu.max, else v1's cfs files); None
    when unlimited or unreadable."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def my_cores() -> List[int]:
    """The cores this process may run on (its affinity), else all of the machine's."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def slurm_cpus() -> Optional[int]:
    """SLURM_CPUS_PER_TASK inside a Slurm job step (srun), else None."""
    value = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return int(value) if value.isdigit() and "SLURM_STEP_ID" in os.environ else None


def threads_per_rank() -> int:
    """Intra-op threads for this rank: HYPARFLOW_THREADS_PER_RANK, else derived from
    the cores this rank may use and the ranks on its node (`derive_threads`)."""
    value = settings.threads()
    if value is not None:
        return value
    return derive_threads(len(my_cores()), os.cpu_count() or 1, local_ranks(), cpu_quota(),
                          slurm_cpus())


def threads_source() -> str:
    """Where `threads_per_rank` came from, in words (the first line of a run, `info`)."""
    if settings.threads() is not None:
        return "HYPARFLOW_THREADS_PER_RANK"
    if slurm_cpus():
        return "SLURM_CPUS_PER_TASK"
    cores, node, quota = len(my_cores()), os.cpu_count() or 1, cpu_quota()
    if cores < node:
        text = f"{cores} cores bound to this rank"
    else:
        text = f"{cores} cores // {local_ranks()} ranks on this node"
    return text + (f", cgroup quota {quota:g} cores" if quota is not None else "")


@contextlib.contextmanager
def _stderr_to_file() -> Iterator[None]:
    """Point file descriptor 2 at a temporary file (C++ logging bypasses Python's
    sys.stderr); hand back what was written if the block fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def start_tensorflow() -> bool:
    """Import TensorFlow, set its threads and start its runtime, quietly.

    TensorFlow's C++ start-up lines (oneDNN, CPU features, absl) go to file
    descriptor 2 whatever TF_CPP_MIN_LOG_LEVEL says, so they are diverted for
    the import and the first operation only. HYPARFLOW_SHOW_TF_LOGS=1 keeps them.
    """
    if "tensorflow" in sys.modules or settings.show_tf_logs():
        return configure_threads()
    with _stderr_to_file():
        import tensorflow as tf

        done = configure_threads()
        tf.constant(0.0) + 1.0  # starts the runtime, which logs once more
    return done


def oversubscribed() -> bool:
    """True when this node's ranks want more threads than it has cores."""
    return local_ranks() * threads_per_rank() > (os.cpu_count() or 1)


_CONFIGURED: List[int] = []   # the intra-op threads this process's TensorFlow started with


def configured_threads() -> Optional[int]:
    """The intra-op threads hyparflow gave TensorFlow (None: it could not)."""
    return _CONFIGURED[-1] if _CONFIGURED else None


def configure_threads() -> bool:
    """Set TensorFlow's thread pools; a no-op once TensorFlow has started running ops."""
    import tensorflow as tf

    try:
        count = threads_per_rank()
        tf.config.threading.set_intra_op_parallelism_threads(count)
        _CONFIGURED.append(count)
        # One: a rank's ops run in order on its own core. Ranks run as threads of one
        # process (tests) need one each, since a split layer's sum waits inside a
        # compiled function for the other ranks' (HYPARFLOW_INTER_OP_THREADS).
        tf.config.threading.set_inter_op_parallelism_threads(
            settings.inter_op_threads())
    except RuntimeError:
        # The runtime is already initialised (the user ran TF ops before importing
        # hyparflow); TensorFlow refuses changes then, and its defaults stay.
        import warnings

        warnings.warn(
            "hyparflow could not set TensorFlow's threads per rank: TensorFlow already ran "
            "operations. Import hyparflow before building models (first line of the script).",
            RuntimeWarning, stacklevel=3)
        return False
    return True
