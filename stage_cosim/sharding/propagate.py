"""Sharding propagation: a block's logical ops become one rank's steps, collectives inferred.

For every op and every mesh axis that shards tensors inside a block, one label is chosen as
the op's *sharded label* on that axis (Megatron's strategy, stated as rules):

* batch axis (``dp``): the micro-batch label ``b`` whenever the op touches it;
* tensor axis (``tp``): the label a weight operand (or weight-gradient result) is sharded on;
  otherwise the residual-stream layout for ops that run in it (``s`` with sequence
  parallelism, nothing without); otherwise whatever label an activation input is already
  sharded on. An op that cannot run with that label sharded (a norm over ``h``) gets none.

Each operand must then be ``Shard(label)`` if it has the label and ``Replicate()`` if not, and
the result is ``Shard(label)`` if it keeps the label and ``Partial()`` if the op summed it away.
Where an operand's current placement differs from the required one, the placement change
(:func:`~stage_cosim.sharding.placement.collective_for`) is the collective. The backward pass is
propagated by the same rules, so Megatron's conjugate collectives, the sequence-parallel
re-gathers and the ZeRO-3 re-gathers are derived rather than listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import sympy as sp

from stage_cosim.graph.autodiff import differentiate
from stage_cosim.graph.cost import op_flops
from stage_cosim.graph.dims import DTYPE_BYTES, LABEL_SIZE, degree_symbol
from stage_cosim.graph.ir import Block, Op, Tensor
from stage_cosim.sharding.placement import (
    PARTIAL, REPLICATE, Collective, Partial, Placement, Shard, collective_for,
)

TENSOR_AXIS = "tp"
BATCH_AXIS = "dp"
BLOCK_AXES = (TENSOR_AXIS, BATCH_AXIS)  # axes that shard tensors inside a block, in redistribution order
RECOMPUTE_MODES = ("none", "selective", "full")

# Per-axis placements of one tensor, in BLOCK_AXES order.
Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class ShardingPolicy:
    """The execution choices that change a block's sharded program (not its sizes)."""

    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    # Megatron accumulates and reduces bf16 training's gradients in fp32 by default.
    grad_reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0..3, got {self.zero}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute}")


@dataclass
class Step:
    """One node of a rank's program: a compute kernel or a collective."""

    index: int
    name: str
    phase: str                 # "fwd", "bwd" or "recompute"
    kind: str                  # "compute" or "collective"
    category: str              # compute: the op kind; collective: the mesh axis
    flops: sp.Expr
    model_flops: sp.Expr
    mem_bytes: sp.Expr         # bytes read plus written
    deps: tuple[int, ...]
    collective: Collective | None = None
    axis: str | None = None
    comm_bytes: sp.Expr = sp.Integer(0)
    matmul: bool = False       # counts toward the matmul FLOPs of the published formulas
    prologue: bool = False     # gathers the block's weights (ZeRO-3): may run a block ahead


@dataclass(frozen=True)
class WeightSync:
    """One weight's gradient reductions, once per step after the last micro-batch's backward
    (from where the backward leaves the gradient to where the optimizer wants it)."""

    weight: Tensor
    params: sp.Expr                                       # elements held per rank before ZeRO
    grad_collectives: tuple[tuple[str, Collective, sp.Expr], ...]   # (axis, collective, bytes)


@dataclass
class ShardedBlock:
    block: Block
    policy: ShardingPolicy
    fwd: list[Step]
    bwd: list[Step]
    fwd_exit: tuple[int, ...]          # steps that produce the block's output
    bwd_exit: tuple[int, ...]          # steps that produce the gradient of the block's input
    saved_bytes: sp.Expr               # activations kept from forward to backward, one micro-batch
    workspace_bytes: sp.Expr           # transient activations while recomputing (full recompute)
    weight_syncs: list[WeightSync]
    boundary_bytes: sp.Expr            # the output activation (and its gradient) on one rank


def _degree(axis: str) -> sp.Symbol:
    return degree_symbol(axis)


