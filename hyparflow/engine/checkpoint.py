"""Distributed checkpoints: each stage writes its own variables; loading is by name.

A checkpoint is a directory `ckpt-<global step>` holding one `stage-<s>.npz` per
stage (written by that stage's replica-0 rank: its variables and the optimizer
slots built for them, keyed by the variable's path, so any other partition can
load them), `model.json` (the architecture, for `hyparflow export`) and
`manifest.json`, written last, with the position in training, the plan, and a
SHA-256 of every file. It is written into a temporary directory that is renamed
into place only when complete, then `LATEST` is replaced (temp file + rename):
a crash at any point leaves the previous checkpoint valid. Nothing is pickled:
arrays are read with `allow_pickle=False`, metadata is JSON.
"""

import hashlib
import json
import os
import shutil
import signal
import uuid

import numpy as np

__all__ = ["CheckpointError", "Checkpointer", "latest_valid", "read", "restore_model",
           "replica_weights",
           "list_checkpoints", "PREEMPTED_EXIT_CODE", "Preempted", "StopFlag", "export"]

FORMAT = "hyparflow-checkpoint"
VERSION = 1
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", what a requeued job should see


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, or of another model."""


class Preempted(SystemExit):
    """Training stopped on a signal after writing a checkpoint; exits with code 75."""

    def __init__(self, message):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self):
        return self.message


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (what Slurm sends before a time limit with --signal)."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.raised = None
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (in-process test ranks)
                pass

    def _handle(self, signum, frame):
        self.raised = signal.Signals(signum).name

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def variable_names(model):
    """Model variable -> its key: the position in `model.weights`.

    Positions, not Keras paths: paths carry automatic layer names (`dense_20`)
    that differ between two builds of the same model in one process, while the
    order of `model.weights` is the model's structure, the same for any number
    of stages. The manifest keeps the paths and shapes to explain a mismatch."""
    return [f"{i:05d}" for i in range(len(model.weights))]


def slot_names(optimizer, model):
    """Optimizer variable -> key: `slot/<variable position>/<slot>` for per-variable
    state, `optimizer/<name>` for the rest (iterations, learning rate, ...)."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", key)
                       for v, key in zip(model.weights, variable_names(model))),
                      key=lambda p: -len(p[0]))
    out = []
    for var in optimizer.variables:
        name = var.name
        for prefix, key in prefixes:
            if name.startswith(prefix):
                out.append(f"slot/{key}/{name[len(prefix):]}")
                break
        else:
            out.append(f"optimizer/{name}")
    return out


def list_checkpoints(directory):
    if not os.path.isdir(directory):
        return []
    found = []
    for entry in os.listdir(directory):
        if entry.startswith("ckpt-") and entry[5:].isdigit():
            found.append((int(entry[5:]), os.path.join(directory, entry)))
    return [path for _, path in sorted(found)]


def read(path, verify=True):
    """The manifest of checkpoint `path`, after checking its files; CheckpointError if unusable."""
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no manifest.json.")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} cannot be read: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not a hyparflow checkpoint of version {VERSION}.")
    if verify:
        for name, digest in manifest["files"].items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise CheckpointError(f"{path} is missing {name}.")
            if _sha256(file) != digest:
                raise CheckpointError(f"{file} is corrupt or truncated (its SHA-256 differs "
                                      "from the manifest's).")
    return manifest


