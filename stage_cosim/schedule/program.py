"""Building one pipeline stage's role graph (:class:`~stage_cosim.schedule.nodes.RoleGraph`): the
blocks of each model chunk the stage holds, its passes placed from their templates in schedule
order with the pipeline sends and receives between them, then (training) the step-end gradient
reductions, the optimizer and the parameter gathers; and the stage's peak memory without the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stage_cosim.parallel.axes import group_name, resolve_group
from stage_cosim.schedule.memory import (
    ADAM_FLOPS_PER_PARAM, ADAM_STATE_BYTES_PER_PARAM, GRAD_BYTES, StageMemory, block_params, inference_memory,
    training_memory, replicas, unique_weights,
)
from stage_cosim.schedule.nodes import (
    COLL, COMP, EMBEDDING_GROUP, FIRST_FWD, MIRROR_GROUP, PP_GROUP, RECV, SEND, Node, PlacedPass, RoleGraph, ceil_int,
    DeferredPass, BlockInstance,
)
from stage_cosim.schedule.pipeline import BACKWARD, Layout, Pass, schedule_order
from stage_cosim.schedule.template_cache import (
    cached_pass_template as pass_template, cached_split_backward as split_backward, cached_two_batch as two_batch,
)
from stage_cosim.schedule.templates import PassTemplate
from stage_cosim.sharding.placement import Collective

if TYPE_CHECKING:          # the compiled blocks (sympy) are only handed through here
    from stage_cosim.sharding.numeric import BlockCosts, CompiledBlock


FB = "fb"              # the template key of an F&B pass: (FB, forward chunk, backward chunk)
EMPTY = ("empty",)     # a pass of no nodes: holds an F&B's second receive or send


class _Builder:
    def __init__(self, degrees: dict[str, int]) -> None:
        self.nodes: list[Node | None] = []
        self.deferred: dict[int, DeferredPass] = {}
        self.last_compute: int | None = None
        self.degrees = degrees

    def add(self, name: str, type: str, deps: list[int], **kw) -> int:
        nid = len(self.nodes)
        self.nodes.append(Node(nid, name, type, sorted(set(deps)), **kw))
        if type == COMP:
            self.last_compute = nid
        return nid

    def defer(self, t: "PassTemplate", **placement) -> int:
        """Reserve the ids of a pass's nodes; they are created when first read. Returns the first id."""
        base = len(self.nodes)
        self.nodes.extend([None] * t.num_rows)
        self.deferred[base] = DeferredPass(base, t, **placement)
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


@dataclass(frozen=True, eq=False)
class ModelBlocks:
    """The compiled blocks of a model with their numbers under one configuration: the
    embedding, every layer in order (layers may differ: a sliding-window layer binds the same
    block to other numbers, another kind of layer is another block), the head."""

    embedding: tuple[CompiledBlock, BlockCosts]
    layers: tuple[tuple[CompiledBlock, BlockCosts], ...]
    head: tuple[CompiledBlock, BlockCosts]


def _stage_layout(stage: int, pp: int, vp: int, layers_per_vstage: tuple[int, ...],
                  blocks: ModelBlocks, schedule: str = "1f1b") -> dict[int, list[BlockInstance]]:
    """The blocks of each model chunk held by ``stage``, in forward order (where each chunk
    lies: :class:`~stage_cosim.schedule.pipeline.Layout`; DualPipe's two chunks are stages of
    two copies of the model, each split as ``layers_per_vstage`` says)."""
    layout = Layout(schedule, pp, vp)
    nv = layout.nv
    starts = [sum(layers_per_vstage[:i]) for i in range(nv)]
    chunks: dict[int, list[BlockInstance]] = {}
    for c in range(layout.chunks):
        _, vs = layout.place(stage, c)
        out = []
        if vs == 0:
            out.append(BlockInstance("embedding", -1, *blocks.embedding))
        out += [BlockInstance("layer", starts[vs] + i, *blocks.layers[starts[vs] + i])
                for i in range(layers_per_vstage[vs])]
        if vs == nv - 1:
            out.append(BlockInstance("head", -1, *blocks.head))
        chunks[c] = out
    return chunks


