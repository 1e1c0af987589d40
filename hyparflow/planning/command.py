"""`hyparflow plan`: profile a model, measure this node (network, compute, stages),
search the plans (`planner.search`) and print or write the best (a plan file).

A ranked plan is a JSON record (a dict of str to numbers, lists and names) as
`planner.search` makes it: `Plan` here."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .costmodel import Compute, Network, Row
from .. import settings
from ..schedules import PLANNED
from .planner import as_layout
from .shapes import (Candidate, Phase, Searcher, choose, measure_network, schedule_name,
                     shapes, short, show, tensor_name)

__all__ = ["main", "parse_bytes", "parse_seconds", "measure_network", "profile_batches",
           "split_kinds"]

Plan = Dict[str, Any]   # one ranked plan (JSON)

UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
         "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "t": 1e12, "tb": 1e12}


def parse_bytes(text: object) -> float:
    """'12.5GB' -> 12.5e9; '4GiB' -> 4 * 2**30; a plain number is bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)(/s)?\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"Cannot read {text!r} as bytes (e.g. 4GB, 512MiB, 12.5GB/s).")
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def parse_seconds(text: object) -> float:
    match = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us|ns)?\s*", str(text))
    if not match:
        raise ValueError(f"Cannot read {text!r} as a time (e.g. 2us, 0.5ms).")
    scale: Dict[Optional[str], float] = {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1}
    return float(match.group(1)) * scale[match.group(2)]


