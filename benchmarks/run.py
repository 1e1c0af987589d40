"""The benchmark suite: throughput, step time, bubble and memory, next to a one-process baseline.

    python benchmarks/run.py                 # everything, table + benchmarks/results.json
    python benchmarks/run.py --only mlp transfer --steps 8
    python benchmarks/run.py --only resnet56 --batch resnet56=128

Each configuration runs under `mpiexec -n S*T*R` with one intra-op thread per rank
(HYPARFLOW_THREADS=1); the baselines are plain Keras `model.fit` in one process, with
one thread and with every core (what a user would run instead), measured in the same
run; each row's speed is given relative to both ("x 1 thread", "x all cores"). Step time is the median of the traced steps after the first (which includes
tracing); the bubble and the gradient bytes each rank exchanges per step (dense
buckets plus sparse pairs received) come from the same trace; "sent MB/step": the bytes of
gradient sums and pipeline messages all ranks sent per step (`History.exchanges`).
`--communication-dtype float32,bfloat16` runs each configuration once per dtype.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))

# workload -> (global batch, list of (S, R, M, schedule[, T[, extra environment]]))
PLANS = {
    "mlp": (256, [(1, 2, 1, "gpipe"), (1, 2, 1, "gpipe", 1, {"HYPARFLOW_ZERO": "0"}),
                  (1, 2, 1, "gpipe", 1, {"HYPARFLOW_OVERLAP": "1"}),
                  (2, 1, 8, "gpipe"), (2, 1, 8, "1f1b"), (2, 1, 8, "zb-h1"), (2, 1, 8, "zb-batched"),
                  (2, 1, 4, "1f1b"), (2, 1, 4, "zb-batched")]),
    "cnnmlp": (128, [(1, 2, 1, "gpipe"), (2, 1, 4, "auto")]),
    "resnet56": (64, [(1, 2, 1, "gpipe"), (2, 1, 4, "1f1b")]),  # issue 40's ResNet row
    "resnet110": (32, [(1, 2, 1, "gpipe"), (2, 1, 4, "1f1b"), (2, 1, 4, "zb-batched"),
                       (2, 1, 8, "1f1b")]),
    "resnet1001": (8, [(2, 1, 4, "1f1b")]),
    "wide": (64, [(2, 1, 4, "1f1b"), (1, 1, 1, "gpipe", 2), (1, 1, 4, "gpipe", 2)]),
    # data, pipeline, tensor and hybrid (4 ranks on the cores there are)
    "gpt": (64, [(1, 2, 1, "1f1b"), (2, 1, 4, "1f1b"), (1, 1, 1, "1f1b", 2),
                 (2, 1, 4, "1f1b", 2)]),
    # the embedding's gradient as pairs (the default) and reduced densely; the optimizer
    # step sharded over the replicas (the default) and not
    "embed": (256, [(1, 2, 1, "1f1b"), (1, 2, 1, "1f1b", 1, {"HYPARFLOW_ZERO": "0"}),
                    (1, 2, 1, "1f1b", 1, {"HYPARFLOW_SPARSE": "0"})]),
}


def run(cmd, env=None, timeout=3000):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):])


def _config(text):
    """"S,R,M,SCHEDULE[,T[,VAR=VALUE...]]" -> a PLANS entry."""
    parts = text.split(",")
    if len(parts) < 4:
        raise SystemExit(f"--configs wants S,R,M,SCHEDULE[,T[,VAR=VALUE...]]; received {text!r}")
    s, r, m, schedule = int(parts[0]), int(parts[1]), int(parts[2]), parts[3]
    t = int(parts[4]) if len(parts) > 4 and "=" not in parts[4] else 1
    extra = dict(p.split("=", 1) for p in parts[4:] if "=" in p)
    return (s, r, m, schedule, t, extra)


def _batches(texts):
    """["resnet56=128", ...] -> {"resnet56": 128}."""
    out = {}
    for text in texts:
        name, _, value = text.partition("=")
        if name not in PLANS or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--batch wants WORKLOAD=N with WORKLOAD one of {sorted(PLANS)} "
                             f"and N a positive number; received {text!r}")
        out[name] = int(value)
    return out


def worker_cmd(*args):
    return [sys.executable, os.path.join(HERE, "worker.py"), *map(str, args)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*",
                        default=["mlp", "wide", "resnet110", "resnet1001", "gpt", "embed",
                                 "transfer"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=os.path.join(HERE, "results.json"))
    parser.add_argument("--trace-dir", default=None, help="keep the traces (and pictures) here")
    parser.add_argument("--configs", nargs="*", default=None,
                        help="instead of each workload's own list: S,R,M,SCHEDULE[,T[,VAR=VALUE...]]"
                             " (e.g. 2,1,8,zb-h1 or 2,1,4,1f1b,1,HYPARFLOW_TRANSPOSED=0;"
                             " SCHEDULE interleaved:V for V model chunks per rank)")
    parser.add_argument("--batch", nargs="*", default=[], metavar="WORKLOAD=N",
                        help="a workload's global batch instead of its own (e.g. resnet56=128)")
    parser.add_argument("--communication-dtype", default=None,
                        help="hf.fit's communication_dtype for every run (e.g. bfloat16); "
                             "several, comma-separated, run each configuration once per dtype")
    args = parser.parse_args()
    batches = _batches(args.batch)
    dtypes = (args.communication_dtype or "float32").split(",")
    env = dict(os.environ, HYPARFLOW_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    rows, results = [], {}
    trace_dir = args.trace_dir or tempfile.mkdtemp()
    os.makedirs(trace_dir, exist_ok=True)
    for workload in [w for w in args.only if w in PLANS]:
        batch, configs = PLANS[workload]
        batch = batches.get(workload, batch)
        if args.configs is not None:
            configs = [_config(c) for c in args.configs]
        base = run(worker_cmd("baseline", workload, batch, args.steps), env)
        cores = os.cpu_count() or 1
        every = run(worker_cmd("baseline", workload, batch, args.steps),
                    dict(env, HYPARFLOW_THREADS=str(cores)))
        results[workload] = {"baseline": base, "all_cores": every, "runs": []}
        rows.append((workload, "Keras 1 proc x 1 thread", base["step_s"], base["samples_s"], 1.0,
                     base["samples_s"] / every["samples_s"], "", "", "", "",
                     f"{base['peak_mb']:.0f}",
                     f"{base['state_mb']:.1f}"))
        rows.append((workload, f"Keras 1 proc x {cores} threads", every["step_s"],
                     every["samples_s"], every["samples_s"] / base["samples_s"], 1.0, "", "", "", "",
                     f"{every['peak_mb']:.0f}", f"{every['state_mb']:.1f}"))
        for (s, r, m, schedule, *more), dtype in [(c, d) for c in configs for d in dtypes]:
            t = more[0] if more else 1
            extra = more[1] if len(more) > 1 else {}
            name = f"S={s} R={r} M={m} {schedule}" + (f" T={t}" if t > 1 else "") + "".join(
                f" {k.replace('HYPARFLOW_', '').lower()}={v}" for k, v in extra.items()) + (
                f" {dtype}" if dtype != "float32" else "")
            trace = os.path.join(trace_dir, f"{workload}_S{s}_R{r}_M{m}_{schedule}_T{t}"
                                 + "".join(f"_{v}".replace(os.sep, "-") for v in extra.values())
                                 + f"_{dtype}.json")
            res = run([MPIEXEC, "-n", str(s * r * t), *worker_cmd(
                "hf", workload, batch, args.steps, s, r, m, schedule, trace, t, dtype)],
                dict(env, **extra))
            results[workload]["runs"].append(res)
            rows.append((workload, name, res["step_s"], res["samples_s"],
                         res["samples_s"] / base["samples_s"],
                         res["samples_s"] / every["samples_s"], f"{res['bubble']:.3f}",
                         f"{res['theory_bubble']:.3f}", f"{res['grad_mb']:.1f}",
                         f"{res['sent_mb']:.2f}",
                         "/".join(f"{v:.0f}" for v in res["peak_mb"]),
                         "/".join(f"{v:.1f}" for v in res["state_mb"])))
    if "transfer" in args.only:
        res = run([MPIEXEC, "-n", "2", *worker_cmd("transfer")], env)
        results["transfer"] = res
    header = ("workload", "configuration", "s/step", "samples/s", "x 1 thread", "x all cores",
              "bubble",
              "theory", "grad MB/step", "sent MB/step", "peak MB/rank", "params+opt MB/rank")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *[
        tuple(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) for row in rows])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*header))
    for row in rows:
        print(fmt.format(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row)))
    if "transfer" in results:
        print("\nboundary-tensor transfer, one way (ping-pong / 2), median of repeats")
        print(f"{'bytes':>10}  {'mpi4py Send/Recv s':>20}  {'hyparflow s':>12}  {'ratio':>6}")
        for row in results["transfer"]["rows"]:
            print(f"{row['bytes']:>10}  {row['raw_s']:>20.6f}  {row['hf_s']:>12.6f}  "
                  f"{row['hf_s'] / row['raw_s']:>6.2f}")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json}; traces in {trace_dir}")


if __name__ == "__main__":
    main()
