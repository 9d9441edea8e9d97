"""Read a Hugging Face ``config.json`` into a ModelConfig, one reader per ``model_type``.

A config means what Hugging Face's implementation of its ``model_type`` builds from it, so each
family's reader knows every key that implementation reads that changes a cost (dimensions,
activation, biases, norms and where they sit, rotary fraction, parallel residual, sliding
windows, soft-capping, tied embeddings, dropout) and either models it or refuses the config
with one line naming the key and its value. A key absent from the file takes Hugging Face's
default for that family. Keys the implementation never reads do not change the model and are
ignored, as Hugging Face ignores them. A ``model_type`` (or ``architectures`` entry) without a
reader is refused with the list of those that have one; Mixture-of-Experts families without a
reader are named as such.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from stage_cosim.errors import UserError
from stage_cosim.model import hf_hybrid as _hybrid
from stage_cosim.model import hf_llama4 as _llama4
from stage_cosim.model.architecture import FULL_ATTENTION, LAYER_TYPES, SLIDING_ATTENTION
from stage_cosim.model.config import ModelConfig
from stage_cosim.model.hf_layers import sparse_layers as _sparse_layers

# Hugging Face activation names, by what they cost (the tanh and erf forms of GELU alike).
_GELU = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python", "gelu_accurate")
_SILU = ("silu", "swish")

_REQUIRED = object()


class HFConfig:
    """One parsed config.json and the file it came from; typed reads that fail in one line."""

    def __init__(self, cfg: dict[str, Any], file: Path, model_type: str, prefix: str = "") -> None:
        self.cfg = cfg
        self.file = file
        self.model_type = model_type
        self.prefix = prefix    # where cfg sits in the file ("text_config."), for messages

    def error(self, key: str, value: Any, rule: str) -> UserError:
        return UserError("model", f"{self.file}: {self.prefix}{key} = {json.dumps(value)}: {rule}")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.cfg:
            return self.cfg[key]
        if default is _REQUIRED:
            raise UserError("model", f"{self.file}: key {self.prefix + key!r} is missing "
                                     f"(a {self.model_type} config needs it)")
        return default

    def nested(self, key: str) -> "HFConfig":
        """The config object under ``key`` (a multimodal model's text_config), read the same way."""
        value = self._get(key, _REQUIRED)
        if not isinstance(value, dict):
            raise self.error(key, value, "must be a JSON object")
        return HFConfig(value, self.file, self.model_type, f"{self.prefix}{key}.")

    def int(self, key: str, default: Any = _REQUIRED, *, nullable: bool = False, minimum: int = 1) -> int | None:
        value = self._get(key, default)
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, value, "must be a positive integer" if minimum == 1 else
                             f"must be an integer of at least {minimum}")
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, nullable: bool = False) -> float | None:
        value = self._get(key, default)
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise self.error(key, value, "must be a non-negative number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, value, "must be true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.error(key, value, "must be a string")
        return value

    def refuse_if(self, key: str, value_is_refused: Callable[[Any], bool], rule: str) -> None:
        if key in self.cfg and value_is_refused(self.cfg[key]):
            raise self.error(key, self.cfg[key], rule)

    # -- pieces several families share ---------------------------------------------------

    def mlp(self, key: str, default: str, *, gated: bool) -> str:
        act = self.text(key, default)
        if act in _GELU:
            return "geglu" if gated else "gelu"
        if act in _SILU and gated:
            return "swiglu"
        kinds = "SiLU or GELU gated MLPs" if gated else "GELU MLPs"
        raise self.error(key, act, f"only {kinds} are modelled for {self.model_type}")

    def rotary_percent(self, default: float = 1.0, key: str = "partial_rotary_factor") -> float:
        """The rotated fraction of each head: a top-level key, or inside ``rope_parameters``
        (newer Hugging Face files keep it there)."""
        rope = self.cfg.get("rope_parameters")
        if isinstance(rope, dict) and "partial_rotary_factor" in rope:
            value, where = rope["partial_rotary_factor"], "rope_parameters.partial_rotary_factor"
        elif key in self.cfg:
            value, where = self.cfg[key], key
        else:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise self.error(where, value, "must be in (0, 1]")
        return float(value)

    def dropout(self, *keys: str, default: float = 0.0) -> float:
        """One probability for several keys that must agree on whether there is dropout at all
        (the model has one hidden-dropout switch for the embedding and the sublayer outputs)."""
        values = {k: self.number(k, default) for k in keys}
        if len({v > 0 for v in values.values()}) > 1:
            on = next(k for k, v in values.items() if v > 0)
            off = next(k for k, v in values.items() if v == 0)
            raise self.error(on, values[on], f"dropout here but not at {off} (0) is not modelled")
        for k, v in values.items():
            if v >= 1:
                raise self.error(k, v, "must be a probability below 1")
        return max(values.values())

    def head_dim(self, hidden: int, heads: int, default: int | None = None) -> int:
        value = self.int("head_dim", default, nullable=True)
        if value is not None:
            return value
        if hidden % heads:
            raise UserError("model", f"{self.file}: hidden_size {hidden} is not a multiple of "
                                     f"num_attention_heads {heads} and head_dim is missing")
        return hidden // heads

    def layer_types(self, layers: int, default: tuple[str, ...]) -> tuple[str, ...]:
        """Per-layer attention kinds, as the shortest pattern that repeats into them."""
        value = self.cfg.get("layer_types")
        if value is None:
            types = default
        else:
            if not isinstance(value, list) or any(t not in LAYER_TYPES for t in value):
                raise self.error("layer_types", value, f"must be a list of {' or '.join(LAYER_TYPES)}")
            if len(value) != layers:
                raise self.error("layer_types", value, f"must have one entry per layer ({layers})")
            types = tuple(value)
        return _shortest_period(types)


def _shortest_period(types: tuple[str, ...]) -> tuple[str, ...]:
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return types[:p]
    return types


def _windowed(c: HFConfig, layers: int, window: int | None,
              default_types: Callable[[int], tuple[str, ...]]) -> dict[str, Any]:
    """sliding_window and layer_types of a family whose windows HF configures per layer."""
    types = c.layer_types(layers, default_types(layers) if window is not None else ())
    if SLIDING_ATTENTION in types and window is None:
        raise c.error("layer_types", list(types), "names sliding_attention layers but sliding_window is unset")
    if window is None or SLIDING_ATTENTION not in types:
        return {}
    return dict(sliding_window=window, layer_types=() if set(types) == {SLIDING_ATTENTION} else types)


# -- the families ---------------------------------------------------------------------------

def _dims(c: HFConfig) -> dict[str, int]:
    return dict(layers=c.int("num_hidden_layers"), hidden=c.int("hidden_size"), heads=c.int("num_attention_heads"),
                ffn=c.int("intermediate_size"), vocab=c.int("vocab_size"))


def _llama_like(c: HFConfig, *, max_seq: int, tied: bool, head_dim: int | None = None,
                act: tuple[str, str] = ("hidden_act", "silu"), **arch: Any) -> dict[str, Any]:
    d = _dims(c)
    return dict(d, arch="llama", kv_heads=c.int("num_key_value_heads", d["heads"], nullable=True) or d["heads"],
                head_dim=c.head_dim(d["hidden"], d["heads"], head_dim),
                max_seq=c.int("max_position_embeddings", max_seq),
                tied_embeddings=c.flag("tie_word_embeddings", tied),
                mlp=c.mlp(*act, gated=True), norm="rmsnorm", position="rope",
                rotary_percent=c.rotary_percent(), attention_dropout=c.number("attention_dropout", 0.0), **arch)


def _qwen_windows(c: HFConfig, layers: int) -> dict[str, Any]:
    """Qwen2/Qwen3: a window only with use_sliding_window, in the layers from max_window_layers on."""
    use = c.flag("use_sliding_window", False)
    window = c.int("sliding_window", 4096, nullable=True) if use else None
    start = c.int("max_window_layers", 28, minimum=0)
    return _windowed(c, layers, window,
                     lambda n: tuple(SLIDING_ATTENTION if i >= start else FULL_ATTENTION for i in range(n)))


def _llama(c: HFConfig) -> dict[str, Any]:
    return _llama_like(c, max_seq=2048, tied=False, attention_bias=c.flag("attention_bias", False),
                       mlp_bias=c.flag("mlp_bias", False))


def _mistral(c: HFConfig) -> dict[str, Any]:
    window = c.int("sliding_window", 4096, nullable=True)    # every layer, as HF's Mistral does
    return _llama_like(c, max_seq=4096 * 32, tied=False, sliding_window=window)


def _qwen2(c: HFConfig) -> dict[str, Any]:
    # Qwen2 hard-codes biases on q, k and v (not on the output projection or the MLP).
    return _llama_like(c, max_seq=32768, tied=False, add_qkv_bias=True,
                       **_qwen_windows(c, c.int("num_hidden_layers")))


def _qwen3(c: HFConfig) -> dict[str, Any]:
    return _llama_like(c, max_seq=32768, tied=False, head_dim=128, qk_layernorm=True,
                       attention_bias=c.flag("attention_bias", False),
                       **_qwen_windows(c, c.int("num_hidden_layers")))


def _gemma2(c: HFConfig) -> dict[str, Any]:
    c.refuse_if("use_bidirectional_attention", bool, "bidirectional attention is not modelled")
    window = c.int("sliding_window", 4096, nullable=True)
    layers = c.int("num_hidden_layers")
    # Even layers slide, odd layers attend globally (HF's default pattern for Gemma-2).
    windows = _windowed(c, layers, window, lambda n: tuple(
        SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n)))
    return _llama_like(c, max_seq=8192, tied=True, head_dim=256, act=("hidden_activation", "gelu_pytorch_tanh"),
                       attention_bias=c.flag("attention_bias", False), sandwich_norm=True,
                       scale_embeddings=True,
                       attn_logit_softcapping=c.number("attn_logit_softcapping", 50.0, nullable=True) or None,
                       final_logit_softcapping=c.number("final_logit_softcapping", 30.0, nullable=True) or None,
                       **windows)


