"""Sharding propagation: a block's logical ops become one rank's steps, collectives inferred.

The engine runs a block's ops in program order, forward and then backward (with what
recomputation replays), each through the rule of its op kind (:func:`~stage_cosim.sharding.rules.rule_for`:
the placement rules, and the rules of the op families that differ from them), which
redistribute its operands (:mod:`~stage_cosim.sharding.redistribute`), add its steps and place
its results. The backward pass is propagated by the same rules. What the passes leave behind
makes the rest of the sharded block: the activations held from forward to backward, the
weights' gradient reductions (derived from placements like every other collective), the
output handed on in the residual layout.
"""

from __future__ import annotations

from dataclasses import replace

import sympy as sp

# The op families' rule modules register their rules when imported (rules.py holds the generic
# rule and the dense ops').
import stage_cosim.sharding.context_parallel  # noqa: F401
import stage_cosim.sharding.dispatch  # noqa: F401
import stage_cosim.sharding.ssm  # noqa: F401
from stage_cosim.graph.autodiff import differentiate
from stage_cosim.graph.dims import DTYPE_BYTES
from stage_cosim.graph.ir import Block, Op, Tensor
from stage_cosim.graph.precision_rewrite import apply_precision
from stage_cosim.parallel.axes import BLOCK_AXES, group_name
from stage_cosim.sharding.layout import (
    DATA_PARALLEL, Placements, compute_placement, input_placement, local_bytes, local_numel, weight_replicas,
)
from stage_cosim.sharding.placement import REPLICATE, Collective, Partial, Shard, collective_for
from stage_cosim.sharding.recompute import backward_order, transient
from stage_cosim.sharding.redistribute import PassState
from stage_cosim.sharding.rules import rule_for
from stage_cosim.sharding.steps import ShardedBlock, ShardingPolicy, WeightSync


class _Pass(PassState):
    """Propagates one pass (forward, or backward with its recomputation) of one block."""

    def __init__(self, policy: ShardingPolicy, phase_default: str, placements: dict[Tensor, Placements],
                 weights: list[Tensor]) -> None:
        super().__init__(policy, phase_default, placements, weights)
        if policy.zero == 3 and weights:
            # ZeRO-3 keeps parameters sharded over their data-parallel group and gathers a
            # whole block (one gather per group) before each pass.
            groups: dict[tuple[str, ...], list[Tensor]] = {}
            for w in weights:
                groups.setdefault(weight_replicas(w), []).append(w)
            for axes, ws in groups.items():
                nbytes = sp.Add(*(local_bytes(w, self.stored(w)) for w in ws))
                name = f"{phase_default}.zero3_gather" if len(groups) == 1 else \
                    f"{phase_default}.zero3_gather_{group_name(axes)}"
                idx = self.collective(name, Collective.ALL_GATHER, axes, nbytes, deps=(), phase=phase_default)
                self.steps[idx].prologue = True
                for w in ws:
                    self.placements[w] = compute_placement(w)
                    self.producers[w] = (idx,)

    def run(self, op: Op, phase: str) -> None:
        """``op`` propagated by the rule of its kind."""
        rule_for(op.kind).run(self, op, phase)