def latest_valid(directory, warn=print):
    """(path, manifest) of the newest checkpoint that verifies, or (None, None).
    Newer checkpoints that do not verify are reported and skipped."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, read(path)
        except CheckpointError as exc:
            if warn:
                warn(f"hyparflow: skipping checkpoint: {exc}")
    return None, None


def _load_arrays(path, manifest, replica=None):
    """Every array of the checkpoint's main files, and those of `replica`'s own files
    (replicas that stepped on their own, `replica-<r>-stage-<s>.npz`) if given."""
    arrays = {}
    for name in manifest["files"]:
        if name.startswith("replica-") and not (
                replica is not None and name.startswith(f"replica-{replica}-")):
            continue
        if name.endswith(".npz"):
            try:
                # allow_pickle=False: a checkpoint from anywhere can never run code.
                with np.load(os.path.join(path, name), allow_pickle=False) as npz:
                    for key in npz.files:
                        arrays[key] = npz[key]
            except (ValueError, OSError, EOFError) as exc:
                raise CheckpointError(f"{os.path.join(path, name)} cannot be loaded safely: "
                                      f"{exc}") from None
    return arrays


def replica_weights(manifest, num_replicas):
    """Whether checkpoint `manifest` holds each of `num_replicas` replicas' own weights
    (written by replicas that step on their own, with as many replicas)."""
    info = manifest.get("replicas")
    return bool(info) and info.get("num_replicas") == num_replicas


def restore_model(model, path, manifest=None, optimizer=True, parts=None, replica=None):
    """Load checkpoint `path` into `model` (and the optimizer slots of the variables
    it has), by name: any partition can load any checkpoint of the same model.
    `parts`: {id(optimizer variable): function} giving the part of a whole saved
    slot that a slot of a split layer's part takes (tensor parallelism).
    `replica`: load that replica's own weights and optimizer state where the
    checkpoint has them (`replica_weights`), else the agreed model's."""
    manifest = manifest or read(path)
    arrays = _load_arrays(path, manifest, replica)
    if replica is not None:
        # A replica's own arrays stand in for the agreed model's, key by key.
        prefix = f"replica/{replica}/"
        arrays.update({key[len(prefix):]: value for key, value in arrays.items()
                       if key.startswith(prefix)})
    names = variable_names(model)
    saved = manifest.get("variables", [])
    problems = []
    if len(saved) != len(names):
        problems.append(f"{len(saved)} variables in the checkpoint, {len(names)} in the model")
    for v, name, info in zip(model.weights, names, saved):
        key = f"model/{name}"
        if key not in arrays:
            problems.append(f"missing {info['path']}")
        elif tuple(arrays[key].shape) != tuple(v.shape):
            problems.append(f"{v.path}: shape {tuple(v.shape)} in the model, "
                            f"{tuple(arrays[key].shape)} for {info['path']} in the checkpoint")
    if problems:
        raise CheckpointError(
            f"Checkpoint {path} is not of this model ({len(problems)} differences: "
            + "; ".join(problems[:6]) + "). Resume with the model that wrote it, or another "
            "checkpoint_dir.")
    for v, name in zip(model.weights, names):
        v.assign(arrays[f"model/{name}"])
    if optimizer and getattr(model, "optimizer", None) is not None and model.optimizer.built:
        for var, name in zip(model.optimizer.variables, slot_names(model.optimizer, model)):
            if name not in arrays:
                continue
            value = arrays[name]
            if parts and id(var) in parts:
                value = parts[id(var)](value)
            if tuple(value.shape) == tuple(var.shape):
                var.assign(value)
    return manifest


