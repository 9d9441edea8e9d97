"""One pipeline stage's whole training step as a dependency graph of nodes (a *role* graph).

Every rank of a stage runs the same graph; only its communicator groups and pipeline peers
differ, so nodes name those symbolically (``group="tp"``, ``peer=+1``) and the trace writer
and the simulator resolve them per rank.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from stage_cosim.graph.ir import ATTENTION_KINDS  # noqa: F401  (the fused attention kernels' categories: re-exported)
from stage_cosim.graph.precision import AMAX_TENSORS_BWD, AMAX_TENSORS_FWD
from stage_cosim.parallel.axes import DENSE, group_name, mesh_axes, resolve_group
from stage_cosim.schedule.pipeline import Pass, schedule_order
from stage_cosim.sharding.placement import Collective

if TYPE_CHECKING:          # the compiled blocks (sympy) are only handed through here
    from stage_cosim.sharding.numeric import BlockCosts, CompiledBlock

COMP, COLL, SEND, RECV = "COMP", "COLL", "SEND", "RECV"

# Mixed-precision Adam: bf16 weights, fp32 main gradients, fp32 master weights + two moments.
# (FP8 parameters are stored in their own bytes per parameter: WeightSync.param_bytes.)
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12
# Adam reads grad, master, m, v (4 B each) and writes master, m, v (and the model's weight in
# its own precision: bf16, or FP8 parameters quantized from the master copy).
ADAM_STATE_BYTES_PER_PARAM = 16 + 12
ADAM_BYTES_PER_PARAM = ADAM_STATE_BYTES_PER_PARAM + WEIGHT_BYTES
ADAM_FLOPS_PER_PARAM = 12
FP32_BYTES = 4

EMBEDDING_GROUP = "embedding"   # first and last pipeline stage, for tied embeddings
PP_GROUP = "pp"
FIRST_FWD = "fwd_first"         # the template of a chunk's first forward, when it differs

# What a compute node runs on, for the GPU model: tensor-core GEMMs, fused (flash) attention
# kernels, or everything else at the vector rate. Written into traces as the ``op_kind``
# attribute, so that a simulator reading the traces back times each kernel as we do. Tensor-core
# kernels in another number format than BF16 carry it: "matmul_fp8", "attention_fp8",
# "matmul_mxfp8".
OP_KINDS = ("matmul", "attention", "vector")


def op_kind(category: str, matmul: bool | str) -> str:
    fmt = "" if matmul in (True, False, "", "bf16") else f"_{matmul}"
    if category in ATTENTION_KINDS:
        return "attention" + fmt
    return ("matmul" + fmt) if matmul else "vector"


def parse_op_kind(kind: str) -> tuple[str, str]:
    """(kernel class, matmul number format) of an ``op_kind`` ("matmul_fp8" -> matmul, fp8)."""
    base, _, fmt = kind.partition("_")
    return base, (fmt or "bf16") if base in ("matmul", "attention") else ""


class Node:
    """A node of a role graph. ``deps`` are data dependencies, ``ctrl`` schedule order."""

    __slots__ = ("id", "name", "type", "deps", "ctrl", "flops", "model_flops", "mem_bytes", "matmul",
                 "coll", "comm_bytes", "group", "peer", "tag", "phase", "micro_batch", "chunk",
                 "block", "category", "groups", "keys")

    def __init__(self, id: int, name: str, type: str, deps: list[int], *, ctrl: list[int] | None = None,
                 flops: int = 0, model_flops: int = 0, mem_bytes: int = 0, matmul: bool | str = False,
                 coll: Collective | None = None, comm_bytes: int = 0, group: str = "",
                 peer: int = 0, tag: int = 0, phase: str = "", micro_batch: int = -1,
                 chunk: int = 0, block: str = "", category: str = "", groups: int = 1, keys: int = 0) -> None:
        self.id = id
        self.name = name
        self.type = type
        self.deps = deps
        self.ctrl = ctrl or []
        self.flops = flops
        self.model_flops = model_flops
        self.mem_bytes = mem_bytes
        self.matmul = matmul
        self.coll = coll
        self.comm_bytes = comm_bytes
        self.group = group
        self.peer = peer
        self.tag = tag
        self.phase = phase
        self.micro_batch = micro_batch
        self.chunk = chunk
        self.block = block
        self.category = category
        self.groups = groups      # a grouped GEMM: its equal GEMMs (one per local expert)
        self.keys = keys           # fused attention: keys each query sees in this kernel

    def __repr__(self) -> str:
        return f"Node({self.id} {self.type} {self.name})"


@dataclass(frozen=True)
class RuntimeMemory:
    """What a rank's process holds beside its tensors, bytes (see :mod:`stage_cosim.hardware.runtime`):
    the CUDA context, cuBLAS workspaces, NCCL's buffers for the communicators it uses, and what
    the caching allocator loses to fragmentation. It depends on the GPU and where the rank's
    peers are, so a stage's memory has it only once a cluster is named."""

    cuda_context: int = 0
    cublas_workspace: int = 0
    nccl_buffers: int = 0
    fragmentation: int = 0

    @property
    def total(self) -> int:
        return self.cuda_context + self.cublas_workspace + self.nccl_buffers + self.fragmentation


