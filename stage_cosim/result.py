"""SimResult: the one result shape every backend returns and every interface prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BREAKDOWN_KEYS = ("compute", "exposed_tp", "exposed_dp", "exposed_pp", "exposed_embedding",
                  "exposed_other", "pipeline_bubble", "idle")


@dataclass
class RoleResult:
    """One pipeline stage (all its ranks behave alike)."""

    stage: int
    finish_s: float
    compute_s: float
    breakdown: dict[str, float]
    peak_memory_bytes: int
    memory: dict[str, int]


@dataclass
class SimResult:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    peak_memory_bytes: int
    memory_capacity_bytes: int
    fits_in_memory: bool
    breakdown: dict[str, float]          # seconds by category, of the stage that sets the step time
    config: dict[str, Any]
    roles: list[RoleResult] = field(default_factory=list)
    flop_convention: str = ("model FLOPs = matmul and attention FLOPs of forward and backward "
                            "(backward = 2x forward), full s x s attention, no recomputation; "
                            "HFU counts every executed FLOP including recomputation")
    backend: str = "roofline"

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / max(1, int(self.config.get("num_gpus", 1)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s_per_gpu"] = self.tokens_per_s_per_gpu
        return d
