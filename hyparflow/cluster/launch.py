"""Pick a launcher (srun or mpiexec) and build the command and environment of a run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple, Union, overload

from .. import settings
from ..layout import Layout, resolve

if TYPE_CHECKING:
    from .hosts import HostSlots

__all__ = ["LaunchError", "CommandLine", "in_slurm_allocation", "find_mpiexec", "usable_cores",
           "layout", "requested", "run_environment", "describe_layout", "command_line", "describe",
           "execute", "supervise", "named_hosts"]


class LaunchError(ValueError):
    """A run that cannot start: bad counts, a missing script or launcher."""


@dataclass
class CommandLine:
    """What `hyparflow run` executes: argv and the variables it adds to the environment."""

    launcher: str                      # "srun" or "mpiexec"
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)   # only the variables set or changed
    reason: str = ""                   # why this launcher
    layout: str = ""                   # how the ranks will be used, as far as the flags say
    placement: List[str] = field(default_factory=list)  # "rank k: host (stage, replica)" lines
    supervise: bool = False            # run under `supervise` (ranks on other hosts)


def in_slurm_allocation(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True inside an sbatch/salloc job with srun on PATH."""
    environ = os.environ if environ is None else environ
    return bool(environ.get("SLURM_JOB_ID")) and shutil.which("srun", path=environ.get("PATH")) is not None


def find_mpiexec(environ: Optional[Mapping[str, str]] = None,
                 python: Optional[str] = None) -> Optional[str]:
    """The launcher of the MPI mpi4py was built with: beside this Python (the `mpich`
    wheel's), else on PATH (`dialect.find_mpiexec`)."""
    from . import dialect

    return dialect.find_mpiexec(environ, python)


