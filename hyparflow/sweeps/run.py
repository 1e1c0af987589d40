"""`hyparflow.sweep`: N configs of one model trained as one job, fused into one array.

Every rank builds every member (`build(config)`, each followed by the sample orders its
own `model.fit` would draw), checks their graphs (fuse.read) and starts them from rank
0's values. The ranks form G = ranks // R groups of R replicas; group g trains the g-th
contiguous share of the members as one fused sub-array (fuse.Array), each replica on
its part of every global batch. Each epoch ends as each member's `model.fit` ends one:
its logs (validation too), its callbacks (its own copies), and a member whose callbacks
stop it leaves the array (the others are fused again without it). Rank 0 prints a table
of every member. At the end every rank holds every member's trained model, optimizer
state and History.
"""

import math
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import keras
import numpy as np

from .. import _compat, settings
from .. import readers as _data
from ..engine import weights as _weights
from ..loop.api import _agree_bad_call
from ..engine.comm import wrap
from ..engine.errors import user_errors
from ..loop.progress import resolve_verbose
from ..engine.prepare import agree_on_error, check_positive, fail
from . import fuse as _fuse
from . import members as _members
from . import optimizers as _optimizers
from . import table as _table
from .steps import Steps

__all__ = ["sweep", "SweepResult"]


class SweepResult(NamedTuple):
    """What `hyparflow.sweep` returns: the trained model and the History of each config,
    in the configs' order (`models, histories = hf.sweep(...)`)."""

    models: list
    histories: list


def _validation_epochs(freq: Union[int, Sequence[int]], epochs: int) -> set:
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"`validation_freq` must be >= 1. Received: validation_freq={freq}")
        return {e for e in range(epochs) if (e + 1) % freq == 0}
    return {int(e) - 1 for e in freq}


