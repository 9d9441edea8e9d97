"""Hugging Face configs are read per model_type: published models come out with their published
parameter counts, and every key that changes a cost is modelled or refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stage_cosim.errors import UserError
from stage_cosim.graph.transformer import symbolic_param_count
from stage_cosim.model.architecture import SLIDING_ATTENTION
from stage_cosim.model import get_preset
from stage_cosim.model.hf import READERS, model_from_hf_dict

HF = Path(__file__).parent / "data" / "hf"

# config.json as published on the Hugging Face hub -> the published parameter count
# (the safetensors index's total_size / bytes per parameter, or the model card's exact figure).
PUBLISHED = {
    "gpt2": 124_439_808,                      # GPT-2 small
    "Meta-Llama-3-8B": 8_030_261_248,
    "Mistral-7B-v0.1": 7_241_732_096,         # total_size 14,483,464,192 B in bf16
    "Qwen2.5-72B-Instruct": 72_706_203_648,   # total_size 145,412,407,296 B; model card "72.7B"
    "Qwen3-8B": 8_190_735_360,                # total_size 16,381,470,720 B; model card "8.2B"
    "gemma-2-9b": 9_241_705_984,              # safetensors total 9,241,705,984
    "gpt-neox-20b": 20_554_567_680,           # model card "nparameters 20554567680"
    "Phi-3-mini-4k-instruct": 3_821_079_552,  # total_size 7,642,159,104 B; model card "3.8B"
}

# Mixture-of-Experts models: (total, active) parameters. Mixtral-8x7B's total is its safetensors
# count; the others are the published figures at their published precision (model cards and
# reports: Mixtral 46.7B / 12.9B, Qwen1.5-MoE-A2.7B 14.3B / 2.7B, Qwen3-30B-A3B 30.5B / 3.3B,
# DeepSeek-V2 236B / 21B, DeepSeek-V2-Lite 15.7B / 2.4B, DeepSeek-V3 671B / 37B without its
# multi-token-prediction module, GPT-OSS-120b 116.83B / 5.13B).
# Active counts follow two conventions: Mistral and Qwen count the input embedding table (a
# token reads one row of it), DeepSeek and OpenAI leave it out. The last field says which; our
# active count (which includes it) less the table is compared where the publisher leaves it
# out. DeepSeek-V2-Lite shows it: 2.66B with the table, 2.45B without (its card: 2.4B).
MOE = {  # (total, its tolerance), (active, its tolerance), active counts the input embedding
    "Mixtral-8x7B-v0.1": ((46_702_792_704, 0), (12.9e9, 0.05e9), True),
    "Qwen1.5-MoE-A2.7B": ((14.3e9, 0.05e9), (2.7e9, 0.05e9), True),      # ours 14.32B / 2.69B
    "Qwen3-30B-A3B": ((30.5e9, 0.05e9), (3.3e9, 0.06e9), True),     # ours 3.353B; the card rounds down
    "DeepSeek-V2": ((236e9, 0.5e9), (21e9, 0.5e9), False),           # ours 235.74B / 20.85B
    "DeepSeek-V2-Lite": ((15.7e9, 0.05e9), (2.4e9, 0.06e9), False),   # ours 15.71B / 2.45B
    "DeepSeek-V3": ((671e9, 0.5e9), (37e9, 0.5e9), False),           # ours 671.03B / 36.62B
    "gpt-oss-120b": ((116.83e9, 0.005e9), (5.13e9, 0.005e9), False),
}


def _cfg(name: str) -> dict:
    return json.loads((HF / name / "config.json").read_text())


def _read(cfg: dict):
    return model_from_hf_dict(cfg, "config.json")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_count(name: str) -> None:
    m = _read(_cfg(name))
    assert m.param_count() == PUBLISHED[name]
    assert symbolic_param_count(m) == PUBLISHED[name]      # the graph's weights add up the same


@pytest.mark.parametrize("name", sorted(MOE))
def test_mixture_of_experts_published_parameters(name: str) -> None:
    m = _read(_cfg(name))
    (total, tol), (active, atol), with_embedding = MOE[name]
    assert m.param_count() == pytest.approx(total, abs=tol)
    table = m.vocab * m.hidden
    assert m.active_param_count() - (0 if with_embedding else table) == pytest.approx(active, abs=atol)
    assert symbolic_param_count(m) == m.param_count() + m.mtp_param_count()


def test_moe_families_read_key_by_key() -> None:
    ds = _read(_cfg("DeepSeek-V3"))
    assert ds.multi_latent_attention and (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.qk_pos_emb_head_dim,
                                          ds.v_head_dim) == (1536, 512, 128, 64, 128)
    assert ds.moe_layers()[:4] == (False, False, False, True) and sum(ds.moe_layers()) == 58
    assert (ds.num_experts, ds.moe_router_topk, ds.expert_ffn, ds.moe_shared_expert_intermediate_size) == (256, 8, 2048, 2048)
    assert ds.mtp_num_layers == 1 and ds.kv_heads == ds.heads
    # node-limited routing: 8 groups, a token's experts from its 4 best (V2: 3; V2-Lite one group)
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk) == (8, 4)
    assert (_read(_cfg("DeepSeek-V2")).moe_router_group_topk, _read(_cfg("DeepSeek-V2-Lite")).moe_router_num_groups) \
        == (3, None)
    preset = get_preset("deepseek-v3")
    assert (preset.moe_router_num_groups, preset.moe_router_group_topk) == (8, 4)
    oss = _read(_cfg("gpt-oss-120b"))
    assert oss.layer_windows()[:3] == (128, None, 128) and oss.attention_sinks and oss.moe_router_bias
    qwen = _cfg("Qwen3-30B-A3B")
    qwen.update(decoder_sparse_step=2, mlp_only_layers=[1])
    assert _read(qwen).moe_layers()[:6] == (False, False, False, True, False, True)
    q15 = _read(_cfg("Qwen1.5-MoE-A2.7B"))     # a gated shared expert beside 60 routed ones, QKV bias
    assert (q15.num_experts, q15.moe_router_topk, q15.expert_ffn, q15.moe_shared_expert_intermediate_size) == \
        (60, 4, 1408, 5632)
    assert q15.moe_shared_expert_gate and q15.add_qkv_bias and all(q15.moe_layers())
    for name, q_lora, experts, shared in (("DeepSeek-V2", 1536, 160, 2 * 1536),
                                          ("DeepSeek-V2-Lite", None, 64, 2 * 1408)):
        v2 = _read(_cfg(name))                  # V2-Lite projects queries directly (no q_lora_rank)
        assert v2.multi_latent_attention and v2.q_lora_rank == q_lora and v2.mtp_num_layers == 0
        assert (v2.num_experts, v2.moe_router_topk, v2.moe_shared_expert_intermediate_size) == (experts, 6, shared)
        assert v2.moe_layers()[0] is False and all(v2.moe_layers()[1:])


def test_moe_family_without_a_reader_is_named(tmp_path) -> None:
    with pytest.raises(UserError) as exc:
        _read({"model_type": "dbrx", "hidden_size": 8})
    assert 'model_type = "dbrx"' in exc.value.rule and "Mixture-of-Experts" in exc.value.rule


def test_issue_table_no_longer_silently_wrong() -> None:
    """The configs that used to be read as dense Llamas: NeoX's GELU MLP and parallel residual,
    Qwen2's QKV bias, Gemma-2's GeGLU and soft-capping."""
    neox = _read(_cfg("gpt-neox-20b"))
    assert (neox.mlp, neox.parallel_residual, neox.rotary_percent, neox.norm) == ("gelu", True, 0.25, "layernorm")
    qwen = _read(_cfg("Qwen2.5-72B-Instruct"))
    assert qwen.add_qkv_bias and not qwen.attention_bias and not qwen.mlp_bias
    gemma = _read(_cfg("gemma-2-9b"))
    assert gemma.mlp == "geglu" and gemma.sandwich_norm and gemma.scale_embeddings and gemma.tied_embeddings
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (50.0, 30.0)


@pytest.mark.parametrize("cfg, needle", [
    ({"model_type": "falcon", "hidden_size": 8}, 'model_type = "falcon": not a known model type (known: '),
    ({"architectures": ["FalconForCausalLM"]}, "not a known architecture (known: GPT2LMHeadModel"),
    ({"hidden_size": 8}, "no model_type or architectures (known model types: "),
    ({"model_type": 3}, "model_type = 3: not a known model type"),
])
def test_unknown_families_refused_with_the_known_list(cfg: dict, needle: str) -> None:
    with pytest.raises(UserError) as exc:
        _read(cfg)
    assert needle in exc.value.rule
    for known in READERS:
        assert known in exc.value.rule or "architecture" in needle


def test_architectures_alone_name_the_family() -> None:
    cfg = _cfg("Meta-Llama-3-8B")
    del cfg["model_type"]
    assert _read(cfg).param_count() == PUBLISHED["Meta-Llama-3-8B"]


@pytest.mark.parametrize("name, key, value, needle", [
    ("Meta-Llama-3-8B", "hidden_act", "relu", "hidden_act = \"relu\": only SiLU or GELU gated MLPs"),
    ("gpt2", "activation_function", "silu", "activation_function = \"silu\": only GELU MLPs"),
    ("gpt-neox-20b", "hidden_act", "relu", "hidden_act = \"relu\""),
    ("gpt2", "add_cross_attention", True, "add_cross_attention = true: cross-attention is not modelled"),
    ("gemma-2-9b", "use_bidirectional_attention", True, "bidirectional attention is not modelled"),
    ("Meta-Llama-3-8B", "quantization_config", {"quant_method": "gptq"}, "quantized checkpoints are not modelled"),
    ("Meta-Llama-3-8B", "is_encoder_decoder", True, "encoder-decoder models are not modelled"),
    ("gpt2", "embd_pdrop", 0.0, "resid_pdrop = 0.1: dropout here but not at embd_pdrop"),
    ("gpt-neox-20b", "rotary_pct", 1.5, "rotary_pct = 1.5: must be in (0, 1]"),
    ("Phi-3-mini-4k-instruct", "rope_parameters", {"partial_rotary_factor": 0}, "partial_rotary_factor = 0"),
    ("Qwen3-8B", "num_key_value_heads", 5, "kv-heads: must divide heads (32)"),
    ("Meta-Llama-3-8B", "num_hidden_layers", 0, "num_hidden_layers = 0: must be a positive integer"),
    ("Meta-Llama-3-8B", "tie_word_embeddings", "yes", "tie_word_embeddings = \"yes\": must be true or false"),
    ("gemma-2-9b", "layer_types", ["full_attention"], "must have one entry per layer (42)"),
    ("Qwen3-8B", "layer_types", ["sliding_attention"] * 36, "names sliding_attention layers but sliding_window"),
])
def test_cost_keys_refused_in_one_line(name: str, key: str, value, needle: str) -> None:
    cfg = _cfg(name)
    cfg[key] = value
    with pytest.raises(UserError) as exc:
        _read(cfg)
    assert exc.value.parameter == "model" and needle in exc.value.rule and "\n" not in exc.value.rule


def test_missing_dimension_is_named() -> None:
    cfg = _cfg("Qwen3-8B")
    del cfg["intermediate_size"]
    with pytest.raises(UserError, match="key 'intermediate_size' is missing"):
        _read(cfg)


def test_sliding_windows_per_family() -> None:
    mistral = _read(_cfg("Mistral-7B-v0.1"))
    assert set(mistral.layer_windows()) == {4096}                 # every layer, as HF's Mistral
    gemma = _read(_cfg("gemma-2-9b"))
    assert gemma.layer_windows()[:4] == (4096, None, 4096, None)  # even layers slide
    assert gemma.layer_types == (SLIDING_ATTENTION, "full_attention")
    phi = _read(_cfg("Phi-3-mini-4k-instruct"))
    assert set(phi.layer_windows()) == {2047}
    qwen = _cfg("Qwen2.5-72B-Instruct")
    assert set(_read(qwen).layer_windows()) == {None}             # use_sliding_window: false
    qwen["use_sliding_window"] = True                             # then layers from max_window_layers on
    windows = _read(qwen).layer_windows()
    assert windows[:70] == (None,) * 70 and windows[70:] == (131072,) * 10
    qwen3 = _cfg("Qwen3-8B")
    qwen3.update(use_sliding_window=True, sliding_window=4096, max_window_layers=0)
    assert set(_read(qwen3).layer_windows()) == {4096}


def test_absent_keys_take_the_family_defaults() -> None:
    """As Hugging Face builds the model: a key left out means the class default."""
    gemma = _cfg("gemma-2-9b")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "head_dim"):
        del gemma[key]
    m = _read(gemma)
    assert (m.attn_logit_softcapping, m.final_logit_softcapping, m.sliding_window, m.head_dim) == (50.0, 30.0, 4096, 256)
    gemma["final_logit_softcapping"] = None                      # explicitly off
    assert _read(gemma).final_logit_softcapping is None
    neox = _cfg("gpt-neox-20b")
    del neox["rotary_pct"], neox["use_parallel_residual"]
    m = _read(neox)
    assert (m.rotary_percent, m.parallel_residual, m.attention_bias) == (0.25, True, True)
    assert _read(_cfg("gpt2")).hidden_dropout == 0.1


def test_keys_the_family_does_not_read_are_ignored() -> None:
    """Hugging Face's Mistral has no biases whatever the file says; Phi-3's file carries an
    attention_bias its implementation never reads; legacy GPT-NeoX dropout keys are unused."""
    mistral = _cfg("Mistral-7B-v0.1")
    mistral["attention_bias"] = True
    assert _read(mistral).param_count() == PUBLISHED["Mistral-7B-v0.1"]
    neox = _cfg("gpt-neox-20b")
    neox["hidden_dropout_prob"] = 0.1
    assert _read(neox).hidden_dropout == 0.0


def test_biases_and_partial_rotary_in_newer_files() -> None:
    llama = _cfg("Meta-Llama-3-8B")
    llama.update(attention_bias=True, mlp_bias=True)
    m = _read(llama)
    h, f, kv = 4096, 14336, 8 * 128
    assert m.param_count() - PUBLISHED["Meta-Llama-3-8B"] == 32 * ((h + 2 * kv) + h + (2 * f + h))
    llama = _cfg("Meta-Llama-3-8B")
    llama["rope_parameters"] = {"rope_theta": 500000.0, "partial_rotary_factor": 0.5}
    assert _read(llama).rotary_percent == 0.5


def test_cli_refuses_an_unmodelled_moe_config_in_one_line(run_cli, tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "dbrx", "d_model": 6144}))
    code, out, err = run_cli("simulate", "--model", str(path), "--cluster", "dgx-h100:8")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: model: ") and "dbrx" in err


# -- older dense families: GPT-J, OPT, BLOOM ---------------------------------------------------

def _dense(layers: int, h: int, ffn: int, vocab: int, *, norms: int, qkv_bias: bool, mlp_bias: bool,
           extra: int = 0, untied: bool = False) -> int:
    """A multi-head-attention model's parameters by hand: per layer 4h^2 (QKV and output) + 2 h
    ffn, their biases, ``norms`` LayerNorms (2h each); the embedding table, ``extra`` (position
    table, embedding and final norms), an untied output layer."""
    layer = 4 * h * h + 2 * h * ffn + (4 * h if qkv_bias else 0) + ((ffn + h) if mlp_bias else 0) + norms * 2 * h
    return layers * layer + vocab * h * (2 if untied else 1) + extra


# name -> (its published parameter count and the tolerance the publisher rounds to, our count by hand)
OLDER = {
    # EleutherAI's model card: 6,053,381,344 (they count more than the modules: "6B", 6.05 B); one
    # LayerNorm per layer, no attention biases, an untied output layer (its bias not modelled)
    "gpt-j-6b": ((6.05e9, 0.005e9), _dense(28, 4096, 16384, 50400, norms=1, qkv_bias=False, mlp_bias=True,
                                           extra=2 * 4096, untied=True)),
    # Hugging Face's count of facebook/opt-6.7b is 6,658,473,984, with the learned position table's
    # two offset rows (2 x 4096) that the model leaves out; the paper's sizes for the rest
    "opt-6.7b": ((6_658_473_984 - 2 * 4096, 0), _dense(32, 4096, 16384, 50272, norms=2, qkv_bias=True, mlp_bias=True,
                                                      extra=2048 * 4096 + 2 * 4096)),
    "opt-13b": ((13e9, 0.2e9), _dense(40, 5120, 20480, 50272, norms=2, qkv_bias=True, mlp_bias=True,
                                      extra=2048 * 5120 + 2 * 5120)),
    "opt-30b": ((30e9, 0.1e9), _dense(48, 7168, 28672, 50272, norms=2, qkv_bias=True, mlp_bias=True,
                                      extra=2048 * 7168 + 2 * 7168)),
    "opt-66b": ((66e9, 0.3e9), _dense(64, 9216, 36864, 50272, norms=2, qkv_bias=True, mlp_bias=True,
                                      extra=2048 * 9216 + 2 * 9216)),
    # BigScience's model cards: 7,069,016,064 and 176,247,271,424; the embedding LayerNorm and the final one
    "bloom-7b1": ((7_069_016_064, 0), _dense(30, 4096, 4 * 4096, 250880, norms=2, qkv_bias=True, mlp_bias=True,
                                            extra=2 * 2 * 4096)),
    "bloom": ((176_247_271_424, 0), _dense(70, 14336, 4 * 14336, 250880, norms=2, qkv_bias=True, mlp_bias=True,
                                          extra=2 * 2 * 14336)),
}
PRESET_OF = {"gpt-j-6b": "gptj-6b", "opt-6.7b": "opt-6.7b", "opt-13b": "opt-13b", "opt-30b": "opt-30b",
             "opt-66b": "opt-66b", "bloom-7b1": "bloom-7b1", "bloom": "bloom-176b"}


@pytest.mark.parametrize("name", sorted(OLDER))
def test_gptj_opt_bloom_published_parameter_counts(name: str) -> None:
    (published, tol), by_hand = OLDER[name]
    m = _read(_cfg(name))
    assert m.param_count() == by_hand == symbolic_param_count(m)
    assert m.param_count() == pytest.approx(published, abs=tol)
    # the preset is the same model
    assert get_preset(PRESET_OF[name]).with_overrides(name=m.name) == m


def test_opt_175b_preset_is_the_papers_size() -> None:
    # Zhang et al. 2022, Table 1: 96 layers, 96 heads, d_model 12288: "175B"
    m = get_preset("opt-175b")
    assert m.param_count() == _dense(96, 12288, 4 * 12288, 50272, norms=2, qkv_bias=True, mlp_bias=True,
                                     extra=2048 * 12288 + 2 * 12288)
    assert round(m.param_count() / 1e9) == 175


def test_gptj_opt_bloom_read_key_by_key() -> None:
    gptj = _read(_cfg("gpt-j-6b"))
    assert gptj.parallel_residual and gptj.shared_input_norm and gptj.rotary_percent == 64 / 256
    assert (gptj.attention_bias, gptj.mlp_bias, gptj.tied_embeddings, gptj.kv_heads) == (False, True, False, 16)
    opt = _read(_cfg("opt-13b"))
    assert (opt.mlp, opt.position, opt.tied_embeddings, opt.hidden_dropout, opt.max_seq) == \
        ("relu", "learned", True, 0.1, 2048)
    bloom = _read(_cfg("bloom-7b1"))        # n_embed (the older key) read as the hidden size
    assert (bloom.hidden, bloom.heads, bloom.position, bloom.embedding_norm, bloom.mlp) == \
        (4096, 32, "alibi", True, "gelu")
    # OPT without biases (enable_bias) and with a GELU
    cfg = _cfg("opt-6.7b")
    cfg.update(enable_bias=False, activation_function="gelu")
    bare = _read(cfg)
    assert (bare.mlp, bare.attention_bias, bare.mlp_bias) == ("gelu", False, False)
    assert _read(_cfg("opt-6.7b")).param_count() - bare.param_count() == 32 * (4 * 4096 + 16384 + 4096)


@pytest.mark.parametrize("name,key,value,needle", [
    ("opt-6.7b", "word_embed_proj_dim", 512, "projected"),            # OPT-350m
    ("opt-6.7b", "do_layer_norm_before", False, "post-LayerNorm"),     # OPT-350m
    ("opt-6.7b", "layerdrop", 0.1, "layer dropout"),
    ("opt-6.7b", "activation_function", "silu", "ReLU and GELU"),
    ("opt-6.7b", "_remove_final_layer_norm", True, "final LayerNorm"),
    ("bloom-7b1", "slow_but_exact", True, "pretraining_tp"),
    ("gpt-j-6b", "rotary_dim", 512, "head's (256)"),
])
def test_older_families_refuse_what_they_do_not_model(name: str, key: str, value, needle: str) -> None:
    cfg = _cfg(name)
    cfg[key] = value
    with pytest.raises(UserError) as exc:
        _read(cfg)
    assert f"{key} = {json.dumps(value)}" in exc.value.rule and needle in exc.value.rule


def test_cli_refuses_opt_350m_in_one_line(run_cli, tmp_path) -> None:
    cfg = _cfg("opt-6.7b")
    cfg.update(hidden_size=1024, word_embed_proj_dim=512, num_attention_heads=16, num_hidden_layers=24,
               ffn_dim=4096)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run_cli("simulate", "--model", str(path), "--cluster", "dgx-h100:8")
    assert code == 2 and out == "" and err.count("\n") == 1 and "word_embed_proj_dim = 512" in err


def _forward(m, b: int = 2, s: int = 1024) -> dict[str, int]:
    """Forward compute nodes of the embedding and the first layer: name -> FLOPs."""
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.schedule.nodes import COMP
    from stage_cosim.workload import synthesize

    w = synthesize(m, ParallelConfig(micro_batch=b, seq_len=s))
    return {n.name: n.flops for n in w.roles[0].nodes
            if n.type == COMP and n.phase == "fwd" and n.block in ("embedding", "layer0") and n.micro_batch in (0, -1)}


def test_alibi_adds_its_bias_inside_the_attention_kernel() -> None:
    """ALiBi adds slope x distance to every score: a multiply and an add per computed score. The
    causal kernel computes half the s x s scores: b a s^2 / 2 of them (2 b a s^2 d model FLOPs
    per QK^T and PV, halved)."""
    from stage_cosim.model.config import ModelConfig

    b, s, h, a = 2, 1024, 1024, 16
    kw = dict(layers=2, hidden=h, heads=a, vocab=32000, max_seq=4096, hidden_dropout=0.0, attention_dropout=0.0)
    alibi = _forward(ModelConfig.build("x", "gpt", position="alibi", **kw), b, s)
    rope = _forward(ModelConfig.build("x", "gpt", position="rope", **kw), b, s)
    assert rope["layer0.attention"] == 4 * b * s * s * h // 2
    assert alibi["layer0.attention"] - rope["layer0.attention"] == 2 * b * a * s * s // 2
    assert "embedding.position_embedding" not in alibi and not any("rope" in n for n in alibi)
    # unfused: a pass over the materialized scores
    unfused = _forward(ModelConfig.build("x", "gpt", position="alibi", attention="unfused", **kw), b, s)
    assert unfused["layer0.alibi_bias"] == 2 * b * a * s * s


def test_gptj_one_norm_per_layer_and_bloom_embedding_norm() -> None:
    """GPT-J's attention and MLP read one LayerNorm's output (GPT-NeoX's parallel residual has
    two); BLOOM normalizes the embedding; OPT's ReLU is one operation per element."""
    gptj = _forward(get_preset("gptj-6b").with_overrides(layers=2), 1, 512)
    neox = _forward(get_preset("gptj-6b").with_overrides(layers=2, shared_input_norm=False), 1, 512)
    assert [n for n in gptj if n.endswith("norm")] == ["layer0.input_norm"]
    assert [n for n in neox if n.endswith("norm")] == ["layer0.input_norm", "layer0.mlp_norm"]
    bloom = _forward(get_preset("bloom-7b1").with_overrides(layers=2, vocab=32000), 1, 512)
    assert "embedding.embedding_norm" in bloom
    opt = _forward(get_preset("opt-6.7b").with_overrides(layers=2), 1, 512)
    assert opt["layer0.relu"] == 1 * 512 * 16384
    with pytest.raises(UserError, match="shared-input-norm"):
        get_preset("llama3-8b").with_overrides(shared_input_norm=True)
