"""Restart a failed run on the hosts that still answer: `hyparflow run --restarts K`.

When a run fails, each host of the run is probed through the launcher (a one-rank
`mpiexec -hosts HOST:1 -n 1 true` (Open MPI: `--host`) with a time limit: what the run itself needs of a host,
its launcher reaching it and its proxy reaching back). The layout is re-shaped to the
slots of the hosts that answered (`reshape`: fewer replicas first, then fewer stages,
then fewer tensor ranks) and the same command starts again; the script, with
`hf.fit(..., checkpoint_dir=DIR, resume=True)`, continues from its newest valid
checkpoint, which loads into any layout (checkpoint.py).

`reshape` is pure; `probe` and `run` start processes (the launcher), never import
TensorFlow or MPI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import settings
from ..layout import Layout
from .hosts import HostSlots
from .launch import CommandLine

__all__ = ["RestartError", "host_slots", "pipelines_within", "reshape", "probe_seconds", "probe", "restartable",
           "describe_shape", "run"]

SCRIPT_ERROR = 1   # what Python exits with on an uncaught exception: a bug, not a lost host


class RestartError(ValueError):
    """No layout fits the hosts that remain; the message says what is left."""


def host_slots(layout: Layout) -> HostSlots:
    """[(host, ranks)] of a placed layout, in rank order (consecutive ranks grouped)."""
    grouped: HostSlots = []
    for host in layout.hosts or ():
        if grouped and grouped[-1][0] == host:
            grouped[-1] = (host, grouped[-1][1] + 1)
        else:
            grouped.append((host, 1))
    return grouped


def pipelines_within(layout: Layout) -> bool:
    """Whether every pipeline (stages x tensor ranks, consecutive ranks) is on one host."""
    hosts, pipeline = layout.hosts or (), layout.pipeline
    return all(len(set(hosts[r:r + pipeline])) <= 1 for r in range(0, len(hosts), pipeline))


def _fill(slots: Sequence[Tuple[str, int]], pipeline: int, count: int,
          within: bool) -> Tuple[Tuple[str, int], ...]:
    """Ranks taken from each host for `count` pipelines of `pipeline` ranks: whole
    pipelines per host (`within`), else the hosts filled in order."""
    taken: HostSlots = []
    left = count * pipeline
    for name, free in slots:
        take = min((free // pipeline) * pipeline if within else free, left)
        if take:
            taken.append((name, take))
        left -= take
    return tuple(taken)


def reshape(slots: Sequence[Tuple[str, int]], stages: int, replicas: int,
            tensor: int = 1) -> Layout:
    """The layout to restart with on hosts `slots` [(name, free slots)], from a run of
    `stages` x `replicas` x `tensor` ranks.

    The rule: keep the pipeline (stages x tensor ranks) and drop replicas, preferring
    pipelines that fit within one host (their activations stay off the network) over
    pipelines that span hosts; when not even one pipeline fits, fewer stages (the
    partition is recomputed for them), then fewer tensor ranks. Never more replicas than
    before (the global batch is split the same way or fewer). Raises RestartError when
    no host is left."""
    slots = [(name, int(free)) for name, free in slots if int(free) > 0]
    for name, value in (("stages", stages), ("replicas", replicas), ("tensor", tensor)):
        if int(value) < 1:
            raise RestartError(f"{name} must be at least 1. Received: {value!r}")
    if not slots:
        raise RestartError("no host is left to restart on.")
    for t in range(tensor, 0, -1):
        for s in range(stages, 0, -1):
            pipeline = s * t
            for within in (True, False):
                fits = (sum(free // pipeline for _, free in slots) if within
                        else sum(free for _, free in slots) // pipeline)
                if fits >= 1:
                    count = min(replicas, fits)
                    taken = _fill(slots, pipeline, count, within)
                    return Layout(num_stages=s, num_replicas=count, num_tensor=t,
                                  hosts=tuple(h for h, n in taken for _ in range(n)))
    raise AssertionError("unreachable: one rank always fits")  # pragma: no cover


def describe_shape(layout: Layout) -> str:
    parts = [f"{layout.num_stages} stage{'s' if layout.num_stages > 1 else ''}",
             f"{layout.num_replicas} replica{'s' if layout.num_replicas > 1 else ''}"]
    if layout.num_tensor > 1:
        parts.append(f"{layout.num_tensor} tensor ranks")
    hosts = ",".join(f"{h}:{n}" for h, n in host_slots(layout))
    return f"{' x '.join(parts)} on {hosts}"


def probe_seconds(environ: Optional[Mapping[str, str]] = None) -> float:
    """How long a host gets to answer the probe: HYPARFLOW_PROBE_SECONDS (default 10)."""
    return settings.probe_seconds(environ)


def probe(hosts: Sequence[str], mpiexec: str, environ: Optional[Mapping[str, str]] = None,
          seconds: Optional[float] = None) -> Dict[str, bool]:
    """{host: True if it answered} for `hosts` [names], all probed at once: a one-rank
    mpiexec on the host running `true`, within `seconds`. A host whose link is down
    never answers (the proxy cannot reach back), and one whose launcher fails answers
    with an error: both count as lost."""
    env = dict(os.environ if environ is None else environ)
    seconds = probe_seconds(env) if seconds is None else seconds
    from .dialect import Dialect, of_mpiexec

    speaks = Dialect(of_mpiexec(mpiexec))   # -hosts for MPICH, --host for Open MPI
    procs = {h: subprocess.Popen(speaks.argv(mpiexec, 1, ["true"], [(h, 1)]), env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
             for h in hosts}
    deadline = time.monotonic() + seconds
    answered: Dict[str, bool] = {}
    while procs and time.monotonic() < deadline:
        for h, p in list(procs.items()):
            if p.poll() is not None:
                answered[h] = p.returncode == 0
                del procs[h]
        time.sleep(0.05)
    for h, p in procs.items():
        answered[h] = False
        _kill_group(p)
    return {h: answered[h] for h in hosts}


def _kill_group(proc: "subprocess.Popen[bytes]") -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def restartable(code: int, lost_hosts: Collection[str]) -> bool:
    """Whether a run that ended with `code` is worth restarting: a lost peer (75), a rank
    killed by a signal, any other launcher failure, or any host lost. Not a script's own
    error (exit code 1 with every host answering): it would fail again the same way."""
    return code != 0 and (bool(lost_hosts) or code != SCRIPT_ERROR)


def _say(text: str) -> None:
    sys.stderr.write(f"hyparflow run: {text}\n")
    sys.stderr.flush()


# make_line(hosts, stages, replicas, tensor): the command line for a layout (None: not given).
MakeLine = Callable[[Optional[HostSlots], Optional[int], Optional[int], Optional[int]], CommandLine]
# start(line, lost): run it, return its exit code, add the hosts the ranks reported lost.
Start = Callable[[CommandLine, List[str]], int]


def run(make_line: MakeLine, start: Start, restarts: int, hosts: Optional[HostSlots],
        stages: int, replicas: int, tensor: int, mpiexec: str, given: Collection[str],
        environ: Optional[Mapping[str, str]] = None) -> int:
    """Run, and after a failure restart up to `restarts` times on the hosts that answer.

    `make_line(hosts, stages, replicas, tensor)` -> a launch.CommandLine for that layout
    (hosts None: this machine); `start(line, lost)` runs it, returns its exit code and
    adds the host names the ranks reported lost to the list `lost`. `hosts`: the run's
    [(name, slots)] or None; `given`: the names of the counts the user gave (only those
    are exported again, re-shaped)."""
    layout = Layout(num_stages=stages, num_replicas=replicas, num_tensor=tensor,
                   hosts=tuple(h for h, n in hosts or () for _ in range(int(n))) or None)
    first_ranks = layout.ranks
    line = make_line(hosts, stages if "stages" in given else None,
                     replicas if "replicas" in given else None,
                     tensor if "tensor" in given else None)
    history: List[str] = []
    for attempt in range(restarts + 1):
        reported: List[str] = []
        code = start(line, reported)
        if code == 0:
            if history:
                _say(f"finished after {len(history)} restart{'s' if len(history) > 1 else ''} "
                     f"({'; '.join(history)}), on {describe_shape(layout)}.")
            return 0
        if attempt == restarts:
            if restarts:
                _say(f"failed with exit code {code}; no restart left (--restarts {restarts}).")
            return code
        if hosts:
            started = time.monotonic()
            answered = probe([h for h, _ in host_slots(layout)], mpiexec, environ)
            lost = [h for h, ok in answered.items() if not ok]
            named = sorted(set(reported) - set(lost))
            _say(f"the run failed (exit code {code}); probed its hosts in "
                 f"{time.monotonic() - started:.1f} s: "
                 + ", ".join(f"{h} {'answers' if ok else 'LOST (no answer)'}"
                             for h, ok in answered.items())
                 + (f" (the ranks named {', '.join(named)} lost, but it answers now)"
                    if named else ""))
        else:
            lost = []
        if not restartable(code, lost):
            _say(f"the run failed with exit code {code} (an error of the script, every host "
                 "answering): not restarting; --restarts restarts after a lost host or rank.")
            return code
        old = layout
        if hosts:
            left = [(h, n) for h, n in host_slots(layout) if h not in lost]
            try:
                layout = reshape(left, layout.num_stages, layout.num_replicas, layout.num_tensor)
            except RestartError as error:
                _say(f"cannot restart: {error} (lost: {', '.join(lost)})")
                return code
        what = f"lost {', '.join(lost)}" if lost else f"exit code {code}"
        history.append(what)
        _say(f"restart {attempt + 1} of {restarts} ({what}): "
             f"{describe_shape(layout) if hosts else 'the same ranks'}"
             + (f" (was {describe_shape(old)})" if hosts else "")
             + "; the script resumes from its newest checkpoint (hf.fit(..., resume=True)).")
        line = make_line(host_slots(layout) if hosts else None,
                         layout.num_stages if "stages" in given else None,
                         layout.num_replicas if "replicas" in given else None,
                         layout.num_tensor if "tensor" in given else None)
        if layout.ranks != first_ranks:
            # A script's plan file (fit(plan=...)) was made for the first ranks.
            line.env["HYPARFLOW_RESHAPED"] = f"{first_ranks}->{layout.ranks}"
    return code  # pragma: no cover - the loop returns
