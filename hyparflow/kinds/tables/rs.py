"""keras_rs's `DistributedEmbedding` (an optional extra: `pip install -e ".[rs]"`):
off TPU it is one Keras layer holding an `EmbedReduce` (an Embedding that pools a bag
with its table's combiner) per table and calling each on its features. Its tables are
the units hyparflow shards, named by their `TableConfig.name`: each sharded one is a
`TablePart` whose pooled lookup stands in for its EmbedReduce's call while the
DistributedEmbedding's own call runs (`LayerTables`, the stage's shard at that node).

keras_rs is not imported here: a model without it never meets this module's classes."""

from typing import Any, Dict, List, Optional, Tuple

from ... import _compat
from .pooled import Pooling

__all__ = ["is_distributed", "tables", "why_not", "pooling", "ids_per_sample", "LayerTables"]


def is_distributed(op: Any) -> bool:
    return any(c.__name__ == "DistributedEmbedding" and c.__module__.startswith("keras_rs")
               for c in type(op).__mro__)


def _features(op: Any, table: Any) -> Dict[Any, Any]:
    """{feature path: FeatureConfig} of `table` (an EmbedReduce of `op`)."""
    configs = op.__dict__.get("_placement_to_path_to_feature_config", {})
    layers = op.__dict__.get("_default_device_embedding_layers", {})
    return {path: configs.get("default_device", {}).get(path)
            for path, layer in layers.items() if layer is table}


def tables(op: Any) -> List[Any]:
    """The EmbedReduce layers of DistributedEmbedding `op` (its tables off TPU), each once."""
    out: List[Any] = []
    for layer in op.__dict__.get("_default_device_embedding_layers", {}).values():
        if all(layer is not t for t in out):
            out.append(layer)
    return out


def why_not(graph: Any, i: int, table: Any) -> Optional[str]:
    """Why `table` of DistributedEmbedding node `i` cannot be sharded, or None."""
    node = graph.nodes[i]
    op = node.op
    if sum(n.op is op for n in graph.nodes) != 1:
        return f"its DistributedEmbedding {op.name!r} is called more than once"
    arguments = node.keras_node.arguments
    if len(arguments.args) > 1 or arguments.kwargs.get("weights") is not None:
        return (f"its DistributedEmbedding {op.name!r} is called with per-id weights "
                "(a weighted pooling is not sharded yet)")
    features = _features(op, table)
    if len(features) != 1:
        return (f"it serves {len(features)} features of DistributedEmbedding {op.name!r} "
                f"({', '.join(sorted(map(str, features)))}): a shared table is not sharded yet")
    if table.combiner not in ("sum", "mean", "sqrtn"):
        return f"its combiner {table.combiner!r} is not one hyparflow pools"
    return None


def _input_shape(op: Any, table: Any) -> Tuple[Any, ...]:
    config = next(iter(_features(op, table).values()))
    return tuple(config.input_shape) if config is not None else ()


def pooling(op: Any, table: Any) -> Optional[Pooling]:
    """The table's pooled lookup (its combiner over a (batch, bag) feature), or None
    (1D ids: EmbedReduce does not reduce; the per-id lookup is its result)."""
    if len(_input_shape(op, table)) != 2 or table.compute_dtype != "float32":
        return None
    return Pooling(table.combiner, False, None)


def ids_per_sample(op: Any, table: Any) -> int:
    shape = _input_shape(op, table)
    return int(shape[1]) if len(shape) == 2 and shape[1] else 1  # 1D ids: one


class LayerTables:
    """The shard of a DistributedEmbedding's call: its sharded tables' parts, each
    part's lookup in place of its EmbedReduce's call, the layer's own call around
    them (its routing of features to tables, its output structure are keras_rs's).
    Answers the engine's questions of a shard for all its parts (a slot's axis
    carries which part holds it)."""

    def __init__(self, op: Any, parts: List[Any]) -> None:
        self.op, self.parts = op, list(parts)

    @property
    def replaces(self) -> Dict[int, Any]:
        return {k: v for part in self.parts for k, v in part.replaces.items()}

    def load(self) -> None:
        for part in self.parts:
            part.load()

    def gather(self) -> None:
        for part in self.parts:
            part.gather()

    def slots(self, optimizer: Any) -> List[Tuple[Any, Tuple[int, Any]]]:
        return [(slot, (k, axis)) for k, part in enumerate(self.parts)
                for slot, axis in part.slots(optimizer)]

    def gathered(self, value: Any, how: Tuple[int, Any]) -> Any:
        return self.parts[how[0]].gathered(value, how[1])

    def sliced(self, value: Any, how: Tuple[int, Any]) -> Any:
        return self.parts[how[0]].sliced(value, how[1])

    def __call__(self, args: Any, kwargs: Dict[str, Any], training: Optional[bool] = None) -> Any:
        replaced: Any = _compat.calls_replaced  # an untyped context manager
        with replaced({part.op: part.replacement() for part in self.parts}):
            return _compat.call_operation(self.op, args, kwargs, training)  # type: ignore[arg-type]
