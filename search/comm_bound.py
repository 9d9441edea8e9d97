"""Lower bounds on a step from the communication no overlap can hide: each stream's collectives,
and each pass's longest dependency path with its collectives on it.

Why it holds, from the simulator's rules (the calibrated network model):

* Every collective of a communicator kind runs on that kind's one stream of the rank
  (:meth:`~stage_cosim.adapters.roofline.network.CalibratedNetwork.stream`: ``comm:<kind>``;
  the attention exchange's ring sends too), and the event-driven engine
  (:mod:`stage_cosim.adapters.roofline.engine`) issues a node on a stream only while the stream
  is free, so a stream's nodes run one at a time. Where every rank of a stage is one agent, a
  collective ends its stated duration after its issue
  (:meth:`~stage_cosim.adapters.roofline.network.CalibratedNetwork.collective`: the latest
  member's issue, and every member is the one agent) and a send holds its stream for
  :meth:`~stage_cosim.adapters.roofline.network.CalibratedNetwork.p2p`'s busy time. The
  durations depend on the collective, its bytes and its members alone (no state).
* The pass-level path (:mod:`stage_cosim.adapters.roofline.fast`) times each pass on that
  engine and starts a pass no earlier than each of its streams' first use finds the stream
  free of the passes before (``stream_free``), so the passes' uses of a stream never overlap;
  the step ends after every pass. Only the first forward of a chunk that waits on step-start
  parameter gathers (ZeRO-1/2 with ``overlap_param_gather``) is timed from absolute times
  without that rule: its communication is not counted. Where every node is replayed
  (:func:`~stage_cosim.search.bound.exact_replay`) the engine serializes them all.

So a stage's step lasts at least, on each stream, the sum of the durations of the collectives
its passes put on it: every micro-batch's forward and backward of each chunk it holds (ZeRO-3's
parameter all-gathers forward and backward and its gradient reduce-scatters, the tensor-,
context- and expert-parallel collectives). What is left out only lowers the sum: the step end
(gradient reductions, the optimizer's gathers), the pipeline's sends (their own stream), the
FP8 amax reduction, the first forward's extra rows (the fewer of its own and a plain
forward's are counted), the tensor-parallel collectives that the communication overlap splits
into chunks, and the routed all-to-alls a deduplicating dispatcher times by its routing.

The same durations give each pass's longest dependency path (:meth:`StreamBound.pass_path`):
a node starts no earlier than the nodes it reads end, and a kernel, a collective or a send then
lasts its duration whatever else runs, so a pass lasts from its start to its sinks at least its
longest path of nodes that come after its start (the collectives on it included: the exposed
tensor- and context-parallel communication, a micro-batch's first parameter gather). The next
pass of the stage starts after those sinks (the pass-level path starts it then; the node-level
replay makes its first nodes wait for them), so the stage lasts at least the sum over its passes
of the longer of that path and the kernels the bound already counts for the pass
(:meth:`~stage_cosim.search.bound.StepBound.step`). The blocks of a pass chain through their
exits as in the pass templates, so the path is built block by block: each block's longest path
from its entry to its exits and to a sink.

The collectives are those of the blocks' pass templates (the same generator the role graphs
use, one block at a time), their members those of the stage's first rank as the simulator
takes them (:meth:`~stage_cosim.workload.Workload.group_members`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from stage_cosim.hardware.cluster import Cluster
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.nodes import COLL, COMP, ENTRY, SEND, BlockInstance
from stage_cosim.sharding.placement import Collective

FP8_LABEL = "fp8"     # delayed scaling's per-pass rows (amax all-reduce), left out
ROUTED_KIND = "ep"    # the all-to-alls a deduplicating dispatcher times by its routing


def block_rows(inst: BlockInstance, phase: str, first: bool, degrees: dict[str, int], overlap: bool
               ) -> tuple[list[tuple], list[int], bool]:
    """(rows, exits, whether its GEMMs stay whole where the pass may split them) of one block in
    one pass, as the pass templates generate it (delayed scaling's per-pass rows left out), with
    the tensor-parallel overlap's GEMM chunks where the block alone tells how the pass splits."""
    from stage_cosim.schedule.templates import _pipeline_tp, pass_template

    split = degrees.get("tp", 1) if overlap and degrees.get("tp", 1) > 1 else 0
    template = pass_template([inst], phase, degrees, False, first=first)
    rows = [r for r in template.rows if r[12] != FP8_LABEL]
    exits = list(template.exits)
    unsure = False
    if split:
        chunked, first_row, last_row = _pipeline_tp(rows, split)
        # A reduce-scatter is split with the one GEMM feeding it: one that reads the block
        # before (ENTRY here) may have a second GEMM feeding it in a pass of several blocks,
        # and stay whole there. Then the block counts every GEMM whole (never longer).
        unsure = any(r[1] == COLL and r[7] == Collective.REDUCE_SCATTER and last_row[j] > first_row[j]
                     and any(d < 0 for d in r[2]) for j, r in enumerate(rows))
        if not unsure:
            rows, exits = chunked, [last_row[e] for e in exits]
    return rows, exits, unsure


class _Path(NamedTuple):
    """The longest dependency paths through one block from its entry, seconds (None: none)."""

    to_exit: float | None       # to the latest of its exits (None: an exit not after its entry)
    to_sink: float | None       # to a kernel nothing reads (a sink of the pass)
    has_exits: bool


class _Rows(NamedTuple):
    """One block's rows in one pass, read once (what its collectives take depends on where
    the stage lies; the rest does not)."""

    rows: list[tuple]
    exits: tuple[int, ...]
    sinks: tuple[int, ...]      # kernels no row reads that are not exits
    comm: tuple[int, ...]       # its collectives and sends
    streams: tuple[int, ...]    # those counted on their stream (not the chunks of a split GEMM's)
    unsure: bool                # GEMMs the pass may split and the block keeps whole


class StreamBound:
    """Per-stream communication and dependency paths of configurations' stages, seconds
    (calibrated network model only: another model has no streams to bound with, and every
    figure is 0)."""

    def __init__(self, model: ModelConfig, cluster: Cluster, network_model: str | None = "calibrated") -> None:
        from stage_cosim.adapters.roofline.network import CalibratedNetwork

        self.model, self.cluster = model, cluster
        self.network = CalibratedNetwork(cluster) if network_model == "calibrated" else None
        # what a block's rows are made of -> (the compiled block, held: its id is in the key; the rows read)
        self._rows: dict[tuple, tuple[Any, _Rows]] = {}
        # (block, its numbers, phase, first, split) -> (held objects, the key above, the rows read)
        self._bound: dict[tuple, tuple[Any, Any, tuple, _Rows]] = {}
        self._members: dict[tuple, tuple] = {}
        self._paths: dict[tuple, tuple] = {}
        self._seconds: dict[tuple, float] = {}
        self._timed: dict[tuple, tuple[tuple[float, ...], dict[str, float]]] = {}

    @property
    def active(self) -> bool:
        return self.network is not None

    def caches(self) -> tuple[dict, ...]:
        """Its caches, each entry what computing it afresh gives (emptied past a limit:
        :meth:`StepBound.trim <stage_cosim.search.bound.StepBound.trim>`)."""
        return self._rows, self._bound, self._members, self._paths, self._seconds, self._timed

    def _read(self, inst: BlockInstance, phase: str, first: bool, degrees: dict[str, int], overlap: bool
              ) -> tuple[tuple, _Rows]:
        """(its key, the block's rows read). Collective bytes depend on the block's numbers
        (ZeRO's shards on the data-parallel degree), so the rows are kept per bound block."""
        split = degrees.get("tp", 1) > 1 and overlap
        fast = (id(inst.compiled), id(inst.costs), phase, first, split)
        hit = self._bound.get(fast)
        if hit is not None:
            return hit[2], hit[3]
        # What the rows are made of (pass_template, block_rows): the compiled block, the pass's
        # step costs and keys, which mesh axes have more than one rank, the overlap's chunks and
        # the block's label. Blocks bound to other numbers that agree in these (configurations
        # apart in the data-parallel degree, mostly) share their rows and every figure keyed
        # by them.
        sc = inst.costs.fwd if phase == "fwd" else inst.costs.bwd
        key = (id(inst.compiled), phase, first, degrees.get("tp", 1) if split else 0,
               tuple(sorted((a, d > 1) for a, d in degrees.items())), sc, inst.costs.keys, inst.label)
        hit = self._rows.get(key)
        if hit is None:
            rows, exits, unsure = block_rows(inst, phase, first, degrees, overlap)
            read = {d for r in rows for d in r[2] if d >= 0}
            comm = tuple(j for j, r in enumerate(rows) if r[1] in (COLL, SEND))
            read_rows = _Rows(rows, tuple(exits),
                              tuple(j for j, r in enumerate(rows) if r[1] == COMP and j not in read and j not in exits),
                              comm, tuple(j for j in comm if not (split and rows[j][9] == "tp")), unsure)
            hit = self._rows[key] = (inst.compiled, read_rows)
        self._bound[fast] = (inst.compiled, inst.costs, key, hit[1])
        return key, hit[1]

    @staticmethod
    def mesh_key(par: ParallelConfig) -> tuple:
        """What decides where a configuration's ranks lie (its degrees, mesh orders and splits)."""
        return tuple(sorted(par.degrees().items())), tuple(sorted(par.mesh_orders().items())), par.mesh_splits()

    def where(self, mesh_key: tuple, workload: Any, stage: int) -> tuple:
        """Where ``stage``'s groups lie in the mesh ``mesh_key`` names (:meth:`mesh_key`): (a key
        of it, the workload, the stage's first rank, that rank's members of each kind asked so
        far)."""
        key = (*mesh_key, stage)
        hit = self._members.get(key)
        if hit is None:
            w = workload()
            hit = self._members[key] = (w, w.mesh.rank(pp=stage), {})
        return (key, *hit)

    def _duration(self, where: tuple, r: tuple, flex: bool) -> float:
        """A collective's time from its issue or a send's hold of its stream, as the simulator
        takes them (a routed all-to-all that a deduplicating dispatcher times by its routing: 0)."""
        what = r[7].value if r[1] == COLL else SEND
        key = (where[0], r[9], what, r[8], r[14] if what == SEND else 0, flex)
        t = self._seconds.get(key)
        if t is None:
            _, w, rank, members = where
            kind = r[9]
            if what == SEND:
                t = self.network.p2p(rank, w.peer(rank, r[14], kind), r[8])[0]
            elif flex and kind == ROUTED_KIND and what == "ALL_TO_ALL":
                t = 0.0
            else:
                if kind not in members:        # (asked of the mesh: the workload's list of kinds builds its graphs)
                    members[kind] = tuple(w.group_members(rank, kind))
                t = self.network.duration(what, r[8], members[kind])
            self._seconds[key] = t
        return t

    @staticmethod
    def _flex(model: ModelConfig, par: ParallelConfig) -> bool:
        return model.is_moe and par.moe_token_dispatcher == "flex"

    def _timed_block(self, key: tuple, rows: _Rows, where: tuple, flex: bool
                     ) -> tuple[tuple[float, ...], dict[str, float]]:
        """(each communication row's time, the block's collectives on each stream) on the stage
        ``where`` says."""
        tkey = (key, where[0], flex)
        hit = self._timed.get(tkey)
        if hit is None:
            seconds = tuple(self._duration(where, rows.rows[j], flex) for j in rows.comm)
            streams: dict[str, float] = {}
            counted = set(rows.streams)
            for j, t in zip(rows.comm, seconds):
                if j in counted:
                    kind = rows.rows[j][9]
                    streams[kind] = streams.get(kind, 0.0) + t
            hit = self._timed[tkey] = (seconds, streams)
        return hit

    def signature(self, par: ParallelConfig, where: tuple, chunks: list[tuple[tuple, int, bool]], reps: dict,
                  degrees: dict[str, int]) -> tuple:
        """What the stage's communication takes, block by block: stages of one configuration
        holding the same blocks with the same signature have the same figures."""
        flex = self._flex(self.model, par)
        out = []
        for runs, _, casts in chunks:
            for k, _ in runs:
                for phase, first in (("fwd", False), ("bwd", False)) + ((("fwd", True),) if casts else ()):
                    key, rows = self._read(reps[k], phase, first, degrees, par.tp_comm_overlap)
                    out.append(self._timed_block(key, rows, where, flex)[0])
        return tuple(out)

    def pass_seconds(self, par: ParallelConfig, where: tuple, runs: tuple, reps: dict, phase: str,
                     first: bool, degrees: dict[str, int]) -> dict[str, float]:
        """Each stream's collectives in one pass over the blocks ``runs`` ((kind, count) in
        forward order) of the stage ``where`` says, seconds."""
        flex = self._flex(self.model, par)
        out: dict[str, float] = {}
        for k, n in runs:
            key, rows = self._read(reps[k], phase, first, degrees, par.tp_comm_overlap)
            for kind, t in self._timed_block(key, rows, where, flex)[1].items():
                out[kind] = out.get(kind, 0.0) + n * t
        return out

    def stage_seconds(self, par: ParallelConfig, where: tuple, chunks: list[tuple[tuple, int, bool]],
                      reps: dict, degrees: dict[str, int]) -> float:
        """The busiest stream's collectives of the stage over the step: ``chunks`` are (its
        blocks as (kind, count) runs, micro-batches through it, whether its first forward
        differs from the others)."""
        if not self.active:
            return 0.0
        # the first forward that waits on step-start gathers is timed without the stream rule
        gathered = par.zero in (1, 2) and bool(par.overlap_param_gather)
        total: dict[str, float] = {}
        for runs, m, casts in chunks:
            fwd = self.pass_seconds(par, where, runs, reps, "fwd", False, degrees)
            bwd = self.pass_seconds(par, where, runs, reps, "bwd", False, degrees)
            first = self.pass_seconds(par, where, runs, reps, "fwd", True, degrees) if casts else fwd
            for kind in set(fwd) | set(bwd):
                once = 0.0 if gathered else min(first.get(kind, 0.0), fwd.get(kind, 0.0))
                total[kind] = total.get(kind, 0.0) + once + (m - 1) * fwd.get(kind, 0.0) + m * bwd.get(kind, 0.0)
        return max(total.values(), default=0.0)

    # -- dependency paths ---------------------------------------------------------------------

    def _block_path(self, inst: BlockInstance, phase: str, first: bool, degrees: dict[str, int], overlap: bool,
                    where: tuple, duration: Callable[[tuple], float], flex: bool) -> _Path | None:
        """The block's longest paths from its entry (:class:`_Path`); None where its rows may
        not be the pass's (GEMMs a pass may split, which the block keeps whole). Stages whose
        collectives take as long share them."""
        key, rows = self._read(inst, phase, first, degrees, overlap)
        if rows.unsure:
            return None
        seconds = self._timed_block(key, rows, where, flex)[0]
        pkey = (key, seconds)
        hit = self._paths.get(pkey)
        if hit is None:
            hit = self._paths[pkey] = (inst.compiled, inst.costs, self._longest(rows, dict(zip(rows.comm, seconds)),
                                                                                duration))
        return hit[2]

    @staticmethod
    def _longest(rows: _Rows, comm: dict[int, float], duration: Callable[[tuple], float]) -> _Path:
        """A block's longest paths from its entry: a row's end, along rows that wait for it (rows
        that do not come after the entry may start before the pass does: they count for none),
        is the latest end it waits for plus its time (a receive: 0, it ends no earlier than its
        issue)."""
        end: list[float | None] = [None] * len(rows.rows)
        for j, r in enumerate(rows.rows):
            after = [0.0 if d == ENTRY else end[d] for d in r[2] if d == ENTRY or (d >= 0 and end[d] is not None)]
            if after:
                end[j] = max(after) + (duration(r) if r[1] == COMP else comm.get(j, 0.0))
        exits = [end[e] for e in rows.exits]
        sinks = [end[j] for j in rows.sinks if end[j] is not None]
        return _Path(max(exits) if exits and None not in exits else None, max(sinks, default=None), bool(exits))

    def pass_path(self, par: ParallelConfig, where: tuple, runs: tuple, reps: dict, phase: str,
                  first: bool, degrees: dict[str, int], duration: Callable[[tuple], float]) -> float:
        """The longest dependency path of a pass over the blocks ``runs`` ((kind, count) in
        forward order) from its start to a kernel nothing reads or to its exits (both are its
        sinks, which the stage's next pass waits for), along rows that come after the start:
        each block's entry waits for the exits of the block before (a block without exits passes
        them on). Where a block's exits do not come after its entry, the paths end there."""
        if not self.active:
            return 0.0
        order = runs if phase == "fwd" else tuple(reversed(runs))
        flex = self._flex(self.model, par)
        chain = best = 0.0
        for k, n in order:
            p = self._block_path(reps[k], phase, first, degrees, par.tp_comm_overlap, where, duration, flex)
            if p is None:
                return best
            if p.to_sink is not None:
                best = max(best, chain + p.to_sink)
            if p.has_exits:
                if p.to_exit is None:
                    return best
                # n blocks in a row: the last one's sinks come after the chain of the first n - 1
                if p.to_sink is not None:
                    best = max(best, chain + (n - 1) * p.to_exit + p.to_sink)
                chain += n * p.to_exit
        return max(best, chain)