class Checkpointer:
    """Writes checkpoints of a running fit; one per `every` steps or per epoch."""

    def __init__(self, directory, every="epoch", keep=3):
        if every != "epoch" and (not isinstance(every, int) or every < 1):
            raise ValueError("`checkpoint_every` must be 'epoch' or a number of steps >= 1. "
                             f"Received: checkpoint_every={every!r}")
        if keep is not None and keep < 1:
            raise ValueError(f"`keep` must be >= 1 or None. Received: keep={keep}")
        self.directory, self.every, self.keep = directory, every, keep

    def due(self, global_step, epoch_end):
        if self.every == "epoch":
            return epoch_end
        return not epoch_end and global_step % self.every == 0

    def write(self, runtime, position):
        """Collective: every rank calls it. Replica 0 of each stage writes its part.
        Replicas that step on their own (`runtime.replicas`) each write their own
        weights and optimizer state too (`replica-<r>-stage-<s>.npz`), and the main
        files hold their agreed model: the global leader's (its ranks write them) or
        the replicas' mean (written by replica 0, with replica 0's optimizer state)."""
        comm, model = runtime.comm, runtime.model
        replicas = getattr(runtime, "replicas", None)
        if replicas is None:
            runtime.average_state()
        runtime.gather_shards()  # split layers: every part, whole, into the model's variables
        whole = runtime.full_slots()
        s = runtime.topo.stage(comm.rank)
        owned_vars = [v for v in model.weights if runtime.owner_stage(v) == s]
        writer, values = (0, None) if replicas is None else replicas.checkpoint_source(owned_vars)
        # Optimizer state sharded over the replicas (hyparflow.zero), put together.
        sharded = runtime.zero_slots()
        name = f"ckpt-{position['global_step']:09d}"
        final = os.path.join(self.directory, name)
        tmp = comm.bcast_obj(os.path.join(self.directory, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
                             if comm.rank == 0 else None, 0)
        error = None
        if comm.rank == 0:
            try:
                os.makedirs(tmp)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = comm.bcast_obj(error, 0)
        if error:
            raise CheckpointError(f"Cannot write checkpoints into {self.directory}: {error}")
        files = {}
        try:
            r = runtime.topo.replica(comm.rank)
            if runtime.topo.tensor(comm.rank) == 0 and (r == writer or replicas is not None):
                arrays = self._arrays(runtime, s, whole, sharded)
                if r == writer:
                    file = f"stage-{s}.npz"
                    agreed = dict(arrays)
                    if values is not None:  # the replicas' mean, not this replica's own
                        agreed.update({f"model/{n}": values[id(v)]
                                       for v, n in zip(model.weights, variable_names(model))
                                       if id(v) in values})
                    np.savez(os.path.join(tmp, file), **agreed)
                    files[file] = _sha256(os.path.join(tmp, file))
                if replicas is not None:
                    file = f"replica-{r}-stage-{s}.npz"
                    np.savez(os.path.join(tmp, file),
                             **{f"replica/{r}/{key}": value for key, value in arrays.items()})
                    files[file] = _sha256(os.path.join(tmp, file))
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        everyone = comm.allgather_obj((files, error))
        errors = [e for _, e in everyone if e]  # the same list on every rank
        if replicas is not None:
            position = dict(position, replicas={
                "method": replicas.method.describe(), "num_replicas": replicas.num_replicas,
                "agreed": (f"replica {writer}'s (the global leader)" if values is None
                           else "the replicas' mean")})
        if not errors and comm.rank == 0:
            try:
                self._finish(runtime, tmp, final, name, position,
                             {k: v for f, _ in everyone for k, v in f.items()})
            except OSError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        if errors and comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # before telling the others
        errors = comm.bcast_obj(errors, 0)
        if errors:
            previous = list_checkpoints(self.directory)
            raise CheckpointError(
                f"Writing checkpoint {final} failed: {errors[0]}. Nothing was replaced: "
                + (f"the previous checkpoint {previous[-1]} is intact." if previous else
                   "there is no earlier checkpoint."))
        return final

    @staticmethod
    def _arrays(runtime, s, whole, sharded):
        """{key: value} of stage `s`'s variables and their optimizer state, as this
        rank holds them."""
        model = runtime.model
        arrays = {}
        names = variable_names(model)
        for v, n in zip(model.weights, names):
            if runtime.owner_stage(v) == s:
                # A sharded table dropped while fit trains: gathered (`full_slots`).
                arrays[f"model/{n}"] = whole[id(v)] if id(v) in whole else np.asarray(v.numpy())
        opt = model.optimizer
        owned = {n for v, n in zip(model.weights, names) if runtime.owner_stage(v) == s}
        for var, n in zip(opt.variables, slot_names(opt, model)):
            if (n.startswith("slot/") and n[5:].rsplit("/", 1)[0] in owned) or (
                    n.startswith("optimizer/") and s == 0):
                arrays[n] = whole[id(var)] if id(var) in whole else np.asarray(var.numpy())
        arrays.update({n: value for n, value in sharded.items()
                       if n[5:].rsplit("/", 1)[0] in owned})
        return arrays

    def _finish(self, runtime, tmp, final, name, position, files):
        """Rank 0: architecture and manifest (last), rename into place, LATEST, rotate."""
        model = runtime.model
        with open(os.path.join(tmp, "model.json"), "w") as f:
            f.write(model.to_json())
        files["model.json"] = _sha256(os.path.join(tmp, "model.json"))
        manifest = {"format": FORMAT, "version": VERSION, "files": files,
                    "variables": [{"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)}
                                  for v in model.weights],
                    "layout": {**runtime.layout.kept(runtime.executor.chosen).record(),
                               "counts": list(runtime.part.counts)},
                    **position}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest = os.path.join(self.directory, "LATEST")
        with open(latest + ".tmp", "w") as f:
            f.write(name + "\n")
        os.replace(latest + ".tmp", latest)
        self._rotate()

    def _rotate(self):
        if self.keep is None:
            return
        for path in list_checkpoints(self.directory)[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for entry in os.listdir(self.directory):
            if entry.startswith(".ckpt-") and ".tmp-" in entry:
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)


def export(directory: str, output: str) -> str:
    """Write the newest valid checkpoint in `directory` (or a checkpoint path) as a
    normal `.keras` model file; returns the checkpoint used. Custom layers must be
    registered (imported) first, as for `keras.saving.load_model`."""
    import keras

    if not os.path.isdir(directory):
        raise CheckpointError(f"No such checkpoint directory: {directory}")
    if os.path.isfile(os.path.join(directory, "manifest.json")):
        path, manifest = directory, read(directory)
    else:
        path, manifest = latest_valid(directory)
    if path is None:
        raise CheckpointError(f"{directory} holds no valid checkpoint.")
    with open(os.path.join(path, "model.json")) as f:
        model = keras.models.model_from_json(f.read())
    restore_model(model, path, manifest, optimizer=False)
    model.save(output)
    return path
