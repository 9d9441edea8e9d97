"""The shipped calibration against the published measurements transcribed in stage_cosim/validation.

These are regression guards on the calibrated model: the measured step times come from the
papers, the predictions from the simulator with the shipped per-family parameters, each row run
with its published layout alone (the switches it does not state are its software profile's
defaults). Tests named ``test_pin_*`` check the calibration on the rows it was fitted to: they
are regression pins, not evidence of accuracy (held-out figures: benchmarks/calibrate.py). The
rest are checks on rows never fitted, guarded at the level docs/validation.md reports.
"""

from __future__ import annotations

import pytest

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.validation.published import TrainingRun, korthikanti_table5, megatron_core_weak_scaling
from stage_cosim.workload import synthesize

# The levels docs/validation.md reports (regression guards, not targets), published layout alone:
# NeMo 24.07's FP8 rows with the bottom-up H100 fit (mean 3.20 %, worst 10.6 %), Llama 3 405B's
# rows (-20.7 % and -21.2 % at 8K, -29.9 % at 131K).
NEMO_MEAN, NEMO_WORST = 0.035, 0.115
LLAMA3_BAND = (-0.31, -0.19)


def relative_errors(runs: list[TrainingRun], cluster: str) -> list[float]:
    errors = []
    for run in runs:
        c = resolve_cluster(cluster, run.gpus)
        result, _, _ = simulate(synthesize(run.model, run.parallel(), c.gpu), c)
        errors.append(result.step_time_s / run.measured_step_s - 1)
    return errors


@pytest.mark.slow
def test_pin_korthikanti_table5_fitted_rows() -> None:
    errors = [abs(e) for e in relative_errors(korthikanti_table5(), "dgx-a100")]
    assert sum(errors) / len(errors) <= 0.035
    assert max(errors) <= 0.08


@pytest.mark.slow
def test_pin_megatron_core_weak_scaling_fitted_rows() -> None:
    errors = [abs(e) for e in relative_errors(megatron_core_weak_scaling(), "dgx-h100")]
    assert sum(errors) / len(errors) <= 0.105       # 10.1 %
    assert max(errors) <= 0.29      # the 32B row, the model's known outlier (docs/validation.md)


def test_moe_rows_with_the_same_calibration() -> None:
    """Checks, not fits. Mixtral 8x7B on 64 H100 (its step time derived from 468 TFLOP/s with
    Megatron-Core v0.9's formula) at its documented level (-9.1 %; -2.3 % before the causal
    kernel's skipped half of the score matrix, when the H100 fit had learnt the full matrix's
    time); DeepSeek-V3 FP8 on 2,048 H800 with the report's own layout: its tokens
    dispatched once per node reached (node-limited routing, the flex dispatcher) and its 16
    stages run by DualPipe (each rank holds stage i and stage 15 - i, so the heavy first and
    last stages share ranks), within 5 % of its 180K H800-hours per trillion tokens (the same
    row under 1F1B is 63 % slow: its last stage, with the MTP module and both output heads,
    alone computes longer than the measured step)."""
    from stage_cosim.validation.published import moe_published

    errors = {}
    for run in moe_published():
        cluster = resolve_cluster(run.cluster, run.gpus)
        result, _, _ = simulate(synthesize(run.model, run.parallel(), cluster.gpu), cluster)
        errors[run.name] = result.step_time_s / run.measured_step_s - 1
    assert abs(errors["mixtral-8x7b"]) <= 0.10
    assert abs(errors["deepseek-v3"]) <= 0.05


# -- NeMo Framework 24.07, FP8 on H100 (fitted together with Megatron-Core's table) ----------------

