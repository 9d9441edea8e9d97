"""The data model of a stage's step: the role graph of one pipeline stage (compute kernels,
collectives, pipeline sends and receives, their dependencies), the encoding of a compute node's
kernel class (``op_kind``), and the creation of a pass's nodes from its template on first use.
Every rank of a stage runs the same graph; only its communicator groups and pipeline peers
differ, so nodes name those symbolically (``group="tp"``, ``peer=+1``) and the trace writer and
the simulators resolve them per rank.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Hashable, Iterator

from stage_cosim.graph.ir import ATTENTION_KINDS
from stage_cosim.schedule.pipeline import Pass
from stage_cosim.sharding.placement import Collective

if TYPE_CHECKING:          # (annotations only: nothing here imports the modules built on it)
    from stage_cosim.schedule.memory import StageMemory
    from stage_cosim.schedule.templates import PassTemplate
    from stage_cosim.sharding.numeric import BlockCosts, CompiledBlock

COMP, COLL, SEND, RECV = "COMP", "COLL", "SEND", "RECV"

EMBEDDING_GROUP = "embedding"   # first and last pipeline stage, for tied embeddings
MIRROR_GROUP = "mirror"         # pipeline positions i and pp-1-i: DualPipe's two copies of a layer
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
    _deferred: dict[int, "DeferredPass"] = field(default_factory=dict, repr=False)

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

    def _materialize(self, d: "DeferredPass") -> None:
        if self._deferred.pop(d.base, None) is not None:
            place_deferred(self._nodes, d)

    def replay_rows(self) -> Iterator[tuple]:
        """Every node in id order as (type, its dependencies then its schedule order, FLOPs,
        memory bytes, matmul, category, groups, keys, collective, communication bytes, group,
        peer, tag) — what a replay reads of it — without creating the nodes of passes not
        created yet (:func:`deferred_rows`)."""
        nodes, deferred = self._nodes, self._deferred
        i, n = 0, len(nodes)
        while i < n:
            node = nodes[i]
            if node is None:        # the first node of a pass not created yet
                d = deferred[i]
                yield from deferred_rows(d)
                i += d.template.num_rows
                continue
            yield (node.type, node.deps + node.ctrl if node.ctrl else node.deps, node.flops, node.mem_bytes,
                   node.matmul, node.category, node.groups, node.keys, node.coll, node.comm_bytes, node.group,
                   node.peer, node.tag)
            i += 1

    def layout_key(self, template_key: Callable[["PassTemplate"], Hashable]) -> tuple:
        """What the graph is, names aside: every created node's content and dependencies, where
        each pass not created yet goes and what it places (``template_key(t)`` says what
        template ``t`` holds), the placed passes, where the step end begins. Graphs with equal
        keys differ at most in their nodes' names, phases, micro-batch and chunk numbers and
        block labels (and model FLOPs): what a simulator times is the same."""
        created = tuple((n.id, n.type, tuple(n.deps), tuple(n.ctrl), n.flops, n.mem_bytes, n.matmul, n.coll,
                         n.comm_bytes, n.group, n.category, n.groups, n.peer, n.tag, n.keys)
                        for n in self._nodes if n is not None)
        deferred = tuple((d.base, template_key(d.template), tuple(d.entry), tuple(d.chain), tuple(d.ctrl),
                          tuple(sorted((j, tuple(v)) for j, v in d.params.items())), d.tag_base)
                         for _, d in sorted(self._deferred.items()))
        passes = tuple((template_key(self.templates[p.template]), p.base, p.recv, p.send, p.param_deps)
                       for p in self.passes)
        return len(self._nodes), self.step_end_start, created, deferred, passes

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


def ceil_int(x: float) -> int:
    return int(math.ceil(x - 1e-9))


@dataclass
class BlockInstance:
    """A block placed on the stage: the embedding, layer ``index``, or the head."""

    kind: str
    index: int
    compiled: CompiledBlock
    costs: BlockCosts

    @property
    def label(self) -> str:
        return f"layer{self.index}" if self.kind == "layer" else self.kind


# Markers in pass templates for dependencies that are only known when the pass is placed.
ENTRY, CHAIN, CTRL = -1, -2, -3
PARAMS = -10   # -10 - j: the parameter gather of the pass's j-th block (first forward only)


@dataclass(frozen=True)
class DeferredPass:
    """Where and how a pass is placed; its nodes are created from this on first use."""

    base: int
    template: PassTemplate
    entry: list[int]
    chain: list[int]
    ctrl: list[int]
    micro_batch: int
    chunk: int
    params: dict[int, list[int]]
    tag_base: int = 0          # added to the template's send/recv tags


def _marked_deps(rel: tuple, base: int, entry: list[int], chain: list[int], ctrl: list[int],
                 params: dict) -> tuple[list[int], list[int]]:
    """A template row's dependencies when it names markers (the pass's entry, its chain, its
    control edges, a parameter's producers) besides rows of its own pass: (deps, control deps)."""
    deps: list[int] = []
    node_ctrl: list[int] = []
    for r in rel:
        if r >= 0:
            deps.append(base + r)
        elif r == ENTRY:
            deps.extend(entry)
        elif r == CHAIN:
            deps.extend(chain)
        elif r == CTRL:
            node_ctrl = ctrl
        else:
            deps.extend(params.get(PARAMS - r, ()))
    return deps, node_ctrl


def place_deferred(nodes: list[Node | None], d: DeferredPass) -> None:
    """Create a pass's nodes in their reserved slots. (The hot loop of synthesis.)"""
    base, entry, chain, ctrl, params = d.base, d.entry, d.chain, d.ctrl, d.params
    micro_batch, chunk, tag_base = d.micro_batch, d.chunk, d.tag_base
    new = Node.__new__
    for i, (name, typ, rel, flops, mflops, mem, matmul, coll, cbytes, group, cat, phase, label, groups, peer, tag,
            keys) in enumerate(d.template.rows):
        node_ctrl: list[int] = []
        if rel and rel[0] < 0:   # markers sort first
            deps, node_ctrl = _marked_deps(rel, base, entry, chain, ctrl, params)
        else:
            deps = [base + r for r in rel]
        n = new(Node)
        n.id, n.name, n.type, n.deps, n.ctrl = base + i, name, typ, deps, node_ctrl
        n.flops, n.model_flops, n.mem_bytes, n.matmul = flops, mflops, mem, matmul
        n.coll, n.comm_bytes, n.group, n.peer, n.tag = coll, cbytes, group, peer, tag + tag_base if peer else 0
        n.phase, n.micro_batch, n.chunk, n.block, n.category = phase, micro_batch, chunk, label, cat
        n.groups, n.keys = groups, keys
        nodes[base + i] = n


def deferred_rows(d: DeferredPass) -> Iterator[tuple]:
    """:meth:`RoleGraph.replay_rows` of a pass not created yet: what :func:`place_deferred`
    would make of each row, without the node."""
    base, entry, chain, ctrl, params, tag_base = d.base, d.entry, d.chain, d.ctrl, d.params, d.tag_base
    for (_, typ, rel, flops, _, mem, matmul, coll, cbytes, group, cat, _, _, groups, peer, tag,
         keys) in d.template.rows:
        node_ctrl: list[int] = []
        if rel and rel[0] < 0:   # markers sort first
            deps, node_ctrl = _marked_deps(rel, base, entry, chain, ctrl, params)
        else:
            deps = [base + r for r in rel]
        yield (typ, deps + node_ctrl if node_ctrl else deps, flops, mem, matmul, cat, groups, keys, coll, cbytes,
               group, peer, tag + tag_base if peer else 0)
