"""Hugging Face readers of Llama 4: ``llama4_text`` (the language model's own config) and
``llama4`` (the multimodal model, whose language model sits under ``text_config``; its vision
encoder and projector are not modelled: the text model is what is trained and served here).

What Hugging Face's Llama 4 builds from the keys: GQA attention; every
``no_rope_layer_interval``-th layer (the 4th, 8th, ...) a global attention layer without RoPE
(NoPE), the others RoPE layers whose attention is chunked (a query sees the keys of its own
``attention_chunk_size``-token chunk); Mixture-of-Experts layers (the ``moe_layers``, by default
every ``interleave_moe_layer_step``-th counting from 1) with ``num_local_experts`` routed
experts of ``intermediate_size`` (top ``num_experts_per_tok`` by a sigmoid score) beside one
shared expert of the same size, dense layers an MLP of ``intermediate_size_mlp``. What changes
no shape and only a few elementwise operations per token is left out: the RoPE layers' L2
norm of queries and keys (``use_qk_norm``: it has no weights), the NoPE layers' query
temperature (``attn_temperature_tuning``), RoPE skipped in the NoPE layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stage_cosim.model.architecture import CHUNKED_ATTENTION, FULL_ATTENTION

if TYPE_CHECKING:
    from stage_cosim.model.hf import HFConfig


def _layer_types(c: "HFConfig", layers: int, chunk: int | None) -> tuple[str, ...]:
    """layer_types when the file has it; else from no_rope_layers (1: a RoPE layer, chunked; 0:
    a NoPE layer, global), else every no_rope_layer_interval-th layer global."""
    rope = c.cfg.get("no_rope_layers")
    if rope:
        if not isinstance(rope, list) or len(rope) != layers or any(v not in (0, 1) or isinstance(v, bool)
                                                                  for v in rope):
            raise c.error("no_rope_layers", rope, f"must list 0 or 1 for each of {layers} layers")
        default = tuple(CHUNKED_ATTENTION if v else FULL_ATTENTION for v in rope)
    else:
        interval = c.int("no_rope_layer_interval", 4)
        default = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else CHUNKED_ATTENTION for i in range(layers))
    types = c.layer_types(layers, default)
    if chunk is not None:
        return types
    # no chunk size: the RoPE layers attend globally too (Hugging Face masks them causally)
    if CHUNKED_ATTENTION in c.layer_types(layers, ()):
        raise c.error("layer_types", c.cfg["layer_types"], "names chunked_attention layers but attention_chunk_size "
                                                           "is unset")
    return ()


def _moe_layers(c: "HFConfig", layers: int) -> int | tuple[int, ...]:
    """moe_layers when given (layer indices), else every interleave_moe_layer_step-th layer
    counting from 1 (layers step-1, 2*step-1, ...), as Hugging Face's Llama 4 fills it."""
    listed = c.cfg.get("moe_layers")
    if listed is not None:
        if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                               or not 0 <= i < layers for i in listed):
            raise c.error("moe_layers", listed, f"must be a list of layer indices below {layers}")
        chosen = set(listed)
    else:
        step = c.int("interleave_moe_layer_step", 1)
        chosen = set(range(step - 1, layers, step))
    pattern = tuple(int(i in chosen) for i in range(layers))
    return 1 if all(pattern) else pattern


def llama4_text(c: "HFConfig") -> dict[str, Any]:
    """The language model of Llama 4 (Hugging Face's defaults are Scout's)."""
    layers = c.int("num_hidden_layers", 48)
    hidden, heads = c.int("hidden_size", 5120), c.int("num_attention_heads", 40)
    chunk = c.int("attention_chunk_size", 8192, nullable=True)
    types = _layer_types(c, layers, chunk)
    experts, topk = c.int("num_local_experts", 16), c.int("num_experts_per_tok", 1)
    if topk > experts:
        raise c.error("num_experts_per_tok", topk, f"must not exceed num_local_experts ({experts})")
    expert_ffn = c.int("intermediate_size", 8192)
    return dict(arch="llama", layers=layers, hidden=hidden, heads=heads,
                kv_heads=c.int("num_key_value_heads", 8), head_dim=c.head_dim(hidden, heads, 128),
                ffn=c.int("intermediate_size_mlp", 16384), vocab=c.int("vocab_size", 202048),
                max_seq=c.int("max_position_embeddings", 4096 * 32),
                tied_embeddings=c.flag("tie_word_embeddings", False), mlp=c.mlp("hidden_act", "silu", gated=True),
                norm="rmsnorm", position="rope", attention_bias=c.flag("attention_bias", False),
                attention_dropout=c.number("attention_dropout", 0.0),
                attention_chunk_size=chunk if CHUNKED_ATTENTION in types else None,
                layer_types=types if CHUNKED_ATTENTION in types and set(types) != {CHUNKED_ATTENTION} else (),
                num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn,
                moe_shared_expert_intermediate_size=expert_ffn, moe_layer_freq=_moe_layers(c, layers))


def llama4(c: "HFConfig") -> dict[str, Any]:
    """The multimodal Llama 4: its text_config's language model (the output layer untied
    unless the top level says otherwise, as the model builds it)."""
    text = c.nested("text_config")
    fields = llama4_text(text)
    if "tie_word_embeddings" in c.cfg and "tie_word_embeddings" not in text.cfg:
        fields["tied_embeddings"] = c.flag("tie_word_embeddings", False)
    return fields


READERS = {"llama4": llama4, "llama4_text": llama4_text}