def _phi3(c: HFConfig) -> dict[str, Any]:
    return _llama_like(c, max_seq=4096, tied=False, sliding_window=c.int("sliding_window", None, nullable=True),
                       hidden_dropout=c.dropout("resid_pdrop", "embd_pdrop"))


# -- Mixture-of-Experts families --------------------------------------------------------------

def _experts(c: HFConfig, *, experts: tuple[str, ...], topk: str = "num_experts_per_tok",
             expert_ffn: str | None = None, **kw: Any) -> dict[str, Any]:
    """The routed experts: their count (the first of ``experts`` present), how many a token
    goes to, each one's intermediate size (``expert_ffn``; absent: intermediate_size)."""
    key = next((k for k in experts if k in c.cfg), experts[0])
    out = dict(num_experts=c.int(key), moe_router_topk=c.int(topk))
    if expert_ffn is not None:
        out["moe_ffn_hidden_size"] = c.int(expert_ffn)
    if out["moe_router_topk"] > out["num_experts"]:
        raise c.error(topk, out["moe_router_topk"], f"must not exceed {key} ({out['num_experts']})")
    out.update(kw)
    return out


def _no_qwen_moe_windows(c: HFConfig) -> None:
    # The Qwen MoE implementations have changed which layers slide across versions; the published
    # models train without windows.
    c.refuse_if("use_sliding_window", lambda v: v is True,
                f"sliding windows are not modelled for {c.model_type} (their layout differs across versions)")


