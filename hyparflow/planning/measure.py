"""The planner's measurements, parent side: what this machine does with the plan's
ranks running on it. The network (a two-rank ping-pong; hyparflow's own allreduce in
rings of every size) and compute (the model's compiled step with 1, 2, ... of the
ranks computing at once, the optimizer step with all of them, stages with split
layers) are measured by `hyparflow.probes` under this venv's mpiexec, each result
one JSON line; a stage without split layers is timed here, in this process, with
`engine.timing.time`. The cost model that uses the numbers is `planner`'s.
"""

import json
import os
import subprocess
import sys

__all__ = ["run_probe", "ping_pong", "rings", "compute", "stage_costs", "StageTimer",
           "tensor_stages", "stage_for", "IDLE"]

# A pipeline stage's call follows a wait for its input, and on this host a compiled
# call after 5-70 ms asleep took 4-7% longer than the same call back to back (the
# median of 36 each: 7.0 ms back to back, 7.3-7.5 ms after a sleep). The stages of
# a pipeline are timed each call after this long asleep, as they run.
IDLE = 0.01


def run_probe(ranks, probe, *args, hosts=None):
    """Run `hyparflow.probes.<probe>(*args)` on `ranks` ranks under mpiexec (on `hosts`,
    mpiexec's -hosts list, if given); the results it reports, as dicts."""
    from ..cluster.launch import find_mpiexec

    mpiexec = find_mpiexec(os.environ)
    if not mpiexec:
        raise ValueError("No mpiexec to measure this machine with; give --latency and "
                         "--bandwidth.")
    where = ["-hosts", hosts] if hosts else []
    out = subprocess.run([mpiexec, *where, "-n", str(ranks), sys.executable, "-c",
                          f"from hyparflow.planning.probes import {probe}; {probe}(*{args!r})"],
                         capture_output=True, text=True, timeout=1200)
    results = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue  # a line of the model's own output
            if isinstance(found, dict) and "probe" in found:
                results.append(found)
    if out.returncode or not results:
        raise RuntimeError(f"measurement {probe} under mpiexec failed: {out.stderr[-2000:]}")
    return results


def ping_pong(hosts=None):
    """(alpha s, beta s/byte) between two ranks: here, or on `hosts` ("h1:2" for two
    ranks within host h1, "h1:1,h2:1" for the link between h1 and h2)."""
    found = run_probe(2, "ping_pong", hosts=hosts)[-1]
    return found["alpha"], found["beta"]


def rings(ranks):
    """For every g > 1 dividing `ranks`, all `ranks` processes started on this node and
    split into groups of g: ({g: (alpha, beta) per ring round}, {g: (alpha, beta) per
    exchange}, wait). Rings sum buffers with hyparflow's own allreduce (buckets, ring
    and waits), as the replicas of a plan do; exchanges are a split layer's sum
    (`tensor.Collectives.sum`) inside a compiled function, as tensor ranks do. `wait`:
    seconds from a send until a rank that waited for it has it, with the other ranks
    computing (`probes._wait`)."""
    groups, exchanges, wait = {}, {}, 0.0
    for found in run_probe(ranks, "rings"):
        if found["probe"] == "wait":
            wait = found["seconds"]
        else:
            into = groups if found["probe"] == "ring" else exchanges
            into[found["group"]] = (found["alpha"], found["beta"])
    return groups, exchanges, wait


def compute(ranks, source, function, batches):
    """The model's compiled forward and backward with the plan's ranks on this node
    (each with the threads a rank of the plan gets): {n: {batch: seconds}} with n of
    them computing at once, n = 1 .. ranks; and seconds per parameter byte of the
    optimizer step with all of them stepping at once. Ranks that share cores or
    memory bandwidth slow each other down; this is how much, for this model."""
    times, optimizer = {}, None
    for found in run_probe(ranks, "compute", source, function, list(batches)):
        if found["probe"] == "optimizer":
            optimizer = found["seconds_per_byte"]
        else:
            times.setdefault(found["busy"], {})[found["batch"]] = found["seconds"]
    return times, optimizer


def tensor_stages(ranks, source, function, batches, keys, repeats=5):
    """{key: [(forward, backward, forward alone, backward alone) seconds at each of
    `batches`]} for stages `keys` (`StageTimer.key`) whose layers are split over their
    tensor ranks: `ranks` processes on this node run each stage at once, in groups of
    its tensor ranks, as the ranks of a plan with that many tensor ranks per stage
    do; then one group runs it, the other ranks waiting as pipeline stages wait (a
    stage of a pipeline runs while the others wait for it)."""
    found = {}
    for r in run_probe(ranks, "tensor_stages", source, function, list(batches),
                       [list(k) for k in keys], repeats):
        found.setdefault(keys[r["index"]], {})[r["batch"]] = (
            r["forward"], r["backward"], r["forward_alone"], r["backward_alone"])
    return {key: [found[key][b] for b in sorted(found[key])] for key in found}


