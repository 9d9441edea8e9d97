"""Named tensor dimensions and their symbolic sizes.

Every tensor dimension is a one-letter label, so an einsum spec names the same dimensions as
the tensors it reads (``"bsh,hf->bsf"``). A label's size is a sympy expression over the model
and batch symbols below; a per-rank size divides it by the parallel degree of every mesh axis
that shards it.
"""

from __future__ import annotations

import sympy as sp

from stage_cosim.model.architecture import ChunkSpan

# Model and batch symbols (positive integers, so sympy simplifies divisions sensibly).
B, S, H, F, G, Q, D, V, P = sp.symbols("b s h f g q d v p", positive=True, integer=True)
# Keys each query attends to: the sequence in a global-attention layer, min(sequence, window)
# in a sliding-window layer. Not a tensor dimension (keys and values still hold the whole
# sequence), only the extent of the score matrix a fused kernel computes; bound per layer.
W = sp.Symbol("w", positive=True, integer=True)
# The unmasked share of those scores under a causal mask (what a flash kernel executes of them),
# bound per layer with W: 1 - w/(2s) for a window of w keys (1/2 for global attention), 1/2
# in a chunked layer (each chunk is a causal square).
U = sp.Symbol("causal_share", positive=True)
# Mixture of Experts: experts, experts per token, a routed expert's and the shared experts'
# intermediate sizes, and the load of the busiest expert rank over the mean (1: balanced
# routing; the imbalance or the capacity factor otherwise; not an integer).
E, K, FI, FJ = sp.symbols("e k f_e f_s", positive=True, integer=True)
L = sp.Symbol("moe_load", positive=True)
# Multi-latent attention: the query and key/value latent ranks, the query/key head dimension
# without and with the rotary part, the rotary part alone.
LQ, LKV, NOPE, ROPE = sp.symbols("q_lora kv_lora qk_nope qk_rope", positive=True, integer=True)
# Keys and values each sequence's attention reads: the sequence itself in training; in
# inference the context held in the KV cache (the prompt in a prefill, every token so far in a
# decode step), which is not the number of new tokens ``s``.
T = sp.Symbol("t", positive=True, integer=True)
# State-space and linear-attention mixers (Mamba-2, gated DeltaNet): head groups, heads per
# group, a head's dimension, the state dimension, the scan's chunk length, the depthwise
# convolution's kernel; Mamba-1: the inner width and the step size's rank.
SG, SR, SP, SN, SK, SX = sp.symbols("ssm_groups ssm_group_heads ssm_head_dim ssm_state ssm_chunk ssm_conv",
                                    positive=True, integer=True)
SI, SD = sp.symbols("ssm_inner ssm_dt_rank", positive=True, integer=True)

MODEL_SYMBOLS: dict[str, sp.Symbol] = {
    "micro_batch": B, "seq": S, "hidden": H, "ffn": F, "kv_heads": G,
    "query_groups": Q, "head_dim": D, "vocab": V, "max_seq": P, "attention_span": W, "causal_share": U,
    "num_experts": E, "moe_router_topk": K, "moe_ffn_hidden_size": FI,
    "moe_shared_expert_intermediate_size": FJ, "moe_load": L, "q_lora_rank": LQ, "kv_lora_rank": LKV,
    "qk_head_dim": NOPE, "qk_pos_emb_head_dim": ROPE,
    "context": T, "mamba_num_groups": SG, "mamba_group_heads": SR, "mamba_head_dim": SP,
    "mamba_state_dim": SN, "mamba_chunk_size": SK, "mamba_d_conv": SX, "mamba_inner": SI, "mamba_dt_rank": SD,
}

def degree_symbol(axis: str) -> sp.Symbol:
    """The parallel degree of a mesh axis, as a symbol (``tp``, ``dp`` …)."""
    return sp.Symbol(axis, positive=True, integer=True)


LABEL_SIZE: dict[str, sp.Expr] = {
    # The logical batch of one micro-batch step spans every data-parallel replica, so that
    # Shard("b") over dp leaves each rank its own micro-batch b.
    "b": B * degree_symbol("dp"),
    "s": S,            # sequence (queries)
    "t": T,            # keys/values per sequence (training: the sequence; inference: the cached context)
    "h": H,            # hidden
    "f": F,            # MLP intermediate
    "u": sp.Integer(2),  # the gate/up pair of a SwiGLU input projection
    "g": G,            # key/value heads (query groups)
    "q": Q,            # query heads per key/value head
    "r": Q + 2,        # fused QKV slots per group: q queries, one key, one value
    "d": D,            # head dimension
    "v": V,            # vocabulary
    "p": P,            # learned position table
    # Mixture of Experts. On the expert mesh a micro-batch's tokens are one label, "n" (the
    # same tokens as b x s on the dense mesh); routed to experts they become "e" x "c".
    "n": B * degree_symbol("dp") * S,   # tokens
    "k": K,            # experts each token is routed to
    "e": E,            # routed experts
    "c": B * degree_symbol("dp") * S * K * L / E,   # token slots per expert (balanced: n k / e)
    "i": FI,           # a routed expert's intermediate size
    "j": FJ,           # the shared experts' intermediate size
    # Multi-latent attention ("d" is the value head dimension there).
    "l": LQ,           # query latent
    "m": LKV,          # key/value latent
    "o": ROPE,         # rotary part of a query/key head (the key's is shared by all heads)
    "x": NOPE,         # query/key head without the rotary part
    "a": NOPE + ROPE,  # query/key head
    "y": LKV + ROPE,   # key/value down-projection: latent and the rotary key
    "z": NOPE + D,     # key/value up-projection per head: the key without rotary part, the value
    "w": H,            # hidden, as the output of a projection from hidden-sized inputs (MTP)
    # State-space / linear-attention mixers (upper case: the lower-case letters are taken).
    "G": SG,           # head groups (Mamba-2 n_groups; gated DeltaNet key heads)
    "R": SR,           # heads per group
    "P": SP,           # a head's dimension (gated DeltaNet: the value head's)
    "N": SN,           # state dimension (Mamba d_state; gated DeltaNet: the key head's)
    "K": sp.Min(SK, S),  # positions of a chunk of the chunked scan (a sequence shorter than a chunk is one)
    "X": SX,           # the depthwise convolution's kernel
    "I": SI,           # Mamba-1 inner width
    "D": SD,           # Mamba-1 step-size rank
}

