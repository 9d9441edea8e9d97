"""Read a Hugging Face ``config.json`` (GPT-2 style or Llama style keys) into a ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stage_cosim.errors import UserError
from stage_cosim.model.config import ModelConfig

_GPT2_KEYS = ("n_layer", "n_embd", "n_head")
_LLAMA_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads")


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError("model", f"{where}: key {key!r} must be a positive integer, got {value!r}")
    return value


def read_hf_config(path: Path) -> tuple[Any, Path]:
    """The parsed config.json at ``path`` (a file or a model directory) and the file read."""
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


def model_from_hf_dict(cfg: object, file: Path | str = "config") -> ModelConfig:
    """A ModelConfig from the parsed content of a Hugging Face config.json."""
    file = Path(file)
    if not isinstance(cfg, dict):
        raise UserError("model", f"{file}: expected a JSON object")
    name = str(cfg.get("_name_or_path") or cfg.get("model_type") or file.parent.name or "hf-model")
    if all(k in cfg for k in _GPT2_KEYS):
        hidden = _int(cfg, "n_embd", file)
        inner = cfg.get("n_inner")
        return ModelConfig.build(
            name, "gpt", layers=_int(cfg, "n_layer", file), hidden=hidden,
            heads=_int(cfg, "n_head", file), vocab=_int(cfg, "vocab_size", file),
            max_seq=_int(cfg, "n_positions", file) if "n_positions" in cfg else 1024,
            ffn=inner if isinstance(inner, int) and inner > 0 else 4 * hidden,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    if all(k in cfg for k in _LLAMA_KEYS):
        hidden = _int(cfg, "hidden_size", file)
        heads = _int(cfg, "num_attention_heads", file)
        head_dim = cfg.get("head_dim")
        if head_dim is None and hidden % heads:
            raise UserError("model", f"{file}: hidden_size {hidden} is not a multiple of "
                                     f"num_attention_heads {heads} and head_dim is missing")
        return ModelConfig.build(
            name, "llama", layers=_int(cfg, "num_hidden_layers", file), hidden=hidden,
            heads=heads, ffn=_int(cfg, "intermediate_size", file),
            kv_heads=_int(cfg, "num_key_value_heads", file) if "num_key_value_heads" in cfg else heads,
            head_dim=_int(cfg, "head_dim", file) if head_dim is not None else None,
            vocab=_int(cfg, "vocab_size", file),
            max_seq=_int(cfg, "max_position_embeddings", file) if "max_position_embeddings" in cfg else 4096,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
    raise UserError("model", f"{file}: neither GPT-2 keys ({', '.join(_GPT2_KEYS)}) nor "
                             f"Llama keys ({', '.join(_LLAMA_KEYS)}) found")
