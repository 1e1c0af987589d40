"""The training loop: data slicing, epochs, global metrics, callbacks and history."""

import math
import sys
import traceback

import keras
import numpy as np

from . import _compat
from . import graph as _graph
from . import partition as _partition
from . import weights
from .comm import timeout_seconds
from .executor import Executor, split_batch
from .stage import Stage
from .timeline import Timeline
from .topology import Topology

__all__ = ["train", "Data", "prepare_data"]


class Data:
    """Inputs as a flat list in the model's input order, targets as a flat list in
    its output order, optional per-sample weights; all numpy, sliced by index."""

    def __init__(self, x, y, sample_weight):
        self.x, self.y, self.sample_weight = x, y, sample_weight

    def __len__(self):
        return len(self.x[0])


def _leaves(value, names, what):
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ValueError(
                f"`{what}` is a dict but has no entry for {missing}; its keys must be the "
                f"model's {what == 'x' and 'input' or 'output'} names {names}. "
                f"Received keys: {sorted(value)}"
            )
        return [value[n] for n in names]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def prepare_data(graph, x, y, sample_weight=None, class_weight=None):
    """Check and normalise user data (numpy arrays, lists or dicts of them)."""
    if x is None:
        raise ValueError("`x` is required. Received: x=None")
    xs = [np.asarray(a) for a in _leaves(x, graph.input_names, "x")]
    if graph.functional is not None and len(xs) != len(graph.inputs):
        raise ValueError(
            f"The model has {len(graph.inputs)} inputs {graph.input_names} but `x` holds "
            f"{len(xs)} arrays. Pass one array per input (a list, or a dict by input name)."
        )
    if graph.functional is not None:
        xs = [a.astype(graph.tensors[t].dtype, copy=False) if graph.tensors[t].dtype != "bfloat16" else a
              for a, t in zip(xs, graph.inputs)]
    if y is None:
        raise ValueError("`y` is required for training (targets for the compiled loss). Received: y=None")
    ys = [np.asarray(a) for a in _leaves(y, graph.output_names, "y")]
    if graph.functional is not None and len(ys) != len(graph.outputs):
        raise ValueError(
            f"The model has {len(graph.outputs)} outputs {graph.output_names} but `y` holds "
            f"{len(ys)} arrays. Pass one target array per output (a list, or a dict by output name)."
        )
    n = len(xs[0])
    lengths = {f"x[{i}]": len(a) for i, a in enumerate(xs)}
    lengths.update({f"y[{i}]": len(a) for i, a in enumerate(ys)})
    sw = None
    if class_weight is not None:
        if len(ys) != 1:
            raise ValueError("`class_weight` is only supported for models with one output; "
                             "use `sample_weight` for several outputs.")
        labels = ys[0]
        labels = labels.argmax(-1) if labels.ndim > 1 and labels.shape[-1] > 1 else labels.reshape(len(labels), -1)[:, 0]
        sw = np.array([class_weight.get(int(c), 1.0) for c in labels], np.float32)
    if sample_weight is not None:
        sample_weight = np.asarray(sample_weight, np.float32).reshape(-1)
        lengths["sample_weight"] = len(sample_weight)
        sw = sample_weight if sw is None else sw * sample_weight
    if len(set(lengths.values())) != 1:
        raise ValueError(
            "`x`, `y` (and `sample_weight`) must have the same number of samples. "
            f"Received lengths: {lengths}"
        )
    if n == 0:
        raise ValueError("No samples to train on: `x` is empty.")
    return Data(xs, ys, sw)


def _resolve_verbose(verbose):
    if verbose == "auto":
        return 1
    if verbose not in (0, 1, 2):
        raise ValueError(f"`verbose` must be 0, 1, 2 or 'auto'. Received: verbose={verbose!r}")
    return verbose


class _Logs:
    """Global loss and metrics, summed exactly over ranks.

    The metrics' state variables (totals, counts, confusion matrices) are
    summed over all ranks (only the last stage updates them; other ranks add
    zeros), so every rank computes the same `result()` as one process would."""

    def __init__(self, model, comm):
        self.model, self.comm = model, comm
        tracker = _compat.loss_tracker(model)
        self.metrics = [m for m in model.metrics if m is not tracker]
        self.variables = [v for m in self.metrics for v in m.variables]
        self.reset()

    def reset(self):
        for m in self.metrics:
            m.reset_state()
        self.loss_sum, self.count = 0.0, 0

    def add(self, contribution, batch_size):
        self.loss_sum += contribution * batch_size
        self.count += batch_size

    def result(self):
        local = [np.asarray(v.numpy(), np.float64) for v in self.variables]
        flat = weights.pack(local + [np.array([self.loss_sum])], np.float64)
        self.comm.allreduce(flat, timeout_seconds())
        summed = weights.unpack(flat, self.variables)
        for v, s in zip(self.variables, summed):
            v.assign(s.astype(v.dtype))
        logs = {"loss": float(flat[-1] / max(1, self.count))}
        for m in self.metrics:
            r = m.result()
            if isinstance(r, dict):
                logs.update({k: float(np.asarray(val)) for k, val in r.items()})
            else:
                logs[m.name] = float(np.asarray(r))
        for v, a in zip(self.variables, local):
            v.assign(a.astype(v.dtype))
        return logs


