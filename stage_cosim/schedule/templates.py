"""Pass templates: the nodes of one (chunk, phase) pass over a stage's blocks, with ids relative
to the pass start, generated once and placed for every micro-batch; later blocks of a kind
copied from the first, and the rewrites a pass undergoes (delayed FP8 scaling's amax reduction,
tensor-parallel communication overlap, two-batch overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from stage_cosim.graph.autodiff import weight_grad_rows
from stage_cosim.graph.precision import AMAX_TENSORS_BWD, AMAX_TENSORS_FWD
from stage_cosim.parallel.axes import DENSE, mesh_axes, resolve_group
from stage_cosim.schedule.memory import FP32_BYTES
from stage_cosim.schedule.nodes import (
    CHAIN, CTRL, ENTRY, PARAMS, COLL, COMP, RECV, SEND, ceil_int, BlockInstance,
)
from stage_cosim.sharding.placement import Collective


class PassTemplate:
    """The nodes of one (chunk, phase) pass with ids relative to the pass start.

    Every micro-batch's pass of a chunk is the same graph; placing it copies the rows with an
    id offset and fills the markers (the pipeline receive, the ZeRO-3 gather chain, the
    previous pass's sinks).

    A block of the same kind as an earlier one of the pass (a model's layers, mostly) is a copy
    of its rows: ``pieces`` says which rows are generated and which are copies, and ``rows``
    writes the copies out on first use. A simulator that times each kind of block once
    (``segments``) never needs them.
    """

    def __init__(self, pieces: list[tuple], num_rows: int, exits: list[int], sinks: list[int],
                 blocks: list[tuple[str, int, int]], last_prologue: int | None, pairs: int = 0,
                 segments: tuple[tuple[tuple, int, int, tuple[int, ...], tuple[int, list]], ...] | None = None,
                 last_compute: int | None = None) -> None:
        # ("rows", start, rows): generated rows; ("copy", start, _BlockCopy, label, index, entry,
        # pair_base): a copy of an earlier block (see _copy_block)
        self.pieces = pieces
        self.num_rows = num_rows
        self.exits = exits
        self.sinks = sinks
        self.blocks = blocks                  # (block label, first row, end row)
        self.last_prologue = last_prologue
        self.pairs = pairs                    # send/recv pairs (their tags are 0 … pairs - 1)
        # The pass as a sequence of blocks that each wait only for the exits of the one before:
        # (kind, first row, end row, the rows it waits for, first row of the generated block of
        # its kind); blocks of one kind have equal rows up to their ids. None where blocks are
        # chained otherwise (see pass_template).
        self.segments = segments
        self.last_compute = last_compute
        self._rows: list[tuple] | None = pieces[0][2] if len(pieces) == 1 and pieces[0][0] == "rows" else None

    @classmethod
    def of_rows(cls, rows: list[tuple], exits: list[int], sinks: list[int], blocks: list[tuple[str, int, int]],
                last_prologue: int | None, pairs: int = 0) -> "PassTemplate":
        last = next((j for j in range(len(rows) - 1, -1, -1) if rows[j][1] == COMP), None)
        return cls([("rows", 0, rows)], len(rows), exits, sinks, blocks, last_prologue, pairs, None, last)

    @property
    def rows(self) -> list[tuple]:
        if self._rows is None:
            rows: list[tuple] = []
            for piece in self.pieces:
                if piece[0] == "rows":
                    rows.extend(piece[2])
                else:
                    _copy_block(rows, *piece[2:])
            self._rows = rows
        return self._rows

    def generated_rows(self) -> list[tuple]:
        """The rows generated, here or for another pass (not their copies): every kind of row of
        the pass is among them."""
        if self._rows is not None:
            return self._rows
        out: list[tuple] = []
        seen: set[int] = set()
        for piece in self.pieces:
            rows = piece[2] if piece[0] == "rows" else piece[2].rows
            if id(rows) not in seen:
                seen.add(id(rows))
                out += rows
        return out

    @cached_property
    def compute_totals(self) -> tuple[int, int, int]:
        """(executed, model, matmul) FLOPs of one placement of the pass."""
        if self._rows is not None:
            return _flop_totals(self._rows)
        generated = {piece[1]: _flop_totals(piece[2]) for piece in self.pieces if piece[0] == "rows"}
        # a copied block's FLOPs are its original's (the generated rows starting at m.start)
        copied: dict[int, tuple[int, int, int]] = {}       # by block copied
        for piece in self.pieces:
            if piece[0] == "copy":
                m = piece[2]
                if id(m) not in copied:
                    copied[id(m)] = _flop_totals(m.rows)
        out = [0, 0, 0]
        for piece in self.pieces:
            t = generated[piece[1]] if piece[0] == "rows" else copied[id(piece[2])]
            for i in range(3):
                out[i] += t[i]
        return out[0], out[1], out[2]


def _flop_totals(rows: list[tuple]) -> tuple[int, int, int]:
    comp = [r for r in rows if r[1] == COMP]
    return sum(r[3] for r in comp), sum(r[4] for r in comp), sum(r[3] for r in comp if r[6])


def _pipeline_tp(rows: list[tuple], k: int) -> tuple[list[tuple], list[int], list[int]]:
    """Megatron-Core's tensor-parallel communication overlap, as a graph rewrite: each
    tensor-parallel all-gather feeding a GEMM, and each reduce-scatter fed by one, is split with
    that GEMM into ``k`` chunks, chunk i of the GEMM waiting only for chunk i of the gather (and
    chunk i of the reduce-scatter only for chunk i of the GEMM), so transfer and compute overlap.

    Returns the new rows and, per old row, the first and last new row standing for it."""
    gathers = {j for j, r in enumerate(rows) if r[1] == COLL and r[9] == "tp" and r[7] == Collective.ALL_GATHER}
    consumers: dict[int, list[int]] = {}      # (of the all-gathers only: nothing else asks)
    if gathers:
        for j, r in enumerate(rows):
            for d in r[2]:
                if d in gathers:
                    consumers.setdefault(d, []).append(j)

    def gemm(j: int) -> bool:
        return rows[j][1] == COMP and rows[j][6]

    split: set[int] = set()
    feeds: dict[int, list[int]] = {}     # gemm -> split all-gathers it reads
    fed_by: dict[int, int] = {}          # split reduce-scatter -> the gemm it reads
    for j, r in enumerate(rows):
        if j in gathers:
            gemms = [c for c in consumers.get(j, []) if gemm(c)]
            if gemms:
                split.add(j)
                split.update(gemms)
                for g in gemms:
                    feeds.setdefault(g, []).append(j)
        elif r[1] == COLL and r[9] == "tp" and r[7] == Collective.REDUCE_SCATTER:
            producers = [d for d in r[2] if d >= 0 and gemm(d)]
            if len(producers) == 1:
                split.update((j, producers[0]))
                fed_by[j] = producers[0]
    if not split:
        return rows, list(range(len(rows))), list(range(len(rows)))
    first: list[int] = []
    last: list[int] = []
    pos = 0
    for j in range(len(rows)):
        first.append(pos)
        pos += k if j in split else 1
        last.append(pos - 1)

    suffixes = [f"#{i + 1}/{k}" for i in range(k)]
    out: list[tuple] = []
    append = out.append
    for j, r in enumerate(rows):
        deps = r[2]
        if j not in split:
            append((r[0], r[1], tuple(sorted({d if d < 0 else last[d] for d in deps})), *r[3:]))
            continue
        name, typ, _, flops, mflops, mem, matmul, coll, cbytes, group, cat, phase, label, groups, peer, tag, keys = r
        # every chunk's share (the same for each)
        f, mf, me, cb = ceil_int(flops / k), ceil_int(mflops / k), ceil_int(mem / k), ceil_int(cbytes / k)
        if typ == COMP:
            fed = feeds.get(j, ())
            rest = {d if d < 0 else last[d] for d in deps if d not in fed}
        elif j in fed_by:
            producer = fed_by[j]
            rest = {d if d < 0 else last[d] for d in deps if d != producer}
        else:
            rest = {d if d < 0 else last[d] for d in deps}
        for i in range(k):
            # chunk i waits for chunk i of what it is split with (all-gathers feeding a GEMM, the
            # GEMM feeding a reduce-scatter), its own chunk before, and (the first, or every
            # chunk of a GEMM) what the row waited for otherwise
            if typ == COMP:
                ds = rest | {first[d] + i for d in fed}
            elif j in fed_by:
                ds = {first[producer] + i} | (rest if i == 0 else set())
            else:
                ds = set(rest) if i == 0 else set()
            if i > 0:
                ds.add(first[j] + i - 1)
            append((name + suffixes[i], typ, tuple(sorted(ds)), f, mf, me, matmul, coll, cb, group, cat, phase, label,
                    groups, peer, tag, keys))
    return out, first, last


@dataclass
class _BlockCopy:
    """A block of a pass as first generated, to copy for the next block of the same kind."""

    start: int
    end: int
    label: str
    index: int                     # block index in the pass (the parameter marker's)
    entry: tuple[int, ...]         # the previous block's exits it depends on
    pair_base: int
    pairs: int                     # pair count of the pass after it
    exits: list[int]
    first_compute: int | None
    last_compute: int | None
    sinks: list[int]               # its compute rows no row of the block reads
    rows: list[tuple] = field(default_factory=list)   # the generated rows (ids from ``start``)


def _rebinder(m: _BlockCopy, start: int, bi: int, entry: list[int]):  # noqa: ANN202
    """Row ids of block ``m`` as seen from its copy at ``start`` (block ``bi``, entered from
    ``entry``): its own rows shifted, its entry dependencies and parameter marker rebound."""
    delta = start - m.start
    entry_of = dict(zip(m.entry, entry))
    params_old, params_new = PARAMS - m.index, PARAMS - bi

    def rebind(d: int) -> int:
        if d in entry_of:
            return entry_of[d]
        if d >= m.start:
            return d + delta
        return params_new if d == params_old else d

    return rebind


def _copy_plan(m: _BlockCopy, start: int, bi: int, entry: list[int], pair_base: int
               ) -> tuple[list[int], int | None, int]:
    """What a copy of block ``m`` at ``start`` leaves for the next block: (its exits, its first
    compute row, the pass's pair count after it)."""
    rebind = _rebinder(m, start, bi, entry)
    first = m.first_compute + start - m.start if m.first_compute is not None else None
    pairs = (pair_base + m.pairs - m.pair_base) if m.pairs > m.pair_base else pair_base
    return [rebind(e) for e in m.exits], first, pairs


def _copy_block(rows: list[tuple], m: _BlockCopy, label: str, bi: int, entry: list[int], pair_base: int) -> None:
    """Append a copy of block ``m``'s rows for a later block of the same kind (the same
    compiled block bound to the same numbers): ids shifted, entry dependencies and markers
    rebound, names and the ring's tags renumbered."""
    rebind = _rebinder(m, len(rows), bi, entry)
    cut = len(m.label)
    tag_shift = pair_base - m.pair_base
    for r in m.rows:
        name, typ, deps, flops, mflops, mem, matmul, coll, cbytes, group, cat, phase, _, groups, peer, tag, keys = r
        rows.append((label + name[cut:], typ, tuple(sorted(rebind(d) for d in deps)), flops, mflops, mem, matmul, coll,
                     cbytes, group, cat, phase, label, groups, peer, tag + tag_shift if typ in (SEND, RECV) else tag,
                     keys))


def pass_template(insts: list[BlockInstance], phase: str, degrees: dict[str, int],
                   tp_overlap: bool = False, first: bool = False,
                   shared: dict[tuple, _BlockCopy] | None = None) -> PassTemplate:
    """The nodes of one pass over ``insts``; ``first``: the first forward of the step, which also
    casts the FP8 weights that the later micro-batches reuse.

    A block of the same kind as an earlier one (the same compiled block bound to the same
    numbers: a model's layers, mostly) is a copy of its rows, written out only when the rows
    are read. Where every block depends only on the exits of the one before (no parameter
    prefetch chains, no FP8 amax reduction across the pass, no tensor-parallel overlap
    rewrite), the template records its blocks as ``segments``, so that a simulator may time
    each kind of block once. ``shared`` carries generated blocks from template to template (the
    passes and stages of one workload: a layer kind is generated once for all of them)."""
    pieces: list[tuple] = []
    n = 0                         # rows of the pass so far
    blocks: list[tuple[str, int, int]] = []
    segments: list[tuple[tuple, int, int, tuple[int, ...], tuple[int, list]]] | None = []
    prev_exit: list[int] = [ENTRY]
    last_prologue: int | None = None
    prev_first_compute: int | None = None     # the previous block's first kernel
    last_compute: int | None = None
    lasts: list[int | None] = []              # each block's last kernel so far
    pair_base = pairs = 0                     # send/recv pairs of the blocks before / so far
    copies: dict[tuple[int, int, int], _BlockCopy] = {}
    local_sinks: list[int] = []               # compute rows no row of their own block reads
    for bi, inst in enumerate(insts):
        sharded = inst.compiled.sharded
        steps = sharded.fwd if phase == "fwd" else sharded.bwd
        start = n
        entry = tuple(prev_exit)
        kind = (id(inst.compiled), id(inst.costs))
        # (a block copies one entered the same way: as many exits of the block before)
        found = (*kind, len(entry))
        m = (copies.get(found) or (shared or {}).get((*found, phase, first, tp_overlap))) if bi > 0 else None
        if m is not None:
            pieces.append(("copy", start, m, inst.label, bi, list(prev_exit), pair_base))
            prev_exit, first_compute, pairs = _copy_plan(m, start, bi, prev_exit, pair_base)
            prev_first_compute = first_compute if first_compute is not None else prev_first_compute
            pair_base = pairs
            n = start + m.end - m.start
            last_compute = m.last_compute + start - m.start if m.last_compute is not None else last_compute
            local_sinks += [j + start - m.start for j in m.sinks]
            blocks.append((inst.label, start, n))
            lasts.append(m.last_compute + start - m.start if m.last_compute is not None else None)
            if segments is not None:
                segments.append(((*kind, phase, first), start, n, entry, (m.start, m.rows)))
            continue
        sc = inst.costs.fwd if phase == "fwd" else inst.costs.bwd
        exits = sharded.fwd_exit if phase == "fwd" else sharded.bwd_exit
        block: list[tuple] = []
        ids: list[list[int]] = []          # step index -> the row(s) standing for it
        prologue = False
        for st in steps:
            i = st.index
            if st.first_microbatch and not first:
                ids.append([])         # the cached copy already exists
                continue
            if st.deps:
                deps = [x for d in st.deps for x in ids[d]]
                if not st.prologue and all(steps[d].prologue for d in st.deps):
                    # reads only the block's gathered weights (ZeRO-3) besides what enters the
                    # block: it waits for the previous block's exits too
                    deps += list(prev_exit)
                    if bi == 0:
                        deps.append(CTRL)
            else:
                # ZeRO-3's parameter gathers as PyTorch FSDP (FULL_SHARD) runs them: the CPU runs
                # ahead of the GPU and issues a block's gather when it reaches the block (in the
                # forward its pre-forward hook, forward_prefetch off; in the backward the block
                # before it in the pass prefetches it, BACKWARD_PRE), behind the previous gather
                # on the one NCCL stream, but first waits for the block two back to be freed
                # (limit_all_gathers: two gathered blocks at most), i.e. for its last kernel. The
                # second block's "two back" is the previous pass's last; the first block's gather
                # waits for the previous pass (and its last gather).
                if st.prologue:
                    prologue = True
                    deps = [last_prologue] if last_prologue is not None else [CHAIN]
                    if bi >= 2 and lasts[bi - 2] is not None:
                        deps.append(lasts[bi - 2])
                    elif bi == 1:
                        deps.append(CTRL)
                else:
                    deps = list(prev_exit) + [PARAMS - bi]
                if bi == 0:
                    deps.append(CTRL)
            name = f"{inst.label}.{st.name}"
            row = start + len(block)
            if st.kind == "compute" and sc.flops[i] <= 0 and sc.mem_bytes[i] <= 0:
                ids.append(sorted(set(deps)))  # a kernel with no work at these degrees is never launched
            elif st.kind == "compute":
                block.append((name, COMP, tuple(sorted(set(deps))), ceil_int(sc.flops[i]), ceil_int(sc.model_flops[i]),
                              ceil_int(sc.mem_bytes[i]), st.matmul, None, 0, "", st.category, st.phase, inst.label,
                              max(1, round(sc.groups[i])), 0, 0, ceil_int(inst.costs.keys * st.key_share)))
                ids.append([row])
            elif (group := resolve_group(st.axes, degrees)) is None:
                ids.append(sorted(set(deps)))  # a collective over one rank is nothing
            elif st.kind in ("send", "recv"):
                # a step of the attention exchange's ring: its peer a cp coordinate away, its tag
                # the pair's number in the pass (made unique per pass when it is placed)
                block.append((name, SEND if st.kind == "send" else RECV, tuple(sorted(set(deps))), 0, 0, 0, "",
                              None, ceil_int(sc.comm_bytes[i]), group, group, st.phase, inst.label, 1, st.peer,
                              pair_base + st.pair, 0))
                pairs = max(pairs, pair_base + st.pair + 1)
                ids.append([row])
            else:
                block.append((name, COLL, tuple(sorted(set(deps))), 0, 0, 0, "", st.collective,
                              ceil_int(sc.comm_bytes[i]), group, group, st.phase, inst.label, 1, 0, 0, 0))
                ids.append([row])
            if st.prologue:
                last_prologue = ids[-1][0] if ids[-1] and ids[-1][0] >= 0 else last_prologue
        pieces.append(("rows", start, block))
        n = start + len(block)
        block_pair_base = pair_base
        pair_base = pairs
        prev_exit = [x for e in exits for x in ids[e]] or prev_exit
        computes = [start + k for k, r in enumerate(block) if r[1] == COMP]
        first_compute = computes[0] if computes else None
        block_last = computes[-1] if computes else None
        prev_first_compute = first_compute if first_compute is not None else prev_first_compute
        last_compute = block_last if block_last is not None else last_compute
        read = {d for r in block for d in r[2] if d >= start}
        sinks_here = [j for j in computes if j not in read]
        local_sinks += sinks_here
        blocks.append((inst.label, start, n))
        lasts.append(block_last)
        if prologue:
            segments = None       # the parameter prefetch chains blocks together
        elif segments is not None:
            segments.append(((*kind, phase, first), start, n, entry, (start, block)))
        if bi > 0 and not prologue:
            made = copies.setdefault((*kind, len(entry)), _BlockCopy(
                start, n, inst.label, bi, entry, block_pair_base, pairs, list(prev_exit), first_compute, block_last,
                sinks_here, block))
            if shared is not None:
                shared.setdefault((*kind, len(entry), phase, first, tp_overlap), made)
    exits = [e for e in prev_exit if e >= 0]
    if segments is not None and not tp_overlap and not _has_amax_reduction(insts, phase):
        # A row is read only inside its block or, if it is an exit, by the next block.
        entered = {d for seg in segments for d in seg[3] if d >= 0}
        sinks = sorted({j for j in local_sinks if j not in entered} | set(exits))
        return PassTemplate(pieces, n, exits, sinks, blocks, last_prologue, pairs, tuple(segments), last_compute)
    template = PassTemplate(pieces, n, exits, [], blocks, last_prologue, pairs)
    rows = template.rows
    _amax_reduction(rows, insts, phase, degrees)
    if tp_overlap and degrees.get("tp", 1) > 1:
        rows, first_row, last = _pipeline_tp(rows, degrees["tp"])
        exits = [last[e] for e in exits]
        last_prologue = last[last_prologue] if last_prologue is not None else None
        blocks = [(label, first_row[lo] if lo < len(first_row) else len(rows),
                   first_row[hi] if hi < len(first_row) else len(rows)) for label, lo, hi in blocks]
    used = {d for r in rows for d in r[2] if d >= 0}
    # The next pass starts after this one's compute is done and its result exists (the result
    # may come out of a collective, e.g. the loss all-reduce).
    sinks = sorted({i for i, r in enumerate(rows) if r[1] == COMP and i not in used} | set(exits))
    return PassTemplate.of_rows(rows, exits, sinks, blocks, last_prologue, pairs)


def two_batch(first: PassTemplate, second: PassTemplate) -> PassTemplate:
    """One pass of two micro-batches that share the rank (two-batch overlap, as DeepSeek's
    inference system and SGLang run it): the rows of both, each micro-batch's nodes waiting for
    their own predecessors and, like any pass, for the pass's input and the pass before, their
    kernels on the one compute stream and their collectives on the communication streams.

    The two take turns: each micro-batch's compute is cut into *stages* at its communication
    (stage k: the kernels that wait, at most, for its k-th collective), and the stages run
    first's 0, second's 0, first's 1, second's 1, …, so that while one micro-batch computes a
    stage, the other's collective (an all-to-all of the experts) is in flight. Their
    collectives are issued in the same alternating order (first's k-th, second's k-th, first's
    (k+1)-th, …), each after the one before: every rank issues the same sequence on its groups
    whatever the timing, so a simulator that runs one communication at a time per rank
    (ASTRA-sim) cannot deadlock on it."""
    ra, rb = first.rows, second.rows
    n = len(ra)

    def shifted(r: tuple, half: int, shift: int, tags: int) -> tuple:
        name, typ, deps, *rest = r
        deps = tuple(d + shift if d >= 0 else d for d in deps)
        row = (f"{name}.half{half}", typ, deps, *rest)
        if typ in (SEND, RECV):
            row = (*row[:15], row[15] + tags, *row[16:])
        return row

    rows = [shifted(r, 0, 0, 0) for r in ra] + [shifted(r, 1, n, first.pairs) for r in rb]
    extra: dict[int, set[int]] = {}

    def stages(lo: int, hi: int) -> tuple[list[int], list[list[int]]]:
        """(the communication rows, the compute rows of each stage) of the rows lo … hi - 1."""
        comm = [j for j in range(lo, hi) if rows[j][1] != COMP]
        order = {j: k for k, j in enumerate(comm)}
        level: dict[int, int] = {}
        out: list[list[int]] = [[] for _ in range(len(comm) + 1)]
        for j in range(lo, hi):
            deps = [d for d in rows[j][2] if d >= 0]
            if rows[j][1] == COMP:
                level[j] = max((order[d] + 1 if d in order else level.get(d, 0) for d in deps), default=0)
                out[level[j]].append(j)
        return comm, out

    comm_a, stages_a = stages(0, n)
    comm_b, stages_b = stages(n, len(rows))
    # the stages in turn: each waits for the last kernel of the stage before it (every kernel
    # of a stage ends before its last one starts: they share one stream, issued in id order)
    turns = [st for pair in zip(stages_a, stages_b) for st in pair]
    turns += stages_a[len(stages_b):] + stages_b[len(stages_a):]
    prev: int | None = None
    for st in (st for st in turns if st):
        if prev is not None:
            inside = set(st)
            for j in st:
                if not any(d in inside for d in rows[j][2]):
                    extra.setdefault(j, set()).add(prev)
        prev = max(st)
    # the collectives in turn, each after the one before
    k = min(len(comm_a), len(comm_b))
    issued = [j for pair in zip(comm_a, comm_b) for j in pair] + comm_a[k:] + comm_b[k:]
    for before, j in zip(issued, issued[1:]):
        extra.setdefault(j, set()).add(before)
    for j, more in extra.items():
        r = rows[j]
        rows[j] = (r[0], r[1], tuple(sorted(set(r[2]) | more)), *r[3:])
    blocks = first.blocks + [(label, lo + n, hi + n) for label, lo, hi in second.blocks]
    return PassTemplate.of_rows(rows, first.exits + [e + n for e in second.exits],
                                 first.sinks + [i + n for i in second.sinks], blocks, first.last_prologue,
                                 first.pairs + second.pairs)


def split_backward(t: PassTemplate) -> tuple[PassTemplate, PassTemplate]:
    """A backward pass template cut into its input-gradient pass (B: what the gradient handed to
    the stage before needs) and its weight-gradient pass (W: the rest,
    :func:`~stage_cosim.graph.autodiff.weight_grad_rows`), each in the backward's own order.
    Run back to back they are the backward. W reads what B produced only through the stage's
    memory (B is over by then), so its rows lose their dependencies on B's; a row left with
    none waits for the pass before it, as a pass's first rows do."""
    rows = t.rows
    deps = [r[2] for r in rows]
    roots = list(t.exits)
    weight = weight_grad_rows(deps, roots)
    # A ring exchange's send feeds nothing on its own rank (what needs it is the neighbour's
    # receive, of the same tag): it goes where its receive goes, with what it sends, or B
    # would wait for a message the neighbour's W has yet to send.
    while True:
        received = {rows[j][15] for j, r in enumerate(rows) if r[1] == RECV and not weight[j]}
        more = [j for j, r in enumerate(rows) if r[1] == SEND and weight[j] and r[15] in received]
        if not more:
            break
        roots += more
        weight = weight_grad_rows(deps, roots)
    new: list[int] = []             # old row -> its row in its own pass
    counts = [0, 0]
    for w in weight:
        new.append(counts[w])
        counts[w] += 1

    def part(w: bool) -> PassTemplate:
        out: list[tuple] = []
        for j, r in enumerate(rows):
            if weight[j] != w:
                continue
            deps = {new[d] for d in r[2] if d >= 0 and weight[d] == w}
            if w:       # the pass's input arrived for B; the previous pass is what W waits for
                deps |= {d for d in r[2] if d < 0 and d != ENTRY}
                if not any(d >= 0 for d in deps):
                    deps.add(CTRL)
            else:
                deps |= {d for d in r[2] if d < 0}
            out.append((r[0], r[1], tuple(sorted(deps)), *r[3:]))
        blocks = []
        for label, lo, hi in t.blocks:
            inside = [new[j] for j in range(lo, min(hi, len(rows))) if weight[j] == w]
            if inside:
                blocks.append((label, inside[0], inside[-1] + 1))
        exits = [new[e] for e in t.exits if weight[e] == w]
        prologue = new[t.last_prologue] if t.last_prologue is not None and weight[t.last_prologue] == w else None
        used = {d for r in out for d in r[2] if d >= 0}
        sinks = sorted({i for i, r in enumerate(out) if r[1] == COMP and i not in used} | set(exits))
        return PassTemplate.of_rows(out, exits, sinks, blocks, prologue, t.pairs)

    return part(False), part(True)


def _has_amax_reduction(insts: list[BlockInstance], phase: str) -> bool:  # noqa: ARG001 (both phases alike)
    """Whether :func:`_amax_reduction` adds rows to a pass over ``insts``."""
    precision = insts[0].compiled.sharded.policy.precision if insts else None
    return bool(precision is not None and precision.delayed and sum(i.compiled.sharded.fp8_modules for i in insts))


def _amax_reduction(rows: list[tuple], insts: list[BlockInstance], phase: str, degrees: dict[str, int]) -> None:
    """Delayed FP8 scaling: at the end of each forward and backward pass (where Transformer
    Engine leaves the autocast region of a model chunk, and in the backward of its first
    module) the amaxes of every FP8 tensor of the pass are max-reduced in one all-reduce over
    the tensor- and data-parallel group, and one fused kernel rolls the amax histories and
    computes the new scales. Both are synchronous: the next pass waits for them."""
    precision = insts[0].compiled.sharded.policy.precision if insts else None
    modules = sum(inst.compiled.sharded.fp8_modules for inst in insts)
    if precision is None or not precision.delayed or not modules or not rows:
        return
    per_module = AMAX_TENSORS_FWD if phase == "fwd" else AMAX_TENSORS_BWD
    entries = modules * per_module
    last = max(j for j, r in enumerate(rows) if r[1] == COMP)
    deps: tuple[int, ...] = (last,)
    group = resolve_group(mesh_axes(DENSE), degrees)
    if group is not None:
        rows.append((f"{phase}.fp8_amax_ar", COLL, deps, 0, 0, 0, "", Collective.ALL_REDUCE,
                     FP32_BYTES * entries, group, group, phase, "fp8", 1, 0, 0, 0))
        deps = (len(rows) - 1,)
    # reads the reduced amaxes and the histories, writes the rolled histories, scales, inverses
    nbytes = FP32_BYTES * entries * (2 * precision.amax_history_len + 3)
    rows.append((f"{phase}.fp8_scale_update", COMP, deps, entries * precision.amax_history_len, 0, nbytes, "",
                 None, 0, "", "amax", phase, "fp8", 1, 0, 0, 0))
