"""A lower bound on a configuration's simulated step time, from its compiled blocks alone.

Why it holds, from the simulator's rules:

* Every kernel of a rank runs on the rank's one compute stream: the event-driven engine
  (:mod:`stage_cosim.adapters.roofline.engine`) issues a node on a stream only while the stream
  is free, and every compute node needs the stream ``"compute"``. Where the simulator replays
  every node (:func:`exact_replay`), a stage's step lasts at least all its kernels.
* The pass-level path (:mod:`stage_cosim.adapters.roofline.fast`) times each pass on that
  engine from its start and starts a stage's next pass once the one before reaches its sinks
  (every kernel nothing reads, and the pass's exits); the node-level replay makes the next
  pass's first nodes wait for the same sinks. So every kernel that leads to a sink ("live")
  runs between its pass's start and the next pass's, and a stage's step lasts at least its live
  kernels; the optimizer runs after every node of the last pass. (A kernel that leads only to a
  collective nothing waits for, ZeRO-3's weight gradients, may still run when the next pass
  starts: it is left out.)
* A pass's kernels that come after its input (they read the pipeline receive, through the
  block entries) start after it arrives; the input leaves the stage before once that stage's
  pass reaches its exits. Where a schedule starts with micro-batch 0's forward of chunk 0 on
  every stage (all but DualPipe's), the first micro-batch's forward fills the pipeline stage by
  stage, and where it ends with one micro-batch's backward of chunk 0 on every stage (those
  whose backward is one pass), the last backward drains it: the classic bubble, in kernels of
  the passes themselves (:meth:`StepBound.step`, which checks the schedule's pass orders). A
  split backward's two passes (B and W) hold the whole backward's kernels, and every one that
  leads to a sink of the whole still leads to one of its half.

The kernels are computed without building any role graph: those of a pass are its blocks',
generated one block at a time by the code that builds the pass templates
(:func:`~stage_cosim.schedule.templates.pass_template`, with the tensor-parallel overlap's GEMM
chunks and delayed FP8 scaling's per-pass amax update) and timed by the simulator's own
:class:`~stage_cosim.adapters.roofline.compute.ComputeModel` call; blocks chain through their
exits as in a pass; each (chunk, phase) pass runs once per micro-batch (the chunk's first
forward with the FP8 weight casts, where it has them), and the optimizer kernels come from the
step end's own builder. Whatever one block cannot see is settled so that fewer kernels count: a
GEMM that a single-block template cannot tell is split (a reduce-scatter reading the block
before) counts whole, never longer than its chunks together (a GEMM of F FLOPs runs (F + g*h)/P,
linear in F, plus a launch); readers outside the block (the amax reduction) are not counted.

Communication (the calibrated network model; :mod:`stage_cosim.search.comm_bound`): each
communication stream runs its collectives one at a time, so a stage lasts at least each
stream's collectives over its passes (ZeRO-3's gathers and reduce-scatters); and each pass
lasts from its start to its sinks at least its longest dependency path, collectives included,
so a stage's passes count each for the longer of that path and their kernels.

Sums of up to a million kernels in another order than the simulator's differ from its by
rounding (some 1e-10 relative at most); the bound is lowered by :data:`SLACK` to stay below.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Iterable, NamedTuple

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.parallel.axes import DENSE, MESHES
from stage_cosim.parallel.mesh import DeviceMesh
from stage_cosim.search.comm_bound import StreamBound
from stage_cosim.schedule.nodes import COMP, ENTRY, BlockInstance
from stage_cosim.schedule.pipeline import Layout
from stage_cosim.search.evaluate import OBJECTIVES

SLACK = 1e-9          # relative: a bound is lowered this much (float rounding of long sums)
# The most entries each of a bound's caches keeps: past it the cache is emptied. A search binds
# one group of blocks after another (configurations alike in all but the schedule and the
# virtual stages), each adding a few entries to every cache; a Mixture-of-Experts space (ep and
# expert-tp re-factor the ranks) has some 37,000 groups, whose entries, all kept, held 9 GB.
# Every entry is what computing it afresh gives (it holds the objects its key names by id), so
# emptying a cache changes no figure, and a search binds alike groups one after the other
# (:meth:`~stage_cosim.search.compiled.CompiledBound.order`): what is dropped is seldom asked
# again.
CACHE_LIMIT = 20_000
# ... the blocks bound to a configuration's numbers (a whole model's list each)
TRAINING_LIMIT = 2_000
# what training_blocks keeps per set of numbers (the rest of its cache, per policy, stays)
NUMBERS = ("values", "costs")


class _Block(NamedTuple):
    """One block's kernels in one pass, seconds (``(x, y)``: if the block's exits lead to a sink
    of the pass, if not)."""

    every: float                        # all its kernels
    live: tuple[float, float]           # the kernels that lead to a sink
    rooted_live: tuple[float, float]    # those of them after the block's entry
    entry_live: tuple[bool, bool]       # whether the block's entry leads to a sink
    exit_time: float                    # the kernels after its entry that lead to its exits
    entry_to_exit: bool                 # whether its entry leads to its exits
    rooted_exit: bool                   # whether an exit comes after its entry
    has_exits: bool


class _Pass(NamedTuple):
    """A pass's kernels, seconds."""

    every: float           # all its kernels
    live: float            # those that lead to a sink of the pass (a later pass waits for them)
    rooted_live: float     # those of them that start after the pass does (its input, the pass before)
    exit_time: float       # those after its start that its exits (what it sends on) wait for
    has_exits: bool


