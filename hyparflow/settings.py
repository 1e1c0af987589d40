"""Every `HYPARFLOW_*` environment variable the package reads, read here and only here.

Values are read when asked for, not at import: a launcher sets them for its ranks, and
tests change them between runs. A malformed value is an error naming the variable and
what it takes, never silently a default. `VARIABLES` is the list the docs table shows
(tests/house/test_docs.py checks the two agree).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple, Optional

__all__ = ["Variable", "VARIABLES", "SettingError", "layout_counts", "plan", "threads", "pin",
           "inter_op_threads", "jit", "show_tf_logs", "timeout", "spin_seconds", "order_seconds",
           "heartbeat_seconds", "peer_timeout", "probe_seconds", "transposed", "fused_norm", "sparse",
           "defer_conv", "zero", "shared_sums", "overlap", "slowdown", "slurm_templates", "reshaped",
           "sweep_configs", "tensor_mesh", "parse_mesh", "loss_scale", "profile_length",
           "layout_warning", "plan_cache", "capture", "data_service", "data_service_mode",
           "data_service_timeout"]


class Variable(NamedTuple):
    name: str
    default: str
    meaning: str


VARIABLES = (
    Variable("HYPARFLOW_NUM_STAGES", "1",
             "pipeline stages S for `fit`, `evaluate` and `predict` calls that leave "
             "`num_stages` as None (set by `hyparflow run --stages`)"),
    Variable("HYPARFLOW_NUM_REPLICAS", "world size // (S x T)",
             "replicas R, when the call leaves `num_replicas` as None "
             "(`hyparflow run --replicas`)"),
    Variable("HYPARFLOW_NUM_MICROBATCHES", "1",
             "microbatches M per replica per step (`hyparflow run --microbatches`)"),
    Variable("HYPARFLOW_NUM_TENSOR", "1",
             "tensor ranks T per stage (`hyparflow run --tensor`)"),
    Variable("HYPARFLOW_TENSOR_MESH", "unset (a 1D split)",
             "`QxQ`: the T = Q * Q tensor ranks of a stage as a 2D mesh "
             "(`hyparflow run --tensor-mesh`)"),
    Variable("HYPARFLOW_PLAN", "unset",
             "a plan file (`hyparflow plan --output`) for `fit`, `evaluate` and `predict` "
             "calls that pass no `plan=` (set by `hyparflow run --plan`)"),
    Variable("HYPARFLOW_THREADS_PER_RANK", "derived: the cores this rank may use "
             "(affinity, cgroup quota, SLURM_CPUS_PER_TASK) // ranks on its node",
             "intra-op threads per rank (`hyparflow run --threads-per-rank`)"),
    Variable("HYPARFLOW_THREADS", "unset",
             "the older name of HYPARFLOW_THREADS_PER_RANK (which wins when both are set)"),
    Variable("HYPARFLOW_PIN", "1",
             "`0`: ranks the launcher did not bind stay where the operating system puts "
             "them (by default each is pinned to cores of its own)"),
    Variable("HYPARFLOW_INTER_OP_THREADS", "1",
             "inter-op threads per rank (ranks run as threads of one process need more)"),
    Variable("HYPARFLOW_JIT", "as `model.compile(jit_compile=...)`",
             "`1` compiles stage functions with XLA, `0` never (see docs/performance.md)"),
    Variable("HYPARFLOW_SHOW_TF_LOGS", "unset",
             "`1` keeps TensorFlow's start-up lines"),
    Variable("HYPARFLOW_TIMEOUT", "600",
             "communication watchdog in seconds: a wait longer than this ends the run "
             "(0 = off)"),
    Variable("HYPARFLOW_ORDER_SECONDS", "20",
             "a split layer's collective waiting this long looks for peers in another "
             "collective (named at once) or says what it waits for"),
    Variable("HYPARFLOW_SPIN_SECONDS", "0.2, or 0 when oversubscribed",
             "how long a wait polls before it sleeps between polls"),
    Variable("HYPARFLOW_PEER_TIMEOUT", "20",
             "a peer silent this many seconds is lost: every remaining rank ends with "
             "exit code 75, naming it and its host (0 = no heartbeat)"),
    Variable("HYPARFLOW_HEARTBEAT_SECONDS", "2",
             "seconds between a rank's heartbeats"),
    Variable("HYPARFLOW_DATA_SERVICE", "unset (each replica decodes in place)",
             "`grpc://HOST:PORT`: a tf.data service dispatcher whose workers decode the "
             "replicas' datasets, for `fit` calls that pass no `data_service=` "
             "(`hyparflow data-service`)"),
    Variable("HYPARFLOW_DATA_SERVICE_MODE", "exact",
             "`exact` (each replica's part produced whole by one worker: model.fit's "
             "weights) or `dynamic` (files split among all workers: the same training only "
             "statistically), for `fit` calls that pass no `data_service_mode=`"),
    Variable("HYPARFLOW_DATA_SERVICE_TIMEOUT", "60 (at most half of HYPARFLOW_TIMEOUT)",
             "seconds a replica's reader waits for a batch from the tf.data service before "
             "every rank ends, naming it (a lost worker's part is never given to another)"),
    Variable("HYPARFLOW_PROBE_SECONDS", "10",
             "how long a host gets to answer `hyparflow run --restarts`'s probe"),
    Variable("HYPARFLOW_RESHAPED", "unset",
             "set by `hyparflow run --restarts` when it starts the run again on fewer "
             "ranks: a plan file (`plan=`) made for more ranks then keeps its stages with "
             "fewer replicas, or, when its stages no longer divide the ranks, gives way to "
             "fewer stages cut by estimate"),
    Variable("HYPARFLOW_OVERLAP", "auto (on when ranks span hosts)",
             "`1` / `0`: gradient buckets start inside the backward, or after it"),
    Variable("HYPARFLOW_TRANSPOSED", "auto (a kept `W^T` where the first step times it faster)",
             "`1`: every eligible Dense layer keeps `W^T`, untimed (fresh runs then take the "
             "same products: the same bits); `0`: none does (TensorFlow's own `transpose_b` "
             "product)"),
    Variable("HYPARFLOW_FUSED_NORM", "1",
             "`0`: BatchNormalization trains through Keras's own operations instead of "
             "TensorFlow's fused kernel (the same mathematics, rounded differently)"),
    Variable("HYPARFLOW_DEFER_CONV", "0",
             "`1`: the split schedules (`1f1b-w`, `zb-h1`, `zb-batched`) leave Conv2D kernels' "
             "gradients to W too, as Dense ones (measured slower here)"),
    Variable("HYPARFLOW_ZERO", "auto (shared where it pays: Embedding tables, or optimizer "
             "state above 1/8 of a rank's memory)",
             "`1`: each replica steps its share of the rows and keeps only that share's "
             "optimizer state (ZeRO stage 1) whenever the optimizer allows; `0`: every "
             "replica steps the whole optimizer"),
    Variable("HYPARFLOW_SHARED_SUMS",
             "auto (where a node holds more than 2 ranks of a sum, or 2 and the sum spans nodes)",
             "`1`: large gradient sums between ranks of one node go through a shared-memory "
             "window (across nodes only slices travel); `0`: always as MPI messages"),
    Variable("HYPARFLOW_SPARSE", "1",
             "`0`: Embedding gradients reduced densely instead of as (row, value) pairs "
             "(for measuring only: Adam and the like then differ from `model.fit`)"),
    Variable("HYPARFLOW_LOSS_SCALE", "32768,2000",
             "`INITIAL[,GROWTH_STEPS]`: the dynamic loss scale of gradients exchanged in "
             "float16 (`communication_dtype`): its first value, and the steps without an "
             "overflow after which it doubles"),
    Variable("HYPARFLOW_LAYOUT_WARNING", "1",
             "`0`: `fit` does not warn of a layout whose one-thread ranks share a node and "
             "that the quick cost model predicts at under 0.8x of the node's best ranks x "
             "threads (docs/planning.md)"),
    Variable("HYPARFLOW_PLAN_CACHE", "~/.cache/hyparflow/plans ($XDG_CACHE_HOME's)",
             "where `hyparflow run` without `-n` keeps the plans it made, one per model "
             "structure, batch, core count and CPU model (docs/planning.md)"),
    Variable("HYPARFLOW_CAPTURE", "unset",
             "set by `hyparflow run` without `-n` for one run of the script: its first "
             "`fit` writes the model and the batch size to this directory and ends the "
             "process, for the planner"),
    Variable("HYPARFLOW_PROFILE_LENGTH", "8",
             "the size profiles and cost estimates give a model's unknown (None) "
             "dimensions, such as a sequence length (`hyparflow plan --length`)"),
    Variable("HYPARFLOW_SLOWDOWN", "1",
             "this rank acts this many times slower (a stand-in for slower hardware, "
             "for testing balancing)"),
    Variable("HYPARFLOW_SLURM_TEMPLATES", "the package's templates",
             "a directory of Slurm templates for `hyparflow slurm`"),
    Variable("HYPARFLOW_SWEEP_CONFIGS", "unset",
             "a JSON file of a sweep's configs (a list of dicts), set by `hyparflow slurm "
             "--sweep`; `hyparflow.sweeps.job_configs()` reads it"),
)
_NAMES = {v.name for v in VARIABLES}


class SettingError(ValueError):
    """An environment variable hyparflow reads has a value it cannot use."""


def _raw(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    assert name in _NAMES, name  # every variable read is listed (and documented)
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _number(name: str, kind: type, environ: Optional[Mapping[str, str]] = None,
            minimum: Optional[float] = None) -> Any:
    text = _raw(name, environ)
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise SettingError(f"{name} must be {'an integer' if kind is int else 'a number'}. "
                           f"Received: {name}={text!r}") from None
    if minimum is not None and value < minimum:
        raise SettingError(f"{name} must be >= {minimum}. Received: {name}={text!r}")
    return value


def _flag(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    text = _raw(name, environ)
    if text is None or text.lower() == "auto":
        return None
    if text not in ("0", "1"):
        raise SettingError(f"{name} must be 1, 0 or auto (or unset). Received: {name}={text!r}")
    return text == "1"


def layout_counts(environ: Optional[Mapping[str, str]] = None) -> dict[str, int]:
    """{"num_stages": S, ...} for each HYPARFLOW_NUM_* that is set (the counts a
    launcher was asked for)."""
    out = {}
    for key in ("num_stages", "num_replicas", "num_microbatches", "num_tensor"):
        value = _number(f"HYPARFLOW_{key.upper()}", int, environ, minimum=1)
        if value is not None:
            out[key] = value
    return out


def profile_length(environ: Optional[Mapping[str, str]] = None) -> int:
    """HYPARFLOW_PROFILE_LENGTH: the size given to unknown dimensions in profiles."""
    value = _number("HYPARFLOW_PROFILE_LENGTH", int, environ, minimum=1)
    return 8 if value is None else int(value)


def plan_cache(environ: Optional[Mapping[str, str]] = None) -> str:
    """HYPARFLOW_PLAN_CACHE: the directory of `hyparflow run`'s plans."""
    environ = os.environ if environ is None else environ
    given = _raw("HYPARFLOW_PLAN_CACHE", environ)
    if given is not None:
        return os.path.expanduser(given)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hyparflow", "plans")


