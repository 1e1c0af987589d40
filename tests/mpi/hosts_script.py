"""A run across hosts, started by tests/hosts/test_hosts_emulated.py with `hyparflow run --hosts`.

    python hosts_script.py contract OUTDIR   # fit (S, R, M from hyparflow run) against model.fit
    python hosts_script.py long MARKER       # train until stopped; MARKER.K once an epoch is done
    python hosts_script.py busy MARKER       # as long, but tracing holds the GIL for 8 s
    python hosts_script.py pause SECONDS     # fit, then rank 0 alone busy SECONDS, then fit again
    python hosts_script.py resumable OUTDIR  # fit with checkpoints and resume=True (restarts)
    python hosts_script.py tables OUTDIR     # "table-row" tables against model.fit
    python hosts_script.py sums OUTDIR       # replicas' sums through each host's window

`contract`: every rank writes OUTDIR/rank-K.json with its host, its threads, the largest
weight difference from plain `model.fit` (Adam) and, per step, how many gradient buckets
started inside the backward (the trace).
"""

import json
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kinds"))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from hyparflow import _env
from hyparflow.engine import overlap  # noqa: E402

import models  # noqa: E402

MODE, TARGET = sys.argv[1], sys.argv[2]
if MODE in ("contract", "tables", "sums"):
    os.makedirs(TARGET, exist_ok=True)


def contract():
    # Buckets of a few hundred bytes: one per layer, so some start while earlier layers
    # are still in backward (when the buckets start early, which is the default across hosts).
    overlap.BUCKET_BYTES = 600
    x, y = models.mlp_data()
    reference = models.mlp("adam")
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = models.mlp("adam")
    model.set_weights(start)
    trace = os.path.join(TARGET, "run.json")
    hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, trace=trace)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(),
                                                          reference.get_weights()))
    report = {"rank": hf.rank(), "host": socket.gethostname(), "diff": diff,
              "local_ranks": _env.local_ranks(), "threads": _env.threads_per_rank(),
              "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
              "cores": os.cpu_count()}
    with open(os.path.join(TARGET, f"rank-{hf.rank()}.json"), "w") as f:
        json.dump(report, f)


HOLD = {"armed": False}


class SlowTrace(keras.layers.Layer):
    """Identity, whose first tracing in fit holds Python's GIL for 8 s: a long C++ call
    (a big graph built or compiled) as the heartbeat thread meets it. libc's sleep
    through ctypes' PyDLL keeps the GIL (a plain CDLL call would release it)."""

    def call(self, x):
        if HOLD["armed"]:
            import ctypes

            HOLD["armed"] = False
            ctypes.PyDLL(None).usleep(8_000_000)
        return x


