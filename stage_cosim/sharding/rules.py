"""The op-kind rule registry: how sharding flows through each kind of op.

Every op kind has one :class:`Rule`, looked up by :func:`rule_for`; a kind without a rule of
its own follows the generic one (the base class), which states Megatron's strategy as placement
rules. For every op and every mesh axis that shards tensors inside a block (the table
:data:`~stage_cosim.parallel.axes.AXES`), one label is chosen as the op's *sharded label* on
that axis (:func:`choose`), in two rules:

* a *label axis* shards its label whenever the op touches it (``dp``: the micro-batch ``b``);
* the *tensor-parallel* rule (``tp``): the label a weight operand (or weight-gradient result) is
  sharded on; otherwise the residual-stream layout for ops that run in it (``s`` with sequence
  parallelism, nothing without); otherwise whatever label an activation input is already
  sharded on.

An op that cannot run with that label sharded (a norm over ``h``) gets none. An op runs on
the mesh its results live on (the dense mesh, or for expert layers the expert mesh) and only
that mesh's axes shard it; a tensor's placement on the other mesh's axes is None.

Each operand must then be ``Shard(label)`` if it has the label and ``Replicate()`` if not, and
the result is ``Shard(label)`` if it keeps the label and ``Partial()`` if the op summed it away.
Where an operand's current placement differs from the required one, the redistribution
(:mod:`stage_cosim.sharding.redistribute`) is the collective. The backward pass is propagated
by the same rules, so Megatron's conjugate collectives, the sequence-parallel re-gathers and the
ZeRO-3 re-gathers are derived rather than listed.

A new op kind is a rule registered for it: a subclass of :class:`Rule` that overrides the
generic rule's hooks (:meth:`Rule.summed_away`, :meth:`Rule.flops`, :meth:`Rule.groups`,
:meth:`Rule.reductions`, :meth:`Rule.mem_bytes`, the ``matmul`` and ``key_share`` attributes)
where the op is a small variation on it, or :meth:`Rule.run` where it moves data its own way::

    @register("cross_entropy")
    class CrossEntropy(Rule):
        def summed_away(self, out):
            return REPLICATE          # the loss is all-reduced inside the op

The rules of the op families live with them: this module's (the generic rule, views, GEMMs,
lookups, the loss), :mod:`~stage_cosim.sharding.dispatch` (the MoE token dispatcher's) and
:mod:`~stage_cosim.sharding.context_parallel` (fused attention, with its exchange over cp).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import sympy as sp

from stage_cosim.graph.cost import op_flops
from stage_cosim.graph.dims import DTYPE_BYTES, L, degree_symbol
from stage_cosim.graph.ir import Op, Tensor
from stage_cosim.parallel.axes import AXIS, BLOCK_AXES
from stage_cosim.sharding.layout import (
    DATA_PARALLEL, Placements, local_bytes, local_numel, local_size, on_mesh, residual_label,
)
from stage_cosim.sharding.placement import PARTIAL, REPLICATE, Collective, Partial, Placement, Shard
from stage_cosim.sharding.redistribute import PassState
from stage_cosim.sharding.steps import Step


class Rule:
    """How sharding flows through ops of one kind. This base class is the generic rule; its
    hooks are the points where an op kind may differ from it."""

    # A matmul-class kernel: it computes in the op's tensor-core format (its precision, bf16
    # by default), and counts among the FLOPs the published formulas count.
    matmul: bool = False
    # Fused attention kernels: the length of each thread block's loop as a share of the layer's
    # keys (see Step.key_share).
    key_share: float = 0.0

    def run(self, pas: PassState, op: Op, phase: str) -> None:
        """Propagate ``op``: its operands redistributed as its sharded labels require, its
        kernel, the reductions it does itself, its results' placements."""
        labels = choose(pas, op)
        partial = partial_axes(pas, op, labels)
        on = on_mesh(op.mesh)
        local_inputs: list[Tensor] = []
        deps: list[int] = [i for t in op.after for i in pas.producers.get(t, ())]
        for t, letters in operands(op):
            want = tuple(None if not here else PARTIAL if keep else
                         Shard(t.labels[letters.index(l)]) if l is not None and l in letters else REPLICATE
                         for l, keep, here in zip(labels, partial, on))
            if t.kind == "weight":   # replicas over the data-parallel axes (ZeRO-3 gathered them)
                want = tuple(REPLICATE if dpar and w is not None else w for w, dpar in zip(want, DATA_PARALLEL))
            lt = pas.redistribute(t, want, phase)
            local_inputs.append(lt)
            deps.extend(pas.producers.get(lt, ()))

        local = local_size(labels)
        out_pls: list[Placements] = []
        for out, letters in zip(op.outputs, op.letters()[1]):
            pl: list[Placement | None] = []
            for l, keep, here in zip(labels, partial, on):
                if not here:
                    pl.append(None)
                elif keep:
                    pl.append(PARTIAL)
                elif l is None:
                    pl.append(REPLICATE)
                elif l in letters:
                    pl.append(Shard(out.labels[letters.index(l)]))
                else:
                    pl.append(self.summed_away(out))
            out_pls.append(tuple(pl))

        out_numel = local_numel(op.outputs[0], out_pls[0])
        flops, model_flops = op_flops(op, local, out_numel)
        # Model FLOPs count each distinct computation once: an op that an axis does not shard
        # (a router without sequence parallelism; the logits of an inference step's last tokens,
        # which no longer have a sequence for cp to split) is repeated on every rank of it.
        for axis, l, here in zip(BLOCK_AXES, labels, on):
            if here and l is None:
                model_flops = model_flops / degree_symbol(axis)
        flops = self.flops(pas, op, flops)
        idx = self.compute(pas, op, phase, local_inputs, out_pls, flops, model_flops, deps)
        if (groups := self.groups(op, local)) is not None:
            pas.steps[idx].groups = groups
        last = (idx,)
        if op.amax_group:
            # current scaling of a tensor gathered over a group: one max all-reduce of its amax
            for axis in op.amax_group:
                j = pas.collective(f"{op.name}.amax.ar_{axis}", Collective.ALL_REDUCE, (axis,),
                                   sp.Integer(DTYPE_BYTES["fp32"]), last, phase)
                pas.steps[j].first_microbatch = op.cached and phase == "fwd"
                last = (j,)
        last = self.reductions(pas, op, labels, out_pls, last, phase)
        for out, pl in zip(op.outputs, out_pls):
            pas.placements[out] = pl
            reduced = out is op.outputs[0] if not op.amax_group else out is op.outputs[-1]
            pas.producers[out] = last if reduced else (idx,)

    def compute(self, pas: PassState, op: Op, phase: str, local_inputs: list[Tensor], out_pls: list[Placements],
                flops: sp.Expr, model_flops: sp.Expr, deps: list[int]) -> int:
        """The kernel step of ``op``: its FLOPs, and the bytes it moves (:meth:`mem_bytes`)."""
        mem = self.mem_bytes(pas, op, local_inputs, out_pls)
        # Model FLOPs count balanced routing: the busiest expert rank's extra load is time, not work.
        model_flops = model_flops.subs(L, 1) if model_flops.has(L) else model_flops
        idx = len(pas.steps)
        matmul = (op.precision or "bf16") if self.matmul else ""
        pas.steps.append(Step(idx, op.name, phase, "compute", op.kind, flops,
                              model_flops if phase != "recompute" else sp.Integer(0), mem,
                              tuple(sorted(set(deps))), matmul=matmul,
                              first_microbatch=op.cached and phase == "fwd", key_share=self.key_share))
        return idx

    # -- hooks of the generic rule -------------------------------------------------------------

    def summed_away(self, out: Tensor) -> Placement:
        """``out``'s placement on an axis whose sharded label the op summed away: a partial sum,
        but an amax is each rank's own (or its group's, reduced by the op's ``amax_group``)."""
        return REPLICATE if out.kind == "amax" else PARTIAL

    def flops(self, pas: PassState, op: Op, flops: sp.Expr) -> sp.Expr:
        """The FLOPs of this rank's kernel (``flops``: as the op's sharded shape has them), as
        the step waits for them."""
        return flops

    def groups(self, op: Op, local: Callable[[str], sp.Expr]) -> sp.Expr | None:
        """The kernel's :attr:`Step.groups` (None: one); ``local``: label -> size on this rank."""
        return None

    def reductions(self, pas: PassState, op: Op, labels: tuple[str | None, ...], out_pls: list[Placements],
                   last: tuple[int, ...], phase: str) -> tuple[int, ...]:
        """Collectives the op runs itself after its kernel (``last``: the steps so far); returns
        the steps its reduced result is ready after."""
        return last

    def mem_bytes(self, pas: PassState, op: Op, local_inputs: list[Tensor], out_pls: list[Placements]) -> sp.Expr:
        """The bytes the kernel reads and writes: its local inputs and outputs, as many times as
        it streams them."""
        return op.memory_passes * sp.Add(*(local_bytes(t, pas.placements[t]) for t in local_inputs),
                                         *(local_bytes(o, p) for o, p in zip(op.outputs, out_pls)))