def _mixtral(c: HFConfig) -> dict[str, Any]:
    window = c.int("sliding_window", None, nullable=True)    # every layer when set, as in Mistral
    return _llama_like(c, max_seq=4096 * 32, tied=False, sliding_window=window,
                       **_experts(c, experts=("num_local_experts",)))


def _qwen2_moe(c: HFConfig) -> dict[str, Any]:
    _no_qwen_moe_windows(c)
    layers = c.int("num_hidden_layers")
    shared = c.int("shared_expert_intermediate_size", 5632, nullable=True, minimum=0)
    return _llama_like(c, max_seq=32768, tied=False, add_qkv_bias=c.flag("qkv_bias", True),
                       **_experts(c, experts=("num_experts", "num_local_experts"), expert_ffn="moe_intermediate_size",
                                  moe_layer_freq=_sparse_layers(c, layers),
                                  moe_shared_expert_intermediate_size=shared or None,
                                  moe_shared_expert_gate=bool(shared)))


def _qwen3_moe(c: HFConfig) -> dict[str, Any]:
    _no_qwen_moe_windows(c)
    layers = c.int("num_hidden_layers")
    return _llama_like(c, max_seq=32768, tied=False, qk_layernorm=True,
                       attention_bias=c.flag("attention_bias", False),
                       **_experts(c, experts=("num_experts", "num_local_experts"), expert_ffn="moe_intermediate_size",
                                  moe_layer_freq=_sparse_layers(c, layers)))


