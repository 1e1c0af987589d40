"""Embedding tables sharded over the ranks of a data-parallel run (`fit(...,
embedding_sharding=...)`): each table whole on one rank ("table"), its rows cut over
every rank ("row") or over the ranks of one host ("table-row"), its columns cut over
every rank ("column"), or replicated as before ("data"), while the dense layers stay
data-parallel. `plan` (pure) places the tables; `lookup` sends ids to their owners
and rows back; `part` is a rank's rows, trained in the table's place. The owner's
optimizer steps its rows on their (row, value) pairs, in the order of the global
batch, so the weights are `model.fit`'s (docs/recommenders.md).

`Tables.make` is the one entry the runtime calls; `Tables` then answers what the
runtime and the executor ask: its parts (as the stage's `shards`), the positions
whose pairs stay on their rank, the communicator to connect, the plan to print."""

from typing import Any, Dict, List, Optional

import keras
import numpy as np

from ...engine.prepare import check_parted
from ..tensor.split import common_why_not
from . import auto as _auto
from . import cost as _cost
from . import plan as _plan
from .lookup import Router, wire_dtype
from .part import TablePart

__all__ = ["Tables", "check_batches", "placements_for", "lookups_per_sample", "first_ids"]


def _embeddings(graph):
    """[(node index, Embedding layer)] of the model's graph, in graph order."""
    return [(i, node.op) for i, node in enumerate(graph.nodes)
            if isinstance(node.op, keras.layers.Embedding)]


def _why_not(graph, op):
    """Why Embedding `op` cannot be sharded (a sentence), or None."""
    reason = common_why_not(op, [op])
    if reason is not None:
        return reason
    if sum(node.op is op for node in graph.nodes) != 1:
        return "the layer is called more than once (shared weights)"
    for node in graph.nodes:
        if node.op is not op and any(v is op.embeddings
                                     for v in getattr(node.op, "weights", ())):
            return f"its table is also used by layer {node.op.name!r} (tied weights)"
    if getattr(op, "sparse", False):
        return "it has sparse=True"
    return None


def _factor(optimizer):
    return _plan.storage_factor(type(optimizer).__name__,
                                momentum=getattr(optimizer, "momentum", 0.0) or 0.0,
                                amsgrad=bool(getattr(optimizer, "amsgrad", False)),
                                centered=bool(getattr(optimizer, "centered", False)))


def _dense(optimizer):
    return _plan.dense_update(type(optimizer).__name__,
                              momentum=getattr(optimizer, "momentum", 0.0) or 0.0)


def _check_layout(layout, sync, graph, model):
    what = "embedding_sharding"
    if graph.functional is None:
        raise ValueError(f"{what} needs a Functional or Sequential model, whose Embedding "
                         f"layers hyparflow can replace; {model.name!r} is subclassed.")
    if layout.num_stages != 1 or layout.num_tensor != 1 or layout.num_chunks != 1:
        raise NotImplementedError(
            f"{what} shards tables over the replicas of a data-parallel run; this run has "
            f"{layout.describe()}. Use num_stages=1 and num_tensor=1 with it (pipelines and "
            "tensor splits together with sharded tables are not supported yet).")
    if layout.num_replicas < 2:
        raise ValueError(
            f"{what} needs at least 2 replicas to shard the tables over; this run has "
            f"num_replicas={layout.num_replicas}. Launch more ranks, or leave "
            f"{what} out.")
    if sync is not None:
        raise NotImplementedError(
            f"{what} needs replica_sync='allreduce': the owners step the tables every "
            "step with the whole batch's gradient.")


def placements_for(model: Any, graph: Any, sharding: Any, ranks: int,
                   memory_limit: Optional[float] = None, training: bool = True,
                   hosts: Optional[List[str]] = None, *, batch_size: Optional[int] = None,
                   ids: Optional[Dict[str, np.ndarray]] = None, wire_bytes: int = 4,
                   link: Any = None) -> List[_plan.Placement]:
    """The `plan.Placement` of each Embedding layer of `graph` (graph order) for
    `embedding_sharding=sharding` over `ranks` ranks (`hosts[r]`: rank r's host, for
    "table-row"), storage counted with the model's optimizer's slots (when
    `training`); what cannot be sharded, with why. "auto" chooses by cost: the ids
    looked up per step (`batch_size` samples), their distribution (`ids`: {layer:
    the first batches' ids}, uniform where missing), `wire_bytes` per value sent,
    `link` (`cost.Link`, its defaults when None)."""
    found = _embeddings(graph)
    if not found:
        raise ValueError(f"embedding_sharding={sharding!r}, but {model.name!r} has no "
                         "Embedding layer. Leave embedding_sharding out.")
    factor = _factor(model.optimizer) if training else 1
    dense = _dense(model.optimizer) if training else False
    tables, refused = [], {}
    for _, op in found:
        table = op.embeddings
        tables.append(_plan.Table(op.name, int(table.shape[0]), int(table.shape[1]),
                                  np.dtype(table.dtype).itemsize, factor, dense))
        reason = _why_not(graph, op)
        if reason is not None:
            refused[op.name] = reason
    costed = {}
    if sharding == "auto":
        costed = dict(ids=ids, wire_bytes=wire_bytes, link=link, lookups=None if not batch_size
                      else {k: v * batch_size for k, v in lookups_per_sample(graph).items()})
    return _auto.place(tables, sharding, ranks, memory_limit, refused, hosts, **costed)