class Arm(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        HOLD["armed"] = True    # the heartbeat runs: the first step's tracing holds the GIL


def long(busy=False):
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    if busy:
        h = SlowTrace()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(2)(h))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    y = np.zeros((256, 2), "float32")

    class Mark(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                with open(f"{TARGET}.{hf.rank()}", "w") as f:
                    f.write(f"{socket.gethostname()} {os.getpid()}")

    hf.fit(model, x, y, batch_size=32, epochs=100000, verbose=0,
           callbacks=[Mark()] + ([Arm()] if busy else []))
    print("finished without a failure", flush=True)


def pause():
    """Silence outside fit is no loss: rank 0 works alone for longer than the peer timeout
    between two fits (the others wait in the second fit's set-up), and again after the
    last fit while the others have finished."""
    import time

    x, y = models.mlp_data(64)
    model = models.mlp()
    hf.fit(model, x, y, batch_size=16, epochs=1, verbose=0)
    if hf.rank() == 0:
        time.sleep(float(TARGET))
    hf.fit(model, x, y, batch_size=16, epochs=1, verbose=0)
    print(f"rank {hf.rank()} finished both fits", flush=True)
    if hf.rank() == 0:
        time.sleep(float(TARGET))
        print("rank 0 finished its own work", flush=True)


def resumable_model():
    keras.utils.set_random_seed(3)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    h = keras.layers.Dense(32, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def resumable():
    """Adam, checkpoints every 2 steps, resume=True, the layout from `hyparflow run`; slow
    steps (OUTDIR/step-K: the rank's step; OUTDIR/host-K: its host) so that a host can be
    lost mid-run. Rank 0 of
    the run that finishes writes OUTDIR/result.json: its layout and host, the checkpoint
    it resumed from, and the largest difference of its weights from plain `model.fit`
    continued from that checkpoint (its weights and Adam's state) over the same batches."""
    import time

    from hyparflow.engine import checkpoint

    os.makedirs(TARGET, exist_ok=True)
    with open(os.path.join(TARGET, f"host-{hf.rank()}"), "w") as f:
        f.write(socket.gethostname())
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = rng.integers(0, 3, 256)
    batch, epochs = 32, 4
    ckpt = os.path.join(TARGET, "ckpt")
    resumed = checkpoint.latest_valid(ckpt, warn=None)[0] if os.path.isdir(ckpt) else None

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            time.sleep(0.3)
            with open(os.path.join(TARGET, f"step-{hf.rank()}"), "w") as f:
                f.write(str(int(self.model.optimizer.iterations.numpy())))

    model = resumable_model()
    hf.fit(model, x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
           callbacks=[Slow()], checkpoint_dir=ckpt, checkpoint_every=2, keep=None, resume=True)
    if not hf.is_main():
        return
    result = {"host": socket.gethostname(), "ranks": hf.size(),
              "stages": int(os.environ.get("HYPARFLOW_NUM_STAGES", "1")), "resumed": resumed}
    if resumed:
        reference = resumable_model()
        reference.optimizer.build(reference.trainable_variables)
        manifest = checkpoint.restore_model(reference, resumed)
        epoch, step = manifest["epoch"], manifest["step"]
        result.update(epoch=epoch, step=step, iterations_at_resume=int(
            reference.optimizer.iterations.numpy()))
        if step:
            reference.fit(x[step * batch:], y[step * batch:], batch_size=batch, epochs=1,
                          shuffle=False, verbose=0)
            epoch += 1
        if epochs - epoch:
            reference.fit(x, y, batch_size=batch, epochs=epochs - epoch, shuffle=False, verbose=0)
        result["diff"] = max(float(np.abs(a - b).max()) for a, b in zip(
            model.get_weights(), reference.get_weights()))
        result["iterations"] = [int(model.optimizer.iterations.numpy()),
                                int(reference.optimizer.iterations.numpy())]
    with open(os.path.join(TARGET, "result.json"), "w") as f:
        json.dump(result, f)
    print(f"result: {result}", flush=True)


def tables():
    """"table-row" tables (rows of 768 values, bags of 8 ids: messages past 64 KB, the
    pooled ones one vector per sample: 32 x 768 x 4 bytes) and a
    row-wise one, SGD, against model.fit; every rank writes OUTDIR/rank-K.json with its
    host, the weight difference, the rows it held of each table and its largest message."""
    from test_tables import tables_data, tables_model

    rows = {"user": 64, "item": 300, "cat": 12}
    build = lambda: tables_model("sgd", dim=768, bag=8, rows=rows)  # noqa: E731
    x, y = tables_data(n=256, bag=8, rows=rows)
    reference = build()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0)
    model = build()
    model.set_weights(start)
    held = {}

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            for name in rows:
                part = model.get_layer(name).__dict__["_hyparflow_table_part"]
                held[name] = int(part.variable.shape[0])
            held["largest"] = part.router.largest

    hf.fit(model, x, y, batch_size=128, epochs=2, shuffle=False, verbose=0,
           embedding_sharding={"user": "table-row", "item": "table-row", "cat": "row"},
           callbacks=[Look()])
    diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(),
                                                          reference.get_weights()))
    report = {"rank": hf.rank(), "host": socket.gethostname(), "diff": diff,
              "rows": {n: held[n] for n in rows}, "largest": held["largest"]}
    with open(os.path.join(TARGET, f"rank-{hf.rank()}.json"), "w") as f:
        json.dump(report, f)


def sums():
    """Replicas only, by default settings: gradients of 64 KB and more are summed in each
    host's shared window, then only slices cross (engine/shm.py), Adam, against
    model.fit. Every rank writes OUTDIR/rank-K.json with its host, the weight
    difference, the pieces it summed through a window and its weights' bytes' hash."""
    import hashlib

    from hyparflow.engine import shm

    def build():
        keras.utils.set_random_seed(3)
        inp = keras.Input((64,))
        h = keras.layers.Dense(512, activation="relu")(inp)   # a 128 KB kernel
        h = keras.layers.Dense(128, activation="relu")(h)
        model = keras.Model(inp, keras.layers.Dense(4)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        return model

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(128, 64)).astype("float32"), rng.normal(size=(128, 4)).astype("float32")
    reference = build()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = build()
    before = shm.used()
    hf.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    weights = model.get_weights()
    diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, reference.get_weights()))
    report = {"rank": hf.rank(), "host": socket.gethostname(), "diff": diff,
              "pieces": shm.used() - before,
              "hash": hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()}
    with open(os.path.join(TARGET, f"rank-{hf.rank()}.json"), "w") as f:
        json.dump(report, f)


{"contract": contract, "tables": tables, "long": long, "busy": lambda: long(busy=True), "pause": pause,
 "resumable": resumable, "sums": sums}[MODE]()
