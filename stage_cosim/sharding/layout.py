"""A tensor's placements over a block's mesh axes, and what one rank holds of it.

A tensor's placement on each block axis (:data:`~stage_cosim.parallel.axes.BLOCK_AXES`, in
that order) is one :class:`~stage_cosim.sharding.placement.Placement`, or None on the axes of
the other mesh. These are the layouts the propagation starts from and hands on: where a weight
is computed, where block inputs arrive (the residual stream), how tokens are split, and the
size of one rank's piece.

Weights are computed replicated over the *data-parallel* axes (those that hold weight
replicas); their gradients leave the backward Partial there, and the once-per-step reduction
runs over all of a mesh's data-parallel axes together, as one communicator group, which is
also the group ZeRO shards over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import sympy as sp

from stage_cosim.graph.dims import DTYPE_BYTES, LABEL_SIZE, degree_symbol
from stage_cosim.graph.ir import Tensor
from stage_cosim.parallel.axes import AXIS, BLOCK_AXES, data_parallel_axes
from stage_cosim.sharding.placement import REPLICATE, Placement, Shard

if TYPE_CHECKING:
    from stage_cosim.sharding.steps import ShardingPolicy

# Whether each block axis holds weight replicas, in BLOCK_AXES order.
DATA_PARALLEL = tuple(AXIS[a].data_parallel for a in BLOCK_AXES)

# Per-axis placements of one tensor, in BLOCK_AXES order (None: an axis of another mesh).
Placements = tuple[Placement | None, ...]


def on_mesh(mesh: str) -> tuple[bool, ...]:
    """Whether each block axis belongs to ``mesh``, in BLOCK_AXES order."""
    return tuple(AXIS[a].mesh == mesh for a in BLOCK_AXES)


def compute_placement(w: Tensor) -> Placements:
    """Where a weight is when an op reads it: sharded on its tensor-parallel label (or on a
    label axis's label it has, other than over data-parallel axes), replicated elsewhere."""
    out: list[Placement | None] = []
    for axis in BLOCK_AXES:
        rule = AXIS[axis]
        if rule.mesh != w.mesh:
            out.append(None)
        elif rule.shards is None:
            out.append(Shard(w.tp_shard) if w.tp_shard else REPLICATE)
        elif not rule.data_parallel and rule.shards in w.labels:
            out.append(Shard(rule.shards))
        else:
            out.append(REPLICATE)
    return tuple(out)


def weight_replicas(w: Tensor) -> tuple[str, ...]:
    """The data-parallel axes that hold replicas of ``w`` (its gradient and ZeRO group)."""
    return data_parallel_axes(w.mesh)


def token_layout(t: Tensor) -> Placements:
    """``t`` split by tokens over every axis of its mesh (each axis shards its token label,
    if ``t`` has it): the layout in which a stage's ranks each hold their own tokens."""
    return tuple(None if AXIS[a].mesh != t.mesh else
                 Shard(AXIS[a].tokens) if AXIS[a].tokens in t.labels else REPLICATE for a in BLOCK_AXES)


def local_numel(t: Tensor, pl: Placements) -> sp.Expr:
    n = t.numel()
    for axis, p in zip(BLOCK_AXES, pl):
        if isinstance(p, Shard) and p.label in t.labels:
            n = n / degree_symbol(axis)
    return n


def local_bytes(t: Tensor, pl: Placements) -> sp.Expr:
    return local_numel(t, pl) * DTYPE_BYTES[t.dtype]


def local_size(labels: tuple[str | None, ...]) -> Callable[[str], sp.Expr]:
    """label -> its size on one rank of an op sharded on ``labels`` (one per block axis)."""

    def local(letter: str) -> sp.Expr:
        n = LABEL_SIZE[letter]
        for axis, l in zip(BLOCK_AXES, labels):
            if l == letter:
                n = n / degree_symbol(axis)
        return n

    return local


def residual_label(policy: ShardingPolicy) -> str | None:
    """The label the residual stream is sharded on over the tensor-parallel axis."""
    return "s" if policy.sp else None


def input_placement(t: Tensor, policy: ShardingPolicy) -> Placements:
    """Block inputs arrive in the residual-stream layout: a label axis shards its label, the
    tensor-parallel axis the residual layout (token ids stay replicated over tp)."""
    out: list[Placement | None] = []
    for axis in BLOCK_AXES:
        if AXIS[axis].mesh != t.mesh:
            out.append(None)
            continue
        label = AXIS[axis].shards
        if label is None:
            # a KV cache is split by heads, as the attention that reads it
            label = t.tp_shard if t.kind == "kv_cache" else residual_label(policy) if t.residual else None
        elif t.kind == "kv_cache" and label not in t.labels:
            label = AXIS[axis].keys or None     # (cp: each rank caches its own tokens)
        out.append(Shard(label) if label is not None and label in t.labels else REPLICATE)
    return tuple(out)