@dataclass
class StageMemory:
    """Peak memory of one rank of a stage, bytes by category."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    workspace: int
    # weights + gradients + optimizer state of the transformer layers alone (what published
    # per-GPU figures usually count) and of the embedding / output layer.
    states_layers: int
    states_embedding_head: int
    # FP8: quantized weight copies kept across micro-batches; delayed scaling's amax histories
    fp8_weight_cache: int = 0
    fp8_amax_history: int = 0
    # An inference step: the KV cache of the step's requests (held from step to step).
    kv_cache: int = 0
    # The process's own memory on the GPU (zero until a cluster is named: Workload.memory).
    runtime: RuntimeMemory = field(default_factory=RuntimeMemory)

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.workspace
                + self.fp8_weight_cache + self.fp8_amax_history + self.kv_cache + self.runtime.total)

    def with_runtime(self, runtime: RuntimeMemory) -> "StageMemory":
        return replace(self, runtime=runtime)

    def to_dict(self) -> dict[str, int]:
        rt = self.runtime
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace,
                "fp8_weight_cache": self.fp8_weight_cache, "fp8_amax_history": self.fp8_amax_history,
                "kv_cache": self.kv_cache, "runtime": rt.total,
                "total": self.total, "model_states_layers": self.states_layers,
                "model_states_embedding_and_head": self.states_embedding_head,
                "runtime_cuda_context": rt.cuda_context, "runtime_cublas_workspace": rt.cublas_workspace,
                "runtime_nccl_buffers": rt.nccl_buffers, "runtime_fragmentation": rt.fragmentation}


@dataclass
class RoleGraph:
    """The graph of one pipeline stage (every rank of the stage runs it).

    The nodes of the passes are created on first use: a simulator that works from the pass
    templates (the fast path, and so every search) only reads the few nodes around them
    (pipeline sends and receives, parameter gathers, the step end) through ``node(i)``, and
    never pays for the millions of per-micro-batch copies. ``nodes`` creates them all.
    """

    stage: int
    _nodes: list["Node | None"]      # None: a node of a pass not created yet
    memory: StageMemory
    layers: tuple[int, ...]          # global layer indices held by this stage
    order: list[Pass] = field(default_factory=list)
    # How the graph was assembled, for simulators that exploit the repetition of passes:
    # the pass templates, where each pass was placed, and where the step-end nodes begin.
    templates: dict = field(default_factory=dict)
    passes: list["PlacedPass"] = field(default_factory=list)
    step_end_start: int = 0
    # passes whose nodes are not created yet, by first node id
    _deferred: dict[int, "_Deferred"] = field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> list[Node]:
        for d in list(self._deferred.values()):
            self._materialize(d)
        return self._nodes  # type: ignore[return-value]

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def node(self, i: int) -> Node:
        """Node ``i``, creating only the pass it belongs to if need be."""
        n = self._nodes[i]
        if n is None:
            k = bisect.bisect_right(self._bases, i) - 1
            self._materialize(self._deferred[self._bases[k]])
            n = self._nodes[i]
        return n  # type: ignore[return-value]

    @cached_property
    def _bases(self) -> list[int]:
        return sorted(self._deferred)

    def _materialize(self, d: "_Deferred") -> None:
        if self._deferred.pop(d.base, None) is not None:
            _place(self._nodes, d)

    def compute_totals(self) -> tuple[int, int, int]:
        """(executed FLOPs, model FLOPs, matmul FLOPs) of the compute nodes, without creating them."""
        executed = model = matmul = 0
        for n in filter(None, self._nodes):     # (the created nodes: most slots are None)
            if n.type == COMP:
                executed += n.flops
                model += n.model_flops
                matmul += n.flops if n.matmul else 0
        for d in self._deferred.values():
            e, m, mm = d.template.compute_totals
            executed, model, matmul = executed + e, model + m, matmul + mm
        return executed, model, matmul


@dataclass(frozen=True)
class PlacedPass:
    """A pass of the schedule as placed in a role graph."""

    spec: Pass
    template: tuple[int, str]        # key into RoleGraph.templates: (chunk, phase)
    base: int                        # id of its first template node
    recv: int                        # id of its pipeline receive, or -1
    send: int                        # id of its pipeline send, or -1
    param_deps: bool                 # the first forward of its chunk, waiting on parameter gathers


def _ceil(x: float) -> int:
    return int(math.ceil(x - 1e-9))


@dataclass
class _Instance:
    """A block placed on the stage: the embedding, layer ``index``, or the head."""

    kind: str
    index: int
    compiled: CompiledBlock
    costs: BlockCosts

    @property
    def label(self) -> str:
        return f"layer{self.index}" if self.kind == "layer" else self.kind


class _Builder:
    def __init__(self, degrees: dict[str, int]) -> None:
        self.nodes: list[Node | None] = []
        self.deferred: dict[int, _Deferred] = {}
        self.last_compute: int | None = None
        self.degrees = degrees

    def add(self, name: str, type: str, deps: list[int], **kw) -> int:
        nid = len(self.nodes)
        self.nodes.append(Node(nid, name, type, sorted(set(deps)), **kw))
        if type == COMP:
            self.last_compute = nid
        return nid

    def defer(self, t: "_PassTemplate", **placement) -> int:
        """Reserve the ids of a pass's nodes; they are created when first read. Returns the first id."""
        base = len(self.nodes)
        self.nodes.extend([None] * t.num_rows)
        self.deferred[base] = _Deferred(base, t, **placement)
        if t.last_compute is not None:
            self.last_compute = base + t.last_compute
        return base

    def add_collective(self, name: str, deps: list[int], axes: tuple[str, ...], **kw) -> list[int]:
        """A collective over the group spanning ``axes``; over a group of one rank it is
        nothing (its dependents wait on its inputs)."""
        group = resolve_group(axes, self.degrees)
        if group is None:
            return sorted(set(deps + kw.get("ctrl", [])))
        return [self.add(name, COLL, deps, group=group, category=group, **kw)]