# -- the registry ----------------------------------------------------------------------------

RULES: dict[str, Rule] = {}
GENERIC = Rule()

_R = TypeVar("_R", bound=type[Rule])


def register(*kinds: str) -> Callable[[_R], _R]:
    """Class decorator: the rule for ops of ``kinds``."""

    def add(cls: _R) -> _R:
        for kind in kinds:
            if kind in RULES:
                raise ValueError(f"op kind {kind!r} already has a rule ({type(RULES[kind]).__name__})")
            RULES[kind] = cls()
        return cls

    return add


def rule_for(kind: str) -> Rule:
    """The rule for ops of ``kind`` (the generic rule if it has none of its own)."""
    return RULES.get(kind, GENERIC)


# -- the sharded label of an op on each axis -------------------------------------------------


def operands(op: Op) -> list[tuple[Tensor, str]]:
    """(tensor, the letters the op calls its dimensions) for every input."""
    return list(zip(op.inputs, op.letters()[0]))


def choose(pas: PassState, op: Op) -> tuple[str | None, ...]:
    """The op's sharded label on each block axis (None: not sharded on it)."""
    ins = operands(op)
    all_letters = set("".join(l for _, l in ins) + "".join(op.letters()[1]))
    chosen: list[str | None] = []
    for i, axis in enumerate(BLOCK_AXES):
        if AXIS[axis].mesh != op.mesh:
            chosen.append(None)
            continue
        label = AXIS[axis].shards
        if label is None:
            label = _tensor_parallel_label(pas, op, ins, i)
        elif label not in all_letters:
            # an op over the cached key sequence alone (inference): the axis's key label
            label = AXIS[axis].keys if AXIS[axis].keys and AXIS[axis].keys in all_letters else None
        if label is not None and (label in op.unsharded or axis in op.replicated_over):
            label = None
        chosen.append(label)
    return tuple(chosen)