def _deepseek(c: HFConfig, *, mtp: bool) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-latent attention; layers from first_k_dense_replace on (every
    moe_layer_freq-th) are MoE with n_shared_experts shared experts of the routed size."""
    c.refuse_if("attention_bias", lambda v: v is True, "biases in multi-latent attention are not modelled")
    layers = c.int("num_hidden_layers")
    first_dense = c.int("first_k_dense_replace", 0, minimum=0)
    freq = c.int("moe_layer_freq", 1)
    expert_ffn = c.int("moe_intermediate_size")
    shared = c.int("n_shared_experts", None, nullable=True, minimum=0) or 0
    heads = c.int("num_attention_heads")
    fields = _llama_like(
        c, max_seq=163840 if mtp else 2048, tied=False, head_dim=c.int("v_head_dim"),
        multi_latent_attention=True, q_lora_rank=c.int("q_lora_rank", None, nullable=True),
        kv_lora_rank=c.int("kv_lora_rank"), qk_head_dim=c.int("qk_nope_head_dim"),
        qk_pos_emb_head_dim=c.int("qk_rope_head_dim"), v_head_dim=c.int("v_head_dim"),
        mtp_num_layers=c.int("num_nextn_predict_layers", 0, minimum=0) if mtp else 0,
        **_experts(c, experts=("n_routed_experts",), expert_ffn="moe_intermediate_size",
                   moe_layer_freq=tuple(int(i >= first_dense and i % freq == 0) for i in range(layers)),
                   moe_shared_expert_intermediate_size=shared * expert_ffn or None))
    fields["kv_heads"] = heads      # multi-latent attention: every head has its own key and value
    groups = c.int("n_group", None, nullable=True, minimum=1)
    if groups is not None and groups > 1:   # (one group: routing not limited)
        fields["moe_router_num_groups"] = groups
        fields["moe_router_group_topk"] = c.int("topk_group")
    return fields


def _gpt_oss(c: HFConfig) -> dict[str, Any]:
    layers = c.int("num_hidden_layers")
    window = c.int("sliding_window", 128, nullable=True)
    # Even layers slide, odd layers attend globally (HF's default pattern for GPT-OSS).
    windows = _windowed(c, layers, window, lambda n: tuple(
        SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n)))
    # The experts' SwiGLU is clamped (swiglu_limit): the same cost as a SwiGLU.
    fields = _llama_like(c, max_seq=131072, tied=False, head_dim=64,
                         attention_bias=c.flag("attention_bias", True), attention_sinks=True,
                         mlp_bias=True, **windows,
                         **_experts(c, experts=("num_local_experts", "num_experts"), moe_router_bias=True))
    return fields


def _gpt2(c: HFConfig) -> dict[str, Any]:
    c.refuse_if("add_cross_attention", bool, "cross-attention is not modelled")
    hidden, heads = c.int("n_embd"), c.int("n_head")
    if hidden % heads:
        raise c.error("n_head", heads, f"must divide n_embd ({hidden})")
    return dict(arch="gpt", layers=c.int("n_layer"), hidden=hidden, heads=heads, kv_heads=heads,
                head_dim=hidden // heads, ffn=c.int("n_inner", None, nullable=True) or 4 * hidden,
                vocab=c.int("vocab_size", 50257), max_seq=c.int("n_positions", 1024),
                tied_embeddings=c.flag("tie_word_embeddings", True), norm="layernorm", position="learned",
                mlp=c.mlp("activation_function", "gelu_new", gated=False), attention_bias=True, mlp_bias=True,
                hidden_dropout=c.dropout("resid_pdrop", "embd_pdrop", default=0.1),
                attention_dropout=c.number("attn_pdrop", 0.1))


def _gpt_neox(c: HFConfig) -> dict[str, Any]:
    d = _dims(c)
    # multi-head attention: GPT-NeoX has no key/value head count of its own
    if d["hidden"] % d["heads"]:
        raise c.error("num_attention_heads", d["heads"], f"must divide hidden_size ({d['hidden']})")
    return dict(d, arch="gpt", kv_heads=d["heads"], head_dim=d["hidden"] // d["heads"],
                max_seq=c.int("max_position_embeddings", 2048), norm="layernorm", position="rope",
                tied_embeddings=c.flag("tie_word_embeddings", False),
                mlp=c.mlp("hidden_act", "gelu", gated=False),
                rotary_percent=c.rotary_percent(0.25, key="rotary_pct"),
                parallel_residual=c.flag("use_parallel_residual", True),
                attention_bias=c.flag("attention_bias", True), mlp_bias=True,
                hidden_dropout=c.number("hidden_dropout", 0.0), attention_dropout=c.number("attention_dropout", 0.0))


# -- older dense families: GPT-J, OPT, BLOOM -------------------------------------------------

def _first_key(c: HFConfig, *keys: str) -> str:
    """The first of ``keys`` the file has (configs of one family name a dimension differently
    across releases: BLOOM's n_embed / hidden_size), else the first."""
    return next((k for k in keys if k in c.cfg), keys[0])


def _gptj(c: HFConfig) -> dict[str, Any]:
    """GPT-J: attention and MLP side by side on one LayerNorm's output (one norm per layer),
    RoPE on the first rotary_dim dimensions of each head, no biases on the attention
    projections, biases on the MLP. (Its output layer's bias, vocab_size parameters and one add
    over the logits, is not modelled: 0.001 % of GPT-J-6B.)"""
    c.refuse_if("add_cross_attention", bool, "cross-attention is not modelled")
    hidden, heads = c.int("n_embd", 4096), c.int("n_head", 16)
    if hidden % heads:
        raise c.error("n_head", heads, f"must divide n_embd ({hidden})")
    head_dim = hidden // heads
    rotary = c.int("rotary_dim", 64, nullable=True)
    if rotary is not None and (rotary > head_dim or rotary % 2):
        raise c.error("rotary_dim", rotary, f"must be an even number of dimensions up to the head's ({head_dim})")
    return dict(arch="gpt", layers=c.int("n_layer", 28), hidden=hidden, heads=heads, kv_heads=heads, head_dim=head_dim,
                ffn=c.int("n_inner", None, nullable=True) or 4 * hidden, vocab=c.int("vocab_size", 50400),
                max_seq=c.int("n_positions", 2048), tied_embeddings=c.flag("tie_word_embeddings", False),
                norm="layernorm", position="rope", rotary_percent=(rotary or head_dim) / head_dim,
                mlp=c.mlp("activation_function", "gelu_new", gated=False), attention_bias=False, mlp_bias=True,
                parallel_residual=True, shared_input_norm=True,
                hidden_dropout=c.dropout("resid_pdrop", "embd_pdrop"), attention_dropout=c.number("attn_pdrop", 0.0))


def _opt(c: HFConfig) -> dict[str, Any]:
    """OPT: learned positions, a ReLU (or GELU) MLP of ffn_dim, pre-LayerNorm, biases on every
    projection (enable_bias). OPT-350m's projected embedding (word_embed_proj_dim) and post-norm
    layers are refused. (Its position table's two offset rows, 2 x hidden parameters, are not
    counted.)"""
    hidden = c.int("hidden_size", 768)
    proj = c.int("word_embed_proj_dim", None, nullable=True)
    if proj is not None and proj != hidden:
        raise c.error("word_embed_proj_dim", proj, f"an embedding projected to hidden_size ({hidden}) and back "
                                                   "(OPT-350m) is not modelled")
    c.refuse_if("do_layer_norm_before", lambda v: v is False, "post-LayerNorm layers (OPT-350m) are not modelled")
    c.refuse_if("_remove_final_layer_norm", lambda v: v is True, "a model without its final LayerNorm is not modelled")
    c.refuse_if("layer_norm_elementwise_affine", lambda v: v is False, "LayerNorms without weights are not modelled")
    c.refuse_if("layerdrop", lambda v: v != 0, "layer dropout (skipping layers at random) is not modelled")
    act = c.text("activation_function", "relu")
    if act != "relu" and act not in _GELU:
        raise c.error("activation_function", act, "only ReLU and GELU MLPs are modelled for opt")
    heads = c.int("num_attention_heads", 12)
    if hidden % heads:
        raise c.error("num_attention_heads", heads, f"must divide hidden_size ({hidden})")
    bias = c.flag("enable_bias", True)
    return dict(arch="gpt", layers=c.int("num_hidden_layers", 12), hidden=hidden, heads=heads, kv_heads=heads,
                head_dim=hidden // heads, ffn=c.int("ffn_dim", 3072), vocab=c.int("vocab_size", 50272),
                max_seq=c.int("max_position_embeddings", 2048), tied_embeddings=c.flag("tie_word_embeddings", True),
                norm="layernorm", position="learned", mlp="relu" if act == "relu" else "gelu",
                attention_bias=bias, mlp_bias=bias, hidden_dropout=c.dropout("dropout", default=0.1),
                attention_dropout=c.number("attention_dropout", 0.0))


def _bloom(c: HFConfig) -> dict[str, Any]:
    """BLOOM: ALiBi instead of position embeddings, a LayerNorm on the embedding, a 4h GELU MLP,
    biases everywhere, tied embeddings. ALiBi has no length limit: max_seq is the training
    sequence length (seq_length, 2048 when absent). The residual from after the LayerNorm
    (apply_residual_connection_post_layernorm) costs the same ops."""
    c.refuse_if("slow_but_exact", lambda v: v is True and c.cfg.get("pretraining_tp", 1) != 1,
                "projections split into pretraining_tp slices (more, smaller GEMMs) are not modelled")
    hidden = c.int(_first_key(c, "n_embed", "hidden_size"), 64)
    heads = c.int(_first_key(c, "n_head", "num_attention_heads"), 8)
    if hidden % heads:
        raise c.error("n_head", heads, f"must divide the hidden size ({hidden})")
    return dict(arch="gpt", layers=c.int(_first_key(c, "n_layer", "num_hidden_layers"), 2), hidden=hidden,
                heads=heads, kv_heads=heads, head_dim=hidden // heads, ffn=4 * hidden,
                vocab=c.int("vocab_size", 250880), max_seq=c.int("seq_length", 2048),
                tied_embeddings=c.flag("tie_word_embeddings", True), norm="layernorm", position="alibi",
                embedding_norm=True, mlp="gelu", attention_bias=True, mlp_bias=True,
                hidden_dropout=c.number("hidden_dropout", 0.0), attention_dropout=c.number("attention_dropout", 0.0))


READERS: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "llama": _llama, "mistral": _mistral, "qwen2": _qwen2,
    "qwen3": _qwen3, "gemma2": _gemma2, "phi3": _phi3,
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe,
    "deepseek_v2": lambda c: _deepseek(c, mtp=False), "deepseek_v3": lambda c: _deepseek(c, mtp=True),
    "gpt_oss": _gpt_oss,
    "gptj": _gptj, "opt": _opt, "bloom": _bloom,
}

