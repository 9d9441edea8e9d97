"""Built-in model presets and the one function that turns a user's --model into a ModelConfig."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from stage_cosim.errors import UserError
from stage_cosim.model.config import ModelConfig

_LLAMA3_8B = ModelConfig.build("llama3-8b", "llama", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8,
                               vocab=128256, max_seq=8192)
_LLAMA3_70B = ModelConfig.build("llama3-70b", "llama", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8,
                                vocab=128256, max_seq=8192)

# Dimensions from the published papers and the models' own config.json files.
PRESETS: dict[str, ModelConfig] = {
    # GPT-3 (Brown et al. 2020), trained without flash attention: the score matrix is materialized.
    "gpt3-175b": ModelConfig.build("gpt3-175b", "gpt", layers=96, hidden=12288, heads=96,
                                   vocab=50257, max_seq=2048, attention="unfused"),
    "llama2-7b": ModelConfig.build("llama2-7b", "llama", layers=32, hidden=4096, ffn=11008,
                                   heads=32, vocab=32000, max_seq=4096),
    "llama2-70b": ModelConfig.build("llama2-70b", "llama", layers=80, hidden=8192, ffn=28672,
                                    heads=64, kv_heads=8, vocab=32000, max_seq=4096),
    "llama3-8b": _LLAMA3_8B,
    "llama3-70b": _LLAMA3_70B,
    # Llama 3.1 and 3.3 (Meta 2024): Llama 3's dimensions with a 128K context (RoPE scaling
    # changes no shape or cost); NVIDIA's recipes and MLPerf name these.
    "llama3.1-8b": replace(_LLAMA3_8B, name="llama3.1-8b", max_seq=131072),
    "llama3.1-70b": replace(_LLAMA3_70B, name="llama3.1-70b", max_seq=131072),
    "llama3.3-70b": replace(_LLAMA3_70B, name="llama3.3-70b", max_seq=131072),
    "llama3.1-405b": ModelConfig.build("llama3.1-405b", "llama", layers=126, hidden=16384,
                                       ffn=53248, heads=128, kv_heads=8, vocab=128256,
                                       max_seq=131072),
    # Mixture-of-Experts models, from their config.json files (the same dimensions the Hugging
    # Face readers take from them).
    "mixtral-8x7b": ModelConfig.build("mixtral-8x7b", "llama", layers=32, hidden=4096, ffn=14336, heads=32,
                                      kv_heads=8, vocab=32000, max_seq=32768, num_experts=8, moe_router_topk=2),
    "mixtral-8x22b": ModelConfig.build("mixtral-8x22b", "llama", layers=56, hidden=6144, ffn=16384, heads=48,
                                       kv_heads=8, vocab=32768, max_seq=65536, num_experts=8, moe_router_topk=2),
    "qwen3-30b-a3b": ModelConfig.build("qwen3-30b-a3b", "llama", layers=48, hidden=2048, ffn=6144, heads=32,
                                       kv_heads=4, head_dim=128, vocab=151936, max_seq=40960, qk_layernorm=True,
                                       num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
    "qwen3-235b-a22b": ModelConfig.build("qwen3-235b-a22b", "llama", layers=94, hidden=4096, ffn=12288, heads=64,
                                         kv_heads=4, head_dim=128, vocab=151936, max_seq=40960, qk_layernorm=True,
                                         num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536),
    # Qwen3's dense models (Qwen 2025), from their config.json files: QK-norm, untied embeddings.
    **{f"qwen3-{size}": ModelConfig.build(f"qwen3-{size}", "llama", layers=layers, hidden=hidden, ffn=ffn, heads=heads,
                                          kv_heads=8, head_dim=128, vocab=151936, max_seq=40960, qk_layernorm=True)
       for size, layers, hidden, ffn, heads in (("8b", 36, 4096, 12288, 32), ("14b", 40, 5120, 17408, 40),
                                                ("32b", 64, 5120, 25600, 64))},
    # Alternating 128-token sliding-window and full attention, attention sinks, biases on the
    # attention projections, the experts and the router.
    "gpt-oss-120b": ModelConfig.build("gpt-oss-120b", "llama", layers=36, hidden=2880, ffn=2880, heads=64,
                                      kv_heads=8, head_dim=64, vocab=201088, max_seq=131072, attention_bias=True,
                                      mlp_bias=True, attention_sinks=True, sliding_window=128,
                                      layer_types=("sliding_attention", "full_attention"), num_experts=128,
                                      moe_router_topk=4, moe_router_bias=True),
    "gpt-oss-20b": ModelConfig.build("gpt-oss-20b", "llama", layers=24, hidden=2880, ffn=2880, heads=64,
                                     kv_heads=8, head_dim=64, vocab=201088, max_seq=131072, attention_bias=True,
                                     mlp_bias=True, attention_sinks=True, sliding_window=128,
                                     layer_types=("sliding_attention", "full_attention"), num_experts=32,
                                     moe_router_topk=4, moe_router_bias=True),
    # Llama 4 (Meta 2025), the text model: every 4th layer global attention without RoPE, the
    # others chunked attention over 8,192-token chunks; MoE layers with one shared expert beside
    # top-1 routed experts, all of intermediate size 8,192. Scout: 16 experts in every layer;
    # Maverick: 128 experts in every 2nd layer (the odd ones), dense MLPs of 16,384 between.
    "llama4-scout": ModelConfig.build("llama4-scout", "llama", layers=48, hidden=5120, ffn=16384, heads=40,
                                      kv_heads=8, head_dim=128, vocab=202048, max_seq=10485760,
                                      attention_chunk_size=8192,
                                      layer_types=("chunked_attention",) * 3 + ("full_attention",),
                                      num_experts=16, moe_router_topk=1, moe_ffn_hidden_size=8192,
                                      moe_shared_expert_intermediate_size=8192),
    "llama4-maverick": ModelConfig.build("llama4-maverick", "llama", layers=48, hidden=5120, ffn=16384, heads=40,
                                         kv_heads=8, head_dim=128, vocab=202048, max_seq=1048576,
                                         attention_chunk_size=8192,
                                         layer_types=("chunked_attention",) * 3 + ("full_attention",),
                                         num_experts=128, moe_router_topk=1, moe_ffn_hidden_size=8192,
                                         moe_shared_expert_intermediate_size=8192, moe_layer_freq=(0, 1) * 24),
    # Multi-latent attention, 3 dense layers then 58 MoE layers (256 routed experts, top 8, one
    # shared expert), one multi-token-prediction module.
    "deepseek-v3": ModelConfig.build("deepseek-v3", "llama", layers=61, hidden=7168, ffn=18432, heads=128,
                                     head_dim=128, vocab=129280, max_seq=163840, multi_latent_attention=True,
                                     q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                     v_head_dim=128, num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                                     moe_shared_expert_intermediate_size=2048, moe_layer_freq=(0,) * 3 + (1,) * 58,
                                     moe_router_num_groups=8, moe_router_group_topk=4, mtp_num_layers=1),
    # Older dense families people still serve, from their config.json files (the values the
    # Hugging Face readers take). GPT-J: attention and MLP side by side on one LayerNorm, RoPE on
    # 64 of each head's 256 dimensions.
    "gptj-6b": ModelConfig.build("gptj-6b", "gpt", layers=28, hidden=4096, heads=16, vocab=50400, max_seq=2048,
                                 tied_embeddings=False, position="rope", rotary_percent=0.25, parallel_residual=True,
                                 shared_input_norm=True, attention_bias=False, hidden_dropout=0.0,
                                 attention_dropout=0.0),
    # OPT (Zhang et al. 2022): learned positions, ReLU MLPs, biases, tied embeddings.
    **{f"opt-{size}": ModelConfig.build(f"opt-{size}", "gpt", layers=layers, hidden=hidden, heads=heads, vocab=50272,
                                        max_seq=2048, mlp="relu", attention_dropout=0.0)
       for size, layers, hidden, heads in (("6.7b", 32, 4096, 32), ("13b", 40, 5120, 40), ("30b", 48, 7168, 56),
                                           ("66b", 64, 9216, 72), ("175b", 96, 12288, 96))},
    # BLOOM (BigScience 2022): ALiBi, a LayerNorm on the embedding, GELU MLPs, a 250,880-token vocabulary.
    "bloom-7b1": ModelConfig.build("bloom-7b1", "gpt", layers=30, hidden=4096, heads=32, vocab=250880, max_seq=2048,
                                   position="alibi", embedding_norm=True, hidden_dropout=0.0, attention_dropout=0.0),
    "bloom-176b": ModelConfig.build("bloom-176b", "gpt", layers=70, hidden=14336, heads=112, vocab=250880,
                                    max_seq=2048, position="alibi", embedding_norm=True, hidden_dropout=0.0,
                                    attention_dropout=0.0),
}


def _hybrid_presets() -> dict[str, ModelConfig]:
    """Hybrid and state-space models, read from their published config.json values by the
    same readers a user's file goes through."""
    from stage_cosim.model.hf import model_from_hf_dict
    from stage_cosim.model.hf_hybrid import PUBLISHED

    return {name: model_from_hf_dict(cfg, name) for name, cfg in PUBLISHED.items()}


PRESETS.update(_hybrid_presets())

DEFAULT_MODEL = "llama3-8b"


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError("model", f"unknown preset {name!r} (known: {', '.join(PRESETS)}; "
                                 "or a path to a Hugging Face config.json)") from None


def resolve_model(spec: str) -> ModelConfig:
    """A preset name, or a path to a Hugging Face ``config.json`` (or a folder holding one).

    Where files are not read (a server's requests), only a preset: the name is never looked up
    on disk."""
    from stage_cosim.files import local_files_allowed

    if not local_files_allowed():
        if spec in PRESETS:
            return PRESETS[spec]
        raise UserError("model", f"unknown preset {spec!r} (known: {', '.join(PRESETS)}); files are not read "
                                 "here: send a Hugging Face config's content as model_config")
    path = Path(spec)
    if spec.endswith(".json") or path.is_dir() or path.is_file():
        from stage_cosim.model.hf import load_hf_config

        return load_hf_config(path)
    return get_preset(spec)
