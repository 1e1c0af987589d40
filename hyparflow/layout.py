"""The run's layout, resolved once: stages, tensor ranks, replicas, microbatches,
schedule, how the layer calls are cut and which layers are split.

Each value comes from the first of, in order:

1. the argument of `fit` / `evaluate` / `predict` (or the launcher's flag);
2. the plan file (`plan=`, written by `hyparflow plan`); an argument that contradicts
   it is an error, since either choice would silently drop what the user asked for;
3. the environment (`HYPARFLOW_NUM_*`, which `hyparflow run` and the Slurm templates
   set from their flags);
4. the world size (replicas = ranks // (stages x tensor)), else the default (1).

`fit`, `evaluate`, `predict`, the launcher and the planner all build one `Layout` with
`resolve` (or `Layout(...)` directly) and pass it down; nothing below re-derives a count.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from . import settings
from .schedules import CHUNKED, TABLE, check_interleaved

__all__ = ["Layout", "resolve", "warn_overridden", "DEFAULT_SCHEDULE"]

DEFAULT_SCHEDULE = "1f1b"
_COUNTS = ("num_stages", "num_tensor", "num_replicas", "num_microbatches")


@dataclass(frozen=True)
class Layout:
    """A complete, checked layout. `origin` says where each count came from (for
    messages); `plan` is the plan file's content when one was used (its layer calls
    are checked against the model when the graph is known, `stage_counts`)."""

    num_stages: int = 1
    num_replicas: int = 1
    num_microbatches: int = 1
    num_tensor: int = 1
    schedule: str = DEFAULT_SCHEDULE
    num_chunks: int = 1  # model chunks per rank (virtual stages), interleaved schedules only
    balance: Any = None
    tensor_layers: Optional[Tuple[str, ...]] = None
    tensor_shares: Union[None, str, Tuple[float, ...]] = None
    # (q, q): the T = q * q tensor ranks of a stage as a 2D mesh (kinds/mesh), else 1D.
    tensor_mesh: Optional[Tuple[int, int]] = None
    hosts: Optional[Tuple[str, ...]] = None
    plan: Optional[Mapping[str, Any]] = field(default=None, compare=False, repr=False)
    origin: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    # (name, the value used, where it came from, the launcher's value) for each count
    # $HYPARFLOW_NUM_* asked for but an argument (or the plan) overrode.
    overridden: Tuple[Tuple[str, Any, str, Any], ...] = field(default=(), compare=False,
                                                            repr=False)

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
        if self.schedule not in TABLE and self.schedule != "auto":
            raise ValueError(f"Unknown schedule {self.schedule!r}; choose one of "
                             f"{sorted(TABLE) + ['auto']}. "
                             f"Received: schedule={self.schedule!r}")
        self._check_chunks()
        self._check_mesh()

    def _check_mesh(self) -> None:
        mesh = self.tensor_mesh
        if mesh is None:
            return
        if (not isinstance(mesh, tuple) or len(mesh) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in mesh)):
            raise ValueError(f"`tensor_mesh` must be a pair of equal integers (q, q), e.g. "
                             f"tensor_mesh=(2, 2) with num_tensor=4. Received: "
                             f"tensor_mesh={mesh!r}")
        q = mesh[0]
        if mesh[1] != q:
            raise ValueError(f"tensor_mesh={mesh!r} is not square: the mesh is q x q (SUMMA "
                             f"cuts rows and columns alike). Use tensor_mesh=({q}, {q}) with "
                             f"num_tensor={q * q}, or leave tensor_mesh out for a 1D split.")
        if q < 2:
            raise ValueError(f"tensor_mesh={mesh!r} is one rank, which splits nothing. Use "
                             "tensor_mesh=(2, 2) or larger, or leave it out.")
        if q * q != self.num_tensor:
            raise ValueError(f"tensor_mesh={mesh!r} has {q * q} ranks but num_tensor="
                             f"{self.num_tensor}. Pass num_tensor={q * q} (or leave it out: "
                             f"the mesh sets it), or a mesh (r, r) with r * r = num_tensor.")
        if self.tensor_shares is not None:
            raise ValueError(f"tensor_shares={self.tensor_shares!r} with tensor_mesh={mesh!r}: "
                             "the mesh cuts rows and columns evenly. Leave tensor_shares out, "
                             "or leave tensor_mesh out for an uneven 1D split.")

    def _check_chunks(self) -> None:
        chunks = self.num_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"`num_chunks` must be an integer >= 1. Received: "
                             f"num_chunks={chunks!r}")
        if self.schedule not in CHUNKED:
            if chunks != 1:
                raise ValueError(
                    f"num_chunks={chunks} model chunks per rank need schedule='interleaved'; "
                    f"{self.schedule!r} runs one stage per rank. Pass "
                    f"schedule='interleaved', or leave num_chunks at 1.")
            return
        check_interleaved(self.num_stages, self.num_microbatches, chunks)
        if self.num_tensor > 1:
            raise NotImplementedError(
                f"schedule='interleaved' with num_tensor={self.num_tensor} is not supported yet "
                f"(split layers inside model chunks). Use num_tensor=1, or schedule='1f1b'.")

    @property
    def pipeline(self) -> int:
        """Ranks in one copy of the pipeline: stages x tensor ranks."""
        return self.num_stages * self.num_tensor

    @property
    def ranks(self) -> int:
        return self.pipeline * self.num_replicas

    def stage_counts(self, graph: Any) -> Any:
        """What the partition cuts by: the plan's stage sizes (after checking its layer
        calls are this model's), else `balance`."""
        if self.plan is None:
            return self.balance
        from . import plan as _plan

        return _plan.counts_for(self.plan, graph)

    def with_hosts(self, hosts: Sequence[str]) -> "Layout":
        """This layout placed: `hosts[r]` is rank r's host."""
        return replace(self, hosts=tuple(hosts))

    def kept(self, schedule: Optional[str]) -> "Layout":
        """This layout with the schedule `"auto"` kept after timing (None: not chosen)."""
        return self if schedule is None else replace(self, schedule=schedule)

    def record(self) -> Dict[str, Any]:
        """The layout as JSON values, for a checkpoint's manifest: what the run used,
        the measured values included (tensor shares, hosts, the schedule "auto" kept)."""
        shares = self.tensor_shares
        return {"num_stages": self.num_stages, "num_tensor": self.num_tensor,
                "num_replicas": self.num_replicas, "num_microbatches": self.num_microbatches,
                "schedule": self.schedule, "num_chunks": self.num_chunks,
                "tensor_layers": None if self.tensor_layers is None else list(self.tensor_layers),
                "tensor_shares": list(shares) if isinstance(shares, tuple) else shares,
                "hosts": None if self.hosts is None else list(self.hosts)}

    def describe(self) -> str:
        parts = [f"{self.num_stages} stage{'s' if self.num_stages != 1 else ''}"]
        if self.num_tensor > 1:
            mesh = self.tensor_mesh
            parts.append(f"{self.num_tensor} tensor ranks"
                         + (f" ({mesh[0]}x{mesh[1]} mesh)" if mesh else ""))
        parts.append(f"{self.num_replicas} replica{'s' if self.num_replicas != 1 else ''}")
        parts.append(f"{self.num_microbatches} microbatch"
                     f"{'es' if self.num_microbatches != 1 else ''}")
        schedule = self.schedule + (f", {self.num_chunks} chunks" if self.num_chunks > 1 else "")
        return " x ".join(parts) + f" ({self.ranks} ranks, {schedule})"