def _build_compiled(model, graph, data):
    """Create the compiled loss's and metrics' state on every rank, symbolically
    (as Keras's own fit does), without building the optimizer for all variables."""
    x_sym = [_compat.symbolic((None,) + a.shape[1:], a.dtype) for a in data.x]
    y_sym = [_compat.symbolic((None,) + a.shape[1:], a.dtype) for a in data.y]
    sw_sym = _compat.symbolic((None,), "float32") if data.sample_weight is not None else None
    if graph.functional is not None:
        x_arg = _compat.tree.pack_sequence_as(_compat.input_structure(graph.functional), x_sym)
    else:
        x_arg = x_sym[0] if len(x_sym) == 1 else x_sym
    y_pred = _compat.compute_output_spec(model, x_arg, training=False)
    y_true = _compat.pack_outputs(graph.functional, y_sym) if graph.functional is not None else (
        y_sym[0] if len(y_sym) == 1 else y_sym)
    loss = _compat.compile_loss(model)
    if loss is not None and not loss.built:
        _compat.compute_output_spec(lambda a, b, c: loss(a, b, c), y_true, y_pred, sw_sym)
    metrics = _compat.compile_metrics(model)
    if metrics is not None and not metrics.built:
        _compat.compute_output_spec(lambda a, b, c: metrics.update_state(a, b, sample_weight=c),
                                    y_true, y_pred, sw_sym)


def _check_agreement(comm, facts):
    """All ranks must run the same model on the same data shape with the same
    settings; a mismatch would otherwise hang or silently mix models."""
    everyone = comm.allgather_obj(facts)
    for r, other in enumerate(everyone):
        if other != facts:
            diff = {k: (facts[k], other.get(k)) for k in facts if facts[k] != other.get(k)}
            raise ValueError(
                f"Ranks disagree on the training set-up: rank {comm.rank} vs rank {r}: {diff} "
                "(values as (this rank, that rank)). Every rank must build the same model and "
                "pass the same data and arguments to hyparflow.fit."
            )


def _agree_on_error(comm, error):
    """Raise on every rank if set-up failed on any rank (so none waits for the others)."""
    errors = comm.allgather_obj(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for r, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"hyparflow.fit set-up failed on rank {r}: {e[0]}: {e[1]}")


def _make_groups(comm, topo, part, stage, model_variables):
    """One communicator per set of stages sharing variables (normally one stage):
    every rank joins each split, in the same sorted order. Returns
    {stage set: (communicator or None, positions in stage.trainable)}."""
    s = topo.stage(comm.rank)
    index_of = {id(v): k for k, v in enumerate(stage.trainable)}
    # Pack variables in the model's order, which every stage of a group shares.
    order = {id(v): k for k, v in enumerate(model_variables)}
    groups = {}
    for key in sorted(set(part.users.values())):
        color = 0 if s in key else None
        sub = comm.split(color, comm.rank) if topo.size > 1 else None
        if color is None:
            continue
        positions = sorted((index_of[vid] for vid, users in part.users.items()
                            if users == key and vid in index_of),
                           key=lambda k: order[id(stage.trainable[k])])
        groups[key] = (sub, positions)
    return groups


def train(model, x, y, *, comm, batch_size, epochs, num_stages, num_replicas,
          num_microbatches, shuffle, seed, verbose, callbacks, balance,
          sample_weight=None, class_weight=None, schedule="gpipe", run_eagerly=None,
          recompute=False, trace=None):
    """The body of `hyparflow.fit` for one rank (see its docstring)."""
    where = {"rank": comm.rank, "action": "set-up"}
    error, setup = None, None
    try:
        setup = _setup(model, x, y, comm, batch_size, epochs, num_stages, num_replicas,
                       num_microbatches, seed, verbose, balance, sample_weight, class_weight,
                       schedule, run_eagerly, recompute, trace)
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    _agree_on_error(comm, error)
    try:
        return _loop(model, setup, comm, batch_size, epochs, shuffle, callbacks, where)
    except BaseException as exc:
        _fail(comm, setup, exc)
        raise


