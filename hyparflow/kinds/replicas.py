"""Replicas that step on their own and meet now and then: LocalSGD and LeaderSGD.

With `replica_sync` other than "allreduce" (`hyparflow.sync`), no gradient crosses
replicas: each replica (a whole pipeline: S stages x T tensor ranks) steps its own
copy of the weights with its own optimizer state, on its slice of every batch. This
module is what the replicas exchange instead, stage by stage: rank (s, r, t) talks
only to the ranks (s, r', t) of the other replicas, which hold the same part of the
model.

- LocalSGD: every `every` steps, every float variable of the stage (weights and
  BatchNorm statistics) becomes its mean over the replicas.
- LeaderSGD: at a pull, the step's training loss of each replica is gathered from
  every rank (an allgather of a few numbers), so all ranks pick the same leader (the
  lowest loss, ties to the lower replica); the leader's ranks broadcast their
  stage's weights and every other replica of the group moves x <- (1 - c) x +
  c x_leader; BatchNorm statistics become their mean over the group.

A replica's local step uses R times its share of the global batch's gradient
(`Executor.grad_scale`): with equal slices that is the mean gradient of its own
slice, and averaging R such steps of plain SGD is exactly the allreduce step.

At an epoch end the trainer installs the replicas' agreed model (`report`: the mean,
or the global leader's weights) for validation, callbacks and the returned model, and
puts each replica's own weights back before the next epoch (`restore`).
"""

import numpy as np

from ..flat import pack, unpack
from ..sync import LeaderSGD, LocalSGD

__all__ = ["Replicas", "replica_groups"]


