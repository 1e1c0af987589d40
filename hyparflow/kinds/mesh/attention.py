"""MultiHeadAttention on the mesh (Optimus's 2D attention): the heads go over the mesh
columns, the batch rows over the mesh rows. Rank (i, j) holds, of the query, key and
value projections' kernels [in, heads, size], the block (input features i, heads j),
and of the output projection's kernel [heads, size, out] the block (heads i, out j).

Each projection is a SUMMA product (`dense.summa`) of the input's [batch/q, seq, in/q]
block with the kernel viewed as [in, heads * size]: its output block (i, j) is batch
rows i of heads j, whole heads because the heads divide by q. The attention itself
(scores, mask, softmax, the weighted values) is then local: a rank holds every query
and key position of its rows' heads, so it runs Keras's own `_compute_attention` on
them with no exchange. Its output [batch/q, seq, heads/q, size] flattened is block
(i, j) of the output projection's input [batch, seq, heads * size], which is what
SUMMA takes, so the output projection follows with no gather in between.

An attention mask given as a value (`attention_mask=`, whole on every rank, as the
replicated layers before the mesh make it) and the Keras masks of the query, value and
key (padding from a `mask_zero` Embedding; whole, as a block carries them: `grid`) are
cut to the rank's batch rows; a causal mask is made for the rank's rows as Keras makes
it."""

import inspect
from typing import Any, List, Optional, Tuple

import keras
import tensorflow as tf

from ... import _compat
from ..tensor.split import common_why_not, qualified, weights_of
from .base import ENTER, GATHER, MeshKind
from .dense import summa
from .grid import is_block, mark, rows_of, sizes_of, whole_of
from .part import BLOCK, COLUMN, HEADS, HEADS_BLOCK, MeshPart

__all__ = ["MeshHeads"]

# Roles (`grid.mesh_tag`): six per SUMMA product and one per bias, for each projection.
_PROJECTIONS = ("query", "key", "value", "output")
_BASE = {name: 8 + 8 * k for k, name in enumerate(_PROJECTIONS)}  # 8, 16, 24, 32
_BIAS = 6  # after a product's six roles

_CALL = "keras.src.layers.attention.multi_head_attention.MultiHeadAttention.call"
_METHODS = ("_compute_attention", "_masked_softmax", "_compute_attention_mask",
            "_compute_causal_mask")


def _parts(op: Any) -> dict:
    return _compat.attention_parts(op)


