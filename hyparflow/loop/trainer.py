"""The training loop: epochs, global metrics, validation, callbacks and history."""

import dataclasses
import sys

import keras
import numpy as np

from ..engine import checkpoint as _ckpt
from . import costs as _costs
from .. import readers
from ..engine.customised import refuse_steps
from .. import sync as _sync
from ..kinds.tables import cost as _tables_cost
from ..kinds.tables import whole as _tables_whole
from .inference import run_evaluation
from .logs import GlobalLogs
from .progress import MAIN_ONLY_CALLBACKS, callback_list, resolve_verbose
from ..engine.prepare import agree_on_error, check_positive, fail, read_graph
from .runtime import Runtime
from . import steps as _steps
from ..engine import node as _node
from . import slow as _slow

__all__ = ["train", "resolve_verbose", "MAIN_ONLY_CALLBACKS"]



def memory_of(runtime, optimizer):
    """Bytes this rank holds for training, as the runtime has them: `weights` (the
    variables its stage trains, its parts of split layers, and their non-trainable
    companions), `optimizer` (the optimizer's state, built on those parts or on ZeRO's
    shards) and `kept_per_sample` (the activations its backward keeps per sample,
    `StageBody._run_nodes`): the partition as it runs, for checking the planner's
    memory model (docs/planning.md)."""
    stage = runtime.stage

    def size(v):
        return int(np.prod(v.shape)) * np.dtype(getattr(v.dtype, "name", v.dtype)).itemsize

    fixed = runtime.graph.variables_of(stage.cut.nodes, trainable=False)
    return {"weights": float(sum(size(v) for v in list(stage.trainable) + list(fixed))),
            "optimizer": float(sum(size(v) for v in optimizer.variables))
            if getattr(optimizer, "built", False) else 0.0,
            "kept_per_sample": getattr(stage, "kept_per_sample", None)}


def _validation_epochs(freq, epochs):
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"`validation_freq` must be >= 1. Received: validation_freq={freq}")
        return {e for e in range(epochs) if (e + 1) % freq == 0}
    return {int(e) - 1 for e in freq}  # a list of 1-based epochs, as in Keras


