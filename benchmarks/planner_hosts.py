"""The planner across hosts: predicted against measured step times on 2 emulated hosts.

    HYPARFLOW_EMU_RATE=1gbit bash scripts/emulated-cluster.sh up 2
    eval "$(bash scripts/emulated-cluster.sh env)"
    python benchmarks/planner_hosts.py --hosts hfnode1:1,hfnode2:1 --workload mlp

`hyparflow plan --hosts` measures the link within a host and between hosts (a ping-pong
through mpiexec), profiles the model and ranks its plans for those hosts; each plan that
fits is then run for real across the hosts (`mpiexec -hosts`, benchmarks/worker.py, the
same model and batch) and its fastest step time printed next to the prediction.

The emulated hosts share this machine's cores: give `--cores` the cores each host really
has (2 cores, 2 hosts: 1).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from planner_accuracy import MODEL_FILE, _key  # noqa: E402
from run import MPIEXEC, PLANS, run, worker_cmd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", required=True)
    parser.add_argument("--workload", default="mlp", choices=sorted(PLANS))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--cores", type=int, default=1, help="cores per host")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    batch = PLANS[args.workload][0]
    tmp = tempfile.mkdtemp()
    model_file = os.path.join(tmp, "model.py")
    with open(model_file, "w") as f:
        f.write(MODEL_FILE.format(here=HERE, workload=args.workload))
    env = dict(os.environ, HYPARFLOW_THREADS=str(args.cores), TF_CPP_MIN_LOG_LEVEL="2")
    out = os.path.join(tmp, "plans.json")
    planned = subprocess.run([sys.executable, "-m", "hyparflow", "plan", model_file,
                              "--batch-size", str(batch), "--hosts", args.hosts, "--json", out,
                              "--schedules", "1f1b", "--cores", str(args.cores),
                              "--microbatches", *map(str, args.microbatches)],
                             env=env, capture_output=True, text=True)
    if planned.returncode:
        raise SystemExit(planned.stdout[-3000:] + planned.stderr[-3000:])
    print("\n".join(l for l in planned.stdout.splitlines() if l.startswith(("links", "network"))))
    ranks = sum(int(h.split(":")[1]) for h in args.hosts.split(","))
    rows = []
    for p in [p for p in json.load(open(out))["plans"] if p["fits"]]:
        s, t, r, m, schedule = _key(p)
        trace = os.path.join(tmp, f"t{s}_{t}_{r}_{m}.json")
        res = run([MPIEXEC, "-hosts", args.hosts, "-n", str(ranks), *worker_cmd(
            "hf", args.workload, batch, args.steps, s, r, m, schedule, trace, t)], env)
        rows.append((s, t, r, m, p["step_s"], res["step_s"]))
        print(f"S={s} T={t} R={r} M={m}: predicted {p['step_s']:.4f} s, measured "
              f"{res['step_s']:.4f} s ({p['step_s'] / res['step_s'] - 1:+.0%})", flush=True)
    print(f"\n{'S':>2} {'T':>2} {'R':>2} {'M':>3} {'predicted s':>12} {'measured s':>11} {'error':>7}")
    for s, t, r, m, pred, meas in rows:
        print(f"{s:>2} {t:>2} {r:>2} {m:>3} {pred:>12.4f} {meas:>11.4f} {pred / meas - 1:>+7.0%}")


if __name__ == "__main__":
    main()
