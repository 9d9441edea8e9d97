"""GPU descriptions: vendor peaks (from data/gpu_specs.csv) plus calibrated efficiencies.

A hypothetical GPU is just another description: every field can be overridden.

Dense tensor-core peaks per number format: BF16 (every GPU), FP8 (Hopper on: per-tensor and
blockwise-scaled FP8 GEMMs), MXFP8 (Blackwell: block-scaled tensor cores, 32-element E8M0
scales) and FP4 (Blackwell; published, not yet used by a training recipe here). A format a GPU
lacks is None.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from stage_cosim.errors import UserError, require

# Preset name -> row of gpu_specs.csv
_SPEC_ROWS = {
    "A100-40GB": "A100-SXM4-40GB",
    "A100-80GB": "A100-SXM4-80GB",
    "H100-SXM": "H100-SXM5-80GB",
    "H800": "H800-SXM",
    "H200": "H200-SXM-141GB",
    "B200": "B200",
    "GB200": "GB200-NVL72",
}
# Which calibrated parameter set a GPU uses (same silicon generation, same kernels).
_CALIBRATION_FAMILY = {"A100-40GB": "A100", "A100-80GB": "A100", "H100-SXM": "H100", "H800": "H100",
                       "H200": "H100", "B200": "B200", "GB200": "B200"}
# Tensor-core generation. Ampere and Hopper FP8 GEMMs take both operands K-major only (TN), so
# FP8 training keeps transposed copies of its operands for the backward GEMMs; Blackwell's
# read either layout.
ARCHES = ("ampere", "hopper", "blackwell")
_ARCH = {"A100-40GB": "ampere", "A100-80GB": "ampere", "H100-SXM": "hopper", "H800": "hopper", "H200": "hopper",
         "B200": "blackwell", "GB200": "blackwell"}
# Streaming multiprocessors of the shipping parts (NVIDIA A100, H100 and Blackwell architecture
# whitepapers and data sheets: A100 108, H100 SXM5 and its export and HBM3e variants 132, B200 148).
_SM_COUNT = {"A100-40GB": 108, "A100-80GB": 108, "H100-SXM": 132, "H800": 132, "H200": 132, "B200": 148,
             "GB200": 148}
# Matmul number formats -> the GPU field holding their dense peak.
MATMUL_PEAKS = {"bf16": "bf16_tflops", "fp8": "fp8_tflops", "mxfp8": "mxfp8_tflops", "fp4": "fp4_tflops"}


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float            # dense peak
    fp8_tflops: float | None
    hbm_GiB: float                # capacity
    hbm_GBps: float               # bandwidth, 10^9 B/s
    nvlink_GBps: float            # per direction, 10^9 B/s
    scaleout_GBps: float | None   # NIC bandwidth per GPU, 10^9 B/s
    matmul_efficiency: float
    matmul_half_flops: float
    attention_efficiency: float
    memory_efficiency: float
    kernel_overhead_us: float
    scale_up_efficiency: float
    scale_out_efficiency: float
    # Non-tensor-core throughput (norms, softmax, optimizer): the FP32 CUDA-core rate, which is
    # 1/16 of the dense BF16 tensor rate on A100, H100 and B200 when not given.
    vector_tflops: float | None = None
    # Dense peaks of the block-scaled formats (None: the GPU has no such tensor cores).
    mxfp8_tflops: float | None = None
    fp4_tflops: float | None = None
    arch: str = "hopper"
    # FP8 GEMMs reach their own fraction of the FP8 peak (quantized operands, scale handling,
    # a higher rate to feed), with their own small-GEMM falloff. These defaults are the
    # calibration file's ``default`` section (for a GPU built without it); families with
    # measured FP8 runs (H100) have fitted values there.
    fp8_matmul_efficiency: float = 0.6
    fp8_matmul_half_flops: float = 4e9
    # Keys per query at which a fused attention kernel runs at half its rate: each query tile
    # pays a fixed prologue and epilogue (load Q, rescale and write O) besides its loop over
    # the keys, so short key ranges (the chunks of ring attention) run slower.
    attention_half_keys: float = 64.0
    # Streaming multiprocessors, and the rows of work one FlashAttention thread block takes
    # (a tile of 128 queries forward, of 128 keys backward, for the head dimensions up to 256
    # of FlashAttention-2 on Ampere and Hopper and FlashAttention-3's BF16 kernels from 65 up):
    # a fused attention kernel whose tiles are fewer than the SMs leaves the rest idle. 0 SMs:
    # not known, occupancy not modelled.
    sm_count: int = 0
    attention_block_rows: int = 128

    def __post_init__(self) -> None:
        for f in ("bf16_tflops", "hbm_GiB", "hbm_GBps", "nvlink_GBps"):
            require(getattr(self, f) > 0, f"gpu.{f}", f"must be positive, got {getattr(self, f)!r}")
        for f in ("fp8_tflops", "mxfp8_tflops", "fp4_tflops"):
            v = getattr(self, f)
            require(v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0), f"gpu.{f}",
                    f"must be positive (or absent: no such tensor cores), got {v!r}")
        for f in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "scale_up_efficiency",
                  "scale_out_efficiency", "fp8_matmul_efficiency"):
            v = getattr(self, f)
            require(0 < v <= 1, f"gpu.{f}", f"must be in (0, 1], got {v!r}")
        require(self.matmul_half_flops >= 0, "gpu.matmul_half_flops", "must be non-negative")
        require(self.fp8_matmul_half_flops >= 0, "gpu.fp8_matmul_half_flops", "must be non-negative")
        require(self.kernel_overhead_us >= 0, "gpu.kernel_overhead_us", "must be non-negative")
        require(self.arch in ARCHES, "gpu.arch", f"must be one of {', '.join(ARCHES)}, got {self.arch!r}")
        require(self.attention_half_keys >= 0, "gpu.attention_half_keys", "must be non-negative")
        require(self.sm_count >= 0, "gpu.sm_count", f"must be non-negative, got {self.sm_count!r}")
        require(self.attention_block_rows > 0, "gpu.attention_block_rows",
                f"must be positive, got {self.attention_block_rows!r}")

    @property
    def vector_peak_tflops(self) -> float:
        return self.vector_tflops if self.vector_tflops else self.bf16_tflops / 16

    def peak_tflops(self, fmt: str) -> float | None:
        """Dense tensor-core peak of a matmul number format (None: not supported)."""
        return getattr(self, MATMUL_PEAKS[fmt])

    @property
    def fp8_transposes(self) -> bool:
        """Whether FP8 GEMMs need transposed operand copies (TN-only FP8 tensor cores)."""
        return self.arch != "blackwell"

    @property
    def memory_bytes(self) -> int:
        return int(self.hbm_GiB * (1 << 30))

    def with_overrides(self, **kw: Any) -> "GPU":
        known = {f.name for f in fields(self)}
        for k in kw:
            if k not in known:
                raise UserError(f"gpu.{k}", f"is not a GPU field (fields: {', '.join(sorted(known))})")
        return replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@lru_cache(maxsize=1)
def calibration() -> dict[str, dict[str, float]]:
    with resources.files("stage_cosim.hardware").joinpath("data", "calibration.yaml").open() as f:
        return yaml.safe_load(f)


def _efficiencies(name: str) -> dict[str, float]:
    cal = calibration()
    params = dict(cal["default"])
    params.update(cal.get(_CALIBRATION_FAMILY.get(name, name), {}) or {})
    return {k: float(v) for k, v in params.items()}


@lru_cache(maxsize=None)
def _spec_rows() -> dict[str, dict[str, str]]:
    with resources.files("stage_cosim.hardware").joinpath("data", "gpu_specs.csv").open() as f:
        return {r["gpu"]: r for r in csv.DictReader(f)}


def _opt(v: str) -> float | None:
    return float(v) if v else None


def get_gpu(name: str) -> GPU:
    if name not in _SPEC_ROWS:
        raise UserError("gpu", f"unknown GPU {name!r} (known: {', '.join(_SPEC_ROWS)})")
    r = _spec_rows()[_SPEC_ROWS[name]]
    return GPU(name=name, bf16_tflops=float(r["bf16_dense_tflops"]), fp8_tflops=_opt(r["fp8_dense_tflops"]),
               mxfp8_tflops=_opt(r["mxfp8_dense_tflops"]), fp4_tflops=_opt(r["fp4_dense_tflops"]),
               hbm_GiB=float(r["hbm_GB"]), hbm_GBps=float(r["hbm_GBps"]),
               nvlink_GBps=float(r["nvlink_per_direction_GBps"]),
               scaleout_GBps=_opt(r["scaleout_per_gpu_GBps"]), arch=_ARCH[name], sm_count=_SM_COUNT[name],
               **_efficiencies(name))


def gpu_names() -> list[str]:
    return list(_SPEC_ROWS)