def local_numel(t: Tensor, pl: Placements) -> sp.Expr:
    n = t.numel()
    for axis, p in zip(BLOCK_AXES, pl):
        if isinstance(p, Shard) and p.label in t.labels:
            n = n / _degree(axis)
    return n


def local_bytes(t: Tensor, pl: Placements) -> sp.Expr:
    return local_numel(t, pl) * DTYPE_BYTES[t.dtype]


class _Pass:
    """Propagates one pass (forward, or backward with its recomputation) of one block."""

    def __init__(self, policy: ShardingPolicy, phase_default: str, placements: dict[Tensor, Placements],
                 weights: list[Tensor]) -> None:
        self.policy = policy
        self.phase_default = phase_default
        self.placements = placements
        self.steps: list[Step] = []
        self.producers: dict[Tensor, tuple[int, ...]] = {}
        self.memo: dict[tuple[int, Placements], Tensor] = {}
        self.weights = weights
        if policy.zero == 3 and weights:
            # ZeRO-3 keeps parameters sharded over dp and gathers a whole block before each pass.
            nbytes = sp.Add(*(local_bytes(w, self.stored(w)) for w in weights))
            idx = self._collective(f"{phase_default}.zero3_gather", Collective.ALL_GATHER, BATCH_AXIS,
                                   nbytes, deps=(), phase=phase_default)
            self.steps[idx].prologue = True
            for w in weights:
                self.placements[w] = self.compute_placement(w)
                self.producers[w] = (idx,)

    # -- placements --------------------------------------------------------------------------

    def stored(self, w: Tensor) -> Placements:
        """Where a weight lives between uses."""
        tp = Shard(w.tp_shard) if w.tp_shard else REPLICATE
        dp = Shard(w.labels[0]) if self.policy.zero == 3 else REPLICATE
        return (tp, dp)

    @staticmethod
    def compute_placement(w: Tensor) -> Placements:
        return (Shard(w.tp_shard) if w.tp_shard else REPLICATE, REPLICATE)

    def placement(self, t: Tensor) -> Placements:
        if t not in self.placements:
            if t.kind == "weight":
                self.placements[t] = self.stored(t)
            else:
                raise KeyError(f"tensor {t.name} has no placement")
        return self.placements[t]

    # -- steps ----------------------------------------------------------------------------------

    def _collective(self, name: str, coll: Collective, axis: str, nbytes: sp.Expr,
                    deps: tuple[int, ...], phase: str) -> int:
        idx = len(self.steps)
        self.steps.append(Step(idx, name, phase, "collective", axis, sp.Integer(0), sp.Integer(0),
                               sp.Integer(0), deps, collective=coll, axis=axis, comm_bytes=nbytes))
        return idx

    def redistribute(self, t: Tensor, want: Placements, phase: str) -> Tensor:
        have = self.placement(t)
        if have == want:
            return t
        key = (id(t), want)
        if key in self.memo:
            return self.memo[key]
        cur, cur_pl, deps = t, have, self.producers.get(t, ())
        for i, axis in enumerate(BLOCK_AXES):
            if cur_pl[i] == want[i]:
                continue
            coll = collective_for(cur_pl[i], want[i])
            new_pl = cur_pl[:i] + (want[i],) + cur_pl[i + 1:]
            nxt = Tensor(f"{t.name}@{axis}:{want[i]!r}", t.labels, t.dtype, t.kind, t.tp_shard,
                         t.residual, t.grad_of)
            if coll is not None:
                idx = self._collective(f"{t.name}.{coll.short.lower()}_{axis}", coll, axis,
                                       local_bytes(cur, cur_pl), deps, phase)
                deps = (idx,)
            self.placements[nxt] = new_pl
            self.producers[nxt] = deps
            cur, cur_pl = nxt, new_pl
        self.memo[key] = cur
        return cur

    # -- the sharded label of an op on each axis ---------------------------------------------

    @staticmethod
    def _operands(op: Op) -> list[tuple[Tensor, str]]:
        """(tensor, the letters the op calls its dimensions) for every input."""
        if op.kind == "einsum":
            letters, _ = op.einsum_operands()
            return list(zip(op.inputs, letters))
        return [(t, t.labels) for t in op.inputs]

    def _out_letters(self, op: Op) -> list[str]:
        if op.kind == "einsum":
            return [op.einsum_operands()[1]]
        return [t.labels for t in op.outputs]

    def choose(self, op: Op) -> tuple[str | None, ...]:
        operands = self._operands(op)
        all_letters = set("".join(l for _, l in operands) + "".join(self._out_letters(op)))
        chosen: list[str | None] = []
        for i, axis in enumerate(BLOCK_AXES):
            label: str | None = None
            if axis == BATCH_AXIS:
                label = "b" if "b" in all_letters else None
            else:
                for t, letters in operands:
                    if t.kind == "weight" and t.tp_shard:
                        label = letters[t.labels.index(t.tp_shard)]
                        break
                else:
                    for out in op.outputs:
                        if out.kind == "weight_grad" and out.tp_shard:
                            label = out.tp_shard
                            break
                    else:
                        if op.residual:
                            label = "s" if self.policy.sp else None
                        else:
                            for t, letters in operands:
                                p = self.placement(t)[i]
                                if t.kind != "weight" and isinstance(p, Shard) and p.label in t.labels:
                                    label = letters[t.labels.index(p.label)]
                                    break
            if label is not None and label in op.unsharded:
                label = None
            chosen.append(label)
        return tuple(chosen)

    # -- ops --------------------------------------------------------------------------------------

    def run(self, op: Op, phase: str) -> None:
        if op.kind == "view":
            self._view(op)
            return
        labels = self.choose(op)
        operands = self._operands(op)
        partial = self._partial_axes(op, labels)
        local_inputs: list[Tensor] = []
        deps: list[int] = []
        for t, letters in operands:
            want = tuple(PARTIAL if keep else
                         Shard(t.labels[letters.index(l)]) if l is not None and l in letters else REPLICATE
                         for l, keep in zip(labels, partial))
            if t.kind == "weight":
                want = tuple(w if a == TENSOR_AXIS else REPLICATE for w, a in zip(want, BLOCK_AXES))
            lt = self.redistribute(t, want, phase)
            local_inputs.append(lt)
            deps.extend(self.producers.get(lt, ()))

        def local(letter: str, _labels=labels) -> sp.Expr:
            n = LABEL_SIZE[letter]
            for axis, l in zip(BLOCK_AXES, _labels):
                if l == letter:
                    n = n / _degree(axis)
            return n

        out_letters = self._out_letters(op)
        out_pls: list[Placements] = []
        for out, letters in zip(op.outputs, out_letters):
            pl = []
            for l, keep in zip(labels, partial):
                if keep:
                    pl.append(PARTIAL)
                elif l is None:
                    pl.append(REPLICATE)
                elif l in letters:
                    pl.append(Shard(out.labels[letters.index(l)]))
                elif op.kind == "cross_entropy":
                    pl.append(REPLICATE)  # the loss is all-reduced inside the op (below)
                else:
                    pl.append(PARTIAL)
            out_pls.append(tuple(pl))

        out_numel = local_numel(op.outputs[0], out_pls[0])
        flops, model_flops = op_flops(op, local, out_numel)
        mem = op.memory_passes * sp.Add(*(local_bytes(t, self.placements[t]) for t in local_inputs),
                                        *(local_bytes(o, p) for o, p in zip(op.outputs, out_pls)))
        idx = len(self.steps)
        self.steps.append(Step(idx, op.name, phase, "compute", op.kind, flops,
                               model_flops if phase != "recompute" else sp.Integer(0), mem,
                               tuple(sorted(set(deps))),
                               matmul=op.kind in ("einsum", "attention", "attention_grad")))
        last = (idx,)
        if op.kind == "cross_entropy":
            # Vocabulary-parallel cross-entropy: the max, the sum of exponentials and the target
            # logit are reductions over the sharded vocabulary, one all-reduce of (b, s) each.
            loss = op.outputs[0]
            for i, (axis, l) in enumerate(zip(BLOCK_AXES, labels)):
                if axis == TENSOR_AXIS and l is not None and l not in loss.labels:
                    for what in ("max", "sum_exp", "target_logit"):
                        j = self._collective(f"{op.name}.{what}.ar_{axis}", Collective.ALL_REDUCE, axis,
                                             local_numel(loss, out_pls[0]) * DTYPE_BYTES["fp32"],
                                             last, phase)
                        last = (j,)
        for out, pl in zip(op.outputs, out_pls):
            self.placements[out] = pl
            self.producers[out] = last if out is op.outputs[0] else (idx,)

    def _partial_axes(self, op: Op, labels: tuple[str | None, ...]) -> tuple[bool, ...]:
        """Axes on which a sum stays a partial sum: a linear op outside the residual stream whose
        every input is partial there (two row-parallel outputs added before their one
        reduction, as a parallel-residual layer does)."""
        if not op.passthrough or op.residual:
            return (False,) * len(BLOCK_AXES)
        return tuple(l is None and all(isinstance(self.placement(t)[i], Partial) for t in op.inputs)
                     for i, l in enumerate(labels))

    def _view(self, op: Op) -> None:
        """Splits and joins move no data; placements follow the labels through."""
        base = op.inputs[0]
        pl = self.placement(base)
        deps: list[int] = list(self.producers.get(base, ()))
        for other in op.inputs[1:]:
            want = tuple(p if not isinstance(p, Shard) or p.label in other.labels else REPLICATE for p in pl)
            lt = self.redistribute(other, want, self.phase_default)
            deps.extend(self.producers.get(lt, ()))
        for out in op.outputs:
            out_pl = []
            for p in pl:
                if isinstance(p, Shard) and p.label not in out.labels:
                    raise ValueError(f"{op.name}: cannot carry {p} into {out.labels}")
                out_pl.append(p)
            self.placements[out] = tuple(out_pl)
            self.producers[out] = tuple(sorted(set(deps)))


