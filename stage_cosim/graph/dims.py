"""Named tensor dimensions and their symbolic sizes.

Every tensor dimension is a one-letter label, so an einsum spec names the same dimensions as
the tensors it reads (``"bsh,hf->bsf"``). A label's size is a sympy expression over the model
and batch symbols below; a per-rank size divides it by the parallel degree of every mesh axis
that shards it.
"""

from __future__ import annotations

import sympy as sp

# Model and batch symbols (positive integers, so sympy simplifies divisions sensibly).
B, S, H, F, G, Q, D, V, P = sp.symbols("b s h f g q d v p", positive=True, integer=True)
# Keys each query attends to: the sequence in a global-attention layer, min(sequence, window)
# in a sliding-window layer. Not a tensor dimension (keys and values still hold the whole
# sequence), only the extent of the score matrix a fused kernel computes; bound per layer.
W = sp.Symbol("w", positive=True, integer=True)

MODEL_SYMBOLS: dict[str, sp.Symbol] = {
    "micro_batch": B, "seq": S, "hidden": H, "ffn": F, "kv_heads": G,
    "query_groups": Q, "head_dim": D, "vocab": V, "max_seq": P, "attention_span": W,
}

def degree_symbol(axis: str) -> sp.Symbol:
    """The parallel degree of a mesh axis, as a symbol (``tp``, ``dp`` …)."""
    return sp.Symbol(axis, positive=True, integer=True)


LABEL_SIZE: dict[str, sp.Expr] = {
    # The logical batch of one micro-batch step spans every data-parallel replica, so that
    # Shard("b") over dp leaves each rank its own micro-batch b.
    "b": B * degree_symbol("dp"),
    "s": S,            # sequence (queries)
    "t": S,            # sequence of keys/values (same length, its own label in attention)
    "h": H,            # hidden
    "f": F,            # MLP intermediate
    "u": sp.Integer(2),  # the gate/up pair of a SwiGLU input projection
    "g": G,            # key/value heads (query groups)
    "q": Q,            # query heads per key/value head
    "r": Q + 2,        # fused QKV slots per group: q queries, one key, one value
    "d": D,            # head dimension
    "v": V,            # vocabulary
    "p": P,            # learned position table
}

LABEL_MEANING: dict[str, str] = {
    "b": "micro-batch", "s": "sequence", "t": "key sequence", "h": "hidden", "f": "ffn",
    "u": "gate/up", "g": "kv heads", "q": "queries per kv head", "r": "qkv slots",
    "d": "head dim", "v": "vocab", "p": "positions",
}

DTYPE_BYTES: dict[str, int | sp.Rational] = {
    "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "u8": 1, "i32": 4, "i64": 8,
    # Quantized FP8 data with its scales, per element: MXFP8 keeps one E8M0 byte per 32
    # elements; blockwise FP8 (DeepSeek-V3's recipe) one fp32 scale per 1x128 tile of an
    # activation or gradient and per 128x128 block of a weight. Per-tensor FP8 ("fp8") has one
    # scale per tensor, nothing per element.
    "mxfp8": sp.Rational(33, 32), "fp8_1x128": sp.Rational(33, 32), "fp8_128x128": 1 + sp.Rational(1, 4096),
}


def model_values(model: "ModelConfig", micro_batch: int, seq: int,  # noqa: F821
                 window: int | None = None) -> dict[sp.Symbol, int]:
    """Bind the model and batch symbols to numbers (for a layer with sliding ``window``, if given)."""
    return {B: micro_batch, S: seq, H: model.hidden, F: model.ffn, G: model.kv_heads,
            Q: model.query_groups, D: model.head_dim, V: model.vocab, P: model.max_seq,
            W: seq if window is None else min(seq, window)}