def profile_batches(batch: int, ranks: int, microbatches: Sequence[int], most: int = 512,
                    per_sample: float = 0, memory: Optional[float] = None) -> Tuple[int, int]:
    """Two batch sizes to profile at: the plans' smallest and largest microbatch (at
    most `most` samples), so their times are interpolated, not extrapolated. With
    `per_sample` activation bytes and `memory` bytes, at most what an eighth of the
    memory holds: the whole model's compiled step keeps every activation for its
    backward, and more besides (ResNet-1001, 281 MB of activations per sample, was
    killed for 24 GB at batch 64, and again at 22)."""
    if per_sample and memory:
        most = min(most, int(memory / 8 / per_sample))
    hi = max(2, min(batch, most))
    lo = max(1, min(batch // max(1, ranks * max(microbatches)), hi // 4))
    return lo, hi


def split_kinds(graph: Any, layout: Any) -> Dict[str, str]:
    """{layer call: split kind} of the layers `layout` splits, stage by stage, as the
    engine's runtime chooses them (a strategy file names each one's kind)."""
    from ..engine.partition import partition
    from ..kinds import tensor as T

    if layout.num_tensor == 1:
        return {}
    part = partition(graph, len(layout.balance), list(layout.balance))
    choose: Any = T.choose  # the kinds are untyped (TensorFlow's layers)
    return {graph.nodes[i].name: sp.kind for p in part.stages
            for i, sp in choose(graph, p.nodes, layout.num_tensor,
                                  layout.tensor_layers).items()}


def _per_layer(args: Any, graph: Any, rows: List[Row], opt_per_byte: float,
               network: Network, ranks: int, limit: Optional[float],
               compute: Optional[Compute], extra: Any, best: Plan,
               explored: List[Plan]) -> Plan:
    """`--search layers`: the best per-layer strategy beside the best global tuple,
    both priced by the layer profiles (the stages timed whole time only the rule's
    split layers); returns the plan to write, the per-layer one when it is faster."""
    from . import search as per_layer
    from .planner import predict

    model = dict(ranks_per_node=args.ranks_per_node if args.nodes > 1 else None,
                 cores=args.cores if args.nodes == 1 or args.hosts else None,
                 compute=compute, stage_costs=extra)
    with Phase(f"searching per-layer strategies (at most {args.search_seconds:g} s of "
                "local moves)"):
        found, done = per_layer.layers(graph, rows, opt_per_byte, network, args.batch_size,
                                       ranks, limit, microbatches=args.microbatches,
                                       schedules=[s for s in args.schedules
                                                  if s != "interleaved"],
                                       seconds=args.search_seconds, **model)
    explored += done["plans"]
    if found is None:
        print("per-layer search: no layer of the model can be split")
        return best
    glob = dict(best, **predict(graph, rows, opt_per_byte, network, best["counts"],
                                args.batch_size, best["replicas"], best["microbatches"],
                                best["schedule"], num_tensor=best["tensor"],
                                chunks=best.get("chunks", 1), **model))
    print(f"\nper-layer search: {done['predicted']} strategies predicted over {done['shapes']} "
          f"shapes in {done['seconds']:.1f} s; both below priced by the layer profiles")
    for what, p in (("best global tuple", glob), ("best per layer", found)):
        split = ", ".join(p["tensor_layers"]) or "nothing"
        print(f"  {what:<17} S={p['stages']} T={p['tensor']} R={p['replicas']} "
              f"M={p['microbatches']} {schedule_name(p)}, cut {p['counts']}, splits "
              f"{split}: step {p['step_s']:.4f} s, peak {max(p['memory_bytes']) / 2**20:.1f} "
              f"MB/rank{'' if p['fits'] else ' (over the memory limit)'}")
    if args.json:  # beside the ranked plans: both, as priced here
        with open(args.json) as f:
            saved = json.load(f)
        saved.update(per_layer=found, global_by_profiles=glob,
                     search={k: v for k, v in done.items() if k != "plans"})
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
    better = found["fits"] >= glob["fits"] and found["step_s"] < glob["step_s"]
    return found if better else best


def _dataset(args: Any, graph: Any, plans: List[Plan], ranks: int) -> None:
    """--explore-all --dataset: every candidate as a CSV row; --measure K of them."""
    from .. import strategy as S
    from . import dataset

    def strategy_of(p: Plan) -> Dict[str, Any]:
        layout = as_layout(p)
        return S.make([n.name for n in graph.nodes], p["counts"], stages=p["stages"],
                      tensor=p["tensor"], replicas=p["replicas"],
                      microbatches=p["microbatches"], schedule=p["schedule"],
                      chunks=p.get("chunks", 1), splits=split_kinds(graph, layout),
                      predicted={"step_s": p["step_s"], "samples_s": p["samples_s"]})

    machine = dataset.machine_fingerprint(args.cores, _memory(), args.nodes,
                                          args.ranks_per_node, args.hosts)
    table = dataset.rows(plans, graph, dataset.model_fingerprint(graph, args.batch_size),
                         machine, ranks, strategy_of)
    if args.measure:
        with Phase(f"measuring {args.measure} of the {len(table)} candidates for real "
                    f"(hf.fit under mpiexec, {args.measure_steps} steps each)"):
            dataset.measure(table, args.measure, ranks, args.model, args.function,
                            args.batch_size, args.measure_steps)
    dataset.write(args.dataset, table)
    print(f"wrote {args.dataset}: {len(table)} candidates"
          + (f", {args.measure} measured" if args.measure else ""))


def _memory() -> Optional[int]:
    """Bytes of this machine's memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _ranks(text: str) -> Any:
    """--ranks: a count, or "auto"."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a number of ranks (1 or more) or auto. Received: "
                                         f"{text!r}")
    return value


_DESCRIPTION = ("Profile a model, search (stages, tensor ranks, replicas, microbatches, "
                "schedule, balance) and rank the plans by a cost model with an alpha-beta "
                "network. On this node it measures, under mpiexec, the network (a ping-pong "
                "and rings of the plan's ranks), each layer call, the model's step with 1 to "
                "N ranks computing at once, and every candidate pipeline's stages timed "
                "whole: minutes for a small CNN on 2 cores. Without --ranks, on one node, it "
                "does so for each ranks x threads per rank the cores allow and keeps the "
                "fastest, never slower than one rank with every core. --quick keeps only "
                "the layer profiles and a ping-pong (seconds, less accurate on a shared "
                "node).")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .. import schedules as sched

    parser = argparse.ArgumentParser(prog="hyparflow plan", description=_DESCRIPTION)
    parser.add_argument("model", help="a .keras file, or a Python file with a function that "
                                      "returns a compiled model")
    parser.add_argument("--function", default="build_model",
                        help="the function of the Python file that returns the compiled "
                             "model (default build_model)")
    parser.add_argument("--quick", action="store_true",
                        help="plan from the layer profiles and a ping-pong only: no "
                             "contention sweep, no ring measurements, no stage timing")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--ranks", type=_ranks, metavar="N|auto",
                        help="ranks to plan for, or auto: choose the ranks on this node x "
                             "threads per rank, each candidate measured (default: auto on "
                             "one node measured here, else nodes x ranks-per-node)")
    parser.add_argument("--length", type=int, metavar="N",
                        help="the size of the model's unknown (None) input dimensions, "
                             "such as the sequence length you train at, for every profile "
                             "and measurement (default 8; exported as "
                             "HYPARFLOW_PROFILE_LENGTH)")
    parser.add_argument("--memory-per-rank", help="e.g. 4GB; plans over it are marked")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--ranks-per-node", type=int)
    parser.add_argument("--bandwidth", help="e.g. 12.5GB/s (default: measured with MPI here)")
    parser.add_argument("--latency", help="e.g. 2us (default: measured with MPI here)")
    parser.add_argument("--hosts", metavar="H1:N1,H2:N2",
                        help="plan for these hosts (as `hyparflow run --hosts`, equal slots): "
                             "the link within a host and the link between the first two "
                             "are measured with a ping-pong through mpiexec")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores per node (ranks beyond them share cores)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(PLANNED),
                        choices=sorted(sched.TABLE))
    parser.add_argument("--chunks", type=int, nargs="+", default=[2],
                        help="model chunks per rank to try with --schedules interleaved")
    parser.add_argument("--top", type=int, default=12,
                        help="how many of the ranked plans to print (default 12)")
    parser.add_argument("--json", help="write every ranked plan here")
    parser.add_argument("--profile-cache", help="reuse (or write) the layer profiles here: "
                                                "profile once, plan for many clusters")
    parser.add_argument("--output", help="write the best plan that fits here (a strategy "
                                         "file, docs/strategy.md)")
    parser.add_argument("--search", choices=("global", "layers"), default="global",
                        help="layers: also search per-layer strategies (each layer split or "
                             "whole, and the cut) and report the best beside the best "
                             "global tuple (docs/planning.md)")
    parser.add_argument("--search-seconds", type=float, default=30.0,
                        help="time for --search layers' local moves (default 30)")
    parser.add_argument("--explore-all", action="store_true",
                        help="write every candidate predicted (the global tuples, and with "
                             "--search layers every per-layer strategy priced) to --dataset")
    parser.add_argument("--dataset", metavar="CSV",
                        help="the explored space as CSV (columns: docs/planning.md)")
    parser.add_argument("--measure", type=int, default=0, metavar="K",
                        help="with --dataset: run K candidates spread over the ranking for "
                             "real under mpiexec and add their measured step time")
    parser.add_argument("--measure-steps", type=int, default=5,
                        help="steps timed per measured candidate (default 5, after one)")
    parser.add_argument("--embedding-sharding", metavar="auto|JSON",
                        help="shard the Embedding tables over the replicas ('auto', or "
                             "'{\"layer\": \"row\", ...}'): plans with one stage and one "
                             "tensor rank only; the tables' placement is costed, printed "
                             "and written into the plan file (its \"tables\")")
    parser.add_argument("--ids", metavar="FUNCTION",
                        help="with --embedding-sharding: a function of the model's Python "
                             "file returning {Embedding layer name: ids of the first "
                             "batches}, for the owners' load (default: uniform ids)")
    parser.add_argument("--communication-dtype", choices=["float32", "bfloat16", "float16"],
                        help="the tables' exchanges in 16 bits (their estimate's bytes)")
    args = parser.parse_args(argv)   # a Namespace: untyped attributes
    if bool(args.explore_all) != bool(args.dataset):
        parser.error("--explore-all and --dataset go together: --explore-all --dataset "
                     "space.csv")
    if args.measure and args.nodes > 1:
        parser.error(f"--measure {args.measure} runs candidates on this node; it cannot with "
                     f"--nodes {args.nodes}")
    hosts = None
    if args.hosts:
        from ..cluster import hosts as H

        hosts = H.parse_hosts(args.hosts)
        if len({n for _, n in hosts}) > 1 or len(hosts) < 2:
            parser.error(f"--hosts: give two or more hosts with equal slots. Received: "
                         f"{args.hosts!r}")
        args.nodes, args.ranks_per_node = len(hosts), hosts[0][1]
    from .. import _env
    _env.start_tensorflow()
    from .. import graph as G
    from . import measure, profile
    from .. import plan as P

    if args.length is not None:
        if args.length < 1:
            parser.error(f"--length: a size of 1 or more. Received: {args.length}")
        os.environ["HYPARFLOW_PROFILE_LENGTH"] = str(args.length)  # the probes' too
    model = profile.load_model(args.model, args.function)
    graph = G.from_model(model)
    unknown = [getattr(graph.tensors[t].keras_tensor, "name", str(t)) for t in graph.inputs
               if graph.tensors[t].dynamic]
    if unknown and args.length is None:
        print(f"note: input(s) {', '.join(unknown)} have unknown dimensions, profiled at "
              f"{settings.profile_length()}: give --length N, the length you train at (a sequence "
              "length), or the plans are for that size", flush=True)
    here = args.nodes == 1 and not (args.bandwidth or args.latency) and not args.quick
    if args.ranks == "auto" and not (here and not hosts):
        parser.error("--ranks auto measures this node (each candidate ranks x threads "
                     "under mpiexec); it cannot with --quick, --bandwidth, --latency, "
                     "--nodes or --hosts. Give --ranks N.")
    auto = (args.ranks == "auto" or (args.ranks is None and here and not hosts)) and \
        args.cores > 1
    ranks = (max(shapes(args.cores)) if auto
             else args.ranks or args.nodes * (args.ranks_per_node or 1))
    batches = profile_batches(args.batch_size, ranks, args.microbatches,
                              per_sample=4 * sum(G.numel(graph.tensors[t].shape) for n in graph.nodes
                                                 for t in n.outputs),
                              memory=_memory())
    network: Optional[Network] = None
    if hosts:
        # The per-link figures the placement needs: two ranks within the first host (its
        # shared memory), and one on each of the first two hosts (the network between).
        (h1, n1), (h2, _) = hosts[:2]
        within = measure.ping_pong(f"{h1}:2") if n1 > 1 else measure.ping_pong(f"{h1}:1,{h1}:1")
        between = measure.ping_pong(f"{h1}:1,{h2}:1")
        network = Network(*within, *between)
        print(f"links: within {h1} alpha {within[0] * 1e6:.1f} us, "
              f"{1 / within[1] / 1e9:.3f} GB/s; {h1} to {h2} alpha {between[0] * 1e6:.1f} us, "
              f"{1 / between[1] / 1e9:.3f} GB/s", flush=True)
    elif args.bandwidth or args.latency:
        if args.bandwidth and args.latency:
            network = Network(parse_seconds(args.latency), 1 / parse_bytes(args.bandwidth))
        else:   # the one not given, measured
            probe = measure_network()
            network = Network(parse_seconds(args.latency) if args.latency else probe.alpha,
                              1 / parse_bytes(args.bandwidth) if args.bandwidth else probe.beta)
    elif args.quick or args.nodes != 1 or not auto and ranks == 1:
        with Phase("measuring the network: a ping-pong of 2 ranks under mpiexec"):
            network = measure_network()
    if network is not None:
        show(network, ranks)
    if args.profile_cache and os.path.exists(args.profile_cache):
        with open(args.profile_cache) as f:
            cached = json.load(f)
        if len(cached["rows"]) != len(graph.nodes):
            raise ValueError(f"{args.profile_cache} profiles another model.")
        rows: List[Row] = [Row(*r) for r in cached["rows"]]
        opt_per_byte: float = cached["optimizer_s_per_byte"]
        extra = cached.get("stage_costs")
    else:
        with Phase(f"profiling {len(graph.nodes)} layer calls of {model.name} (forward and "
                    f"backward at batches {', '.join(map(str, batches))}), and a stage's "
                    "extra cost"):
            rows, opt_per_byte = profile.fit_model(graph, model, batches)
            extra = measure.stage_costs(graph, model, rows, batches)
        if args.profile_cache:
            with open(args.profile_cache, "w") as f:
                json.dump({"rows": rows, "optimizer_s_per_byte": opt_per_byte,
                           "stage_costs": extra}, f)
    limit = parse_bytes(args.memory_per_rank) if args.memory_per_rank else None
    node = Searcher(args, graph, model, rows, opt_per_byte, extra, limit, batches, hosts, here)
    if auto:
        found = [node.search(n, None) for n in shapes(args.cores)]
        one = found[0].one
        print(f"\n{'ranks x threads':>16} {'best plan':>24} {'step s':>9} {'speed-up':>8}")
        print(f"{'1 x ' + str(args.cores):>16} {'S=1 T=1 R=1 M=1':>24} {one['step_s']:>9.4f} "
              f"{1.0:>8.2f}")
        for c in found:
            p = c.best
            print(f"{f'{c.ranks} x {c.threads}':>16} {short(p):>24} {p['step_s']:>9.4f} "
                  f"{one['step_s'] / p['step_s']:>8.2f}")
        chosen = choose(found, one)
        if chosen is None:
            print(f"chosen: one rank with all {args.cores} cores (no plan of several ranks is "
                  "predicted faster)")
            chosen = Candidate(1, args.cores, [one], one, found[0].network, None)
        else:
            print(f"chosen: {chosen.ranks} ranks x {chosen.threads} threads")
    else:
        chosen = node.search(ranks, network)
        one = chosen.one
    ranks, plans, network, compute, threads = (chosen.ranks, chosen.plans, chosen.network,
                                               chosen.compute, chosen.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plans": plans, "one_rank": one, "ranks": ranks,
                       "threads_per_rank": threads}, f, indent=1)
    print(f"\n{'#':>4} {'S':>3} {'T':>3} {'R':>4} {'M':>3} {'schedule':>8} {'step s':>9} {'samples/s':>10} "
          f"{'speed-up':>8} {'bubble':>6} {'comm s':>8} {'peak MB/rank':>12} fits")
    for k, p in enumerate(plans[:args.top], 1):
        print(f"{k:>4} {p['stages']:>3} {tensor_name(p):>3} {p['replicas']:>4} {p['microbatches']:>3} {schedule_name(p):>8} "
              f"{p['step_s']:>9.4f} {p['samples_s']:>10.1f} {one['step_s'] / p['step_s']:>8.2f} "
              f"{p['bubble']:>6.3f} {p['comm_s']:>8.4f} {max(p['memory_bytes']) / 2**20:>12.1f} "
              f"{'yes' if p['fits'] else 'no'}")
    print(f"\nscaling efficiency of the best plan: "
          f"{one['step_s'] / plans[0]['step_s'] / ranks:.2f} ({ranks} ranks)")
    on_node = ranks if args.nodes == 1 else (args.ranks_per_node or 1)
    print(f"threads per rank: {threads} ({args.cores} cores // {on_node} ranks per node, as "
          f"every plan above runs; `hyparflow run --plan` gives them)")
    tables = None
    if ranks == 1 and (args.embedding_sharding or args.search == "layers"):
        print("one rank: no tables to shard and no layer to split (--embedding-sharding "
              "and --search layers need --ranks 2 or more)")
    elif args.embedding_sharding:
        tables, plans = _tables(args, model, graph, network, ranks, limit, plans)
    best = next((p for p in plans if p["fits"]), plans[0])
    explored: List[Plan] = []
    if args.search == "layers" and ranks > 1:
        best = _per_layer(args, graph, rows, opt_per_byte, network, ranks, limit, compute,
                          extra, best, explored)
    if args.dataset:
        _dataset(args, graph, plans + explored, ranks)
    if args.output:
        layout = as_layout(best)
        P.write(args.output, graph, layout,
                predicted={k: best[k] for k in ("step_s", "bubble", "comm_s", "samples_s")},
                splits=split_kinds(graph, layout), tables=tables, threads_per_rank=threads)
        print(f"wrote {args.output}")
    return 0