def _selective_region(block: Block) -> tuple[list[Op], set[int]]:
    """The attention-core ops that selective recomputation replays, and the ids of the tensors
    that leave that region (its checkpointed outputs, which are kept rather than replayed)."""
    core = [op for op in block.ops if op.attention_core]
    # Flash attention never stores the score matrix: nothing to gain by replaying it.
    if any(op.kind == "attention" for op in core):
        return [], set()
    inside = {id(op) for op in core}
    produced = {id(t) for op in core for t in op.outputs}
    leaving = {id(t) for op in block.ops if id(op) not in inside for t in op.inputs if id(t) in produced}
    return core, leaving


def _backward_order(block: Block, bwd_ops: list[Op], recompute: str) -> tuple[list[tuple[str, Op]], set[int]]:
    """Backward ops, with the forward ops that recomputation replays placed where needed, and
    the ids of the forward tensors those replays reproduce (not kept from the forward)."""
    if recompute == "full":
        replayed = {id(t) for op in block.ops for t in op.outputs}
        return [("recompute", op) for op in block.ops] + [("bwd", op) for op in bwd_ops], replayed
    if recompute == "selective":
        core, leaving = _selective_region(block)
        replayed = {id(t) for op in core for t in op.outputs} - leaving
        order: list[tuple[str, Op]] = []
        pending = bool(core)
        for op in bwd_ops:
            if pending and any(id(t) in replayed for t in op.inputs):
                order.extend(("recompute", c) for c in core)
                pending = False
            order.append(("bwd", op))
        return order, replayed
    return [("bwd", op) for op in bwd_ops], set()