def replica_groups(method, hosts_of_replicas):
    """The group (0, 1, ...) of each replica: by host (replica r's host is that of its
    first rank), in order of first appearance, or `method.groups` runs of consecutive
    replicas. LocalSGD has one group."""
    count = len(hosts_of_replicas)
    if not isinstance(method, LeaderSGD):
        return [0] * count
    if method.groups is not None:
        size = count // method.groups  # it divides them (`sync.check`)
        return [r // size for r in range(count)]
    order = {}
    for host in hosts_of_replicas:
        order.setdefault(host, len(order))
    return [order[h] for h in hosts_of_replicas]


def _floats(variables):
    """The floating variables (BatchNorm statistics, not seed generators' states)."""
    return [v for v in variables if "float" in str(v.dtype)]


def _by_dtype(variables):
    groups = {}
    for v in variables:
        groups.setdefault(np.dtype(v.numpy().dtype), []).append(v)
    return sorted(groups.items(), key=lambda item: item[0].str)


class Replicas:
    """One rank's side of the replicas' meetings (collective over every rank: each
    method is called by all ranks at the same step)."""

    def __init__(self, method, comm, topo, stage, state, hosts):
        """`stage`: this rank's (its `trainable` are the variables it steps); `state`:
        the non-trainable variables of its layers (BatchNorm statistics, seed
        states); `hosts`: every rank's host name, by rank."""
        self.method, self.comm, self.topo = method, comm, topo
        s, r, t = topo.stage(comm.rank), topo.replica(comm.rank), topo.tensor(comm.rank)
        S, T, R = topo.num_stages, topo.num_tensor, topo.num_replicas
        self.replica, self.num_replicas = r, R
        self.group_of = replica_groups(method, [hosts[topo.rank(0, q, 0)] for q in range(R)])
        self.members = [q for q in range(R) if self.group_of[q] == self.group_of[r]]
        # The same (stage, tensor rank) of every replica, ordered by replica; and of
        # this replica's group. Every rank takes part in every split (MPI's rule).
        self.everyone = comm.split(s * T + t, r)
        several = len(set(self.group_of)) > 1
        group = comm.split((self.group_of[r] * S + s) * T + t, r) if several else None
        self.group = group if several else self.everyone
        self.trainable = list(stage.trainable)
        self.state = list(state)
        self.bn = _floats(self.state)  # averaged at pulls; integer state (seeds) stays
        self.last = (0.0, 0, 1)  # (this rank's loss contribution, replica's samples, batch)
        self.leaders = []  # (step, "local"/"global", group, leader, losses): what was chosen
        self.received = 0  # bytes this rank received in meetings (payload)
        self.final = None  # the replica whose model `report` installed (LeaderSGD)
        self._saved = None

    # -- per step --------------------------------------------------------------
    def after_step(self, step, contribution, samples, batch):
        """After step number `step` (1-based): note this rank's loss contribution (0
        where it does not count), and meet if the method says so."""
        self.last = (float(contribution), int(samples), int(batch))
        method = self.method
        if isinstance(method, LocalSGD):
            if step % method.every == 0:
                self._average(self.everyone, self.trainable + self.bn)
            return
        local = method.local_every is not None and step % method.local_every == 0
        glob = method.global_every is not None and step % method.global_every == 0
        if not (local or glob):
            return
        losses = self.losses()
        if local:
            # Every rank knows every group's leader (it logs them all), and joins its own.
            for g in sorted(set(self.group_of)):
                members = [q for q, h in enumerate(self.group_of) if h == g]
                leader = min(members, key=lambda q: (losses[q], q))
                self.leaders.append((step, "local", g, leader, losses))
                if g == self.group_of[self.replica]:
                    mine = leader
            self._pull(self.group, self.members.index(mine), method.pull)
        if glob:
            leader = min(range(self.num_replicas), key=lambda q: (losses[q], q))
            self.leaders.append((step, "global", None, leader, losses))
            self._pull(self.everyone, leader, method.pull)

    def losses(self):
        """Each replica's training loss at the last step, the same list on every rank
        (collective over all ranks): its ranks' loss contributions summed (the loss is
        on the last stage, regularisers on every stage), over its share of the batch.
        A replica without samples (a short last batch) has an infinite loss."""
        contribution, samples, batch = self.last
        everyone = self.comm.allgather_obj((self.replica, contribution, samples, batch))
        total, count, size = [0.0] * self.num_replicas, [0] * self.num_replicas, 1
        for replica, c, n, b in everyone:
            total[replica] += c
            count[replica], size = n, b
        return [total[q] * size / count[q] if count[q] else float("inf")
                for q in range(self.num_replicas)]

    # -- meetings --------------------------------------------------------------
    def _pull(self, comm, root, pull):
        """Move this rank's weights `pull` of the way to those of `comm`'s rank `root`
        (the leader, which stays); BatchNorm statistics become the group's mean."""
        for dtype, variables in _by_dtype(self.trainable):
            flat = pack([v.numpy() for v in variables], dtype)
            if comm.size > 1:
                comm.bcast(flat, root)
            if comm.rank != root:
                self.received += flat.nbytes
                keep, move = np.asarray(1.0 - pull, dtype), np.asarray(pull, dtype)
                for v, leader in zip(variables, unpack(flat, variables)):
                    v.assign(np.asarray(v.numpy(), dtype) * keep + leader * move)
        self._average(comm, self.bn)

    def _average(self, comm, variables, count=True):
        """Float `variables` become their mean over `comm` (summed in their dtype in
        rank order where the sum is ours, then times 1/size). `count`: add the bytes to
        `received` (training's meetings; not the agreed model shown at epoch ends)."""
        if comm.size == 1:
            return
        for dtype, group in _by_dtype(_floats(variables)):
            flat = pack([v.numpy() for v in group], dtype)
            comm.allreduce(flat)
            flat *= np.asarray(1.0 / comm.size, dtype)
            # A ring allreduce moves 2 (n-1)/n of the payload in and out of each rank.
            if count:
                self.received += int(flat.nbytes * 2 * (comm.size - 1) / comm.size)
            for v, value in zip(group, unpack(flat, group)):
                v.assign(value)

    def _copy(self, comm, root, variables):
        for dtype, group in _by_dtype(variables):
            flat = pack([v.numpy() for v in group], dtype)
            comm.bcast(flat, root)
            if comm.rank != root:
                for v, value in zip(group, unpack(flat, group)):
                    v.assign(value)

    # -- the agreed model --------------------------------------------------------
    def leader(self):
        """The global leader now: the replica with the lowest loss at the last step
        (collective)."""
        losses = self.losses()
        return min(range(self.num_replicas), key=lambda q: (losses[q], q))

    def report(self):
        """Install the replicas' agreed model in this rank's variables (collective),
        keeping its own to `restore`: LocalSGD the mean of every replica's weights and
        statistics, LeaderSGD the global leader's."""
        variables = self.trainable + self.state
        self._saved = [np.array(v.numpy(), copy=True) for v in variables]
        if isinstance(self.method, LocalSGD):
            self._average(self.everyone, self.trainable + self.bn, count=False)
        else:
            self.final = self.leader()
            self._copy(self.everyone, self.final, variables)

    def restore(self):
        """Put back this replica's own weights after `report` (none saved: nothing)."""
        if self._saved is None:
            return
        for v, value in zip(self.trainable + self.state, self._saved):
            v.assign(value)
        self._saved = None

    def checkpoint_source(self, owned):
        """For a checkpoint's agreed model (collective): (the replica whose rank writes
        the stage's main file, the values it writes for the `owned` model variables or
        None for their own). LeaderSGD: the global leader writes its own weights;
        LocalSGD: replica 0 writes the mean over the replicas."""
        if isinstance(self.method, LeaderSGD):
            return self.leader(), None
        values = []
        for dtype, group in _by_dtype(_floats(owned)):
            flat = pack([v.numpy() for v in group], dtype)
            self.everyone.allreduce(flat)
            flat *= np.asarray(1.0 / self.everyone.size, dtype)
            values += list(zip(group, unpack(flat, group)))
        means = {id(v): value for v, value in values}
        return 0, {id(v): means.get(id(v), np.asarray(v.numpy())) for v in owned}

    def summary(self):
        """What `fit` reports in `History.replicas`."""
        return {"method": self.method.describe(), "groups": list(self.group_of),
                "leaders": list(self.leaders), "final": self.final,
                "received_bytes": self.received}

    def free(self):
        for comm in {id(c): c for c in (self.everyone, self.group)}.values():
            try:
                comm.free()
            except Exception:  # noqa: BLE001 - freeing is best effort at the end of a run
                pass
