"""The members of a sweep as ordinary Keras models: built from their configs (each key
of a config must be read), their compiled loss and metrics, their callbacks and
`History`, their logs per epoch, and, at the end, every member's trained state on every
rank."""

import copy

import keras
import numpy as np

from .. import _compat
from ..engine import weights as _weights
from ..loop.progress import MAIN_ONLY_CALLBACKS

__all__ = ["Config", "job_configs", "read_configs", "build_members", "describe", "prepare",
           "callback_list", "needs_batch_hooks", "MemberLogs", "gather_results"]


class Config(dict):
    """A member's config as `build(config)` sees it: a dict that remembers the keys read,
    so that a key the model never reads (a typo, a stale setting) is an error instead of
    a member silently trained with the default."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def setdefault(self, key, default=None):
        self.read.add(key)
        return super().setdefault(key, default)

    def pop(self, key, *default):
        self.read.add(key)
        return super().pop(key, *default)

    def _all(self):
        self.read.update(dict.keys(self))

    def keys(self):
        self._all()
        return super().keys()

    def items(self):
        self._all()
        return super().items()

    def values(self):
        self._all()
        return super().values()

    def __iter__(self):
        self._all()
        return super().__iter__()

    def copy(self):
        self._all()
        return dict(self)

    def unread(self):
        return [k for k in dict.keys(self) if k not in self.read]


def read_configs(path):
    """A sweep's configs from a JSON file: a non-empty list of dicts."""
    import json

    with open(path) as f:
        configs = json.load(f)
    if not isinstance(configs, list) or not configs or \
            not all(isinstance(c, dict) for c in configs):
        raise ValueError(f"{path} must hold a non-empty JSON list of objects, one config per "
                         "member.")
    return configs


def job_configs(default=None):
    """The configs of the job `hyparflow slurm --sweep CONFIGS.json` rendered (the file
    HYPARFLOW_SWEEP_CONFIGS names), else `default`: a script runs alone and as that job."""
    from .. import settings

    path = settings.sweep_configs()
    if path is None:
        return default
    return read_configs(path)


def describe(configs):
    """`describe(p)` -> "member p (config ...)" for error messages."""
    def text(p):
        shown = ", ".join(f"{k}={v!r}" for k, v in list(configs[p].items())[:6])
        return f"member {p} ({{{shown}}})" if shown else f"member {p}"
    return text


def build_members(build, configs, draw_orders):
    """Build every member's model, in order; right after each build, `draw_orders()`
    draws the member's epochs' sample orders (its own `model.fit` would draw them next,
    from the random state its build left). Returns (models, orders)."""
    models, orders = [], []
    name = describe(configs)
    for p, config in enumerate(configs):
        if not isinstance(config, dict):
            raise TypeError(f"configs[{p}] must be a dict. Received: {type(config).__name__}")
        tracked = Config(config)
        model = build(tracked)
        unread = tracked.unread()
        if unread:
            raise ValueError(
                f"{name(p)}: build(config) never read the config key {unread[0]!r}"
                + (f" (nor {unread[1:]})" if unread[1:] else "") + ". A key the model does not "
                "use would leave that member trained with the default: fix the key's name, "
                "or read it in build.")
        models.append(model)
        orders.append(draw_orders())
    return models, orders