def _order(schedule: str, pp: int, stage: int, num_microbatches: int, vp: int, inference: bool) -> list[Pass]:
    """The stage's passes: the schedule's, or (an inference step) the forwards alone, in order."""
    order = schedule_order(schedule, pp, stage, num_microbatches, vp)
    return [replace(p, paired=False) for p in order if p.phase == "fwd"] if inference else order


def stage_memory(stage: int, *, pp: int, vp: int, schedule: str, num_microbatches: int,
                 layers_per_vstage: tuple[int, ...], blocks: ModelBlocks, zero: int, tied_embeddings: bool,
                 degrees: dict[str, int], overlap_param_gather: bool = False,
                 tp_comm_overlap: bool = False, overlap_grad_reduce: bool = True, inference: bool = False,
                 overlapped: ModelBlocks | None = None, block_cache: dict | None = None) -> StageMemory:
    """Peak memory of a rank of ``stage``, without building its graph."""
    chunks = _stage_layout(stage, pp, vp, layers_per_vstage, blocks, schedule)
    order = _order(schedule, pp, stage, num_microbatches, vp, inference)
    instances = [inst for c in sorted(chunks) for inst in chunks[c]]
    if inference:
        return inference_memory(instances, num_microbatches, tied_embeddings,
                                 _overlapped_instances(stage, pp, vp, layers_per_vstage, overlapped, schedule))
    return training_memory(instances, order, chunks, zero=zero, degrees=degrees, tied=tied_embeddings)


