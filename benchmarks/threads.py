"""Threads per rank in one run (docs/performance.md, "Threads per rank"): for each
workload, plain Keras with every core, `mpiexec -n 2 python` (hf.fit's default layout:
one-thread replicas), and `hyparflow run` without -n (the node planned, or its cached
plan), each the median step after a warm-up epoch, interleaved so the machine's noisy
spells fall on all three alike.

    python benchmarks/threads.py --only mlp gpt resnet56 --steps 8 --rounds 2
    python benchmarks/threads.py step WORKLOAD BATCH STEPS [keras]   # one measurement

Planning a workload the first time (not counted) takes minutes; its plan is cached
(HYPARFLOW_PLAN_CACHE) and every later round takes it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = {"mlp": 256, "gpt": 64, "resnet56": 64}


def step(workload, batch, steps, keras_only):
    import hyparflow as hf

    sys.path.insert(0, HERE)
    import workloads

    model, x, y = workloads.make(workload, batch * (steps + 1))
    times = []
    fit = model.fit if keras_only else (lambda *a, **k: hf.fit(model, *a, **k))
    fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
        callbacks=[workloads.BatchTimer(times)])
    median = statistics.median(times[1:])
    if keras_only or hf.is_main():
        print("RESULT " + json.dumps({"step_s": median, "samples_s": batch / median}),
              flush=True)


def _result(out):
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(out.stdout[-2000:] + out.stderr[-3000:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", default=list(BATCH))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPARFLOW_NUM_",
                                                                       "HYPARFLOW_THREADS"))}
    env.setdefault("HYPARFLOW_INTER_OP_THREADS", "1")
    me = os.path.abspath(__file__)
    rows = {}
    for name in args.only:
        what = [name, str(BATCH[name]), str(args.steps)]
        first = subprocess.run([py, "-m", "hyparflow", "run", me, "step", *what], env=env,
                               capture_output=True, text=True)   # plans (or takes the cache)
        choice = first.stdout.splitlines()[0] if first.stdout else first.stderr[-2000:]
        runs = {"keras": [], "mpiexec -n 2": [], "hyparflow run": []}
        for _ in range(args.rounds):
            runs["keras"].append(_result(subprocess.run(
                [py, me, "step", *what, "keras"], env=env, capture_output=True, text=True)))
            runs["mpiexec -n 2"].append(_result(subprocess.run(
                [os.path.join(os.path.dirname(py), "mpiexec"), "-n", "2", py, me, "step",
                 *what], env=env, capture_output=True, text=True)))
            runs["hyparflow run"].append(_result(subprocess.run(
                [py, "-m", "hyparflow", "run", me, "step", *what], env=env,
                capture_output=True, text=True)))
        rows[name] = {k: [r["samples_s"] for r in v] for k, v in runs.items()}
        base = statistics.median(rows[name]["keras"])
        print(f"{name} (batch {BATCH[name]}): {choice}")
        for k, v in rows[name].items():
            print(f"  {k:>14}: " + ", ".join(f"{s:.0f}" for s in v)
                  + f" samples/s, median {statistics.median(v) / base:.2f}x plain Keras",
                  flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "step":
        step(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), len(sys.argv) > 5)
    else:
        main()
