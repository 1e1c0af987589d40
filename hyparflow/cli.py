"""The `hyparflow` command: run, info, slurm, export, trace, data-service."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import TYPE_CHECKING, List, Optional, Sequence

from .cluster import launch

if TYPE_CHECKING:
    from .cluster.hosts import HostSlots
    from .cluster.launch import CommandLine

    # What add_subparsers returns (generic in typeshed only).
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]
# The parsed options are an argparse.Namespace: its attributes are untyped (Any).

__all__ = ["main", "build_parser"]


def _add_run(sub: Subparsers) -> None:
    p = sub.add_parser(
        "run", help="start a training script on N ranks (srun in a Slurm job, else mpiexec)",
        description="Start SCRIPT on N ranks: `srun --mpi=pmi2` inside a Slurm allocation, "
                    "else the mpiexec beside this Python. Passes on only the counts given "
                    "here, as HYPARFLOW_NUM_STAGES/REPLICAS/MICROBATCHES/TENSOR (the defaults "
                    "of hyparflow.fit's arguments the script leaves out; the script's own "
                    "arguments win); sets HYPARFLOW_THREADS_PER_RANK, PYTHONUNBUFFERED=1 and "
                    "TF_CPP_MIN_LOG_LEVEL=2; exits with the run's code.")
    p.add_argument("-n", "--ranks", type=int, default=None,
                   help="number of ranks (default: $SLURM_NTASKS inside a Slurm job that "
                        "set it; else, with no other count, plan or --hosts: the node is "
                        "planned for the script's model, ranks x threads, the plan cached "
                        "per model, batch, cores and CPU; docs/planning.md)")
    p.add_argument("--stages", type=int,
                   help="pipeline stages S, for scripts that do not choose them (default: "
                        "the script's num_stages, else $HYPARFLOW_NUM_STAGES, else 1)")
    p.add_argument("--tensor", type=int,
                   help="tensor ranks T per stage, which split its widest layers (default: "
                        "the script's num_tensor, else 1)")
    p.add_argument("--tensor-mesh", metavar="QxQ",
                   help="the T = Q x Q tensor ranks of a stage as a 2D mesh (exported as "
                        "HYPARFLOW_TENSOR_MESH; sets --tensor; default: the script's "
                        "tensor_mesh, else a 1D split)")
    p.add_argument("--replicas", type=int,
                   help="replicas R (default: derived by fit as N // (S x T))")
    p.add_argument("--microbatches", type=int,
                   help="microbatches M (default: the script's num_microbatches, else "
                        "$HYPARFLOW_NUM_MICROBATCHES, else 1)")
    p.add_argument("--threads-per-rank", "--threads", dest="threads", type=int,
                   help="intra-op threads per rank, exported as HYPARFLOW_THREADS_PER_RANK "
                        "(default: the cores each rank may use // the ranks on its node)")
    p.add_argument("--plan", metavar="FILE",
                   help="a plan file (`hyparflow plan --output`): its ranks (S x T x R) and "
                        "threads per rank are the defaults of -n and --threads-per-rank, "
                        "and it is exported as HYPARFLOW_PLAN, which the script's "
                        "hf.fit uses when it passes no plan=")
    p.add_argument("--launcher", choices=("auto", "srun", "mpiexec"), default="auto",
                   help="default auto: srun inside a Slurm allocation, else mpiexec")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="H1:N1,H2:N2",
                       help="hosts for mpiexec (no Slurm), filled in order with as many ranks "
                            "as slots: a pipeline stays within a host when each host's slots "
                            "are a multiple of its stages (default -n: all slots)")
    where.add_argument("--hostfile", metavar="FILE",
                       help="the hosts from a file: one per line, NAME, NAME:SLOTS or "
                            "NAME slots=SLOTS")
    p.add_argument("--restarts", type=int, default=0, metavar="K",
                   help="after a failure (a lost host or rank), probe the hosts and start "
                        "again up to K times on those that answer, the layout re-shaped to "
                        "them (fewer replicas, then fewer stages); the script resumes with "
                        "hf.fit(..., checkpoint_dir=DIR, resume=True) (default 0)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data-service", metavar="grpc://HOST:PORT",
                      help="a tf.data service dispatcher whose workers decode the replicas' "
                           "datasets (exported as HYPARFLOW_DATA_SERVICE)")
    data.add_argument("--data-workers", type=int, metavar="K",
                      help="start a tf.data service dispatcher and K workers on this node for "
                           "the run, and stop them when it ends (mpiexec runs)")
    p.add_argument("--data-service-mode", choices=("exact", "dynamic"),
                   help="exported as HYPARFLOW_DATA_SERVICE_MODE (default exact: model.fit's "
                        "weights; docs/training.md, 'Decoding on other nodes')")
    p.add_argument("--dry-run", action="store_true",
                   help="print where each rank runs, the environment and the command only")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=_run)


def _plans_the_node(args: argparse.Namespace) -> Optional[int]:
    """The cores to plan for when `hyparflow run` is given no count, no plan and no
    hosts: this machine's, or inside a one-node Slurm allocation that fixed no task
    count, its CPUs on the node; None where the old rules hold (-n from SLURM_NTASKS,
    or the error asking for -n)."""
    if (args.ranks is not None or args.plan is not None or args.hosts is not None
            or args.hostfile is not None or args.dry_run or args.restarts
            or any(v is not None for v in (args.stages, args.replicas, args.microbatches,
                                            args.tensor, args.tensor_mesh))):
        return None
    if launch.in_slurm_allocation() or args.launcher == "srun":
        cpus, nodes = os.environ.get("SLURM_CPUS_ON_NODE", ""), os.environ.get("SLURM_NNODES",
                                                                                 "1")
        if (os.environ.get("SLURM_NTASKS") or "").isdigit() or not cpus.isdigit() \
                or nodes != "1":
            return None
        return int(cpus)
    return launch.usable_cores()


def _run(args: argparse.Namespace) -> int:
    args.tensor, args.tensor_mesh = launch.mesh_flag(args.tensor_mesh, args.tensor)
    cores = _plans_the_node(args)
    if cores is not None:
        from .planning import auto

        choice = auto.choose(args.script, args.args, cores)
        print(choice.line, flush=True)
        args.plan = choice.plan
    if args.plan is not None:
        args.ranks, args.threads, args.plan = launch.from_plan(args.plan, args.ranks,
                                                               args.threads)
    hosts: Optional[HostSlots] = None
    if args.hosts is not None or args.hostfile is not None:
        from .cluster import hosts as _hosts

        try:
            hosts = (_hosts.parse_hosts(args.hosts) if args.hosts is not None
                     else _hosts.read_hostfile(args.hostfile))
        except _hosts.HostError as error:
            raise launch.LaunchError(str(error)) from None
    line = launch.command_line(args.script, args.args, ranks=args.ranks, stages=args.stages,
                               replicas=args.replicas, microbatches=args.microbatches,
                               tensor=args.tensor, threads=args.threads,
                               launcher=args.launcher, hosts=hosts, mesh=args.tensor_mesh,
                               plan=args.plan)
    if args.data_service or args.data_service_mode or args.data_workers is not None:
        return _run_with_data(args, line, hosts)
    if args.restarts:
        return _run_restarting(args, line, hosts)
    if args.dry_run:
        print(launch.describe(line))
        return 0
    if line.supervise:
        return launch.supervise(line)
    launch.execute(line)  # does not return


def _run_with_data(args: argparse.Namespace, line: CommandLine,
                   hosts: Optional[HostSlots]) -> int:
    """`hyparflow run` with a tf.data service: the one named (--data-service), or a
    dispatcher and K workers started on this node (--data-workers) and stopped at exit."""
    from .cluster import dataservice

    if args.data_service_mode:
        line.env["HYPARFLOW_DATA_SERVICE_MODE"] = args.data_service_mode
    try:
        if args.data_service:
            line.env["HYPARFLOW_DATA_SERVICE"] = dataservice.address(args.data_service)
    except ValueError as error:
        raise launch.LaunchError(str(error)) from None
    workers = args.data_workers
    if workers is not None and (workers < 1 or args.restarts):
        raise launch.LaunchError(
            f"--data-workers K starts K >= 1 workers for one run (received {workers}"
            f"{', with --restarts' if args.restarts else ''}): start `hyparflow "
            "data-service --dispatcher` and `--worker` yourself (in Slurm, as steps of their "
            "own) and pass --data-service grpc://HOST:PORT.")
    # Inside a Slurm allocation each is a step of its own beside the ranks' (--overlap:
    # it shares their nodes' cores), and names its node; slurm/data_service.sbatch gives
    # the data nodes of their own.
    steps = ("srun", "--overlap", "--nodes=1", "--ntasks=1") if line.launcher == "srun" else ()
    if args.dry_run or not workers:
        if args.dry_run:
            print(launch.describe(line))
            if workers:
                where = "as Slurm steps (srun --overlap)" if steps else "on this node"
                print(f"# --data-workers {workers}: a dispatcher and {workers} workers "
                      f"started {where}, stopped at exit")
            return 0
        if args.restarts:   # its command lines are made anew: the variables go by ours
            os.environ.update({k: v for k, v in line.env.items() if "DATA_SERVICE" in k})
            return _run_restarting(args, line, hosts)
        if line.supervise:
            return launch.supervise(line)
        launch.execute(line)  # does not return
    import socket

    processes, address = dataservice.start(
        workers, None if steps else "localhost" if hosts is None else socket.gethostname(),
        prefix=steps)
    line.env["HYPARFLOW_DATA_SERVICE"] = address
    print(f"hyparflow run: data service {address} (dispatcher pid {processes[0].pid}, "
          f"worker pids {' '.join(str(p.pid) for p in processes[1:])})", flush=True)
    try:
        return launch.supervise(line)
    finally:
        dataservice.stop(processes)


def _run_restarting(args: argparse.Namespace, first: CommandLine,
                    hosts: Optional[HostSlots]) -> int:
    """`hyparflow run --restarts K`: the run under restart.run (its first command line `first`)."""
    from .cluster import hosts as _hosts
    from .cluster import restart

    if args.restarts < 0:
        raise launch.LaunchError(f"--restarts must be 0 or more. Received: {args.restarts}")
    if first.launcher == "srun":
        raise launch.LaunchError(
            "--restarts is for mpiexec runs; inside a Slurm job the templates restart: a run "
            "that ends with exit code 75 (a lost host, or the time limit) is requeued and "
            "resumes from its checkpoint on the nodes Slurm gives it (docs/slurm.md).")
    ranks = int(first.argv[first.argv.index("-n") + 1])
    shape = launch.layout(ranks, args.stages, args.replicas, args.microbatches,
                          tensor=args.tensor)
    stages, replicas = shape.num_stages, shape.num_replicas
    given = launch.requested(args.stages, args.replicas, args.microbatches, args.tensor)
    tensor = given.get("tensor", 1)
    if hosts is not None:
        where = _hosts.place(hosts, ranks)
        hosts = [(h, where.count(h)) for h, _ in hosts if h in where]

    def make_line(on: Optional[HostSlots], stages: Optional[int], replicas: Optional[int],
                  tensor: Optional[int]) -> CommandLine:
        return launch.command_line(args.script, args.args, ranks=None if on else args.ranks,
                                   stages=stages, replicas=replicas,
                                   microbatches=args.microbatches, tensor=tensor,
                                   threads=args.threads, launcher=args.launcher, hosts=on,
                                   mesh=args.tensor_mesh, plan=args.plan)

    if args.dry_run:
        print(launch.describe(first))
        print(f"# --restarts {args.restarts}: after a failure, probe "
              + (", ".join(h for h, _ in hosts) if hosts else "nothing (one machine)")
              + " and start again on what answers")
        return 0
    return restart.run(make_line, lambda line, lost: launch.supervise(line, lost_hosts=lost),
                       args.restarts, hosts, stages, replicas, tensor,
                       first.argv[0], set(given))   # the mpiexec command_line found


def _add_info(sub: Subparsers) -> None:
    p = sub.add_parser("info", help="versions, cores, ranks, threads, Slurm: for bug reports",
                       description="Print what a bug report needs: library versions, MPI, "
                                   "cores, threads per rank, Slurm.")
    p.set_defaults(func=_info)


def _info(args: argparse.Namespace) -> int:
    from .cluster import report

    print(report.report())
    return 0


def _add_slurm(sub: Subparsers) -> None:
    from .cluster import slurm
    p = sub.add_parser(
        "slurm", help="write an sbatch script for a training script (or submit it)",
        description="Render an sbatch script from hyparflow's slurm/ templates: print it, "
                    "write it (--output) or submit it (--submit). The job activates this "
                    "Python environment and runs SCRIPT with one rank per task.")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1,
                   help="ranks per node; a multiple of --stages keeps each pipeline on one node")
    p.add_argument("--stages", type=int,
                   help="pipeline stages S, for scripts that do not choose them (exported as "
                        "HYPARFLOW_NUM_STAGES; default: the script's num_stages, else 1)")
    p.add_argument("--microbatches", type=int,
                   help="microbatches M (exported as HYPARFLOW_NUM_MICROBATCHES; default: the "
                        "script's num_microbatches, else 1)")
    p.add_argument("--tensor", type=int,
                   help="tensor ranks T per stage, which split its widest layers (exported as "
                        "HYPARFLOW_NUM_TENSOR; default: the script's num_tensor, else 1)")
    p.add_argument("--tensor-mesh", metavar="QxQ",
                   help="the T = Q x Q tensor ranks of a stage as a 2D mesh (exported as "
                        "HYPARFLOW_TENSOR_MESH; sets --tensor)")
    p.add_argument("--cpus-per-task", type=int, help="CPUs (and threads) per rank")
    p.add_argument("--time", default="01:00:00", help="time limit, HH:MM:SS (default 01:00:00)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job-name", help="default: the script's name")
    p.add_argument("--template", help="single (one node, the default), hybrid (several nodes, "
                   "the default for --nodes > 1), array (with --array), node (one node, no "
                   "task count: `hyparflow run` plans its ranks x threads), data_service (a "
                   "heterogeneous job: training nodes and a tf.data service's node), or a "
                   "template file")
    p.add_argument("--launcher", choices=slurm.LAUNCHERS, default="srun",
                   help="srun --mpi=pmi2 (default) or the MPI's mpiexec")
    p.add_argument("--array", help="job array spec for a sweep, e.g. 0-7 or 0-15%%4; the task "
                   f"index is appended to the script's arguments, or replaces {slurm.TASK_TOKEN} in them")
    p.add_argument("--sweep", metavar="CONFIGS.json",
                   help="one job running the script's hf.sweep over the configs in this JSON "
                        "list (exported as HYPARFLOW_SWEEP_CONFIGS; the script reads them with "
                        "hyparflow.sweeps.job_configs()), instead of a job array")
    p.add_argument("--replicas", type=int,
                   help="with --sweep: ranks per group, each member data parallel over them "
                        "(exported as HYPARFLOW_NUM_REPLICAS; default 1)")
    p.add_argument("--log", help="the job's output file (default JOBNAME-%%j.out, "
                   "arrays JOBNAME-%%A_%%a.out)")
    p.add_argument("--overcommit", action="store_true",
                   help="allow more ranks than CPUs (#SBATCH --overcommit)")
    p.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                   help="extra #SBATCH line, e.g. --sbatch-option=--qos=long (repeatable)")
    p.add_argument("--output", "-o", help="write the script to this file instead of printing it")
    p.add_argument("--submit", action="store_true", help="sbatch it and print the job id")
    p.add_argument("script", help="the Python script the job runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=_slurm)


def _slurm(args: argparse.Namespace) -> int:
    from .cluster import slurm
    spec = slurm.JobSpec(
        script=args.script, script_args=list(args.args), nodes=args.nodes,
        tasks_per_node=args.tasks_per_node, stages=args.stages, microbatches=args.microbatches,
        tensor=args.tensor, mesh=args.tensor_mesh,
        time=args.time, partition=args.partition, account=args.account,
        cpus_per_task=args.cpus_per_task, job_name=args.job_name, template=args.template,
        launcher=args.launcher, array=args.array, log=args.log, overcommit=args.overcommit,
        sbatch_options=args.sbatch_option, sweep=args.sweep, replicas=args.replicas,
        rendered_by="Rendered by: " + shlex.join(["hyparflow", *sys.argv[1:]]))
    text, warnings = slurm.render(spec)
    for warning in warnings:
        print(f"hyparflow slurm: warning: {warning}", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        os.chmod(args.output, 0o755)
        print(f"hyparflow slurm: wrote {args.output}", file=sys.stderr)
    if args.submit:
        job = slurm.submit(text, path=args.output)
        print(f"hyparflow slurm: submitted job {job}", file=sys.stderr)
        print(job)
    elif not args.output:
        sys.stdout.write(text)
    return 0


def _add_data_service(sub: Subparsers) -> None:
    p = sub.add_parser(
        "data-service", help="run a tf.data service dispatcher or worker until stopped",
        description="Run a tf.data service's dispatcher (--dispatcher) or one of its "
                    "workers (--worker DISPATCHER) until SIGTERM or SIGINT; it prints its "
                    "address on one line. hf.fit(..., data_service=ADDRESS) (or "
                    "HYPARFLOW_DATA_SERVICE) then has the workers decode the replicas' "
                    "datasets (docs/training.md, 'Decoding on other nodes').")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--dispatcher", action="store_true", help="run the dispatcher")
    role.add_argument("--worker", metavar="HOST:PORT",
                      help="run a worker of the dispatcher at HOST:PORT (or grpc://HOST:PORT)")
    p.add_argument("--port", type=int, default=0, help="the port to serve on (default: a "
                   "free one, printed)")
    p.add_argument("--host", help="the name the trainers (and workers) reach this process by "
                   "(default: this machine's name)")
    p.add_argument("--worker-timeout", type=float, metavar="SECONDS",
                   help="with --dispatcher: a worker silent this long is lost (TensorFlow's "
                        "default otherwise)")
    p.set_defaults(func=_data_service)


def _data_service(args: argparse.Namespace) -> int:
    from .cluster import dataservice

    if args.port < 0 or args.port > 65535:
        raise launch.LaunchError(f"--port must be 0 (a free one) to 65535. Received: "
                                 f"{args.port}")
    if args.dispatcher:
        return dataservice.dispatcher(args.port, args.host, args.worker_timeout)
    return dataservice.worker(args.worker, args.port, args.host)


def _add_export(sub: Subparsers) -> None:
    p = sub.add_parser("export", help="write the newest valid checkpoint as a .keras file",
                       description="Write the newest valid checkpoint in CHECKPOINT_DIR (or "
                                   "one checkpoint's directory) as a normal .keras model. "
                                   "Custom layers must be importable, as for "
                                   "keras.saving.load_model.")
    p.add_argument("checkpoint_dir")
    p.add_argument("-o", "--output", required=True, help="the .keras file to write")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from .engine import checkpoint

    try:
        used = checkpoint.export(args.checkpoint_dir, args.output)
    except checkpoint.CheckpointError as error:
        raise launch.LaunchError(str(error)) from None
    print(f"hyparflow export: wrote {args.output} from {used}", file=sys.stderr)
    return 0


def _add_trace(sub: Subparsers) -> None:
    p = sub.add_parser("trace", help="draw a fit(trace=...) timeline and measure its bubble",
                       description="Draw the timeline written by hyparflow.fit(trace=RUN.json): "
                                   "one row per rank, actions coloured by kind, idle time "
                                   "blank. Prints the measured bubble fraction next to the "
                                   "theoretical (S-1)/(M+S-1).")
    p.add_argument("trace", help="the JSON file fit(trace=...) wrote")
    p.add_argument("-o", "--output", help="the picture to write (PNG; default: the trace's "
                                          "name with .png, beside it)")
    p.add_argument("--steps", type=int, default=2, help="how many of the last steps to draw")
    p.set_defaults(func=_trace)


def _trace(args: argparse.Namespace) -> int:
    from .engine import timeline

    try:
        data = timeline.load(args.trace)
    except (OSError, ValueError) as error:
        raise launch.LaunchError(f"cannot read {args.trace}: {error}") from None
    meta = data.get("otherData", {})
    measured = timeline.bubble(data)
    line = f"measured bubble {measured:.3f}"
    if meta.get("num_stages") and meta.get("num_microbatches"):
        theory = timeline.theoretical_bubble(meta["num_stages"], meta["num_microbatches"])
        line += (f", theoretical (S-1)/(M+S-1) = {theory:.3f} (S={meta['num_stages']}, "
                 f"M={meta['num_microbatches']}, {meta.get('schedule')})")
    print(line)
    output = args.output or os.path.splitext(args.trace)[0] + ".png"
    timeline.draw(data, output, steps=args.steps)
    print(f"wrote {output}")
    return 0


# Commands with parsers of their own: listed here for `hyparflow --help`, while main()
# hands everything after the command's name to its parser (argparse would take `--help`
# for an option of this one).
FORWARDED = {
    "plan": ("profile a model and rank (stages, replicas, microbatches) plans", "command"),
    "strategy": ("validate, show, export or import a strategy file", "strategy_command"),
}


def _forwarded(name: str, argv: Sequence[str]) -> int:
    import importlib

    module = importlib.import_module(f".planning.{FORWARDED[name][1]}", __package__)
    code: int = module.main(argv)
    return code


def _add_forwarded(sub: Subparsers, name: str) -> None:
    p = sub.add_parser(name, help=FORWARDED[name][0], add_help=False,
                       description=f"See `hyparflow {name} --help`.")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: _forwarded(name, args.rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyparflow", description="Launch hyparflow training: locally, under Slurm, or as "
                                      "an sbatch script.")
    sub = parser.add_subparsers(
        dest="command", metavar="{run,info,slurm,export,trace,data-service,plan,strategy}")
    sub.required = True
    _add_run(sub)
    _add_info(sub)
    _add_slurm(sub)
    _add_export(sub)
    _add_trace(sub)
    _add_data_service(sub)
    for name in FORWARDED:
        _add_forwarded(sub, name)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in FORWARDED:
        return _forwarded(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)   # the sub-command's exit code
        return code
    except launch.LaunchError as error:
        print(f"hyparflow {args.command}: error: {error}", file=sys.stderr)
        return 2
