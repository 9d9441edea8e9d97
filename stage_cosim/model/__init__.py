"""Model descriptions: what is being trained (dimensions and architecture), independent of how."""

from stage_cosim.model.config import ModelConfig
from stage_cosim.model.presets import PRESETS, get_preset, resolve_model

__all__ = ["ModelConfig", "PRESETS", "get_preset", "resolve_model"]
