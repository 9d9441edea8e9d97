"""Activation recomputation: which forward ops each ``recompute`` mode replays in the backward.

One policy per mode, registered by name (a new mode is a function added here, not a branch in
the pass engine). A policy returns the forward ops it replays and the ids of their outputs that
are kept anyway (they leave the replayed region); :func:`backward_order` places the replays in
the backward pass: all of them up front for ``full``, else just before the first backward op
that reads a replayed tensor (where PyTorch's checkpoint and Megatron's recompute run them).
"""

from __future__ import annotations

from typing import Callable

from stage_cosim.graph.ir import Block, Op

Policy = Callable[[Block], tuple[list[Op], set[int]]]
_POLICIES: dict[str, Policy] = {}


def _policy(mode: str) -> Callable[[Policy], Policy]:
    def register(fn: Policy) -> Policy:
        _POLICIES[mode] = fn
        return fn
    return register


@_policy("none")
def _nothing(block: Block) -> tuple[list[Op], set[int]]:
    return [], set()


@_policy("full")
def _everything(block: Block) -> tuple[list[Op], set[int]]:
    """Every forward op (the FP8 weight casts are not replayed: their copies are kept)."""
    return [op for op in block.ops if not op.cached], set()


@_policy("selective")
def _attention_core(block: Block) -> tuple[list[Op], set[int]]:
    """Megatron's selective recomputation: the attention core (an unfused one's scores, softmax,
    dropout and context), whose score matrix is what it would otherwise keep. Its outputs that
    leave the region (the checkpointed context) are kept rather than replayed."""
    core = [op for op in block.ops if op.attention_core]
    # Flash attention never stores the score matrix: nothing to gain by replaying it.
    if any(op.kind == "attention" for op in core):
        return [], set()
    inside = {id(op) for op in core}
    produced = {id(t) for op in core for t in op.outputs}
    leaving = {id(t) for op in block.ops if id(op) not in inside for t in op.inputs if id(t) in produced}
    return core, leaving


@_policy("op")
def _every_second_matmul(block: Block) -> tuple[list[Op], set[int]]:
    """torchtitan's per-op selective checkpointing: its policy saves the outputs of matmuls
    (``aten.mm``) and of the fused attention kernel and recomputes every other op — and every
    second matmul of the layer, counted in forward order, to halve what the matmuls keep.
    Batched matmuls (``bmm``: an unfused attention core's) are not in its save list. The graph's
    fused projections (QKV; gate and up) count as one matmul each."""
    replayed: list[Op] = []
    matmuls = 0
    for op in block.ops:
        if op.cached or op.kind == "attention":
            continue
        if op.kind == "einsum" and not op.attention_core:
            matmuls += 1
            if matmuls % 2:
                continue        # the odd ones are kept
        replayed.append(op)
    return replayed, set()


def backward_order(block: Block, bwd_ops: list[Op], recompute: str) -> tuple[list[tuple[str, Op]], set[int]]:
    """Backward ops, with the forward ops that recomputation replays placed where needed, and
    the ids of the forward tensors those replays reproduce (not kept from the forward)."""
    replays, leaving = _POLICIES[recompute](block)
    replayed = {id(t) for op in replays for t in op.outputs} - leaving
    if recompute == "full":
        return [("recompute", op) for op in replays] + [("bwd", op) for op in bwd_ops], replayed
    order: list[tuple[str, Op]] = []
    pending = bool(replays)
    for op in bwd_ops:
        if pending and any(id(t) in replayed for t in op.inputs):
            order.extend(("recompute", c) for c in replays)
            pending = False
        order.append(("bwd", op))
    return order, replayed


def transient(recompute: str) -> bool:
    """Whether the replayed tensors are held only while the block's backward runs (a workspace):
    modes that replay the whole layer, or most of it, around its backward."""
    return recompute in ("full", "op")