ARCHITECTURES: dict[str, str] = {
    "GPT2LMHeadModel": "gpt2", "GPTNeoXForCausalLM": "gpt_neox", "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2", "Phi3ForCausalLM": "phi3",
    "GPTJForCausalLM": "gptj", "OPTForCausalLM": "opt", "BloomForCausalLM": "bloom",
    # Mixture-of-Experts families (those without a reader are refused as such)
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss", "DbrxForCausalLM": "dbrx", "OlmoeForCausalLM": "olmoe",
    "PhimoeForCausalLM": "phimoe", "JambaForCausalLM": "jamba", "GraniteMoeForCausalLM": "granitemoe",
    "Llama4ForConditionalGeneration": "llama4", "Llama4ForCausalLM": "llama4_text",
}

# The hybrid and state-space families (stage_cosim.model.hf_hybrid), and Llama 4.
READERS.update(_hybrid.READERS)
READERS.update(_llama4.READERS)
ARCHITECTURES.update(_hybrid.ARCHITECTURES)

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "dbrx", "olmoe",
             "phimoe", "jamba", "granitemoe", "granitemoeshared", "jetmoe", "llama4", "llama4_text", "minimax",
             "glm4_moe", "qwen3_next", "hunyuan_v1_moe", "ernie4_5_moe", "dots1", "bailing_moe", "step3p5")