# The performance table, transcribed here by hand from the NeMo 24.07 performance summary:
# model, GPUs, global batch, micro-batch, sequence, tp, pp, cp, vp, tokens/s per GPU.
NEMO_TABLE = [
    ("GPT3-5B", 64, 2048, 4, 2048, 1, 1, 1, 1, 22521), ("GPT3-20B", 64, 256, 2, 2048, 2, 1, 1, 1, 5851),
    ("GPT3-175B", 128, 256, 1, 2048, 4, 8, 1, 6, 726), ("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 1, 6, 782),
    ("LLAMA2-7B", 8, 128, 1, 4096, 1, 1, 1, 1, 16847), ("LLAMA2-13B", 16, 128, 1, 4096, 1, 4, 1, 10, 8646),
    ("LLAMA2-70B", 64, 128, 1, 4096, 4, 4, 1, 20, 1707), ("Nemotron-8B", 64, 256, 4, 4096, 2, 1, 1, 1, 12701),
    ("Nemotron-22B", 64, 256, 2, 4096, 2, 4, 1, 10, 4256), ("Nemotron-340B", 128, 32, 1, 4096, 8, 8, 1, 12, 322),
    ("LLAMA3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12036), ("LLAMA3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1533),
]
# the table's model TFLOP/s per GPU, in the same order
NEMO_TFLOPS = [736, 750, 782, 842, 776, 754, 759, 653, 554, 678, 697, 738]
NOMINAL_B = [5, 20, 175, 175, 7, 13, 70, 8, 22, 340, 8, 70]


def test_nemo_fp8_rows_load_with_the_table_values() -> None:
    from stage_cosim.validation.published import nemo2407_fp8_h100

    runs = nemo2407_fp8_h100()
    assert len(runs) == len(NEMO_TABLE)
    for run, (model, gpus, gb, mb, s, tp, pp, cp, vp, tokens), billions in zip(runs, NEMO_TABLE, NOMINAL_B):
        assert run.name == f"{model} ({gpus})"
        assert (run.gpus, run.global_batch, run.micro_batch, run.seq_len, run.tp, run.pp, run.cp, run.vp) == \
            (gpus, gb, mb, s, tp, pp, cp, vp)
        assert run.dp * run.tp * run.pp * run.cp == gpus
        assert run.measured_step_s == pytest.approx(gb * s / (tokens * gpus), rel=1e-12)
        assert (run.dtype, run.fp8_recipe, run.fp8_format, run.cp_comm) == ("fp8", "delayed", "hybrid", "p2p")
        assert run.parallel().world_size == gpus
        assert abs(run.model.param_count() / 1e9 / billions - 1) < 0.1


@pytest.mark.slow
def test_nemo_model_dimensions_reproduce_the_tables_model_flops() -> None:
    """NeMo reports model TFLOP/s beside tokens/s; their ratio is its FLOPs per token, which the
    recipes' dimensions (vocabulary, query groups, MLP width) must reproduce with our model-FLOP
    count (the same convention: matmuls and full s x s attention, forward and backward)."""
    from stage_cosim.validation.published import nemo2407_fp8_h100

    for run, (*_, tokens_per_s_per_gpu), tflops in zip(nemo2407_fp8_h100(), NEMO_TABLE, NEMO_TFLOPS):
        w = synthesize(run.model, run.parallel())
        ours = w.total_model_flops() / (run.global_batch * run.seq_len)
        assert ours == pytest.approx(tflops * 1e12 / tokens_per_s_per_gpu, rel=0.005), run.name


@pytest.mark.slow
def test_pin_nemo_fp8_fitted_rows() -> None:
    """A regression guard on the shipped calibration (the FP8 GEMM curve is fitted to these rows
    together with Megatron-Core's BF16 table): the errors docs/validation.md reports."""
    from stage_cosim.validation.published import nemo2407_fp8_h100

    errors = [abs(e) for e in relative_errors(nemo2407_fp8_h100(), "dgx-h100")]
    assert sum(errors) / len(errors) <= NEMO_MEAN
    assert max(errors) <= NEMO_WORST


# -- Llama 3 405B (BF16, cp 16 at 131K): a check, not fitted ---------------------------------------

def test_llama3_table4_rows() -> None:
    """The paper's mapping and the step time its TFLOP/s imply with PaLM's FLOP count, which
    equals our model-FLOP count for the same step."""
    from stage_cosim.validation.published import llama3_herd_table4, palm_model_flops

    rows = {r.name: r for r in llama3_herd_table4()}
    long = rows["405B 16384 GPUs, 128K, cp16"]
    assert (long.gpus, long.tp, long.cp, long.pp, long.dp, long.seq_len, long.global_batch) == \
        (16384, 8, 16, 16, 8, 131072, 128)
    assert long.global_batch * long.seq_len == 16 * 2**20          # "16M" tokens per batch
    m = long.model
    per_token = 6 * (m.param_count() - m.vocab * m.hidden) + 12 * 126 * 128 * 128 * 131072
    assert long.measured_step_s == pytest.approx(128 * 131072 * per_token / (380e12 * 16384))
    assert long.measured_step_s == pytest.approx(15.28, abs=0.01)
    par = long.parallel()
    assert (par.cp_comm, par.zero, par.vp, par.axis_order) == ("all-gather", 2, 8, ("tp", "cp", "pp", "dp"))
    assert par.layers_per_stage(m.layers)[:2] == (0, 1) and sum(par.layers_per_stage(m.layers)) == 126
    w = synthesize(m, par)
    assert w.total_model_flops() == pytest.approx(palm_model_flops(m, 128, 131072), rel=1e-4)


def test_llama3_table4_prediction() -> None:
    """Guarded at the level docs/validation.md reports and explains (the model is faster than Meta's
    runs by a fifth at 8K and by 30 % at 131K, where attention, at cuDNN's in-training rate, is
    most of the step)."""
    from stage_cosim.validation.published import llama3_herd_table4

    for run in llama3_herd_table4():
        cluster = resolve_cluster(run.cluster, run.gpus)
        result, _, _ = simulate(synthesize(run.model, run.parallel(), cluster.gpu), cluster)
        assert result.fits_in_memory
        assert LLAMA3_BAND[0] <= result.step_time_s / run.measured_step_s - 1 <= LLAMA3_BAND[1], run.name


# -- torchtitan / torchao (PyTorch-native): checks, not fitted ------------------------------------

def test_torchtitan_rows_load_as_published() -> None:
    """Every row is either a run or named with the reason it cannot be expressed; the step time
    is gbs * seq / (tokens/s/GPU * GPUs); torchtitan's defaults (pp micro-batches, two stages per
    rank interleaved, FSDP as ZeRO 3, ZeRO 2 with pipelining) are applied."""
    from stage_cosim.validation.published import torchtitan_benchmarks

    runs, unexpressed = torchtitan_benchmarks()
    assert len(runs) + len(unexpressed) == 50
    assert all(u.reason for u in unexpressed)
    by_index = {int(r.name.rsplit("#", 1)[1]): r for r in runs}
    interleaved = by_index[13]           # 405B, 512 H100, tp8 pp8 dp8, interleaved 1F1B, local batch 32
    assert (interleaved.tp, interleaved.pp, interleaved.dp, interleaved.vp) == (8, 8, 8, 2)
    assert (interleaved.micro_batch, interleaved.global_batch, interleaved.zero) == (4, 256, 2)
    assert interleaved.measured_step_s == pytest.approx(256 * 8192 / (128 * 512))
    async_tp = by_index[21]              # 70B, 256 H100, tp8, float8 tensorwise, async TP
    par = async_tp.parallel()
    assert (par.tp_comm_overlap, par.dtype, par.fp8_recipe, par.zero, par.sp) == (True, "fp8", "tensorwise", 3, True)
    assert "tp_comm_overlap" not in par.assumed
    assert by_index[20].parallel().tp_comm_overlap is False      # the same run without async TP


@pytest.mark.slow
def test_torchtitan_rows_at_their_documented_level() -> None:
    """Guarded at the level docs/validation.md reports (regression pins on check rows, never
    fitted to them), each row's attention FlashAttention-2's (the torchtitan profile's kernel).
    The H200 rows (Float8 FSDP at full power, torchtitan's per-op selective checkpointing)
    within 6 %; on the Grand Teton H100 that describes torchtitan's own H100 rows (500 W GEMM
    rates, HBM2e), the FSDP rows without tp or pp (BF16 and Float8, cp at most 2) within 6 %;
    every other H100 row at most 1 % slower and at most 31 % faster than measured, and the
    rowwise rows 30-60 % faster (their GEMMs priced at the per-tensor FP8 rate and no rescale
    kernel, while the runs are 1.1-1.5x slower than the same runs with tensorwise scaling)."""
    from stage_cosim.validation.published import GRAND_TETON_H100, torchtitan_benchmarks

    runs, _ = torchtitan_benchmarks()
    checked = fsdp = 0
    for run in runs:
        if run.gpu not in ("H100", "H200"):
            continue
        cluster = resolve_cluster(run.cluster, run.gpus)
        result, _, _ = simulate(synthesize(run.model, run.parallel(), cluster.gpu), cluster)
        error = result.step_time_s / run.measured_step_s - 1
        if run.gpu == "H200":
            assert abs(error) <= 0.06, (run.name, error)
            checked += 1
        elif run.fp8_recipe == "rowwise":
            assert -0.60 <= error <= -0.30, (run.name, error)
        elif run.cluster == GRAND_TETON_H100 and run.tp == run.pp == 1 and run.cp <= 2:
            assert abs(error) <= 0.06, (run.name, error)
            fsdp += 1
        else:
            assert -0.31 <= error <= 0.01, (run.name, error)
    assert checked == 2 and fsdp == 6
