"""The public entry points: fit, evaluate, predict and the rank helpers."""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Sequence, Union

from . import inference, trainer
from .options import FitOptions
from .. import layout as _layout
from .. import settings
from ..engine.errors import user_errors
from ..engine.comm import wrap
from ..engine.prepare import agree_on_error

__all__ = ["fit", "evaluate", "predict", "rank", "size", "is_main"]

# None or a mode ("estimate", "time", "params", "memory"), or layer calls per stage.
Balance = Union[None, str, Sequence[int]]
# None (even), "measure", or one relative share per tensor rank.
Shares = Union[None, str, Sequence[float]]


def _agree_bad_call(call: str) -> Any:
    """For a call of `call` whose arguments do not fit: raise its error on every rank
    together (collective over the call's communicator), printed once by the first."""
    def agree(error: Exception, kwargs: dict[str, Any]) -> None:
        comm = kwargs.get("comm")
        communicator, owned = wrap(comm if "comm" in kwargs else None, call)
        try:
            agree_on_error(communicator, error)
        finally:
            if owned:
                communicator.free()
        raise error   # pragma: no cover - agree_on_error raised it

    return agree


def _call(call: str, comm: Any, arguments: dict[str, Any],
          body: Callable[[Any, _layout.Layout], Any]) -> Any:
    """What fit, evaluate and predict share: the communicator (the world, or `comm`),
    the call's layout resolved on it, `body(communicator, layout)`, and the
    communicator freed if this call made it."""
    communicator, owned = wrap(comm, call)
    try:
        return body(communicator, _resolve(communicator, **arguments))
    finally:
        if owned:
            communicator.free()


def _resolve(communicator: Any, **arguments: Any) -> _layout.Layout:
    """The call's layout, or its error raised on every rank together (printed once, by
    the first rank); rank 0 warns where a launcher's count lost to an argument."""
    layout: Optional[_layout.Layout] = None
    error: Optional[Exception] = None
    try:
        layout = _layout.resolve(communicator.size, **arguments)
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    agree_on_error(communicator, error)
    assert layout is not None   # else agree_on_error raised
    if communicator.rank == 0:
        _layout.warn_overridden(layout)
    return layout


