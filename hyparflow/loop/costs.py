"""Per-layer-call costs for a balance mode, and stage speeds, agreed by every rank: the
layer calls profiled on this machine (forward+backward time, parameter, optimizer and
activation bytes) and a rank's calibrated speed, for heterogeneous balancing.

On the training path (the trainer resolves `balance` with it); the planner's `profile`
builds on it, never the other way round. Models, layers and tensors are Keras's and TensorFlow's
(untyped: Any)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from .. import _compat
from .. import settings
from ..balance import Resolved
from ..engine import norms as _norms
from ..graph import LayerGraph, Tensor, sized
from ..topology import Topology

if TYPE_CHECKING:
    from ..engine.comm import Communicator
    from ..layout import Layout

__all__ = ["MODES", "resolve", "measured_shares", "LayerProfile", "profile", "calibrate",
           "optimizer_slots", "slowdown"]

MODES = ("estimate", "params", "time", "memory")


def resolve(graph: LayerGraph, model: Any, comm: Communicator,
            balance: Union[None, str, Sequence[int]], layout: Layout, *,
            speeds: Union[None, str, Sequence[float]] = None,
            memory_limit: Optional[float] = None,
            microbatch: int = 32) -> Union[Sequence[int], Resolved]:
    """Turn `balance` (None, a mode, or counts) and `speeds` (None, "measure" or one
    number per stage) into what `partition` takes. Collective: profiling and
    calibration run on this machine's ranks and their results are shared, so every
    rank cuts the model the same way. `layout`: the run's (hyparflow.layout.Layout)."""
    num_stages = layout.num_stages
    chunks: int = getattr(layout, "num_chunks", 1)
    if chunks > 1 and memory_limit is not None:
        raise NotImplementedError(
            f"memory_limit={memory_limit} with schedule='interleaved' is not supported yet (the "
            f"limit is per rank, which holds {chunks} chunks). Leave memory_limit out, or "
            "use schedule='1f1b'.")
    if balance is not None and not isinstance(balance, str) and speeds is None and memory_limit is None:
        return balance  # explicit counts
    mode = balance or "estimate"
    if mode not in MODES:
        raise ValueError(f"`balance` must be one of {MODES}, None or a list of counts. "
                         f"Received: balance={balance!r}")
    profiles: List[LayerProfile] = []
    if mode in ("time", "memory") or memory_limit is not None:
        profiles = comm.bcast_obj(profile(graph, model, batch=microbatch)
                                  if comm.rank == 0 else None, 0)
    costs: List[float]
    if mode == "estimate":
        costs = [n.cost for n in graph.nodes]
    elif mode == "params":
        costs = [float(max(n.params, 1)) for n in graph.nodes]  # weightless calls still count a little
    elif mode == "time":
        costs = [p.seconds for p in profiles]
    else:
        costs = [_memory(p, microbatch, num_stages) for p in profiles]
    per_stage: Optional[Sequence[float]]
    if speeds == "measure":
        rates: List[float] = comm.allgather_obj(calibrate())
        # A stage is as fast as its slowest rank (its T tensor ranks share the work).
        topo = _topology(layout)
        per_stage = [min(rate for r, rate in enumerate(rates) if topo.stage(r) == s)
                     for s in range(num_stages)]
    elif isinstance(speeds, str):
        raise ValueError(f"`speeds` must be \"measure\", None or one number per stage. "
                         f"Received: speeds={speeds!r}")
    elif speeds is not None and len(speeds) != num_stages:
        raise ValueError(f"`speeds` needs one value per stage ({num_stages}). Received: {speeds}")
    else:
        per_stage = speeds
    memory = [float(_memory(p, microbatch, num_stages)) for p in profiles] if memory_limit else None
    if per_stage is not None and chunks > 1:
        per_stage = [per_stage[j % num_stages] for j in range(num_stages * chunks)]  # per chunk
    return {"costs": costs, "speeds": list(per_stage) if per_stage is not None else None,
            "memory": memory, "limit": memory_limit}


def measured_shares(comm: Communicator, layout: Layout) -> List[float]:
    """tensor_shares="measure": each rank's calibrated speed, shared by all; a tensor
    rank's share is its speed (the slowest over replicas, whose parts must match),
    per stage. Returns this rank's stage's shares (collective)."""
    rates: List[float] = comm.allgather_obj(calibrate())
    topo = _topology(layout)
    stage = topo.stage(comm.rank)
    return [min(rates[r] for r in topo.stage_ranks(stage, t)) for t in range(layout.num_tensor)]


def _topology(layout: Layout) -> Topology:
    return Topology(layout.num_stages, layout.num_replicas, layout.num_tensor)


