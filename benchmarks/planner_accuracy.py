"""The planner's predictions against measured step times, on this machine.

    python benchmarks/planner_accuracy.py --workload mlp --ranks 1 2 4

For each rank count, `hyparflow plan` ranks its plans (stages x tensor ranks x replicas
dividing the ranks, the microbatch counts given); every plan that fits is then run for real under
mpiexec (benchmarks/worker.py, the same model and batch) and its median step time is
printed next to the prediction.

This machine's cores are shared with other virtual machines, which now and then slow
everything on it down for seconds at a time (one plan measured 0.083 s in one run and
0.049-0.051 s in four runs right after). So every plan is run `--passes` times, one
pass over all the plans after another, and the fastest of its runs is the measurement.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import MPIEXEC, PLANS, run, worker_cmd  # noqa: E402

MODEL_FILE = """import sys
sys.path.insert(0, {here!r})
import workloads

def build_model():
    return workloads.make({workload!r}, 8)[0]
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp", choices=sorted(PLANS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--passes", type=int, default=2,
                        help="runs of every plan (the fastest is kept)")
    args = parser.parse_args()
    batch = PLANS[args.workload][0]
    tmp = tempfile.mkdtemp()
    model_file = os.path.join(tmp, "model.py")
    with open(model_file, "w") as f:
        f.write(MODEL_FILE.format(here=HERE, workload=args.workload))
    env = dict(os.environ, HYPARFLOW_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    rows = []
    for ranks in args.ranks:
        out = os.path.join(tmp, f"plans{ranks}.json")
        subprocess.run([sys.executable, "-m", "hyparflow", "plan", model_file, "--batch-size",
                        str(batch), "--ranks", str(ranks), "--json", out, "--schedules", "1f1b",
                        "--microbatches", *map(str, args.microbatches)],
                       check=True, env=env, capture_output=True, text=True)
        plans = [(k, p) for k, p in enumerate(json.load(open(out))["plans"], 1) if p["fits"]]
        runs = {k: [] for k, _ in plans}
        for _ in range(args.passes):
            for rank_order, p in plans:
                s, r, m, t = p["stages"], p["replicas"], p["microbatches"], p.get("tensor", 1)
                trace = os.path.join(tmp, f"t{ranks}_{s}_{t}_{r}_{m}.json")
                res = run([MPIEXEC, "-n", str(ranks), *worker_cmd(
                    "hf", args.workload, batch, args.steps, s, r, m, p["schedule"], trace, t)],
                    env)
                runs[rank_order].append(res["step_s"])
        for rank_order, p in plans:
            rows.append((ranks, rank_order, p["stages"], p.get("tensor", 1), p["replicas"],
                         p["microbatches"], p["schedule"], p["step_s"], min(runs[rank_order]),
                         max(runs[rank_order])))
        best_measured = min((min(v) for v in runs.values()), default=None)
        first = [row for row in rows if row[0] == ranks and row[1] == 1]
        if first:
            print(f"ranks={ranks}: planner's first choice measured {first[0][8]:.4f} s, best "
                  f"measured {best_measured:.4f} s ({first[0][8] / best_measured - 1:+.0%})",
                  flush=True)
    print(f"\n{'ranks':>5} {'#':>3} {'S':>2} {'T':>2} {'R':>2} {'M':>3} {'schedule':>8} "
          f"{'predicted s':>12} {'measured s':>11} {'error':>7} {'slowest run s':>14}")
    for ranks, k, s, t, r, m, sched, pred, meas, slowest in rows:
        print(f"{ranks:>5} {k:>3} {s:>2} {t:>2} {r:>2} {m:>3} {sched:>8} {pred:>12.4f} "
              f"{meas:>11.4f} {pred / meas - 1:>+7.0%} {slowest:>14.4f}")


if __name__ == "__main__":
    main()
