"""Model presets, Hugging Face configs, and the parameter count derived from the graph."""

from __future__ import annotations

import json

import pytest

from stage_cosim.errors import UserError
from stage_cosim.graph.transformer import symbolic_param_count
from stage_cosim.model import PRESETS, resolve_model

# Parameter counts published with the models (Hugging Face model cards / safetensors index).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.3-70b": 70_553_706_496,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "gpt-oss-20b": 20_914_757_184,      # OpenAI's model card: 20.91B (3.61B active without the input embedding)
    "llama3.1-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_params_match_published(name: str) -> None:
    assert PRESETS[name].param_count() == PUBLISHED_PARAMS[name]


def test_gpt3_is_175b() -> None:
    # 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) from Narayanan et al. 2021, learned positions.
    m = PRESETS["gpt3-175b"]
    l, h, v, s = m.layers, m.hidden, m.vocab, m.max_seq
    assert m.param_count() == 12 * l * h * h + 13 * l * h + v * h + s * h + 2 * h


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_graph_weights_equal_closed_form(name: str) -> None:
    m = PRESETS[name]
    assert symbolic_param_count(m) == m.param_count() + m.mtp_param_count()   # MTP modules: graph only


def test_hf_gpt2_config(tmp_path) -> None:
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
           "n_positions": 1024, "activation_function": "gelu_new"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = resolve_model(str(path))
    assert (m.arch, m.ffn, m.tied_embeddings) == ("gpt", 3072, True)
    assert m.param_count() == 124_439_808  # GPT-2 small, as published


def test_hf_llama_config_folder(tmp_path) -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = resolve_model(str(tmp_path))
    assert m.param_count() == PUBLISHED_PARAMS["llama3-8b"]


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not a valid JSON"),
    ('{"foo": 1}', "no model_type or architectures"),
    ('{"model_type": "gpt2", "n_layer": 2, "n_embd": -5, "n_head": 1, "vocab_size": 10}', "n_embd"),
    ("[1, 2]", "expected a JSON object"),
])
def test_malformed_hf_config(tmp_path, content: str, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(UserError) as exc:
        resolve_model(str(path))
    assert exc.value.parameter == "model" and needle in str(exc.value)


def test_unknown_preset() -> None:
    with pytest.raises(UserError, match="unknown preset"):
        resolve_model("gpt5-10t")


# Mixture-of-Experts presets: (total, active) as published, to their published precision
# (Mixtral 8x7B's total is its safetensors count; GPT-OSS's active count leaves out the
# embedding table, 201088 x 2880, which ours includes).
PUBLISHED_MOE = {
    "mixtral-8x7b": ((46_702_792_704, 0), (12.9e9, 0.05e9)),
    "mixtral-8x22b": ((141e9, 0.5e9), (39e9, 0.5e9)),
    "qwen3-30b-a3b": ((30.5e9, 0.05e9), (3.3e9, 0.06e9)),
    "qwen3-235b-a22b": ((235e9, 0.5e9), (22e9, 0.5e9)),
    "gpt-oss-120b": ((116.83e9, 0.005e9), (5.13e9 + 201088 * 2880, 0.005e9)),
    "deepseek-v3": ((671e9, 0.5e9), (37e9, 1e9)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MOE))
def test_moe_presets_total_and_active_match_published(name: str) -> None:
    (total, tol), (active, atol) = PUBLISHED_MOE[name]
    m = PRESETS[name]
    assert m.param_count() == pytest.approx(total, abs=tol)
    assert m.active_param_count() == pytest.approx(active, abs=atol)


def test_deepseek_v3_mtp_module_is_its_14b_beyond_671b() -> None:
    """The released checkpoint holds 685B: 671B plus the MTP module (with its own copy of the
    embedding and output tables, shared in training)."""
    m = PRESETS["deepseek-v3"]
    assert m.param_count() + m.mtp_param_count() + 2 * m.vocab * m.hidden == pytest.approx(685e9, abs=1e9)
