"""How an error reaches the user: once, from the rank where it happened, in the words
of Keras (model.fit's message and filtered traceback), with hyparflow's context after."""

from __future__ import annotations

import os
import sys
import traceback
import types
from typing import (Any, Callable, Dict, List, Mapping, Optional, ParamSpec, Protocol,
                    Sequence, Tuple, Type, TypeVar)

P = ParamSpec("P")
R = TypeVar("R")
# A rank's set-up outcome, as ranks share it: None, or (type name, message).
RankError = Optional[Tuple[str, str]]


class _Ranks(Protocol):
    """What `agreed` reads of a communicator (engine.comm.Communicator; not imported:
    comm reaches this module through calls)."""

    rank: int
    size: int

__all__ = ["user_errors", "filter_traceback", "format_error", "agreed", "install_hook",
           "REPORTED_ELSEWHERE"]

# The package's root (this file sits in its engine/ wing): frames below it are ours.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Set on an exception that another rank prints: the excepthook here stays silent.
REPORTED_ELSEWHERE = "_hyparflow_reported_elsewhere"


def _filtering() -> bool:
    """Keras's switch (keras.config.disable_traceback_filtering) governs ours too."""
    try:
        import keras

        return bool(keras.config.is_traceback_filtering_enabled())
    except Exception:  # noqa: BLE001 - no Keras: show everything
        return False


def filter_traceback(tb: Optional[types.TracebackType],
                     all_ours: bool = False) -> Optional[types.TracebackType]:
    """`tb` without hyparflow's own frames, as Keras hides its frames: the user's frame
    comes first, then where the error was raised (the innermost frame is kept, unless it
    is this module's, or `all_ours`: the error is about the call itself, the user's line)."""
    frames: List[types.TracebackType] = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    kept = [t for t in frames[:-1] if not t.tb_frame.f_code.co_filename.startswith(_PACKAGE)]
    last = frames[-1:]
    if last and (all_ours or last[0].tb_frame.f_code.co_filename == _THIS):
        last = [] if kept else last
    kept += last
    new: Optional[types.TracebackType] = None
    for t in reversed(kept):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new


_THIS = os.path.abspath(__file__)
_CALL_ERROR = "_hyparflow_call_error"   # set on an error in the call's own arguments


def _bad_call(fn: Callable[..., Any], name: str, args: Sequence[Any],
              kwargs: Mapping[str, Any]) -> Optional[TypeError]:
    """The TypeError Python would raise for a call of `fn` that does not fit its
    signature, None if it fits; a mistyped keyword gets Keras's "Did you mean ...?"."""
    import difflib
    import inspect

    signature = inspect.signature(fn)
    try:
        signature.bind(*args, **kwargs)
        return None
    except TypeError as error:
        message = f"{name}() {error}"
    unknown = [k for k in kwargs if k not in signature.parameters]
    if unknown:
        message = f"{name}() got an unexpected keyword argument {unknown[0]!r}."
        close = difflib.get_close_matches(unknown[0], list(signature.parameters), n=1,
                                          cutoff=0.7)
        if close:
            message += f" Did you mean {close[0]!r}?"
    return TypeError(message)


def user_errors(name: Optional[str] = None,
                agree: Optional[Callable[[TypeError, Dict[str, Any]], None]] = None,
                ) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a public entry point (`name`: as the user calls it, e.g. "hf.fit"): an
    error leaves it with hyparflow's frames hidden (unless Keras's traceback filtering
    is off), and prints once, by the first rank, if nobody catches it. `agree(error,
    kwargs)`: for a call that does not fit the signature, raises the error on every
    rank together (`agreed`)."""
    import functools

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        called = name or fn.__name__

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                bad = _bad_call(fn, called, args, kwargs)
                if bad is not None:
                    setattr(bad, _CALL_ERROR, True)
                    if agree is None:
                        raise bad
                    agree(bad, kwargs)
                return fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - re-raised, its traceback shortened
                if not _filtering():
                    raise
                install_hook()
                raise error.with_traceback(filter_traceback(
                    error.__traceback__, getattr(error, _CALL_ERROR, False))) from None

        return wrapper

    return decorate


def format_error(exc: BaseException) -> str:
    """The text Python would print for `exc` had it not been caught: the frames from the
    program's start to where it was caught (the user's script first), then its own,
    hyparflow's hidden as in `user_errors`."""
    te = traceback.TracebackException.from_exception(exc)
    tb = exc.__traceback__
    outer = traceback.extract_stack(tb.tb_frame.f_back) if tb is not None else []
    frames = list(outer) + list(te.stack)
    if _filtering() and frames:
        frames = [f for f in frames[:-1] if not f.filename.startswith(_PACKAGE)] + frames[-1:]
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):   # Python 3.11+: printed after the message
        exc.add_note(text)


def _hook(kind: Type[BaseException], value: BaseException,
          tb: Optional[types.TracebackType]) -> None:
    if getattr(value, REPORTED_ELSEWHERE, False):
        return   # another rank printed it; the exit code is still 1
    if _filtering() and tb is not None:
        # The entry point's own frame was added as the error left it: hide it too.
        tb = filter_traceback(tb, getattr(value, _CALL_ERROR, False))
        value = value.with_traceback(tb)   # Python prints the exception's own traceback
    if _previous is not None:   # installed by install_hook, which sets it first
        _previous(kind, value, tb)


_previous: Optional[Callable[[Type[BaseException], BaseException,
                              Optional[types.TracebackType]], Any]] = None


def install_hook() -> None:
    """Python's excepthook, wrapped: an uncaught error that another rank prints stays
    silent here, and hyparflow's frames are hidden from the one printed."""
    global _previous
    if _previous is None:
        _previous = sys.excepthook
        sys.excepthook = _hook


def agreed(comm: _Ranks, error: Optional[BaseException],
           errors: Sequence[RankError]) -> BaseException:
    """The exception this rank raises after set-up failed somewhere, given every rank's
    (type name, message) or None. The first rank with the error reports it (its own
    exception, with a note on where it happened); every other rank raises too (a caller
    may catch it) but prints nothing if it goes uncaught."""
    failed = [r for r, e in enumerate(errors) if e is not None]
    first = failed[0]
    if error is None:
        kind, message = errors[first] or ("", "")   # not None: rank `first` failed
        error = RuntimeError(f"hyparflow set-up failed on rank {first}: {kind}: {message}")
    if comm.size > 1 and comm.rank != first:
        setattr(error, REPORTED_ELSEWHERE, True)
        if _is_process_rank(comm):
            install_hook()
    elif comm.size > 1:
        same = all(errors[r] == errors[first] for r in failed)
        where = (f"on every rank ({comm.size}) alike; shown by rank {first} only"
                 if same and len(failed) == comm.size else
                 f"on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of "
                 f"{comm.size}; the other ranks stopped with it")
        _note(error, f"hyparflow: set-up failed {where}.")
    return error


def _is_process_rank(comm: _Ranks) -> bool:
    """True when each rank is a process of its own (real MPI), not a thread here."""
    return type(comm).__name__ == "MPICommunicator"