LABEL_MEANING: dict[str, str] = {
    "b": "micro-batch", "s": "sequence", "t": "key sequence", "h": "hidden", "f": "ffn",
    "u": "gate/up", "g": "kv heads", "q": "queries per kv head", "r": "qkv slots",
    "d": "head dim", "v": "vocab", "p": "positions", "n": "tokens", "k": "routed slots per token",
    "e": "experts", "c": "tokens per expert", "i": "expert ffn", "j": "shared expert ffn",
    "l": "query latent", "m": "key/value latent", "o": "rotary head dim", "x": "query/key head dim without rotary",
    "a": "query/key head dim", "y": "key/value latent and rotary key", "z": "key without rotary and value",
    "w": "hidden (projected)", "G": "ssm head groups", "R": "ssm heads per group", "P": "ssm head dim",
    "N": "ssm state dim", "K": "scan chunk", "X": "conv kernel", "I": "mamba inner", "D": "mamba dt rank",
}

DTYPE_BYTES: dict[str, int | sp.Rational] = {
    "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "u8": 1, "i32": 4, "i64": 8,
    # Quantized FP8 data with its scales, per element: MXFP8 keeps one E8M0 byte per 32
    # elements; blockwise FP8 (DeepSeek-V3's recipe) one fp32 scale per 1x128 tile of an
    # activation or gradient and per 128x128 block of a weight. Per-tensor FP8 ("fp8") has one
    # scale per tensor, nothing per element.
    "mxfp8": sp.Rational(33, 32), "fp8_1x128": sp.Rational(33, 32), "fp8_128x128": 1 + sp.Rational(1, 4096),
    # Weight-only 4-bit quantization (GPTQ, AWQ): half a byte per weight and an fp16 scale per
    # group of 128 weights.
    "int4_g128": sp.Rational(1, 2) + sp.Rational(2, 128),
}
# Weights that a BF16 GEMM dequantizes as it loads them (weight-only quantization), with the
# work per weight element (unpack, subtract the zero point, scale): inside the GEMM's kernel.
DEQUANTIZED_FLOPS: dict[str, int] = {"int4_g128": 3}


def model_values(model: "ModelConfig", micro_batch: int, seq: int,  # noqa: F821
                 window: int | None = None, moe_load: float = 1.0) -> dict[sp.Symbol, float]:
    """Bind the model and batch symbols to numbers (for a layer with sliding ``window``, or
    chunk, if given; with the busiest expert rank's load ``moe_load``). Symbols a model does not
    use (no experts, no latent attention) are bound to 1. Keys are the sequence itself
    (training); inference rebinds ``T`` and ``W``."""
    keys, share = attention_extent(seq, window)
    moe = model.num_experts is not None
    shared = model.moe_shared_expert_intermediate_size
    mla = model.multi_latent_attention
    return {B: micro_batch, S: seq, H: model.hidden, F: model.ffn, G: model.kv_heads,
            Q: model.query_groups, D: model.v_head_dim if mla else model.head_dim, V: model.vocab,
            P: model.max_seq, W: keys, U: share,
            E: model.num_experts if moe else 1, K: model.moe_router_topk if moe else 1,
            FI: model.expert_ffn if moe else 1, FJ: shared if moe and shared else 1, L: moe_load,
            LQ: model.q_lora_rank if mla and model.q_lora_rank else 1, LKV: model.kv_lora_rank if mla else 1,
            NOPE: model.qk_head_dim if mla else 1, ROPE: model.qk_pos_emb_head_dim if mla else 1, T: seq,
            **ssm_values(model, seq)}


def attention_extent(seq: int, window: int | None) -> tuple[float, float]:
    """(keys per query of the scores a fused kernel covers, the causal unmasked share of them)
    in a training sequence of ``seq`` tokens. A window of w keys: s x min(s, w) scores,
    1 - w/(2s) of them unmasked (the continuous count the global s^2/2 convention uses). A
    chunked layer (:class:`ChunkSpan` c): the sequence is full chunks and a remainder r, each a
    causal square, sum L^2 scores (so sum L^2 / s keys per query) of which half are unmasked;
    a flash kernel skips the blocks outside a query's chunk."""
    if isinstance(window, ChunkSpan):
        full, rest = divmod(seq, int(window))
        return (full * int(window) ** 2 + rest ** 2) / seq, 0.5
    keys = seq if window is None else min(seq, window)
    return keys, 1 - keys / (2 * seq)


def ssm_values(model: "ModelConfig", seq: int) -> dict[sp.Symbol, int]:  # noqa: F821
    """The state-space symbols of ``model`` (1 where it has no such layers)."""
    ssm = model.mamba_num_heads is not None
    return {SG: model.mamba_num_groups if ssm else 1,
            SR: model.mamba_num_heads // model.mamba_num_groups if ssm else 1,
            SP: model.mamba_head_dim if ssm else 1, SN: model.mamba_state_dim,
            SK: model.mamba_chunk_size, SX: model.mamba_d_conv,
            SI: model.mamba_inner or 1, SD: model.mamba_dt_rank}