# Markers in pass templates for dependencies that are only known when the pass is placed.
_ENTRY, _CHAIN, _CTRL = -1, -2, -3
_PARAMS = -10   # -10 - j: the parameter gather of the pass's j-th block (first forward only)


class _PassTemplate:
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
        # chained otherwise (see _pass_template).
        self.segments = segments
        self.last_compute = last_compute
        self._rows: list[tuple] | None = pieces[0][2] if len(pieces) == 1 and pieces[0][0] == "rows" else None

    @classmethod
    def of_rows(cls, rows: list[tuple], exits: list[int], sinks: list[int], blocks: list[tuple[str, int, int]],
                last_prologue: int | None, pairs: int = 0) -> "_PassTemplate":
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


@dataclass(frozen=True)
class _Deferred:
    """Where and how a pass is placed; its nodes are created from this on first use."""

    base: int
    template: _PassTemplate
    entry: list[int]
    chain: list[int]
    ctrl: list[int]
    micro_batch: int
    chunk: int
    params: dict[int, list[int]]
    tag_base: int = 0          # added to the template's send/recv tags


def _pipeline_tp(rows: list[tuple], k: int) -> tuple[list[tuple], list[int], list[int]]:
    """Megatron-Core's tensor-parallel communication overlap, as a graph rewrite: each
    tensor-parallel all-gather feeding a GEMM, and each reduce-scatter fed by one, is split with
    that GEMM into ``k`` chunks, chunk i of the GEMM waiting only for chunk i of the gather (and
    chunk i of the reduce-scatter only for chunk i of the GEMM), so transfer and compute overlap.

    Returns the new rows and, per old row, the first and last new row standing for it."""
    consumers: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        for d in r[2]:
            if d >= 0:
                consumers.setdefault(d, []).append(j)

    def gemm(j: int) -> bool:
        return rows[j][1] == COMP and rows[j][6]

    def tp_coll(j: int, kind: Collective) -> bool:
        return rows[j][1] == COLL and rows[j][9] == "tp" and rows[j][7] == kind

    split: set[int] = set()
    feeds: dict[int, list[int]] = {}     # gemm -> split all-gathers it reads
    fed_by: dict[int, int] = {}          # split reduce-scatter -> the gemm it reads
    for j in range(len(rows)):
        if tp_coll(j, Collective.ALL_GATHER):
            gemms = [c for c in consumers.get(j, []) if gemm(c)]
            if gemms:
                split.add(j)
                split.update(gemms)
                for g in gemms:
                    feeds.setdefault(g, []).append(j)
        elif tp_coll(j, Collective.REDUCE_SCATTER):
            producers = [d for d in rows[j][2] if d >= 0 and gemm(d)]
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

    def chunk(j: int, i: int) -> int:
        return first[j] + i if j in split else last[j]

    out: list[tuple] = []
    for j, r in enumerate(rows):
        name, typ, deps, flops, mflops, mem, matmul, coll, cbytes, group, cat, phase, label, groups, peer, tag, keys = r
        if j not in split:
            out.append((name, typ, tuple(sorted({d if d < 0 else last[d] for d in deps})), *r[3:]))
            continue
        for i in range(k):
            if typ == COMP:
                ds = {chunk(d, i) if d in feeds.get(j, ()) else (d if d < 0 else last[d]) for d in deps}
            elif j in fed_by:
                ds = {chunk(fed_by[j], i)} | ({d if d < 0 else last[d] for d in deps if d != fed_by[j]} if i == 0 else set())
            else:
                ds = {d if d < 0 else last[d] for d in deps} if i == 0 else set()
            if i > 0:
                ds.add(first[j] + i - 1)
            out.append((f"{name}#{i + 1}/{k}", typ, tuple(sorted(ds)), _ceil(flops / k), _ceil(mflops / k),
                        _ceil(mem / k), matmul, coll, _ceil(cbytes / k), group, cat, phase, label, groups, peer, tag,
                        keys))
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
    params_old, params_new = _PARAMS - m.index, _PARAMS - bi

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


