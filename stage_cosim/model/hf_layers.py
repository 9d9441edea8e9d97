"""Layer-pattern keys that more than one Hugging Face reader reads (the dense Qwen-MoE readers in
:mod:`stage_cosim.model.hf` and Qwen3-Next's in :mod:`stage_cosim.model.hf_hybrid`): kept apart so
neither reader module imports the other's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stage_cosim.model.hf import HFConfig


def sparse_layers(c: "HFConfig", layers: int) -> tuple[int, ...] | int:
    """Qwen-MoE: layer i has experts unless it is in mlp_only_layers, every decoder_sparse_step-th
    (1 where every layer has them)."""
    step = c.int("decoder_sparse_step", 1)
    only = c.cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise c.error("mlp_only_layers", only, "must be a list of layer indices")
    pattern = tuple(int(i not in only and (i + 1) % step == 0) for i in range(layers))
    return 1 if all(pattern) else pattern
