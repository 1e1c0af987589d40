"""ResNet-1001 projected onto large clusters by `hyparflow plan`, next to HyPar-Flow's.

    python benchmarks/projection.py --nodes 1 128 512

Profiles the ResNet-1001 of benchmarks/workloads.py here once (`--profile-cache`),
then asks the planner for its best plan at each node count with a given network
(weak scaling: `--per-node` samples per node, `--ranks-per-node` ranks of one node's
cores each), and prints the projected throughput and the speed-up over one node. The
HyPar-Flow paper (ISC 2020) reports 110x on 128 Stampede2 nodes and 481x on 512
Frontera nodes for ResNet-1001 against one node.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PAPER = {128: "110x (Stampede2)", 512: "481x (Frontera)"}
MODEL_FILE = """import sys
sys.path.insert(0, {here!r})
import workloads

def build_model():
    return workloads.make("resnet1001", 8)[0]
"""


def plan(model_file, nodes, args, cache, out):
    cmd = [sys.executable, "-m", "hyparflow", "plan", model_file,
           "--batch-size", str(args.per_node * nodes), "--nodes", str(nodes),
           "--ranks-per-node", str(args.ranks_per_node), "--cores", str(args.ranks_per_node),
           "--bandwidth", args.bandwidth, "--latency", args.latency,
           "--microbatches", *map(str, args.microbatches), "--schedules", "1f1b",
           "--profile-cache", cache, "--json", out]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)["plans"][0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 128, 512])
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=64, help="samples per node per step")
    parser.add_argument("--bandwidth", default="12.5GB/s")
    parser.add_argument("--latency", default="2us")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--profile-cache", default=os.path.join(tempfile.gettempdir(),
                                                                "resnet1001-profile.json"))
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    model_file = os.path.join(tmp, "model.py")
    with open(model_file, "w") as f:
        f.write(MODEL_FILE.format(here=HERE))
    rows = []
    for nodes in args.nodes:
        best = plan(model_file, nodes, args, args.profile_cache,
                    os.path.join(tmp, f"plans{nodes}.json"))
        rows.append((nodes, best))
        print(f"{nodes} nodes: done", flush=True)
    base = next((p["samples_s"] for n, p in rows if n == 1), None)
    print(f"\nResNet-1001, {args.per_node} samples per node, {args.ranks_per_node} ranks per "
          f"node, {args.bandwidth}, {args.latency}")
    print(f"{'nodes':>6} {'S':>4} {'R':>5} {'M':>3} {'step s':>9} {'samples/s':>10} "
          f"{'speed-up':>9} {'efficiency':>10}  paper")
    for nodes, p in rows:
        up = p["samples_s"] / base if base else float("nan")
        print(f"{nodes:>6} {p['stages']:>4} {p['replicas']:>5} {p['microbatches']:>3} "
              f"{p['step_s']:>9.3f} {p['samples_s']:>10.1f} {up:>8.1f}x {up / nodes:>10.2f}  "
              f"{PAPER.get(nodes, '')}")


if __name__ == "__main__":
    main()
