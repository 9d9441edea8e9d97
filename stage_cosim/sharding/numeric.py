"""Bind a sharded block's symbolic costs to numbers, with one compiled function per block.

Sharding a block is symbolic work done once per (architecture, policy); every concrete model
size and parallel degree then costs one call of a lambdified function, never ``subs``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, NamedTuple, Sequence

import sympy as sp

from stage_cosim.graph.dims import (
    B, D, E, F, FI, FJ, G, H, K, L, LKV, LQ, NOPE, P, Q, ROPE, S, SD, SG, SI, SK, SN, SP, SR, SX, T, U, V, W,
    degree_symbol,
)
from stage_cosim.graph.transformer import build_blocks
from stage_cosim.model.architecture import ArchSwitches
from stage_cosim.parallel.axes import BLOCK_AXES
from stage_cosim.sharding.layout import input_placement, local_bytes
from stage_cosim.sharding.propagate import shard_block, shard_forward
from stage_cosim.sharding.steps import ShardedBlock, ShardingPolicy

SYMBOLS: tuple[sp.Symbol, ...] = ((B, S, H, F, G, Q, D, V, P, W, E, K, FI, FJ, L, LQ, LKV, NOPE, ROPE, T,
                                   SG, SR, SP, SN, SK, SX, SI, SD, U)
                                  + tuple(degree_symbol(a) for a in BLOCK_AXES))
_DEGREES = frozenset(degree_symbol(a) for a in BLOCK_AXES)


@dataclass(frozen=True)
class StepCosts:
    flops: tuple[float, ...]
    model_flops: tuple[float, ...]
    mem_bytes: tuple[float, ...]
    comm_bytes: tuple[float, ...]
    groups: tuple[float, ...]          # GEMMs per kernel (local experts of a grouped GEMM)


@dataclass(frozen=True)
class BlockCosts:
    """Numbers for one block under one concrete configuration (indices match the steps)."""

    fwd: StepCosts
    bwd: StepCosts
    saved_bytes: float
    workspace_bytes: float
    boundary_bytes: float
    cached_bytes: float                              # FP8 weight copies kept across micro-batches
    exchange_bytes: float                            # the attention exchange's buffers
    keys: float                                      # keys each query attends to (sequence or window)
    weight_params: tuple[float, ...]                 # per WeightSync
    weight_sync_bytes: tuple[tuple[float, ...], ...]  # per WeightSync, per collective
    cache_bytes: float = 0.0                         # the KV cache on one rank (inference)
    # of cache_bytes, the fixed state whatever the context (SSM scan and convolution state)
    state_bytes: float = 0.0


@dataclass
class CompiledBlock:
    sharded: ShardedBlock
    _fn: Callable[..., Sequence[float]]
    _layout: tuple[int, ...]
    # every expression's value: a number, or None where the compiled function computes it
    _constants: tuple[float | None, ...] = ()

    def evaluate(self, values: dict[sp.Symbol, int]) -> BlockCosts:
        """Numbers for ``values`` (model symbols required; a mesh axis not given has degree 1)."""
        computed = iter(self._fn(*(values[s] if s in values or s not in _DEGREES else 1 for s in SYMBOLS)))
        flat = [next(computed) if c is None else c for c in self._constants]
        nf, nb, nw = self._layout[:3]
        sync_lens = self._layout[3:]
        pos = 0

        def take(n: int) -> tuple[float, ...]:
            nonlocal pos
            out = tuple(float(x) for x in flat[pos:pos + n])
            pos += n
            return out

        fwd = StepCosts(take(nf), take(nf), take(nf), take(nf), take(nf))
        bwd = StepCosts(take(nb), take(nb), take(nb), take(nb), take(nb))
        saved, workspace, boundary, cached, exchange, cache, state = take(7)
        params = take(nw)
        syncs = tuple(take(n) for n in sync_lens)
        return BlockCosts(fwd, bwd, saved, workspace, boundary, cached, exchange, float(values[W]), params, syncs,
                          cache, state)


def _state_bytes(sb: ShardedBlock) -> sp.Expr:
    """The part of ``sb``'s cache that has no context label (``t``): the state an SSM layer
    keeps per sequence, placed as the forward placed its caches (shard_forward)."""
    return sp.Add(*(local_bytes(c, input_placement(c, sb.policy)) for c in sb.block.caches if "t" not in c.labels))


def compile_block(sb: ShardedBlock) -> CompiledBlock:
    exprs: list[sp.Expr] = []
    for steps in (sb.fwd, sb.bwd):
        exprs += [s.flops for s in steps] + [s.model_flops for s in steps]
        exprs += [s.mem_bytes for s in steps] + [s.comm_bytes for s in steps] + [s.groups for s in steps]
    exprs += [sb.saved_bytes, sb.workspace_bytes, sb.boundary_bytes, sb.cached_bytes, sb.exchange_bytes,
              sb.cache_bytes, _state_bytes(sb)]
    exprs += [w.params for w in sb.weight_syncs]
    for w in sb.weight_syncs:
        exprs += [b for _, _, b in w.grad_collectives]
    exprs = [sp.sympify(e) for e in exprs]
    # Most entries are constants (no FLOPs in a collective, one GEMM per kernel): only the rest
    # is compiled, which keeps the first synthesis of an architecture fast.
    constants = tuple(float(e) if e.is_Number else None for e in exprs)
    fn = sp.lambdify(SYMBOLS, [e for e in exprs if not e.is_Number], modules="math", cse=True)
    layout = (len(sb.fwd), len(sb.bwd), len(sb.weight_syncs),
              *(len(w.grad_collectives) for w in sb.weight_syncs))
    return CompiledBlock(sb, fn, layout, constants)


class CompiledGraph(NamedTuple):
    """The compiled blocks of an architecture (see :class:`~stage_cosim.graph.transformer.ModelGraph`)."""

    embedding: CompiledBlock
    layer: CompiledBlock
    head: CompiledBlock
    moe_layer: CompiledBlock | None = None
    hybrid: tuple[CompiledBlock, ...] = ()      # per ArchSwitches.hybrid_kinds

    def block(self, kind: tuple[str, str], hybrid_kinds: tuple[tuple[str, str], ...]) -> CompiledBlock:
        """The compiled block of a layer of ``kind`` (see ModelGraph.block)."""
        if kind in hybrid_kinds:
            return self.hybrid[hybrid_kinds.index(kind)]
        return self.moe_layer if kind[1] == "moe" else self.layer


@lru_cache(maxsize=128)
def compiled_blocks(arch: ArchSwitches, policy: ShardingPolicy) -> CompiledGraph:
    """The embedding, layer kinds and head of an architecture, sharded under ``policy`` and
    compiled.

    Recomputation applies to transformer layers only (as in Megatron): the embedding and the
    output layer keep their activations.
    """
    g = build_blocks(arch)
    edges = replace(policy, recompute="none")
    return CompiledGraph(compile_block(shard_block(g.embedding, edges)), compile_block(shard_block(g.layer, policy)),
                         compile_block(shard_block(g.head, edges)),
                         compile_block(shard_block(g.moe_layer, policy)) if g.moe_layer is not None else None,
                         tuple(compile_block(shard_block(b, policy)) for b in g.hybrid))


@lru_cache(maxsize=128)
def compiled_inference_blocks(arch: ArchSwitches, policy: ShardingPolicy, kv_cache_dtype: str = "bf16",
                              absorb: bool = False) -> CompiledGraph:
    """The blocks of an inference step (forward only, the layers reading their KV cache, the
    head sampling), sharded under ``policy`` and compiled (``absorb``: latent attention in its
    absorbed form)."""
    from stage_cosim.graph.inference import inference_blocks

    g = inference_blocks(arch, kv_cache_dtype, absorb)
    return CompiledGraph(*(compile_block(shard_forward(b, policy)) if b is not None else None for b in g[:4]),
                         tuple(compile_block(shard_forward(b, policy)) for b in g.hybrid))
