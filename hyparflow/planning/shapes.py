"""The node shapes `hyparflow plan` weighs: ranks on a node x threads per rank, each
measured and searched (`Searcher`), and the choice among them (`choose`), never slower
than one rank with all the cores; with the helpers the command's phases share."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from .._env import derive_threads
from ..nodecost import shapes
from .costmodel import Compute, Network, Row
from .planner import search

__all__ = ["shapes", "choose", "Candidate", "Searcher", "Phase", "measure_network", "show",
           "short", "tensor_name", "schedule_name"]

Plan = Dict[str, Any]   # one ranked plan (JSON), as command.Plan


def measure_network(ranks: Optional[int] = None) -> Network:
    """alpha, beta from a ping-pong of two ranks under this venv's mpiexec; with
    `ranks`, also each ring size's own alpha and beta (`measure.rings`)."""
    from . import measure

    alpha, beta = measure.ping_pong()
    if not ranks or ranks < 2:
        return Network(alpha, beta)
    groups, exchanges, wait = measure.rings(ranks)
    return Network(alpha, beta, groups=groups, exchanges=exchanges, wait=wait)


def schedule_name(plan: Mapping[str, Any]) -> str:
    """"1f1b", or "interleaved:2" with its model chunks per rank."""
    chunks: int = plan.get("chunks", 1)
    return str(plan["schedule"]) + (f":{chunks}" if chunks > 1 else "")


def tensor_name(plan: Mapping[str, Any]) -> str:
    """T, or the mesh as "2x2" (`tensor_mesh`)."""
    mesh = plan.get("tensor_mesh")
    return f"{mesh[0]}x{mesh[1]}" if mesh else str(plan["tensor"])


class Phase:
    """Say what is being measured, then how long it took (`hyparflow plan` runs for
    minutes on a shared node; silence looked like a hang)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        import time

        self.start = time.monotonic()
        print(f"{self.what} ...", flush=True)

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        import time

        if kind is None:
            print(f"  done in {time.monotonic() - self.start:.1f} s", flush=True)


def choose(candidates: Sequence["Candidate"], one: Mapping[str, Any]) -> Optional["Candidate"]:
    """The candidate node shape whose best plan is predicted fastest, or None when no
    candidate is predicted faster than `one`, one rank with all the cores (what a
    user runs without hyparflow)."""
    best = min(candidates, key=lambda c: c.best["step_s"], default=None)
    if best is None or best.best["step_s"] >= one["step_s"]:
        return None
    return best


class Candidate:
    """One node shape searched: `ranks` x `threads`, its plans best first, the best
    that fits, what it was measured with, and one rank's plan (`one`)."""

    def __init__(self, ranks: int, threads: int, plans: List[Plan], one: Plan,
                 network: Network, compute: Optional[Compute]) -> None:
        self.ranks, self.threads, self.plans, self.one = ranks, threads, plans, one
        self.network, self.compute = network, compute
        self.best = next((p for p in plans if p["fits"]), plans[0])


class Searcher:
    """What every node shape's search shares: the model, its profiles, the options;
    `search(ranks)` measures this node with that many ranks (when measuring here) and
    ranks the plans."""

    def __init__(self, args: Any, graph: Any, model: Any, rows: List[Row],
                 opt_per_byte: float, extra: Any, limit: Optional[float],
                 batches: Tuple[int, int], hosts: Any, here: bool) -> None:
        self.args, self.graph, self.model, self.rows = args, graph, model, rows
        self.opt_per_byte, self.extra, self.limit = opt_per_byte, extra, limit
        self.batches, self.hosts, self.here = batches, hosts, here

    def search(self, ranks: int, network: Optional[Network]) -> Candidate:
        from . import measure

        args, graph = self.args, self.graph
        on_node = ranks if args.nodes == 1 else (args.ranks_per_node or 1)
        threads = derive_threads(args.cores, args.cores, on_node)
        if network is None:
            with Phase("measuring the network: a ping-pong of 2 ranks under mpiexec, and "
                        f"rings of 2 to {ranks} ranks with all {ranks} running"):
                network = measure_network(ranks)
            show(network, ranks)
        compute: Optional[Compute] = None
        if self.here and ranks > 1:
            # This node, as the plan will run it: the model's step with 1 .. ranks ranks
            # computing at once (they share memory bandwidth, and cores beyond --cores),
            # each with the threads a rank of the plan gets.
            with Phase(f"measuring the model's step with 1 to {ranks} ranks of {threads} "
                        "thread(s) computing at once (under mpiexec, twice)"):
                compute = Compute(*measure.compute(ranks, args.model, args.function,
                                                   self.batches))
            for n, row in sorted(compute.times.items()):
                print(f"  {n} at once: " + ", ".join(f"{t * 1e3:.1f} ms at batch {b}"
                                                     for b, t in sorted(row.items())),
                      flush=True)
        timer = None
        if self.here:
            # Plans that run here: their stages timed whole (a stage pays more than its
            # calls' profiles say, and they share the step out only roughly); a single
            # stage too, whose gradient sums and eager calls the model's step lacks
            # (12.2 against 9.3 ms at batch 16 for the MLP).
            timer = measure.StageTimer(graph, self.model, self.batches, source=args.model,
                                       function=args.function, ranks=ranks)
        with Phase(f"searching the plans of {ranks} ranks"
                    + (", timing every candidate pipeline's stages whole" if timer else "")):
            plans: List[Plan] = search(
                graph, self.rows, self.opt_per_byte, network, args.batch_size, ranks,
                self.limit, microbatches=args.microbatches, schedules=args.schedules,
                chunks=tuple(args.chunks),
                ranks_per_node=args.ranks_per_node if args.nodes > 1 else None,
                cores=args.cores if args.nodes == 1 or self.hosts else None,
                compute=compute, stage_costs=self.extra, stage_timer=timer)
            one: Plan = search(graph, self.rows, self.opt_per_byte, network, args.batch_size,
                               1, tensor=(1,), stage_costs=self.extra, stage_timer=timer)[0]
        return Candidate(ranks, threads, plans, one, network, compute)


def show(network: Network, ranks: int) -> None:
    print(f"network: alpha {network.alpha * 1e6:.2f} us, bandwidth "
          f"{1 / network.beta / 1e9:.2f} GB/s", flush=True)
    for g, (alpha, beta) in sorted(network.groups.items()):
        print(f"  rings of {g} of the {ranks} ranks: {alpha * 1e6:.1f} us per round, "
              f"{1 / beta / 1e9:.2f} GB/s", flush=True)
    for g, (alpha, beta) in sorted(network.exchanges.items()):
        print(f"  a split layer's exchange among {g}: {alpha * 1e6:.1f} us + "
              f"{1 / beta / 1e9:.2f} GB/s", flush=True)
    if network.wait:
        print(f"  a receive that waits has its message {network.wait * 1e6:.0f} us after "
              f"the send, the other ranks computing", flush=True)


def short(plan: Mapping[str, Any]) -> str:
    return (f"S={plan['stages']} T={tensor_name(plan)} R={plan['replicas']} "
            f"M={plan['microbatches']} {schedule_name(plan)}")