def _memory(p: LayerProfile, microbatch: int, num_stages: int) -> int:
    """Bytes a layer call holds on its rank: weights, optimizer state, and the
    activations of the microbatches in flight (at most S with 1F1B)."""
    return p.param_bytes + p.optimizer_bytes + p.activation_bytes * microbatch * num_stages


@dataclass
class LayerProfile:
    name: str
    seconds: float          # forward + backward of one call on `batch` samples
    batch: int
    param_bytes: int        # weights first used by this call (a shared layer counts once)
    optimizer_bytes: int    # optimizer state for those weights
    activation_bytes: int   # output bytes per sample (kept for the backward)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def slowdown() -> float:
    """HYPARFLOW_SLOWDOWN=f makes this rank f times slower (a test stand-in for a slower
    CPU: every stage computation and the calibration sleep (f-1) times their duration)."""
    return settings.slowdown()


def optimizer_slots(optimizer: Any) -> int:
    """How many per-weight state tensors `optimizer` keeps (SGD 0, momentum 1, Adam 2)."""
    import keras

    probe = optimizer.__class__.from_config(optimizer.get_config())
    weight = keras.Variable(np.zeros((3,), "float32"), name="probe")
    probe.build([weight])
    return sum(1 for v in probe.variables if tuple(v.shape) == (3,))


def _dummy(tensor: Tensor, batch: int) -> Any:
    """Random (or zero) values of `tensor`'s shape for `batch` samples (`graph.sized`)."""
    shape = sized(tensor.shape, batch)
    if tensor.floating:
        return tf.random.normal(shape, dtype=tf.as_dtype(tensor.dtype))
    return tf.zeros(shape, dtype=tf.as_dtype(tensor.dtype))


def profile(graph: LayerGraph, model: Any, batch: int = 32, repeats: int = 3) -> List[LayerProfile]:
    """Measure every layer call of `graph` alone, eagerly, on random inputs of `batch`
    samples (median of `repeats` after one warm-up)."""
    slots = optimizer_slots(model.optimizer) if getattr(model, "optimizer", None) else 0
    seen: set[int] = set()
    out: List[LayerProfile] = []
    factor = slowdown()
    # Timed as a stage runs them (BatchNormalization through the fused kernel).
    fused = _norms.fused_nodes(graph, range(len(graph.nodes)))
    for index, node in enumerate(graph.nodes):
        op = node.op
        call = fused.get(index)
        if graph.functional is None:
            inputs = [_dummy(graph.tensors[t], batch) for t in node.inputs]
            args: Any = [inputs[0] if len(inputs) == 1 else inputs]
            kwargs: Any = {}
            floats = inputs
        else:
            values = {id(graph.tensors[t].keras_tensor): _dummy(graph.tensors[t], batch)
                      for t in node.inputs}
            args, kwargs = _compat.fill_in(node.keras_node, values)
            floats = [v for v in values.values() if v.dtype.is_floating]
        variables = list(getattr(op, "trainable_weights", ()))

        def run() -> None:
            with tf.GradientTape() as tape:
                tape.watch(floats)
                out_ = (call(args, kwargs) if call is not None
                        else _compat.call_operation(op, args, kwargs, True))
                flat = [o for o in _compat.tree.flatten(out_) if o.dtype.is_floating]
                target = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in flat]) if flat else None
            if target is not None and (variables or floats):
                tape.gradient(target, variables + floats)

        run()
        times: List[float] = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * factor)
        weights = [v for v in getattr(op, "weights", ()) if id(v) not in seen]
        seen.update(id(v) for v in weights)
        params = sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype) if v.dtype != "bfloat16" else "float16").itemsize
                     for v in weights)
        trainable = sum(int(np.prod(v.shape)) * 4 for v in weights if v.trainable)
        acts = sum(int(np.prod([d or 1 for d in graph.tensors[t].shape[1:]])) *
                   (2 if graph.tensors[t].dtype in ("bfloat16", "float16") else 4) for t in node.outputs)
        out.append(LayerProfile(node.name, statistics.median(times), batch, params,
                                trainable * slots, acts))
    return out


def calibrate(seconds: float = 0.2) -> float:
    """This rank's speed: matrix multiplies per second on its threads (relative units)."""
    a = tf.random.normal((256, 256))
    fn = tf.function(lambda x: tf.matmul(x, x))
    fn(a).numpy()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn(a).numpy()
        count += 1
    elapsed = time.perf_counter() - start
    factor = slowdown()
    if factor > 1:
        time.sleep((factor - 1) * elapsed)
        elapsed *= factor
    return count / elapsed
