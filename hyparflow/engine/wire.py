"""Reduced-precision exchanges (`communication_dtype`): which paths send their floating
values in 16 bits, the replicas' gradient sum over a 16-bit wire, and the dynamic loss
scale of float16 exchanges.

Three paths exchange floating values: the sharded tables' rows and gradients
("tables", `kinds.tables`), the dense gradient sums over replicas ("replicas",
`overlap.Buckets`) and the pipeline boundaries' activations and their gradients
("stages", `engine.boundary`). `resolve` reads the setting: one name for every path,
or a dict per path. Integer tensors (ids, masks, headers, counts) never change.

The replicas' sum (`Sum`): each rank casts its gradient buffer to 16 bits once and sends
it to every other rank (point-to-point, non-blocking, advanced by `test()` like the
ring allreduce); each rank adds the R buffers in float32, in rank order, so every rank
gets the same bits. This is "gather": (R-1) x the buffer per rank. "scatter" (a
reduce-scatter of 16-bit chunks to their owners, summed in float32, and an allgather
of the 16-bit sums) sends 2 (R-1)/R x the buffer but rounds the sum once more (every
rank keeps the owner's 16-bit sum, so all agree); at R = 2 both send the same bytes.
`mode_for` chooses, as measured (docs/recommenders.md).

float16 keeps 11 bits of mantissa but only 5 of exponent: gradients under 6e-8 become
zero, and values over 65504 infinite. Gradients that travel in float16 are multiplied
by a `LossScale` before the cast and divided by it in float32 after the sum (a power of
two: exact). A received float16 buffer with an inf or nan (an overflow, or a gradient
that was not finite already) is sent again in float32 for that step, so no step's
result is wrong because of the scale, and the scale halves; it doubles after
`growth_steps` steps without one (Keras's `LossScaleOptimizer` rules: 2**15 to start,
2000 steps). Every rank that takes part sees the same buffers, so they agree on each
redo and on the scale without a message of their own. bfloat16 has float32's
exponent: no scale, no redo.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from .. import settings

__all__ = ["PATHS", "NAMES", "resolve", "numpy_dtype", "LossScale", "Sum", "start_sum",
           "SUM_TAG", "mode_for"]

PATHS = ("tables", "replicas", "stages")
NAMES = ("float32", "bfloat16", "float16")
# Point-to-point tags of the replicas' 16-bit sums on a gradient group's communicator
# (which carries no other point-to-point message but ZeRO's, off with a 16-bit wire):
# two per bucket, the 16-bit exchange and its float32 redo.
SUM_TAG = 20000


def _bad_name(value: Any, where: str) -> ValueError:
    return ValueError(
        f"communication_dtype={where}{value!r} is not a dtype hyparflow exchanges in. Use "
        f"one of {list(NAMES)} (or None: float32), for every path or per path as a dict "
        f"{{path: dtype}} with paths {list(PATHS)}.")


def resolve(value: Any) -> Dict[str, str]:
    """`communication_dtype` -> {path: name} for every path of `PATHS` ("float32" where
    not set): None, one name for every path, or a dict naming some paths."""
    if value is None:
        return {p: "float32" for p in PATHS}
    if isinstance(value, str):
        if value not in NAMES:
            raise _bad_name(value, "")
        return {p: value for p in PATHS}
    if isinstance(value, dict):
        unknown = sorted(str(k) for k in value if k not in PATHS)
        if unknown:
            raise ValueError(
                f"communication_dtype names paths hyparflow does not have: {unknown}. "
                f"The paths are {list(PATHS)} (the sharded tables' rows and gradients, the "
                "replicas' gradient sums, the pipeline boundaries).")
        out = {}
        for p in PATHS:
            name = value.get(p, "float32")
            if name is None:
                name = "float32"
            if name not in NAMES:
                raise _bad_name(name, f"{{{p!r}: ...}}: ")
            out[p] = name
        return out
    raise TypeError(f"communication_dtype={value!r}: pass a dtype name ({list(NAMES)}), "
                    f"a dict {{path: dtype}} with paths {list(PATHS)}, or None.")


def numpy_dtype(name: Optional[str]) -> Optional[np.dtype]:
    """The numpy dtype floating values travel in (None: as they are)."""
    if name is None or name == "float32":
        return None
    if name == "bfloat16":
        import ml_dtypes  # comes with TensorFlow

        bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bfloat16
    return np.dtype(np.float16)


def scaled(dtype: Optional[np.dtype]) -> bool:
    """Whether values travelling in `dtype` take a loss scale (float16 only)."""
    return dtype is not None and dtype == np.float16


class LossScale:
    """A dynamic scale for gradients that travel in float16: `value` multiplies them
    before the cast; `update(overflowed)` once per step halves it after a step with an
    inf/nan (never under 1) or doubles it after `growth_steps` good steps in a row.
    HYPARFLOW_LOSS_SCALE="INITIAL[,GROWTH_STEPS]" (default 32768,2000)."""

    def __init__(self, initial: Optional[float] = None, growth_steps: Optional[int] = None):
        default_initial, default_growth = settings.loss_scale()
        self.value = float(default_initial if initial is None else initial)
        self.growth_steps = int(default_growth if growth_steps is None else growth_steps)
        self.good = 0
        self.overflows = 0  # steps with a float32 redo

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.value = max(1.0, self.value / 2)
            self.good = 0
            self.overflows += 1
            return
        self.good += 1
        if self.good >= self.growth_steps:
            self.value = min(self.value * 2, 2.0 ** 64)
            self.good = 0


class Sum:
    """An in-place sum of the float32 buffer `flat` over `comm`, exchanged in `wire`
    (16 bits, or float32 for a redo) and added in float32. `values`: how many leading
    values are gradients (multiplied by `scale` before the cast, divided after); the
    rest (one flag per variable: 0 or 1) travel unscaled. `counter`: an object whose
    `sent` grows by the bytes this rank sends. `mode`: "gather" or "scatter" (the
    module's docstring). A float16 result with an inf or nan is summed again in
    float32 (`overflowed` then true)."""

    def __init__(self, comm: Any, flat: np.ndarray, values: int, wire: np.dtype,
                 scale: float, tag: int, counter: Any, mode: str = "gather") -> None:
        self.comm, self.flat, self.values, self.wire = comm, flat, values, np.dtype(wire)
        self.scale, self.tag, self.counter, self.mode = float(scale), tag, counter, mode
        self.overflowed = False
        self.redo: Optional[Sum] = None
        self.done = False
        n, me = comm.size, comm.rank
        out = np.empty(flat.size, self.wire)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone
            if self.scale != 1.0:
                np.multiply(flat[:values], np.float32(self.scale), out=out[:values],
                            casting="unsafe")
                out[values:] = flat[values:]
            else:
                out[...] = flat
        self.mine = out
        bounds = np.linspace(0, flat.size, n + 1).astype(np.int64)
        self.bounds = bounds
        self.reqs: List[Any] = []
        if mode == "gather":
            self.got = [out if p == me else np.empty(flat.size, self.wire) for p in range(n)]
            for p in range(n):
                if p != me:
                    self.reqs.append(comm.irecv(self.got[p], p, tag))
                    self.reqs.append(comm.isend(out, p, tag))
                    counter.sent += out.nbytes
            self.phase = 2
        else:
            lo, hi = bounds[me], bounds[me + 1]
            self.got = [out[lo:hi] if p == me else np.empty(hi - lo, self.wire)
                        for p in range(n)]
            for p in range(n):
                if p != me:
                    self.reqs.append(comm.irecv(self.got[p], p, tag))
                    chunk = out[bounds[p]:bounds[p + 1]]
                    self.reqs.append(comm.isend(chunk, p, tag))
                    counter.sent += chunk.nbytes
            self.phase = 1

    def _added(self) -> np.ndarray:
        """The received buffers added in float32, in rank order."""
        total = self.got[0].astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is redone
            for part in self.got[1:]:
                total += part.astype(np.float32)
        return total

    def test(self) -> bool:
        if self.done:
            return True
        if self.redo is not None:
            self.done = self.redo.test()
            return self.done
        if not all(r.test() for r in self.reqs):
            return False
        if self.phase == 1:
            # This rank's chunk is summed: its 16-bit sum (this rank keeps the same
            # rounding as the others get) goes to every other rank.
            comm, me, bounds = self.comm, self.comm.rank, self.bounds
            lo, hi = bounds[me], bounds[me + 1]
            self.mine[lo:hi] = self._added().astype(self.wire)
            self.reqs = []
            for p in range(comm.size):
                if p != me:
                    self.reqs.append(comm.irecv(self.mine[bounds[p]:bounds[p + 1]], p,
                                                self.tag))
                    self.reqs.append(comm.isend(self.mine[lo:hi], p, self.tag))
                    self.counter.sent += self.mine[lo:hi].nbytes
            self.phase = 2
            return self.test()
        total = self._added() if self.mode == "gather" else self.mine.astype(np.float32)
        if scaled(self.wire) and not np.isfinite(total[:self.values]).all():
            # The same buffers on every rank: every rank redoes this sum.
            self.overflowed = True
            self.redo = Sum(self.comm, self.flat, self.values, np.dtype(np.float32), 1.0,
                            self.tag + 1, self.counter, self.mode)
            return self.test()
        if self.scale != 1.0:
            total[:self.values] *= np.float32(1.0 / self.scale)
        self.flat[...] = total
        self.done = True
        return True


def start_sum(comm: Any, flat: np.ndarray, values: int, wire: np.dtype, scale: float,
              index: int, counter: Any) -> Sum:
    """Bucket `index`'s sum (its tags: `SUM_TAG + 2 index`, + 1 for the redo)."""
    return Sum(comm, flat, values, wire, scale, SUM_TAG + 2 * index, counter,
               mode_for(comm.size, flat.nbytes))


GATHER_BYTES = 2 << 20


def mode_for(size: int, nbytes: int) -> str:
    """Which exchange a sum of `nbytes` (float32) over `size` ranks takes. Measured with
    benchmarks/wire_sum.py on one node (docs/recommenders.md): at R = 2 both send the
    same bytes and "gather" saves a round; at R = 4 "gather" was faster up to 1 MB,
    "scatter" from 4 MB (1.5-2x faster at 4-16 MB: half the bytes)."""
    return "gather" if size <= 2 or nbytes < GATHER_BYTES else "scatter"
