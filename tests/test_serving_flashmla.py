"""Multi-latent attention's absorbed decode priced as FlashMLA measures it: its own kernel rate
(a flavour of the attention rate the op names), from FlashMLA's published H800 figures —
660 TFLOP/s compute-bound, 3,000 GB/s memory-bound (attention_microbench.csv)."""

from __future__ import annotations

import pytest

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.kernels import InferenceComputeModel
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import BatchShape
from stage_cosim.model import resolve_model
from stage_cosim.parallel import ParallelConfig
from stage_cosim.serving.steptime import StepTimer

FLASHMLA_TFLOPS = 660e12        # FlashMLA README: "660 TFLOPS in computation-bound configuration" (H800)
FLASHMLA_BPS = 3000e9           # "up to 3000 GB/s in memory-bound configuration" (H800)


def test_flashmla_on_h800_runs_at_its_published_rates() -> None:
    """One layer of DeepSeek-V3's absorbed decode on a DP rank: 64 requests at 4,096 cached
    tokens, 128 heads, scores over 576 (latent 512 + rotary 64) and values over 512, so
    2 * 64 * 4096 * 128 * (576 + 512) FLOPs; the BF16 latent cache is 64 * 4096 * 576 * 2 bytes.
    Compute-bound at 660 TFLOP/s (one launch on top); a cache read alone, at 3,000 GB/s."""
    gpu = resolve_cluster("dgx-h800").gpu
    cm = InferenceComputeModel(gpu)
    flops = 2 * 64 * 4096 * 128 * (576 + 512)          # 73.0 GFLOP
    nbytes = 64 * 4096 * 576 * 2                        # 302 MB
    launch = gpu.kernel_overhead_us * 1e-6
    t = cm.duration_s(flops, nbytes, "flashmla", attention=True, groups=1, keys=4096)
    assert t == pytest.approx(flops / FLASHMLA_TFLOPS + launch, rel=1e-9)       # 110.6 us
    assert flops / FLASHMLA_TFLOPS > nbytes / FLASHMLA_BPS                        # (100.7 us of bytes)
    # memory-bound: one head group's worth of FLOPs over the same bytes
    t_mem = cm.duration_s(flops // 128, nbytes, "flashmla", attention=True, keys=4096)
    assert t_mem == pytest.approx(nbytes / FLASHMLA_BPS + launch, rel=1e-9)
    # the generic fused attention on the same GPU (cuDNN's in training: 40 % of the BF16
    # peak, less at short key loops) is slower than FlashMLA's 67 %
    assert cm.duration_s(flops, nbytes, "bf16", attention=True, keys=4096) > 1.5 * t


def test_flashmla_rates_carry_over_to_hopper_by_share_of_peak() -> None:
    """FlashMLA is an SM90 kernel: an H200 runs it at the H800's shares of its peaks, 660 / 989
    of BF16 and 3,000 / 3,350 of HBM: 660 TFLOP/s (the same tensor cores) and
    3,000 / 3,350 * 4,800 = 4,299 GB/s."""
    h200 = InferenceComputeModel(resolve_cluster("dgx-h200").gpu)
    assert h200.attention_rate("flashmla") == pytest.approx(660 / 989 * 989e12, rel=1e-9)
    assert h200.attention_bandwidth("flashmla") == pytest.approx(3000 / 3350 * 4800e9, rel=1e-9)
    # no measurement on another architecture: the generic kernel in its format
    a100 = InferenceComputeModel(resolve_cluster("dgx-a100").gpu)
    assert a100.attention_rate("flashmla", 4096) == a100.attention_rate("bf16", 4096)
    assert a100.attention_bandwidth("flashmla") == a100.memory_bandwidth
    # the training model has no kernel of its own: the generic BF16 attention
    train = ComputeModel(resolve_cluster("dgx-h800").gpu)
    assert train.attention_rate("flashmla", 4096) == train.attention_rate("bf16", 4096)


def test_deepseek_v3_decode_attention_is_flashmla_and_only_there() -> None:
    """A decode step of DeepSeek-V3 runs its absorbed attention as FlashMLA; its attention
    kernels cost what the FlashMLA rates say of their FLOPs and bytes; a dense Llama's decode
    attention stays the generic kernel."""
    m = resolve_model("deepseek-v3")
    par = ParallelConfig(dp=8, ep=8)
    timer = StepTimer(m, par, InferenceConfig("decode", attention_dp=True), resolve_cluster("dgx-h800:8"), 0)
    shape = BatchShape.uniform(32, 1, 2047, frozenset(m.layer_windows()))
    nodes = [n for n in timer.workload(shape).role(0).nodes if n.type == "COMP" and n.category == "attention"]
    assert nodes and {n.matmul for n in nodes} == {"flashmla"}
    gpu = timer.cluster.gpu
    for n in nodes:
        want = max(n.flops / FLASHMLA_TFLOPS, n.mem_bytes / FLASHMLA_BPS) + gpu.kernel_overhead_us * 1e-6
        assert timer._compute.node_duration_s(n) == pytest.approx(want, rel=1e-6)   # noqa: SLF001
    llama = resolve_model("llama3-8b")
    t2 = StepTimer(llama, ParallelConfig(), InferenceConfig("decode"), resolve_cluster("dgx-h800"), 0)
    w = t2.workload(BatchShape.uniform(8, 1, 1023, frozenset(llama.layer_windows())))
    assert {n.matmul for n in w.role(0).nodes if n.category == "attention"} == {"bf16"}