def prepare(model, data, rows):
    """Build the member's optimizer on its trainable variables and its compiled loss and
    metrics (symbolically, on `rows` samples), as its `model.fit` would before training."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    functional = _compat.functional_of(model)
    x = [_compat.symbolic((rows,) + a.shape[1:], a.dtype) for a in data.x]
    y = [_compat.symbolic((rows,) + a.shape[1:], a.dtype) for a in data.y]
    sw = _compat.symbolic((rows,), "float32") if data.sample_weight is not None else None
    x_arg = _compat.tree.pack_sequence_as(_compat.input_structure(functional), x)
    y_pred = _compat.compute_output_spec(model, x_arg, training=False)
    y_true = _compat.pack_outputs(functional, y)
    loss = _compat.compile_loss(model)
    if loss is None:
        raise ValueError(f"Model {model.name!r} was compiled without a loss: a sweep trains "
                         "with each member's compiled loss.")
    if not loss.built:
        _compat.compute_output_spec(lambda a, b, c: loss(a, b, c), y_true, y_pred, sw)
    metrics = _compat.compile_metrics(model)
    if metrics is not None and not metrics.built:
        _compat.compute_output_spec(lambda a, b, c: metrics.update_state(a, b, sample_weight=c),
                                    y_true, y_pred, sw)


def member_callbacks(callbacks, index, config):
    """The member's own callbacks: `callbacks(index, config)`, or a copy of each in the
    list (a callback keeps state: EarlyStopping's best value, a scheduler's step)."""
    if callbacks is None:
        return []
    if callable(callbacks) and not isinstance(callbacks, (list, tuple)):
        return list(callbacks(index, dict(config)) or [])
    try:
        return [copy.deepcopy(c) for c in callbacks]
    except Exception as error:  # noqa: BLE001 - say how to give each member its own
        raise TypeError(
            f"Cannot copy the callbacks for each member ({error!r}). Pass a function "
            "callbacks(index, config) -> list that makes each member's own.") from error


def callback_list(model, callbacks, main, epochs, steps):
    """Keras's CallbackList for a member on a rank of its group (`main`: the group's
    first rank, where the callbacks that print or write files run)."""
    user = [c for c in callbacks if main or not isinstance(c, MAIN_ONLY_CALLBACKS)]
    return keras.callbacks.CallbackList(user, add_history=True, add_progbar=False, model=model,
                                        verbose=0, epochs=epochs, steps=steps)


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


def needs_batch_hooks(callbacks):
    """Whether any callback does something per batch (its logs then come every step)."""
    base = keras.callbacks.Callback
    return any(getattr(type(c), h) is not getattr(base, h) for c in callbacks
               for h in _BATCH_HOOKS)


class MemberLogs:
    """The logs of one group's members (`models`: {sweep index: model}), as each member's
    `model.fit` reports them: `loss` the batch-size-weighted mean of the steps' losses;
    the compiled metrics' state summed over the group's replicas (each saw a part of
    every batch)."""

    def __init__(self, models, comm):
        self.models, self.comm = models, comm
        self.metrics, self.sums, self.counts = {}, {}, {}
        for i, model in models.items():
            tracker = _compat.loss_tracker(model)
            self.metrics[i] = [m for m in model.metrics if m is not tracker]

    def reset(self, indices):
        for i in indices:
            self.models[i].reset_metrics()
            self.sums[i], self.counts[i] = 0.0, 0

    def add(self, indices, contributions, batch_size):
        """One step's loss contributions (this replica's, one per member in `indices`)
        for a global batch of `batch_size`."""
        for i, c in zip(indices, np.asarray(contributions, np.float64)):
            self.sums[i] += float(c) * batch_size
            self.counts[i] += batch_size

    def result(self, indices):
        """{sweep index: logs} for `indices` (collective over the group's replicas, which
        call it with the same indices)."""
        variables = [v for i in indices for m in self.metrics[i] for v in m.variables]
        local = [np.asarray(v.numpy(), np.float64) for v in variables]
        flat = _weights.pack(local + [np.array([self.sums[i] for i in indices])], np.float64)
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(flat)
        for v, s in zip(variables, _weights.unpack(flat, variables)):
            v.assign(s.astype(v.dtype))
        sums = flat[len(flat) - len(indices):] if indices else []
        out = {}
        for i, total in zip(indices, sums):
            logs = {"loss": float(total / max(1, self.counts[i]))}
            for m in self.metrics[i]:
                r = m.result()
                if isinstance(r, dict):
                    logs.update({k: float(np.asarray(val)) for k, val in r.items()})
                else:
                    logs[m.name] = float(np.asarray(r))
            out[i] = logs
        for v, a in zip(variables, local):
            v.assign(a.astype(v.dtype))
        return out


def state_of(model, history):
    """What another rank needs to hold this trained member: its variables, its
    optimizer's, its history."""
    return ([np.asarray(v.numpy()) for v in model.variables],
            [np.asarray(v.numpy()) for v in model.optimizer.variables],
            dict(history.history), list(history.epoch), dict(history.params or {}))


def adopt(model, state):
    """Set a member's model from `state_of` another rank's: weights, optimizer, History."""
    variables, optimizer, history, epoch, params = state
    for v, a in zip(model.variables, variables):
        v.assign(a)
    for v, a in zip(model.optimizer.variables, optimizer):
        v.assign(a)
    h = keras.callbacks.History()
    h.set_model(model)
    h.history, h.epoch = history, epoch
    h.set_params(params)
    model.history = h
    return h


def gather_results(comm, owned, count):
    """Every member's trained state on every rank: `owned` {sweep index: state} on the
    ranks that report (each group's first), [state per sweep index] back."""
    everyone = comm.allgather_obj(owned) if comm.size > 1 else [owned]
    merged = {}
    for part in everyone:
        merged.update(part or {})
    missing = [i for i in range(count) if i not in merged]
    assert not missing, missing
    return [merged[i] for i in range(count)]


def broadcast_start(comm, models):
    """Every rank's members start from rank 0's (their variables), whatever each rank's
    builds drew."""
    if comm.size > 1:
        _weights.broadcast(comm, [v for m in models for v in m.variables], 0)