def _pass_template(insts: list[_Instance], phase: str, degrees: dict[str, int],
                   tp_overlap: bool = False, first: bool = False,
                   shared: dict[tuple, _BlockCopy] | None = None) -> _PassTemplate:
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
    prev_exit: list[int] = [_ENTRY]
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
                    deps = [last_prologue] if last_prologue is not None else [_CHAIN]
                    if bi >= 2 and lasts[bi - 2] is not None:
                        deps.append(lasts[bi - 2])
                    elif bi == 1:
                        deps.append(_CTRL)
                else:
                    deps = list(prev_exit) + [_PARAMS - bi]
                if bi == 0:
                    deps.append(_CTRL)
            name = f"{inst.label}.{st.name}"
            row = start + len(block)
            if st.kind == "compute":
                block.append((name, COMP, tuple(sorted(set(deps))), _ceil(sc.flops[i]), _ceil(sc.model_flops[i]),
                              _ceil(sc.mem_bytes[i]), st.matmul, None, 0, "", st.category, st.phase, inst.label,
                              max(1, round(sc.groups[i])), 0, 0, _ceil(inst.costs.keys * st.key_share)))
                ids.append([row])
            elif (group := resolve_group(st.axes, degrees)) is None:
                ids.append(sorted(set(deps)))  # a collective over one rank is nothing
            elif st.kind in ("send", "recv"):
                # a step of the attention exchange's ring: its peer a cp coordinate away, its tag
                # the pair's number in the pass (made unique per pass when it is placed)
                block.append((name, SEND if st.kind == "send" else RECV, tuple(sorted(set(deps))), 0, 0, 0, "",
                              None, _ceil(sc.comm_bytes[i]), group, group, st.phase, inst.label, 1, st.peer,
                              pair_base + st.pair, 0))
                pairs = max(pairs, pair_base + st.pair + 1)
                ids.append([row])
            else:
                block.append((name, COLL, tuple(sorted(set(deps))), 0, 0, 0, "", st.collective,
                              _ceil(sc.comm_bytes[i]), group, group, st.phase, inst.label, 1, 0, 0, 0))
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
        return _PassTemplate(pieces, n, exits, sinks, blocks, last_prologue, pairs, tuple(segments), last_compute)
    template = _PassTemplate(pieces, n, exits, [], blocks, last_prologue, pairs)
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
    return _PassTemplate.of_rows(rows, exits, sinks, blocks, last_prologue, pairs)


def _two_batch(first: _PassTemplate, second: _PassTemplate) -> _PassTemplate:
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
    return _PassTemplate.of_rows(rows, first.exits + [e + n for e in second.exits],
                                 first.sinks + [i + n for i in second.sinks], blocks, first.last_prologue,
                                 first.pairs + second.pairs)


def _has_amax_reduction(insts: list[_Instance], phase: str) -> bool:  # noqa: ARG001 (both phases alike)
    """Whether :func:`_amax_reduction` adds rows to a pass over ``insts``."""
    precision = insts[0].compiled.sharded.policy.precision if insts else None
    return bool(precision is not None and precision.delayed and sum(i.compiled.sharded.fp8_modules for i in insts))


def _amax_reduction(rows: list[tuple], insts: list[_Instance], phase: str, degrees: dict[str, int]) -> None:
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


def amax_history_bytes(inst_modules: int, history_len: int) -> int:
    """Memory of delayed scaling's state: per FP8 module, for its three forward and two backward
    tensors, an fp32 amax history plus a scale and an inverse scale."""
    return FP32_BYTES * inst_modules * (AMAX_TENSORS_FWD + AMAX_TENSORS_BWD) * (history_len + 2)


def _place(nodes: list[Node | None], d: _Deferred) -> None:
    """Create a pass's nodes in their reserved slots. (The hot loop of synthesis.)"""
    base, entry, chain, ctrl, params = d.base, d.entry, d.chain, d.ctrl, d.params
    micro_batch, chunk, tag_base = d.micro_batch, d.chunk, d.tag_base
    new = Node.__new__
    for i, (name, typ, rel, flops, mflops, mem, matmul, coll, cbytes, group, cat, phase, label, groups, peer, tag,
            keys) in enumerate(d.template.rows):
        node_ctrl: list[int] = []
        if rel and rel[0] < 0:   # markers sort first
            deps = []
            for r in rel:
                if r >= 0:
                    deps.append(base + r)
                elif r == _ENTRY:
                    deps.extend(entry)
                elif r == _CHAIN:
                    deps.extend(chain)
                elif r == _CTRL:
                    node_ctrl = ctrl
                else:
                    deps.extend(params.get(_PARAMS - r, ()))
        else:
            deps = [base + r for r in rel]
        n = new(Node)
        n.id, n.name, n.type, n.deps, n.ctrl = base + i, name, typ, deps, node_ctrl
        n.flops, n.model_flops, n.mem_bytes, n.matmul = flops, mflops, mem, matmul
        n.coll, n.comm_bytes, n.group, n.peer, n.tag = coll, cbytes, group, peer, tag + tag_base if peer else 0
        n.phase, n.micro_batch, n.chunk, n.block, n.category = phase, micro_batch, chunk, label, cat
        n.groups, n.keys = groups, keys
        nodes[base + i] = n


@dataclass(frozen=True, eq=False)
class ModelBlocks:
    """The compiled blocks of a model with their numbers under one configuration: the
    embedding, every layer in order (layers may differ: a sliding-window layer binds the same
    block to other numbers, another kind of layer is another block), the head."""

    embedding: tuple[CompiledBlock, BlockCosts]
    layers: tuple[tuple[CompiledBlock, BlockCosts], ...]
    head: tuple[CompiledBlock, BlockCosts]