FIRST_BATCHES = 8  # the batches whose ids "auto" reads for the owners' load


def first_ids(graph: Any, sample: Any, batch_size: Optional[int]) -> Dict[str, np.ndarray]:
    """{Embedding layer: the ids of the data's first `FIRST_BATCHES` batches}, for
    the Embedding layers whose ids are a model input (others: uniform). `sample` is
    what `fit` already holds (`loop.data.source`): the arrays (all of them), or a
    dataset's first batch (nothing more is read from it)."""
    out: Dict[str, np.ndarray] = {}
    xs = getattr(sample, "x", None) or []
    most = FIRST_BATCHES * (batch_size or 0) or None
    for i, op in _embeddings(graph):
        where = graph.tensors[graph.nodes[i].inputs[0]].input_position
        if where is not None and where < len(xs):
            out[op.name] = np.asarray(xs[where][:most])
    return out


def lookups_per_sample(graph: Any) -> Dict[str, int]:
    """{Embedding layer name: ids it looks up per sample} (its input's size)."""
    out: Dict[str, int] = {}
    for i, op in _embeddings(graph):
        shape = graph.tensors[graph.nodes[i].inputs[0]].shape
        out[op.name] = int(np.prod([d or 1 for d in shape[1:]]))
    return out


class Tables:
    """This rank's sharded tables: placements, parts, and the router."""

    def __init__(self, placements, parts, positions, ranks):
        self.placements, self.parts, self.ranks = placements, parts, ranks
        self.positions = positions  # filled in by `bind` (positions in stage.trainable)
        self.router = next(iter(parts.values())).router if parts else Router()
        self.costs = None  # the placements' `cost.Cost`s, when the batch is known

    @classmethod
    def make(cls, model, graph, layout, sharding, rank, *, memory_limit=None, sync=None,
             training=True, communication_dtype=None, hosts=None, sample=None,
             batch_size=None):
        """The run's `Tables` for `embedding_sharding=sharding` (None: nothing sharded,
        returns None). `rank`: this rank's replica index; `communication_dtype`: the
        dtype rows and gradients travel in (None: float32); `hosts[r]`: replica r's
        host (None: one host), where "table-row" tables go; `sample`, `batch_size`:
        the data fit holds and its global batch, whose first batches' ids "auto"
        costs the owners' load from (every rank holds the same: the same plan)."""
        wire = wire_dtype(communication_dtype)
        if sharding is None:
            if wire is not None:
                raise ValueError(
                    f"communication_dtype={communication_dtype!r} applies to the exchanges "
                    "of sharded embedding tables (the replicas' gradient sums stay float32 "
                    "for now), but embedding_sharding is not set. Set embedding_sharding, "
                    "or leave communication_dtype out.")
            return None
        _check_layout(layout, sync, graph, model)
        if training:
            # engine.prepare.check_optimizer refused LossScaleOptimizer for every run.
            check_parted(model.optimizer, "the owners of a sharded table each hold a part "
                         "of it", "embedding_sharding=None")
        ids = first_ids(graph, sample, batch_size)
        wire_bytes = 2 if wire is not None else 4
        placements = placements_for(
            model, graph, sharding, layout.num_replicas, memory_limit, training, hosts,
            batch_size=batch_size, wire_bytes=wire_bytes, ids=ids)
        router = Router(wire)
        parts = {}
        for site, ((i, op), p) in enumerate(zip(_embeddings(graph), placements)):
            if p.kind != "data":
                parts[i] = TablePart(op, p, rank, router, site)
        self = cls(placements, parts, [], layout.num_replicas)
        self.router = router
        if batch_size:  # the plan's estimate per step, printed with it
            lookups = {k: v * batch_size for k, v in lookups_per_sample(graph).items()}
            self.costs = _cost.costs(placements, layout.num_replicas, lookups, ids,
                                     wire_bytes=wire_bytes, hosts=hosts)
        return self

    def bind(self, stage):
        """Positions, in `stage.trainable`, of the parts: their pairs stay on this rank."""
        where = {id(v): k for k, v in enumerate(stage.trainable)}
        self.positions = sorted(where[id(part.variable)] for part in self.parts.values())
        return self.positions

    def connect(self, comm):
        self.router.comm = comm

    def describe(self):
        """The plan (bytes per rank), and its estimate per step when fit gave the batch."""
        text = _plan.describe(self.placements, self.ranks)
        if not self.costs:
            return text
        return text + "\n" + _cost.describe(self.costs, self.ranks)

    def nbytes(self):
        """The bytes of the table rows this rank trains (weights only)."""
        return sum(part.nbytes for part in self.parts.values())


def check_batches(samples, batch_size, replicas, microbatches, what="the data"):
    """Every replica must look up as many microbatches as the others each step (their
    lookups pair up, and each owner serves every replica's): a short last batch with
    fewer than R x M samples is refused. A dataset's batches are checked one by one
    (`batch_size` = samples + 1: the batch is its own "last")."""
    last = samples % batch_size
    if 0 < last < replicas * microbatches:
        sizes = ("" if batch_size == samples + 1 else
                 f" ({samples} samples, batch_size={batch_size})")
        raise ValueError(
            f"With embedding_sharding every replica looks its microbatches up together, but "
            f"{what}'s last batch has {last} samples{sizes}, fewer than num_replicas x "
            f"num_microbatches = {replicas * microbatches}. Drop those last {last} samples "
            "(a dataset: .batch(..., drop_remainder=True)), or pick a batch_size whose last "
            "batch has at least that many.")
