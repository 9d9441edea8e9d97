"""The FlashAttention-3 paper's H100 attention-kernel comparison (attention_kernels_h100.csv)
and what the bottom-up calibration takes from it: the training-step rate of a kernel (forward
and backward at their 1 : 2.5 FLOP ratio), checked by hand and against an independent
measurement, and the attention model's fit to the causal kernel the Megatron-Core and NeMo runs
use."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stage_cosim.hardware.gpu import get_gpu
from stage_cosim.validation import components as comp


def _rate(kernel: str, phase: str, causal: bool, seq: int) -> float:
    return next(r.tflops for r in comp.kernel_attention_rows()
                if (r.kernel, r.phase, r.causal, r.seq) == (kernel, phase, causal, seq))


def test_the_paper_table_is_whole() -> None:
    """Three kernels, forward with and without the mask and backward without it, six lengths,
    every length at 16k tokens in 16 heads of 128."""
    rows = comp.kernel_attention_rows()
    assert len(rows) == 3 * 3 * 6
    assert {(r.batch * r.seq, r.heads, r.head_dim) for r in rows} == {(16384, 16, 128)}
    assert not any(r.causal and r.phase == "bwd" for r in rows)


def test_training_rate_combines_the_passes_at_their_flop_ratio() -> None:
    """cuDNN, causal, 4k, by hand: the forward 518 TFLOP/s; the backward without a mask 499,
    times what the mask costs the forward at 4k (518 / 609); the step's rate 3.5 / (1/518 +
    2.5/424.4) = 447.5."""
    row = next(r for r in comp.training_attention_rows("cudnn", causal=True) if r.seq == 4096)
    bwd = 499 * 518 / 609
    assert row.tflops == pytest.approx(3.5 / (1 / 518 + 2.5 / bwd), rel=1e-12)
    assert row.tflops == pytest.approx(447.5, abs=0.1)
    # without a mask both passes are measured: no assumption
    plain = next(r for r in comp.training_attention_rows("flash_attn_2", causal=False) if r.seq == 8192)
    assert plain.tflops == pytest.approx(3.5 / (1 / _rate("flash_attn_2", "fwd", False, 8192)
                                                + 2.5 / _rate("flash_attn_2", "bwd", False, 8192)))


def test_flash_attention_2_agrees_with_the_azure_measurement() -> None:
    """Two sources, one kernel: FlashAttention-2's fwd+bwd at 8k on H100 from the paper's two
    passes (331.3 TFLOP/s) and Azure's fwd+bwd benchmark of it (attention_microbench.csv,
    327.9) agree within 2 %."""
    paper = next(r for r in comp.training_attention_rows("flash_attn_2", causal=False) if r.seq == 8192)
    azure = next(r for r in comp.attention_rows() if r.gpu == "H100-SXM5-80GB" and r.seq == 8192)
    assert paper.tflops / azure.tflops == pytest.approx(1.0, abs=0.02)


def test_the_causal_kernel_is_faster_than_the_old_floor() -> None:
    """What the end-to-end H100 fit had bounded attention by (at least FlashAttention-2 without
    a mask) is far below the kernel the runs use: cuDNN's causal step rate is 1.35-1.5 times
    FlashAttention-2's unmasked one from 4k on, and FlashAttention-2 with a mask is below both."""
    for seq in (4096, 8192, 16384):
        cudnn = next(r for r in comp.training_attention_rows("cudnn", causal=True) if r.seq == seq)
        fa2 = next(r for r in comp.training_attention_rows("flash_attn_2", causal=False) if r.seq == seq)
        fa2_causal = next(r for r in comp.training_attention_rows("flash_attn_2", causal=True) if r.seq == seq)
        assert 1.35 <= cudnn.tflops / fa2.tflops <= 1.5, seq
        assert fa2_causal.tflops < fa2.tflops


@pytest.mark.slow
def test_calibration_pins_attention_to_the_runs_kernel() -> None:
    """The H100 component fit: cuDNN's causal training rate at every length within 3 % (the
    half-rate key length fitted with it, about three times an unmasked kernel's), and the
    end-to-end box no longer holds attention."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from calibrate import end_to_end_box, fit_components
    from stage_cosim.hardware.gpu import family_efficiencies

    comps = fit_components("H100", family_efficiencies("H100"))
    fit = next(f for f in comps.fits if "cuDNN" in f.file)
    assert max(abs(e) for e in fit.errors(comps.by_file[fit.file])) <= 0.03
    plain = next(f for f in comps.fits if "FlashAttention-2 without a mask" in f.file)
    assert comps.params["attention_half_keys"] > 2 * comps.by_file[plain.file]["attention_half_keys"]
    assert comps.params["attention_efficiency"] == comps.by_file[fit.file]["attention_efficiency"]
    assert "attention_efficiency" not in end_to_end_box("H100", comps).names
    # the model at the fitted values, by hand at 4k: 989 x eff x 4096 / (4096 + half keys)
    g = get_gpu("H100-SXM").with_overrides(attention_efficiency=comps.params["attention_efficiency"],
                                            attention_half_keys=comps.params["attention_half_keys"])
    row = next(r for r in fit.rows if r.seq == 4096)
    assert comp.attention_tflops(row, g) == pytest.approx(
        989 * g.attention_efficiency * 4096 / (4096 + g.attention_half_keys), rel=1e-9)


@pytest.mark.slow
def test_end_to_end_fit_scales_the_microbenchmark_rates_by_one_training_factor() -> None:
    """The end-to-end fit's tensor-core parameters are the microbenchmarks' rates times one
    factor: on H100 the BF16 GEMM's MAMF ceiling (794.5 of 989 TFLOP/s), the FP8 GEMM's and
    cuDNN attention's component fits; by hand at a factor of 0.5 each is half its rate, and the
    BF16 GEMM's half size follows the FP8 one's at the same time per GEMM."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from calibrate import end_to_end_box, fit_components, in_training, microbenchmark_rates
    from stage_cosim.hardware.gpu import family_efficiencies

    comps = fit_components("H100", family_efficiencies("H100"))
    rates = microbenchmark_rates("H100", comps)
    assert rates["matmul_efficiency"] == pytest.approx(794.5 / 989, rel=1e-3)
    assert rates["attention_efficiency"] == comps.params["attention_efficiency"]
    assert end_to_end_box("H100", comps).names == ("kernel_overhead_us", "training_factor", "scale_out_efficiency")
    p = in_training("H100", comps.params, rates, {"training_factor": 0.5, "kernel_overhead_us": 2.0,
                                                  "scale_out_efficiency": 0.9})
    for name, rate in rates.items():
        assert p[name] == pytest.approx(0.5 * rate, rel=1e-12), name
    assert (p["kernel_overhead_us"], p["scale_out_efficiency"]) == (2.0, 0.9)
    assert "training_factor" not in p
    bf16, fp8 = 989 * p["matmul_efficiency"], 1979 * p["fp8_matmul_efficiency"]
    assert p["matmul_half_flops"] / bf16 == pytest.approx(p["fp8_matmul_half_flops"] / fp8, rel=1e-12)
    # A100: its BF16 GEMM sweep is the rate scaled; its runs' attention is materialized (no
    # fused kernel to scale or fit) and one node's links are measured, the IB ones too
    a100 = fit_components("A100", family_efficiencies("A100"))
    assert set(microbenchmark_rates("A100", a100)) == {"matmul_efficiency"}
    assert end_to_end_box("A100", a100).names == ("kernel_overhead_us", "training_factor")