def shard_block(block: Block, policy: ShardingPolicy) -> ShardedBlock:
    """The per-rank forward and backward programs of ``block`` under ``policy``."""
    backward = differentiate(block)
    block, bwd_ops, weight_grads, fp8_modules = apply_precision(
        block, backward.ops, backward.weight_grads, policy.precision, sp=policy.sp, zero3=policy.zero == 3)
    backward = replace(backward, ops=bwd_ops, weight_grads=weight_grads)
    placements: dict[Tensor, Placements] = {t: input_placement(t, policy) for t in block.inputs}

    fwd = _Pass(policy, "fwd", placements, block.weights)
    for op in block.ops:
        fwd.run(op, "fwd")
    fwd_exit = _hand_on(fwd, block, policy)

    # The backward pass starts from the gradients of the block's outputs, placed like the outputs.
    for out, g in backward.output_grads.items():
        placements[g] = tuple(REPLICATE if isinstance(p, Partial) else p for p in placements[out])
    bwd = _Pass(policy, "bwd", placements, block.weights)
    order, recomputed = backward_order(block, backward.ops, policy.recompute)
    bwd.reuse(fwd.kept(recomputed), fwd.gathered)
    for phase, op in order:
        bwd.run(op, phase)
    bwd_exit = tuple(sorted({i for g in backward.input_grads.values() for i in bwd.producers.get(g, ())}))

    # Activations the backward reads that it did not recompute: held from forward to backward.
    forward_tensors = {id(t): t for t in block.inputs}
    forward_tensors.update({id(t): t for op in block.ops for t in op.outputs})
    # a tensor re-read on the other mesh is the same memory as its (local) source
    alias = fwd.aliases
    saved: dict[int, Tensor] = {}
    for _phase, op in order:
        for t in op.inputs:
            if id(t) in forward_tensors and id(t) not in recomputed and t.kind != "weight":
                # what is held is what the backward starts from: the tensor, or the copy the
                # forward redistributed and kept
                for origin in bwd.reads.get(id(t), {id(t): t}).values():
                    while id(origin) in alias:
                        origin = alias[id(origin)]
                    saved[id(origin)] = origin
    saved_bytes = sp.Add(*(local_bytes(t, placements[t]) for t in saved.values()))
    workspace = sp.Integer(0)
    if transient(policy.recompute):
        workspace = sp.Add(*(local_bytes(forward_tensors[i], placements[forward_tensors[i]])
                             for i in recomputed))
    # An all-to-all's send buffer (the permuted tokens before the dispatch, the experts' output
    # before the combine) lives only while it runs; its receive buffer is the next op's input.
    buffers = [st.comm_bytes for st in (*fwd.steps, *bwd.steps) if st.collective is Collective.ALL_TO_ALL]
    if buffers:
        workspace += sp.Max(*buffers)

    weight_syncs = _weight_syncs(block, backward.weight_grads, placements, policy, bwd)
    boundary = sp.Add(*(local_bytes(t, placements[t]) for t in block.outputs))
    cached = sp.Add(*(local_bytes(t, placements[t]) for op in block.ops if op.cached for t in op.outputs
                      if t.kind == "weight"))
    exchange = sp.Max(fwd.transient, bwd.transient, fwd.gathered_bytes, bwd.gathered_bytes)
    return ShardedBlock(block, policy, fwd.steps, bwd.steps, fwd_exit, bwd_exit, saved_bytes,
                        workspace, weight_syncs, boundary, cached, fp8_modules, exchange_bytes=exchange)


def _hand_on(fwd: _Pass, block: Block, policy: ShardingPolicy) -> tuple[int, ...]:
    """The steps that hand the block's outputs on, in the layout the next block reads its
    inputs in (the residual stream): an output still partial over tp (the vocabulary-parallel
    embedding's) is reduced first, as Megatron's embedding all-reduces (or, with sequence
    parallelism, reduce-scatters) its output."""
    exits: set[int] = set()
    for t in block.outputs:
        # the hidden states go on in the residual layout (a loss or sampled tokens stay put)
        want = input_placement(replace(t, residual=True), policy) if "h" in t.labels else fwd.placement(t)
        if fwd.placement(t) != want:
            lt = fwd.redistribute(t, want, "fwd")
            fwd.placements[t] = want
            fwd.producers[t] = fwd.producers.get(lt, ())
        exits.update(fwd.producers.get(t, ()))
    return tuple(sorted(exits))