def train(model, x, y, *, comm, layout, options):
    """The body of `hyparflow.fit` for one rank (see its docstring), with its
    resolved `layout` (hyparflow.layout) and its other arguments, `options`
    (`options.FitOptions`)."""
    if _steps.overrides(model, "train_step"):
        # The model's own step, on each replica's rows (S = T = M = 1 only).
        return _steps.fit(model, x, y, comm=comm, layout=layout, options=options)
    error, runtime, state = None, None, {}
    sample_weight, validation_data = options.sample_weight, options.validation_data
    replica_sync = options.replica_sync
    try:
        check_positive(batch_size=options.batch_size, epochs=options.epochs)
        # A plan file's table placement ("tables", `hyparflow plan`) is the default.
        options = dataclasses.replace(options, embedding_sharding=_tables_cost.from_plan(
            options.embedding_sharding, layout.plan))
        replica_sync = _sync.resolve(options.replica_sync)
        _sync.check(replica_sync, layout.num_replicas)
        if replica_sync is not None and layout.num_replicas > 1 and getattr(
                model.optimizer, "use_ema", False):
            raise NotImplementedError(
                f"use_ema=True with replica_sync={options.replica_sync!r}: each replica "
                "would keep the moving average of its own weights, and model.fit has no "
                "model to say which average the end of training should install. Use "
                "replica_sync=None (the replicas' gradients summed every step), or "
                "use_ema=False.")
        if options.resume and not options.checkpoint_dir:
            raise ValueError("`resume=True` needs `checkpoint_dir` (where the checkpoints are).")
        if options.checkpoint_dir:
            state["checkpointer"] = _ckpt.Checkpointer(
                options.checkpoint_dir, options.checkpoint_every, options.keep)
        state["verbose"] = resolve_verbose(options.verbose)
        if options.threads_per_rank is not None:
            check_positive(threads_per_rank=options.threads_per_rank)
        if validation_data is not None or options.validation_split:
            refuse_steps(model, ("test_step",))
        state["batch_size"] = options.batch_size
        if options.embedding_sharding is not None:
            _tables_whole.check_callbacks(options.callbacks)
        if options.validation_split and validation_data is None:
            if readers.is_stream(x):
                raise ValueError(
                    f"`validation_split` needs arrays; with a {type(x).__name__} (read batch "
                    "by batch) pass `validation_data`.")
            (x, y, sample_weight), validation_data = readers.validation_split(
                x, y, sample_weight, options.validation_split)
        reading = dict(batch_size=options.batch_size, sample_weight=sample_weight,
                       class_weight=options.class_weight, shuffle=options.shuffle,
                       seed=0, steps_per_epoch=options.steps_per_epoch)
        # A tf.data service decodes the datasets' parts on its workers (readers/service.py).
        service = readers.service.resolve(options.data_service, options.data_service_mode)
        stream = readers.open_source(comm, x, y, layout=layout, service=service,
                                     epoch=options.initial_epoch, **reading)
        graph = read_graph(model, layout.num_stages, x if stream is None else stream.first_x,
                           options.batch_size)
        cut = layout.stage_counts(graph)
        source, sample = readers.source(graph, x, y, stream=stream, **reading)
        if options.check_finite and isinstance(source, readers.ArraySource):
            readers.check_finite(source.data)
        replicas, microbatches = layout.num_replicas, layout.num_microbatches
        effective = (getattr(source, "global_rows", len(sample)) if stream is not None
                     else options.batch_size)
        if effective < replicas * microbatches:
            raise ValueError(
                f"batch_size={effective} is smaller than num_replicas x num_microbatches = "
                f"{replicas} x {microbatches} = {replicas * microbatches}: some "
                "microbatch would be empty. Raise batch_size or lower num_microbatches."
            )
        if validation_data is not None:
            vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(validation_data) if isinstance(
                validation_data, (list, tuple)) else (validation_data, None, None)
            vbatch = options.validation_batch_size or options.batch_size
            vreading = dict(batch_size=vbatch, sample_weight=vsw,
                            steps_per_epoch=options.validation_steps)
            state["validation"], _ = readers.source(
                graph, vx, vy, stream=readers.open_source(comm, vx, vy, layout=layout,
                                                          service=service, validation=True,
                                                          **vreading),
                **vreading)
        state["validation_epochs"] = _validation_epochs(options.validation_freq, options.epochs)
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    agree_on_error(comm, error)
    try:
        # The node's ranks and threads (collective; a threads_per_rank TensorFlow did
        # not start with is refused after it, on every rank alike).
        local, line = _node.settle(comm, options.threads_per_rank)
        if state["verbose"] and comm.rank == 0:
            print(line, flush=True)
        try:
            _slow.check(comm, graph, layout, options.batch_size, local,
                        getattr(model, "optimizer", None))
        except Exception:  # noqa: BLE001 - a warning that fails must never end a run
            pass
        # Collective (profiling, calibration): every rank reaches it, or none does.
        cut = _costs.resolve(graph, model, comm, cut, layout, speeds=options.speeds,
                             memory_limit=options.memory_limit,
                             microbatch=max(1, options.batch_size // (replicas * microbatches)))
        if layout.tensor_shares == "measure" and layout.num_tensor > 1:
            layout = dataclasses.replace(
                layout, tensor_shares=tuple(_costs.measured_shares(comm, layout)))
        # Where each rank runs: "table-row" tables go to a host's ranks.
        hosts = (comm.allgather_obj(comm.host())
                 if options.embedding_sharding is not None else None)
        runtime = Runtime(model, comm, layout, graph=graph, sample=sample, cut=cut,
                          run_eagerly=options.run_eagerly, recompute=options.recompute,
                          trace=options.trace,
                          facts={"samples": getattr(source, "global_rows", len(sample)),
                                 "steps": source.steps,
                                 "batch_size": options.batch_size, "epochs": options.epochs},
                          batch_rows=min(effective,
                                         getattr(source, "global_rows", len(sample))),
                          replica_sync=replica_sync,
                          embedding_sharding=options.embedding_sharding,
                          memory_limit=options.memory_limit,
                          communication_dtype=options.communication_dtype, hosts=hosts)
        if runtime.tables is not None and state["verbose"] and comm.rank == 0:
            print(runtime.tables.describe(), flush=True)
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    agree_on_error(comm, error)
    runtime.connect()
    # One seed everywhere: the random layers' masks derive from it, and so does the
    # shuffling when it is given. None: rank 0 draws it from Keras's global generator,
    # and the data comes in model.fit's order, so keras.utils.set_random_seed repeats
    # a run as it repeats model.fit.
    state["seed"] = options.seed if options.seed is not None else comm.bcast_obj(
        int(keras.random.randint((), 0, 2 ** 31 - 1)) if comm.rank == 0 else None, 0)
    state["start"] = (options.initial_epoch, 0, options.initial_epoch * (source.steps or 0))
    if options.resume:
        _resume(runtime, state)
        if hasattr(source, "restore"):   # a reader that starts mid-epoch by index
            source.restore(state["start"][0], state.get("reader"))
    if isinstance(source, readers.ArraySource):
        source.seed = state["seed"]
        if options.seed is None:
            source.order = lambda epoch: readers.fit_order(comm, len(source.data))
    stop_flag = _ckpt.StopFlag() if options.checkpoint_dir else None
    state["stop_flag"] = stop_flag
    try:
        if runtime.tables is not None and runtime.layout.num_stages == 1 \
                and runtime.layout.num_tensor == 1:
            # Each rank trains its rows: the whole copies go (every rank alike: every
            # rank holds a part of each sharded table; not yet in pipelines or with
            # tensor ranks, whose other stages take the tables from the owners).
            runtime.tables.empty()
            # The user's callbacks see the whole tables at each epoch's end (a collective:
            # ranks may pass different callbacks, so all fill if any has some).
            state["whole_at_epoch_end"] = any(comm.allgather_obj(
                _tables_whole.reads_weights(options.callbacks)))
        history = _loop(model, runtime, source, state, options.epochs, options.callbacks)
        # Bytes per sample this rank keeps for the backward (`StageBody._run_nodes`).
        history.kept_per_sample = getattr(runtime.stage, "kept_per_sample", None)
        history.memory = memory_of(runtime, model.optimizer)
        history.exchanges = runtime.exchanges()
        history.data_wait = state["waits"].summary()
        if runtime.replicas is not None:
            _report_replicas(runtime, history, verbose=state["verbose"])
        return history
    except (_ckpt.Preempted, _ckpt.CheckpointError):
        if runtime.tables is not None:
            runtime.tables.fill()  # every rank is here: the tables can be gathered
        raise  # every rank raises these together: nothing to abort
    except BaseException as exc:
        fail(comm, runtime, exc)
        raise
    finally:
        if stop_flag is not None:
            stop_flag.restore()
        runtime.close()
        for used in (source, state.get("validation")):
            if hasattr(used, "close"):
                used.close()


def _resume(runtime, state):
    """Continue from the newest checkpoint that verifies (or start afresh if none)."""
    comm = runtime.comm
    directory = state["checkpointer"].directory
    path = comm.bcast_obj(_ckpt.latest_valid(directory)[0] if comm.rank == 0 else None, 0)
    if path is None:
        if comm.rank == 0:
            print(f"hyparflow: no checkpoint in {directory}; starting from the beginning.",
                  flush=True)
        return
    replica = None
    if runtime.replicas is not None:
        manifest = _ckpt.read(path)
        if _ckpt.replica_weights(manifest, runtime.topo.num_replicas):
            replica = runtime.replica  # each replica goes on from its own weights
        elif comm.rank == 0:
            print(f"hyparflow: {path} holds no weights of {runtime.topo.num_replicas} "
                  "replicas stepping on their own; every replica starts from its model.",
                  flush=True)
    manifest = _ckpt.restore_model(runtime.model, path, parts=runtime.slot_slicer(),
                                   replica=replica)
    runtime.load_shards()
    choices = manifest.get("choices") or {}
    if choices.get("for") == _choices_key(runtime, state):
        runtime.executor.adopt(choices)  # same layout: the same products, the same bits
    state["seed"] = manifest["seed"]
    state["start"] = (manifest["epoch"], manifest["step"], manifest["global_step"])
    state["reader"] = manifest.get("reader")
    if comm.rank == 0:
        print(f"hyparflow: resuming from {path} (epoch {manifest['epoch'] + 1}, step "
              f"{manifest['step']}).", flush=True)


def _report_replicas(runtime, history, verbose):
    """Replicas that stepped on their own: which model `fit` returns, said once, and
    what they did in `history.replicas` (hyparflow.replicas.Replicas.summary)."""
    summary = runtime.replicas.summary()
    history.replicas = summary
    if verbose and runtime.comm.rank == 0:
        if summary["final"] is None:
            which = "the mean of the replicas' weights"
        else:
            which = (f"replica {summary['final']}'s weights (the global leader: the lowest "
                     "training loss at the last step)")
        print(f"hyparflow: {summary['method']}: the model holds {which}.", flush=True)


def _choices_key(runtime, state):
    """The layout the executor's timed choices hold for (`Executor.choices`)."""
    layout = runtime.layout
    return [layout.num_stages, layout.num_replicas, layout.num_tensor,
            layout.num_microbatches, layout.num_chunks, list(runtime.part.counts),
            state["batch_size"]]


def _checkpoint(runtime, state, epoch, step, global_step):
    choices = dict(runtime.executor.choices(), **{"for": _choices_key(runtime, state)})
    reading = state.get("reading")
    state["checkpointer"].write(runtime, {
        "epoch": epoch, "step": step, "global_step": global_step, "seed": state["seed"],
        "choices": choices, "reader": reading(epoch_end=step == 0) if reading else None})


def _loop(model, runtime, source, state, epochs, callbacks):
    comm, executor = runtime.comm, runtime.executor
    verbose = state["verbose"]
    cbs, per_step = callback_list(model, comm, callbacks, verbose, epochs=epochs,
                                  steps=source.steps, add_history=True)
    logs = GlobalLogs(model, comm, runtime.counted)
    model.stop_training = False
    if runtime.timeline is not None:
        runtime.timeline.start(comm)
    cbs.on_train_begin()
    epoch_logs = {}
    first_epoch, skip, global_step = state["start"]
    checkpointer, flag = state.get("checkpointer"), state.get("stop_flag")
    replicas = runtime.replicas  # None: allreduce (every replica takes the same step)
    waits = readers.Waits(runtime.timeline, warn=comm.rank == 0)
    state["waits"] = waits
    state["reading"] = getattr(source, "state", None)
    for epoch in range(first_epoch, epochs):
        if replicas is not None:
            replicas.restore()  # each replica's own weights, after the last epoch's report
        logs.reset()
        cbs.on_epoch_begin(epoch)
        # Resuming: the steps done before the checkpoint are not read again.
        start = skip if epoch == first_epoch else 0
        for step, (data, micro, rows) in enumerate(
                waits.over(readers.steps(source, epoch, runtime, start)), start):
            cbs.on_train_batch_begin(step)
            if global_step == state["start"][2] and verbose and comm.rank == 0:
                # The first step traces and compiles every stage's functions: for a large
                # model this is the longest wait of the run, and looked like a hang.
                print("hyparflow: compiling the stages (the first step traces each stage's "
                      "forward and backward; the steps after it reuse them) ...", flush=True)
            contribution = executor.step(micro, rows, data, global_step, state["seed"])
            waits.stepped()
            global_step += 1
            if replicas is not None:
                replicas.after_step(global_step, contribution if runtime.counted else 0.0,
                                    sum(len(m) for m in micro), rows)
            logs.add(contribution, rows)
            if per_step:
                cbs.on_train_batch_end(step, logs.result())
                if comm.bcast_obj(bool(model.stop_training), 0):
                    model.stop_training = True
                    break
            if checkpointer is not None:
                signalled = [s for s in comm.allgather_obj(flag.raised) if s]
                if signalled or checkpointer.due(global_step, epoch_end=False):
                    _checkpoint(runtime, state, epoch, step + 1, global_step)
                if signalled:
                    message = (f"hyparflow: stopped by {signalled[0]} after step {global_step}; "
                               f"checkpoint written to {checkpointer.directory}. Resume with "
                               f"resume=True (exit code {_ckpt.PREEMPTED_EXIT_CODE}).")
                    if comm.rank == 0:
                        print(message, file=sys.stderr, flush=True)
                    raise _ckpt.Preempted(message)
        if replicas is None:
            runtime.sync_weights()
        if checkpointer is not None and checkpointer.due(global_step, epoch_end=True):
            _checkpoint(runtime, state, epoch + 1, 0, global_step)
        if replicas is not None:
            # Validation, callbacks and the returned model see the replicas' agreed
            # model; the checkpoint above kept each replica's own.
            replicas.report()
            runtime.sync_weights()
        epoch_logs = logs.result()
        if "validation" in state and epoch in state["validation_epochs"]:
            val = run_evaluation(model, runtime, state["validation"], logs)
            epoch_logs.update({f"val_{k}": v for k, v in val.items()})
        whole = state.get("whole_at_epoch_end")
        if whole:
            runtime.tables.fill()  # collective: every rank is at this epoch's end
        cbs.on_epoch_end(epoch, epoch_logs)
        model.stop_training = comm.bcast_obj(bool(model.stop_training), 0)
        if model.stop_training:
            break
        if whole and epoch + 1 < epochs:
            runtime.tables.empty()
    if epochs > 0:
        # As model.fit after its last epoch (before on_train_end): use_ema's averages
        # become the weights (`optimizer.finalize_variable_values`) on every rank.
        runtime.finalize_optimizer()
    if runtime.tables is not None:
        runtime.tables.fill()  # whole again, from their owners, for the model fit returns
    cbs.on_train_end(epoch_logs)
    if runtime.timeline is not None:
        topo = runtime.topo
        runtime.timeline.write(comm, runtime.trace, {
            "num_stages": topo.num_stages, "num_replicas": topo.num_replicas,
            "num_microbatches": runtime.layout.num_microbatches,
            "schedule": runtime.layout.schedule})
    return model.history
