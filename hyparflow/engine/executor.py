"""Runs one rank's lowered schedule for a training step: stage + communicator.

Receives are posted for the whole step before the first action, sends are
non-blocking and completed at the step's end, so the order in which stages
reach their messages never matters; a wait that outlives the watchdog raises
with the action it was waiting in. With a `Timeline`, every action is
recorded with its wall time.
"""

import time

import numpy as np

from . import overlap
from .. import schedules as sched
from . import sparse as _sparse
from .boundary import Boundary
from .comm import CommTimeout, timeout_seconds, wait_all
from .fill import Fill

__all__ = ["Executor", "split_batch", "AUTO"]

# What schedule="auto" tries, each for two steps (the first traces), before keeping
# the fastest by the slowest rank's time of its second step.
AUTO = sched.AUTO  # what schedule="auto" tries, in order (the schedule table says)


def split_batch(indices, num_replicas, num_microbatches):
    """Global batch -> per replica, per microbatch, contiguous index arrays.

    `np.array_split` sizes: the first slices take one more sample when the
    batch does not divide evenly; empty microbatches (only in a short last
    batch) are dropped."""
    out = []
    for part in np.array_split(indices, num_replicas):
        out.append([m for m in np.array_split(part, num_microbatches) if len(m)])
    return out


class Executor(Fill):
    """One rank: stage `stage` of replica `replica`, driven step by step by the trainer."""

    def __init__(self, comm, topology, partition, graph, stage, optimizer, *,
                 schedule="1f1b", num_microbatches=1, groups=(), timeline=None, chunks=None):
        """`chunks`: with an interleaved schedule, this rank's model chunks (a `Stage`
        each, for virtual stages s, s + S, ... of `partition`), whose gradients go
        into `stage` (an accumulator: `Stage.sink_into`); None: `stage` is the one."""
        self.comm, self.topo, self.part, self.graph = comm, topology, partition, graph
        self.stage, self.optimizer = stage, optimizer
        self.stages = list(chunks) if chunks else [stage]
        self.chunks = len(self.stages)
        self.schedule, self.num_microbatches = schedule, num_microbatches
        # schedule="auto": the steps `_trials` plays in turn, and their times.
        self._trials = [name for name in AUTO for _ in range(2)] if schedule == "auto" else []
        self._timed = {}
        self.chosen = None  # what "auto" chose, once it has
        self.transposed = None  # {node: keeps W^T}, agreed at the first training step
        # Replicas that step on their own (hyparflow.replicas) scale their summed
        # gradients by this before the optimizer step; 1 under allreduce.
        self.grad_scale = 1.0
        if schedule == "auto":
            self.schedule = AUTO[0]
        self.s = topology.stage(comm.rank)
        self.r = topology.replica(comm.rank)
        self.t = topology.tensor(comm.rank)  # messages go to the same tensor rank
        self.cuts = [partition.stages[self.s + c * topology.num_stages]
                      for c in range(self.chunks)]
        self.cut = self.cuts[0]
        self.local = set()  # positions whose pairs stay on this rank (`keep_local`)
        self.set_groups(groups)
        self.num_edges = max(1, len(partition.edges))
        self.timeline = timeline
        self._lowered = {}
        self.position = None  # the action being run, for error messages
        self._sources = [p.sources for p in partition.stages]
        self._dests = [p.dests for p in partition.stages]
        self.boxes = [Boundary(comm, graph, cut, self._rank_of, len(partition.edges))
                      for cut in self.cuts]
        self.boundary = self.boxes[0]
        # Losses divided by a count over the whole batch (`hyparflow.normaliser`):
        # set by the runtime on every rank, since they change every stage's order.
        self.normaliser = None
        # Sharded tables (`kinds.tables.idle.Idle`): serves the others' lookups of the
        # microbatches this replica lacks in a short batch, in their place.
        self.idle = None

    def set_groups(self, groups, early=False, zero=None, wire=None):
        """[(communicator, [variable positions in stage.trainable])]: who sums what.
        `early`: buckets start their allreduces from inside the step's last backward.
        `zero`: a `hyparflow.zero.Zero` when the optimizer step is sharded. `wire`: the
        dtype the sums travel in (None: float32; `engine.wire`)."""
        self.buckets = overlap.Buckets(self.stage, groups, wire)
        # Sums no other rank shares go to the optimizer as the tensors they came as.
        self.stage.grads.direct = not self.buckets.shared
        self.zero = zero if zero else None
        if self.zero is not None:
            self.buckets.reduce = self.zero.start_reduce
        # Per group: {position: "s"/"d"/"-"} as its ranks agreed (see `_agree`).
        self._kinds = [dict() for _ in self.buckets.groups]
        early = self.buckets.shared and early
        self.stage.on_arrival = self.buckets.arrive if early else None

    def keep_local(self, positions):
        """Variables (positions in stage.trainable) whose gradient pairs this rank
        applies as they are, summed with no other rank's: the rows of sharded tables
        it owns, which the pairs of every replica's lookups reached in the backward
        (`kinds.tables`). No buffer, no bucket."""
        self.local = set(positions)
        if self.local:
            self.buckets.exclude(self.local)

    @property
    def groups(self):
        return self.buckets.groups

    def lowered(self, m, training=True):
        key = (m, training, self.schedule)
        if key not in self._lowered:
            if training:
                # The step program the planner times too (`schedules.program`): with
                # one stage 1F1B's order; all forwards first when the losses wait for
                # a global count (the normaliser) or a short batch under model chunks;
                # the last stage's forward and backward of a microbatch in one call
                # where the schedule has them back to back.
                compute = sched.program(self.schedule, self.topo.num_stages, m, self._dests,
                                        self.chunks, self.stage.recompute,
                                        gathered=self.normaliser is not None)
            else:
                compute = sched.forward_only(self.topo.num_stages, m, self.chunks)
            lowered = sched.lower(compute, self._sources, self._dests)
            sched.validate(lowered, m, backward=training)
            self._lowered[key] = lowered[self.s]
        return self._lowered[key]

    def _rank_of(self, stage):
        """The rank of (virtual) stage `stage` in this replica and tensor slot."""
        return self.topo.rank(stage % self.topo.num_stages, self.r, self.t)

    def _record(self, name, cat, start, **args):
        if self.timeline is not None:
            self.timeline.add(name, cat, start, time.perf_counter(), **args)

    def step(self, micro_indices, batch_size, data, step_id=0, seed=0):
        """Training step number `step_id` on this rank's microbatches (`micro_indices`:
        list of index arrays into the data); returns the step's summed loss contribution."""
        start = time.perf_counter()
        contribution = 0.0
        if self._trials:
            self.schedule = self._trials[0]
        if self.transposed is None:
            rows = len(micro_indices[0]) if micro_indices else None
            self._choose_transposed(rows, len(micro_indices))
        for stage in self.stages:
            stage.begin_step()  # the W^T copies wait for the first wait or backward
        self.buckets.arm()
        if self.idle is not None:
            micro_indices = self.idle.pad(micro_indices, batch_size)
        if micro_indices:
            first = (step_id * self.topo.num_replicas + self.r) * self.num_microbatches
            contribution = self._pipeline(micro_indices, batch_size, data, first, seed)
        else:
            self._normalise_empty()
        if self.grad_scale != 1.0:
            self.stage.grads.scale(self.grad_scale)
        self._allreduce_and_apply()
        self._record("step", "step", start, step=step_id)
        if self._trials:
            self._try(time.perf_counter() - start)
        return contribution

    def choices(self):
        """What this run chose by timing and that changes round-off (the schedule
        "auto" kept, the Dense layers keeping `W^T`), for a checkpoint: a resume that
        `adopt`s them runs the same products and trains to the same bits."""
        return {"schedule": self.chosen,
                "transposed": None if self.transposed is None else
                {str(node): keep for node, keep in sorted(self.transposed.items())}}

    def adopt(self, choices):
        """Take `choices` (of `choices()`, the same on every rank) instead of timing."""
        if choices.get("schedule") and self._trials:
            self.schedule = self.chosen = choices["schedule"]
            self._trials = []
        if choices.get("transposed") is not None:
            self.transposed = {int(node): keep for node, keep in choices["transposed"].items()}
            for stage in self.stages:
                stage.keep_transposed(self.transposed)

    def _try(self, seconds):
        """schedule="auto": note this step's time under the schedule on trial; after
        the last trial every rank keeps the schedule whose second step (the first
        traces) was fastest on the slowest rank (a collective: all ranks step alike).
        Every schedule trains to the same weights, so trying them costs only time."""
        self._timed[self._trials.pop(0)] = seconds  # the second step's overwrites
        if self._trials:
            return
        mine = [self._timed[name] for name in AUTO]
        everyone = self.comm.allgather_obj(mine) if self.comm.size > 1 else [mine]
        slowest = [max(times[k] for times in everyone) for k in range(len(AUTO))]
        self.schedule = self.chosen = AUTO[slowest.index(min(slowest))]
        if self.timeline is not None:
            self.timeline.add("auto: " + self.chosen, "step", time.perf_counter(),
                              time.perf_counter(), times=dict(zip(AUTO, slowest)))

    def infer(self, kind, micro_indices, batch_size, data):
        """Forward-only pass ("evaluate" or "predict") over this rank's microbatches.
        Returns the summed loss contribution and, on the last stage for "predict",
        the predictions of each microbatch (lists of arrays, one per model output)."""
        if self.idle is not None:
            micro_indices = self.idle.pad(micro_indices, batch_size)
        if not micro_indices:
            if kind != "predict":
                self._normalise_empty()
            return 0.0, []
        return self._pipeline(micro_indices, batch_size, data, 0, None, kind)

    @property
    def _normalising(self):
        """The normaliser, on a rank holding the last stage (None elsewhere)."""
        if self.normaliser is not None and any(st.is_last for st in self.stages):
            return self.normaliser
        return None

    def _normalise_empty(self):
        """A replica with no sample in a short last batch still joins the agreement."""
        norm = self._normalising
        if norm is not None:
            norm.reset()
            norm.agree(lambda reqs: self._wait(reqs, timeout_seconds()))

    def _normalise(self, stage):
        """Before the last stage's first backward (or after its last forward, for
        evaluate): agree on the global normalisers and hand the scales to `stage`."""
        norm = self.normaliser
        self.position = "agreeing on the loss normaliser"
        start = time.perf_counter()
        norm.agree(lambda reqs: self._wait(reqs, timeout_seconds()))
        stage.scales = norm.scales()
        self._record("normaliser", "allreduce", start)

    def _pipeline(self, micro_indices, batch_size, data, first_id, seed, kind="train"):
        g = self.graph
        training = kind == "train"
        timeout = timeout_seconds()
        for box in self.boxes:
            box.start([len(idx) for idx in micro_indices], training)
        sends, outs, grads_in, predictions = [], {}, {}, []
        total = 0.0
        norm = self._normalising
        if norm is not None:
            norm.reset()
        actions = self.lowered(len(micro_indices), training)
        # Split backward (W actions): B leaves the deferred kernels' gradients to W.
        for stage in self.stages:
            stage.split = training and sched.splits(actions)
        # The step's last backward reports gradients as it makes them, so that
        # allreduces start early (only when they are shared: hooks cost a little).
        # Kernels a W computes never report: their buckets start after the step's W's.
        # (Not with model chunks: their gradients go into one accumulator, after each call.)
        hooked = (training and self.chunks == 1 and self.stage.on_arrival is not None
                  and bool(self.stage.hooks))
        last = max((a.microbatch for a in actions if a.kind in (sched.B, sched.FB)), default=None)
        for a in actions:
            i, key = a.microbatch, (a.chunk, a.microbatch)
            stage, cut, box = self.stages[a.chunk], self.cuts[a.chunk], self.boxes[a.chunk]
            self.position = str(a)
            start = time.perf_counter()
            if a.kind in (sched.B, sched.FB):
                self._refresh_transposed()  # if no wait before it took the copies
                start = time.perf_counter()
            if a.kind == sched.RECV_ACT:
                reqs = box.activation_requests(i, a.peer)
                if self._fill(reqs):
                    start = time.perf_counter()  # the wait after the work that filled it
                while reqs:  # a header first, where shapes are known only at run time
                    self._wait(reqs, timeout)
                    reqs = box.activation_requests(i, a.peer)
                self._record(str(a), "wait", start, microbatch=i, peer=a.peer)
            elif a.kind in (sched.F, sched.FB) and self.idle is not None \
                    and not len(micro_indices[i]):
                # A microbatch this replica lacks: only the tables' lookups, for the others.
                self.idle.forward(i, keep=training)
                if a.kind == sched.FB:
                    self.idle.backward(i)
                outs[key], grads_in[key] = {}, {}
                self._record(str(a), "lookups", start, microbatch=i)
            elif a.kind in (sched.F, sched.FB):
                idx = micro_indices[i]
                inputs = [data.x[g.tensors[t].input_position][idx] for t in cut.data_inputs]
                received, masks = box.activations(i)
                inputs += received + masks
                y, sw = (), ()
                if stage.is_last and data.y is not None:
                    y = [leaf[idx] for leaf in data.y]
                    if stage.takes_x:  # a compute_loss override takes the model's inputs
                        y += [leaf[idx] for leaf in data.x]
                    sw = [leaf[idx] for leaf in data.sample_weight or ()]
                share = len(idx) / batch_size
                if a.kind == sched.FB:
                    grads, c = stage.forward_backward(i, inputs, y, sw, share, (seed, first_id + i),
                                                      hooked=hooked and i == last)
                    grads_in[key] = {t: gr.numpy() for t, gr in grads.items()}
                    out = []
                    self._record(str(a), "backward", start, microbatch=i)
                elif training:
                    out, c = stage.forward(i, inputs, y, sw, share=share,
                                           seed=(seed, first_id + i), hooked=hooked and i == last)
                else:
                    out, c, pred, terms = stage.infer(kind, inputs, y, sw, share=share)
                    if pred:
                        predictions.append([p.numpy() for p in pred])
                    if terms.shape[0]:
                        stage.terms[i] = terms.numpy()
                if norm is not None and stage.is_last and kind != "predict":
                    norm.add(stage.terms.pop(i), share)
                outs[key] = {t: o.numpy() for t, o in zip(
                    stage.output_ids + [("mask", t) for t in stage.output_mask_ids], out)}
                total += float(c)
                if a.kind == sched.F:
                    self._record(str(a), "forward", start, microbatch=i)
            elif a.kind == sched.SEND_ACT:
                sends += box.send_activations(i, a.peer, outs[key], training)
                self._record(str(a), "send", start, microbatch=i, peer=a.peer)
            elif a.kind == sched.RECV_GRAD:
                reqs = box.gradient_requests(i, a.peer)
                if self._fill(reqs):
                    start = time.perf_counter()
                self._wait(reqs, timeout)
                self._record(str(a), "wait", start, microbatch=i, peer=a.peer)
            elif a.kind == sched.B:
                if norm is not None and stage.is_last and not norm.agreed:
                    self._normalise(stage)
                if self.idle is not None and self.idle.serving(i):
                    self.idle.backward(i)
                    outs.pop(key, None)
                    grads_in[key] = {}
                    self._record(str(a), "lookups", start, microbatch=i)
                    continue
                out_grads = box.gradients(i)
                outs.pop(key, None)
                grads = stage.backward(i, out_grads)
                grads_in[key] = {t: gr.numpy() for t, gr in grads.items()}
                self._record(str(a), "backward", start, microbatch=i)
            elif a.kind == sched.W:
                left = [j for j in a.microbatches if j in stage.waiting]  # not done in a wait
                if stage.splitting and left:
                    stage.weight_grads(left)
                    self._record(str(a), "weight", start, microbatch=left[0], count=len(left),
                                 layers=len(stage.deferred))
            elif a.kind == sched.SEND_GRAD:
                sends += box.send_gradients(i, a.peer, grads_in[key])
                self._record(str(a), "send", start, microbatch=i, peer=a.peer)
            elif a.kind in (sched.ALLREDUCE, sched.STEP):
                break  # the step closes with these for every replica alike, below
        if norm is not None and kind != "predict":
            last = next(st for st in self.stages if st.is_last)
            if not norm.agreed:
                self._normalise(last)
            total += norm.contribution()
            last.track_global(norm)
        self.position = "completing sends"
        start = time.perf_counter()
        self._wait(sends, timeout)
        self._record("send wait", "wait", start)
        return total if training else (total, predictions)

    def _sparse_exchanges(self, slices, held):
        """Start gathering each group's sparse pairs; pairs of a variable its group
        reduces densely go into the dense buffers first (`hyparflow.sparse`)."""
        self._agree(held)
        exchanges, trainable = [], self.stage.trainable
        for (comm, positions), kinds in zip(self.buckets.groups, self._kinds):
            mine = [k for k in positions if kinds.get(k) == _sparse.SPARSE]
            if mine:
                exchanges.append(_sparse.Exchange(
                    comm, slices, {k: tuple(trainable[k].shape) for k in mine},
                    # Not summed densely under a norm: Keras's squares are the pairs'.
                    dense_ok=_sparse.linear(self.optimizer) and not (
                        getattr(self.optimizer, "global_clipnorm", None)
                        or getattr(self.optimizer, "clipnorm", None)),
                    fixed=self.stage.grads.fixed or ()))
        for k, (indices, values) in slices.items():
            if not any(kinds.get(k) == _sparse.SPARSE for kinds in self._kinds):
                self.stage.grads.densify(k, indices, values)
        return exchanges

    def _agree(self, held):
        """Which variables each group reduces as pairs: agreed by its ranks (an
        allgather of what each holds) at the first step, and again at later steps
        while some variable has had no gradient anywhere. Gradient kinds are fixed
        by the model's graph, so one agreement per variable is enough."""
        for (comm, positions), kinds in zip(self.buckets.groups, self._kinds):
            if positions and all(kinds.get(k, _sparse.NONE) != _sparse.NONE for k in positions):
                continue  # decided
            mine = "".join(held[k] for k in positions)
            everyone = comm.allgather_obj(mine) if comm is not None and comm.size > 1 else [mine]
            for j, k in enumerate(positions):
                kinds[k] = _sparse.merge([e[j] for e in everyone])

    def _relay_sparse(self, positions):
        """Sparse variables need no dense buffer nor a place in the allreduce buckets
        (re-laid after a step's optimizer step, never within a step)."""
        new = set(positions) - self.buckets.sparse
        if new:
            self.buckets.exclude(new)

    def _wait(self, reqs, timeout):
        where = f"rank {self.comm.rank} (stage {self.s}, replica {self.r})"
        try:
            wait_all(reqs, timeout, f"{self.position} on {where}", self.comm.spin)
        except CommTimeout as exc:
            raise CommTimeout(f"{exc}; schedule position: {self.position}") from None

    def _allreduce_and_apply(self):
        """Sum gradients over every rank holding each variable, then step the optimizer.

        Variables are grouped by the set of stages that use them: usually just
        this stage (an allreduce over its replicas); a weight shared between
        stages is summed over all of them, so every copy takes the same step.
        Each group is cut into buckets (`overlap.Buckets`) whose allreduces
        are all in flight at once, most started during the last backward. One
        flag per variable rides along, so a variable that got no gradient
        anywhere is skipped as Keras skips it."""
        self.position = "ALLREDUCE"
        start = time.perf_counter()
        if not self.buckets.shared:
            self.position = "STEP"
            sparse_now = {k for k, c in enumerate(self.stage.grads.kinds()) if c == "s"}
            self.stage.grads.apply_local(self.optimizer)  # nothing to share: no buffers
            self._relay_sparse(sparse_now)
            self._record("optimizer", "optimizer", start)
            return
        held = self.stage.grads.kinds()
        slices = self.stage.grads.take_slices()
        local = {k: slices.pop(k) for k in self.local if k in slices}
        exchanges = self._sparse_exchanges(slices, held)
        pending = self.buckets.finish()
        self.stage.grads.reset()
        self._wait(pending + exchanges, timeout_seconds())
        self.buckets.settle()
        self._record("allreduce", "allreduce", start, buckets=len(self.buckets.buckets),
                     inside=self.buckets.inside, early=self.buckets.early,
                     dense_bytes=self.buckets.nbytes, sparse_bytes=sum(x.bytes for x in exchanges))
        self.position = "STEP"
        start = time.perf_counter()
        reduced = {k: v for x in exchanges for k, v in x.result().items()}
        reduced.update(local)
        buckets = [bucket for _, bucket in self.buckets.buckets]
        if self.zero is not None:
            self.zero.apply(self.stage.grads.reduced(buckets), reduced)
            self._record("optimizer", "optimizer", start, sharded=True)
            self.position = "ALLGATHER"
            start = time.perf_counter()
            self.zero.gather(lambda reqs: self._wait(reqs, timeout_seconds()))
            self._record("allgather", "allgather", start)
        else:
            self.stage.grads.apply(self.optimizer, buckets, reduced)
            self._record("optimizer", "optimizer", start)
        self._relay_sparse({k for kinds in self._kinds for k, c in kinds.items()
                            if c == _sparse.SPARSE})
        if not self.buckets.learned:
            self.buckets.learn()
            if self.stage.on_arrival is not None:
                # From now on, report only gradients that can start a bucket early.
                self.stage.hooks = tuple(self.buckets.early_positions())

