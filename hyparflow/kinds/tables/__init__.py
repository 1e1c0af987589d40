"""Embedding tables sharded over the ranks of a data-parallel run (`fit(...,
embedding_sharding=...)`): each table whole on one rank ("table"), its rows cut over
every rank ("row") or over the ranks of one host ("table-row"), its columns cut over
every rank ("column"), or replicated as before ("data"), while the dense layers stay
data-parallel. In a pipeline, "every rank" is every rank of the table's stage (its
R replicas, times its T tensor ranks): each stage's tables are placed over its own
ranks, which look up together on a communicator of their own (`Tables.color`). Every
replica of a stage runs the same schedule program (`schedules.program`, one per
stage), so their lookups pair up microbatch by microbatch, in the same order.

`plan` (pure) places the tables; `lookup` sends ids to their owners and rows back;
`part` is a rank's rows, trained in the table's place. The owner's optimizer steps
its rows on their (row, value) pairs, in the order of the global batch, so the
weights are `model.fit`'s (docs/recommenders.md).

`Tables.make` is the one entry the runtime calls; `Tables` then answers what the
runtime and the executor ask: its parts (as the stage's `shards`), the positions
whose pairs stay on their rank, the communicator to connect, the plan to print."""

from typing import Any, Dict, List, Optional

import keras
import numpy as np

from ...engine.prepare import check_parted
from ...topology import Topology
from ..tensor.split import common_why_not
from . import auto as _auto
from . import cost as _cost
from . import plan as _plan
from . import rs as _rs
from . import whole as _whole
from ...engine.wire import numpy_dtype
from .lookup import Router
from .part import TablePart
from .pooled import PoolTaken
from .pooled import find as find_pooling

__all__ = ["Tables", "placements_for", "lookups_per_sample", "first_ids"]


def _embeddings(graph):
    """[(node index, Embedding layer)]: the model's tables, in graph order: each
    Embedding call, and each table (EmbedReduce) of a keras_rs DistributedEmbedding."""
    out = []
    for i, node in enumerate(graph.nodes):
        if isinstance(node.op, keras.layers.Embedding):
            out.append((i, node.op))
        elif _rs.is_distributed(node.op):
            out.extend((i, table) for table in _rs.tables(node.op))
    return out


