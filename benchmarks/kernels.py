"""What one core does with each kernel path: GFLOPS of the products a rank runs.

    python benchmarks/kernels.py            # the table (a process per path)
    python benchmarks/kernels.py --json out.json

Each rank of a hyparflow job runs TensorFlow with one intra-op thread on its core, so
the speed of TensorFlow's single-thread kernels bounds every layout. This prints, per
product, TensorFlow with 1 thread, 2 threads pinned to one core, XLA (`jit_compile`)
with 1 thread, the plain BLAS product with 1 thread (NumPy's OpenBLAS: the per-core
limit), and TensorFlow / XLA / BLAS with every core (what plain Keras uses). Only
ratios measured in one run mean anything: CPU models differ several-fold.
"""

import argparse
import json
import os
import subprocess
import sys
import time

# name -> (kind, shapes): "mm" is x[m,k] @ w[k,n]; "mmT" is dy[m,n] @ w[k,n]^T (the
# input gradient); conv kinds are a 3x3 same-padded Conv2D's forward, input and filter
# gradients on x[b,h,w,c] with c filters.
PRODUCTS = {
    "Dense 256x1024x1024": ("mm", (256, 1024, 1024)),
    "Dense 32x1024x1024": ("mm", (32, 1024, 1024)),
    "Dense dy@W^T 32x1024x1024": ("mmT", (32, 1024, 1024)),
    "Conv2D fwd b8 16x16x32": ("conv", (8, 16, 16, 32)),
    "Conv2D fwd b64 16x16x32": ("conv", (64, 16, 16, 32)),
    "Conv2D dx b64 16x16x32": ("conv_dx", (64, 16, 16, 32)),
    "Conv2D dw b64 16x16x32": ("conv_dw", (64, 16, 16, 32)),
}

# path -> (engine, threads ("all": every core), pinned to one core)
PATHS = {
    "TF 1 thread": ("tf", 1, False),
    "TF 2 threads, 1 core": ("tf", 2, True),
    "XLA 1 thread": ("xla", 1, False),
    "BLAS 1 thread": ("blas", 1, False),
    "TF all cores": ("tf", "all", False),
    "XLA all cores": ("xla", "all", False),
    "BLAS all cores": ("blas", "all", False),
}


def _flops(kind, shape):
    if kind in ("mm", "mmT"):
        m, k, n = shape
        return 2 * m * k * n
    b, h, w, c = shape
    return 2 * b * h * w * c * c * 9


def _timed(fn, repeats):
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(engine, threads, repeats=20):
    """GFLOPS of every product on one path, in this process (its thread counts are set
    before TensorFlow starts)."""
    import numpy as np

    out = {}
    if engine == "blas":
        rng = np.random.default_rng(0)
        for name, (kind, shape) in PRODUCTS.items():
            if kind not in ("mm", "mmT"):
                continue  # no plain BLAS convolution
            m, k, n = shape
            x = rng.standard_normal((m, k) if kind == "mm" else (m, n), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32)
            fn = (lambda: x @ w) if kind == "mm" else (lambda: x @ w.T)
            out[name] = _flops(kind, shape) / _timed(fn, repeats) / 1e9
        return out
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    jit = engine == "xla"
    for name, (kind, shape) in PRODUCTS.items():
        if kind in ("mm", "mmT"):
            m, k, n = shape
            x = tf.random.normal((m, k) if kind == "mm" else (m, n))
            w = tf.random.normal((k, n))
            f = tf.function(lambda a, b, t=(kind == "mmT"): tf.matmul(a, b, transpose_b=t),
                            jit_compile=jit)
            args = (x, w)
        else:
            b, h, wd, c = shape
            x = tf.random.normal((b, h, wd, c))
            w = tf.random.normal((3, 3, c, c))
            dy = tf.random.normal((b, h, wd, c))
            if kind == "conv":
                f = tf.function(lambda a, k_: tf.nn.conv2d(a, k_, 1, "SAME"), jit_compile=jit)
                args = (x, w)
            elif kind == "conv_dx":
                f = tf.function(lambda g, k_: tf.compat.v1.nn.conv2d_backprop_input(
                    (b, h, wd, c), k_, g, [1, 1, 1, 1], "SAME"), jit_compile=jit)
                args = (dy, w)
            else:
                f = tf.function(lambda a, g: tf.compat.v1.nn.conv2d_backprop_filter(
                    a, (3, 3, c, c), g, [1, 1, 1, 1], "SAME"), jit_compile=jit)
                args = (x, dy)
        out[name] = _flops(kind, shape) / _timed(lambda: f(*args).numpy(), repeats) / 1e9
    return out


def _run_path(engine, threads, pinned):
    cores = os.cpu_count() or 1
    n = cores if threads == "all" else threads
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OPENBLAS_NUM_THREADS=str(n),
               OMP_NUM_THREADS=str(n))
    cmd = [sys.executable, __file__, "--one", engine, str(n)]
    if pinned:
        if not hasattr(os, "sched_setaffinity"):
            return None
        cmd = [sys.executable, "-c", "import os, runpy, sys; os.sched_setaffinity(0, {min("
               "os.sched_getaffinity(0))}); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], "
               "run_name='__main__')", __file__, "--one", engine, str(n)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table():
    """{path: {product: GFLOPS}}, each path in a process of its own."""
    return {path: _run_path(*spec) for path, spec in PATHS.items()}


def print_table(results):
    paths = [p for p in PATHS if results.get(p)]
    width = max(len(p) for p in PRODUCTS)
    print(f"{'GFLOPS':<{width}}  " + "  ".join(f"{p:>{len(p)}}" for p in paths))
    for name in PRODUCTS:
        cells = [f"{results[p][name]:>{len(p)}.1f}" if name in results[p] else f"{'-':>{len(p)}}"
                 for p in paths]
        print(f"{name:<{width}}  " + "  ".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("ENGINE", "THREADS"), help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    results = table()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
