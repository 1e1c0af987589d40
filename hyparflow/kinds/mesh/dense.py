"""Dense on the mesh (SUMMA, as Optimus's 2D layers): rank (i, j) holds kernel block
(i, j), [in/q, out/q]; its input is the [batch/q, in/q] block (i, j) of the layer's
input and its output the [batch/q, out/q] block (i, j), so consecutive mesh layers pass
blocks with no gather in between.

Forward, for k = 0..q-1: the input's block (i, k) is broadcast in row i and the
kernel's block (k, j) in column j; Y_ij = sum_k X_ik W_kj. Backward: the input's
gradient dX_ik = sum_j dY_ij W_kj^T (W_kj broadcast in column j, the products summed
in row i onto (i, k)), the kernel's dW_kj = sum_i X_ik^T dY_ij (X_ik broadcast in row
i, the products summed in column j onto (k, j)). The bias block j is one copy per rank
of column j, its gradient summed over the column."""

import keras
import tensorflow as tf

from ...engine import order as _order
from ..tensor.split import common_why_not, qualified, weights_of
from .base import ENTER, GATHER, MeshKind, elementwise
from .grid import is_block, mark, sizes_of, whole_of
from .part import BLOCK, COLUMN

__all__ = ["MeshDense", "MeshEinsum", "dense_equation", "summa"]

# Roles of a Dense's collectives (`grid.mesh_tag`).
_X, _W, _BW, _BDX, _BX, _BDW, _BIAS = range(8, 15)


def _why_not_blocks(op, ins, outs, q):
    """Why a projection of `ins` to `outs` features cannot run on the q x q mesh's
    blocks (None: it can): what every kind refuses, too few features for the mesh's
    columns, or an activation that reads a whole row."""
    reason = common_why_not(op, [op])
    if reason is not None:
        return reason
    if min(ins, outs) < q:
        return (f"it has fewer input ({ins}) or output ({outs}) features than the mesh's "
                f"{q} columns")
    if not elementwise(op.activation):
        return (f"its activation {getattr(op.activation, '__name__', op.activation)!r} "
                "reads a whole row of features, which a block does not hold")
    return None


class MeshDense(MeshKind):
    name = "mesh-dense"
    what: "str | None" = "Dense"

    def products(self, in_bytes, weight_bytes):
        return [(in_bytes, weight_bytes)]

    def claims(self, op):
        return isinstance(op, keras.layers.Dense)

    def why_not(self, op, q):
        return _why_not_blocks(op, int(op.kernel.shape[0]), op.units, q)

    def cuts(self, op):
        return [(op.kernel, BLOCK)] + ([(op.bias, COLUMN)] if op.use_bias else [])

    def run(self, part, args, kwargs, training):
        op, mesh = part.op, part.coll
        x = args[0] if args else kwargs["inputs"]
        if not is_block(x):
            x = mesh.to_block(x, part.what, part.tag(ENTER))
        batch, _ = whole_of(x)
        x = tf.cast(x, op.compute_dtype) if x.dtype.is_floating else x
        weights = weights_of(part)
        y = summa(mesh, x, weights[0], sizes_of(int(op.kernel.shape[0]), mesh.q), part)
        if op.bias is not None:
            y = y + mesh.shared(weights[1], mesh.column, part.what, part.tag(_BIAS))
        if op.activation is not None:
            y = op.activation(y)
        y = mark(y, batch, int(op.kernel.shape[-1]))
        return mesh.to_whole(y, part.what, part.tag(GATHER)) if part.split.gather else y


_EINSUM_CALL = "keras.src.layers.core.einsum_dense.EinsumDense.call"


def dense_equation(equation):
    """Whether an EinsumDense `equation` is a Dense on the last axis: "...c,cd->...d"
    or "abc,cd->abd" (the input's axes kept in order, its last contracted with the
    kernel's first, the kernel's last the output's last)."""
    try:
        ins, out = equation.replace(" ", "").split("->")
        x, w = ins.split(",")
    except ValueError:
        return False
    return (len(w) == 2 and len(x) >= 2 and x[-1] == w[0] and out == x[:-1] + w[1]
            and w[1] not in x and len(set(x.replace("...", "."))) == len(x.replace("...", ".")))