@user_errors("hf.fit", _agree_bad_call("hf.fit"))
def fit(model: Any, x: Any, y: Any = None, *, batch_size: Optional[int] = None, epochs: int = 1,
        num_stages: Optional[int] = None, num_replicas: Optional[int] = None,
        num_microbatches: Optional[int] = None, shuffle: bool = True,
        seed: Optional[int] = None, verbose: Union[int, str] = "auto",
        callbacks: Optional[Sequence[Any]] = None, balance: Balance = None,
        comm: Any = None, sample_weight: Any = None, class_weight: Any = None,
        schedule: Optional[str] = None, run_eagerly: Optional[bool] = None,
        recompute: bool = False, trace: Optional[str] = None, validation_data: Any = None,
        validation_split: float = 0.0, validation_freq: Union[int, Sequence[int]] = 1,
        initial_epoch: int = 0, steps_per_epoch: Optional[int] = None,
        validation_batch_size: Optional[int] = None, validation_steps: Optional[int] = None,
        checkpoint_dir: Optional[str] = None, checkpoint_every: Union[int, str] = "epoch",
        keep: int = 3, resume: bool = False, check_finite: bool = True,
        speeds: Union[None, str, Sequence[float]] = None, memory_limit: Optional[float] = None,
        plan: Optional[str] = None, num_tensor: Optional[int] = None,
        tensor_layers: Optional[Sequence[str]] = None, tensor_shares: Shares = None,
        num_chunks: Optional[int] = None, replica_sync: Any = "allreduce",
        tensor_mesh: Any = None, embedding_sharding: Any = None,
        communication_dtype: Any = None, threads_per_rank: Optional[int] = None,
        data_service: Optional[str] = None,
        data_service_mode: Optional[Literal["exact", "dynamic"]] = None) -> Any:
    """Train a compiled Keras model with S stages x R replicas x M microbatches
    (x T tensor ranks per stage).

    Call it on every rank with the same arguments, as `model.fit` on one
    process; launch with `mpiexec -n S*T*R python script.py` (one process works
    too). The model's layer calls are cut into `num_stages` contiguous
    stages, one per rank; the pipeline is copied `num_replicas` times
    (default: world size // num_stages); each global batch of `batch_size`
    samples is cut into `num_replicas` contiguous slices, each of those into
    `num_microbatches` contiguous microbatches. Gradients are accumulated over
    microbatches and summed over replicas, each microbatch's loss weighted by
    its share of the global batch, so training gives the weights one process
    gets with `model.fit(x, y, batch_size=batch_size)` (to float round-off).

    Args:
        model: a compiled Keras 3 model (Functional or Sequential to pipeline it;
            a subclassed model trains with num_stages=1). Its optimizer, loss
            (per-output losses and loss_weights included) and metrics are used.
        x, y: numpy arrays, or lists / dicts (by input / output name) of them.
        batch_size: the global batch, as in `model.fit` (None: 32; a dataset,
            PyDataset or generator gives its own batches).
        epochs: number of passes over the data.
        num_stages: pipeline stages (S); None: $HYPARFLOW_NUM_STAGES, else 1.
        num_replicas: data-parallel copies (R); None: $HYPARFLOW_NUM_REPLICAS,
            else world size // S.
        num_microbatches: microbatches per replica per step (M); None:
            $HYPARFLOW_NUM_MICROBATCHES, else 1.
        num_tensor: ranks per stage (T) that split its widest layers between
            them (tensor parallelism); None: $HYPARFLOW_NUM_TENSOR, else 1.
        tensor_layers: names of the layers to split (Dense, Conv2D, Embedding);
            None: every one with at least `hyparflow.tensor.MIN_PARAMS` weights.
        tensor_shares: each tensor rank's share of a split layer (T numbers,
            e.g. relative speeds; "measure": a short calibration); None: even.
        tensor_mesh: (q, q) (or "qxq"): the T = q * q tensor ranks of a stage as a
            2D mesh (Optimus), activations cut by rows and features too; None:
            $HYPARFLOW_TENSOR_MESH, else the 1D split (docs/tensor.md).
        shuffle: one permutation per epoch, the same on every rank, from `seed`.
        seed: the shuffling seed; None draws one on rank 0 and shares it.
        verbose: 0, 1, 2 or "auto", as in `model.fit`; the progress bar is
            printed by rank 0 only, with global values. "auto" is 1 (Keras's bar)
            when the output is a terminal (the launcher's, under mpiexec or srun),
            else 2 (one line per epoch, no escape codes).
        callbacks: Keras callbacks; they run on every rank with the global logs.
        balance: how to cut the layer calls into stages: None or "estimate"
            (estimated compute, no measuring), "time" (each call profiled here),
            "params", "memory" (weights + optimizer state + activations in
            flight), or a list with the number of layer calls of each stage.
        speeds: relative speed of each stage's ranks ("measure": a short
            calibration on every rank), so a faster rank gets more work.
        memory_limit: bytes per rank that no stage may exceed (with `balance`).
        plan: a plan file (see `hyparflow plan`): a strategy file (docs/strategy.md:
            each layer call's stage and split, each stage's recompute) or a plan file
            of the format before; stages with their layer calls, replicas,
            microbatches, schedule and tensor split from it. An argument
            that contradicts it is an error. The layout is resolved once, from the
            arguments, then the plan, then $HYPARFLOW_NUM_*, then the world size
            (see `hyparflow.layout`).
        comm: an mpi4py communicator (default MPI.COMM_WORLD) or a
            `hyparflow.comm.Communicator`.
        sample_weight, class_weight: as in `model.fit`.
        schedule: None or "1f1b" (the default: one forward, one backward, at most S
            microbatches alive per stage), "gpipe" (all forwards, then all
            backwards), "1f1b-w", "zb-h1" or "zb-batched" (the backward split
            into B, the inputs' gradients, and W, the Dense kernels' gradients:
            "1f1b-w" computes every W in one call at the end, over the whole
            batch's rows; "zb-h1" and "zb-batched" fill the pipeline's waits
            with them), "interleaved" (Megatron-LM's interleaved 1F1B: each rank
            runs `num_chunks` model chunks, the model being cut into S x
            num_chunks virtual stages; bubble (S-1)/(num_chunks M) instead of
            (S-1)/M; needs M a multiple of S), or "auto" (tries 1f1b, 1f1b-w,
            zb-h1 and zb-batched for two steps each, then keeps the fastest). All
            give the same weights; see docs/performance.md for speed and memory.
        num_chunks: model chunks per rank for schedule="interleaved" (>= 2);
            None: 1, or the plan's.
        run_eagerly: run stages eagerly instead of as tf.functions (debugging);
            None follows `model.run_eagerly`.
        recompute: keep only each stage's inputs per microbatch and recompute
            its forward in the backward (less memory, one more forward).
        trace: a path; every action on every rank is recorded and written there
            by rank 0 as Chrome-trace JSON (see `hyparflow trace`).
        validation_data: as in `model.fit`; so are validation_split,
            validation_freq, validation_batch_size, validation_steps,
            initial_epoch and steps_per_epoch;
            validation runs pipeline-parallel with the same partition.

        checkpoint_dir, checkpoint_every, keep: write a distributed checkpoint
            every `checkpoint_every` steps (or "epoch") into `checkpoint_dir`,
            keeping the newest `keep`; SIGTERM / SIGUSR1 then make every rank
            finish its step, write one, and raise `Preempted` (exit code 75).
        resume: continue from the newest valid checkpoint in `checkpoint_dir`
            (any number of stages and replicas may load it); none there means
            starting from the beginning.
        check_finite: refuse numpy inputs or targets with NaN or infinity.
        replica_sync: how the replicas keep in step: "allreduce" (the default:
            gradients summed every step, the exact contract above),
            `hf.LocalSGD(every=k)` (each replica steps on its own slice, weights
            averaged every k steps) or `hf.LeaderSGD(pull=0.1, local_every=64,
            global_every=128)` (replicas pulled toward the one with the lowest
            training loss); see docs/replicas.md for what each promises. The
            returned model is then the replicas' mean (LocalSGD) or the global
            leader's (LeaderSGD), and the History has a `replicas` attribute.
        embedding_sharding: shard the model's Embedding tables over the ranks of
            their pipeline stage (its replicas and tensor ranks, at least 2) while
            the other layers stay data-parallel (and may be pipelined): "auto" (each
            table's kind and ranks chosen by its estimated cost per step, the owners'
            load from the first batches' ids, under `memory_limit`; printed on rank
            0), one kind ("row", "table", "column", "table-row") for every table
            that can take it (the others "data"; rank 0 prints which), or
            {layer name: "table" | "row" | "column" | "data" | "table-row"} (whole
            on one rank, rows cut over every rank, columns cut over every rank,
            replicated, rows cut over the ranks of one host; unnamed tables stay
            "data"). Ids go to the rows' owners and rows come
            back; the owners step their rows, so the weights are still model.fit's
            (docs/recommenders.md).
        communication_dtype: "bfloat16" or "float16": the floating values of every
            exchange travel in it (the sharded tables' rows and gradients, the
            replicas' gradient sums, the pipeline boundaries; half the bytes; sums
            stay float32; float16 with a dynamic loss scale and a float32 redo on
            overflow), or per path: {"tables": ..., "replicas": ..., "stages": ...}.
            It leaves the exact contract: the weights drift from model.fit's by the
            rounding (docs/recommenders.md). None or "float32": as they are.
        threads_per_rank: the intra-op threads each rank computes with. TensorFlow
            fixes them when it starts (at `import hyparflow`), so they are set by
            HYPARFLOW_THREADS_PER_RANK or `hyparflow run --threads-per-rank`; given
            here, fit checks they are what TensorFlow started with. By default: the
            cores the rank may use (affinity, cgroup quota, Slurm's
            SLURM_CPUS_PER_TASK) divided among the ranks on its node; ranks the
            launcher did not bind are pinned to cores of their own. Rank 0 prints
            the choice first (with `verbose`).
        data_service: "grpc://HOST:PORT", a tf.data service dispatcher (`hyparflow
            data-service --dispatcher`) whose workers decode each replica's part of a
            dataset function or of a dataset (and a dataset rank 0 reads whole), and
            the validation data's; None: $HYPARFLOW_DATA_SERVICE, else decoded in place.
            Arrays, PyDatasets and generators are read in place.
        data_service_mode: "exact" (the default: each replica's part produced whole,
            in order, by one worker: the weights are those of reading in place) or
            "dynamic" (the parts' files split among all the workers as they ask: every
            worker busy, each file read at most once, in no fixed order: the same
            training only statistically); None: $HYPARFLOW_DATA_SERVICE_MODE, else
            "exact" (docs/training.md, "Decoding on other nodes").

    `x` may also be a batched `tf.data.Dataset` yielding (x, y) or (x, y,
    sample_weight): each element is one global batch (`batch_size` is then
    not used); every rank iterates it (seed its shuffling) and keeps only the
    current batch.

    Returns:
        A `keras.callbacks.History` with the global loss and metrics per
        epoch, identical on every rank. When it returns, `model` holds all the
        trained weights on every rank.
    """
    options = FitOptions(
        batch_size=batch_size or 32, epochs=epochs, shuffle=shuffle, seed=seed, verbose=verbose,
        callbacks=callbacks, sample_weight=sample_weight, class_weight=class_weight,
        run_eagerly=run_eagerly, recompute=recompute, trace=trace,
        validation_data=validation_data, validation_split=validation_split,
        validation_freq=validation_freq, initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch, validation_batch_size=validation_batch_size,
        validation_steps=validation_steps, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, keep=keep, resume=resume, check_finite=check_finite,
        speeds=speeds, memory_limit=memory_limit, replica_sync=replica_sync,
        embedding_sharding=embedding_sharding, communication_dtype=communication_dtype,
        threads_per_rank=threads_per_rank, data_service=data_service,
        data_service_mode=data_service_mode)
    layout_arguments = dict(
        num_stages=num_stages, num_replicas=num_replicas, num_microbatches=num_microbatches,
        num_tensor=num_tensor, schedule=schedule, num_chunks=num_chunks, balance=balance,
        tensor_layers=tensor_layers, tensor_shares=tensor_shares, plan=plan,
        tensor_mesh=tensor_mesh)
    captured = settings.capture()
    if captured is not None:   # `hyparflow run` without -n: its planner's model, then exit
        from . import capture

        capture.write(captured, model, x, batch_size or 32, layout_arguments)
    return _call("hf.fit", comm, layout_arguments, lambda communicator, layout: trainer.train(
        model, x, y, comm=communicator, layout=layout, options=options))