def usable_cores() -> int:
    """Cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# A count as a flag gives it (int) or as text (an environment variable, a flag not yet parsed).
Count = Union[int, str]


@overload
def _positive(name: str, value: None) -> None: ...
@overload
def _positive(name: str, value: Count) -> int: ...
def _positive(name: str, value: Optional[Count]) -> Optional[int]:
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise LaunchError(f"{name} must be a positive integer. Received: {value!r}") from None
    if number < 1:
        raise LaunchError(f"{name} must be a positive integer. Received: {value!r}")
    return number


def layout(ranks: Count, stages: Optional[Count] = None, replicas: Optional[Count] = None,
           microbatches: Optional[Count] = None, environ: Optional[Mapping[str, str]] = None,
           tensor: Optional[Count] = None) -> Layout:
    """Check (ranks, stages, replicas, microbatches) against each other and complete them.

    Only counts the user gave (a flag, or HYPARFLOW_NUM_* in `environ`) are checked; the
    rest are completed with `fit`'s defaults (1 stage, ranks // (stages x tensor)
    replicas, 1 microbatch) for describing the run, but a run exports only what was given
    (`requested`): a script's own `hf.fit(num_stages=...)` decides the rest. `tensor`:
    ranks per stage (`--tensor`), which a pipeline needs `stages x tensor` of.
    Returns the `Layout` (hyparflow.layout) the run would have without script arguments.
    """
    environ = os.environ if environ is None else environ
    ranks = _positive("the number of ranks (-n)", ranks)
    given = requested(stages, replicas, microbatches, tensor, environ)
    tensor = given.get("tensor", 1)
    stages = given.get("stages")
    microbatches = given.get("microbatches", 1)
    replicas = given.get("replicas")
    if stages is None:
        # The script may choose its own stages: only a given replica count can be checked.
        if replicas is not None and ranks % (replicas * tensor):
            raise LaunchError(f"-n {ranks} ranks cannot be split into --replicas {replicas}"
                              + (f" x --tensor {tensor}" if tensor > 1 else "") + " pipelines.")
        stages = ranks // (replicas * tensor) if replicas is not None else 1
    pipeline = stages * tensor
    what = f"{stages} stages" + (f" x {tensor} tensor ranks" if tensor > 1 else "")
    flag = "--stages" + (" x --tensor" if tensor > 1 else "")
    if ranks % pipeline:
        lower = ranks - ranks % pipeline
        options = " or ".join(f"-n {n}" for n in (lower, lower + pipeline) if n)
        raise LaunchError(
            f"{ranks} ranks cannot be split into pipelines of {what}: the number of "
            f"ranks must be a multiple of {flag} (e.g. {options}).")
    if replicas is not None and pipeline * replicas != ranks:
        raise LaunchError(f"{flag} {pipeline} x --replicas {replicas} = {pipeline * replicas} "
                          f"ranks, but -n is {ranks}; give -n {pipeline * replicas} or leave "
                          f"--replicas out (it defaults to -n // ({flag})).")
    # Checked above in the words of the flags; `resolve` completes it as fit would.
    return resolve(ranks, num_stages=stages, num_replicas=replicas,
                   num_microbatches=microbatches, num_tensor=tensor, environ={})


def mesh_flag(mesh: Optional[str],
              tensor: Optional[Count] = None) -> Tuple[Optional[Count], Optional[str]]:
    """(tensor ranks, "QxQ") from `--tensor-mesh QxQ` and `--tensor`, checked: the mesh
    is square, of at least 2 x 2, and Q * Q is --tensor when both are given (without
    --tensor the mesh sets it). (tensor, None) without a mesh."""
    if mesh is None:
        return tensor, None
    try:
        q, p = settings.parse_mesh(str(mesh), "--tensor-mesh")
    except settings.SettingError as error:
        raise LaunchError(str(error)) from None
    if q != p or q < 2:
        raise LaunchError(f"--tensor-mesh {mesh} must be square and at least 2x2 (QxQ, e.g. "
                          "2x2 for 4 tensor ranks, 3x3 for 9).")
    if tensor is not None and tensor != q * q:
        raise LaunchError(f"--tensor-mesh {mesh} has {q * q} ranks but --tensor is {tensor}; "
                          f"give --tensor {q * q}, or leave --tensor out (the mesh sets it).")
    return q * q, f"{q}x{q}"


def requested(stages: Optional[Count] = None, replicas: Optional[Count] = None,
              microbatches: Optional[Count] = None, tensor: Optional[Count] = None,
              environ: Optional[Mapping[str, str]] = None) -> Dict[str, int]:
    """{name: count} of the counts the user gave, checked: flags, else HYPARFLOW_NUM_*
    already set. What is not here, `fit` takes from its own arguments or derives."""
    out: Dict[str, int] = {}
    try:
        exported = settings.layout_counts(os.environ if environ is None else environ)
    except settings.SettingError as error:
        raise LaunchError(str(error)) from None
    for name, value, flag in (("stages", stages, "--stages"), ("replicas", replicas, "--replicas"),
                              ("microbatches", microbatches, "--microbatches"),
                              ("tensor", tensor, "--tensor")):
        count = value if value is not None else exported.get(f"num_{name}")
        if count is not None:
            out[name] = _positive(flag, count)
    return out


def from_plan(path: str, ranks: Optional[int],
              threads: Optional[int]) -> Tuple[Optional[int], Optional[int], str]:
    """`hyparflow run --plan FILE`: (ranks, threads per rank, the file's absolute path),
    the plan's where -n and --threads-per-rank were not given (its ranks: S x T x R,
    unless it leaves R to the world size)."""
    from .. import plan as _plan

    try:
        found = _plan.read(path)
    except ValueError as error:
        raise LaunchError(f"--plan: {error}") from None
    if ranks is None and found.get("num_replicas") is not None:
        ranks = (found["num_stages"] * found.get("num_tensor", 1)
                 * found["num_replicas"])
    if threads is None:
        threads = found.get("threads_per_rank")
    return ranks, threads, os.path.abspath(path)


def run_environment(stages: Optional[int] = None, replicas: Optional[int] = None,
                    microbatches: Optional[int] = None, threads: Optional[Count] = None,
                    ranks_on_node: Optional[int] = None,
                    environ: Optional[Mapping[str, str]] = None,
                    tensor: Optional[int] = None,
                    mesh: Optional[str] = None, plan: Optional[str] = None) -> Dict[str, str]:
    """The variables a run sets: the S, R, M, T the user asked for (none else: a count
    that is only derived, like the replicas = ranks // S, must be derived again where the
    script's own S is known), threads per rank, quiet unbuffered Python.

    Threads: `threads` if given, else an HYPARFLOW_THREADS_PER_RANK (or its older name
    HYPARFLOW_THREADS) already set, else Slurm's
    SLURM_CPUS_PER_TASK, else cores // ranks_on_node when that is known (all ranks on
    this node); otherwise left unset and each rank works it out at start-up.
    """
    environ = os.environ if environ is None else environ
    env: Dict[str, str] = {}
    for name, value in (("STAGES", stages), ("REPLICAS", replicas),
                        ("MICROBATCHES", microbatches), ("TENSOR", tensor)):
        if value is not None:
            env[f"HYPARFLOW_NUM_{name}"] = str(value)
    if mesh is not None:  # "QxQ" (`mesh_flag`)
        env["HYPARFLOW_TENSOR_MESH"] = mesh
    if plan is not None:  # `--plan`: fit's plan= where the script passes none
        env["HYPARFLOW_PLAN"] = plan
    env.update({
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    })
    count = _positive("--threads-per-rank", threads)
    if count is None:
        try:
            count = settings.threads(environ)
        except settings.SettingError as error:
            raise LaunchError(str(error)) from None
    if count is None and (environ.get("SLURM_CPUS_PER_TASK") or "").isdigit():
        count = max(1, int(environ["SLURM_CPUS_PER_TASK"]))
    if count is None and ranks_on_node:
        count = max(1, usable_cores() // ranks_on_node)
    if count is not None:
        env["HYPARFLOW_THREADS_PER_RANK"] = str(count)
        if "OMP_NUM_THREADS" not in environ:
            env["OMP_NUM_THREADS"] = str(count)
    return env


def describe_layout(ranks: int, given: Mapping[str, int]) -> str:
    """One line on how `ranks` ranks will be used, given the counts in `given`."""
    if not given:
        return (f"{ranks} ranks; stages, replicas and microbatches as the script's hf.fit "
                f"says (without arguments: 1 stage x {ranks} replicas)")
    parts = [f"{name} {value}" for name, value in given.items()]
    rest = "" if "replicas" in given else "; replicas = ranks // (stages x tensor)"
    return f"{ranks} ranks; {', '.join(parts)} (the script's own hf.fit arguments win){rest}"


def command_line(script: str, script_args: Sequence[str] = (), *, ranks: Optional[Count] = None,
                 stages: Optional[Count] = None, replicas: Optional[Count] = None,
                 microbatches: Optional[Count] = None, threads: Optional[Count] = None,
                 launcher: str = "auto", environ: Optional[Mapping[str, str]] = None,
                 python: Optional[str] = None, tensor: Optional[Count] = None,
                 hosts: Optional[Sequence[Tuple[str, int]]] = None,
                 mesh: Optional[str] = None, plan: Optional[str] = None) -> CommandLine:
    """Everything `hyparflow run` needs, checked; raises LaunchError with the fix.

    `hosts`: [(name, slots)] (from --hosts or --hostfile) for mpiexec to start the ranks
    on, filled in order; -n defaults to their slots."""
    environ = os.environ if environ is None else environ
    python = python or sys.executable
    tensor, mesh = mesh_flag(mesh, tensor)
    if hosts is not None:
        if launcher == "srun":
            raise LaunchError("--hosts/--hostfile start the ranks with mpiexec; inside a Slurm "
                              "job leave them out (srun uses the allocation's nodes).")
        if ranks is None:
            ranks = sum(slots for _, slots in hosts)
    if ranks is None and (environ.get("SLURM_NTASKS") or "").isdigit() and in_slurm_allocation(environ):
        ranks = int(environ["SLURM_NTASKS"])
    if ranks is None:
        raise LaunchError("give the number of ranks, e.g. `hyparflow run -n 4 train.py` "
                          "(without -n, --dry-run and the counts, `hyparflow run train.py` "
                          "plans the node and launches its best ranks x threads).")
    ranks = layout(ranks, stages, replicas, microbatches, environ, tensor).ranks
    # Export only the flags: a count in the environment already reaches the ranks.
    flags = requested(stages, replicas, microbatches, tensor, environ={})
    given = requested(stages, replicas, microbatches, tensor, environ)
    if not script:
        raise LaunchError("give the script to run, e.g. `hyparflow run -n 4 train.py`.")
    if not os.path.isfile(script):
        raise LaunchError(f"script not found: {script!r} (from {os.getcwd()})")

    placement: List[str] = []
    if hosts is not None:
        from . import hosts as _hosts

        try:
            where = _hosts.place(hosts, ranks)
        except _hosts.HostError as error:
            raise LaunchError(str(error)) from None
        # As fit will use them: what was given, the replicas derived from the rest.
        per = given.get("stages", 1) * given.get("tensor", 1)
        placement = _hosts.describe_placement(where, given.get("stages", 1),
                                              given.get("replicas", ranks // per),
                                              given.get("tensor", 1))
        hosts = [(h, s) for h, s in hosts if h in where]
    if launcher == "auto" and hosts is not None:
        launcher, reason = "mpiexec", "--hosts/--hostfile"
    elif launcher == "auto":
        launcher = "srun" if in_slurm_allocation(environ) else "mpiexec"
        reason = (f"inside Slurm job {environ.get('SLURM_JOB_ID')}" if launcher == "srun"
                  else "no Slurm allocation: SLURM_JOB_ID unset or no srun")
    else:
        reason = "--launcher"
    command = [python, script, *script_args]
    from . import dialect

    family = dialect.library(python)
    if launcher == "srun":
        srun = shutil.which("srun", path=environ.get("PATH"))
        if srun is None:
            raise LaunchError("srun not found on PATH.")
        mpi = dialect.srun_mpi(family, srun)
        if mpi is None and reason == "--launcher":
            raise LaunchError("mpi4py is built with Open MPI, which srun starts through PMIx, "
                              "and this Slurm has none (`srun --mpi=list`); use "
                              "`--launcher mpiexec` (Open MPI's mpiexec reads the allocation).")
        if mpi is None:
            launcher = "mpiexec"
            reason += "; Open MPI and no PMIx in this Slurm: its mpiexec, in the allocation"
        else:
            # A plan's threads per rank: each task gets as many CPUs of the allocation.
            cpus = [f"--cpus-per-task={threads}"] if plan is not None and threads else []
            argv = [srun, f"--mpi={mpi}", "-n", str(ranks), *cpus, "--kill-on-bad-exit=1",
                    *command]
            ranks_on_node = None  # srun may spread the ranks over several nodes
    if launcher == "mpiexec":
        mpiexec = find_mpiexec(environ, python)
        if mpiexec is None:
            fix = ("mpi4py is built with Open MPI: put its bin directory on PATH (load its "
                   "module)" if family == dialect.OPENMPI else
                   "install the `mpich` wheel (pip install mpich) or load your cluster's MPI "
                   "(docs/cluster-mpi.md)")
            raise LaunchError(f"mpiexec not found beside Python or on PATH; {fix}.")
        speaks = dialect.of_mpiexec(mpiexec)
        if dialect.UNKNOWN not in (family, speaks) and family != speaks:
            raise LaunchError(
                f"{mpiexec} is {dialect.NAMES[speaks]}'s but mpi4py is built with "
                f"{dialect.NAMES[family]}: each rank would run alone. Put the launcher of "
                f"mpi4py's MPI first on PATH, or rebuild mpi4py against this one "
                f"(docs/cluster-mpi.md).")
        # Outside Slurm, mpiexec starts every rank here; inside, it may use other nodes.
        local = hosts is None and not environ.get("SLURM_JOB_ID")
        # With hosts, each rank counts the ranks on its own host (MPI_LOCALNRANKS, Open
        # MPI's OMPI_COMM_WORLD_LOCAL_SIZE) to choose its threads, since hosts may differ.
        ranks_on_node = ranks if local else None
        env = run_environment(flags.get("stages"), flags.get("replicas"),
                              flags.get("microbatches"), threads, ranks_on_node, environ,
                              flags.get("tensor"), mesh, plan)
        argv = dialect.Dialect(speaks).argv(mpiexec, ranks, command, hosts, environ, env,
                                            local=local)
        return CommandLine(launcher, argv, env, reason, describe_layout(ranks, given),
                           placement, supervise=hosts is not None)
    if launcher != "srun":
        raise LaunchError(f"unknown launcher {launcher!r}; use auto, srun or mpiexec.")
    env = run_environment(flags.get("stages"), flags.get("replicas"), flags.get("microbatches"),
                          threads, ranks_on_node, environ, flags.get("tensor"), mesh, plan)
    return CommandLine(launcher, argv, env, reason, describe_layout(ranks, given), placement,
                supervise=hosts is not None)


def describe(line: CommandLine) -> str:
    """Shell text for --dry-run: the exports, then the command."""
    lines = [f"# launcher: {line.launcher} ({line.reason})"]
    if line.layout:
        lines.append(f"# layout: {line.layout}")
    lines += [f"# {line}" for line in line.placement]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(line.env.items())]
    lines.append(shlex.join(line.argv))
    return "\n".join(lines)


def execute(line: CommandLine, environ: Optional[Mapping[str, str]] = None) -> NoReturn:
    """Replace this process by the launcher (its exit code and signals are the run's)."""
    environ = dict(os.environ if environ is None else environ)
    environ.update(line.env)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(line.argv[0], line.argv, environ)


LOST_GRACE = 3.0   # seconds mpiexec gets to end by itself once a rank reported a lost peer
_LOST = re.compile(r"^hyparflow: rank \d+ on host \S+: lost ")


def named_hosts(line: str) -> List[str]:
    """The hosts a heartbeat report names lost: 'hyparflow: rank 0 on host a: lost rank 1
    on host b, rank 2 on host c (silent ...' -> ['b', 'c']; [] for any other line."""
    if not _LOST.match(line):
        return []
    named = line.split(": lost ", 1)[1].split(" (", 1)[0]
    return list(dict.fromkeys(re.findall(r"on host (\S+?),?(?= |$)", named)))


def supervise(line: CommandLine, environ: Optional[Mapping[str, str]] = None,
              lost_hosts: Optional[List[str]] = None) -> int:
    """Run the launcher as a child, passing its output through; return its exit code.

    When a host is lost, the ranks that remain end themselves (hyparflow.heartbeat), but
    mpiexec then waits for the lost host's proxy, which cannot answer (a cut link, a frozen
    host). Once a rank has reported a lost peer, mpiexec gets LOST_GRACE seconds, then
    SIGTERM (it ends the proxies it can reach and exits), then SIGKILL; the run exits with
    the heartbeat's code (75). SIGINT, SIGTERM and SIGHUP are passed on to mpiexec.
    `lost_hosts`: a list that gets the host names the ranks reported lost."""
    import signal
    import subprocess
    import threading
    import time

    from .heartbeat import EXIT_CODE

    environ = dict(os.environ if environ is None else environ)
    environ.update(line.env)
    sys.stdout.flush()
    sys.stderr.flush()
    child = subprocess.Popen(line.argv, env=environ, stderr=subprocess.PIPE)
    lost: List[float] = []   # when the first rank reported a lost peer
    stderr = child.stderr
    assert stderr is not None   # stderr=PIPE

    def relay() -> None:
        for raw in iter(stderr.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            text = raw.decode(errors="replace")
            if _LOST.match(text):
                if not lost:
                    lost.append(time.monotonic())
                if lost_hosts is not None:
                    lost_hosts.extend(h for h in named_hosts(text) if h not in lost_hosts)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    forwarded = {sig: signal.signal(sig, lambda number, frame: child.send_signal(number))
                 for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        stage = 0
        while child.poll() is None:
            time.sleep(0.2)
            if lost and stage < 2 and time.monotonic() - lost[0] > LOST_GRACE * (1 + stage):
                child.send_signal(signal.SIGTERM if stage == 0 else signal.SIGKILL)
                if stage == 0:
                    sys.stderr.write(f"hyparflow run: a host was lost; ending {line.launcher} "
                                     f"(it was still waiting for the lost host)\n")
                stage += 1
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    reader.join(timeout=5)
    if lost:
        return EXIT_CODE
    return 128 - child.returncode if child.returncode < 0 else child.returncode