class MeshEinsum(MeshDense):
    """An EinsumDense whose equation is a Dense on the last axis (`dense_equation`),
    with a bias on the output axis or none: run as a mesh Dense (SUMMA)."""
    name = "mesh-einsum"
    what = "EinsumDense (a projection of the last axis)"

    def claims(self, op):
        return isinstance(op, keras.layers.EinsumDense)

    def why_not(self, op, q):
        if qualified(type(op).call) != _EINSUM_CALL:
            return (f"its class {type(op).__name__} overrides EinsumDense.call, which the mesh "
                    "cannot follow")
        if not dense_equation(op.equation):
            return (f"its equation {op.equation!r} is not a projection of the last axis "
                    "(\"...c,cd->...d\"), which is what SUMMA multiplies")
        if op.bias is not None and tuple(op.bias.shape) != (int(op.kernel.shape[-1]),):
            return f"its bias (bias_axes={op.bias_axes!r}) is not on the output axis alone"
        ins, outs = (int(n) for n in op.kernel.shape)
        return _why_not_blocks(op, ins, outs, q)

    def cuts(self, op):
        return [(op.kernel, BLOCK)] + ([(op.bias, COLUMN)] if op.bias is not None else [])


def _mm(a, b, **transposed):
    """A product of numpy blocks by TensorFlow's kernels, on the rank's own threads
    (numpy's OpenBLAS starts its own per process: on an oversubscribed host their
    spinning threads made a step 20x slower)."""
    return tf.linalg.matmul(a, b, **transposed).numpy()


def summa(mesh, x, w, ins, part, base=_X):
    """Y_ij = sum_k X_ik W_kj on the q x q mesh (`ins`: the input features' block
    sizes), with the SUMMA backward. Each direction runs its exchanges in one
    `py_function`, step by step, so every rank makes them in the same order. `base`:
    the first of the six roles (`grid.mesh_tag`) its exchanges take (a layer making
    several products gives each its own, as TensorFlow may run them at once)."""
    q, what = mesh.q, part.what
    _X, _W, _BW, _BDX, _BX, _BDW = range(base, base + 6)

    def forward(xv, wv):
        xv, wv = xv.numpy(), wv.numpy()
        i, j = mesh.coords
        x2 = xv.reshape(-1, xv.shape[-1])
        y = None
        for k in range(q):
            a, ra = mesh.post_bcast(x2, i * q + k, mesh.row(), (x2.shape[0], ins[k]), x2.dtype,
                                    part.tag(_X))
            b, rb = mesh.post_bcast(wv, k * q + j, mesh.column(), (ins[k], wv.shape[1]),
                                    wv.dtype, part.tag(_W))
            mesh.wait(ra + rb, what)
            y = _mm(a, b) if y is None else y + _mm(a, b)
        return y.reshape(xv.shape[:-1] + (wv.shape[1],))

    def backward(dyv, xv, wv):
        dyv, xv, wv = dyv.numpy(), xv.numpy(), wv.numpy()
        i, j = mesh.coords
        dy2, x2 = dyv.reshape(-1, dyv.shape[-1]), xv.reshape(-1, xv.shape[-1])
        dx = dw = None
        for k in range(q):  # dX_ik = sum_j dY_ij W_kj^T, onto (i, k)
            b, rb = mesh.post_bcast(wv, k * q + j, mesh.column(), (ins[k], wv.shape[1]),
                                    wv.dtype, part.tag(_BW))
            mesh.wait(rb, what)
            total = mesh.reduce(_mm(dy2, b, transpose_b=True), i * q + k, mesh.row(), what,
                                part.tag(_BDX))
            dx = total if total is not None else dx
        for k in range(q):  # dW_kj = sum_i X_ik^T dY_ij, onto (k, j)
            a, ra = mesh.post_bcast(x2, i * q + k, mesh.row(), (x2.shape[0], ins[k]),
                                    x2.dtype, part.tag(_BX))
            mesh.wait(ra, what)
            total = mesh.reduce(_mm(a, dy2, transpose_a=True), k * q + j, mesh.column(), what,
                                part.tag(_BDW))
            dw = total if total is not None else dw
        return dx.reshape(xv.shape).astype(xv.dtype), dw.astype(wv.dtype)

    @_order.custom_gradient
    def op(x, w):
        y = _order.py_function(forward, [x, w], x.dtype)
        y.set_shape(x.shape[:-1].concatenate([w.shape[-1]]))

        def grad(dy):
            dx, dw = _order.py_function(backward, [dy, x, w], [x.dtype, w.dtype])
            dx.set_shape(x.shape)
            dw.set_shape(w.shape)
            return dx, dw

        return y, grad

    return op(x, w)