@user_errors("hf.evaluate", _agree_bad_call("hf.evaluate"))
def evaluate(model: Any, x: Any, y: Any = None, *, batch_size: Optional[int] = None,
             verbose: Union[int, str] = "auto", sample_weight: Any = None,
             steps: Optional[int] = None, callbacks: Optional[Sequence[Any]] = None,
             return_dict: bool = False, num_stages: Optional[int] = None,
             num_replicas: Optional[int] = None, num_microbatches: Optional[int] = None,
             balance: Balance = None, comm: Any = None, num_tensor: Optional[int] = None,
             tensor_layers: Optional[Sequence[str]] = None, tensor_shares: Shares = None,
             plan: Optional[str] = None, tensor_mesh: Any = None,
             data_service: Optional[str] = None,
             data_service_mode: Optional[str] = None) -> Any:
    """`model.evaluate`, pipeline-parallel: forward only, microbatched, the replicas
    sharing the data. Returns what `model.evaluate` returns (the loss, or a list
    with the metrics, or a dict with `return_dict=True`), the same on every rank.

    Takes `model.evaluate`'s arguments (`batch_size`, `verbose`, `sample_weight`,
    `steps`, `callbacks`, `return_dict`): `verbose=0` prints nothing; otherwise rank 0
    prints Keras's progress bar (`"auto"`: the bar on a terminal, else one line);
    callbacks get `on_test_begin` / `on_test_batch_end` / `on_test_end` with the
    global logs (those that print or write files on rank 0 only, as in `fit`). The
    layout arguments (`plan` included) and `data_service` are `fit`'s."""
    layout_arguments = dict(
        num_stages=num_stages, num_replicas=num_replicas, num_microbatches=num_microbatches,
        num_tensor=num_tensor, balance=balance, tensor_layers=tensor_layers,
        tensor_shares=tensor_shares, plan=plan, tensor_mesh=tensor_mesh)
    return _call("hf.evaluate", comm, layout_arguments, lambda communicator, layout:
                 inference.evaluate(model, x, y, comm=communicator, layout=layout,
                                    batch_size=batch_size or 32, sample_weight=sample_weight,
                                    steps=steps, return_dict=return_dict, verbose=verbose,
                                    callbacks=callbacks, data_service=data_service,
                                    data_service_mode=data_service_mode))