def _overlapped_instances(stage: int, pp: int, vp: int, layers_per_vstage: tuple[int, ...],
                          overlapped: ModelBlocks | None, schedule: str = "1f1b") -> list[BlockInstance]:
    """The blocks of the second micro-batch of each two-batch-overlapped pass (none without)."""
    if overlapped is None:
        return []
    chunks = _stage_layout(stage, pp, vp, layers_per_vstage, overlapped, schedule)
    return [inst for c in sorted(chunks) for inst in chunks[c]]


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
    layout = Layout(schedule, pp, vp)
    nv = layout.nv
    chunks = _stage_layout(stage, pp, vp, layers_per_vstage, blocks, schedule)
    order = _order(schedule, pp, stage, num_microbatches, vp, inference)
    phases = ("fwd",) if inference else ("fwd", "bwd")
    templates: dict = {(c, ph): pass_template(chunks[c] if ph == "fwd" else list(reversed(chunks[c])), ph, degrees,
                                               tp_comm_overlap, shared=block_cache)
                       for c in chunks for ph in phases}
    # the zero-bubble split of each backward: input gradients (B), then weight gradients (W)
    if any(p.phase in ("bwd_input", "bwd_weight") for p in order):
        for c in chunks:
            templates[(c, "bwd_input")], templates[(c, "bwd_weight")] = split_backward(templates[(c, "bwd")])
    # the first forward of each chunk also casts the FP8 weights the other micro-batches reuse
    for c in chunks:
        if any(st.first_microbatch for inst in chunks[c] for st in inst.compiled.sharded.fwd):
            templates[(c, FIRST_FWD)] = pass_template(chunks[c], "fwd", degrees, tp_comm_overlap, first=True,
                                                       shared=block_cache)
    second = _stage_layout(stage, pp, vp, layers_per_vstage, overlapped, schedule) if overlapped is not None else None
    if second is not None:
        templates = {(c, ph): two_batch(t, pass_template(second[c], "fwd", degrees, tp_comm_overlap,
                                                           first=ph == FIRST_FWD))
                     for (c, ph), t in templates.items()}
    # DualPipe's F&B: a forward and another micro-batch's backward as one pass, taking turns at
    # their communication as two-batch overlap does
    for p, q in zip(order, order[1:]):
        if p.paired and (FB, p.chunk, q.chunk) not in templates:
            templates[(FB, p.chunk, q.chunk)] = two_batch(templates[(p.chunk, "fwd")], templates[(q.chunk, "bwd")])
    b = _Builder(degrees)
    last_b: dict[str, list[int]] = {}   # block instance -> its nodes in the last input-gradient pass
    last_w: dict[str, list[int]] = {}   # … and in the last weight-gradient pass
    prev_sinks: list[int] = []
    chain: list[int] = []
    # every layer hands on the same activation (b, s, h): the first layer's says how large
    act_bytes = ceil_int((blocks.layers[0][1] if blocks.layers else blocks.embedding[1]).boundary_bytes)
    if overlapped is not None:      # (both micro-batches of an overlapped pass go on together)
        act_bytes += ceil_int((overlapped.layers[0][1] if overlapped.layers else overlapped.embedding[1]).boundary_bytes)
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
    nb = layout.lines * nv                       # pipeline boundaries, over every model copy
    ring_base = 2 * num_microbatches * nb

    def boundary(p: Pass, forward: bool, side: int) -> tuple[int, int] | None:
        """The (peer, tag) of pass ``p``'s pipeline message: its input (``side`` -1) or its
        output (+1), forward or backward; None where there is none or the neighbour virtual
        stage is this stage's own other chunk (the V's turn: nothing to send)."""
        line, vs = layout.place(stage, p.chunk)
        other = vs + (side if forward else -side)
        if not 0 <= other < nv:
            return None
        holder, _ = layout.holder(line, other)
        if holder == stage:
            return None
        low = min(vs, other)
        # the stage after virtual stage ``low`` is one further along its chunk's direction
        # (modulo pp: the interleaved schedule's chunks wrap round to stage 0)
        step = layout.direction(layout.holder(line, low)[1])
        peer = step if vs == low else -step
        return peer, _tag(p.micro_batch, line * nv + low, nb, 0 if forward else 1)

    def recv(p: Pass) -> list[int]:
        fwd = p.phase == "fwd"
        if p.phase not in ("fwd", *BACKWARD) or (msg := boundary(p, fwd, -1)) is None:
            return []
        _, vs = layout.place(stage, p.chunk)
        name = "recv_fwd" if fwd else "recv_bwd"
        return [b.add(f"{name}.mb{p.micro_batch}.vs{vs}", RECV, [], peer=msg[0], tag=msg[1], **common(p))]

    def send(p: Pass, exits: list[int]) -> int:
        fwd = p.phase == "fwd"
        if p.phase not in ("fwd", *BACKWARD) or (msg := boundary(p, fwd, +1)) is None:
            return -1
        _, vs = layout.place(stage, p.chunk)
        name = "send_fwd" if fwd else "send_bwd"
        nid = b.add(f"{name}.mb{p.micro_batch}.vs{vs}", SEND, exits, peer=msg[0], tag=msg[1], **common(p))
        sends.append(nid)
        return nid

    def common(p: Pass) -> dict:
        return dict(micro_batch=p.micro_batch, chunk=p.chunk, phase=p.phase, category="pp", group=PP_GROUP,
                    comm_bytes=act_bytes)

    def record(t: PassTemplate, base: int, phase: str, skip: int = 0) -> None:
        """The nodes of each block in its last backward pass (``skip``: the blocks of an F&B's forward)."""
        for label, lo, hi in t.blocks[skip:]:
            nodes = list(range(base + lo, base + hi))
            if phase in BACKWARD:
                last_b[label] = nodes
            if phase in ("bwd", "bwd_weight"):
                last_w[label] = nodes

    k = 0
    while k < len(order):
        p = order[k]
        if p.paired:
            # F&B: both inputs before the pass, both outputs after it (a pass has at most one
            # receive and one send: the forward's go with an empty pass before and after it)
            q = order[k + 1]
            key = (FB, p.chunk, q.chunk)
            t = templates[key]
            rf, rb = recv(p), recv(q)
            if rf and rb:
                placed.append(PlacedPass(p, EMPTY, len(b.nodes), rf[0], -1, False))
                templates.setdefault(EMPTY, PassTemplate.of_rows([], [], [], [], None))
            base = b.defer(t, entry=rf + rb, chain=chain, ctrl=prev_sinks, micro_batch=p.micro_batch, chunk=p.chunk,
                           params={}, tag_base=ring_base + len(placed) * ring_tags)
            nf = len(templates[(p.chunk, "fwd")].rows)
            exits_f = [base + e for e in t.exits if e < nf] or rf
            exits_b = [base + e for e in t.exits if e >= nf] or rb
            sb, sf = send(q, exits_b), send(p, exits_f)
            placed.append(PlacedPass(q, key, base, (rb or rf or [-1])[0], sb if sb >= 0 else sf, False))
            if sb >= 0 and sf >= 0:
                templates.setdefault(EMPTY, PassTemplate.of_rows([], [], [], [], None))
                placed.append(PlacedPass(p, EMPTY, len(b.nodes), -1, sf, False))
            record(t, base, "bwd", skip=len(templates[(p.chunk, "fwd")].blocks))
            prev_sinks = [base + i for i in t.sinks] or prev_sinks
            k += 2
            continue
        entry = recv(p)
        key = (p.chunk, p.phase)
        params: dict[int, list[int]] = {}
        if p.phase == "fwd" and p.chunk not in first_fwd_done:
            first_fwd_done.add(p.chunk)
            params = {j: param_ag.get(inst.label, []) for j, inst in enumerate(chunks[p.chunk])}
            if (p.chunk, FIRST_FWD) in templates:
                key = (p.chunk, FIRST_FWD)
        t = templates[key]
        base = b.defer(t, entry=entry, chain=chain, ctrl=prev_sinks, micro_batch=p.micro_batch, chunk=p.chunk,
                       params=params, tag_base=ring_base + len(placed) * ring_tags)
        if t.last_prologue is not None:
            chain = [base + t.last_prologue]
        exits = [base + e for e in t.exits] or entry
        record(t, base, p.phase)
        placed.append(PlacedPass(p, key, base, entry[0] if entry else -1, send(p, exits), bool(params)))
        prev_sinks = [base + i for i in t.sinks] or prev_sinks
        k += 1

    last_bwd_nodes = {label: sorted(set(last_b.get(label, []) + last_w.get(label, [])))
                      for label in dict.fromkeys([*last_b, *last_w])}
    instances = [inst for c in sorted(chunks) for inst in chunks[c]]
    step_end_start = len(b.nodes)
    if inference:
        memory = inference_memory(instances, num_microbatches, tied_embeddings,
                                   [inst for c in sorted(second) for inst in second[c]] if second is not None else [])
    else:
        _step_end(b, instances, last_bwd_nodes, stage=stage, pp=pp, zero=zero, tied=tied_embeddings,
                  degrees=degrees, gather_after_update=not gathered, flush=prev_sinks + sends,
                  overlap_grad_reduce=overlap_grad_reduce, mirrored=layout.lines == 2)
        memory = training_memory(instances, order, chunks, zero=zero, degrees=degrees, tied=tied_embeddings)
    layers = tuple(inst.index for inst in instances if inst.kind == "layer")
    return RoleGraph(stage, b.nodes, memory, layers, order, templates, placed, step_end_start, b.deferred)


