"""Hugging Face readers of the hybrid and state-space families: ``mamba2``, ``jamba``,
``nemotron_h``, ``qwen3_next``, ``falcon_h1``; ``zamba2`` is refused in one line (:data:`REFUSED`). Their layer patterns become data: one mixer kind and one MLP kind per layer
(:attr:`ModelConfig.layer_mixers`, :attr:`ModelConfig.layer_mlps`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from stage_cosim.model.architecture import (
    ATTENTION, ATTENTION_MAMBA2, DENSE_MLP, GATED_DELTANET, MAMBA, MAMBA2, MOE_MLP, NO_MIXER, NO_MLP,
)
from stage_cosim.model.hf_layers import sparse_layers

if TYPE_CHECKING:
    from stage_cosim.model.hf import HFConfig


def _mamba2_dims(c: "HFConfig", hidden: int, *, heads_key: str, head_dim_key: str, state_key: str,
                 head_dim: int = 64, state: int = 128, chunk: int = 256) -> dict[str, Any]:
    heads = c.int(heads_key, None, nullable=True)
    p = c.int(head_dim_key, head_dim)
    if heads is None:
        heads = c.int("expand", 2) * hidden // p
    return dict(mamba_num_heads=heads, mamba_head_dim=p, mamba_num_groups=c.int("n_groups", 1),
                mamba_state_dim=c.int(state_key, state), mamba_d_conv=c.int("conv_kernel", 4),
                mamba_chunk_size=c.int("chunk_size", chunk))


def _ssm_only(hidden: int, layers: int, ssm: dict[str, Any]) -> dict[str, Any]:
    """The attention and MLP fields of a model without either: unused (the SSM's heads and
    groups stand in for them, so they divide as the mixer's do), set so the config is valid."""
    return dict(heads=ssm["mamba_num_heads"], kv_heads=ssm["mamba_num_groups"], head_dim=ssm["mamba_head_dim"],
                ffn=hidden, layer_mlps=(NO_MLP,) * layers, **ssm)


def mamba2(c: "HFConfig") -> dict[str, Any]:
    """Hugging Face's Mamba2 (Mamba-Codestral): every layer a Mamba-2 mixer, no MLP."""
    c.refuse_if("rmsnorm", lambda v: v is False, "a Mamba-2 mixer without its gated RMSNorm is not modelled")
    hidden, layers = c.int("hidden_size"), c.int("num_hidden_layers")
    dims = _mamba2_dims(c, hidden, heads_key="num_heads", head_dim_key="head_dim", state_key="state_size")
    inner = c.int("expand", 2) * hidden
    if dims["mamba_num_heads"] * dims["mamba_head_dim"] != inner:
        # Hugging Face sizes the projections from expand x hidden_size and splits them into heads
        raise c.error("num_heads", dims["mamba_num_heads"],
                      f"times head_dim ({dims['mamba_head_dim']}) must be expand x hidden_size ({inner})")
    return dict(arch="llama", layers=layers, hidden=hidden, vocab=c.int("vocab_size"),
                max_seq=c.int("max_position_embeddings", 1 << 20), tied_embeddings=c.flag("tie_word_embeddings", True),
                norm="rmsnorm", mlp="swiglu", position="rope", layer_mixers=(MAMBA2,) * layers,
                ssm_conv_bias=c.flag("use_conv_bias", True), ssm_proj_bias=c.flag("use_bias", False),
                **_ssm_only(hidden, layers, dims))


def jamba(c: "HFConfig") -> dict[str, Any]:
    """AI21's Jamba: Mamba-1 mixers with attention every attn_layer_period-th layer (from
    attn_layer_offset), Mixture-of-Experts MLPs every expert_layer_period-th (from
    expert_layer_offset), RMSNorms on the scan's dt, B and C."""
    c.refuse_if("sliding_window", lambda v: v is not None, "sliding-window attention in Jamba is not modelled")
    layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
    ap, ao = c.int("attn_layer_period", 8), c.int("attn_layer_offset", 4, minimum=0)
    ep, eo = c.int("expert_layer_period", 2), c.int("expert_layer_offset", 1, minimum=0)
    rank = c.cfg.get("mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank == "auto" else c.int("mamba_dt_rank")
    heads = c.int("num_attention_heads")
    experts = c.int("num_experts", 16)
    return dict(arch="llama", layers=layers, hidden=hidden, ffn=c.int("intermediate_size"), heads=heads,
                kv_heads=c.int("num_key_value_heads", 8), head_dim=hidden // heads, vocab=c.int("vocab_size"),
                max_seq=c.int("max_position_embeddings", 262144), tied_embeddings=c.flag("tie_word_embeddings", False),
                norm="rmsnorm", mlp=c.mlp("hidden_act", "silu", gated=True), position="rope",
                num_experts=experts, moe_router_topk=c.int("num_experts_per_tok", 2),
                layer_mixers=tuple(ATTENTION if i % ap == ao else MAMBA for i in range(layers)),
                layer_mlps=tuple(MOE_MLP if experts > 1 and i % ep == eo else DENSE_MLP for i in range(layers)),
                mamba_inner=c.int("mamba_expand", 2) * hidden, mamba_state_dim=c.int("mamba_d_state", 16),
                mamba_d_conv=c.int("mamba_d_conv", 4), mamba_dt_rank=rank, mamba_inner_norms=True,
                ssm_conv_bias=c.flag("mamba_conv_bias", True), ssm_proj_bias=c.flag("mamba_proj_bias", False))


_NEMOTRON_H = {"M": (MAMBA2, NO_MLP), "*": (ATTENTION, NO_MLP), "-": (NO_MIXER, DENSE_MLP)}


def nemotron_h(c: "HFConfig") -> dict[str, Any]:
    """NVIDIA's Nemotron-H: one block per character of hybrid_override_pattern, M a Mamba-2
    mixer, * attention, - a squared-ReLU MLP (each its own pre-normed residual layer)."""
    layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
    pattern = c.text("hybrid_override_pattern")
    if len(pattern) != layers or set(pattern) - set(_NEMOTRON_H):
        bad = sorted(set(pattern) - set(_NEMOTRON_H))
        raise c.error("hybrid_override_pattern", pattern,
                      f"the layer kind {bad[0]!r} is not modelled (M, * and - are)" if bad else
                      f"must have one character per layer ({layers})")
    act = c.text("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise c.error("mlp_hidden_act", act, "only relu2 (squared ReLU) MLPs are modelled for nemotron_h")
    heads = c.int("num_attention_heads")
    head_dim = c.int("head_dim", None, nullable=True) or c.int("attention_head_dim", hidden // heads)
    kinds = [_NEMOTRON_H[ch] for ch in pattern]
    return dict(arch="llama", layers=layers, hidden=hidden, ffn=c.int("intermediate_size"), heads=heads,
                kv_heads=c.int("num_key_value_heads", heads), head_dim=head_dim, vocab=c.int("vocab_size"),
                max_seq=c.int("max_position_embeddings", 8192), tied_embeddings=c.flag("tie_word_embeddings", False),
                norm="rmsnorm", mlp="squared_relu", position="rope",
                attention_bias=c.flag("attention_bias", False), mlp_bias=c.flag("mlp_bias", False),
                layer_mixers=tuple(k[0] for k in kinds), layer_mlps=tuple(k[1] for k in kinds),
                ssm_conv_bias=c.flag("use_conv_bias", True),
                ssm_proj_bias=c.flag("mamba_proj_bias", c.flag("use_bias", False)),
                **_mamba2_dims(c, hidden, heads_key="mamba_num_heads", head_dim_key="mamba_head_dim",
                               state_key="ssm_state_size", chunk=128))


def qwen3_next(c: "HFConfig") -> dict[str, Any]:
    """Qwen3-Next: gated DeltaNet layers with full (gated-output) attention every
    full_attention_interval-th layer, Mixture-of-Experts MLPs with a gated shared expert."""
    layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
    interval = c.int("full_attention_interval", 4)
    types = c.cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
            raise c.error("layer_types", types, f"must list linear_attention or full_attention for each of {layers} layers")
        mixers = tuple(ATTENTION if t == "full_attention" else GATED_DELTANET for t in types)
    else:
        mixers = tuple(ATTENTION if (i + 1) % interval == 0 else GATED_DELTANET for i in range(layers))
    c.refuse_if("attn_output_gate", lambda v: v is False, "Qwen3-Next attention without its output gate is not modelled")
    key_heads, value_heads = c.int("linear_num_key_heads", 16), c.int("linear_num_value_heads", 32)
    heads = c.int("num_attention_heads")
    sparse = sparse_layers(c, layers)
    sparse = (1,) * layers if sparse == 1 else sparse
    return dict(arch="llama", layers=layers, hidden=hidden, ffn=c.int("intermediate_size"), heads=heads,
                kv_heads=c.int("num_key_value_heads", 2), head_dim=c.int("head_dim", 256), vocab=c.int("vocab_size"),
                max_seq=c.int("max_position_embeddings", 32768), tied_embeddings=c.flag("tie_word_embeddings", False),
                norm="rmsnorm", mlp=c.mlp("hidden_act", "silu", gated=True), position="rope",
                rotary_percent=c.rotary_percent(0.25), qk_layernorm=True, attention_output_gate=True,
                attention_bias=c.flag("attention_bias", False),
                num_experts=c.int("num_experts"), moe_router_topk=c.int("num_experts_per_tok"),
                moe_ffn_hidden_size=c.int("moe_intermediate_size"),
                moe_shared_expert_intermediate_size=c.int("shared_expert_intermediate_size"),
                moe_shared_expert_gate=True, layer_mixers=mixers,
                layer_mlps=tuple(MOE_MLP if m else DENSE_MLP for m in sparse),
                mamba_num_heads=value_heads, mamba_num_groups=key_heads,
                mamba_head_dim=c.int("linear_value_head_dim", 128), mamba_state_dim=c.int("linear_key_head_dim", 128),
                mamba_d_conv=c.int("linear_conv_kernel_dim", 4), mamba_chunk_size=64, ssm_conv_bias=False)


def falcon_h1(c: "HFConfig") -> dict[str, Any]:
    """TII's Falcon-H1: in every layer attention and a Mamba-2 mixer read one RMSNorm's output
    side by side and their outputs are summed into the residual, then a SwiGLU MLP. The Mamba-2
    inner width is mamba_d_ssm (expand x hidden when null), split into mamba_n_heads heads of
    mamba_d_head ("auto": the width over the heads); without mamba_rms_norm its output is only
    gated. Hugging Face's implementation fixes attention_bias and mlp_bias to false. The muP
    multipliers (embedding, attention and SSM in/out, key, MLP, lm_head) scale tensors
    elementwise inside kernels that run anyway, and cost nothing modelled here."""
    c.refuse_if("mamba_use_mlp", lambda v: v is False, "Falcon-H1 layers without their MLP are not modelled")
    layers, hidden = c.int("num_hidden_layers", 32), c.int("hidden_size", 4096)
    heads = c.int("num_attention_heads", 32)
    mamba_heads = c.int("mamba_n_heads", 128)
    inner = c.int("mamba_d_ssm", None, nullable=True) or c.int("mamba_expand", 2) * hidden
    if inner % mamba_heads:
        raise c.error("mamba_n_heads", mamba_heads, f"must divide the Mamba-2 inner width ({inner})")
    head = c.cfg.get("mamba_d_head", "auto")
    head = inner // mamba_heads if head == "auto" else c.int("mamba_d_head")
    if head * mamba_heads != inner:
        raise c.error("mamba_d_head", head, f"times mamba_n_heads ({mamba_heads}) must be the inner width ({inner})")
    proj_bias = c.flag("mamba_proj_bias", False)
    if c.flag("projectors_bias", False) != proj_bias:
        raise c.error("projectors_bias", c.cfg.get("projectors_bias"),
                      "an output-projection bias unlike the input projection's (mamba_proj_bias) is not modelled")
    return dict(arch="llama", layers=layers, hidden=hidden, ffn=c.int("intermediate_size", 14336), heads=heads,
                kv_heads=c.int("num_key_value_heads", heads), head_dim=c.int("head_dim", hidden // heads),
                vocab=c.int("vocab_size", 128000), max_seq=c.int("max_position_embeddings", 8192),
                tied_embeddings=c.flag("tie_word_embeddings", False), norm="rmsnorm",
                mlp=c.mlp("hidden_act", "silu", gated=True), position="rope",
                layer_mixers=(ATTENTION_MAMBA2,) * layers, layer_mlps=(DENSE_MLP,) * layers,
                mamba_num_heads=mamba_heads, mamba_head_dim=head, mamba_num_groups=c.int("mamba_n_groups", 1),
                mamba_state_dim=c.int("mamba_d_state", 256), mamba_d_conv=c.int("mamba_d_conv", 4),
                mamba_chunk_size=c.int("mamba_chunk_size", 256), mamba_gated_norm=c.flag("mamba_rms_norm", False),
                ssm_conv_bias=c.flag("mamba_conv_bias", True), ssm_proj_bias=proj_bias)


READERS = {"mamba2": mamba2, "jamba": jamba, "nemotron_h": nemotron_h, "qwen3_next": qwen3_next,
           "falcon_h1": falcon_h1}

# Hybrid families whose layout no layer kind here describes: refused by name, in one line.
REFUSED = {
    "zamba2": "a shared attention block reused across layers with per-use LoRA adapters (Zamba2) is not modelled",
}
ARCHITECTURES = {
    "Mamba2ForCausalLM": "mamba2", "NemotronHForCausalLM": "nemotron_h", "Qwen3NextForCausalLM": "qwen3_next",
    "FalconH1ForCausalLM": "falcon_h1", "Zamba2ForCausalLM": "zamba2",
}

# The public checkpoints' config.json values that set a cost (the rest take the reader's defaults).
PUBLISHED: dict[str, dict[str, Any]] = {
    "jamba-v0.1": {"model_type": "jamba", "_name_or_path": "jamba-v0.1", "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 65536, "num_experts": 16, "num_experts_per_tok": 2,
                   "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
                   "expert_layer_offset": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                   "mamba_dt_rank": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
                   "max_position_embeddings": 262144, "tie_word_embeddings": False},
    # state-spaces/mamba2-2.7b (d_model 2560, 64 layers, headdim 64, d_state 128, ngroups 1; its
    # vocabulary of 50277 padded to a multiple of 16), in Hugging Face's Mamba2 keys
    "mamba2-2.7b": {"model_type": "mamba2", "_name_or_path": "mamba2-2.7b", "hidden_size": 2560,
                    "num_hidden_layers": 64, "num_heads": 80, "head_dim": 64, "state_size": 128, "n_groups": 1,
                    "expand": 2, "conv_kernel": 4, "chunk_size": 256, "vocab_size": 50288,
                    "tie_word_embeddings": True, "use_bias": False, "use_conv_bias": True},
    "mamba-codestral-7b": {"model_type": "mamba2", "_name_or_path": "mamba-codestral-7b", "hidden_size": 4096,
                           "num_hidden_layers": 64, "num_heads": 128, "head_dim": 64, "state_size": 128,
                           "n_groups": 8, "expand": 2, "conv_kernel": 4, "chunk_size": 256, "vocab_size": 32768,
                           "tie_word_embeddings": False, "use_bias": False, "use_conv_bias": True},
    "nemotron-h-8b": {"model_type": "nemotron_h", "_name_or_path": "nemotron-h-8b", "hidden_size": 4096,
                      "num_hidden_layers": 52,
                      "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                      "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
                      "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mamba_num_heads": 128,
                      "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
                      "chunk_size": 128, "use_conv_bias": True, "mamba_proj_bias": False, "vocab_size": 131072,
                      "max_position_embeddings": 8192, "tie_word_embeddings": False},
    "qwen3-next-80b-a3b": {"model_type": "qwen3_next", "_name_or_path": "qwen3-next-80b-a3b", "hidden_size": 2048,
                           "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                           "head_dim": 256, "intermediate_size": 5120, "partial_rotary_factor": 0.25,
                           "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                           "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                           "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "vocab_size": 151936, "max_position_embeddings": 262144, "tie_word_embeddings": False},
    # tiiuae/Falcon-H1-0.5B-Instruct (the technical report's 0.5B row: 36 layers, 1024 wide, 8
    # attention heads, 2 KV heads, 24 Mamba heads of 64, d_state 128)
    "falcon-h1-0.5b": {"model_type": "falcon_h1", "_name_or_path": "falcon-h1-0.5b", "hidden_size": 1024,
                       "num_hidden_layers": 36, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                       "intermediate_size": 2048, "hidden_act": "silu", "mamba_d_ssm": 1536, "mamba_n_heads": 24,
                       "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4,
                       "mamba_chunk_size": 128, "mamba_expand": 2, "mamba_rms_norm": False, "mamba_use_mlp": True,
                       "mamba_conv_bias": True, "mamba_proj_bias": False, "projectors_bias": False,
                       "vocab_size": 32784, "max_position_embeddings": 16384, "tie_word_embeddings": False},
}
