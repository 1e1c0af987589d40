"""TFRecord files of a small tabular data set, and the pipelines users build on them;
every decode is counted (record ids, per process) to check who reads what."""

import os

import numpy as np
import tensorflow as tf

FEATURES = 6
DECODED = []   # ids of the records this process decoded


def write(directory, files=4, per_file=24, seed=0):
    """`files` TFRecord files of `per_file` records (id, x, y, w); their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for f in range(files):
        path = os.path.join(str(directory), f"part-{f:02d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(per_file):
                feature = {
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[f * per_file + i])),
                    "x": tf.train.Feature(float_list=tf.train.FloatList(
                        value=rng.normal(size=FEATURES).astype(np.float32))),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[int(rng.integers(0, 3))])),
                    "w": tf.train.Feature(float_list=tf.train.FloatList(
                        value=[float(rng.uniform(0.5, 2.0))])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())
        paths.append(path)
    return paths


def written_once(comm, tmp_path_factory, files=4):
    """Under MPI: the files written by rank 0 in a directory every rank is told; their
    paths, on every rank once they exist."""
    where = comm.bcast(str(tmp_path_factory.mktemp("records")) if comm.rank == 0 else None, 0)
    if comm.rank == 0:
        write(where, files=files)
    comm.Barrier()
    return sorted(os.path.join(where, f) for f in os.listdir(where))


def _count(ids):
    DECODED.extend(int(i) for i in np.ravel(ids))
    return ids


def decode(record):
    """One record to (x, y, w), counting the decode."""
    parsed = tf.io.parse_single_example(record, {
        "id": tf.io.FixedLenFeature([], tf.int64),
        "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
        "w": tf.io.FixedLenFeature([], tf.float32)})
    ident = tf.numpy_function(_count, [parsed["id"]], tf.int64)
    x = parsed["x"] + tf.cast(ident, tf.float32) * 0.0   # the count runs with the decode
    return x, parsed["y"], parsed["w"]


def pipeline(paths, batch):
    """The user's pipeline: files read in order, decoded, batched."""
    return tf.data.TFRecordDataset(paths).map(decode).batch(batch)


def replica_batches(paths, batch, replicas):
    """Replica r reads files r, r + R, ... in batches of its share: what a dataset
    function `files[ctx.input_pipeline_id::ctx.num_input_pipelines]` gives."""
    from hyparflow.readers.context import per_replica

    return [list(pipeline(paths[r::replicas], per_replica(batch, replicas, r)).as_numpy_iterator())
            for r in range(replicas)]


def global_batches(parts):
    """The replicas' batches of each step put together, in replica order."""
    steps = max(len(p) for p in parts)
    out = []
    for s in range(steps):
        mine = [p[s] for p in parts if s < len(p)]
        out.append(tuple(np.concatenate([m[k] for m in mine]) for k in range(3)))
    return out


def parse(record):
    """One record to (x, y, w), uncounted: a pipeline a worker in another process runs
    (a numpy_function lives only in the process that made it)."""
    parsed = tf.io.parse_single_example(record, {
        "id": tf.io.FixedLenFeature([], tf.int64),
        "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
        "w": tf.io.FixedLenFeature([], tf.float32)})
    return parsed["x"], parsed["y"], parsed["w"]


def by_files_uncounted(paths):
    """A dataset function: replica r reads files r, r + R, ..., decoded uncounted."""
    def fn(ctx):
        mine = paths[ctx.input_pipeline_id::ctx.num_input_pipelines]
        return tf.data.TFRecordDataset(mine).map(parse).batch(ctx.per_replica_batch_size)
    return fn


def data_service(*args, timeout=90):
    """`hyparflow data-service ARGS` started as a process of its own (without the MPI
    launcher's variables, which would make it a rank): (process, the address it printed)."""
    import subprocess
    import sys
    import threading

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "MPI_", "OMPI_", "HYDRA_", "MPIR_"))}
    process = subprocess.Popen([sys.executable, "-m", "hyparflow", "data-service", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=env)
    timer = threading.Timer(timeout, process.kill)   # no line: no hang
    timer.start()
    try:
        line = process.stdout.readline()
    finally:
        timer.cancel()
    if "hyparflow data-service:" not in line:
        process.kill()
        raise RuntimeError(f"hyparflow data-service {' '.join(args)} printed {line!r}")
    return process, line.split()[3]
