"""Serving steps' GEMMs priced from the measured microbenchmarks: bytes against the measured HBM
bandwidth where they are memory-bound, no small-GEMM floor per kernel or per expert."""

from __future__ import annotations

import csv
import math
from importlib import resources

import pytest

from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import BatchShape
from stage_cosim.model import resolve_model
from stage_cosim.parallel import ParallelConfig
from stage_cosim.adapters.roofline.kernels import InferenceComputeModel, measured_rate
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
    cm = InferenceComputeModel(gpu)
    bw = _triad("A100-SXM4-80GB")
    # 8 experts of 4096 x 14336 BF16 weights, 4 tokens each
    nbytes = 8 * 4096 * 14336 * 2
    flops = 8 * 2 * 4 * 4096 * 14336
    t8 = cm.duration_s(flops, nbytes, "bf16", groups=8)
    assert t8 == pytest.approx(nbytes / bw + gpu.kernel_overhead_us * 1e-6, rel=1e-9)
    assert t8 == pytest.approx(cm.duration_s(flops, nbytes, "bf16", groups=1), rel=1e-9)


def test_a_varied_gpu_scales_its_measurements() -> None:
    """A design exploration that varies a shipped GPU's peaks gets the measured fractions of
    them: A100 with twice its HBM bandwidth streams at twice the measured triad, with twice its
    BF16 peak runs the 8192^3 GEMM at twice the measured 253.7 TFLOP/s, and every kernel of the
    step (attention and norms too) moves its bytes at that one rate."""
    gpu = resolve_cluster("dgx-a100").gpu
    bw = _triad("A100-SXM4-80GB")
    fast_hbm = InferenceComputeModel(gpu.with_overrides(hbm_GBps=2 * gpu.hbm_GBps))
    nbytes = 1 << 30
    assert fast_hbm.duration_s(0, nbytes, "") == pytest.approx(nbytes / (2 * bw) + gpu.kernel_overhead_us * 1e-6,
                                                              rel=1e-12)
    assert InferenceComputeModel(gpu).duration_s(0, nbytes, "") == nbytes / bw + gpu.kernel_overhead_us * 1e-6
    fast_tc = InferenceComputeModel(gpu.with_overrides(bf16_tflops=2 * gpu.bf16_tflops))
    f = 2.0 * 8192 ** 3
    assert fast_tc.duration_s(f, 3 * 8192 ** 2 * 2, "bf16") == pytest.approx(f / (2 * 253.7e12) + 1e-6, rel=1e-9)


def test_compute_bound_gemm_runs_at_the_measured_rate() -> None:
    """A100's cuBLASLt 8192^3 FP16 GEMM measured 253.7 TFLOP/s: a GEMM of that size costs its
    FLOPs at that rate (plus a launch), between measured sizes the rate is interpolated, and
    below the smallest measured size it is that size's rate (time proportional to FLOPs)."""
    gpu = resolve_cluster("dgx-a100").gpu
    cm = InferenceComputeModel(gpu)
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


# -- one kernel model for every inference step --------------------------------------------------

@pytest.mark.parametrize("model,par", [("llama3-8b", dict(tp=1)), ("llama3-70b", dict(tp=8)),
                                       ("mixtral-8x7b", dict(tp=2, ep=2, expert_tp=1))])
def test_simulate_phase_decode_is_the_serving_step(model: str, par: dict) -> None:
    """``simulate --phase decode``, serve-sim's step timer and the serving search's decode rate
    give one decode step one time: 16 requests at 1,000 tokens of context (999 cached before
    the step's token) on H100."""
    from stage_cosim import api
    from stage_cosim.search.serving import DecodeTarget, decode_rate

    m, p = resolve_model(model), ParallelConfig(**par)
    cluster = resolve_cluster("dgx-h100", p.world_size)
    step = api.simulate(dict(model=model, cluster=f"dgx-h100:{p.world_size}", phase="decode", batch=16,
                             context_len=1000, **par))["step_time_s"]
    timer = StepTimer(m, p, InferenceConfig("decode"), cluster)
    shape = BatchShape.uniform(16, 1, 999, frozenset(m.layer_windows()))
    assert timer.simulate(shape) == step
    assert timer(shape) == pytest.approx(step, rel=1e-9)        # the split: exact up to rounding
    assert timer.stats.mode == "split"
    if p.world_size <= 2 and 16 % p.world_size == 0:
        config = {"parallel": par, "attention_dp": False, "instance_gpus": p.world_size}
        ev = decode_rate(m, cluster, config, {}, DecodeTarget(batch_per_gpu=16 // p.world_size, context_len=1000))
        assert ev.result["step_time_s"] == step


def test_simulate_phase_decode_reads_at_the_measured_bandwidth(run_cli) -> None:
    """``simulate --phase decode`` prices the step as serve-sim does: Llama 2 7B on one A100,
    32 requests at 1K context, is its weights and KV cache over the measured triad bandwidth
    (to within 10 %; priced by the training fit's small-GEMM knee it was 1.55x that)."""
    import json

    bw = _triad("A100-SXM4-80GB")
    m = resolve_model("llama2-7b")
    h = m.hidden
    weights = (m.layers * (4 * h * h + 3 * h * m.ffn) + 2 * m.vocab * h) * 2
    kv = 32 * 1024 * m.layers * 2 * h * 2
    code, out, err = run_cli("simulate", "--model", "llama2-7b", "--cluster", "dgx-a100:1", "--phase", "decode",
                             "--batch", "32", "--context-len", "1025", "--json")
    assert code == 0, err
    assert json.loads(out)["step_time_s"] == pytest.approx((weights + kv) / bw, rel=0.10)


def test_training_steps_keep_the_training_fit() -> None:
    """Only inference steps take the measured GEMMs: a training step's GEMMs are the training
    fit's, which the published training runs calibrate."""
    from stage_cosim.adapters.roofline.compute import ComputeModel
    from stage_cosim.adapters.roofline.kernels import step_compute_model

    gpu = resolve_cluster("dgx-h100").gpu
    assert type(step_compute_model(gpu, inference=False)) is ComputeModel
    assert type(step_compute_model(gpu, inference=True)) is InferenceComputeModel


def test_step_timer_prices_attention_as_the_kernel_model() -> None:
    """The step timer's attention pricing (the GPU's constants taken out of the step's loop) is
    ``duration_s`` bit for bit, over kernels of every regime: memory- or compute-bound, short
    and long key loops, few and many rows, no work."""
    import random

    from stage_cosim.serving.steptime import _pricer

    for gpu in (resolve_cluster("dgx-h100").gpu, resolve_cluster("dgx-a100").gpu):
        cm = InferenceComputeModel(gpu)
        for matmul in ("bf16", "fp8", ""):
            if matmul == "fp8" and gpu.peak_tflops("fp8") is None:
                continue
            price = _pricer(cm, matmul, True, 0.5)
            rnd = random.Random(7)
            for _ in range(300):
                flops, nbytes = rnd.choice([0.0, 1e3, rnd.uniform(1, 1e13)]), rnd.uniform(0, 1e10)
                groups, w = rnd.choice([0.4, 1.0, rnd.uniform(1, 5e4)]), rnd.choice([0.0, rnd.uniform(0, 3e4)])
                want = cm.duration_s(int(math.ceil(flops - 1e-9)), int(math.ceil(nbytes - 1e-9)), matmul, True,
                                     max(1, round(groups)), int(math.ceil(w * 0.5 - 1e-9)))
                assert price(flops, nbytes, groups, w) == want
