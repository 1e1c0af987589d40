"""`hyparflow strategy`: check a strategy (or plan) file, show it as a table and as
the mesh figure, and move its pipeline schedule in and out as torch pipelining's
action-list CSV (`schedule_csv`). No TensorFlow: it reads JSON and plain data."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Optional, Sequence

from .. import strategy as S
from ..schedules import build
from . import schedule_csv

__all__ = ["main", "load"]


def load(path: str) -> Dict[str, Any]:
    """A strategy file, or a plan file ("hyparflow-plan") as its strategy; raises
    ValueError naming each bad field."""
    from .. import plan as P

    return P.read(path).strategy


def _validate(args: argparse.Namespace) -> int:
    try:
        with open(args.file) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"{args.file}: cannot read it as JSON: {exc}", file=sys.stderr)
        return 1
    if isinstance(doc, dict) and doc.get("format") == "hyparflow-plan":
        try:
            load(args.file)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{args.file}: a plan file of the format before strategies (hyparflow-plan "
              "version 1); it loads as a strategy with default per-layer entries. "
              "`hyparflow plan --output` writes the strategy format.")
        return 0
    errors = S.validate(doc)
    for error in errors:
        print(f"{args.file}: {error}", file=sys.stderr)
    if errors:
        return 1
    shape = doc["mesh"]["shape"]
    print(f"{args.file}: a valid strategy, {len(doc['layers'])} layer calls on the mesh "
          f"stage={shape[0]}, tensor={shape[1]}, replica={shape[2] or 'the world size'}")
    return 0


def _show(args: argparse.Namespace) -> int:
    try:
        doc = load(args.file)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{args.file}: schedule {doc['schedule']}, {doc['num_microbatches']} microbatches"
          + (f", {doc['num_chunks']} chunks per rank" if doc.get("num_chunks", 1) > 1 else "")
          + (f", tensor mesh {doc['tensor_mesh']}" if doc.get("tensor_mesh") else ""))
    print(S.table(doc))
    print()
    print(S.figure(doc))
    predicted = doc.get("predicted")
    if predicted:
        print("\npredicted: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in predicted.items()))
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.file:
        doc = load(args.file)
        name, stages = doc["schedule"], doc["mesh"]["shape"][0]
        micro, chunks = doc["num_microbatches"], doc.get("num_chunks", 1)
    else:
        if not (args.schedule and args.stages and args.microbatches):
            print("give a strategy file, or --schedule, --stages and --microbatches",
                  file=sys.stderr)
            return 2
        name, stages, micro, chunks = args.schedule, args.stages, args.microbatches, args.chunks
    text = schedule_csv.export(build(name, stages, micro, chunks))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}: schedule {name}, {stages} ranks, {micro} microbatches")
    else:
        sys.stdout.write(text)
    return 0


def _import(args: argparse.Namespace) -> int:
    with open(args.csv) as f:
        try:
            lists = schedule_csv.parse(f.read())
        except ValueError as exc:
            print(f"{args.csv}: {exc}", file=sys.stderr)
            return 1
    micro = 1 + max((m for actions in lists for a in actions for m in a.microbatches),
                    default=-1)
    try:
        makespan, bubble = schedule_csv.check(lists, micro)
    except (ValueError, RuntimeError) as exc:
        print(f"{args.csv}: not a schedule hyparflow can run: {exc}", file=sys.stderr)
        return 1
    same = schedule_csv.match(lists, micro)
    print(f"{args.csv}: {len(lists)} ranks, {micro} microbatches; played with forward 1 and "
          f"backward 2: makespan {makespan:g}, bubble {bubble:.3f}")
    print(f"  hyparflow's schedule {same!r} gives the same lists" if same else
          "  no hyparflow schedule gives these lists")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hyparflow strategy",
                                     description="Check, show and convert strategy files "
                                                 "(docs/strategy.md).")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("validate", help="check a strategy (or plan) file; each problem "
                                        "names its field")
    p.add_argument("file")
    p.set_defaults(func=_validate)
    p = sub.add_parser("show", help="a table per layer call and the mesh figure")
    p.add_argument("file")
    p.set_defaults(func=_show)
    p = sub.add_parser("export-schedule", help="the pipeline schedule as torch pipelining's "
                                               "action-list CSV")
    p.add_argument("file", nargs="?", help="a strategy file (its schedule, stages, "
                                           "microbatches), or give the three below")
    p.add_argument("--schedule")
    p.add_argument("--stages", type=int)
    p.add_argument("--microbatches", type=int)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--output", help="write here (default: print)")
    p.set_defaults(func=_export)
    p = sub.add_parser("import-schedule", help="read an action-list CSV: check it, play it, "
                                               "name the hyparflow schedule it is")
    p.add_argument("csv")
    p.set_defaults(func=_import)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
