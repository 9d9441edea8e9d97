"""The search's lower bounds for many configurations at once: each term computed once for all
the configurations that share it, then composed per configuration.

:class:`~stage_cosim.search.bound.StepBound` bounds one configuration at a time, and most of
its work is the same for many of them: a configuration's compiled blocks, its mesh and its
stages' placement depend neither on its pipeline schedule nor on its virtual stages (nine
configurations in the default space share them), and the stages of one pipeline mostly hold
the same blocks with their groups placed alike. :class:`CompiledBound` takes the whole list,
groups the configurations by everything but the schedule and the virtual stages, and works
out per group, once:

* the blocks bound to the group's numbers, the stages' mesh and workload;
* each stage's *placement*: for every communicator kind its blocks use, what the network
  model's cost of a collective over the stage's group of that kind depends on
  (:meth:`~stage_cosim.adapters.roofline.network.CalibratedNetwork.cost_key`: "equal keys,
  equal times, to the bit"), and for every send whether its peer is in the same scale-up
  domain (the only thing a send's time depends on besides its bytes). Stages alike in it take
  every collective and send equally long, so their communication terms (each stream's
  collectives, each pass's longest dependency path) are computed once, where
  :class:`~stage_cosim.search.comm_bound.StreamBound` computes them stage by stage;
* each distinct stage (its chunks' blocks, the micro-batches through each chunk, whether the
  schedule splits or pairs its backward, its placement): the stage's figures (kernels, the
  optimizer, the busiest stream, the passes' paths), by the same methods
  :meth:`StepBound.stages <stage_cosim.search.bound.StepBound.stages>` calls.

A configuration is then its stages looked up and composed by
:meth:`StepBound.compose <stage_cosim.search.bound.StepBound.compose>`, the same composition
(pipeline fill and drain, the busiest stream, the exact replay's every kernel) that
:meth:`~stage_cosim.search.bound.StepBound.step` applies. So each bound is the one
``StepBound`` gives (tests hold it equal to 1e-12 relative on random configurations of several
models), and a lower bound for the reasons :mod:`stage_cosim.search.bound` and
:mod:`stage_cosim.search.comm_bound` give: nothing here changes a term, only how often it is
computed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import fields
from operator import attrgetter
from typing import Any, Iterable

import numpy as np

from stage_cosim.gc_pause import gc_paused
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.parallel.axes import DENSE, MESHES
from stage_cosim.parallel.mesh import DeviceMesh
from stage_cosim.schedule.nodes import COLL, SEND, BlockInstance
from stage_cosim.schedule.pipeline import Layout
from stage_cosim.search.bound import CACHE_LIMIT, SLACK, StepBound, _Pass, _Stage

# What a configuration's group leaves out: all it shares with the rest of its group is every
# other field of its ParallelConfig.
VARYING = ("schedule", "vp")
# (read with one call: the key is taken for every configuration)
_SHARED = attrgetter(*(f.name for f in fields(ParallelConfig) if f.name not in VARYING))

# The groups kept at once, the least recently used dropped first (each holds its blocks, its
# stages' figures and its groups' members: some 150 kB; every one kept, a Mixture-of-Experts
# space's 37,000 groups held gigabytes). A search bounds each group's configurations together
# (:meth:`CompiledBound.order`), so a dropped group is not asked for again.
GROUPS_KEPT = 64


class _Group:
    """What the configurations alike in everything but :data:`VARYING` share."""

    def __init__(self, bound: StepBound, par: ParallelConfig) -> None:
        self.blocks, self.precision = bound.blocks(par)
        degrees = par.degrees()
        mesh = DeviceMesh.build({a: degrees[a] for a in MESHES[DENSE]}, par.mesh_orders()[DENSE], par.mesh_splits())
        self.degrees = degrees | dict(mesh.size)        # what the role graphs resolve groups with
        self.par = par                                   # one of the group (its shared fields)
        # the model's layers as runs of one kind, as StepBound.stages takes them
        self.reps: dict[tuple, BlockInstance] = {}
        self.layer_runs: list[list] = []
        for i, (compiled, costs) in enumerate(self.blocks.layers):
            k = ("layer", id(compiled), id(costs))
            if self.layer_runs and self.layer_runs[-1][2] == k:
                self.layer_runs[-1][1] = i + 1
            else:
                self.layer_runs.append([i, i + 1, k])
                self.reps.setdefault(k, BlockInstance("layer", i, compiled, costs))
        self.edge = {}
        for kind, b in (("embedding", self.blocks.embedding), ("head", self.blocks.head)):
            k = (kind, id(b[0]), id(b[1]))
            self.edge[kind] = k
            self.reps[k] = BlockInstance(kind, -1, *b)
        self._workload: Any = None
        self.passes: dict[tuple, _Pass] = {}         # (chunk, phase, first) -> its kernels
        self.kernels: dict[tuple, _Stage] = {}       # (chunks, micro-batches each) -> the stage's kernels
        # (chunks, micro-batches each) -> (StreamBound's chunks, its communicator kinds, its sends)
        self.chunks: dict[tuple, tuple] = {}
        self.placed: dict[tuple, tuple] = {}         # (stage, kinds, sends) -> where (StreamBound's)
        self.figures: dict[tuple, _Stage] = {}       # a stage's full key -> its figures
        self.comm: dict[tuple, float] = {}           # (chunks, micro-batches each, placement) -> its busiest stream
        self.ranks: dict[int, tuple] = {}            # stage -> (its first rank, its groups, their cost keys)

    def workload(self, model: ModelConfig) -> Any:
        if self._workload is None:
            from stage_cosim.search.memory import workload_from_blocks

            self._workload = workload_from_blocks(model, self.par, self.blocks, self.precision)
        return self._workload


class CompiledBound:
    """Lower bounds on the step time of many configurations of one model on one cluster
    (:meth:`steps`, :meth:`__call__`): each the one :class:`~stage_cosim.search.bound.StepBound`
    gives. Its :attr:`bound` holds the blocks (what the memory check reads)."""

    def __init__(self, model: ModelConfig, cluster: Cluster, network_model: str | None = "calibrated",
                 bound: StepBound | None = None, software: str | None = None) -> None:
        self.model, self.cluster = model, cluster
        # (a StepBound of the same model, cluster, network model and software may be given: its
        # caches are shared)
        self.bound = bound or StepBound(model, cluster, network_model, software)
        self.streams = self.bound.streams
        self._groups: OrderedDict[tuple, _Group] = OrderedDict()      # the latest GROUPS_KEPT
        self._comm_of: dict[tuple, tuple[frozenset, frozenset]] = {}   # a block's rows -> its kinds, sends

    @staticmethod
    def group_key(par: ParallelConfig) -> tuple:
        """Every field of ``par`` but :data:`VARYING`."""
        return _SHARED(par)

    @classmethod
    def order(cls, configs: Iterable[ParallelConfig]) -> list[int]:
        """The positions of ``configs`` in the order that bounds them with the least work and
        memory: each group's configurations together (a group is bound once, then dropped),
        and the groups that share most (the same sharding policy, micro-batch and model-parallel
        degrees, apart in the pipeline or the data-parallel degree) one after the other. The
        bounds are the same in any order; only how much is computed again changes."""
        groups: dict[tuple, list[int]] = {}
        first: dict[tuple, ParallelConfig] = {}
        for j, par in enumerate(configs):
            key = cls.group_key(par)
            groups.setdefault(key, []).append(j)
            first.setdefault(key, par)

        def alike(key: tuple) -> tuple:
            p = first[key]
            return (p.dtype, p.sp, p.zero, p.recompute, p.cp, p.cp_comm, p.cp_a2a_size or 0, p.micro_batch, p.tp,
                    p.expert_tp, p.ep, p.pp, p.dp)

        return [j for key in sorted(groups, key=alike) for j in groups[key]]

    def _group(self, par: ParallelConfig) -> _Group:
        key = self.group_key(par)
        g = self._groups.get(key)
        if g is None:
            # (a new group: the caches its blocks will fill are emptied past their limits first)
            self.bound.trim()
            if len(self._comm_of) > CACHE_LIMIT:
                self._comm_of.clear()
            g = self._groups[key] = _Group(self.bound, par)
            if len(self._groups) > GROUPS_KEPT:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        return g

    # -- one stage ---------------------------------------------------------------------------

    def _one(self, g: _Group, runs: tuple, phase: str, first: bool) -> _Pass:
        key = (runs, phase, first)
        t = g.passes.get(key)
        if t is None:
            t = g.passes[key] = self.bound._pass(runs, g.reps, phase, first, g.degrees, g.par.tp_comm_overlap)
        return t

    def _kernels(self, g: _Group, comps: tuple, per_chunk: tuple, stage: int) -> _Stage:
        """The stage's kernels, as :meth:`StepBound.stages` adds them up."""
        key = (comps, per_chunk)
        st = g.kernels.get(key)
        if st is not None:
            return st
        st = g.kernels[key] = self.bound.stage_kernels(
            comps, per_chunk, lambda runs, phase, first: self._one(g, runs, phase, first), g.reps, g.degrees, g.par,
            stage)
        return st

    def _comm(self, g: _Group, chunks: list[tuple[tuple, int, bool]]) -> tuple[frozenset, frozenset]:
        """The communicator kinds and the sends ((peer offset, kind)) of the rows a stage of
        ``chunks`` puts on the network: those :meth:`StreamBound.signature` times."""
        kinds: set = set()
        sends: set = set()
        overlap = g.par.tp_comm_overlap
        for runs, _, casts in chunks:
            for k, _ in runs:
                for phase, first in (("fwd", False), ("bwd", False)) + ((("fwd", True),) if casts else ()):
                    key, rows = self.streams._read(g.reps[k], phase, first, g.degrees, overlap)
                    hit = self._comm_of.get(key)
                    if hit is None:
                        rk = frozenset(rows.rows[j][9] for j in rows.comm if rows.rows[j][1] == COLL)
                        rs = frozenset((rows.rows[j][14], rows.rows[j][9]) for j in rows.comm
                                       if rows.rows[j][1] == SEND)
                        hit = self._comm_of[key] = (rk, rs)
                    kinds |= hit[0]
                    sends |= hit[1]
        return frozenset(kinds), frozenset(sends)

    def _where(self, g: _Group, stage: int, kinds: frozenset, sends: frozenset) -> tuple:
        """StreamBound's ``where`` for ``stage``, keyed by its placement (see the module's
        docstring) instead of its position: stages alike in it share every timing."""
        key = (stage, kinds, sends)
        hit = g.placed.get(key)
        if hit is None:
            w = g.workload(self.model)
            rank, members, costs = g.ranks.get(stage) or g.ranks.setdefault(stage, (w.mesh.rank(pp=stage), {}, {}))
            net = self.streams.network
            # (a network without the cost key: the members themselves, shared by no other stage)
            cost_key = getattr(net, "cost_key", tuple)
            for kind in kinds:
                if kind not in members:
                    members[kind] = tuple(w.group_members(rank, kind))
                    costs[kind] = cost_key(members[kind])
            placement = (tuple((kind, costs[kind]) for kind in sorted(kinds))
                         + tuple((off, kind, rank // net.domain == w.peer(rank, off, kind) // net.domain)
                                 for off, kind in sorted(sends)))
            hit = g.placed[key] = (("placed", placement), w, rank, members)
        return hit

    def _stage(self, g: _Group, par: ParallelConfig, comps: tuple, per_chunk: tuple, stage: int) -> _Stage:
        """The stage's figures, :class:`_Stage`, as :meth:`StepBound.stages` gives them."""
        st = self._kernels(g, comps, per_chunk, stage)
        if not self.streams.active:
            return st._replace(paths=st.rooted)
        bound, reps = self.bound, g.reps
        hit = g.chunks.get((comps, per_chunk))
        if hit is None:
            chunks = [(runs, per_chunk[c], any(bound._casts(reps[k].compiled) for k, _ in runs))
                      for c, runs in enumerate(comps)]
            hit = g.chunks[(comps, per_chunk)] = (chunks, *self._comm(g, chunks))
        chunks = hit[0]
        where = self._where(g, stage, hit[1], hit[2])
        # the schedule enters the paths only through whether it pairs or splits the backward,
        # the streams not at all
        key = (comps, per_chunk, par.schedule in ("dualpipe", "dualpipev"), par.schedule in ("zb-h1", "zb-v"),
               where[0])
        hit = g.figures.get(key)
        if hit is None:
            paths, chain = bound._paths(par, where, chunks, reps, g.degrees,
                                        lambda runs, phase, first: self._one(g, runs, phase, first))
            ckey = (comps, per_chunk, where[0])
            comm = g.comm.get(ckey)
            if comm is None:
                comm = g.comm[ckey] = self.streams.stage_seconds(par, where, chunks, reps, g.degrees)
            hit = g.figures[key] = st._replace(comm=comm, paths=paths, chain=chain)
        return hit

    # -- configurations ----------------------------------------------------------------------

    def stages(self, par: ParallelConfig) -> list[_Stage]:
        """Each pipeline stage's figures (:meth:`StepBound.stages`)."""
        g = self._group(par)
        pp, vp = par.pp, par.vp
        per_vstage = par.layers_per_stage(self.model.layers)
        layout = Layout(par.schedule, pp, vp)
        nv = layout.nv
        per_chunk = (par.num_microbatches // layout.lines,) * layout.chunks
        starts = [0] * nv
        for i in range(1, nv):
            starts[i] = starts[i - 1] + per_vstage[i - 1]
        embedding, head, layer_runs = g.edge["embedding"], g.edge["head"], g.layer_runs

        def chunk(vs: int) -> tuple:
            start = starts[vs]
            end = start + per_vstage[vs]
            runs = [(embedding, 1)] if vs == 0 else []
            runs += [(k, min(end, hi) - max(start, lo)) for lo, hi, k in layer_runs if lo < end and hi > start]
            if vs == nv - 1:
                runs.append((head, 1))
            return tuple(runs)

        return [self._stage(g, par, tuple(chunk(layout.place(s, c)[1]) for c in range(layout.chunks)), per_chunk, s)
                for s in range(pp)]

    def steps(self, configs: Iterable[ParallelConfig]) -> np.ndarray:
        """The largest of the lower bounds the stages give (:meth:`StepBound.step`), seconds,
        one per configuration."""
        configs = list(configs)
        out = np.empty(len(configs), dtype=float)
        # (millions of small acyclic objects, most of them kept in the caches: the cycle
        # collector only costs time here, some 15 % of it)
        with gc_paused():
            for j in self.order(configs):       # (each group's together: see GROUPS_KEPT)
                par = configs[j]
                out[j] = self.bound.compose(par, self.stages(par))
        return out

    def __call__(self, configs: Iterable[ParallelConfig]) -> np.ndarray:
        """Lower bounds on the configurations' simulated step times, seconds (:meth:`steps`,
        lowered by :data:`~stage_cosim.search.bound.SLACK` as ``StepBound`` lowers its)."""
        return self.steps(configs) * (1 - SLACK)


def bound_many(model: ModelConfig, cluster: Cluster, configs: list[ParallelConfig],
               network_model: str | None = "calibrated") -> list[float]:
    """Lower bounds of many configurations (a runner job: one per worker's share)."""
    return CompiledBound(model, cluster, network_model)(configs).tolist()