class MeshHeads(MeshKind):
    name = "mesh-heads"
    what = "MultiHeadAttention"

    def products(self, in_bytes: float, weight_bytes: float) -> List[Tuple[float, float]]:
        # The query, key, value and output projections, a quarter of the weights each
        # (the output projection's input, heads x size, taken as wide as the query's).
        return [(in_bytes, weight_bytes / 4)] * 4

    def claims(self, op: Any) -> bool:
        return isinstance(op, keras.layers.MultiHeadAttention)

    def weights(self, op: Any) -> List[Any]:
        return op.weights

    def why_not(self, op: Any, q: int) -> Optional[str]:
        parts = _parts(op)
        if any(parts.get(name) is None for name in _PROJECTIONS):
            return "it is not built (call the model once first)"
        dense = [parts[name] for name in _PROJECTIONS]
        cls, base = type(op), keras.layers.MultiHeadAttention
        if qualified(cls.call) != _CALL or any(getattr(cls, m, None) is not getattr(base, m)
                                              for m in _METHODS):
            return (f"its class {cls.__name__} overrides MultiHeadAttention's call or "
                    "attention, which the mesh cannot follow head by head")
        reason = common_why_not(op, [op] + dense)
        if reason is not None:
            return reason
        if "gate" in parts:
            return "its gated output (use_gate) is not on the mesh yet"
        if op.dropout > 0:
            return ("dropout on its attention probabilities is not on the mesh yet (the mask "
                    "one process draws would have to be cut by rows and heads)")
        if any(len(d.kernel.shape) != 3 for d in dense) or len(parts["axes"]) != 1:
            return ("it attends over more than one axis or has a multi-axis output_shape; "
                    "the mesh cuts [batch, sequence, features] values")
        if op.num_heads % q:
            return (f"its {op.num_heads} heads do not divide over the mesh's {q} columns "
                    "(each column takes whole heads, the same number)")
        ins = [int(d.kernel.shape[0]) for d in dense[:3]] + [int(dense[3].kernel.shape[-1])]
        if min(ins) < q:
            return (f"it has fewer features ({min(ins)}) than the mesh's {q} columns")
        return None

    def cuts(self, op: Any) -> List[Tuple[Any, str]]:
        parts, out = _parts(op), []
        for name in _PROJECTIONS[:3]:
            layer = parts[name]
            out.append((layer.kernel, HEADS_BLOCK))
            if layer.bias is not None:
                out.append((layer.bias, HEADS))
        layer = parts["output"]
        out.append((layer.kernel, BLOCK))  # [heads, size, out]: heads by i, out by j
        if layer.bias is not None:
            out.append((layer.bias, COLUMN))
        return out

    def run(self, part: MeshPart, args: Any, kwargs: Any, training: Any) -> Any:
        op, mesh = part.op, part.coll
        bound = inspect.signature(_compat.original_call(op)).bind(*args, **kwargs)
        given = bound.arguments
        if given.get("return_attention_scores"):
            raise ValueError(
                f"Attention layer {op.name!r} is on the {mesh.q}x{mesh.q} tensor mesh and was "
                "asked for its attention scores, which the mesh holds by rows and heads. "
                "Leave it out of tensor_layers, or leave tensor_mesh out.")
        query, value = given["query"], given["value"]
        key = given.get("key")
        # The Keras masks as Keras's call takes them: the query's own (always), the value's
        # and the key's unless given; whole, as masks stay (`grid`), cut to the rows below.
        masks = {"query_mask": _compat.get_mask(query),
                 "value_mask": _given_or(given, "value_mask", value),
                 "key_mask": _given_or(given, "key_mask", key)}
        key = value if key is None else key
        entered = {}

        def block(x: Any, k: int) -> Any:
            if is_block(x):
                return x
            if id(x) not in entered:  # self-attention: query = value entered once
                entered[id(x)] = mesh.to_block(x, part.what, part.tag(ENTER + k))
            return entered[id(x)]

        query, key, value = block(query, 1), block(key, 2), block(value, 3)
        batch, _ = whole_of(query)
        i, _ = mesh.coords
        mask = given.get("attention_mask")
        for name, value_ in [("attention_mask", mask)] + list(masks.items()):
            if value_ is not None and is_block(value_):
                raise ValueError(f"Attention layer {op.name!r}: its {name} comes from the "
                                 "tensor mesh as blocks; make the mask outside it.")

        def rows(m: Any) -> Any:  # this rank's batch rows of a whole mask
            if m is None:
                return None
            lo, hi = rows_of(tf.shape(m)[0], mesh.q, i)
            return m[lo:hi]

        mask = rows(mask)
        masks = {name: rows(m) for name, m in masks.items()}
        causal = bool(given.get("use_causal_mask", False))
        weights = iter(weights_of(part))
        parts = _parts(op)
        projected = {}
        for name, x in (("query", query), ("key", key), ("value", value)):
            projected[name] = _project(part, parts[name], x, weights, _BASE[name])
        causal_only = (causal and mask is None and all(m is None for m in masks.values())
                       and op._sliding_window is None)
        if causal_only:
            extra, mask = {"use_causal_mask": True}, None
        else:
            extra = {}
            mask = op._compute_attention_mask(query, value, attention_mask=mask,
                                              use_causal_mask=causal, **masks)
        out, _ = op._compute_attention(projected["query"], projected["key"], projected["value"],
                                       mask, training, False, **extra)
        y = _project(part, parts["output"], out, weights, _BASE["output"], output=True)
        y = mark(y, batch, int(parts["output"].kernel.shape[-1]))
        return mesh.to_whole(y, part.what, part.tag(GATHER)) if part.split.gather else y


def _given_or(given: dict, name: str, tensor: Any) -> Any:
    """A mask argument as Keras's `Layer.__call__` fills it: the one given, else the
    Keras mask of its tensor (None without one)."""
    if given.get(name) is not None:
        return given[name]
    return None if tensor is None else _compat.get_mask(tensor)


def _project(part: MeshPart, layer: Any, x: Any, weights: Any, base: int,
             output: bool = False) -> Any:
    """One projection's SUMMA product on this rank's blocks: `x` [rows, seq, in/q] by the
    kernel block [in/q, heads/q, size] (query, key, value: [rows, seq, heads/q, size]
    out), or `x` [rows, seq, heads/q, size] by [heads/q, size, out/q] (the output
    projection: [rows, seq, out/q] out); its bias block shared over the column."""
    mesh, q = part.coll, part.q
    kernel = next(weights)
    x = tf.cast(x, kernel.dtype)
    if output:
        heads, size = int(layer.kernel.shape[0]), int(layer.kernel.shape[1])
        x = tf.reshape(x, tf.concat([tf.shape(x)[:2], [-1]], 0))
        ins = [h * size for h in sizes_of(heads, q)]
        y = summa(mesh, x, tf.reshape(kernel, (-1, kernel.shape[-1])), ins, part, base)
    else:
        ins = sizes_of(int(layer.kernel.shape[0]), q)
        flat = tf.reshape(kernel, (kernel.shape[0], -1))
        y = summa(mesh, x, flat, ins, part, base)
        y = tf.reshape(y, tf.concat([tf.shape(y)[:2], kernel.shape[1:]], 0))
    if layer.bias is not None:
        y = y + mesh.shared(next(weights), mesh.column, part.what, part.tag(base + _BIAS))
    if layer.activation is not None:
        y = layer.activation(y)
    return y