def _tensor_parallel_label(pas: PassState, op: Op, ins: list[tuple[Tensor, str]], i: int) -> str | None:
    """Megatron's tensor parallelism: a weight operand's (or weight-gradient result's)
    shard label; else the residual-stream layout; else what an activation input is
    already sharded on over this axis."""
    for t, letters in ins:
        if t.kind == "weight" and t.tp_shard:
            return letters[t.labels.index(t.tp_shard)]
    for out in op.outputs:
        if out.kind == "weight_grad" and out.tp_shard:
            return out.tp_shard
    if op.residual:
        return residual_label(pas.policy)
    for t, letters in ins:
        p = pas.placement(t)[i]
        if t.kind != "weight" and isinstance(p, Shard) and p.label in t.labels:
            return letters[t.labels.index(p.label)]
    return None


def partial_axes(pas: PassState, op: Op, labels: tuple[str | None, ...]) -> tuple[bool, ...]:
    """Axes on which a sum stays a partial sum: a linear op outside the residual stream whose
    every input is partial there (two row-parallel outputs added before their one
    reduction, as a parallel-residual layer does)."""
    if not op.passthrough or op.residual:
        return (False,) * len(BLOCK_AXES)
    return tuple(l is None and all(isinstance(pas.placement(t)[i], Partial) for t in op.inputs)
                 for i, l in enumerate(labels))


# -- the rules of the dense ops --------------------------------------------------------------


@register("view")
class View(Rule):
    def run(self, pas: PassState, op: Op, phase: str) -> None:
        """Splits and joins move no data; placements follow the labels through."""
        base = op.inputs[0]
        pl = pas.placement(base)
        deps: list[int] = list(pas.producers.get(base, ()))
        for other in op.inputs[1:]:
            want = tuple(p if not isinstance(p, Shard) or p.label in other.labels else REPLICATE for p in pl)
            lt = pas.redistribute(other, want, pas.phase_default)
            deps.extend(pas.producers.get(lt, ()))
        for out in op.outputs:
            out_pl = []
            for p in pl:
                if isinstance(p, Shard) and p.label not in out.labels:
                    raise ValueError(f"{op.name}: cannot carry {p} into {out.labels}")
                out_pl.append(p)
            pas.placements[out] = tuple(out_pl)
            pas.producers[out] = tuple(sorted(set(deps)))


@register("einsum")
class Einsum(Rule):
    matmul = True

    def groups(self, op: Op, local: Callable[[str], sp.Expr]) -> sp.Expr | None:
        """The experts' GEMMs are one grouped GEMM over the experts this rank holds."""
        if "e" in "".join(op.einsum_operands()[0]) and op.mesh != "dense":
            return local("e")
        return None


@register("lookup")
class Lookup(Rule):
    def mem_bytes(self, pas: PassState, op: Op, local_inputs: list[Tensor], out_pls: list[Placements]) -> sp.Expr:
        """A gather reads the rows its indices pick, as many as it writes, not the whole table."""
        rows = local_bytes(op.outputs[0], out_pls[0])
        return local_bytes(local_inputs[1], pas.placements[local_inputs[1]]) + 2 * rows


@register("cross_entropy")
class CrossEntropy(Rule):
    def summed_away(self, out: Tensor) -> Placement:
        return REPLICATE      # the loss is all-reduced inside the op (reductions)

    def reductions(self, pas: PassState, op: Op, labels: tuple[str | None, ...], out_pls: list[Placements],
                   last: tuple[int, ...], phase: str) -> tuple[int, ...]:
        """Vocabulary-parallel cross-entropy: the max, the sum of exponentials and the target
        logit are reductions over the sharded vocabulary, one all-reduce of (b, s) each."""
        loss = op.outputs[0]
        for axis, l in zip(BLOCK_AXES, labels):
            if l is not None and l not in loss.labels:
                for what in ("max", "sum_exp", "target_logit"):
                    j = pas.collective(f"{op.name}.{what}.ar_{axis}", Collective.ALL_REDUCE, (axis,),
                                       local_numel(loss, out_pls[0]) * DTYPE_BYTES["fp32"], last, phase)
                    last = (j,)
        return last
