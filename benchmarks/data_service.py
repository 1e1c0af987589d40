"""Decoding on other hosts: the JPEG pipeline of benchmarks/input.py trained by 2 ranks on
one emulated host, decoded in place or by a tf.data service's workers on another.

    bash scripts/emulated-cluster.sh up 2
    python benchmarks/data_service.py --images 1536 --epochs 3 --workers 0 1 2

Host A (the first emulated host) runs `mpiexec -n 2` of hf.fit on the dataset (its files
dealt to the 2 replicas); with K workers, host B runs `hyparflow data-service
--dispatcher` and K `--worker` processes, and the replicas read from them
(`data_service=`, the mode `--mode`). Rows: samples/s over the epochs after the first,
the share of rank 0's step spent waiting for data, and the bytes that reached host A
over its link per sample (its network namespace's counters: the ranks of host A talk by
shared memory, so these are the decoded batches, and the service's own messages). All
hosts share this machine's cores: a worker on "host B" takes cores from the training on
"host A", which a real second node would not.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLUSTER = os.path.join(ROOT, "scripts", "emulated-cluster.sh")
sys.path.insert(0, HERE)

from input import make_files, pipeline_arguments, result, worker_command  # noqa: E402


def hosts():
    """[(name, address)] of the emulated hosts (`emulated-cluster.sh up`)."""
    path = os.path.join(os.environ.get("HYPARFLOW_EMU_DIR", "/tmp/hyparflow-emu"), "hosts")
    if not os.path.exists(path):
        sys.exit("no emulated cluster: bash scripts/emulated-cluster.sh up 2")
    return [tuple(line.split()[:2]) for line in open(path) if line.strip()]


def on(host, *argv, **popen):
    return subprocess.Popen(["bash", CLUSTER, "exec", host, *argv], text=True,
                            start_new_session=True, **popen)


def received(host):
    """Bytes received on `host`'s links (not loopback), from its namespace's counters."""
    out = subprocess.run(["bash", CLUSTER, "exec", host, "cat", "/proc/net/dev"],
                         capture_output=True, text=True, timeout=30).stdout
    total = 0
    for line in out.splitlines()[2:]:
        name, fields = line.split(":", 1)
        if name.strip() != "lo":
            total += int(fields.split()[0])
    return total


def line_of(proc, prefix, timeout=60):
    """The first line `proc` prints that starts with `prefix`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.stdout.readline()
        if text.startswith(prefix):
            return text.strip()
        if not text and proc.poll() is not None:
            break
    raise RuntimeError(f"no '{prefix}' line from {proc.args}")


def service(host, address, workers):
    """A dispatcher and `workers` workers on `host`: (grpc address, processes)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    py = [sys.executable, "-m", "hyparflow", "data-service"]
    dispatcher = on(host, *py, "--dispatcher", "--host", address, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, env=env)
    target = line_of(dispatcher, "hyparflow data-service: dispatcher").split()[-1]
    procs = [dispatcher]
    for _ in range(workers):
        procs.append(on(host, *py, "--worker", target, "--host", address,
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env))
        line_of(procs[-1], "hyparflow data-service: worker")
    return target, procs


def train(args, host, target):
    """One hf.fit on `host` under mpiexec -n 2: its RESULT and the bytes host A received."""
    import shutil

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    cmd = [mpiexec, "-n", "2", *worker_command(args, "hf-dataset")]
    if target:
        cmd += ["--data-service", target, "--data-service-mode", args.mode]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = received(host)
    proc = on(host, *cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = proc.communicate(timeout=3000)
    moved = received(host) - before
    return result(proc.returncode, out, err, "training"), moved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pipeline_arguments(parser, 1536)
    parser.add_argument("--workers", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--mode", default="exact", choices=("exact", "dynamic"))
    args = parser.parse_args()
    (a, _), (b, b_address) = hosts()[:2]
    args.dir = args.dir or tempfile.mkdtemp(prefix="jpeg-records-")
    if not os.listdir(args.dir):
        make_files(args, args.dir)
    rows = []
    for k in args.workers:
        target, procs = service(b, b_address, k) if k else (None, [])
        try:
            result, moved = train(args, a, target)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
        rows.append((k, result, moved))
    samples = args.images * args.epochs
    print(f"\n{args.images} JPEGs {args.size}px in {args.files} files -> {args.crop}px, batch "
          f"{args.batch}, 2 ranks on {a}, the service on {b} ({args.mode}), "
          f"{os.cpu_count()} cores shared by both\n")
    print("| decoding | samples/s | x in place | wait on rank 0 | bytes to host A per sample |")
    print("|---|---:|---:|---:|---:|")
    base = rows[0][1]["samples_s"]
    for k, res, moved in rows:
        where = "in place (each replica its files)" if not k else f"{k} worker(s) on {b}"
        print(f"| {where} | {res['samples_s']:.0f} | {res['samples_s'] / base:.2f}x | "
              f"{res['wait']:.0%} | {moved / samples:,.0f} |")


if __name__ == "__main__":
    main()
