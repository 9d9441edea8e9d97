"""Built-in model presets and the one function that turns a user's --model into a ModelConfig."""

from __future__ import annotations

from pathlib import Path

from stage_cosim.errors import UserError
from stage_cosim.model.config import ModelConfig

# Dimensions from the published papers and the models' own config.json files.
PRESETS: dict[str, ModelConfig] = {
    # GPT-3 (Brown et al. 2020), trained without flash attention: the score matrix is materialized.
    "gpt3-175b": ModelConfig.build("gpt3-175b", "gpt", layers=96, hidden=12288, heads=96,
                                   vocab=50257, max_seq=2048, attention="unfused"),
    "llama2-7b": ModelConfig.build("llama2-7b", "llama", layers=32, hidden=4096, ffn=11008,
                                   heads=32, vocab=32000, max_seq=4096),
    "llama2-70b": ModelConfig.build("llama2-70b", "llama", layers=80, hidden=8192, ffn=28672,
                                    heads=64, kv_heads=8, vocab=32000, max_seq=4096),
    "llama3-8b": ModelConfig.build("llama3-8b", "llama", layers=32, hidden=4096, ffn=14336,
                                   heads=32, kv_heads=8, vocab=128256, max_seq=8192),
    "llama3-70b": ModelConfig.build("llama3-70b", "llama", layers=80, hidden=8192, ffn=28672,
                                    heads=64, kv_heads=8, vocab=128256, max_seq=8192),
    "llama3.1-405b": ModelConfig.build("llama3.1-405b", "llama", layers=126, hidden=16384,
                                       ffn=53248, heads=128, kv_heads=8, vocab=128256,
                                       max_seq=131072),
}

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
