"""Training from JPEG files: hf.fit reading per replica against model.fit, in one run.

    python benchmarks/input.py                       # the table
    python benchmarks/input.py --images 3072 --ranks 1 2 4

The pipeline of issue 59: `--files` TFRecord files of `--images` JPEGs (`--size`
pixels square), decoded, resized to `--resize` and cropped to `--crop` by
`map(num_parallel_calls=AUTOTUNE)`, batched by `--batch`; a 3-convolution CNN. Rows:
plain `model.fit` on every core, on the pipeline and on the same images decoded into
arrays; then hf.fit under `mpiexec -n N` (threads per rank derived for the node): on
the arrays, on the whole dataset (its files dealt to the replicas), on a dataset
function (each replica its own files), on a PyDataset read by index (`model.fit` on it
too), and two stages on the dataset. Samples/s over
the epochs after the first (which traces and compiles); "x Keras": against plain
model.fit on the pipeline. "wait": the share of rank 0's step spent waiting for data.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))


def make_files(args, directory):
    """Smooth random RGB images (JPEG compresses them as it does photographs)."""
    import numpy as np
    import tensorflow as tf
    from image_files import write_records

    rng = np.random.default_rng(0)
    coarse = rng.uniform(0, 255, (args.images, 10, 10, 3)).astype("float32")
    images, labels = [], rng.integers(0, 10, args.images)
    for lo in range(0, args.images, 256):
        images.append(tf.cast(tf.image.resize(coarse[lo:lo + 256], (args.size, args.size)),
                              tf.uint8).numpy())
    return write_records(directory, np.concatenate(images), labels, args.files)


def worker(args):
    """One measurement (this process, or each rank of an mpiexec); prints RESULT."""
    import hyparflow as hf
    import keras
    import numpy as np
    import tensorflow as tf
    from image_files import cnn, decoder, pipeline

    paths = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir))
    model = cnn(args.crop)
    if args.how.endswith("arrays"):
        decode = decoder(args.resize, args.crop)
        pairs = list(tf.data.TFRecordDataset(paths).map(decode).batch(1024).as_numpy_iterator())
        data = dict(x=np.concatenate([p[0] for p in pairs]),
                    y=np.concatenate([p[1] for p in pairs]), batch_size=args.batch)
    elif args.how.endswith("function"):
        def files(ctx):
            mine = paths[ctx.input_pipeline_id::ctx.num_input_pipelines]
            return pipeline(mine, ctx.per_replica_batch_size, args.resize, args.crop)
        data = dict(x=files, batch_size=args.batch)
    elif args.how.endswith("pydataset"):
        data = dict(x=_jpegs(paths, args))
    else:
        data = dict(x=pipeline(paths, args.batch, args.resize, args.crop))
    times = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    if args.how.startswith("keras"):
        model.fit(**data, epochs=args.epochs, verbose=0, callbacks=[Clock()],
                  shuffle=False)
        wait = None
    else:
        stages = 2 if args.how.startswith("hf-stages") else 1
        service = dict(data_service=args.data_service,
                       data_service_mode=args.data_service_mode) if args.data_service else {}
        history = hf.fit(model, **data, epochs=args.epochs, verbose=0, shuffle=False,
                         callbacks=[Clock()], num_stages=stages,
                         num_microbatches=2 if stages == 2 else 1, **service)
        wait = history.data_wait["fraction"]
        if not hf.is_main():
            return
    n = args.images
    print("RESULT " + json.dumps({"samples_s": n * (len(times) - 1) / sum(times[1:]),
                                  "wait": wait}), flush=True)


def _jpegs(paths, args):
    """The records as a PyDataset read by index (the encoded images held in memory, as
    files of a folder would be read): each batch decoded when asked for, on 2 threads."""
    import keras
    import tensorflow as tf
    from image_files import decoder

    records = [r.numpy() for r in tf.data.TFRecordDataset(paths)]
    decode = decoder(args.resize, args.crop)
    batch_decode = tf.function(lambda rs: tf.map_fn(
        decode, rs, fn_output_signature=(tf.float32, tf.int64)))

    class Jpegs(keras.utils.PyDataset):
        def __len__(self):
            return -(-len(records) // args.batch)

        def __getitem__(self, i):
            x, y = batch_decode(tf.constant(records[i * args.batch:(i + 1) * args.batch]))
            return x.numpy(), y.numpy()

    return Jpegs(workers=2)


def worker_command(args, how):
    """The command line of one measurement `how` of the pipeline `args` describe."""
    return [sys.executable, os.path.abspath(__file__), "--worker", how, "--dir", args.dir,
            *(f"--{k}={getattr(args, k)}" for k in ("images", "size", "resize", "crop",
                                                      "batch", "epochs"))]


def result(code, stdout, stderr, what):
    """The RESULT a worker printed, or RuntimeError with its output."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not lines:
        raise RuntimeError(f"{what} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def pipeline_arguments(parser, images):
    """The pipeline's arguments, shared with benchmarks/data_service.py."""
    parser.add_argument("--images", type=int, default=images)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--resize", type=int, default=72)
    parser.add_argument("--crop", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dir", default=None)


def measure(args, how, ranks):
    cmd = worker_command(args, how)
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    return result(out.returncode, out.stdout, out.stderr, f"{how} on {ranks} ranks")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pipeline_arguments(parser, 3072)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--worker", default=None)
    # A tf.data service decodes for the worker (benchmarks/data_service.py).
    parser.add_argument("--data-service", default=None)
    parser.add_argument("--data-service-mode", default="exact")
    args = parser.parse_args()
    if args.worker:
        args.how = args.worker
        return worker(args)
    args.dir = args.dir or tempfile.mkdtemp(prefix="jpeg-records-")
    if not os.listdir(args.dir):
        make_files(args, args.dir)
    rows = [("model.fit, pipeline", 0, measure(args, "keras-pipeline", 0)),
            ("model.fit, decoded arrays", 0, measure(args, "keras-arrays", 0)),
            ("model.fit, PyDataset (2 threads)", 0, measure(args, "keras-pydataset", 0))]
    for n in args.ranks:
        rows.append(("hf.fit R=N, decoded arrays", n, measure(args, "hf-arrays", n)))
        rows.append(("hf.fit R=N, dataset (files dealt)", n, measure(args, "hf-dataset", n)))
        rows.append(("hf.fit R=N, dataset function", n, measure(args, "hf-function", n)))
        rows.append(("hf.fit R=N, PyDataset (readers in turn)", n,
                     measure(args, "hf-pydataset", n)))
        if n % 2 == 0:
            rows.append(("hf.fit S=2 M=2, dataset", n, measure(args, "hf-stages-dataset", n)))
    keras = rows[0][2]["samples_s"]
    print(f"\n{args.images} JPEGs {args.size}px in {args.files} files -> {args.crop}px, "
          f"batch {args.batch}, {os.cpu_count()} cores\n")
    print(f"| run | ranks | samples/s | x Keras (pipeline) | wait on rank 0 |")
    print("|---|---:|---:|---:|---:|")
    for name, n, res in rows:
        wait = "" if res["wait"] is None else f"{res['wait']:.0%}"
        print(f"| {name} | {n or 1} | {res['samples_s']:.0f} | "
              f"{res['samples_s'] / keras:.2f}x | {wait} |")


if __name__ == "__main__":
    main()