def _as_tuple(value: Any) -> Any:
    """Lists become tuples (a Layout is frozen and compared); anything else stays."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def resolve(world_size: int, *, num_stages: Optional[int] = None,
            num_replicas: Optional[int] = None, num_microbatches: Optional[int] = None,
            num_tensor: Optional[int] = None, schedule: Optional[str] = None,
            num_chunks: Optional[int] = None, balance: Any = None,
            tensor_layers: Optional[Sequence[str]] = None, tensor_shares: Any = None,
            plan: Any = None, tensor_mesh: Any = None,
            environ: Optional[Mapping[str, str]] = None) -> Layout:
    """The layout for `world_size` ranks, from the arguments, then the plan file (a
    path or an already read plan; else $HYPARFLOW_PLAN's), then the environment, then
    the world size."""
    from . import plan as _plan

    given = {"num_stages": num_stages, "num_replicas": num_replicas,
             "num_microbatches": num_microbatches, "num_tensor": num_tensor,
             "schedule": schedule, "tensor_layers": tensor_layers,
             "num_chunks": num_chunks}
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, value in given.items():
        if value is not None:
            values[name], origin[name] = value, "this script's argument"
    source: Optional[str] = None
    if plan is not None:
        source = f"the plan {plan}" if isinstance(plan, str) else "the plan"
    elif settings.plan(environ) is not None:
        plan = settings.plan(environ)
        source = f"the plan {plan} ($HYPARFLOW_PLAN, from `hyparflow run --plan`)"
    if plan is not None:
        assert source is not None
        plan = _plan.read(plan) if isinstance(plan, str) else plan
        if balance is not None:
            raise ValueError(f"balance={balance!r} and plan= both say how to cut the layer "
                             f"calls; {source} already lists each stage's. Pass one of them.")
        for name in ("num_stages", "num_replicas", "num_microbatches", "num_tensor",
                     "schedule", "num_chunks", "tensor_layers", "tensor_shares",
                     "tensor_mesh"):
            if name not in plan:
                continue
            value = plan[name]
            if name == "tensor_shares":
                if tensor_shares is None:
                    tensor_shares = value
                continue
            if name == "tensor_mesh":
                mine = _mesh(tensor_mesh, {}) if tensor_mesh is not None else None
                if mine is not None and _as_tuple(mine) != _as_tuple(value):
                    raise ValueError(
                        f"tensor_mesh={tensor_mesh!r} (the argument) contradicts {source}, "
                        f"which says tensor_mesh={value!r}. Leave the argument out to use "
                        "the plan, or write a new plan with `hyparflow plan`.")
                tensor_mesh = _as_tuple(value)
                continue
            mine = values.get(name)
            if mine is not None and _as_tuple(mine) != _as_tuple(value):
                raise ValueError(
                    f"{name}={mine!r} (the argument) contradicts {source}, which says "
                    f"{name}={value!r}. Leave the argument out to use the plan, or write a "
                    f"new plan with `hyparflow plan`.")
            values[name], origin[name] = value, source
        if tensor_mesh is None and plan.get("tensor_mesh") is not None:
            tensor_mesh = tuple(plan["tensor_mesh"])  # a strategy's [q, q]
    if source is not None and settings.reshaped(environ):
        plan = _after_restart(world_size, values, origin, source, plan)
    mesh = _mesh(tensor_mesh, environ)
    if mesh is not None and "num_tensor" not in values and isinstance(mesh[0], int):
        values["num_tensor"], origin["num_tensor"] = mesh[0] * mesh[0], "tensor_mesh"
    from_env = settings.layout_counts(environ)
    overridden = []
    for name, value in from_env.items():
        if name not in values:
            values[name], origin[name] = value, (f"$HYPARFLOW_{name.upper()}, from "
                                                 "`hyparflow run` or a job script")
        elif values[name] != value:
            overridden.append((name, values[name], origin[name], value))
    stages = values.get("num_stages", 1)
    tensor = values.get("num_tensor", 1)
    origin.setdefault("num_stages", "the default")
    origin.setdefault("num_tensor", "the default")
    origin.setdefault("num_microbatches", "the default")
    for name, value in (("num_stages", stages), ("num_tensor", tensor)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    pipeline = stages * tensor
    what = (f"num_stages={stages}" if tensor == 1 else
            f"num_stages x num_tensor = {stages} x {tensor}")
    replicas = values.get("num_replicas")
    if replicas is None:
        if world_size % pipeline:
            raise ValueError(
                f"The world has {world_size} ranks, which {what} does not divide. Launch a "
                f"multiple of {pipeline} ranks (e.g. mpiexec -n "
                f"{pipeline * max(1, world_size // pipeline)}) or change num_stages"
                + (" or num_tensor." if tensor > 1 else "."))
        replicas, origin["num_replicas"] = world_size // pipeline, "the world size"
    elif pipeline * replicas != world_size:
        raise ValueError(_mismatch(world_size, stages, tensor, replicas, origin))
    return Layout(num_stages=stages, num_replicas=replicas,
                  num_microbatches=values.get("num_microbatches", 1), num_tensor=tensor,
                  schedule=values.get("schedule", DEFAULT_SCHEDULE),
                  num_chunks=values.get("num_chunks", 1), balance=_as_tuple(balance),
                  tensor_layers=_as_tuple(values.get("tensor_layers")),
                  tensor_shares=_as_tuple(tensor_shares), plan=plan, origin=origin,
                  overridden=tuple(overridden), tensor_mesh=mesh)


def _mesh(value: Any, environ: Optional[Mapping[str, str]]) -> Any:
    """`tensor_mesh` as a tuple: the argument ((2, 2), [2, 2] or "2x2"), else
    $HYPARFLOW_TENSOR_MESH (`hyparflow run --tensor-mesh`); checked by `Layout`."""
    if value is None:
        return settings.tensor_mesh(environ)
    if isinstance(value, str):
        return settings.parse_mesh(value, "tensor_mesh")
    return _as_tuple(value)


_WARNED: set[Tuple[str, Any, Any]] = set()


def warn_overridden(layout: Layout) -> None:
    """Warn (once per process and count) where the launcher's count lost to an argument
    or a plan: `hyparflow run --stages 1` beside `num_stages=2` in the script trains 2
    stages, as documented, but says so. Called on one rank."""
    import warnings

    for name, used, source, launched in layout.overridden:
        key = (name, used, launched)
        if key in _WARNED:
            continue
        _WARNED.add(key)
        flag = "--" + name[len("num_"):]
        warnings.warn(
            f"{name}={used!r} ({source}) overrides {name}={launched!r} from the launcher "
            f"($HYPARFLOW_{name.upper()}, set by `hyparflow run {flag}` or a job script). "
            f"To take the launcher's, leave {name} out of the call (or pass None).",
            UserWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The `stacklevel` of the first caller outside hyparflow (the user's call)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep  # its wings included
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _after_restart(world_size: int, values: dict[str, Any], origin: dict[str, str], source: str,
                   plan: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """A plan file's counts fitted to the fewer ranks a restart left (`values` and
    `origin` updated in place); returns the plan, or None when its cut no longer
    applies. Fewer replicas first, keeping the plan's stages and cut; then fewer
    stages (one replica), cut by estimate. The plan's microbatches and schedule stay."""
    import warnings

    stages = values.get("num_stages", 1)
    tensor = values.get("num_tensor", 1)
    replicas = values.get("num_replicas")
    if replicas is None:  # the plan leaves the replicas to the world size
        if world_size % (stages * tensor) == 0:
            return plan
        replicas = 1
    elif stages * tensor * replicas == world_size:
        return plan
    if origin.get("num_replicas") == source and world_size % (stages * tensor) == 0:
        values["num_replicas"] = world_size // (stages * tensor)
        origin["num_replicas"] = f"{source}, fewer replicas after a restart"
        warnings.warn(f"{source} was made for {stages * tensor * replicas} ranks; restarted on "
                      f"{world_size}, it runs with num_replicas={values['num_replicas']} "
                      "and its stages as planned.", RuntimeWarning, stacklevel=3)
        return plan
    if (origin.get("num_stages") == source and origin.get("num_replicas") in (source, None)
            and world_size % tensor == 0):
        values["num_stages"], values["num_replicas"] = world_size // tensor, 1
        origin["num_stages"] = f"{source}, fewer stages after a restart"
        origin["num_replicas"] = origin["num_stages"]
        if values.pop("num_chunks", 1) != 1 or values.get("schedule") in CHUNKED:
            values["schedule"] = DEFAULT_SCHEDULE  # its chunks were cut for the old stages
        warnings.warn(f"{source} was made for {stages * tensor * replicas} ranks; restarted on "
                      f"{world_size}, it runs with num_stages={values['num_stages']}, one "
                      "replica, its layers cut by estimate (write a new plan with `hyparflow "
                      "plan` for a measured cut).", RuntimeWarning, stacklevel=3)
        return None
    return plan


def _mismatch(world_size: int, stages: int, tensor: int, replicas: int,
              origin: Mapping[str, str]) -> str:
    """S x T x R does not make the world: say where each number came from."""
    def named(name: str, value: int) -> str:
        return f"{name}={value} ({origin.get(name, 'the default')})"

    product = " x ".join([named("num_stages", stages)]
                         + ([named("num_tensor", tensor)] if tensor > 1 else [])
                         + [named("num_replicas", replicas)])
    pipeline = stages * tensor
    hint = ""
    if origin.get("num_replicas", "").startswith("$"):
        # `hyparflow run --replicas` was given for another S than the script's.
        hint = (" Leave --replicas out (the replicas are then world size // (stages x "
                "tensor)), or pass num_replicas to hyparflow.")
    elif world_size % pipeline == 0:
        hint = f" Launch mpiexec -n {pipeline * replicas}, or pass num_replicas=" \
               f"{world_size // pipeline} (or None)."
    else:
        hint = f" Launch mpiexec -n {pipeline * replicas}."
    return f"{product} = {pipeline * replicas} ranks, but {world_size} were launched.{hint}"
