"""FLOPs and bytes of one op on one rank, as sympy expressions of its local (sharded) sizes."""

from __future__ import annotations

from typing import Callable

import sympy as sp

from stage_cosim.graph.dims import DTYPE_BYTES, LABEL_SIZE
from stage_cosim.graph.ir import Op

# local_size(label_letter_of_this_op) -> per-rank size of that dimension for this op
LocalSize = Callable[[str], sp.Expr]


def einsum_flops(op: Op, local: LocalSize) -> sp.Expr:
    letters, out = op.einsum_operands()
    every = sorted(set("".join(letters) + out))
    return 2 * sp.Mul(*(local(c) for c in every))


def attention_flops(op: Op, local: LocalSize) -> sp.Expr:
    """QK^T and PV over the full s x s score matrix."""
    return 4 * local("b") * local("s") * LABEL_SIZE["t"] * local("g") * local("q") * local("d")


def op_flops(op: Op, local: LocalSize, out_numel: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """(executed FLOPs, model FLOPs) of ``op``. Model FLOPs follow the convention of the
    published formulas: matmuls only, backward twice the forward, no recomputation."""
    if op.kind == "einsum":
        f = einsum_flops(op, local)
        return f, f
    # A causal kernel skips the masked half of the score matrix; the model-FLOP convention of the
    # published formulas still counts all of it.
    if op.kind == "attention":
        f = attention_flops(op, local)
        return (f / 2 if op.causal else f), f
    if op.kind == "attention_grad":
        # Flash attention's backward: four matmuls plus recomputing QK^T (2.5x the forward).
        f = attention_flops(op, local)
        return sp.Rational(5, 2) * (f / 2 if op.causal else f), 2 * f
    return op.flops_per_element * out_numel, sp.Integer(0)


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
