"""Pipeline-parallel inference: evaluate (loss and metrics) and predict, forward only."""

import dataclasses

import numpy as np

from .. import _compat
from .. import readers
from .logs import GlobalLogs
from .progress import callback_list, resolve_verbose
from ..engine.prepare import agree_on_error, check_positive, fail, read_graph
from .runtime import Runtime
from . import steps as _steps

__all__ = ["run_evaluation", "evaluate", "predict"]


def run_evaluation(model, runtime, source, logs=None):
    """Loss and metrics over `source` with `runtime`'s partition; global logs dict."""
    logs = logs or GlobalLogs(model, runtime.comm, runtime.counted)
    logs.reset()
    for data, micro, rows in readers.steps(source, 0, runtime):
        contribution, _ = runtime.executor.infer("evaluate", micro, rows, data)
        logs.add(contribution, rows)
    return logs.result()


def _runtime(model, x, y, comm, layout, *, batch_size, sample_weight, steps, kind,
             service=None):
    check_positive(batch_size=batch_size)
    if layout.tensor_shares == "measure":
        # Shares change only the speed of inference, never its results.
        layout = dataclasses.replace(layout, tensor_shares=None)
    reading = dict(batch_size=batch_size, sample_weight=sample_weight, steps_per_epoch=steps,
                   need_y=(kind == "evaluate"))
    # Predictions come back in the order of `x`: a predicting run reads it whole.
    stream = readers.open_source(comm, x, y, layout=layout, shard=(kind != "predict"),
                                 service=service, **reading)
    graph = read_graph(model, layout.num_stages, x if stream is None else stream.first_x,
                       batch_size)
    source, sample = readers.source(graph, x, y, stream=stream, **reading)
    rows = getattr(source, "global_rows", len(sample))
    runtime = Runtime(model, comm, layout, graph=graph, sample=sample,
                      cut=layout.stage_counts(graph), training=False,
                      facts={"samples": rows, "steps": source.steps, "kind": kind},
                      batch_rows=rows if stream is not None else min(batch_size, rows))
    return runtime, source


def _run(comm, build, body):
    error, runtime = None, None
    try:
        runtime, source = build()
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    agree_on_error(comm, error)
    runtime.connect()
    try:
        return body(runtime, source)
    except BaseException as exc:
        fail(comm, runtime, exc)
        raise
    finally:
        runtime.close()
        if hasattr(source, "close"):
            source.close()


def evaluate(model, x, y=None, *, comm, layout, batch_size, sample_weight=None, steps=None,
             return_dict=False, verbose="auto", callbacks=None, data_service=None,
             data_service_mode=None):
    """The body of `hyparflow.evaluate` for one rank."""
    if not _compat.is_compiled(model):
        raise ValueError(f"Model {model.name!r} is not compiled: call model.compile(...) before "
                         "hyparflow.evaluate, as before model.evaluate.")
    if _steps.overrides(model, "test_step"):
        # The model's own step, on each replica's rows (S = T = M = 1 only).
        result = _steps.evaluate(model, x, y, comm=comm, layout=layout, batch_size=batch_size,
                                 sample_weight=sample_weight, steps=steps, verbose=verbose,
                                 callbacks=callbacks)
        return result if return_dict else _compat.flatten_logs(model, result)
    verbose = resolve_verbose(verbose)

    def body(runtime, source):
        comm = runtime.comm
        # As model.evaluate: on_test_* callbacks, the progress bar (here on rank 0).
        cbs, per_step = callback_list(model, comm, callbacks, verbose, epochs=1,
                                      steps=source.steps)
        logs = GlobalLogs(model, comm, runtime.counted)
        logs.reset()
        model.stop_evaluating = False
        cbs.on_test_begin()
        for step, (data, micro, rows) in enumerate(readers.steps(source, 0, runtime)):
            cbs.on_test_batch_begin(step)
            contribution, _ = runtime.executor.infer("evaluate", micro, rows, data)
            logs.add(contribution, rows)
            if per_step:
                cbs.on_test_batch_end(step, logs.result())
                if comm.bcast_obj(bool(getattr(model, "stop_evaluating", False)), 0):
                    break
        result = logs.result()
        cbs.on_test_end(result)
        if return_dict:
            return result
        values = list(result.values())
        return values[0] if len(values) == 1 else values

    return _run(comm, lambda: _runtime(
        model, x, y, comm, layout, batch_size=batch_size, sample_weight=sample_weight,
        steps=steps, kind="evaluate",
        service=readers.service.resolve(data_service, data_service_mode)), body)


def predict(model, x, *, comm, layout, batch_size, steps=None, gather="all", verbose="auto",
            callbacks=None, data_service=None):
    """The body of `hyparflow.predict` for one rank."""
    if gather not in ("all", "main"):
        raise ValueError(f"`gather` must be 'all' or 'main'. Received: gather={gather!r}")
    verbose = resolve_verbose(verbose)

    def body(runtime, source):
        comm = runtime.comm
        cbs, per_step = callback_list(model, comm, callbacks, verbose, epochs=1,
                                      steps=source.steps)
        # A callback sees each batch's predictions, as from model.predict: gathered
        # per batch only when some rank has a callback.
        batch_outputs = any(comm.allgather_obj(bool(callbacks)))
        pieces = []  # (global sample positions, [one array per output])
        # Array batches index the whole data; a dataset's batches count from zero.
        relative = source.relative
        offset = 0
        model.stop_predicting = False
        cbs.on_predict_begin()
        for step, (data, batch) in enumerate(source.epoch(0)):
            cbs.on_predict_batch_begin(step)
            micro = runtime.microbatches(batch)
            _, preds = runtime.executor.infer("predict", micro, len(batch), data)
            mine = [(np.asarray(idx), outs)
                    for idx, outs in zip(micro, preds if runtime.counted else ())]
            pieces += [((offset if relative else 0) + idx, outs) for idx, outs in mine]
            offset += len(batch)
            if per_step:
                logs = None
                if batch_outputs:
                    within = {int(v): k for k, v in enumerate(np.asarray(batch))}
                    logs = {"outputs": _assemble(
                        [(np.array([within[int(v)] for v in idx], dtype=np.int64), outs)
                         for rank_pieces in comm.allgather_obj(mine)
                         for idx, outs in rank_pieces], len(batch), runtime.graph)}
                cbs.on_predict_batch_end(step, logs)
                if comm.bcast_obj(bool(getattr(model, "stop_predicting", False)), 0):
                    break
        cbs.on_predict_end()
        if gather == "all":
            everyone = runtime.comm.allgather_obj(pieces)
        else:
            everyone = runtime.comm.gather_obj(pieces, 0)
            if runtime.comm.rank != 0:
                return None
        return _assemble([p for rank_pieces in everyone for p in rank_pieces], offset,
                         runtime.graph)

    # Predictions come back in the order of `x`: the service's exact mode keeps it.
    return _run(comm, lambda: _runtime(
        model, x, None, comm, layout, batch_size=batch_size, sample_weight=None, steps=steps,
        kind="predict", service=readers.service.resolve(data_service, "exact")), body)


def _assemble(pieces, total, graph):
    """Predictions back in input order, in the structure `model.predict` returns."""
    outputs = len(pieces[0][1])
    arrays = []
    for k in range(outputs):
        first = pieces[0][1][k]
        out = np.empty((total,) + first.shape[1:], first.dtype)
        for positions, outs in pieces:
            out[positions] = outs[k]
        arrays.append(out)
    return _compat.pack_outputs(graph.functional, arrays)