def _stage_layout(stage: int, pp: int, vp: int, layers_per_vstage: tuple[int, ...],
                  blocks: ModelBlocks) -> dict[int, list[_Instance]]:
    """The blocks of each model chunk held by ``stage``, in forward order."""
    nv = pp * vp
    starts = [sum(layers_per_vstage[:i]) for i in range(nv)]
    chunks: dict[int, list[_Instance]] = {}
    for c in range(vp):
        vs = c * pp + stage
        out = []
        if vs == 0:
            out.append(_Instance("embedding", -1, *blocks.embedding))
        out += [_Instance("layer", starts[vs] + i, *blocks.layers[starts[vs] + i])
                for i in range(layers_per_vstage[vs])]
        if vs == nv - 1:
            out.append(_Instance("head", -1, *blocks.head))
        chunks[c] = out
    return chunks


def _order(schedule: str, pp: int, stage: int, num_microbatches: int, vp: int, inference: bool) -> list[Pass]:
    """The stage's passes: the schedule's, or (an inference step) the forwards alone, in order."""
    order = schedule_order(schedule, pp, stage, num_microbatches, vp)
    return [p for p in order if p.phase == "fwd"] if inference else order


def stage_memory(stage: int, *, pp: int, vp: int, schedule: str, num_microbatches: int,
                 layers_per_vstage: tuple[int, ...], blocks: ModelBlocks, zero: int, tied_embeddings: bool,
                 degrees: dict[str, int], overlap_param_gather: bool = False,
                 tp_comm_overlap: bool = False, overlap_grad_reduce: bool = True, inference: bool = False,
                 overlapped: ModelBlocks | None = None, block_cache: dict | None = None) -> StageMemory:
    """Peak memory of a rank of ``stage``, without building its graph."""
    chunks = _stage_layout(stage, pp, vp, layers_per_vstage, blocks)
    order = _order(schedule, pp, stage, num_microbatches, vp, inference)
    instances = [inst for c in range(vp) for inst in chunks[c]]
    if inference:
        return _inference_memory(instances, num_microbatches, tied_embeddings,
                                 _overlapped_instances(stage, pp, vp, layers_per_vstage, overlapped))
    return _memory(instances, order, chunks, zero=zero, degrees=degrees, tied=tied_embeddings)


def _overlapped_instances(stage: int, pp: int, vp: int, layers_per_vstage: tuple[int, ...],
                          overlapped: ModelBlocks | None) -> list[_Instance]:
    """The blocks of the second micro-batch of each two-batch-overlapped pass (none without)."""
    if overlapped is None:
        return []
    chunks = _stage_layout(stage, pp, vp, layers_per_vstage, overlapped)
    return [inst for c in range(vp) for inst in chunks[c]]


