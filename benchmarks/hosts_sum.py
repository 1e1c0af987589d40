"""Gradient sums across hosts: hierarchical against flat, in bytes across hosts and time.

    bash scripts/emulated-cluster.sh up 2
    python benchmarks/hosts_sum.py --rate 1gbit --ranks-per-host 2

Runs on the emulated hosts (scripts/emulated-cluster.sh, as root), with each host's link
limited to `--rate` both ways for the run (`emulated-cluster.sh rate`; unlimited again
at the end). Bytes across hosts are what the hosts' links carried: each host's veth
counter on the bridge side (what the host sent), summed over the hosts.

1. One sum of `--sizes` MB of float32, each way in its own mpiexec run
   (benchmarks/shm_sum.py): MPI_Allreduce (MPICH's own), hyparflow's messages (flat: a
   ring of every rank) and hyparflow's shared window (hierarchical: each host sums in
   memory, then only slices cross: each rank exchanges its 1/P with the same-position
   ranks of the other hosts). Median ms of the slowest rank; MB across hosts per sum.
2. Training (`--workload`, benchmarks/workloads.py) as R = hosts x ranks-per-host
   replicas, with HYPARFLOW_SHARED_SUMS=0 (flat) and =1 (hierarchical): the median step
   time, and the bytes across hosts per step (two runs of different lengths, so what
   set-up sends cancels out).

The hosts share this machine's cores: times compare the ways with each other, in the
same run, not with a real cluster.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run import MPIEXEC, PLANS, run, worker_cmd  # noqa: E402

CLUSTER = os.path.join(ROOT, "scripts", "emulated-cluster.sh")
WAYS = [("mpi", "MPI_Allreduce"), ("messages", "flat: a ring of every rank"),
        ("window", "hierarchical: host's window, slices across")]


def cluster(*args):
    return subprocess.run(["bash", CLUSTER, *args], check=True, capture_output=True,
                          text=True).stdout


def cluster_env():
    """The exports `emulated-cluster.sh env` prints, as a dict."""
    env = {}
    for line in cluster("env").splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            env[key] = value.strip("'\"")
    return env


def sent(hosts):
    """Bytes each host has sent so far: its link's counter on the bridge side."""
    bridge = os.environ.get("HYPARFLOW_EMU_BRIDGE", "hfbr0")
    prefix = os.environ.get("HYPARFLOW_EMU_PREFIX", "hfnode")
    total = 0
    for h in hosts:
        with open(f"/sys/class/net/{bridge}v{h[len(prefix):]}/statistics/rx_bytes") as f:
            total += int(f.read())
    return total


def across(hosts, cmd, env):
    """Run cmd; its RESULT and the bytes the hosts sent meanwhile."""
    before = sent(hosts)
    res = run(cmd, env)
    return res, sent(hosts) - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="each host's link, both ways ('off': unlimited)")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--sizes", type=float, nargs="*", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--workload", default="mlp", choices=sorted(PLANS))
    parser.add_argument("--steps", type=int, nargs=2, default=[3, 9],
                        help="the two run lengths whose difference gives bytes per step")
    args = parser.parse_args()
    env = dict(os.environ, **cluster_env(), HYPARFLOW_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    hosts = env["HYPARFLOW_EMULATED_HOSTS"].split(",")
    p = args.ranks_per_host
    n = len(hosts) * p
    launch = [MPIEXEC, "-n", str(n), "-hosts", ",".join(f"{h}:{p}" for h in hosts)]
    cluster("rate", args.rate)
    try:
        print(f"{len(hosts)} hosts x {p} ranks, links at {args.rate}")
        print(f"{'MB':>5}  {'sum':<45}  {'ms':>8}  {'MB across hosts':>15}")
        for mb in args.sizes:
            for way, name in WAYS:
                res, nbytes = across(hosts, launch + [
                    sys.executable, os.path.join(HERE, "shm_sum.py"), "--sizes", str(mb),
                    "--repeats", str(args.repeats), "--ways", way], env)
                ms = res["rows"][0][2] * 1e3
                print(f"{mb:>5g}  {name:<45}  {ms:>8.1f}  {nbytes / (args.repeats + 1) / 2**20:>15.1f}",
                      flush=True)
        batch = PLANS[args.workload][0]
        trace = os.path.join(tempfile.mkdtemp(), "trace.json")
        print(f"\n{args.workload}, batch {batch}, R={n} replicas (HYPARFLOW_ZERO=0)")
        print(f"{'sums':<45}  {'s/step':>8}  {'MB across hosts/step':>20}")
        for flag, name in (("0", "flat (HYPARFLOW_SHARED_SUMS=0)"),
                           ("1", "hierarchical (HYPARFLOW_SHARED_SUMS=1)")):
            runs = []
            for steps in args.steps:
                runs.append(across(hosts, launch + worker_cmd(
                    "hf", args.workload, batch, steps, 1, n, 1, "gpipe", trace, 1, "float32"),
                    dict(env, HYPARFLOW_SHARED_SUMS=flag, HYPARFLOW_ZERO="0")))
            (_, short), (res, long) = runs
            per_step = (long - short) / (args.steps[1] - args.steps[0])
            print(f"{name:<45}  {res['step_s']:>8.3f}  {per_step / 2**20:>20.1f}", flush=True)
        print("RESULT " + json.dumps({"rate": args.rate, "hosts": hosts, "ranks_per_host": p}))
    finally:
        cluster("rate", "off")


if __name__ == "__main__":
    main()
