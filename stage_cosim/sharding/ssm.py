"""The rule of the state-space scan (``ssm_scan`` and its backward): the generic placement rule
with the scan's own work, and the state handed between context-parallel ranks.

Over tp the scan runs on its rank's head groups (the weights A and D are sharded on them, so the
generic rule picks that label). Over cp every rank scans its own piece of the sequence from a
zero state; the true state entering a piece is the previous ranks' final states, each decayed
through the pieces after it. Each rank's final state (and its piece's total decay, a scalar
per head) is all-gathered over cp, every rank combines those of the ranks before it and
corrects its output with C times the decayed entering state (2 s N P FLOPs per head, a second
pass over its output, a step after the gather). An all-gather rather than a chain of sends: a chain would wait for
cp - 1 hops in turn, and the same bytes reach every rank at once this way. The backward
hands the state's gradient the other way, with the same collective.
"""

from __future__ import annotations

import sympy as sp

from stage_cosim.graph.dims import DTYPE_BYTES, degree_symbol
from stage_cosim.graph.ir import Op, Tensor
from stage_cosim.graph.ssm import SELECTIVE, scan_flops
from stage_cosim.parallel.axes import BLOCK_AXES
from stage_cosim.sharding.layout import Placements, local_numel, local_size
from stage_cosim.sharding.placement import REPLICATE, Collective, Placement
from stage_cosim.sharding.redistribute import PassState
from stage_cosim.sharding.rules import Rule, choose, register
from stage_cosim.sharding.steps import Step

# Chunk states of the chunked scans are written by one kernel and read by the next (chunk
# state, state passing, chunk scan: written, read and written, read): four fp32 passes.
CHUNK_STATE_PASSES = 4
# The backward recomputes the forward's chunk states and runs each product's two gradients.
BACKWARD_MATMUL_FACTOR = 2


def _cp_active() -> sp.Expr:
    """1 with context parallelism, 0 without (the hand-off exists only between ranks)."""
    return sp.Min(degree_symbol("cp") - 1, 1)


def _work(op: Op, labels: tuple[str | None, ...]) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """(matmul FLOPs, elementwise FLOPs, the cp correction's FLOPs) of this rank's kernel."""
    local = local_size(labels)
    mm, elementwise = scan_flops(op.spec, local)
    if op.kind == "ssm_scan_grad":
        mm, elementwise = BACKWARD_MATMUL_FACTOR * mm + mm, 2 * elementwise
    b, s = local("b"), local("s")
    if op.spec == SELECTIVE:
        correction = 2 * b * s * local("I") * local("N")
    else:
        correction = 2 * b * s * local("G") * local("R") * local("P") * local("N")
    return mm, elementwise, correction * _cp_active()


@register("ssm_scan", "ssm_scan_grad")
class Scan(Rule):
    """A chunked (or selective) scan; tensor-core work for the chunked forms."""

    def summed_away(self, out: Tensor) -> Placement:
        # the final state has no sequence: after the hand-off each rank holds its own piece's
        return REPLICATE if out.kind == "activation" else super().summed_away(out)

    def compute(self, pas: PassState, op: Op, phase: str, local_inputs: list[Tensor], out_pls: list[Placements],
                flops: sp.Expr, model_flops: sp.Expr, deps: list[int]) -> int:
        labels = choose(pas, op)
        mm, elementwise, _ = _work(op, labels)
        mem = self.mem_bytes(pas, op, local_inputs, out_pls)
        if op.spec != SELECTIVE:
            local = local_size(labels)
            chunks = local("b") * local("s") / local("K") * local("G") * local("R") * local("P") * local("N")
            # a decode step (one position per sequence) runs the single-step state update instead
            # (read the state, write it: the cache input and the state output already counted)
            chunked = sp.Min(local("s") - 1, 1)
            mem += CHUNK_STATE_PASSES * chunks * DTYPE_BYTES["fp32"] * chunked
        idx = len(pas.steps)
        pas.steps.append(Step(idx, op.name, phase, "compute", op.kind, mm + elementwise,
                              mm if phase != "recompute" else sp.Integer(0), mem, tuple(sorted(set(deps))),
                              matmul=(op.precision or "bf16") if op.spec != SELECTIVE else ""))
        return idx

    def reductions(self, pas: PassState, op: Op, labels: tuple[str | None, ...], out_pls: list[Placements],
                   last: tuple[int, ...], phase: str) -> tuple[int, ...]:
        """The state's hand-off over cp (its gradient's, backward): each rank's final state
        all-gathered, then the correction of the rank's output (its gradient's) by the state
        entering its piece: a second pass over the output."""
        if labels[BLOCK_AXES.index("cp")] is None:
            return last
        local = local_size(labels)
        state = op.outputs[1] if op.kind == "ssm_scan" else op.grad_of.outputs[1]
        numel = sp.Mul(*(local(c) for c in state.labels))
        j = pas.collective(f"{op.name}.state.ag_cp", Collective.ALL_GATHER, ("cp",),
                           numel * DTYPE_BYTES["fp32"] * _cp_active(), last, phase)
        _, _, correction = _work(op, labels)
        out = op.outputs[0]
        out_bytes = local_numel(out, out_pls[0]) * DTYPE_BYTES[out.dtype] * 2 * _cp_active()
        k = len(pas.steps)
        pas.steps.append(Step(k, f"{op.name}.state_correction", phase, "compute", "pointwise", correction,
                              sp.Integer(0), out_bytes + numel * DTYPE_BYTES["fp32"] * _cp_active(), (j,)))
        return (k,)


__all__ = ["Scan"]