def _tag(micro_batch: int, vs: int, nv: int, direction: int) -> int:
    """Unique per (micro-batch, pipeline boundary after virtual stage ``vs`` of ``nv``, direction)."""
    return (micro_batch * nv + vs) * 2 + direction


def _param_gathers(b: "_Builder", chunks: dict[int, list[BlockInstance]], tied: bool,
                   degrees: dict[str, int]) -> dict[str, list[int]]:
    """Step-start all-gathers of each block's updated parameter shard (ZeRO 1/2, overlapped)."""
    instances = [inst for c in sorted(chunks) for inst in chunks[c]]
    out: dict[str, list[int]] = {}
    for (label, axes), nbytes in block_params(instances, tied, as_bytes=True).items():
        if nbytes > 0:
            group = resolve_group(axes, degrees) or group_name(axes)
            out.setdefault(label, []).extend(b.add_collective(
                f"{label}.param_ag_{group}", [], axes, coll=Collective.ALL_GATHER,
                comm_bytes=ceil_int(nbytes / replicas(degrees, axes)), phase="step", block=label))
    return out


def _step_end(b: _Builder, instances: list[BlockInstance], last_bwd: dict[str, list[int]], *, stage: int,
              pp: int, zero: int, tied: bool, degrees: dict[str, int], gather_after_update: bool = True,
              flush: list[int] | None = None, overlap_grad_reduce: bool = True, mirrored: bool = False) -> None:
    """Once per step: gradient reductions per block (bucketed), the optimizer, parameter gathers.

    ``flush`` are the nodes that end the stage's pipeline schedule (the last pass's sinks and
    every pipeline send): the tied-embedding gradient all-reduce waits for them, as Megatron
    reduces the embedding group's gradients only after the schedule has drained. Without
    ``overlap_grad_reduce`` every gradient reduction waits for them too (Megatron's default:
    one reduction after the backward of the whole step).

    ``mirrored`` (DualPipe): the stage at pipeline position i holds the blocks of stage i of one
    parameter copy and of stage pp-1-i of the other, as the stage at pp-1-i does the other way
    round; each block's gradient is first summed over the two (an all-reduce over the mirror
    group, after the schedule has drained, as the tied embedding's), then reduced over dp.
    """
    syncs: list[int] = []
    per_block: dict[str, dict[tuple[tuple[str, ...], Collective], float]] = {}
    params_of = block_params(instances, tied)
    bytes_of = block_params(instances, tied, as_bytes=True)
    tied_bytes: dict[str, float] = {}
    # the embedding group sums the tied table's two copies where they lie on two stages; a
    # stage holding both ends (the V schedules' first stage, each of DualPipe's end stages)
    # holds the table once and has nothing to sum with another stage
    one_end = len({inst.kind for inst in instances} & {"embedding", "head"}) == 1
    for inst, j in unique_weights(instances, tied):
        ws = inst.compiled.sharded.weight_syncs[j]
        if tied and pp > 1 and one_end and ws.weight.name == "word_embedding":
            tied_bytes[inst.label] = inst.costs.weight_params[j] * GRAD_BYTES
        buckets = per_block.setdefault(inst.label, {})
        for (axes, coll, _), nbytes in zip(ws.grad_collectives, inst.costs.weight_sync_bytes[j]):
            buckets[(axes, coll)] = buckets.get((axes, coll), 0.0) + nbytes
    mirror_bytes: dict[str, float] = {}
    if mirrored and pp > 1:
        for inst, j in unique_weights(instances, tied):
            # ZeRO-3 reduce-scatters each gradient in the backward: what is left to sum is the shard
            shard = replicas(degrees, inst.compiled.sharded.weight_syncs[j].replicas) if zero == 3 else 1
            mirror_bytes[inst.label] = (mirror_bytes.get(inst.label, 0.0)
                                        + inst.costs.weight_params[j] * GRAD_BYTES / shard)
    mirrored_ar: dict[str, int] = {}
    prev: list[int] = []
    # The two stages of a pair hold their blocks in opposite chunk order: both issue the sums in
    # model order, one after the other, so that the pair's collectives match one for one.
    for inst in sorted(instances, key=lambda i: ({"embedding": 0, "layer": 1}.get(i.kind, 2), i.index)):
        if mirror_bytes.get(inst.label, 0.0) <= 0:
            continue
        nid = b.add(f"{inst.label}.mirror_grad_ar", COLL,
                    list(dict.fromkeys(last_bwd.get(inst.label, []) + list(flush or []) + prev)),
                    coll=Collective.ALL_REDUCE, comm_bytes=ceil_int(mirror_bytes[inst.label]), group=MIRROR_GROUP,
                    phase="step", block=inst.label, category=MIRROR_GROUP)
        mirrored_ar[inst.label] = nid
        prev = [nid]
        syncs.append(nid)
    for inst in instances:
        deps = last_bwd.get(inst.label, []) + ([] if overlap_grad_reduce else list(flush or []))
        if inst.label in mirrored_ar:
            deps = [mirrored_ar[inst.label]]
        if inst.label in tied_bytes:
            # Tied embeddings on two stages: sum the two copies' gradients first (Megatron's
            # embedding group), then reduce over dp like any other gradient. The group spans the
            # first and the last stage, so it starts only when this stage's schedule is done:
            # issued earlier on the last stage, it would hold that rank's communication (one
            # operation at a time in ASTRA-sim) while the first stage still waits for its last
            # backward send, and the pipeline would never drain.
            nid = b.add(f"{inst.label}.tied_grad_ar", COLL, list(dict.fromkeys(deps + list(flush or []))),
                        coll=Collective.ALL_REDUCE,
                        comm_bytes=ceil_int(tied_bytes[inst.label]), group=EMBEDDING_GROUP,
                        phase="step", block=inst.label, category=EMBEDDING_GROUP)
            deps = [nid]
            syncs.append(nid)
        for (axes, coll), nbytes in per_block.get(inst.label, {}).items():
            if nbytes <= 0:
                continue
            group = resolve_group(axes, degrees) or group_name(axes)
            syncs += b.add_collective(f"{inst.label}.grad_{coll.short.lower()}_{group}", deps, axes, coll=coll,
                                      comm_bytes=ceil_int(nbytes), phase="step", block=inst.label)
    last_compute = [b.last_compute] if b.last_compute is not None else []
    for inst in instances:
        groups = {axes: params for (label, axes), params in params_of.items() if label == inst.label}
        if sum(groups.values()) <= 0:
            continue
        # ZeRO 1-3: each rank updates its shard of the block's parameters over each group.
        def shard(v: float, axes: tuple[str, ...]) -> float:
            return v / replicas(degrees, axes) if zero >= 1 else v

        local = {axes: shard(params, axes) for axes, params in groups.items()}
        local_bytes = {axes: shard(bytes_of[(inst.label, axes)], axes) for axes in groups}
        total = sum(local.values())
        # The optimizer runs after every gradient of the step is reduced (as frameworks do,
        # for gradient clipping), one kernel per block.
        # (and after the block's own gradients are complete: ZeRO-3 reduces them in the backward)
        opt = b.add(f"{inst.label}.optimizer", COMP, syncs + last_compute + last_bwd.get(inst.label, []),
                    flops=ceil_int(total * ADAM_FLOPS_PER_PARAM),
                    mem_bytes=ceil_int(total * ADAM_STATE_BYTES_PER_PARAM + sum(local_bytes.values())),
                    phase="step", block=inst.label, category="optimizer")
        last_compute = [opt]
        if zero in (1, 2) and gather_after_update:
            for axes, nbytes in local_bytes.items():
                group = resolve_group(axes, degrees) or group_name(axes)
                b.add_collective(f"{inst.label}.param_ag_{group}", [opt], axes, coll=Collective.ALL_GATHER,
                                 comm_bytes=ceil_int(nbytes), phase="step", block=inst.label)