def build_role(stage: int, *, pp: int, vp: int, schedule: str, num_microbatches: int,
               layers_per_vstage: tuple[int, ...], blocks: ModelBlocks, zero: int, tied_embeddings: bool,
               degrees: dict[str, int], overlap_param_gather: bool = False,
               tp_comm_overlap: bool = False, overlap_grad_reduce: bool = True, inference: bool = False,
               overlapped: ModelBlocks | None = None, block_cache: dict | None = None) -> RoleGraph:
    """The graph of one pipeline stage: its passes in schedule order, then (training) the
    step-end reductions and the optimizer. An inference step is its forward passes alone;
    with ``overlapped`` (two-batch overlap) each of its passes is two micro-batches at once,
    ``blocks`` bound to the first's shape and ``overlapped`` to the second's. ``block_cache``:
    blocks generated for the workload's other stages, copied here instead of generated again."""
    nv = pp * vp
    chunks = _stage_layout(stage, pp, vp, layers_per_vstage, blocks)
    order = _order(schedule, pp, stage, num_microbatches, vp, inference)
    phases = ("fwd",) if inference else ("fwd", "bwd")
    templates = {(c, ph): _pass_template(chunks[c] if ph == "fwd" else list(reversed(chunks[c])), ph, degrees,
                                         tp_comm_overlap, shared=block_cache)
                 for c in range(vp) for ph in phases}
    # the first forward of each chunk also casts the FP8 weights the other micro-batches reuse
    for c in range(vp):
        if any(st.first_microbatch for inst in chunks[c] for st in inst.compiled.sharded.fwd):
            templates[(c, FIRST_FWD)] = _pass_template(chunks[c], "fwd", degrees, tp_comm_overlap, first=True,
                                                       shared=block_cache)
    second = _stage_layout(stage, pp, vp, layers_per_vstage, overlapped) if overlapped is not None else None
    if second is not None:
        templates = {(c, ph): _two_batch(t, _pass_template(second[c], "fwd", degrees, tp_comm_overlap,
                                                           first=ph == FIRST_FWD))
                     for (c, ph), t in templates.items()}
    b = _Builder(degrees)
    last_bwd_nodes: dict[str, list[int]] = {}   # block instance -> its nodes in the last backward
    prev_sinks: list[int] = []
    chain: list[int] = []
    # every layer hands on the same activation (b, s, h): the first layer's says how large
    act_bytes = _ceil((blocks.layers[0][1] if blocks.layers else blocks.embedding[1]).boundary_bytes)
    if overlapped is not None:      # (both micro-batches of an overlapped pass go on together)
        act_bytes += _ceil((overlapped.layers[0][1] if overlapped.layers else overlapped.embedding[1]).boundary_bytes)
    gathered = zero in (1, 2) and overlap_param_gather
    # With the distributed optimizer's overlapped parameter gather, the updated parameters of
    # the previous step are all-gathered block by block ahead of each block's first forward.
    param_ag = _param_gathers(b, chunks, tied_embeddings, degrees) if gathered else {}
    first_fwd_done: set[int] = set()
    placed: list[PlacedPass] = []
    sends: list[int] = []
    # The attention exchange's sends and receives: every pass gets its own block of tags after
    # the pipeline's (a cp neighbour runs the same schedule, so its passes number alike).
    ring_tags = max((t.pairs for t in templates.values()), default=0)
    ring_base = 2 * num_microbatches * nv
    for k, p in enumerate(order):
        vs = p.chunk * pp + stage
        common = dict(micro_batch=p.micro_batch, chunk=p.chunk, phase=p.phase, category="pp", group=PP_GROUP,
                      comm_bytes=act_bytes)
        entry: list[int] = []
        if p.phase == "fwd" and vs > 0:
            entry = [b.add(f"recv_fwd.mb{p.micro_batch}.vs{vs}", RECV, [], peer=-1,
                           tag=_tag(p.micro_batch, vs - 1, nv, 0), **common)]
        if p.phase == "bwd" and vs < nv - 1:
            entry = [b.add(f"recv_bwd.mb{p.micro_batch}.vs{vs}", RECV, [], peer=+1,
                           tag=_tag(p.micro_batch, vs, nv, 1), **common)]
        key = (p.chunk, p.phase)
        params: dict[int, list[int]] = {}
        if p.phase == "fwd" and p.chunk not in first_fwd_done:
            first_fwd_done.add(p.chunk)
            params = {j: param_ag.get(inst.label, []) for j, inst in enumerate(chunks[p.chunk])}
            if (p.chunk, FIRST_FWD) in templates:
                key = (p.chunk, FIRST_FWD)
        t = templates[key]
        base = b.defer(t, entry=entry, chain=chain, ctrl=prev_sinks, micro_batch=p.micro_batch, chunk=p.chunk,
                       params=params, tag_base=ring_base + k * ring_tags)
        if t.last_prologue is not None:
            chain = [base + t.last_prologue]
        exits = [base + e for e in t.exits] or entry
        if p.phase == "bwd":
            for label, lo, hi in t.blocks:
                last_bwd_nodes[label] = list(range(base + lo, base + hi))
        send = -1
        if p.phase == "fwd" and vs < nv - 1:
            send = b.add(f"send_fwd.mb{p.micro_batch}.vs{vs}", SEND, exits, peer=+1,
                         tag=_tag(p.micro_batch, vs, nv, 0), **common)
        if p.phase == "bwd" and vs > 0:
            send = b.add(f"send_bwd.mb{p.micro_batch}.vs{vs}", SEND, exits, peer=-1,
                         tag=_tag(p.micro_batch, vs - 1, nv, 1), **common)
        if send >= 0:
            sends.append(send)
        placed.append(PlacedPass(p, key, base, entry[0] if entry else -1, send, bool(params)))
        prev_sinks = [base + i for i in t.sinks] or prev_sinks

    instances = [inst for c in range(vp) for inst in chunks[c]]
    step_end_start = len(b.nodes)
    if inference:
        memory = _inference_memory(instances, num_microbatches, tied_embeddings,
                                   [inst for c in range(vp) for inst in second[c]] if second is not None else [])
    else:
        _step_end(b, instances, last_bwd_nodes, stage=stage, pp=pp, zero=zero, tied=tied_embeddings,
                  degrees=degrees, gather_after_update=not gathered, flush=prev_sinks + sends,
                  overlap_grad_reduce=overlap_grad_reduce)
        memory = _memory(instances, order, chunks, zero=zero, degrees=degrees, tied=tied_embeddings)
    layers = tuple(inst.index for inst in instances if inst.kind == "layer")
    return RoleGraph(stage, b.nodes, memory, layers, order, templates, placed, step_end_start, b.deferred)


def _tag(micro_batch: int, vs: int, nv: int, direction: int) -> int:
    """Unique per (micro-batch, pipeline boundary after virtual stage ``vs``, direction)."""
    return (micro_batch * nv + vs) * 2 + direction


def _unique_weights(instances: list[_Instance], tied: bool):
    """(instance, weight index) pairs, counting a tied table once when both ends are here."""
    has_embedding = any(i.kind == "embedding" for i in instances)
    for inst in instances:
        for j, ws in enumerate(inst.compiled.sharded.weight_syncs):
            if tied and has_embedding and inst.kind == "head" and ws.weight.name == "word_embedding":
                continue
            yield inst, j


def _replicas(degrees: dict[str, int], axes: tuple[str, ...]) -> int:
    """How many ranks hold a replica of a weight (the size of its data-parallel group)."""
    return math.prod(degrees[a] for a in axes)


def _block_params(instances: list[_Instance], tied: bool, as_bytes: bool = False
                  ) -> dict[tuple[str, tuple[str, ...]], float]:
    """Parameters per rank of each block (or their bytes as stored: bf16, or FP8 parameters),
    by the data-parallel axes that replicate them."""
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for inst, j in _unique_weights(instances, tied):
        ws = inst.compiled.sharded.weight_syncs[j]
        key = (inst.label, ws.replicas)
        out[key] = out.get(key, 0.0) + inst.costs.weight_params[j] * (ws.param_bytes if as_bytes else 1)
    return out