class _Stage(NamedTuple):
    """A pipeline stage's kernels over the step, seconds."""

    every: float           # all its kernels, the optimizer's included
    live: float            # every kernel a later pass or the step end waits for, the optimizer's included
    rooted: float          # those of the passes that start after their pass does
    optimizer: float
    first: _Pass           # its first pass (micro-batch 0's forward of its first chunk)
    last: _Pass            # its last pass (the last micro-batch's backward of its first chunk)
    comm: float = 0.0      # its busiest communication stream's collectives (search.comm_bound)
    paths: float = 0.0     # ``rooted``, each pass's no less than its longest dependency path
    chain: float = 0.0     # the passes' longest dependency paths alone


class StepBound:
    """Lower bounds on the step time of configurations of one model on one cluster.

    Work is shared between configurations: a block bound to the same numbers (the same
    compiled block, micro-batch and degrees) is timed once, and each kernel shape once."""

    def __init__(self, model: ModelConfig, cluster: Cluster, network_model: str | None = "calibrated",
                 software: str | None = None) -> None:
        self.model, self.cluster = model, cluster
        # (the kernels of the configurations' software profile, as simulate prices them)
        self.compute = ComputeModel(cluster.gpu.for_software(software))
        # the communication each stream serializes (the calibrated network model's streams)
        self.streams = StreamBound(model, cluster, network_model)
        self._durations: dict[tuple, float] = {}
        # what training_blocks shares between configurations of this model (the compiled blocks,
        # each bound to its numbers, ...): kept as long as this bound is, as the timings below
        # are, which name those blocks by id
        self._block_cache: dict[tuple, Any] = {}
        # timings, each holding the compiled blocks its key names by id
        self._blocks: dict[tuple, tuple[Any, _Block]] = {}
        self._amax: dict[tuple, tuple[Any, float]] = {}
        self._optimizer: dict[tuple, tuple[list, list[float]]] = {}
        self._first: dict[int, tuple[Any, bool]] = {}
        self._training: dict[tuple, Any] = {}      # the model's blocks bound to a configuration's numbers

    def trim(self) -> None:
        """Empty the caches past their limits (:data:`CACHE_LIMIT`): called before a new group's
        blocks are bound, it keeps a search's memory bounded whatever the size of its space."""
        if len(self._training) > TRAINING_LIMIT:
            self._training.clear()
        if len(self._block_cache) > CACHE_LIMIT:
            # (the model's switches and each policy's compiled blocks stay: the caches name
            # those blocks by id)
            for key in [k for k in self._block_cache if k[0] in NUMBERS]:
                del self._block_cache[key]
        for cache in (self._durations, self._blocks, self._amax, self._optimizer, *self.streams.caches()):
            if len(cache) > CACHE_LIMIT:
                cache.clear()

    # -- kernels ---------------------------------------------------------------------------

    def _duration(self, flops: int, mem: int, matmul: Any, category: str, groups: int, keys: int) -> float:
        """A compute node's time, as the simulator times it (``fast._program``, ``_programs``)."""
        return self.compute.row_duration_s(self._durations, flops, mem, matmul, category, groups, keys)

    def _row_duration(self, r: tuple) -> float:
        return self._duration(r[3], r[5], r[6], r[10], r[13], r[16])

    def _rows_time(self, rows: Iterable[tuple]) -> float:
        return sum(self._duration(r[3], r[5], r[6], r[10], r[13], r[16]) for r in rows if r[1] == COMP)

    def _block_time(self, inst: BlockInstance, phase: str, first: bool, degrees: dict[str, int],
                    overlap: bool) -> _Block:
        """What one block's kernels contribute to a pass (the pass's own FP8 amax rows aside):
        see :class:`_Block`. A kernel that leads to no sink of its pass (only to a collective
        nothing waits for: ZeRO-3's gradient reduce-scatter) may still run when the next pass
        starts, so it is left out.

        Which rows a block has depends on its compiled program, the phase, and which mesh axes
        have more than one rank (the collectives over one rank are left out); their numbers on
        the compute steps' costs; so blocks alike in those are timed once."""
        split = degrees.get("tp", 1) if overlap and degrees.get("tp", 1) > 1 else 0
        sc = inst.costs.fwd if phase == "fwd" else inst.costs.bwd
        key = (id(inst.compiled), phase, first, split, tuple(sorted((a, d > 1) for a, d in degrees.items())),
               sc.flops, sc.mem_bytes, sc.groups, inst.costs.keys)
        hit = self._blocks.get(key)
        if hit is not None:
            return hit[1]
        # (the rows the communication terms read too: generated once per bound block)
        read = self.streams._read(inst, phase, first, degrees, overlap)[1]
        rows, exits = read.rows, read.exits
        n = len(rows)
        # rows after the block's entry (its rows that read the block before, and what reads
        # them: rows only read earlier ones, ids are in dependency order)
        rooted = [False] * n
        for j, r in enumerate(rows):
            rooted[j] = ENTRY in r[2] or any(d >= 0 and rooted[d] for d in r[2])
        # rows that lead to a kernel nothing reads (a sink: not an exit, which the next block
        # reads), or to the block's exits
        read = [False] * n
        for r in rows:
            for d in r[2]:
                if d >= 0:
                    read[d] = True
        to_exit = [False] * n
        for e in exits:
            to_exit[e] = True
        to_sink = [rows[j][1] == COMP and not read[j] and not to_exit[j] for j in range(n)]
        for j in range(n - 1, -1, -1):
            for d in rows[j][2]:
                if d >= 0:
                    to_sink[d] = to_sink[d] or to_sink[j]
                    to_exit[d] = to_exit[d] or to_exit[j]
        seconds = [self._duration(r[3], r[5], r[6], r[10], r[13], r[16]) if r[1] == COMP else 0.0 for r in rows]
        live, rooted_live, entry_live = [], [], []
        for exit_live in (True, False):
            ok = [to_sink[j] or (exit_live and to_exit[j]) for j in range(n)]
            live.append(sum(t for t, o in zip(seconds, ok) if o))
            rooted_live.append(sum(t for t, o, r in zip(seconds, ok, rooted) if o and r))
            entry_live.append(any(ok[j] and ENTRY in rows[j][2] for j in range(n)))
        block = _Block(sum(seconds), tuple(live), tuple(rooted_live), tuple(entry_live),
                       sum(t for t, e, r in zip(seconds, to_exit, rooted) if e and r),
                       any(to_exit[j] and ENTRY in rows[j][2] for j in range(n)),
                       any(rooted[e] for e in exits), bool(exits))
        self._blocks[key] = (inst.compiled, block)
        return block

    def stage_kernels(self, comps: tuple, per_chunk: Any, one: Any, reps: Any, degrees: dict[str, int],
                      par: ParallelConfig, stage: int) -> _Stage:
        """A stage's kernels over a step: each chunk's passes (``one(runs, phase, first)``) times
        its micro-batches, FP8 amax reductions and the optimizer step."""
        every = live = rooted = 0.0
        kinds: dict[tuple, list] = {}
        ends_of: dict[int, tuple[_Pass, _Pass]] = {}
        for c, runs in enumerate(comps):
            # a split backward's B and W passes are the whole backward's kernels (the split
            # keeps every kernel that leads to a sink leading to one)
            m = per_chunk[c]
            fwd, bwd = one(runs, "fwd", False), one(runs, "bwd", False)
            first = one(runs, "fwd", True) if any(self._casts(reps[k].compiled) for k, _ in runs) else fwd
            amax = self._amax_time(runs, reps, "fwd", degrees) * m + self._amax_time(runs, reps, "bwd", degrees) * m
            every += first.every + (m - 1) * fwd.every + m * bwd.every + amax
            live += first.live + (m - 1) * fwd.live + m * bwd.live + amax
            rooted += first.rooted_live + (m - 1) * fwd.rooted_live + m * bwd.rooted_live
            ends_of[c] = (first, bwd)
            for k, n in runs:
                kinds.setdefault(k, [reps[k], 0])[1] += n
        opt = self._optimizer_time(kinds, par, stage, degrees)
        return _Stage(every + opt, live + opt, rooted, opt, ends_of[0][0], ends_of[0][1])

    def _pass(self, runs: tuple, reps: dict, phase: str, first: bool, degrees: dict[str, int],
              overlap: bool) -> _Pass:
        """What the kernels of a pass over the blocks ``runs`` ((kind, count) in forward order)
        contribute (:class:`_Pass`). Its blocks follow each other: each one's entry reads the
        latest exits before it (a block without exits passes those on, as ``pass_template``
        does), and the latest exits at the end are the pass's. A kernel leads to a sink of the
        pass if it leads to a kernel nothing reads, or to its block's exits and these lead to a
        sink (an entry reading them does, or they are the pass's exits); it comes after the
        pass's start if the exits its block's entry reads do; it comes before the pass's exits
        if it leads to its block's exits and these lead on to the pass's. Readers a single block
        cannot see (the pass's amax reduction) are left out: they could only make more kernels
        count."""
        order = [(k, n) for k, n in (runs if phase == "fwd" else reversed(runs))]
        blocks = [self._block_time(reps[k], phase, first, degrees, overlap) for k, _ in order]
        flat = [b for (_, n), b in zip(order, blocks) for _ in range(n)]
        # from the pass's start: whether the exits each block's entry reads come after the start
        rooted, after = [], True
        for b in flat:
            rooted.append(after)
            if b.has_exits:
                after = after and b.rooted_exit
        plain = rooted_live = exit_time = 0.0
        live = chain = True        # the exits reaching the end are the pass's: a sink, and what it sends
        for j in range(len(flat) - 1, -1, -1):
            b = flat[j]
            if b.has_exits:
                i = 0 if live else 1
                plain += b.live[i]
                if rooted[j]:
                    rooted_live += b.rooted_live[i]
                    if chain:
                        exit_time += b.exit_time
                live, chain = b.entry_live[i], chain and b.entry_to_exit
            else:               # its entry reads the exits before it, which also go on past it
                plain += b.live[1]
                if rooted[j]:
                    rooted_live += b.rooted_live[1]
                live = live or b.entry_live[1]
        return _Pass(sum(b.every for b in flat), plain, rooted_live, exit_time, any(b.has_exits for b in blocks))

    def _amax_time(self, runs: tuple, reps: dict, phase: str, degrees: dict[str, int]) -> float:
        """Delayed FP8 scaling's kernel at the end of each pass over the blocks ``runs`` ((kind,
        count) pairs; none without delayed scaling): it depends on the blocks' programs alone
        (their FP8 modules), which the rows are generated from."""
        from stage_cosim.schedule.templates import _amax_reduction

        programs: dict[int, int] = {}
        for k, n in runs:
            programs[k[1]] = programs.get(k[1], 0) + n
        key = (tuple(programs.items()), phase)
        hit = self._amax.get(key)
        if hit is None:
            insts = [reps[k] for k, n in runs for _ in range(n)]
            rows: list[tuple] = [("bound", COMP, (), 0, 0, 0, "", None, 0, "", "", phase, "bound", 1, 0, 0, 0)]
            _amax_reduction(rows, insts, phase, degrees)
            hit = self._amax[key] = ([reps[k].compiled for k, _ in runs], self._rows_time(rows[1:]))
        return hit[1]

    def _casts(self, compiled: Any) -> bool:
        """Whether a block's first forward differs from the others (FP8 weight casts)."""
        hit = self._first.get(id(compiled))
        if hit is None:
            hit = self._first[id(compiled)] = (compiled, any(st.first_microbatch for st in compiled.sharded.fwd))
        return hit[1]

    def _optimizer_time(self, kinds: dict[tuple, list], par: ParallelConfig, stage: int,
                        degrees: dict[str, int]) -> float:
        """The step end's kernels of a stage holding ``kinds`` (kind -> [a block of it, count]):
        the optimizer, one kernel per block, from the step end's own builder run on one block of
        each kind. A block's optimizer kernel depends on that block alone (and, for the head, on
        whether the tied embedding is on the stage too, which the representatives keep)."""
        from stage_cosim.schedule.program import _Builder, _step_end

        key = (tuple((k[0], k[1], rep.costs.weight_params) for k, (rep, _) in kinds.items()), par.zero,
               par.overlap_param_gather, par.overlap_grad_reduce, par.pp > 1, tuple(sorted(degrees.items())))
        hit = self._optimizer.get(key)
        if hit is None:
            reps = [BlockInstance(rep.kind, j if rep.kind == "layer" else -1, rep.compiled, rep.costs)
                    for j, (rep, _) in enumerate(kinds.values())]
            b = _Builder(degrees)
            _step_end(b, reps, {}, stage=stage, pp=par.pp, zero=par.zero, tied=self.model.shares_embedding,
                      degrees=degrees, gather_after_update=not (par.zero in (1, 2) and par.overlap_param_gather),
                      flush=[], overlap_grad_reduce=par.overlap_grad_reduce)
            by_label: dict[str, float] = {}
            for n in b.nodes:
                if n is not None and n.type == COMP:
                    by_label[n.block] = by_label.get(n.block, 0.0) + self._duration(
                        n.flops, n.mem_bytes, n.matmul, n.category, n.groups, n.keys)
            hit = self._optimizer[key] = ([i.compiled for i in reps], [by_label.get(rep.label, 0.0) for rep in reps])
        return sum(count * t for (_, count), t in zip(kinds.values(), hit[1]))

    # -- configurations ------------------------------------------------------------------------

    def blocks(self, par: ParallelConfig) -> tuple[Any, Any]:
        """``par``'s training blocks bound to its numbers (``training_blocks``) and its precision:
        what :func:`~stage_cosim.workload.synthesize` builds the stages from, kept for every
        configuration that shares them."""
        from stage_cosim.workload import precision_for, training_blocks

        precision = precision_for(par, self.cluster.gpu)
        key = self.blocks_key(par, precision)
        blocks = self._training.get(key)
        if blocks is None:
            self.trim()
            blocks = self._training[key] = training_blocks(self.model, par, precision, cache=self._block_cache)
        return blocks, precision

    def blocks_key(self, par: ParallelConfig, precision: Any) -> tuple:
        """What ``training_blocks`` reads of ``par`` (run at ``precision``): configurations that
        differ only in the schedule or the virtual stages (a third of the space each) share
        their blocks."""
        return (precision, par.sp, par.zero, par.recompute, par.grad_reduce_dtype, par.moe_token_dispatcher,
                par.cp_ring, par.cp_a2a, par.cp_load_balance, tuple(sorted(par.degrees().items())),
                par.micro_batch, par.seq_len, par.moe_load, par.padded_vocab(self.model.vocab))

    def stages(self, par: ParallelConfig) -> list[_Stage]:
        """What each pipeline stage's kernels add up to over the step (:class:`_Stage`): every
        micro-batch's forward and backward (recomputation included) of every model chunk it
        holds, and the optimizer.

        The chunks are laid out as the role graphs lay them out
        (:func:`~stage_cosim.schedule.program._stage_layout`, where each chunk lies:
        :class:`~stage_cosim.schedule.pipeline.Layout`): each virtual stage holds its run of
        layers, the first also the embedding, the last the head."""
        blocks, precision = self.blocks(par)
        degrees = par.degrees()
        mesh = DeviceMesh.build({a: degrees[a] for a in MESHES[DENSE]}, par.mesh_orders()[DENSE], par.mesh_splits())
        degrees = degrees | dict(mesh.size)        # what the role graphs resolve groups with
        overlap, m, pp, vp = par.tp_comm_overlap, par.num_microbatches, par.pp, par.vp
        per_vstage = par.layers_per_stage(self.model.layers)
        layout = Layout(par.schedule, pp, vp)
        nv = layout.nv
        # micro-batches through each chunk of a stage (DualPipe's two copies take half each)
        per_chunk = [m // layout.lines] * layout.chunks
        # the model's layers as runs of one kind (the same compiled block bound to the same numbers)
        reps: dict[tuple, BlockInstance] = {}
        layer_runs: list[list] = []         # [first layer, end, kind]
        for i, (compiled, costs) in enumerate(blocks.layers):
            k = ("layer", id(compiled), id(costs))
            if layer_runs and layer_runs[-1][2] == k:
                layer_runs[-1][1] = i + 1
            else:
                layer_runs.append([i, i + 1, k])
                reps.setdefault(k, BlockInstance("layer", i, compiled, costs))
        ends = (("embedding", blocks.embedding), ("head", blocks.head))
        edge = {kind: ((kind, id(b[0]), id(b[1])), BlockInstance(kind, -1, *b)) for kind, b in ends}
        for k, inst in edge.values():
            reps[k] = inst

        def chunk(vs: int, start: int) -> tuple:
            """Virtual stage ``vs``'s blocks from layer ``start`` on, as (kind, count) runs."""
            end = start + per_vstage[vs]
            runs = [(edge["embedding"][0], 1)] if vs == 0 else []
            runs += [(k, min(end, hi) - max(start, lo)) for lo, hi, k in layer_runs if lo < end and hi > start]
            if vs == nv - 1:
                runs.append((edge["head"][0], 1))
            return tuple(runs)

        starts = [0] * nv
        for i in range(1, nv):
            starts[i] = starts[i - 1] + per_vstage[i - 1]
        passes: dict[tuple, _Pass] = {}       # (chunk, phase, first) -> its kernels, this configuration
        stages: dict[tuple, _Stage] = {}      # a stage's chunks -> its kernels
        timed: dict[tuple, tuple[float, float, float]] = {}     # ... and its communication's signature -> figures

        def one(runs: tuple, phase: str, first: bool) -> _Pass:
            key = (runs, phase, first)
            t = passes.get(key)
            if t is None:
                t = passes[key] = self._pass(runs, reps, phase, first, degrees, overlap)
            return t

        def workload() -> Any:
            from stage_cosim.search.memory import workload_from_blocks

            return workload_from_blocks(self.model, par, blocks, precision)

        mesh_key = self.streams.mesh_key(par) if self.streams.active else None
        out = []
        for s in range(pp):
            comps = tuple(chunk(layout.place(s, c)[1], starts[layout.place(s, c)[1]]) for c in range(layout.chunks))
            st = stages.get(comps)
            if st is None:
                st = stages[comps] = self.stage_kernels(comps, per_chunk, one, reps, degrees, par, s)
            if self.streams.active:
                chunks = [(runs, per_chunk[c], any(self._casts(reps[k].compiled) for k, _ in runs))
                          for c, runs in enumerate(comps)]
                where = self.streams.where(mesh_key, workload, s)
                # stages alike in their blocks and in what their communication takes (the
                # middle stages of a pipeline, mostly) have the same figures
                tkey = (comps, self.streams.signature(par, where, chunks, reps, degrees))
                figures = timed.get(tkey)
                if figures is None:
                    paths, chain = self._paths(par, where, chunks, reps, degrees, one)
                    figures = timed[tkey] = (self.streams.stage_seconds(par, where, chunks, reps, degrees), paths, chain)
                st = st._replace(comm=figures[0], paths=figures[1], chain=figures[2])
            else:
                st = st._replace(paths=st.rooted)
            out.append(st)
        return out

    def _paths(self, par: ParallelConfig, where: tuple, chunks: list[tuple[tuple, int, bool]],
               reps: dict, degrees: dict[str, int], one: Any) -> tuple[float, float]:
        """The stage's passes after they start, each for the longer of its kernels that come
        after its start and a sink waits for, and its longest dependency path from its start
        (collectives included): a pass runs from its start to its sinks, and the next one
        starts after them (:meth:`StreamBound.pass_path`). A split backward's two passes and
        DualPipe's F&B pairs (a forward and a backward in one pass, each one's communication
        under the other's kernels) count their kernels alone. Returns it and the paths alone."""
        paired = par.schedule in ("dualpipe", "dualpipev")
        split = par.schedule in ("zb-h1", "zb-v")

        def path(runs: tuple, phase: str, first: bool) -> float:
            if paired or (split and phase == "bwd"):
                return 0.0
            return self.streams.pass_path(par, where, runs, reps, phase, first, degrees, self._row_duration)

        total = chain = 0.0
        for runs, m, casts in chunks:
            fwd, bwd = one(runs, "fwd", False), one(runs, "bwd", False)
            first = one(runs, "fwd", True) if casts else fwd
            pf, pb = path(runs, "fwd", False), path(runs, "bwd", False)
            p1 = path(runs, "fwd", True) if casts else pf
            total += max(first.rooted_live, p1) + (m - 1) * max(fwd.rooted_live, pf) + m * max(bwd.rooted_live, pb)
            chain += p1 + (m - 1) * pf + m * pb
        return total, chain

    def stage_times(self, par: ParallelConfig) -> list[float]:
        """Each pipeline stage's kernels that a later pass or the step end waits for, summed
        over the step (the optimizer's included), seconds."""
        return [st.live for st in self.stages(par)]

    def step(self, par: ParallelConfig) -> float:
        """The largest of the lower bounds (seconds) that the stages' kernels give:

        * each stage's kernels, on its one compute stream: those a later pass or the step end
          waits for (the pass-level replay starts a pass once the one before reaches its
          sinks), or every one where the simulator replays every node (:func:`exact_replay`);
        * with a pipeline, a stage's kernels after the first micro-batch has come through the
          stages before it: each one's first forward up to what it sends on (every schedule
          starts with micro-batch 0's forward of the first chunk, and a pass starts only once its
          input arrives);
        * and, from a stage on, the last micro-batch's backward back through the stages before
          it (every schedule ends with the same micro-batch's backward of the first chunk on
          every stage): the stage's kernels before its last pass and those its last pass sends
          on, then each earlier stage's last pass up to what it sends on, and the first stage's
          last pass and optimizer.

        Only kernels that start after their pass does count in the pipeline's terms; there
        each pass counts for the longer of those and its longest dependency path from its
        start, collectives included (``paths``). And each stage's busiest communication stream:
        its collectives over the passes (``comm``)."""
        return self.compose(par, self.stages(par))

    def ends(self, par: ParallelConfig) -> tuple[bool, bool]:
        """Whether ``par``'s schedule fills the pipeline with micro-batch 0's forward of chunk 0
        on every stage, and drains it with one micro-batch's backward of chunk 0 on every stage
        (DualPipe's F&B passes are two micro-batches' rows interleaved: only the stage's kernels
        in all are claimed for them)."""
        return _schedule_ends(par.schedule, par.pp, par.num_microbatches, par.vp)

    def compose(self, par: ParallelConfig, stages: list[_Stage]) -> float:
        """:meth:`step` from ``par``'s stages (:meth:`stages`)."""
        best = max(max(st.every if exact_replay(par) else st.live, st.comm) for st in stages)
        pp = par.pp
        if pp == 1:
            return max(best, stages[0].paths + stages[0].optimizer)
        fill_ok, drain_ok = self.ends(par)
        arrival = drained = 0.0           # the first micro-batch's arrival; the last one's drain (stages 1 … s-1)
        for s, st in enumerate(stages):
            after = arrival if fill_ok else 0.0
            best = max(best, after + st.paths + st.optimizer)
            if drain_ok and s > 0:
                best = max(best, after + st.rooted - st.last.rooted_live + st.last.exit_time + drained
                           + stages[0].last.rooted_live + stages[0].optimizer)
                drained += st.last.exit_time
            arrival += st.first.exit_time
        return best

    def __call__(self, par: ParallelConfig) -> float:
        """A lower bound on ``par``'s simulated step time, seconds (:meth:`step`, lowered by
        :data:`SLACK`)."""
        return self.step(par) * (1 - SLACK)


@lru_cache(maxsize=4096)
def _schedule_ends(schedule: str, pp: int, m: int, vp: int) -> tuple[bool, bool]:
    """:meth:`StepBound.ends` of a schedule (a function of these alone: kept for every search
    of the process, as the compiled sharding policies are)."""
    from stage_cosim.schedule.pipeline import schedule_order

    orders = [schedule_order(schedule, pp, s, m, vp) for s in range(pp)]
    paired = any(p.paired for o in orders for p in o)
    return (not paired and all(o[0].phase == "fwd" and o[0].micro_batch == 0 and o[0].chunk == 0 for o in orders),
            all(o[-1].phase == "bwd" and o[-1].chunk == 0 and o[-1].micro_batch == orders[0][-1].micro_batch
                for o in orders))


def exact_replay(par: ParallelConfig) -> bool:
    """Whether the simulator replays ``par``'s step node by node (a search simulates one rank
    per stage, and ``stage_cosim.adapters.roofline.simulate`` replays every node of ZeRO-3 with
    a pipeline, whose prefetched gathers the pass-level path cannot time): then every kernel of
    a stage, on its one compute stream, is before the step's end."""
    return par.zero >= 3 and par.pp > 1


def score_bound(objective: Any, step_bound: float, tokens: int, gpus: int) -> float | None:
    """A lower bound on ``objective``'s score (lower is better) from a lower bound on the step
    time, for objectives that grow with the step time at a fixed GPU count and batch (all of
    :data:`~stage_cosim.search.evaluate.OBJECTIVES`); None for any other."""
    if objective.name not in OBJECTIVES or not math.isfinite(step_bound) \
            or step_bound <= 0:
        return None
    per_s = tokens / step_bound
    return objective.score({"step_time_s": step_bound, "tokens_per_s": per_s,
                            "tokens_per_s_per_gpu": per_s / max(1, gpus), "config": {"num_gpus": gpus}})


def policy_key(par: ParallelConfig) -> tuple:
    """What decides a configuration's compiled blocks (roughly: configurations alike in it share
    their compilation, so a worker gets them together)."""
    return (par.dtype, par.sp, par.zero, par.recompute, par.cp, par.cp_comm, par.cp_a2a_size)
