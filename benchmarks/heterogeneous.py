"""A slowed rank: speed-aware balance against even balance.

    python benchmarks/heterogeneous.py [--slowdown 2] [--steps 8]

Runs the 8 x Dense(1024) MLP on 2 stages with rank 0 made `--slowdown` times slower
(HYPARFLOW_SLOWDOWN, set for that rank only with mpiexec's MPMD syntax), once cut
evenly by measured time and once with `speeds="measure"`, and prints the step times.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def worker(mode, steps):
    import hyparflow as hf
    from hyparflow.engine import timeline

    sys.path.insert(0, HERE)
    import workloads

    model, x, y = workloads.make("mlp", 256 * (steps + 1))
    trace = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hetero-{mode}.json")
    hf.fit(model, x, y, batch_size=256, epochs=1, num_stages=2, num_microbatches=8,
           schedule="1f1b", balance="time", speeds="measure" if mode == "speeds" else None,
           verbose=0, shuffle=False, trace=trace)
    if hf.is_main():
        data = timeline.load(trace)
        steps_ = {}
        for e in data["traceEvents"]:
            if e.get("cat") == "step":
                steps_.setdefault(e["args"]["step"], []).append(e["dur"] / 1e6)
        per = [max(v) for _, v in sorted(steps_.items())][1:]
        print("RESULT " + json.dumps({"mode": mode, "step_s": statistics.median(per)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowdown", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", choices=("even", "speeds"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    results = {}
    for mode in ("even", "speeds"):
        me = [sys.executable, __file__, "--worker", mode, "--steps", str(args.steps)]
        cmd = [MPIEXEC, "-n", "1", "-env", "HYPARFLOW_SLOWDOWN", str(args.slowdown),
               "-env", "HYPARFLOW_THREADS", "1", *me, ":", "-n", "1", "-env",
               "HYPARFLOW_THREADS", "1", *me]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not line:
            raise SystemExit(f"{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        results[mode] = json.loads(line[-1][7:])["step_s"]
    print(f"rank 0 slowed {args.slowdown:g}x, 2 stages, M=8, 1F1B")
    print(f"{'balance':<28} {'s/step':>8}")
    print(f"{'even (by measured time)':<28} {results['even']:>8.4f}")
    print(f"{'speed-aware (measure)':<28} {results['speeds']:>8.4f}")
    print(f"speed-up from speed-aware balance: {results['even'] / results['speeds']:.2f}x")


if __name__ == "__main__":
    main()
