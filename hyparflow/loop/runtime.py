"""One rank's set-up for a run: partition, stage, executor, communicators, ZeRO and
tensor parts (`Runtime`). What comes before it (arguments checked, errors agreed,
the model read as a layer graph, the model and optimizer checked, the compiled loss
built) is `prepare`'s."""



from .. import _compat
from ..engine import clipping as _clipping
from ..engine import coupling as _coupling
from ..engine import customised as _customised
from .. import plan as _plan
from .. import strategy as _strategy
from ..cluster import heartbeat as _heartbeat
from ..engine import normaliser as _normaliser
from ..engine import overlap
from ..engine import partition as _partition
from ..engine import prepare as _prepare
from ..kinds import mesh as _mesh
from ..kinds import tables as _tables
from ..kinds.tables.idle import Idle
from ..kinds import tensor as _tensor
from ..engine import weights
from ..engine import wire as _wire
from ..kinds import zero as _zero
from ..engine.comm import timeout_seconds
from ..engine.checkpoint import slot_names
from ..engine.executor import Executor, split_batch
from ..engine.groups import make_groups
from ..kinds.replicas import Replicas
from ..engine.stage import Stage
from ..engine.timeline import Timeline
from ..topology import Topology

__all__ = ["Runtime"]


class Runtime:
    """Everything one rank needs to run stage s of replica r of `model`."""

    def __init__(self, model, comm, layout, *, graph, sample, cut=None, run_eagerly=None,
                 recompute=False, trace=None, training=True, facts=None, batch_rows=None,
                 replica_sync=None, embedding_sharding=None, memory_limit=None,
                 communication_dtype=None, hosts=None):
        """`layout`: the run's, resolved for this world (hyparflow.layout); `cut`: how
        to cut the layer calls (counts, or costs from hyparflow.costs), by default
        `layout.balance`; `replica_sync`: None (allreduce) or a `hyparflow.sync`
        method, under which each replica steps on its own (`hyparflow.replicas`);
        `embedding_sharding`: the Embedding tables sharded over the replicas of their
        stage (`kinds.tables`), placed within `memory_limit` bytes per rank, their rows and
        gradients exchanged in `communication_dtype` (None: float32); `hosts[r]`: rank
        r's host, where "table-row" tables go (gathered collectively by the caller)."""
        _prepare.check_model(model, sample)
        if layout.ranks != comm.size:
            raise ValueError(f"The layout {layout.describe()} needs {layout.ranks} ranks, but "
                             f"{comm.size} were launched.")
        if training:
            _prepare.check_optimizer(model.optimizer, layout.num_stages, layout.num_tensor,
                                     layout.num_replicas)
        self.model, self.comm, self.layout = model, comm, layout
        self.graph = graph
        # Replicas on their own only where there are several (one replica: allreduce).
        self.sync = replica_sync if training and layout.num_replicas > 1 else None
        self.replicas = None
        # Interleaved schedules: S x v virtual stages, virtual stage j on position j % S.
        self.part = part = _partition.partition(
            graph, layout.num_stages * layout.num_chunks, layout.balance if cut is None else cut)
        self.topo = topo = Topology(layout.num_stages, layout.num_replicas, layout.num_tensor)
        self.training = training
        # The dtype of each exchange path (engine.wire): one name applies to the paths
        # the run has; a dict naming "tables" needs sharded tables.
        self.wires = _wire.resolve(communication_dtype)
        named = isinstance(communication_dtype, dict) and "tables" in communication_dtype
        tables_dtype = self.wires["tables"] if embedding_sharding is not None or named \
            else None
        self.tables = _tables.Tables.make(model, graph, layout,
                                          _plan.local_keys(embedding_sharding, layout.plan,
                                                           graph),
                                          comm.rank, memory_limit=memory_limit,
                                          sync=self.sync, training=training,
                                          communication_dtype=tables_dtype,
                                          hosts=hosts, sample=sample,
                                          batch_size=(facts or {}).get("batch_size"),
                                          stage_of={
                                              i: j % topo.num_stages
                                              for j, p in enumerate(part.stages)
                                              for i in p.nodes})
        self.splits, split_calls = self._choose_splits()
        self.facts = dict(facts or {}, **{
            "x_shapes": [a.shape[1:] for a in sample.x],
            "weights": [tuple(v.shape) for v in model.weights], "layout": layout,
            "counts": part.counts, "tensor_layers": _prepare.identities(graph, split_calls),
            "embedding_sharding": embedding_sharding,
            "communication_dtype": communication_dtype,
        })
        _prepare.build_compiled(model, graph, sample, batch_rows)
        # A compute_loss override or layers adding losses of their own: checked on
        # this process's model (every rank alike) that they add up over microbatches.
        self.custom = _customised.probe(model, graph, sample) if sample.y is not None \
            else _customised.Custom()
        _coupling.check(model, graph, sample, layout, comm.rank)
        y_specs = _prepare.target_specs(graph, sample)
        if self.custom.loss is not None:
            y_specs = y_specs + _prepare.input_specs(graph, sample)
        s = topo.stage(comm.rank)
        eager = bool(getattr(model, "run_eagerly", False)) if run_eagerly is None else run_eagerly
        shards = self._shards(layout.tensor_shares)
        if self.tables is not None:
            shards.update(self.tables.shards)
        chunks = None
        if layout.num_chunks == 1:
            stage = Stage(graph, part.stages[s], model, part,
                          is_last=(s == layout.num_stages - 1), run_eagerly=eager,
                          y_specs=y_specs,
                          sw_specs=_prepare.weight_specs(sample),
                          per_output=sample.per_output,
                          recompute=recompute or _strategy.recomputes(layout.plan, s),
                          shards=shards)
        else:
            # One Stage per model chunk (virtual stages s, s + S, ...), and one that
            # computes nothing but holds the rank's gradient sums for all of them:
            # one allreduce and one optimizer step per rank, as with one stage.
            last = part.num_stages - 1
            virtual = range(s, part.num_stages, layout.num_stages)
            chunks = [Stage(graph, part.stages[j], model, part, is_last=(j == last),
                            run_eagerly=eager, y_specs=y_specs,
                            sw_specs=_prepare.weight_specs(sample),
                            per_output=sample.per_output,
                            recompute=recompute or _strategy.recomputes(layout.plan, j))
                      for j in virtual]
            union = _partition.StageCut(s, [i for j in virtual for i in part.stages[j].nodes],
                                         [], [], [])
            stage = Stage(graph, union, model, part, is_last=False, run_eagerly=eager,
                          recompute=recompute, accumulator=True)
            for chunk in chunks:
                chunk.sink_into(stage)
        self.stage = stage
        if self.tables is not None:
            self.tables.bind(stage)
        kinds, normaliser = self._plan_loss(sample)
        for st in (chunks or []) + [stage]:
            st.loss_kinds = kinds
            st.custom = self.custom
        self.timeline = Timeline(comm.rank) if trace else None
        self.trace = trace
        self.executor = Executor(comm, topo, part, graph, stage, getattr(model, "optimizer", None),
                                 schedule=layout.schedule,
                                 num_microbatches=layout.num_microbatches,
                                 timeline=self.timeline, chunks=chunks)
        self.executor.normaliser = normaliser
        if self.tables is not None:
            self.executor.idle = Idle(self.tables, stage, layout.num_replicas,
                                      layout.num_microbatches,
                                      served=layout.num_stages == 1 and layout.num_tensor == 1)
        for box in self.executor.boxes:
            box.set_wire(_wire.numpy_dtype(self.wires["stages"]))
        self.executor.lowered(layout.num_microbatches, training)  # validate the schedule up front
        self.stage_comm = None
        self.owners = [topo.rank(self.owner_stage(v), 0, 0) for v in model.weights]
        self.non_trainable = [v for v in graph.variables_of(stage.cut.nodes, trainable=False)
                              if self.owner_stage(v) == s]

    def _plan_loss(self, sample):
        """The compiled loss's kinds (`_compat.loss_kinds`) and, when some loss divides
        by a count over the whole batch, a `Normaliser` (the same on every rank: it
        sets every stage's order)."""
        loss = _compat.compile_loss(self.model)
        if sample.y is None or loss is None or not loss.built:
            return [], None
        graph = self.graph
        masked = [graph.tensors[t].mask is not None for t in graph.outputs] \
            if graph.functional is not None else [False]
        kinds = _compat.loss_kinds(loss, masked, sample.sample_weight is not None)
        if self.custom.loss is not None:
            if _compat.GLOBAL in kinds:
                name = _compat.overrider(self.model, "compute_loss").__qualname__
                raise NotImplementedError(
                    f"{name}.compute_loss is run per microbatch, but the compiled loss it may "
                    "call divides by a count over the whole batch (a Keras mask reaches the "
                    "model's outputs, or a mean_with_sample_weight reduction), which a "
                    "microbatch cannot know. Leave compute_loss to Keras (hyparflow carries "
                    "the compiled loss's normaliser over microbatches and replicas), or train "
                    "with num_microbatches=1 and num_replicas=1.")
            return kinds, None
        weights = [w for w, kind in zip(_compat.loss_weights(loss), kinds)
                   if kind == _compat.GLOBAL]
        return kinds, (_normaliser.Normaliser(weights) if weights else None)

    def owner_stage(self, variable):
        """The pipeline position (stage of ranks) whose replica 0 owns `variable`: the
        first (virtual) stage using it, on position j % S."""
        return self.part.owner.get(id(variable), 0) % self.topo.num_stages

    def _choose_splits(self):
        """{node index: split} of this rank's stage, and the indices of every split call."""
        graph, layout, part, model = self.graph, self.layout, self.part, self.model
        num_tensor, tensor_layers = layout.num_tensor, layout.tensor_layers
        # A plan file's names are its writer's: this graph's calls at their positions.
        local = _plan.local_names(layout.plan, graph)
        if tensor_layers is not None:
            tensor_layers = [local.get(n, n) for n in tensor_layers]
        if num_tensor == 1:
            return {}, []
        if graph.functional is None:
            raise ValueError(
                f"num_tensor={num_tensor} needs a Functional or Sequential model, whose "
                f"layers hyparflow can split; {model.name!r} is subclassed. Use num_tensor=1.")
        if tensor_layers is not None:
            missing = sorted(set(tensor_layers) - {n.op.name for n in graph.nodes})
            if missing:
                raise ValueError(f"tensor_layers names layers the model does not have: "
                                 f"{missing}. Layer names: {[n.op.name for n in graph.nodes]}")
        kinds = self._kinds
        # A sharded table's Embedding is looked up from its owners, not split.
        tables = self.tables.nodes if self.tables is not None else set()
        named = sorted(graph.nodes[i].op.name for i in tables
                       if graph.nodes[i].op.name in (tensor_layers or ()))
        if named:
            raise ValueError(
                f"tensor_layers names {named}, whose tables embedding_sharding shards over "
                "the ranks of their stage. Leave them out of tensor_layers, or make them "
                "'data' in embedding_sharding.")
        every = {i: sp for p in part.stages
                 for i, sp in kinds.choose(graph, p.nodes, num_tensor, tensor_layers).items()
                 if i not in tables}
        if not every:
            raise ValueError(
                f"num_tensor={num_tensor}, but no layer of {model.name!r} is split: none of "
                f"its {kinds.describe('or')} with at least {kinds.MIN_PARAMS} weights "
                "can be. Name the layers to split with tensor_layers=[...], or use "
                "num_tensor=1.")
        # A strategy file's named kinds must be the ones the engine splits by.
        theirs = {name: plan_name for plan_name, name in local.items()}
        _strategy.check_kinds(layout.plan, {theirs.get(graph.nodes[i].name, graph.nodes[i].name):
                                            sp.kind for i, sp in every.items()})
        mine = set(part.stages[self.topo.stage(self.comm.rank)].nodes)
        return {i: sp for i, sp in every.items() if i in mine}, sorted(every)

    @property
    def _kinds(self):
        """The split kinds of this layout: the 1D ones (`kinds.tensor`) or, with
        `tensor_mesh`, the mesh's (`kinds.mesh`); both give choose, shard, describe."""
        return _mesh if self.layout.tensor_mesh else _tensor

    def _shards(self, shares):
        """This rank's parts of the split layers of its stage (none without num_tensor)."""
        mesh = self.layout.tensor_mesh
        self.collectives = _mesh.Mesh(mesh[0]) if mesh else _tensor.Collectives()
        t, num = self.topo.tensor(self.comm.rank), self.topo.num_tensor
        shares = _tensor.shares_of(shares if not mesh else None, num)
        return {i: self._kinds.shard(self.graph.nodes[i].op, sp, t, shares, self.collectives)
                for i, sp in self.splits.items()}

    def connect(self):
        """The collective part of set-up, once every rank's local set-up succeeded:
        check that all ranks agree, make the gradient communicators, start every
        replica from rank 0's weights. Disagreement raises the same error everywhere."""
        _prepare.check_agreement(self.comm, self.facts)
        topo, rank = self.topo, self.comm.rank
        hosts = self.comm.allgather_obj(self.comm.host())
        self.hosts = hosts
        self.layout = self.layout.with_hosts(hosts)
        # From here to close(), a peer that falls silent ends this rank (docs/slurm.md).
        self.heartbeat = _heartbeat.start(self.comm, hosts,
                                          describe=lambda: self.executor.position)
        if topo.num_tensor > 1:
            # The T ranks of this stage and replica, which sum and gather inside split layers.
            self.collectives.comm = self.comm.split(
                topo.replica(rank) * topo.num_stages + topo.stage(rank), topo.tensor(rank))
        if self.tables is not None:
            # The ranks that share a stage's tables (its replicas), on a communicator
            # of their own, so their lookups never pair with other messages.
            self.tables.connect(self.comm.split(self.tables.color(), rank))
        if self.training:
            optimizer = self.model.optimizer
            local = self.sync is not None
            groups = make_groups(self.comm, self.topo, self.part, self.stage, self.model.weights,
                                  per_replica=local)
            if self.tables is not None:
                # A sharded table's pairs stay with its owner: no sum over replicas.
                mine = set(self.tables.positions)
                groups = {key: (sub, [k for k in positions if k not in mine])
                          for key, (sub, positions) in groups.items()}
            shared = [g for g in groups.values() if g[1]]
            # Not sharded with model chunks (a first version: ZeRO's shards and the
            # chunks' accumulator are not combined yet; docs/performance.md), nor when
            # each replica steps on its own (nothing is summed over replicas).
            # Nor with a 16-bit wire for the replicas' sums (ZeRO sums each row range
            # on its owner in float32; engine.wire sums whole buckets).
            wire = _wire.numpy_dtype(self.wires["replicas"])
            self.zero = (self._plan_zero(optimizer, shared)
                         if self.layout.num_chunks == 1 and not local and self.tables is None
                         and wire is None else None)
            if not optimizer.built:
                # Only this stage's variables (or, sharded, this rank's parts of them):
                # optimizer state is split like the weights.
                optimizer.build(self.zero.variables if self.zero else self.stage.trainable)
            elif self.stage.shards or not self.zero:
                _zero.check_knows(optimizer, self.zero.variables if self.zero
                                  else self.stage.trainable)
            # Not early with replicas on their own: their gradients are scaled (below)
            # before any sum, and only tied copies within a replica are summed.
            early = (overlap.enabled(default=len(set(hosts)) > 1)
                     and self.layout.num_chunks == 1 and not local)
            self.executor.set_groups(shared, early=early, zero=self.zero, wire=wire)
            if _clipping.needed(optimizer, topo.num_stages, topo.num_tensor,
                                self.tables is not None):
                # global_clipnorm: one norm over the ranks' parts (engine.clipping);
                # ZeRO steps whole variables then (`zero.why_not`).
                counted, mine = _clipping.counted_positions(
                    self.stage, topo, rank, self.owner_stage,
                    self.tables.positions if self.tables is not None else ())
                self.clip_comm = self.comm.split(0, rank)
                self.stage.grads.clip = _clipping.Clip(
                    optimizer.global_clipnorm, self.clip_comm, counted, mine,
                    topo.replica(rank), topo.num_replicas, own=local)
            if self.tables is not None:
                self.executor.keep_local(self.tables.positions)
            self.stage_comm = groups.get((self.topo.stage(self.comm.rank),), (None, []))[0]
            if local:
                state = self.graph.variables_of(self.stage.cut.nodes, trainable=False)
                self.replicas = Replicas(self.sync, self.comm, topo, self.stage, state, hosts)
                # Each replica steps on R times its share of the batch's gradient: its
                # own slice's mean gradient when the slices are equal (hyparflow.replicas).
                self.executor.grad_scale = float(topo.num_replicas)
        norm = self.executor.normaliser
        if norm is not None and topo.size > 1:
            # The last stage's replicas at each tensor rank agree on its normalisers.
            last = topo.stage(rank) == topo.num_stages - 1
            norm.comm = self.comm.split(topo.tensor(rank) if last else None, rank)
        weights.broadcast(self.comm, self.model.weights, 0)
        self.load_shards()

    def _plan_zero(self, optimizer, groups):
        """This rank's `zero.Zero` when the optimizer step is sharded over replicas
        (every rank must be able to, and some stage must gain), else None. A group
        spans stages when they tie weights, so all ranks decide alike."""
        from .. import _env

        setting = _zero.enabled()
        allowed = setting is not False and _zero.why_not(optimizer, self.stage.trainable) is None
        if allowed and optimizer.built and not optimizer.__dict__.get("_hyparflow_zero"):
            allowed = False  # built for whole variables (say by model.fit): keep them whole
        wants = allowed and (setting is True or _zero.pays(self.stage, optimizer,
                                                           _env.local_ranks()))
        everyone = self.comm.allgather_obj((allowed, wants))
        if not all(a for a, _ in everyone) or not any(w for _, w in everyone):
            return None
        zero = _zero.Zero(self.stage, groups, optimizer, eager=self.stage.grads.eager)
        # An optimizer an earlier fit built for whole variables keeps stepping them.
        known = not optimizer.built or _zero.knows(optimizer, zero.variables)
        if not all(self.comm.allgather_obj(known)):
            return None
        return zero if zero else None

    def close(self):
        """Free the sub-communicators connect() made (MPI has a limited number of them,
        and a script may call fit many times), after stopping the heartbeat."""
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.replicas is not None:
            self.replicas.free()
        comms = [c for c, _ in getattr(self.executor, "groups", ())]
        comms.append(getattr(getattr(self, "collectives", None), "comm", None))
        if self.tables is not None:
            comms.append(self.tables.router.comm)
        comms.append(getattr(self, "clip_comm", None))
        self.clip_comm = None
        norm = getattr(self.executor, "normaliser", None)
        if norm is not None:
            comms.append(norm.comm)
            norm.comm = None
        for comm in {id(c): c for c in comms if c is not None}.values():
            try:
                comm.free()
            except Exception:  # noqa: BLE001 - freeing is best effort at the end of a run
                pass
        self.executor.set_groups([])
        self.stage_comm = None
        if getattr(self, "collectives", None) is not None:
            self.collectives.comm = None
        if self.tables is not None:
            self.tables.connect(None)

    def exchanges(self):
        """What this rank's reduced-precision paths did (`History.exchanges`): per path,
        its dtype, the bytes of floating values this rank sent, and for float16 the
        loss scales now and the steps summed again in float32."""
        out = {"tables": {"dtype": self.wires["tables"],
                          "bytes": self.tables.router.payload if self.tables else 0}}
        buckets = self.executor.buckets
        scales = [s for s, (comm, _) in zip(buckets.scales or [], buckets.groups)
                  if comm is not None and comm.size > 1]
        # ZeRO's sums go to the owners and its new rows back (kinds/zero).
        sent = buckets.sent + (self.executor.zero.sent if self.executor.zero else 0)
        out["replicas"] = {"dtype": self.wires["replicas"], "bytes": sent,
                           "scales": [s.value for s in scales],
                           "redone": sum(s.overflows for s in scales)}
        boxes = self.executor.boxes
        edges = [s for box in boxes for s in box.scales.values()]
        out["stages"] = {"dtype": self.wires["stages"], "bytes": sum(b.sent for b in boxes),
                         "scales": [s.value for s in edges],
                         # with the last step's, which the next step's start counts
                         "redone": sum(s.overflows for s in edges)
                         + sum(len(box.overflowed) for box in boxes)}
        return out

    @property
    def counted(self):
        """Whether this rank's loss, metrics and predictions count (tensor rank 0;
        the others compute the same)."""
        return self.topo.tensor(self.comm.rank) == 0

    @property
    def replica(self):
        return self.topo.replica(self.comm.rank)

    def microbatches(self, indices):
        """This rank's microbatches of a global batch (index arrays)."""
        return split_batch(indices, self.topo.num_replicas,
                           self.layout.num_microbatches)[self.replica]

    def average_state(self):
        """Average this stage's state (e.g. BatchNorm statistics) over its replicas."""
        weights.average(self.stage_comm, self.non_trainable)

    def _part_slots(self):
        """(shard, optimizer variable, axis) for the optimizer state of this rank's
        parts of split layers."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return []
        return [(shard, slot, axis) for shard in self.stage.shards.values()
                for slot, axis in shard.slots(optimizer)]

    def full_slots(self):
        """{id(optimizer variable): its whole value} for the optimizer state of this
        rank's parts of split layers (collective over the tensor ranks), and {id(model
        variable): its whole value} for the sharded tables whose whole copy is dropped
        while fit trains (collective over the replicas)."""
        out = {id(slot): shard.gathered(slot.numpy(), axis)
               for shard, slot, axis in self._part_slots()}
        if self.tables is not None:
            out.update(self.tables.whole_weights())
        return out

    def slot_slicer(self):
        """For restoring: optimizer variable -> function giving its part of a whole value."""
        out = {id(slot): (lambda value, shard=shard, axis=axis: shard.sliced(value, axis))
               for shard, slot, axis in self._part_slots()}
        if getattr(self, "zero", None):
            out.update(self.zero.slicers(slot_names(self.model.optimizer, self.model)))
        return out

    def zero_slots(self):
        """{checkpoint key: whole value} of the optimizer state sharded over replicas
        (collective over the replicas; empty without sharding)."""
        if not getattr(self, "zero", None):
            return {}
        return self.zero.whole_slots(slot_names(self.model.optimizer, self.model))

    def load_shards(self):
        for shard in self.stage.shards.values():
            shard.load()
        if getattr(self, "zero", None):
            self.zero.load()

    def gather_shards(self):
        """The split layers' variables put back together on their stage's ranks."""
        for shard in self.stage.shards.values():
            shard.gather()

    def finalize_optimizer(self):
        """What `model.fit` does after its last epoch, `optimizer.finalize_variable_values`:
        with `use_ema`, the variables take their moving averages. Each rank's optimizer
        keeps the averages of what it steps (its stage's variables, its parts of split
        layers and tables, its ZeRO rows), so each overwrites those, and the parts go
        back into the model's variables as at an epoch's end (collective)."""
        optimizer = getattr(self.model, "optimizer", None)
        if not getattr(optimizer, "use_ema", False) or not optimizer.built:
            return
        optimizer.finalize_variable_values(optimizer._trainable_variables)
        if getattr(self, "zero", None):
            # Each owner's rows to every replica of its group, into the variables.
            self.zero.gather(lambda reqs: self.executor._wait(reqs, timeout_seconds()))
        self.sync_weights(state=False)

    def sync_weights(self, state=True):
        """Average the state (`state`), then give every rank every variable from the
        stage that owns it (replica 0, tensor rank 0)."""
        self.gather_shards()
        if state:
            self.average_state()
        # Sharded tables whose whole copy is dropped while fit trains stay so.
        dropped = self.tables.emptied() if self.tables is not None else set()
        kept = [(v, o) for v, o in zip(self.model.weights, self.owners) if id(v) not in dropped]
        weights.gather(self.comm, [v for v, _ in kept], [o for _, o in kept])