def _param_gathers(b: "_Builder", chunks: dict[int, list[_Instance]], tied: bool,
                   degrees: dict[str, int]) -> dict[str, list[int]]:
    """Step-start all-gathers of each block's updated parameter shard (ZeRO 1/2, overlapped)."""
    instances = [inst for c in sorted(chunks) for inst in chunks[c]]
    out: dict[str, list[int]] = {}
    for (label, axes), nbytes in _block_params(instances, tied, as_bytes=True).items():
        if nbytes > 0:
            group = resolve_group(axes, degrees) or group_name(axes)
            out.setdefault(label, []).extend(b.add_collective(
                f"{label}.param_ag_{group}", [], axes, coll=Collective.ALL_GATHER,
                comm_bytes=_ceil(nbytes / _replicas(degrees, axes)), phase="step", block=label))
    return out


def _step_end(b: _Builder, instances: list[_Instance], last_bwd: dict[str, list[int]], *, stage: int,
              pp: int, zero: int, tied: bool, degrees: dict[str, int], gather_after_update: bool = True,
              flush: list[int] | None = None, overlap_grad_reduce: bool = True) -> None:
    """Once per step: gradient reductions per block (bucketed), the optimizer, parameter gathers.

    ``flush`` are the nodes that end the stage's pipeline schedule (the last pass's sinks and
    every pipeline send): the tied-embedding gradient all-reduce waits for them, as Megatron
    reduces the embedding group's gradients only after the schedule has drained. Without
    ``overlap_grad_reduce`` every gradient reduction waits for them too (Megatron's default:
    one reduction after the backward of the whole step).
    """
    syncs: list[int] = []
    per_block: dict[str, dict[tuple[tuple[str, ...], Collective], float]] = {}
    params_of = _block_params(instances, tied)
    bytes_of = _block_params(instances, tied, as_bytes=True)
    tied_bytes: dict[str, float] = {}
    for inst, j in _unique_weights(instances, tied):
        ws = inst.compiled.sharded.weight_syncs[j]
        if tied and pp > 1 and ws.weight.name == "word_embedding":
            tied_bytes[inst.label] = inst.costs.weight_params[j] * GRAD_BYTES
        buckets = per_block.setdefault(inst.label, {})
        for (axes, coll, _), nbytes in zip(ws.grad_collectives, inst.costs.weight_sync_bytes[j]):
            buckets[(axes, coll)] = buckets.get((axes, coll), 0.0) + nbytes
    for inst in instances:
        deps = last_bwd.get(inst.label, []) + ([] if overlap_grad_reduce else list(flush or []))
        if inst.label in tied_bytes:
            # Tied embeddings on two stages: sum the two copies' gradients first (Megatron's
            # embedding group), then reduce over dp like any other gradient. The group spans the
            # first and the last stage, so it starts only when this stage's schedule is done:
            # issued earlier on the last stage, it would hold that rank's communication (one
            # operation at a time in ASTRA-sim) while the first stage still waits for its last
            # backward send, and the pipeline would never drain.
            nid = b.add(f"{inst.label}.tied_grad_ar", COLL, list(dict.fromkeys(deps + list(flush or []))),
                        coll=Collective.ALL_REDUCE,
                        comm_bytes=_ceil(tied_bytes[inst.label]), group=EMBEDDING_GROUP,
                        phase="step", block=inst.label, category=EMBEDDING_GROUP)
            deps = [nid]
            syncs.append(nid)
        for (axes, coll), nbytes in per_block.get(inst.label, {}).items():
            if nbytes <= 0:
                continue
            group = resolve_group(axes, degrees) or group_name(axes)
            syncs += b.add_collective(f"{inst.label}.grad_{coll.short.lower()}_{group}", deps, axes, coll=coll,
                                      comm_bytes=_ceil(nbytes), phase="step", block=inst.label)
    last_compute = [b.last_compute] if b.last_compute is not None else []
    for inst in instances:
        groups = {axes: params for (label, axes), params in params_of.items() if label == inst.label}
        if sum(groups.values()) <= 0:
            continue
        # ZeRO 1-3: each rank updates its shard of the block's parameters over each group.
        def shard(v: float, axes: tuple[str, ...]) -> float:
            return v / _replicas(degrees, axes) if zero >= 1 else v

        local = {axes: shard(params, axes) for axes, params in groups.items()}
        local_bytes = {axes: shard(bytes_of[(inst.label, axes)], axes) for axes in groups}
        total = sum(local.values())
        # The optimizer runs after every gradient of the step is reduced (as frameworks do,
        # for gradient clipping), one kernel per block.
        # (and after the block's own gradients are complete: ZeRO-3 reduces them in the backward)
        opt = b.add(f"{inst.label}.optimizer", COMP, syncs + last_compute + last_bwd.get(inst.label, []),
                    flops=_ceil(total * ADAM_FLOPS_PER_PARAM),
                    mem_bytes=_ceil(total * ADAM_STATE_BYTES_PER_PARAM + sum(local_bytes.values())),
                    phase="step", block=inst.label, category="optimizer")
        last_compute = [opt]
        if zero in (1, 2) and gather_after_update:
            for axes, nbytes in local_bytes.items():
                group = resolve_group(axes, degrees) or group_name(axes)
                b.add_collective(f"{inst.label}.param_ag_{group}", [opt], axes, coll=Collective.ALL_GATHER,
                                 comm_bytes=_ceil(nbytes), phase="step", block=inst.label)


