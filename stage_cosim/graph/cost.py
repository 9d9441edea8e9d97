"""FLOPs and bytes of one op on one rank, as sympy expressions of its local (sharded) sizes."""

from __future__ import annotations

from typing import Callable

import sympy as sp

from stage_cosim.graph.dims import DEQUANTIZED_FLOPS, DTYPE_BYTES, U, W
from stage_cosim.graph.ir import ATTENTION_KINDS, Op

# local_size(label_letter_of_this_op) -> per-rank size of that dimension for this op
LocalSize = Callable[[str], sp.Expr]


def einsum_flops(op: Op, local: LocalSize) -> sp.Expr:
    letters, out = op.einsum_operands()
    every = sorted(set("".join(letters) + out))
    return 2 * sp.Mul(*(local(c) for c in every))


# Elementwise work per score of soft-capping, cap * tanh(x / cap): divide, tanh, multiply
# (forward), and its derivative (backward).
SOFTCAP_FLOPS_PER_SCORE = 3
# ALiBi (Press et al. 2022, BLOOM): each score gets its head's slope times the query-key
# distance added, a multiply and an add per score, in the forward and again where the backward
# recomputes the scores.
ALIBI_FLOPS_PER_SCORE = 2


def attention_scores(op: Op, local: LocalSize) -> sp.Expr:
    """Scores a fused kernel computes: every query against the keys it attends to (``W``: the
    whole sequence, the sliding window, or its chunk on average)."""
    return local("b") * local("s") * W * local("g") * local("q")


def causal_fraction() -> sp.Expr:
    """The unmasked share of the scores under a causal mask: with a window of w keys a query
    sees min(i + 1, w) of them, s*w - w^2/2 pairs in all, i.e. 1 - w/(2s) (1/2 for w = s); in a
    chunked layer 1/2 of each chunk's square. Bound per layer (:func:`dims.attention_extent`)."""
    return U


def attention_flops(op: Op, local: LocalSize) -> sp.Expr:
    """QK^T and PV over the score matrix (s x s for global attention, s x w with a window):
    the scores over the query/key head dimension, the values over the value head dimension
    (the same label but in multi-latent attention)."""
    qk, v = op.spec.split(",") if op.spec else ("d", "d")
    return 2 * attention_scores(op, local) * (local(qk) + local(v))


def op_flops(op: Op, local: LocalSize, out_numel: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """(executed FLOPs, model FLOPs) of ``op``. Model FLOPs follow the convention of the
    published formulas: matmuls only, backward twice the forward, no recomputation."""
    if op.kind == "einsum":
        f = einsum_flops(op, local)
        return f + dequantize_flops(op, local), f
    # A causal kernel skips the masked half of the score matrix; the model-FLOP convention of the
    # published formulas still counts all of it.
    if op.kind in ATTENTION_KINDS:
        f = attention_flops(op, local)
        # Flash attention's backward: four matmuls plus recomputing QK^T (2.5x the forward).
        executed = f if op.kind == "attention" else sp.Rational(5, 2) * f
        # Soft-capped scores cost elementwise work inside the kernel (not model FLOPs).
        if op.softcap:
            executed += SOFTCAP_FLOPS_PER_SCORE * attention_scores(op, local)
        if op.alibi:
            executed += ALIBI_FLOPS_PER_SCORE * attention_scores(op, local)
        if op.causal:
            executed *= causal_fraction()
        return executed, (f if op.kind == "attention" else 2 * f)
    return op.flops_per_element * out_numel, sp.Integer(0)


def dequantize_flops(op: Op, local: LocalSize) -> sp.Expr:
    """Work a GEMM does to dequantize the weight-only quantized operands it reads, once per
    element loaded (executed FLOPs of the GEMM's own kernel; not model FLOPs)."""
    letters, _ = op.einsum_operands()
    return sp.Add(*(DEQUANTIZED_FLOPS[t.dtype] * sp.Mul(*(local(c) for c in l))
                    for t, l in zip(op.inputs, letters) if t.dtype in DEQUANTIZED_FLOPS))


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