def shard_forward(block: Block, policy: ShardingPolicy) -> ShardedBlock:
    """The per-rank program of ``block``'s forward alone, as an inference step runs it: no
    backward, no gradients, no activations held for later. Its KV cache (the block's state)
    is placed like the attention that reads it. ``workspace_bytes`` is the largest kernel's
    working set of activations beside the block's input (what a forward pass holds at once)."""
    # the precision's GEMMs, casts and stored weights (a forward-only policy: see graph.precision)
    block = apply_precision(block, [], {}, policy.precision, sp=policy.sp, zero3=False)[0]
    placements: dict[Tensor, Placements] = {t: input_placement(t, policy) for t in [*block.inputs, *block.caches]}
    fwd = _Pass(policy, "fwd", placements, block.weights)
    for op in block.ops:
        fwd.run(op, "fwd")
    fwd_exit = _hand_on(fwd, block, policy)
    syncs = [WeightSync(w, local_numel(w, compute_placement(w)), (), weight_replicas(w), float(DTYPE_BYTES[w.dtype]))
             for w in block.weights]
    boundary = sp.Add(*(local_bytes(t, placements[t]) for t in block.outputs))
    inputs = sp.Add(*(local_bytes(t, placements[t]) for t in block.inputs))
    working = [sp.Add(*(local_bytes(t, placements[t]) for t in [*op.inputs, *op.outputs]
                        if t.kind == "activation" and t in placements))
               for op in block.ops]
    workspace = inputs + (sp.Max(*working) if working else sp.Integer(0))
    caches = sp.Add(*(local_bytes(c, placements[c]) for c in block.caches))
    exchange = sp.Max(fwd.transient, fwd.gathered_bytes)
    return ShardedBlock(block, policy, fwd.steps, [], fwd_exit, (), sp.Integer(0), workspace, syncs, boundary,
                        cache_bytes=caches, exchange_bytes=exchange)


def _weight_syncs(block: Block, weight_grads: dict[Tensor, Tensor], placements: dict[Tensor, Placements],
                  policy: ShardingPolicy, bwd: _Pass) -> list[WeightSync]:
    """Weight-gradient reductions, derived from placements like every other collective.

    The optimizer wants each gradient where the weight is computed over the model-parallel
    axes, and replicated (ZeRO 0) or sharded (ZeRO 1-3) over the weight's data-parallel axes,
    which change together: one collective over their group. ZeRO-3 reduce-scatters every
    micro-batch, at the end of the block's backward; everything else accumulates locally and
    is reduced once per step.
    """
    syncs: list[WeightSync] = []
    per_microbatch: dict[tuple[str, ...], sp.Expr] = {}
    for w in block.weights:
        replicas = weight_replicas(w)
        compute = compute_placement(w)
        optimizer = tuple((Shard(w.labels[0]) if policy.zero >= 1 else REPLICATE) if dpar and p is not None else p
                          for p, dpar in zip(compute, DATA_PARALLEL))
        params = local_numel(w, compute)
        g = weight_grads.get(w)
        colls: list[tuple[tuple[str, ...], Collective, sp.Expr]] = []
        if g is not None:
            g32 = Tensor(g.name, g.labels, policy.grad_reduce_dtype, g.kind)
            cur = placements[g]
            # Model-parallel axes one by one (a norm weight's gradient under sequence
            # parallelism: an all-reduce over tp) ...
            for i, axis in enumerate(BLOCK_AXES):
                if DATA_PARALLEL[i] or optimizer[i] is None:
                    continue
                coll = collective_for(cur[i], optimizer[i])
                if coll is not None:
                    colls.append(((axis,), coll, local_bytes(g32, cur)))
                cur = cur[:i] + (optimizer[i],) + cur[i + 1:]
            # ... then the data-parallel axes together, over their group.
            moving = [i for i, dpar in enumerate(DATA_PARALLEL)
                      if dpar and optimizer[i] is not None and cur[i] != optimizer[i]]
            if moving:
                kinds = {collective_for(cur[i], optimizer[i]) for i in moving}
                assert len(kinds) == 1, f"{w.name}: data-parallel axes change placement differently"
                (coll,) = kinds
                axes = tuple(BLOCK_AXES[i] for i in moving)
                if coll is not None:
                    if policy.zero == 3:
                        per_microbatch[axes] = per_microbatch.get(axes, sp.Integer(0)) + local_bytes(g32, cur)
                    else:
                        colls.append((axes, coll, local_bytes(g32, cur)))
        syncs.append(WeightSync(w, params, tuple(colls), replicas, float(DTYPE_BYTES[w.dtype])))
    for axes, nbytes in per_microbatch.items():
        deps = tuple(sorted({i for g in weight_grads.values() for i in bwd.producers.get(g, ())}))
        bwd.collective(f"{block.name}.grad_rs_{group_name(axes)}", Collective.REDUCE_SCATTER, axes,
                        nbytes, deps, "bwd")
    return syncs
