"""The sweep's progress table, printed by rank 0: one row per member, its config and
its latest logs, and whether it stopped (early stopping) and when."""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

__all__ = ["config_columns", "render"]

# A member's row: (sweep index, its latest logs or None, status).
Row = Tuple[int, Optional[Mapping[str, Any]], str]


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 12 else text[:11] + "~"


def config_columns(configs: Sequence[Mapping[str, Any]]) -> List[str]:
    """The config keys worth a column: those whose values differ between members (all of
    them when every member has the same)."""
    keys: List[str] = []
    for config in configs:
        for k in config:
            if k not in keys:
                keys.append(k)
    varying = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
    return varying or keys


def render(epoch: int, epochs: int, rows: Sequence[Row], configs: Sequence[Mapping[str, Any]],
           seconds: Optional[float] = None, samples: Optional[float] = None) -> str:
    """The table's text: `rows` [(sweep index, logs dict or None, status)] for every
    member, by index."""
    keys = config_columns(configs)
    metrics: List[str] = []
    for _, logs, _ in rows:
        for k in (logs or {}):
            if k not in metrics:
                metrics.append(k)
    header = ["member"] + keys + metrics + ["status"]
    body = []
    for index, logs, status in rows:
        body.append([str(index)] + [_short(configs[index].get(k, "")) for k in keys]
                    + [_short(logs[k]) if logs and k in logs else "" for k in metrics]
                    + [status])
    widths = [max(len(r[c]) for r in [header] + body) for c in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) for v, w in zip(r, widths))

    title = f"hyparflow sweep: epoch {epoch + 1}/{epochs}"
    if seconds is not None:
        title += f" - {seconds:.1f} s"
        if samples:
            title += f" - {samples / max(seconds, 1e-9):,.0f} samples/s over the members"
    return "\n".join([title, line(header)] + [line(r) for r in body])
