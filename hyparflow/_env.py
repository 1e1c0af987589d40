"""Process set-up done once at import: quiet TensorFlow, threads per rank."""

import contextlib
import os
import sys
import tempfile
from typing import Iterator

from . import settings

__all__ = ["quiet_tensorflow", "threads_per_rank", "configure_threads", "local_ranks",
           "start_tensorflow", "oversubscribed"]


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
    return 1


def threads_per_rank() -> int:
    """Intra-op threads for this rank: HYPARFLOW_THREADS, else cores // ranks-on-node.

    When the launcher bound the process to fewer cores than the node has, the
    binding already says how many cores are ours, so it is used as is.
    """
    value = settings.threads()
    if value is not None:
        return value
    node_cores = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = node_cores
    if mine < node_cores:
        return max(1, mine)
    return max(1, node_cores // local_ranks())


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


def configure_threads() -> bool:
    """Set TensorFlow's thread pools; a no-op once TensorFlow has started running ops."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads_per_rank())
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