def shard_block(block: Block, policy: ShardingPolicy) -> ShardedBlock:
    """The per-rank forward and backward programs of ``block`` under ``policy``."""
    backward = differentiate(block)
    placements: dict[Tensor, Placements] = {}
    for t in block.inputs:
        # Block inputs arrive in the residual-stream layout (token ids replicated over tp).
        tp = Shard("s") if (policy.sp and t.residual) else REPLICATE
        placements[t] = (tp, Shard("b"))

    fwd = _Pass(policy, "fwd", placements, block.weights)
    for op in block.ops:
        fwd.run(op, "fwd")
    fwd_exit = tuple(sorted({i for t in block.outputs for i in fwd.producers.get(t, ())}))

    # The backward pass starts from the gradients of the block's outputs, placed like the outputs.
    for out, g in backward.output_grads.items():
        placements[g] = tuple(REPLICATE if isinstance(p, Partial) else p for p in placements[out])
    bwd = _Pass(policy, "bwd", placements, block.weights)
    order, recomputed = _backward_order(block, backward.ops, policy.recompute)
    for phase, op in order:
        bwd.run(op, phase)
    bwd_exit = tuple(sorted({i for g in backward.input_grads.values() for i in bwd.producers.get(g, ())}))

    # Activations the backward reads that it did not recompute: held from forward to backward.
    forward_tensors = {id(t): t for t in block.inputs}
    forward_tensors.update({id(t): t for op in block.ops for t in op.outputs})
    saved: dict[int, Tensor] = {}
    for phase, op in order:
        for t in op.inputs:
            if id(t) in forward_tensors and id(t) not in recomputed and t.kind != "weight":
                saved[id(t)] = t
    saved_bytes = sp.Add(*(local_bytes(t, placements[t]) for t in saved.values()))
    workspace = sp.Integer(0)
    if policy.recompute == "full":
        workspace = sp.Add(*(local_bytes(forward_tensors[i], placements[forward_tensors[i]])
                             for i in recomputed))

    weight_syncs = _weight_syncs(block, backward.weight_grads, placements, policy, bwd)
    boundary = sp.Add(*(local_bytes(t, placements[t]) for t in block.outputs))
    return ShardedBlock(block, policy, fwd.steps, bwd.steps, fwd_exit, bwd_exit, saved_bytes,
                        workspace, weight_syncs, boundary)


