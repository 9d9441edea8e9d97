"""SimResult: the one result shape every backend returns and every interface prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

def fp8_mfu(model_flops: float, step_s: float, gpu: Any, num_gpus: int, precision: Any) -> float | None:
    """MFU against the dense peak the FP8 GEMMs run at (None unless training in FP8)."""
    if not precision.fp8:
        return None
    return model_flops / (step_s * gpu.peak_tflops(precision.matmul) * 1e12 * num_gpus)


BREAKDOWN_KEYS = ("compute", "exposed_tp", "exposed_cp", "exposed_ep", "exposed_dp", "exposed_pp", "exposed_embedding",
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
                            "(backward = 2x forward), attention over the whole score matrix the layer's keys span "
                            "(s x s; s x window for sliding layers; the chunks' squares for chunked ones), "
                            "causal mask not subtracted, no recomputation; "
                            "MFU and HFU against the dense BF16 peak, as NVIDIA's published MFU counts; "
                            "mfu_fp8 against the dense FP8 (MXFP8) peak; HFU counts every executed FLOP "
                            "including recomputation")
    backend: str = "roofline"
    # The training precision: {"dtype": "bf16"}, or the FP8 recipe and its options.
    precision: dict[str, Any] = field(default_factory=lambda: {"dtype": "bf16"})
    # MFU against the dense peak of the format the FP8 GEMMs run in (None for BF16 training).
    mfu_fp8: float | None = None

    @property
    def mfu_label(self) -> str:
        """How the MFU figures read: "34.1 % of BF16 peak (17.0 % of FP8 peak)"."""
        text = f"{100 * self.mfu:.1f} % of BF16 peak"
        if self.mfu_fp8 is not None:
            fmt = "MXFP8" if self.precision.get("recipe") == "mxfp8" else "FP8"
            text += f" ({100 * self.mfu_fp8:.1f} % of {fmt} peak)"
        return text
    # An inference step (None for training): phase, batch, latency, bytes read, MBU, KV cache
    # (see stage_cosim.inference.summary).
    inference: dict[str, Any] | None = None
    # The model's parameter counts, total and active, and what each counts
    # (stage_cosim.model.params; None where the model is not known, as for foreign traces).
    parameters: dict[str, Any] | None = None

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / max(1, int(self.config.get("num_gpus", 1)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s_per_gpu"] = self.tokens_per_s_per_gpu
        return d