# Storage formats of released weights that are the models' own (DeepSeek-V3 trains and ships in
# block-wise FP8, GPT-OSS ships its experts in MXFP4): the file still describes the model that
# is trained, so the architecture is read; a run's precision is its own choice.
_NATIVE_QUANTIZATION = {"deepseek_v3": "fp8", "gpt_oss": "mxfp4"}


def _quantized(c: HFConfig) -> bool:
    q = c.cfg.get("quantization_config")
    if q is None:
        return False
    return not (isinstance(q, dict) and q.get("quant_method") == _NATIVE_QUANTIZATION.get(c.model_type))


# Keys of any family that ask for something this tool does not model.
_GENERAL_REFUSALS = (
    ("is_encoder_decoder", bool, "encoder-decoder models are not modelled"),
)


def read_hf_config(path: Path) -> tuple[Any, Path]:
    """The parsed config.json at ``path`` (a file or a model directory) and the file read."""
    from stage_cosim.files import local_files_allowed, refuse_local_file

    if not local_files_allowed():
        refuse_local_file("model", str(path), "send a Hugging Face config's content as model_config")
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text()), file
    except FileNotFoundError:
        raise UserError("model", f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError("model", f"{file}: not a valid JSON config ({exc.__class__.__name__})") from None


def load_hf_config(path: Path) -> ModelConfig:
    cfg, file = read_hf_config(path)
    return model_from_hf_dict(cfg, file)


def model_type_of(cfg: dict[str, Any], file: Path) -> str:
    """The family a config belongs to: its model_type, else its first known architecture."""
    known = ", ".join(sorted(READERS))
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type is None:
        if not isinstance(archs, list) or not archs:
            raise UserError("model", f"{file}: no model_type or architectures (known model types: {known})")
        model_type = ARCHITECTURES.get(str(archs[0]))
        if model_type is None:
            raise UserError("model", f"{file}: architectures = {json.dumps(archs)}: not a known architecture "
                                     f"(known: {', '.join(a for a, t in ARCHITECTURES.items() if t in READERS)})")
    if model_type in MOE_TYPES and model_type not in READERS:
        modelled = ", ".join(sorted(t for t in MOE_TYPES if t in READERS))
        raise UserError("model", f"{file}: model_type = {json.dumps(model_type)}: the {model_type} Mixture-of-Experts "
                                 f"family is not modelled (modelled Mixture-of-Experts families: {modelled})")
    if model_type in _hybrid.REFUSED:
        raise UserError("model", f"{file}: model_type = {json.dumps(model_type)}: {_hybrid.REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in READERS:
        raise UserError("model", f"{file}: model_type = {json.dumps(model_type)}: not a known model type "
                                 f"(known: {known})")
    return model_type


def model_name(cfg: dict[str, Any], file: Path) -> str:
    """The model's own name: the config's ``_name_or_path``, else its folder's
    (``Meta-Llama-3-8B/config.json``) or its file's; the family (``model_type``: "llama") only for
    a config given as content. The bridge's client names an uploaded config with this too, so a
    remote result names the model as the local one does."""
    own = file.parent.name if file.name == "config.json" else file.stem if file.suffix == ".json" else ""
    return str(cfg.get("_name_or_path") or own or cfg.get("model_type") or "hf-model")


def model_from_hf_dict(cfg: object, file: Path | str = "config") -> ModelConfig:
    """A ModelConfig from the parsed content of a Hugging Face config.json."""
    file = Path(file)
    if not isinstance(cfg, dict):
        raise UserError("model", f"{file}: expected a JSON object")
    model_type = model_type_of(cfg, file)
    c = HFConfig(cfg, file, model_type)
    for key, refused, rule in _GENERAL_REFUSALS:
        c.refuse_if(key, refused, rule)
    if _quantized(c):
        raise c.error("quantization_config", cfg["quantization_config"],
                      "quantized checkpoints are not modelled (training runs in bf16); remove the key for the bf16 model")
    fields = READERS[model_type](c)
    name = model_name(cfg, file)
    try:
        return ModelConfig(name=name, **fields)
    except UserError as exc:
        raise UserError("model", f"{file}: {exc.parameter}: {exc.rule}") from None