def _rank_hosts(args: argparse.Namespace, ranks: int) -> Optional[List[str]]:
    """Each rank's host as the plan runs it (`--hosts`, or `--nodes` x
    `--ranks-per-node`: hosts filled in rank order, as `hyparflow run` fills them);
    None on one host."""
    if getattr(args, "hosts", None):
        from ..cluster import hosts as H

        names = [h for h, slots in H.parse_hosts(args.hosts) for _ in range(slots)]
        if len(names) < ranks:
            raise ValueError(f"--hosts {args.hosts} has {len(names)} slots, fewer than the "
                             f"{ranks} ranks planned for. Add hosts or lower --ranks.")
        return names[:ranks]
    nodes, per = getattr(args, "nodes", 1) or 1, getattr(args, "ranks_per_node", None)
    if nodes > 1 and per:
        return [f"node{r // per}" for r in range(ranks)]
    return None


def _tables(args: argparse.Namespace, model: Any, graph: Any, network: Network, ranks: int,
            limit: Optional[float], plans: List[Plan]) -> Tuple[Dict[str, str], List[Plan]]:
    """Place and cost the Embedding tables (`--embedding-sharding`) over the replicas
    of a plan with one stage and one tensor rank; print the placement; return its
    kinds for the plan file and the plans it allows. The owners' load is from the ids
    `--ids` returns, else uniform (`hyparflow plan` sees no data). Over several hosts
    (`--hosts`, `--nodes`) the links between them cost the network's measured (or
    told) inter-host terms, and "table-row" tables go to one host's ranks."""
    from ..kinds import tables as T
    from ..kinds.tables import cost as C
    from ..kinds.tables.plan import host_groups
    from .profile import load_function

    text = args.embedding_sharding
    sharding = text if text == "auto" else json.loads(text)
    allowed = [p for p in plans if p["stages"] == 1 and p["tensor"] == 1]
    if not allowed:
        raise ValueError("--embedding-sharding needs plans with one stage and one tensor "
                         "rank (the tables are sharded over the replicas); none was found.")
    hosts = _rank_hosts(args, ranks)
    wire = 2 if args.communication_dtype in ("bfloat16", "float16") else 4
    ids = load_function(args.model, args.ids, "--ids")() if args.ids else None
    link = C.Link(alpha=network.alpha, beta=network.beta, alpha_inter=network.alpha_inter,
                  beta_inter=network.beta_inter)
    placements = T.placements_for(model, graph, sharding, ranks, limit, hosts=hosts,
                                  batch_size=args.batch_size, ids=ids, wire_bytes=wire,
                                  link=link)
    per_sample = T.lookups_per_sample(graph)
    rows = C.costs(placements, ranks, {k: v * args.batch_size for k, v in per_sample.items()},
                   ids, wire_bytes=wire, link=link, hosts=hosts)
    if hosts:
        groups = host_groups(hosts, ranks)
        print("\nthe tables' hosts: " + ", ".join(
            f"{hosts[g[0]]} (ranks {','.join(map(str, g))})" for g in groups))
    print("\n" + C.describe(rows, ranks))
    best = allowed[0]
    print(f"with the tables sharded over the replicas: plan S=1 T=1 R={best['replicas']} "
          f"M={best['microbatches']} {schedule_name(best)}, {best['step_s']:.4f} s per "
          "step without the tables' exchanges")
    return C.to_plan(placements), allowed


if __name__ == "__main__":
    sys.exit(main())