@user_errors("hf.predict", _agree_bad_call("hf.predict"))
def predict(model: Any, x: Any, *, batch_size: Optional[int] = None,
            verbose: Union[int, str] = "auto",
            steps: Optional[int] = None, callbacks: Optional[Sequence[Any]] = None,
            gather: Literal["all", "main"] = "all", num_stages: Optional[int] = None,
            num_replicas: Optional[int] = None, num_microbatches: Optional[int] = None,
            balance: Balance = None, comm: Any = None, num_tensor: Optional[int] = None,
            tensor_layers: Optional[Sequence[str]] = None, tensor_shares: Shares = None,
            plan: Optional[str] = None, tensor_mesh: Any = None,
            data_service: Optional[str] = None) -> Any:
    """`model.predict`, pipeline-parallel. Predictions come back in input order, in
    the structure `model.predict` gives, on every rank (`gather="all"`) or only on
    rank 0 (`gather="main"`, None elsewhere) for big outputs.

    Takes `model.predict`'s arguments (`batch_size`, `verbose`, `steps`, `callbacks`),
    which behave as in `evaluate`; callbacks get `on_predict_*`, with each batch's
    predictions as `logs["outputs"]`. `data_service`: a dataset decoded by the service's
    workers, in order (its exact mode)."""
    layout_arguments = dict(
        num_stages=num_stages, num_replicas=num_replicas, num_microbatches=num_microbatches,
        num_tensor=num_tensor, balance=balance, tensor_layers=tensor_layers,
        tensor_shares=tensor_shares, plan=plan, tensor_mesh=tensor_mesh)
    return _call("hf.predict", comm, layout_arguments, lambda communicator, layout:
                 inference.predict(model, x, comm=communicator, layout=layout,
                                   batch_size=batch_size or 32, steps=steps, gather=gather,
                                   verbose=verbose, callbacks=callbacks,
                                   data_service=data_service))


def _world() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD


def rank() -> int:
    """This process's rank in MPI.COMM_WORLD (0 when run without a launcher)."""
    return int(_world().Get_rank())


def size() -> int:
    """Number of ranks in MPI.COMM_WORLD."""
    return int(_world().Get_size())


def is_main() -> bool:
    """True on rank 0: the one rank that should print, save and log."""
    return rank() == 0