def _num_samples(x: Any) -> int:
    first = x
    while isinstance(first, (dict, list, tuple)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return len(first)


@user_errors("hf.sweep", _agree_bad_call("hf.sweep"))
def sweep(build: Callable[[dict], Any], configs: Sequence[dict], x: Any, y: Any = None, *,
          batch_size: int = 32, epochs: int = 1, validation_data: Any = None,
          validation_split: float = 0.0, validation_batch_size: Optional[int] = None,
          validation_freq: Union[int, Sequence[int]] = 1, callbacks: Any = None,
          num_replicas: Optional[int] = None, shuffle: bool = True, sample_weight: Any = None,
          class_weight: Any = None, verbose: Union[int, str] = "auto",
          comm: Any = None) -> SweepResult:
    """Train one model per config as one fused array: a hyper-parameter sweep in one job.

    `build(config)` returns a compiled Keras model (Functional or Sequential); the
    configs (dicts: learning rates, optimizer arguments, seeds, dropout rates, loss
    weights, ...) may change anything that keeps the graph's shapes. hyparflow builds the
    N models, checks that their graphs match, and trains them as one model whose layers
    compute all N members at once (Dense as one batched product, Conv as one grouped
    convolution, per-member normalization, dropout and optimizer hyper-parameters); a
    layer with no fused kind runs once per member, and the run says which. Every member
    trains to the weights its own `model.fit(x, y, batch_size=..., epochs=...,
    shuffle=...)` gives, dropout masks and `shuffle=True`'s order included.

    Call it on every rank; with `mpiexec -n G*R` the members are shared out over G groups
    of `num_replicas` R ranks: each group trains its share as one sub-array, each of its
    replicas a contiguous part of every batch.

    Args:
        build: `build(config) -> compiled keras.Model`. Each key of a config must be read
            by it (a key it never reads is an error naming the member and the key).
        configs: a list of dicts, one per member, or the path of a JSON file of one
            (`hyparflow.sweeps.job_configs(default)`: the file of the job `hyparflow slurm
            --sweep` rendered).
        x, y, sample_weight, class_weight, batch_size, epochs, shuffle: as in `model.fit`
            (numpy arrays, or lists / dicts of them); every member sees the same data, in
            the order its own fit would take it.
        validation_data, validation_split, validation_batch_size, validation_freq: as in
            `model.fit`; each member's `val_` logs.
        callbacks: Keras callbacks, copied for each member, or a function
            `callbacks(index, config) -> list` (e.g. a ModelCheckpoint per member). A
            member whose callbacks set `stop_training` (EarlyStopping) leaves the array;
            the others go on.
        num_replicas: ranks per group (data parallel within each member); None:
            $HYPARFLOW_NUM_REPLICAS, else 1.
        verbose: 0 (silent), or 1, 2, "auto": rank 0 prints a table of every member after
            each epoch.
        comm: an mpi4py communicator (default MPI.COMM_WORLD) or a
            `hyparflow.comm.Communicator`.

    Returns:
        `SweepResult(models, histories)`: each config's trained model (usable alone:
        `predict`, `save`, more `fit`, its optimizer's state included) and its
        `keras.callbacks.History`, in the configs' order, on every rank.
    """
    communicator, owned = wrap(comm, "hf.sweep")
    try:
        run = _Run(communicator, build, configs, x, y, dict(
            batch_size=batch_size, epochs=epochs, validation_data=validation_data,
            validation_split=validation_split, validation_batch_size=validation_batch_size,
            validation_freq=validation_freq, callbacks=callbacks, num_replicas=num_replicas,
            shuffle=shuffle, sample_weight=sample_weight, class_weight=class_weight,
            verbose=verbose))
        return run.train()
    finally:
        if owned:
            communicator.free()


class _Run:
    """One sweep on one rank: set-up (agreed by all ranks), then the epochs."""

    def __init__(self, comm: Any, build: Callable[[dict], Any], configs: Any, x: Any, y: Any,
                 options: dict) -> None:
        self.comm = comm
        self.o = options
        error = None
        try:
            self._set_up(build, configs, x, y)
        except (ValueError, TypeError, NotImplementedError) as exc:
            error = exc
        agree_on_error(comm, error)

    # set-up ------------------------------------------------------------------------------
    def _set_up(self, build: Callable[[dict], Any], configs: Any, x: Any, y: Any) -> None:
        o, comm = self.o, self.comm
        if isinstance(configs, str):
            configs = _members.read_configs(configs)
        if not isinstance(configs, (list, tuple)) or not configs:
            raise ValueError("`configs` must be a non-empty list of dicts, one per member. "
                             f"Received: {type(configs).__name__}")
        if not callable(build):
            raise TypeError(f"`build` must be a function build(config) -> compiled model. "
                            f"Received: {type(build).__name__}")
        check_positive(batch_size=o["batch_size"], epochs=o["epochs"])
        self.configs = [dict(c) if isinstance(c, dict) else c for c in configs]
        self.n = len(configs)
        self.epochs, self.batch_size = o["epochs"], o["batch_size"]
        self.verbose = resolve_verbose(o["verbose"])
        replicas = o["num_replicas"] or settings.layout_counts().get("num_replicas") or 1
        check_positive(num_replicas=replicas)
        if comm.size % replicas:
            raise ValueError(f"The world has {comm.size} ranks, which num_replicas={replicas} "
                             "does not divide.")
        self.replicas, self.groups = replicas, comm.size // replicas
        if self.groups > self.n:
            raise ValueError(
                f"{comm.size} ranks with num_replicas={replicas} make {self.groups} groups, "
                f"more than the {self.n} members: every group needs a member. Use "
                f"num_replicas={math.ceil(comm.size / self.n)} or more, or fewer ranks.")
        self.val_epochs = _validation_epochs(o["validation_freq"], self.epochs)
        if o["validation_split"] and o["validation_data"] is None:
            (x, y, sw), o["validation_data"] = _data.validation_split(
                x, y, o["sample_weight"], o["validation_split"])
            o["sample_weight"] = sw
        if _data.is_stream(x):
            raise ValueError("hf.sweep takes numpy data (arrays, or lists / dicts of them): each "
                             "member's batch is gathered from its own order. Received a "
                             "tf.data.Dataset.")
        samples = _num_samples(x)
        self.steps_per_epoch = math.ceil(samples / self.batch_size)
        self.describe = _members.describe(self.configs)

        def draw_orders() -> Any:
            if not o["shuffle"]:
                return None
            return np.stack([_compat.fit_shuffle_order(samples) for _ in range(self.epochs)])

        self.models, orders = _members.build_members(build, self.configs, draw_orders)
        self.sweep = _fuse.read(self.models, self.describe)
        self.data = _data.prepare_data(self.sweep.graph, x, y, o["sample_weight"],
                                       o["class_weight"])
        _data.check_finite(self.data)
        self.validation = None
        if o["validation_data"] is not None:
            vd = o["validation_data"]
            vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(vd) if isinstance(
                vd, (list, tuple)) else (vd, None, None)
            self.validation = _data.prepare_data(self.sweep.graph, vx, vy, vsw)
        for model in self.models:
            _members.prepare(model, self.data, min(self.batch_size, samples))
        # Checked for every member here, so that every rank finds a mistake alike.
        _optimizers.fuse([m.optimizer for m in self.models], [], self.describe)
        self.orders = np.stack(orders) if o["shuffle"] else None

    # training ----------------------------------------------------------------------------
    def train(self) -> SweepResult:
        comm = self.comm
        # Rank 0's members everywhere, whatever each rank's builds drew.
        _members.broadcast_start(comm, self.models)
        if self.orders is not None and comm.size > 1:
            self.orders = comm.bcast(np.ascontiguousarray(self.orders, np.int64), 0)
        self.group = self.rank_in_group = None
        g, r = divmod(comm.rank, self.replicas)
        self.group_comm = comm.split(g, comm.rank) if comm.size > 1 else None
        self.replica = r
        self.positions = [int(i) for i in np.array_split(np.arange(self.n), self.groups)[g]]
        if comm.rank == 0 and self.verbose:
            self._announce()
        try:
            return self._epochs()
        except BaseException as exc:
            fail(comm, None, exc)
            raise
        finally:
            if self.group_comm is not None:
                self.group_comm.free()

    def _announce(self) -> None:
        fused = sum(1 for k in self.sweep.kinds.values() if k.fused)
        print(f"hyparflow sweep: {self.n} members on {self.groups} group(s) of "
              f"{self.replicas} rank(s); {fused} of {len(self.sweep.kinds)} layers fused",
              flush=True)
        normalizing = [layers[0].name for layers in self.sweep.layers.values()
                       if isinstance(layers[0], keras.layers.BatchNormalization)
                       and layers[0].trainable]
        random_loops = [layers[0].name for key, layers in self.sweep.layers.items()
                        if not self.sweep.kinds[key].fused and _compat.seed_generators(layers[0])]
        if self.replicas > 1 and random_loops:
            print(f"hyparflow sweep: warning: layers run once per member draw their own random "
                  f"numbers on each replica's part of a batch ({', '.join(random_loops)}), "
                  "not the whole batch's as their own model.fit: those members differ from it. "
                  "num_replicas=1 keeps them exact.", flush=True)
        if self.replicas > 1 and normalizing:
            print(f"hyparflow sweep: warning: with num_replicas={self.replicas} "
                  f"BatchNormalization ({', '.join(normalizing)}) normalizes each replica's part "
                  "of a batch by that part's statistics, so those members differ from their "
                  "own model.fit (moving statistics are averaged over the replicas after each "
                  "epoch, as in hf.fit). num_replicas=1 keeps them exact.", flush=True)
        for name, cls, why in self.sweep.looped:
            print(f"hyparflow sweep: layer {name!r} ({cls}) runs once per member: {why}",
                  flush=True)

    def _fuse(self, indices: list) -> Optional[Steps]:
        """The group's array of the members `indices` (its steps; None for none)."""
        if not indices:
            return None
        array = _fuse.Array(self.sweep, self.models, indices)
        optimizer = _optimizers.fuse([self.models[i].optimizer for i in indices],
                                     array.trainable, lambda p: self.describe(indices[p]))
        return Steps(array, optimizer, self.data, self.validation,
                     self.group_comm if self.replicas > 1 else None)

    def _rows(self, member: int, epoch: int, step: int, total_rows: int) -> Any:
        lo = step * self.batch_size
        hi = min(lo + self.batch_size, total_rows)
        if self.orders is None:
            return np.arange(lo, hi)
        return self.orders[member, epoch, lo:hi]

    def _epochs(self) -> SweepResult:
        comm, n_samples = self.comm, len(self.data)
        main = self.replica == 0
        callbacks = {i: _members.callback_list(
            self.models[i], _members.member_callbacks(self.o["callbacks"], i, self.configs[i]),
            main, self.epochs, self.steps_per_epoch) for i in self.positions}
        hooks = self._agree(any(_members.needs_batch_hooks(c.callbacks)
                                for c in callbacks.values()))
        logs = _members.MemberLogs({i: self.models[i] for i in self.positions},
                                   self.group_comm if self.replicas > 1 else None)
        active = list(self.positions)
        status = {i: "training" for i in range(self.n)}
        last_logs = {}
        for i in active:
            self.models[i].stop_training = False
            callbacks[i].on_train_begin()
        steps: Any = self._fuse(active)
        for epoch in range(self.epochs):
            start_time = time.perf_counter()
            logs.reset(active)
            for i in active:
                callbacks[i].on_epoch_begin(epoch)
            finishing = list(active)          # members that end this epoch's steps
            trained = 0
            for step in range(self.steps_per_epoch if active else 0):
                rows = np.stack([self._rows(i, epoch, step, n_samples) for i in active])
                part = np.array_split(np.arange(rows.shape[1]), self.replicas)[self.replica]
                if hooks:
                    for i in active:
                        callbacks[i].on_train_batch_begin(step)
                contributions = steps.train(rows[:, part], len(part) / rows.shape[1],
                                            int(part[0]) if len(part) else 0, rows.shape[1])
                logs.add(active, contributions, rows.shape[1])
                trained += rows.shape[1] * len(active)
                if hooks:
                    batch = logs.result(active)
                    for i in active:
                        callbacks[i].on_train_batch_end(step, batch[i])
                    left = self._stopped(active)
                    if left:
                        steps.array.write_back()
                        steps.optimizer.write_back()
                        active = [i for i in active if i not in left]
                        steps = self._fuse(active)
                        if not active:
                            break
            epoch_logs = logs.result(finishing)
            if steps is not None and self.replicas > 1:
                # Each replica's BatchNormalization statistics came from its part of the
                # batches: the replicas take their mean (as hf.fit does).
                _weights.average(self.group_comm,
                                 [s.variable for s in steps.array.slots if not s.trainable])
            if self.validation is not None and epoch in self.val_epochs:
                val = self._validate(steps, active, finishing, logs, callbacks)
                for i in finishing:
                    epoch_logs[i].update({f"val_{k}": v for k, v in val[i].items()})
            if steps is not None:
                steps.array.write_back()
            for i in finishing:
                callbacks[i].on_epoch_end(epoch, epoch_logs[i])
                last_logs[i] = epoch_logs[i]
            ended = [i for i in finishing if i not in active] + self._stopped(active)
            for i in ended:
                status[i] = f"stopped after epoch {epoch + 1}"
                callbacks[i].on_train_end(last_logs[i])
            if any(i in active for i in ended):
                steps.optimizer.write_back()
                active = [i for i in active if i not in ended]
                steps = self._fuse(active)
            elif steps is not None:
                steps.array.reload()      # a callback may have set a member's weights
            shown = {i: last_logs.get(i) for i in self.positions}
            remaining = self._report(epoch, shown, status, time.perf_counter() - start_time,
                                     trained)
            if not remaining:
                break
        for i in active:
            callbacks[i].on_train_end(last_logs.get(i))
        if steps is not None:
            steps.optimizer.write_back()
            steps.array.write_back()
        return self._results(callbacks)

    def _agree(self, flag: bool) -> bool:
        """One decision for the whole group (its replicas run the same members)."""
        if self.group_comm is None or self.replicas == 1:
            return flag
        return any(self.group_comm.allgather_obj(flag))

    def _stopped(self, active: list) -> list:
        """The members whose callbacks stopped them, as the group's first rank saw it."""
        stops = [i for i in active if self.models[i].stop_training]
        if self.group_comm is not None and self.replicas > 1:
            stops = self.group_comm.bcast_obj(stops, 0)
        return stops

    def _validate(self, steps: Any, active: list, finishing: list, logs: Any,
                  callbacks: dict) -> dict:
        """Each finishing member's validation logs (as its `model.fit` evaluates after
        the epoch's steps); a member that left mid-epoch is evaluated from its model."""
        out = {}
        groups = [(steps, [i for i in finishing if i in active])]
        gone = [i for i in finishing if i not in active]
        if gone:
            array = _fuse.Array(self.sweep, self.models, gone)
            groups.append((Steps(array, None, self.data, self.validation,
                                 self.group_comm if self.replicas > 1 else None), gone))
        assert self.validation is not None
        total = len(self.validation)
        size = self.o["validation_batch_size"] or self.batch_size
        for evaluator, members in groups:
            if not members:
                continue
            for i in members:
                callbacks[i].on_test_begin()
            logs.reset(members)
            for lo in range(0, total, size):
                rows = np.arange(lo, min(lo + size, total))
                part = np.array_split(np.arange(len(rows)), self.replicas)[self.replica]
                idx = np.tile(rows[part], (len(members), 1))
                logs.add(members, evaluator.evaluate(idx, len(part) / len(rows)), len(rows))
            out.update(logs.result(members))
            for i in members:
                callbacks[i].on_test_end(out[i])
        return out

    def _report(self, epoch: int, epoch_logs: dict, status: dict, seconds: float,
                trained: int) -> int:
        """Every group's members to rank 0's table (collective); returns how many members
        still train anywhere."""
        mine = {i: (epoch_logs.get(i), status[i]) for i in self.positions} \
            if self.replica == 0 else {}
        everyone = self.comm.allgather_obj((mine, trained if self.replica == 0 else 0)) \
            if self.comm.size > 1 else [(mine, trained)]
        rows: dict = {}
        samples = 0
        for part, count in everyone:
            rows.update(part)
            samples += count
        if self.comm.rank == 0 and self.verbose:
            shown = [(i, logs, state) for i, (logs, state) in sorted(rows.items(),
                                                                     key=lambda r: r[0])]
            print(_table.render(epoch, self.epochs, shown, self.configs, seconds, samples),
                  flush=True)
        return sum(1 for _, state in rows.values() if state == "training")

    def _results(self, callbacks: dict) -> SweepResult:
        histories = {}
        for i in self.positions:
            history = next(c for c in callbacks[i].callbacks
                           if isinstance(c, keras.callbacks.History))
            self.models[i].history = history
            histories[i] = history
        owned = {i: _members.state_of(self.models[i], histories[i]) for i in self.positions} \
            if self.replica == 0 else {}
        states = _members.gather_results(self.comm, owned, self.n)
        out = []
        for i, state in enumerate(states):
            if i in histories:
                out.append(histories[i])
            else:
                out.append(_members.adopt(self.models[i], state))
        return SweepResult(list(self.models), out)