def _fail(comm, setup, exc):
    """End every rank with this rank's error: print it once, here, then abort."""
    if comm.size == 1:
        return
    topo = setup["topo"]
    position = setup["executor"].position
    sys.stderr.write(
        f"hyparflow: rank {comm.rank} (stage {topo.stage(comm.rank)}, replica "
        f"{topo.replica(comm.rank)}) failed at {position}: {type(exc).__name__}: {exc}\n"
        + "".join(traceback.format_exception(exc)) + "hyparflow: aborting all ranks.\n"
    )
    sys.stderr.flush()
    comm.abort(1)


def _setup(model, x, y, comm, batch_size, epochs, num_stages, num_replicas,
           num_microbatches, seed, verbose, balance, sample_weight, class_weight,
           schedule, run_eagerly, recompute, trace):
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model={type(model).__name__}")
    if not _compat.is_compiled(model):
        raise ValueError(
            f"Model {model.name!r} is not compiled: call model.compile(optimizer=..., loss=...) "
            "before hyparflow.fit, as before model.fit."
        )
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("batch_size", batch_size), ("epochs", epochs)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    if num_replicas is None:
        if comm.size % num_stages:
            raise ValueError(
                f"The world has {comm.size} ranks, which num_stages={num_stages} does not "
                f"divide. Launch a multiple of {num_stages} ranks (e.g. mpiexec -n "
                f"{num_stages * max(1, comm.size // num_stages)}) or change num_stages."
            )
        num_replicas = comm.size // num_stages
    if num_stages * num_replicas != comm.size:
        raise ValueError(
            f"num_stages x num_replicas = {num_stages} x {num_replicas} = "
            f"{num_stages * num_replicas} ranks, but {comm.size} were launched. Launch "
            f"mpiexec -n {num_stages * num_replicas}, or pass num_replicas={comm.size // num_stages}"
            f" (or None)." if comm.size % num_stages == 0 else
            f"num_stages x num_replicas = {num_stages} x {num_replicas} = "
            f"{num_stages * num_replicas} ranks, but {comm.size} were launched. Launch "
            f"mpiexec -n {num_stages * num_replicas}."
        )
    if batch_size < num_replicas * num_microbatches:
        raise ValueError(
            f"batch_size={batch_size} is smaller than num_replicas x num_microbatches = "
            f"{num_replicas} x {num_microbatches} = {num_replicas * num_microbatches}: some "
            "microbatch would be empty. Raise batch_size or lower num_microbatches."
        )
    verbose = _resolve_verbose(verbose)
    from .schedule import SCHEDULES

    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}. "
                         f"Received: schedule={schedule!r}")
    x_leaves = [np.asarray(a) for a in (_leaves(x, [], "x") if not isinstance(x, dict) else list(x.values()))]
    graph = _graph.from_model(model, [a.shape for a in x_leaves])
    if graph.functional is None and num_stages > 1:
        raise ValueError(
            f"Model {model.name!r} is a subclassed keras.Model whose `call` hyparflow cannot "
            f"read, so it cannot be cut into stages (num_stages={num_stages}). Train it with "
            "num_stages=1 (data parallel, any num_replicas), or build it with the Functional "
            "API (keras.Model(inputs, outputs)) or keras.Sequential to pipeline it."
        )
    data = prepare_data(graph, x, y, sample_weight, class_weight)
    part = _partition.partition(graph, num_stages, balance)
    for e in part.edges:
        t = graph.tensors[e.tensor]
        if any(d is None for d in t.shape[1:]):
            raise ValueError(
                f"Tensor {t.keras_tensor.name!r} crosses from stage {e.src} to stage {e.dst} but "
                f"its shape {t.shape} has unknown dimensions besides the batch. Give the model's "
                "Input a full shape, or choose a `balance` that cuts elsewhere."
            )
    topo = Topology(num_stages, num_replicas)
    _check_agreement(comm, {
        "samples": len(data), "x_shapes": [a.shape[1:] for a in data.x],
        "weights": [tuple(v.shape) for v in model.weights], "num_stages": num_stages,
        "num_replicas": num_replicas, "num_microbatches": num_microbatches,
        "batch_size": batch_size, "epochs": epochs, "counts": part.counts, "schedule": schedule,
    })
    if seed is None:
        seed = comm.bcast_obj(int(np.random.SeedSequence().entropy % (2 ** 31)), 0)
    # Every replica starts from rank 0's weights.
    weights.broadcast(comm, model.weights, 0)
    _build_compiled(model, graph, data)
    s = topo.stage(comm.rank)
    eager = bool(getattr(model, "run_eagerly", False)) if run_eagerly is None else run_eagerly
    stage = Stage(graph, part.stages[s], model, part, is_last=(s == num_stages - 1),
                  run_eagerly=eager,
                  y_specs=[((None,) + a.shape[1:], a.dtype) for a in data.y],
                  has_sample_weight=data.sample_weight is not None, recompute=recompute)
    optimizer = model.optimizer
    if not optimizer.built:
        # Only this stage's variables: optimizer state is split like the weights.
        optimizer.build(stage.trainable)
    groups = _make_groups(comm, topo, part, stage, model.weights)
    timeline = Timeline(comm.rank) if trace else None
    executor = Executor(comm, topo, part, graph, stage, optimizer, schedule=schedule,
                        num_microbatches=num_microbatches, timeline=timeline,
                        groups=[g for g in groups.values() if g[1]])
    executor.lowered(num_microbatches)  # validate the schedule before any step
    stage_comm = groups.get((s,), (None, []))[0]
    owners = [topo.rank(part.owner.get(id(v), 0), 0) for v in model.weights]
    non_trainable = [v for v in graph.variables_of(part.stages[s].nodes, trainable=False)
                     if part.owner.get(id(v)) == s]
    return {
        "graph": graph, "data": data, "part": part, "topo": topo, "stage": stage,
        "executor": executor, "seed": seed, "verbose": verbose, "owners": owners,
        "non_trainable": non_trainable, "stage_comm": stage_comm,
        "num_microbatches": num_microbatches, "timeline": timeline, "trace": trace,
        "schedule": schedule,
    }


