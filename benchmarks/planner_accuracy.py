"""The planner's predictions against measured step times, on this machine.

    python benchmarks/planner_accuracy.py --workload mlp --ranks 1 2 4

For each rank count, `hyparflow plan` ranks its plans (stages x tensor ranks x replicas
dividing the ranks, the microbatch counts given); every plan that fits is then run for real under
mpiexec (benchmarks/worker.py, the same model and batch) and its median step time is
printed next to the prediction.

This machine's cores are shared with other virtual machines, which now and then slow
everything on it down for seconds at a time (one plan measured 0.083 s in one run and
0.049-0.051 s in four runs right after; its speed drifts by 10-20% over minutes). So
the benchmark goes in `--rounds`: each round plans anew, then runs every plan once,
so that a prediction and a measurement are never far apart in time. A plan's
prediction is the median of its rounds', its measurement the fastest of its runs;
the table shows the range of the predictions and the slowest run too.
"""

import argparse
import json
import os
import statistics
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2,
                        help="plan, then run every plan once; this many times (the median "
                             "prediction and the fastest run are kept)")
    args = parser.parse_args()
    batch = PLANS[args.workload][0]
    tmp = tempfile.mkdtemp()
    model_file = os.path.join(tmp, "model.py")
    with open(model_file, "w") as f:
        f.write(MODEL_FILE.format(here=HERE, workload=args.workload))
    env = dict(os.environ, HYPARFLOW_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    rows = []
    for ranks in args.ranks:
        predicted, runs, firsts, hidden = {}, {}, [], {}
        for k in range(args.rounds):
            out = os.path.join(tmp, f"plans{ranks}_{k}.json")
            subprocess.run([sys.executable, "-m", "hyparflow", "plan", model_file, "--batch-size",
                            str(batch), "--ranks", str(ranks), "--json", out, "--schedules",
                            "1f1b", "--microbatches", *map(str, args.microbatches)],
                           check=True, env=env, capture_output=True, text=True)
            plans = [p for p in json.load(open(out))["plans"] if p["fits"]]
            if plans:
                firsts.append(_key(plans[0]))
            for p in plans:
                predicted.setdefault(_key(p), []).append(p["step_s"])
                s, t, r, m, schedule = _key(p)
                trace = os.path.join(tmp, f"t{ranks}_{s}_{t}_{r}_{m}.json")
                res = run([MPIEXEC, "-n", str(ranks), *worker_cmd(
                    "hf", args.workload, batch, args.steps, s, r, m, schedule, trace, t)], env)
                runs.setdefault(_key(p), []).append(res["step_s"])
                # What the trace does not show (worker's `_untraced`): in a step, outside
                # its actions, and between steps.
                hidden.setdefault(_key(p), []).append(res["untraced_s"] + res["between_s"])
        order = sorted(predicted, key=lambda key: statistics.median(predicted[key]))
        best = min(min(v) for v in runs.values())
        for key in firsts:
            print(f"ranks={ranks}: a first choice, {_name(key)}, measured {min(runs[key]):.4f} s, "
                  f"best measured {best:.4f} s ({min(runs[key]) / best - 1:+.0%})", flush=True)
        for n, key in enumerate(order, 1):
            rows.append((ranks, n, key, statistics.median(predicted[key]), min(predicted[key]),
                         max(predicted[key]), min(runs[key]), max(runs[key]),
                         max(hidden[key])))
    print(f"\n{'ranks':>5} {'#':>3} {'S':>2} {'T':>2} {'R':>2} {'M':>3} {'schedule':>8} "
          f"{'predicted s':>12} {'measured s':>11} {'error':>7} {'predictions s':>16} "
          f"{'slowest run s':>14} {'untraced ms':>12}")
    for ranks, n, (s, t, r, m, sched), pred, lo, hi, meas, slowest, untraced in rows:
        print(f"{ranks:>5} {n:>3} {s:>2} {t:>2} {r:>2} {m:>3} {sched:>8} {pred:>12.4f} "
              f"{meas:>11.4f} {pred / meas - 1:>+7.0%} {f'{lo:.4f}-{hi:.4f}':>16} {slowest:>14.4f} "
              f"{untraced * 1e3:>12.1f}")


def _key(plan):
    return (plan["stages"], plan.get("tensor", 1), plan["replicas"], plan["microbatches"],
            plan["schedule"])


def _name(key):
    s, t, r, m, schedule = key
    return f"S={s} T={t} R={r} M={m} {schedule}"


if __name__ == "__main__":
    main()
