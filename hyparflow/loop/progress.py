"""Progress and callbacks for fit, evaluate and predict: Keras's own machinery
(CallbackList, ProgbarLogger), on the ranks that should run each part of it."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple, Union, cast

import keras

if TYPE_CHECKING:
    from ..engine.comm import Communicator

__all__ = ["MAIN_ONLY_CALLBACKS", "resolve_verbose", "stdout_is_terminal", "callback_list"]

# Callbacks that write files or print: run on rank 0 only (they see the same logs
# and, at epoch ends, the whole model there). Every other callback runs on every
# rank, so that decisions (early stopping, learning-rate changes) are taken alike.
MAIN_ONLY_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger,
                       keras.callbacks.TensorBoard, keras.callbacks.ProgbarLogger,
                       keras.callbacks.BackupAndRestore)

# Processes between a rank and the terminal: MPICH's and Open MPI's launchers, Slurm's.
_LAUNCHERS = {"mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy", "orterun", "orted",
              "prterun", "prted", "srun", "slurmstepd"}


def _process(pid: int) -> Tuple[str, int]:
    """(name, parent pid) of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    return name, int(stat[stat.rindex(")") + 2:].split()[1])


def _launcher_on_terminal() -> bool:
    """Whether this rank's launcher (mpiexec, srun) writes to a terminal. A launcher
    passes the ranks' output on through pipes, so a rank never sees the terminal itself:
    walk up through the launcher's processes and look at the outermost one's stdout."""
    try:
        pid = os.getppid()
        outermost: Optional[int] = None
        for _ in range(8):
            name, parent = _process(pid)
            if name.split(" ")[0] not in _LAUNCHERS:
                break
            outermost, pid = pid, parent
        if outermost is None:
            return False
        target = os.readlink(f"/proc/{outermost}/fd/1")
        return target.startswith(("/dev/pts/", "/dev/tty"))
    except (OSError, ValueError, IndexError):
        return False  # not Linux, or not allowed to look: no terminal assumed


def stdout_is_terminal() -> bool:
    """Whether this process's output reaches a terminal (directly or via its launcher)."""
    stream = sys.stdout
    if getattr(stream, "isatty", None) is not None and stream.isatty():
        return True
    if stream is not sys.__stdout__:
        return False  # redirected inside Python (a log capture, a StringIO)
    return _launcher_on_terminal()


def resolve_verbose(verbose: Union[int, str]) -> int:
    """0, 1 or 2; "auto": the progress bar (1) on a terminal, else one line per
    epoch (2), so that logs get no escape codes."""
    if verbose == "auto":
        return 1 if stdout_is_terminal() else 2
    if verbose not in (0, 1, 2):
        raise ValueError(f"`verbose` must be 0, 1, 2 or 'auto'. Received: verbose={verbose!r}")
    return cast(int, verbose)   # 0, 1 or 2 (as given: True and 1.0 pass, as in Keras)


def callback_list(model: Any, comm: Communicator, callbacks: Optional[Sequence[Any]], verbose: int,
                  *, epochs: int, steps: Optional[int],
                  add_history: bool = False) -> Tuple[Any, bool]:
    """Keras's CallbackList for this rank: the progress bar on rank 0 only, main-only
    callbacks there only (Keras callbacks: Any). Returns (callbacks, per_step): per_step says whether the
    per-batch logs (a collective) are computed, on every rank alike."""
    main = comm.rank == 0
    user = [c for c in (callbacks or []) if main or not isinstance(c, MAIN_ONLY_CALLBACKS)]
    cbs = keras.callbacks.CallbackList(user, add_history=add_history,
                                       add_progbar=verbose != 0 and main, model=model,
                                       verbose=verbose, epochs=epochs, steps=steps)
    # Ranks may differ in verbosity (`verbose=1 if hf.is_main() else 0` is common)
    # or callbacks; per-step logs are a collective, so all join if any wants them.
    per_step = any(comm.allgather_obj(verbose == 1 or bool(callbacks)))
    return cbs, per_step