def _weight_syncs(block: Block, weight_grads: dict[Tensor, Tensor], placements: dict[Tensor, Placements],
                  policy: ShardingPolicy, bwd: _Pass) -> list[WeightSync]:
    """Weight-gradient reductions, derived from placements like every other collective.

    The optimizer wants each gradient where the weight lives over tp, and replicated (ZeRO 0)
    or sharded (ZeRO 1-3) over dp. ZeRO-3 reduce-scatters over dp every micro-batch, at the end
    of the block's backward; everything else accumulates locally and is reduced once per step.
    """
    syncs: list[WeightSync] = []
    per_microbatch = sp.Integer(0)
    for w in block.weights:
        tp_target: Placement = Shard(w.tp_shard) if w.tp_shard else REPLICATE
        dp_target: Placement = Shard(w.labels[0]) if policy.zero >= 1 else REPLICATE
        params = local_numel(w, (tp_target, REPLICATE))
        g = weight_grads.get(w)
        colls: list[tuple[str, Collective, sp.Expr]] = []
        if g is not None:
            g32 = Tensor(g.name, g.labels, policy.grad_reduce_dtype, g.kind)
            cur = placements[g]
            for i, (axis, target) in enumerate(zip(BLOCK_AXES, (tp_target, dp_target))):
                coll = collective_for(cur[i], target)
                if coll is not None:
                    if policy.zero == 3 and axis == BATCH_AXIS:
                        per_microbatch += local_bytes(g32, cur)
                    else:
                        colls.append((axis, coll, local_bytes(g32, cur)))
                cur = cur[:i] + (target,) + cur[i + 1:]
        syncs.append(WeightSync(w, params, tuple(colls)))
    if per_microbatch != 0:
        deps = tuple(sorted({i for g in weight_grads.values() for i in bwd.producers.get(g, ())}))
        bwd._collective(f"{block.name}.grad_rs_dp", Collective.REDUCE_SCATTER, BATCH_AXIS,
                        per_microbatch, deps, "bwd")
    return syncs


def iter_steps(sb: ShardedBlock) -> Iterable[Step]:
    yield from sb.fwd
    yield from sb.bwd