def stage_costs(graph, model, rows, batches, repeats=5):
    """What a stage pays besides its layers' fused forward and backward, measured in
    this process on hyparflow's own `Stage` (all the model's calls but the last, which
    is how every stage but a fused last one runs): `taped`, how many times longer
    than those layers' share of the model's compiled step its forward and backward
    take (a separate compiled forward kept on a tape, the backward from it, the
    gradients summed into the stage's buffers), and `forward`, the forward's share.
    None for a model of one call. The last stage adds only the summing, at
    `add_s_per_byte`."""
    import numpy as np

    from ..clock import timed
    from ..engine import timing
    from .costmodel import Row

    n = len(graph.nodes)
    if n < 2:
        return None
    buf = np.zeros(1 << 22, np.float32)
    out = {"batches": list(batches), "taped": [], "forward": [],
           "add_s_per_byte": timed(lambda: np.add(buf, buf, out=buf), repeats) / buf.nbytes}
    stage = stage_for(graph, model, (0, n - 1, False))
    for b in batches:
        # Those layers' share of the fused step: `rows` were fitted to the model's
        # compiled step at these very batch sizes (`profile.fit_model`).
        fused = sum(Row(*r).seconds(b) for r in rows[:-1])
        ahead, behind = timing.time(stage, b, repeats=repeats)
        whole = ahead + behind
        out["taped"].append(max(1.0, whole / max(fused, 1e-12)))
        out["forward"].append(min(0.9, ahead / whole))
    return out


class StageTimer:
    """Each stage of a plan timed as hyparflow runs it: its layers compiled into a
    `Stage`, forward kept on a tape and backward from it, or both in one call for a
    last stage under 1F1B, the gradients summed into its buffers (`engine.timing.time`).
    Layer profiles share the model's step out among its calls only roughly (one
    eager call at a time), and a stage pays more than its calls' share (its own
    compiled calls, the tape, the sums); this times the whole.

    `timer(counts, s, m, fused)` -> (forward, backward) seconds of stage `s` of a
    partition into `counts` on `m` samples: measured at the two `batches` and
    interpolated between them, each stage (first call, length, fused) in two passes
    over all of them (`prepare`), in this process. A last stage is timed with ones as
    its outputs' gradients, as `profile.model_step` times the whole model: the
    planner has no targets to feed the user's loss.

    `timer(counts, s, m, fused, num_tensor)`, with the model's `source` and
    `function` and the plan's `ranks` given: stage `s` with its layers split over
    `num_tensor` ranks, timed under mpiexec (`tensor_stages`), its split layers'
    exchanges included, as they run inside the compiled stage, between ranks that
    share this node's cores: (forward, backward) with all `ranks` running it at once
    in groups of `num_tensor`, then (forward, backward) with one group running it.
    `prepare` times many such stages in one run."""

    def __init__(self, graph, model, batches, repeats=9, source=None, function=None,
                 ranks=None):
        # The median of 9 calls: a stage's call of a few milliseconds varied twofold
        # over 5 on this shared host (other machines' spells take its cores).
        self.graph, self.model, self.repeats = graph, model, repeats
        self.batches = sorted(set(int(b) for b in batches))
        self.source, self.function, self.ranks = source, function, ranks
        self._cache = {}

    @property
    def splits(self):
        """Whether stages with split layers can be timed (under mpiexec) here."""
        return self.source is not None and bool(self.ranks)

    def key(self, counts, s, fused, num_tensor=1):
        return sum(counts[:s]), counts[s], len(counts) - 1 == s, bool(fused), num_tensor

    def prepare(self, wanted, sweeps=2):
        """Time every (counts, s, fused, num_tensor) of `wanted` not timed yet: the
        stages with split layers in one run under mpiexec; the others here, in
        `sweeps` passes over all of them, each stage's faster pass kept. This host's
        slow spells last seconds, longer than a stage's nine calls: timed in one go,
        the same pipeline of 2 stages came out 0.058 to 0.084 s from one planner run
        to the next."""
        from ..engine import timing

        keys = {self.key(c, s, f, t) for c, s, f, t in wanted}
        keys = sorted(k for k in keys if k not in self._cache)
        split = [k for k in keys if k[-1] > 1]
        if split:
            self._cache.update(tensor_stages(self.ranks, self.source, self.function,
                                             self.batches, split, self.repeats))
        stages = {k: stage_for(self.graph, self.model, k) for k in keys if k[-1] == 1}
        for _ in range(sweeps):
            for key, stage in stages.items():
                found = [timing.time(stage, b, fused=key[3], repeats=self.repeats, idle=IDLE)
                         for b in self.batches]
                known = self._cache.get(key, found)
                self._cache[key] = [min(a, b, key=sum) for a, b in zip(known, found)]

    def __call__(self, counts, s, m, fused, num_tensor=1):
        from .costmodel import interpolate

        key = self.key(counts, s, fused, num_tensor)
        if key not in self._cache:
            self.prepare([(counts, s, fused, num_tensor)])
        points = self._cache[key]
        if len(points) == 1:
            return points[0]
        x = (self.batches[0], self.batches[-1])
        # A stage's time is affine in its batch: extended beyond the two sizes.
        return tuple(interpolate(x, (points[0][k], points[-1][k]), m, beyond="extend")
                     for k in range(len(points[0])))


def stage_for(graph, model, key, shards=None):
    """hyparflow's `Stage` for the stage `key` (`StageTimer.key`: its first call, how
    many, whether it is the last); with `shards`, its split layers' parts
    (`tensor.shard`). A last stage's outputs are the model's (which its loss would
    take), so that timing it differentiates them."""
    from ..engine.partition import partition
    from ..engine.stage import Stage

    first, count, last = key[:3]
    counts = [c for c in (first, count, len(graph.nodes) - first - count) if c]
    part = partition(graph, len(counts), counts)
    plan = part.stages[1 if first else 0]
    stage = Stage(graph, plan, model, part, is_last=False, shards=shards)
    if last:
        stage.output_ids = list(plan.outputs)
    return stage


def strategy_steps(ranks, source, function, path, batch, steps=5):
    """Seconds of one training step of the model under the strategy file `path`, run
    for real by `hf.fit` on `ranks` ranks under mpiexec (`probes.strategy_steps`)."""
    return run_probe(ranks, "strategy_steps", source, function, path, batch, steps)[-1]["seconds"]
