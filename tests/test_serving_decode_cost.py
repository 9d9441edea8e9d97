"""Serving steps' GEMMs priced from the measured microbenchmarks: bytes against the measured HBM
bandwidth where they are memory-bound, no small-GEMM floor per kernel or per expert."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import BatchShape
from stage_cosim.model import resolve_model
from stage_cosim.parallel import ParallelConfig
from stage_cosim.serving.kernels import ServingComputeModel, measured_rate
from stage_cosim.serving.steptime import StepTimer


def _triad(part: str) -> float:
    with resources.files("stage_cosim.validation").joinpath("data", "hbm_bandwidth.csv").open() as f:
        return max(float(r["bandwidth_tbps"]) * 1e12 for r in csv.DictReader(f)
                   if r["gpu"] == part and r["kernel"] == "triad")


def _decode(model: str, cluster: str, batch: int, context: int, **par) -> float:
    m = resolve_model(model)
    p = ParallelConfig(**par)
    timer = StepTimer(m, p, InferenceConfig("decode"), resolve_cluster(cluster, p.world_size), 0)
    return timer.simulate(BatchShape.uniform(batch, 1, context, frozenset(m.layer_windows())))


def test_llama2_7b_decode_on_a100_is_its_bytes_over_the_measured_bandwidth() -> None:
    """32 requests at 1K context: the step reads the BF16 weights (6.74e9 x 2 bytes) and the KV
    cache (32 x 1024 tokens x 32 layers x 2 x 4096 x 2 bytes); at the measured triad bandwidth
    of an A100 that is the step to within 10 %, and tp2 halves both per GPU."""
    bw = _triad("A100-SXM4-80GB")
    m = resolve_model("llama2-7b")
    h = m.hidden
    weights = (m.layers * (4 * h * h + 3 * h * m.ffn) + 2 * m.vocab * h) * 2      # 6.74e9 parameters
    kv = 32 * 1024 * m.layers * 2 * h * 2
    tp1 = _decode("llama2-7b", "dgx-a100", 32, 1024)
    tp2 = _decode("llama2-7b", "dgx-a100", 32, 1024, tp=2)
    assert tp1 == pytest.approx((weights + kv) / bw, rel=0.10)
    assert tp2 < 0.6 * tp1            # tensor parallelism speeds decode up (the bytes per GPU halve)


def test_grouped_expert_gemms_pay_no_floor_per_expert() -> None:
    """A memory-bound grouped GEMM of 8 experts costs its bytes over the bandwidth plus one
    launch, the same as one GEMM moving the same bytes: no per-expert floor."""
    gpu = resolve_cluster("dgx-a100").gpu
    cm = ServingComputeModel(gpu)
    bw = _triad("A100-SXM4-80GB")
    # 8 experts of 4096 x 14336 BF16 weights, 4 tokens each
    nbytes = 8 * 4096 * 14336 * 2
    flops = 8 * 2 * 4 * 4096 * 14336
    t8 = cm.duration_s(flops, nbytes, "bf16", groups=8)
    assert t8 == pytest.approx(nbytes / bw + gpu.kernel_overhead_us * 1e-6, rel=1e-9)
    assert t8 == pytest.approx(cm.duration_s(flops, nbytes, "bf16", groups=1), rel=1e-9)


def test_compute_bound_gemm_runs_at_the_measured_rate() -> None:
    """A100's cuBLASLt 8192^3 FP16 GEMM measured 253.7 TFLOP/s: a GEMM of that size costs its
    FLOPs at that rate (plus a launch), between measured sizes the rate is interpolated, and
    below the smallest measured size it is that size's rate (time proportional to FLOPs)."""
    gpu = resolve_cluster("dgx-a100").gpu
    cm = ServingComputeModel(gpu)
    f = 2.0 * 8192 ** 3
    assert cm.duration_s(f, 3 * 8192 ** 2 * 2, "bf16") == pytest.approx(f / 253.7e12 + 1e-6, rel=1e-9)
    points = ((1e9, 100e12), (1e11, 200e12))
    assert measured_rate(points, 1e10) == pytest.approx(150e12)
    assert measured_rate(points, 1e8) == 100e12 and measured_rate(points, 1e13) == 200e12


def test_mixtral_decode_is_its_expert_bytes() -> None:
    """Mixtral 8x7B at tp2 ep2 on A100, 16 requests at 512 context: each GPU reads its half of
    the attention and its 4 experts' weights (every expert is hit by 16 x 2 routed tokens over
    8 experts); the step is those bytes over the measured bandwidth within 15 %, not 8 floors
    per layer."""
    m = resolve_model("mixtral-8x7b")
    bw = _triad("A100-SXM4-80GB")
    h, f, layers = m.hidden, m.ffn, m.layers
    experts = 4 * 3 * h * f * 2                          # 4 local experts, three matrices, BF16
    attn = (h * h * 2 + 2 * h * (h // m.heads) * m.kv_heads) * 2 / 2     # q, o + k, v; half per GPU
    kv = 16 * 512 * 2 * (h // m.heads) * m.kv_heads * 2 / 2
    per_gpu = layers * (experts + attn + kv) + m.vocab * h * 2 / 2
    step = _decode("mixtral-8x7b", "dgx-a100", 16, 512, tp=2, ep=2, expert_tp=1)
    assert step == pytest.approx(per_gpu / bw, rel=0.15)