def capture(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """HYPARFLOW_CAPTURE: the directory a capturing run's `fit` writes to, if set."""
    return _raw("HYPARFLOW_CAPTURE", environ)


def plan(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """HYPARFLOW_PLAN, the path of a plan file, if set (checked where it is read)."""
    return _raw("HYPARFLOW_PLAN", environ)


def parse_mesh(text: str, name: str) -> tuple[int, int]:
    """"2x2" -> (2, 2); anything else is an error naming `name` and the form."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise SettingError(f"{name} takes QxQ (e.g. 2x2 for 4 tensor ranks). Received: "
                           f"{text!r}")
    return int(parts[0]), int(parts[1])


def tensor_mesh(environ: Optional[Mapping[str, str]] = None) -> Optional[tuple[int, int]]:
    """HYPARFLOW_TENSOR_MESH as (q, q), if set."""
    value = (os.environ if environ is None else environ).get("HYPARFLOW_TENSOR_MESH")
    return None if not value else parse_mesh(value, "HYPARFLOW_TENSOR_MESH")


def threads(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """HYPARFLOW_THREADS_PER_RANK (else its older name HYPARFLOW_THREADS), if set."""
    value = _number("HYPARFLOW_THREADS_PER_RANK", int, environ, minimum=1)
    if value is None:
        value = _number("HYPARFLOW_THREADS", int, environ, minimum=1)
    return None if value is None else int(value)


def pin() -> Optional[bool]:
    """HYPARFLOW_PIN: False ("0") leaves unbound ranks unpinned."""
    return _flag("HYPARFLOW_PIN")


def layout_warning() -> bool:
    """HYPARFLOW_LAYOUT_WARNING: False ("0") silences fit's warning of a slow layout."""
    return _flag("HYPARFLOW_LAYOUT_WARNING") is not False


def inter_op_threads() -> int:
    value = _number("HYPARFLOW_INTER_OP_THREADS", int, minimum=1)
    return 1 if value is None else value


def jit() -> Optional[bool]:
    """HYPARFLOW_JIT: 1 compiles stage functions with XLA, 0 never; unset follows
    `model.compile(jit_compile=...)`."""
    return _flag("HYPARFLOW_JIT")


def show_tf_logs() -> bool:
    return _raw("HYPARFLOW_SHOW_TF_LOGS") not in (None, "0")


def timeout() -> Optional[float]:
    """The watchdog in seconds; None when turned off (0)."""
    value = _number("HYPARFLOW_TIMEOUT", float)
    value = 600.0 if value is None else value
    return value if value > 0 else None


def order_seconds() -> float:
    """HYPARFLOW_ORDER_SECONDS: when a waiting collective checks what its peers are in."""
    value = _number("HYPARFLOW_ORDER_SECONDS", float, minimum=0)
    return 20.0 if value is None else float(value)


def spin_seconds() -> Optional[float]:
    """HYPARFLOW_SPIN_SECONDS, if set (the caller decides the default)."""
    value = _number("HYPARFLOW_SPIN_SECONDS", float, minimum=0)
    return None if value is None else float(value)


def heartbeat_seconds() -> float:
    value = _number("HYPARFLOW_HEARTBEAT_SECONDS", float)
    return max(0.05, 2.0 if value is None else value)


def peer_timeout() -> Optional[float]:
    """Seconds of silence after which a peer is lost; None: no heartbeat (0)."""
    value = _number("HYPARFLOW_PEER_TIMEOUT", float)
    value = 20.0 if value is None else value
    return value if value > 0 else None


def probe_seconds(environ: Optional[Mapping[str, str]] = None) -> float:
    value = _number("HYPARFLOW_PROBE_SECONDS", float, environ)
    return max(1.0, 10.0 if value is None else float(value))


def reshaped(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this run was started again on fewer ranks (`hyparflow run --restarts`)."""
    return bool(_raw("HYPARFLOW_RESHAPED", environ))


def transposed() -> Optional[bool]:
    """True / False when HYPARFLOW_TRANSPOSED forces kept `W^T`s; None: where they pay."""
    return _flag("HYPARFLOW_TRANSPOSED")


def shared_sums() -> Optional[bool]:
    """HYPARFLOW_SHARED_SUMS: True / False forces the shared window on / off; None: auto."""
    return _flag("HYPARFLOW_SHARED_SUMS")


def sparse() -> bool:
    return _flag("HYPARFLOW_SPARSE") is not False


def overlap() -> Optional[bool]:
    """True / False when HYPARFLOW_OVERLAP forces it; None: the runtime decides."""
    return _flag("HYPARFLOW_OVERLAP")


def fused_norm() -> bool:
    """Whether BatchNormalization may train through the fused kernel (engine/norms.py)."""
    return _flag("HYPARFLOW_FUSED_NORM") is not False


def defer_conv() -> bool:
    return _flag("HYPARFLOW_DEFER_CONV") is True


def zero() -> Optional[bool]:
    """Whether the optimizer step is shared out over the replicas (None: where it pays)."""
    return _flag("HYPARFLOW_ZERO")


def slowdown() -> float:
    value = _number("HYPARFLOW_SLOWDOWN", float)
    return 1.0 if value is None else value


def slurm_templates() -> Optional[str]:
    return _raw("HYPARFLOW_SLURM_TEMPLATES")


def sweep_configs(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """HYPARFLOW_SWEEP_CONFIGS: the path of a sweep's configs file, if set."""
    return _raw("HYPARFLOW_SWEEP_CONFIGS", environ)


def loss_scale() -> tuple[float, int]:
    """HYPARFLOW_LOSS_SCALE "INITIAL[,GROWTH_STEPS]": (initial scale, growth steps)."""
    text = _raw("HYPARFLOW_LOSS_SCALE")
    if text is None:
        return 32768.0, 2000
    parts = text.split(",")
    try:
        initial = float(parts[0])
        growth = int(parts[1]) if len(parts) > 1 else 2000
        if len(parts) > 2 or not initial >= 1 or growth < 1:
            raise ValueError
    except ValueError:
        raise SettingError("HYPARFLOW_LOSS_SCALE must be INITIAL[,GROWTH_STEPS]: a number "
                           ">= 1 and an integer >= 1 (e.g. 32768,2000). Received: "
                           f"HYPARFLOW_LOSS_SCALE={text!r}") from None
    return initial, growth


def data_service(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """HYPARFLOW_DATA_SERVICE: a tf.data service dispatcher's address, if set."""
    return _raw("HYPARFLOW_DATA_SERVICE", environ)


def data_service_mode(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """HYPARFLOW_DATA_SERVICE_MODE: "exact" or "dynamic", if set."""
    text = _raw("HYPARFLOW_DATA_SERVICE_MODE", environ)
    if text is not None and text not in ("exact", "dynamic"):
        raise SettingError("HYPARFLOW_DATA_SERVICE_MODE must be exact or dynamic. Received: "
                           f"HYPARFLOW_DATA_SERVICE_MODE={text!r}")
    return text


def data_service_timeout() -> Optional[float]:
    """HYPARFLOW_DATA_SERVICE_TIMEOUT (default 60), at most half the watchdog, so that a
    reader names the service before its waiting peers time out; None: no limit."""
    value = _number("HYPARFLOW_DATA_SERVICE_TIMEOUT", float, minimum=0)
    value = 60.0 if value is None else float(value)
    watchdog = timeout()
    limits = [v for v in (value if value > 0 else None,
                          None if watchdog is None else watchdog / 2) if v is not None]
    return min(limits) if limits else None