def _why_not(graph, i, op):
    """Why Embedding `op` (called by node `i`) cannot be sharded (a sentence), or None."""
    reason = common_why_not(op, [op])
    if reason is not None:
        return reason
    holder = graph.nodes[i].op
    if holder is not op:  # a table of a DistributedEmbedding
        reason = _rs.why_not(graph, i, op)
        if reason is not None:
            return reason
    elif sum(node.op is op for node in graph.nodes) != 1:
        return "the layer is called more than once (shared weights)"
    for node in graph.nodes:
        if node.op is not holder and any(v is op.embeddings
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
    if layout.num_chunks != 1 or layout.tensor_mesh:
        # Model chunks (interleaved) are Stages built without parts; a tensor mesh's
        # ranks are not known to compute the same lookups (a 1D split's are).
        raise NotImplementedError(
            f"{what} shards tables over the ranks of each pipeline stage; this run has "
            f"{layout.describe()}. Use num_chunks=1 and no tensor_mesh with it "
            "(interleaved schedules and tensor meshes together with sharded tables are not "
            "supported yet).")
    if layout.num_replicas * layout.num_tensor < 2:
        stages = (" (in a pipeline, each stage's tables are sharded over the ranks that "
                  "run that stage: its replicas and tensor ranks)"
                  if layout.num_stages > 1 else "")
        raise ValueError(
            f"{what} needs at least 2 ranks per stage to shard the tables over; this run "
            f"has num_replicas={layout.num_replicas} and num_tensor={layout.num_tensor}"
            f"{stages}. Launch more ranks, or leave {what} out.")
    if sync is not None:
        raise NotImplementedError(
            f"{what} needs replica_sync='allreduce': the owners step the tables every "
            "step with the whole batch's gradient.")


def placements_for(model: Any, graph: Any, sharding: Any, ranks: int,
                   memory_limit: Optional[float] = None, training: bool = True,
                   hosts: Optional[List[str]] = None,
                   nodes: Optional[List[int]] = None, *, batch_size: Optional[int] = None,
                   ids: Optional[Dict[str, np.ndarray]] = None, wire_bytes: int = 4,
                   link: Any = None) -> List[_plan.Placement]:
    """The `plan.Placement` of each Embedding layer of `graph` (graph order) for
    `embedding_sharding=sharding` over `ranks` ranks (`hosts[r]`: rank r's host, for
    "table-row"), storage counted with the model's optimizer's slots (when
    `training`); what cannot be sharded, with why. `nodes`: place only the Embedding
    calls at these node indices (a pipeline stage's), over `ranks` ranks of their own;
    the names of `sharding` are checked against every Embedding layer. "auto" chooses
    by cost: the ids looked up per step (`batch_size` samples), their distribution
    (`ids`: {layer: the first batches' ids}, uniform where missing), `wire_bytes` per
    value sent, `link` (`cost.Link`, its defaults when None)."""
    found = _embeddings(graph)
    if not found:
        raise ValueError(f"embedding_sharding={sharding!r}, but {model.name!r} has no "
                         "Embedding layer. Leave embedding_sharding out.")
    factor = _factor(model.optimizer) if training else 1
    dense = _dense(model.optimizer) if training else False
    tables, refused = [], {}
    for i, op in found:
        table = op.embeddings
        tables.append(_plan.Table(op.name, int(table.shape[0]), int(table.shape[1]),
                                  np.dtype(table.dtype).itemsize, factor, dense))
        reason = _why_not(graph, i, op)
        if reason is not None:
            refused[op.name] = reason
    if isinstance(sharding, str) and sharding != "auto":
        # One kind for every table that can take it (over this stage's ranks).
        sharding, _ = _plan.expand(sharding, tables, ranks, refused)
    costed: Dict[str, Any] = {}
    if sharding == "auto":
        costed = dict(ids=ids, wire_bytes=wire_bytes, link=link, lookups=None if not batch_size
                      else {k: v * batch_size for k, v in lookups_per_sample(graph).items()})
    if nodes is None:
        return _auto.place(tables, sharding, ranks, memory_limit, refused, hosts, **costed)
    # The kinds and names checked over every table (the same ranks in every stage);
    # then this stage's tables placed over its ranks, its bytes within memory_limit.
    _auto.place(tables, sharding, ranks, None, refused, **costed)
    keep = [k for k, (i, _) in enumerate(found) if i in set(nodes)]
    names = {tables[k].name for k in keep}
    if isinstance(sharding, dict):
        sharding = {n: kind for n, kind in sharding.items() if n in names}
    return _auto.place([tables[k] for k in keep], sharding, ranks, memory_limit,
                       {n: why for n, why in refused.items() if n in names}, hosts, **costed)


FIRST_BATCHES = 8  # the batches whose ids "auto" reads for the owners' load


def first_ids(graph: Any, sample: Any, batch_size: Optional[int]) -> Dict[str, np.ndarray]:
    """{Embedding layer: the ids of the data's first `FIRST_BATCHES` batches}, for
    the Embedding layers whose ids are a model input (others: uniform). `sample` is
    what `fit` already holds (`readers.source`): the arrays (all of them), or a
    dataset's first batch (nothing more is read from it)."""
    out: Dict[str, np.ndarray] = {}
    xs = getattr(sample, "x", None) or []
    most = FIRST_BATCHES * (batch_size or 0) or None
    for i, op in _embeddings(graph):
        if graph.nodes[i].op is not op:  # a DistributedEmbedding's table: uniform
            continue
        where = graph.tensors[graph.nodes[i].inputs[0]].input_position
        if where is not None and where < len(xs):
            out[op.name] = np.asarray(xs[where][:most])
    return out


def lookups_per_sample(graph: Any) -> Dict[str, int]:
    """{Embedding layer name: ids it looks up per sample} (its input's size)."""
    out: Dict[str, int] = {}
    for i, op in _embeddings(graph):
        if graph.nodes[i].op is not op:
            out[op.name] = _rs.ids_per_sample(graph.nodes[i].op, op)
            continue
        shape = graph.tensors[graph.nodes[i].inputs[0]].shape
        out[op.name] = int(np.prod([d or 1 for d in shape[1:]]))
    return out


def _stage_ranks(topo, stage):
    """The ranks that run pipeline position `stage`, in rank order (replica-major):
    a stage's tables are sharded over them, and a rank's index here is its share."""
    return sorted(topo.rank(stage, r, t) for r in range(topo.num_replicas)
                  for t in range(topo.num_tensor))


def applied(kind, placements):
    """`embedding_sharding=kind`'s tables, said once: those it applied to, and those
    kept whole on every rank ("data") with why."""
    took = [p.table.name for p in placements if p.kind == kind]
    kept = [p.table.name for p in placements if p.kind != kind]
    text = f"hyparflow: embedding_sharding={kind!r} applies to {', '.join(map(repr, took)) or 'no table'}"
    if kept:
        text += f"; kept whole on every rank ('data'): {', '.join(map(repr, kept))}"
    return text + "."


class Tables:
    """This rank's sharded tables: placements (of every stage's tables), parts (of
    this rank's stage's), and the router."""

    def __init__(self, placements, parts, positions, ranks, stages=None, stage=0,
                 shards=None):
        self.placements, self.parts, self.ranks = placements, parts, ranks
        # {node: what the stage calls there}: the parts (a DistributedEmbedding's
        # together: rs.LayerTables), and the pooling calls the owners' pooled lookups
        # took over (pooled.PoolTaken).
        self.shards = dict(shards or {})
        self.positions = positions  # filled in by `bind` (positions in stage.trainable)
        self.router = parts[0].router if parts else Router()
        # The pipeline position of each placement's table, and this rank's.
        self.stages = list(stages) if stages is not None else [0] * len(placements)
        self.stage = stage
        self.pipelined = False  # whether `describe` names the stages
        self.nodes = set()
        self.costs = None  # the placements' `cost.Cost`s, when the batch is known
        self.note = ""  # embedding_sharding="row" (one kind): which tables it applied to

    @classmethod
    def make(cls, model, graph, layout, sharding, rank, *, memory_limit=None, sync=None,
             training=True, communication_dtype=None, hosts=None, stage_of=None,
             sample=None, batch_size=None):
        """The run's `Tables` for `embedding_sharding=sharding` (None: nothing sharded,
        returns None). `rank`: this rank in the run; `stage_of`: {node index: its
        pipeline position} (None: one stage); `communication_dtype`: the dtype rows
        and gradients travel in (None: float32); `hosts[q]`: rank q's host (None: one
        host), where "table-row" tables go; `sample`, `batch_size`: the data fit holds
        and its global batch, whose first batches' ids "auto" costs the owners' load
        from (every rank holds the same: the same plan)."""
        wire = numpy_dtype(communication_dtype)  # a name engine.wire.resolve checked
        if sharding is None:
            if wire is not None:
                raise ValueError(
                    f"communication_dtype={{'tables': {communication_dtype!r}}} applies to "
                    "the exchanges of sharded embedding tables, but embedding_sharding is "
                    "not set. Set embedding_sharding, or leave 'tables' out.")
            return None
        _check_layout(layout, sync, graph, model)
        if training:
            # engine.prepare.check_optimizer refused LossScaleOptimizer for every run.
            check_parted(model.optimizer, "the owners of a sharded table each hold a part "
                         "of it", "embedding_sharding=None")
        ids = first_ids(graph, sample, batch_size)
        wire_bytes = 2 if wire is not None else 4
        topo = Topology(layout.num_stages, layout.num_replicas, layout.num_tensor)
        found = _embeddings(graph)
        stage_of = stage_of or {}
        where = [stage_of.get(i, 0) for i, _ in found]
        # Each stage's tables over the ranks of that stage (as many in every stage).
        placed = {}  # by place in `found` (a DistributedEmbedding's tables share a node)
        for s in sorted(set(where)):
            group = _stage_ranks(topo, s)
            ks = [k for k, q in enumerate(where) if q == s]
            nodes = sorted({found[k][0] for k in ks})
            mine = placements_for(model, graph, sharding, len(group), memory_limit, training,
                                  None if hosts is None else [hosts[q] for q in group],
                                  nodes=nodes if layout.num_stages > 1 else None,
                                  batch_size=batch_size, ids=ids, wire_bytes=wire_bytes)
            placed.update(zip(ks, mine))
        placements = [placed[k] for k in range(len(found))]
        s = topo.stage(rank)
        share = _stage_ranks(topo, s).index(rank)  # this rank's part of its stage's tables
        router = Router(wire)
        group = _stage_ranks(topo, s)
        router.silent = frozenset(k for k, q in enumerate(group) if topo.tensor(q) != 0)
        parts, shards, inner = [], {}, {}
        for site, ((i, op), p, q) in enumerate(zip(found, placements, where)):
            if p.kind == "data" or q != s:
                continue
            holder = graph.nodes[i].op
            pooling = find_pooling(graph, i) if holder is op else _rs.pooling(holder, op)
            if (pooling is not None and pooling.node is not None
                    and stage_of.get(pooling.node, 0) != q):
                pooling = None  # the rows cross to the next stage: pooled there, per id
            part = TablePart(op, p, share, router, site, pooling)
            parts.append(part)
            if holder is not op:
                inner.setdefault(i, []).append(part)
                continue
            shards[i] = part
            if pooling is not None and pooling.node is not None:
                shards[pooling.node] = PoolTaken(graph.nodes[pooling.node].op, pooling)
        for i, held in inner.items():
            shards[i] = _rs.LayerTables(graph.nodes[i].op, held)
        self = cls(placements, parts, [], len(_stage_ranks(topo, s)), where, s, shards)
        self.pipelined = layout.num_stages > 1
        if isinstance(sharding, str) and sharding != "auto":
            self.note = applied(sharding, placements)
        self.router = router
        # The Embedding calls sharded in any stage: no tensor split takes them.
        self.nodes = {i for (i, _), p in zip(found, placements) if p.kind != "data"}
        if batch_size and layout.num_stages == 1:  # the plan's estimate, printed with it
            group = _stage_ranks(topo, s)
            lookups = {k: v * batch_size for k, v in lookups_per_sample(graph).items()}
            self.costs = _cost.costs(placements, len(group), lookups, ids,
                                     wire_bytes=wire_bytes,
                                     hosts=None if hosts is None else [hosts[q] for q in group])
        return self

    def color(self):
        """This rank's color in the split that makes the tables' communicator: its
        stage (the ranks of a stage look up together)."""
        return self.stage

    def bind(self, stage):
        """Positions, in `stage.trainable`, of the parts: their pairs stay on this rank."""
        where = {id(v): k for k, v in enumerate(stage.trainable)}
        self.positions = sorted(where[id(part.variable)] for part in self.parts)
        return self.positions

    def connect(self, comm):
        self.router.comm = comm

    def describe(self):
        """The plan, one block per pipeline stage holding tables; with one stage,
        its estimate per step too (when fit gave the batch); first, for one kind
        named for every table, the tables it applied to."""
        if self.note:
            return self.note + "\n" + self._describe()
        return self._describe()

    def _describe(self):
        if not self.pipelined:
            text = _plan.describe(self.placements, self.ranks)
            if not self.costs:
                return text
            return text + "\n" + _cost.describe(self.costs, self.ranks)
        return "\n".join(
            f"stage {s}: " + _plan.describe(
                [p for p, q in zip(self.placements, self.stages) if q == s], self.ranks)
            for s in sorted(set(self.stages)))

    def nbytes(self):
        """The bytes of the table rows this rank trains (weights only)."""
        return sum(part.nbytes for part in self.parts)

    # -- the whole tables' storage while fit trains (`whole`) -------------------
    def empty(self):
        """Drop every sharded table's whole copy on this rank (its part trains)."""
        for part in self.parts:
            _whole.empty(part)
        _whole.trim()

    def fill(self):
        """Every sharded table whole again in its Keras variable (collective)."""
        for part in self.parts:
            if part.emptied:
                _whole.fill(part)

    def emptied(self):
        """{id(Keras variable)} of the tables whose whole copy is dropped."""
        return {id(part.op.embeddings) for part in self.parts if part.emptied}

    def whole_weights(self):
        """{id(Keras variable): whole table} of the dropped tables, gathered from
        their owners (collective), for a checkpoint."""
        return {id(part.op.embeddings): part.gathered(part.variable.numpy(), 0)
                for part in self.parts if part.emptied}

