"""Inference steps: prefill and decode, the shape of a batch, the KV cache."""

from stage_cosim.inference.config import PHASES, BatchShape, InferenceConfig, Sequence

__all__ = ["PHASES", "BatchShape", "InferenceConfig", "Sequence"]