def _sync_weights(model, comm, setup):
    """Average this stage's state (e.g. BatchNorm statistics) over its replicas, then
    give every rank every variable from the stage that owns it (replica 0)."""
    weights.average(setup["stage_comm"], setup["non_trainable"])
    weights.gather(comm, model.weights, setup["owners"])


def _loop(model, setup, comm, batch_size, epochs, shuffle, callbacks, where):
    data, topo, executor = setup["data"], setup["topo"], setup["executor"]
    verbose = setup["verbose"]
    n = len(data)
    steps = math.ceil(n / batch_size)
    main = comm.rank == 0
    user_callbacks = list(callbacks or [])
    cbs = keras.callbacks.CallbackList(
        user_callbacks, add_history=True, add_progbar=verbose != 0 and main,
        model=model, verbose=verbose, epochs=epochs, steps=steps)
    # Ranks may differ in verbosity (`verbose=1 if hf.is_main() else 0` is common)
    # or callbacks; per-step logs are a collective, so all join if any wants them.
    per_step = any(comm.allgather_obj(verbose == 1 or bool(user_callbacks)))
    logs = _Logs(model, comm)
    r = topo.replica(comm.rank)
    model.stop_training = False
    timeline = setup["timeline"]
    if timeline is not None:
        timeline.start(comm)
    cbs.on_train_begin()
    epoch_logs = {}
    for epoch in range(epochs):
        logs.reset()
        cbs.on_epoch_begin(epoch)
        if shuffle:
            order = np.random.default_rng([setup["seed"], epoch]).permutation(n)
        else:
            order = np.arange(n)
        for step in range(steps):
            batch = order[step * batch_size:(step + 1) * batch_size]
            cbs.on_train_batch_begin(step)
            parts = split_batch(batch, topo.num_replicas, setup["num_microbatches"])
            contribution = executor.step(parts[r], len(batch), data, epoch * steps + step,
                                         setup["seed"])
            logs.add(contribution, len(batch))
            if per_step:
                cbs.on_train_batch_end(step, logs.result())
                if comm.bcast_obj(bool(model.stop_training), 0):
                    model.stop_training = True
                    break
        _sync_weights(model, comm, setup)
        epoch_logs = logs.result()
        cbs.on_epoch_end(epoch, epoch_logs)
        model.stop_training = comm.bcast_obj(bool(model.stop_training), 0)
        if model.stop_training:
            break
    cbs.on_train_end(epoch_logs)
    if timeline is not None:
        timeline.write(comm, setup["trace"], {
            "num_stages": topo.num_stages, "num_replicas": topo.num_replicas,
            "num_microbatches": setup["num_microbatches"], "schedule": setup["schedule"]})
    return model.history
