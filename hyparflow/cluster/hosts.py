"""Hosts for a run without Slurm: `--hosts h1:2,h2:2` or a hostfile, and where each rank goes.

mpiexec (MPICH's hydra) fills the hosts in order, as many ranks on each as it has
slots: ranks 0..k-1 on the first host, and so on. hyparflow numbers a pipeline's
stages consecutively (rank = (replica * S + stage) * T + tensor, topology.py), so when
each host's slots are a multiple of S x T, every pipeline stays within one host (its
activations never cross a link) and only the once-per-step gradient sums cross hosts.
Pure Python.
"""

from __future__ import annotations

import re
from typing import Iterable, List, Sequence, Tuple

from ..topology import Topology

__all__ = ["HostError", "HostSlots", "parse_hosts", "read_hostfile", "place", "describe_placement"]

# [(host name, slots)], in the order mpiexec fills them.
HostSlots = List[Tuple[str, int]]


class HostError(ValueError):
    """A host list or hostfile that cannot be used; the message says why and the fix."""


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _entry(text: str, where: str) -> Tuple[str, int]:
    """'host', 'host:N' or 'host slots=N' -> (host, N)."""
    text = text.strip()
    match = re.match(r"^(\S+?)(?::(\S+)|\s+slots\s*=\s*(\S+))?$", text)
    if not match or not _NAME.match(match.group(1)):
        raise HostError(f"{where}: cannot read {text!r}; write a host as NAME or NAME:SLOTS "
                        "(e.g. node1:4), in a hostfile also NAME slots=SLOTS.")
    host, slots = match.group(1), match.group(2) or match.group(3) or "1"
    if not slots.isdigit() or int(slots) < 1:
        raise HostError(f"{where}: the slots of {host!r} must be a positive integer. "
                        f"Received: {slots!r}")
    return host, int(slots)


def _merge(entries: Iterable[Tuple[str, int]], where: str) -> HostSlots:
    hosts: dict[str, int] = {}
    for host, slots in entries:
        if host in hosts:
            raise HostError(f"{where}: host {host!r} is listed twice; give it once with "
                            f"all its slots ({host}:{hosts[host] + slots}).")
        hosts[host] = slots
    if not hosts:
        raise HostError(f"{where}: no hosts given.")
    return list(hosts.items())


def parse_hosts(text: str | None) -> HostSlots:
    """`h1:2,h2:2` -> [('h1', 2), ('h2', 2)] (a host without `:N` has one slot)."""
    parts = [p for p in (text or "").split(",") if p.strip()]
    return _merge([_entry(p, "--hosts") for p in parts], "--hosts")


def read_hostfile(path: str) -> HostSlots:
    """A hostfile: one host per line, `NAME`, `NAME:SLOTS` or `NAME slots=SLOTS`; # comments."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as error:
        raise HostError(f"cannot read the hostfile {path!r}: {error.strerror or error}") from None
    entries: HostSlots = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if line:
            entries.append(_entry(line, f"{path}, line {number}"))
    return _merge(entries, path)


def place(hosts: Sequence[Tuple[str, int]], ranks: int) -> List[str]:
    """The host of each of `ranks` ranks, filling `hosts` [(name, slots)] in order as
    mpiexec does. More ranks than slots is refused (mpiexec would wrap around and put
    a pipeline's stages on hosts hyparflow did not plan)."""
    total = sum(slots for _, slots in hosts)
    if ranks > total:
        listed = ",".join(f"{h}:{s}" for h, s in hosts)
        raise HostError(f"{ranks} ranks but the hosts have {total} slots ({listed}); give "
                        f"each host more slots or run -n {total}.")
    where = [host for host, slots in hosts for _ in range(slots)]
    return where[:ranks]


def describe_placement(where: Sequence[str], stages: int, replicas: int,
                       tensor: int = 1) -> List[str]:
    """Lines saying where each rank runs and what it holds, then a warning for each
    pipeline that crosses hosts (its activations then travel between hosts)."""
    topo = Topology(stages, replicas, tensor)
    lines = []
    for rank, host in enumerate(where):
        part = f"stage {topo.stage(rank)}, replica {topo.replica(rank)}"
        if tensor > 1:
            part += f", tensor {topo.tensor(rank)}"
        lines.append(f"rank {rank}: {host} ({part})")
    for r in range(replicas):
        spread = sorted({where[k] for s in range(stages) for t in range(tensor)
                         for k in [topo.rank(s, r, t)]}, key=[h for h in where].index)
        if len(spread) > 1:
            lines.append(f"note: replica {r}'s pipeline spans hosts {', '.join(spread)}: its "
                         "activations cross the network (give each host a multiple of "
                         f"{stages * tensor} slots to keep pipelines within hosts)")
    return lines