def _memory(instances: list[_Instance], order: list[Pass], chunks: dict[int, list[_Instance]], *,
            zero: int, degrees: dict[str, int], tied: bool) -> StageMemory:
    """Peak memory of a rank: model states (ZeRO divides each weight's over its own
    data-parallel group), activations held under the schedule, workspace."""
    from stage_cosim.schedule.pipeline import peak_in_flight

    layer_params: dict[tuple[str, ...], float] = {}
    other_params: dict[tuple[str, ...], float] = {}
    stored: dict[tuple[str, ...], float] = {}            # bytes of the weights as stored
    layer_stored: dict[tuple[str, ...], float] = {}
    for inst, j in _unique_weights(instances, tied):
        into = layer_params if inst.kind == "layer" else other_params
        ws = inst.compiled.sharded.weight_syncs[j]
        into[ws.replicas] = into.get(ws.replicas, 0.0) + inst.costs.weight_params[j]
        nbytes = inst.costs.weight_params[j] * ws.param_bytes
        stored[ws.replicas] = stored.get(ws.replicas, 0.0) + nbytes
        if inst.kind == "layer":
            layer_stored[ws.replicas] = layer_stored.get(ws.replicas, 0.0) + nbytes

    def divisor(dp: int, from_stage: int) -> int:
        return dp if zero >= from_stage else 1

    def total(params: dict[tuple[str, ...], float], nbytes: int, from_stage: int) -> float:
        """Bytes of one kind of model state: ZeRO stage ``from_stage`` on shards it."""
        return sum(n * nbytes / divisor(_replicas(degrees, axes), from_stage) for axes, n in params.items())

    def states(params: dict[tuple[str, ...], float], weight_bytes: dict[tuple[str, ...], float]) -> float:
        out = 0.0
        for axes, n in params.items():
            dp = _replicas(degrees, axes)
            out += (weight_bytes.get(axes, 0.0) / divisor(dp, 3)
                    + n * (GRAD_BYTES / divisor(dp, 2) + OPTIMIZER_BYTES / divisor(dp, 1)))
        return out

    other_stored = {axes: v - layer_stored.get(axes, 0.0) for axes, v in stored.items()}

    params = {axes: layer_params.get(axes, 0.0) + other_params.get(axes, 0.0)
              for axes in dict.fromkeys([*layer_params, *other_params])}
    saved = {c: sum(i.costs.saved_bytes for i in insts) for c, insts in chunks.items()}
    activations = peak_in_flight(order, saved)
    workspace = max((i.costs.workspace_bytes + i.costs.exchange_bytes for i in instances), default=0.0)
    if zero >= 3:
        # The gathered weights of the block in use and of the one being prefetched.
        biggest = max((sum(n * ws.param_bytes for n, ws in zip(i.costs.weight_params, i.compiled.sharded.weight_syncs))
                       for i in instances), default=0.0)
        workspace += 2 * biggest
    # FP8: the quantized weights kept from the first micro-batch on, and delayed scaling's state
    cache = sum(i.costs.cached_bytes for i in instances)
    history = sum(amax_history_bytes(i.compiled.sharded.fp8_modules, i.compiled.sharded.policy.precision.amax_history_len)
                  for i in instances if i.compiled.sharded.policy.precision.delayed)
    return StageMemory(
        weights=_ceil(sum(v / divisor(_replicas(degrees, axes), 3) for axes, v in stored.items())),
        gradients=_ceil(total(params, GRAD_BYTES, 2)),
        optimizer=_ceil(total(params, OPTIMIZER_BYTES, 1)), activations=_ceil(activations),
        workspace=_ceil(workspace), states_layers=_ceil(states(layer_params, layer_stored)),
        states_embedding_head=_ceil(states(other_params, other_stored)),
        fp8_weight_cache=_ceil(cache), fp8_amax_history=_ceil(history))


def _inference_memory(instances: list[_Instance], num_microbatches: int, tied: bool,
                      overlapped: list[_Instance] | None = None) -> StageMemory:
    """Memory of a rank in an inference step: the weights (no gradients, no optimizer, no
    activations held for a backward), the KV cache of every micro-batch's requests, and the
    largest forward working set of one block (with two-batch overlap, ``overlapped`` are the
    second micro-batch's blocks: its cache too, and both working sets at once)."""
    layer = other = 0.0
    for inst, j in _unique_weights(instances, tied):
        ws = inst.compiled.sharded.weight_syncs[j]
        nbytes = inst.costs.weight_params[j] * ws.param_bytes   # as the weights are stored
        if inst.kind == "layer":
            layer += nbytes
        else:
            other += nbytes
    kv = sum(i.costs.cache_bytes for i in [*instances, *(overlapped or ())]) * num_microbatches
    # (with the attention exchange's buffers: context parallelism's ring or gathered keys)
    workspace = sum(max((i.costs.workspace_bytes + i.costs.exchange_bytes for i in insts), default=0.0)
                    for insts in (instances, overlapped) if insts)
    return StageMemory(weights=_ceil(layer + other), gradients=0, optimizer=0, activations=0,
                       workspace=_ceil(workspace), states_layers=_ceil(layer), states_embedding_head=_ceil(other),
                       kv_cache=_ceil(kv))
