"""The shipped calibration against the published measurements transcribed in stage_cosim/validation.

These are regression guards on the calibrated model: the measured step times come from the
papers, the predictions from the simulator with the shipped per-family parameters. The bounds
are the issue's targets where the model meets them (A100) and the documented level where it does
not (H100, see the README's calibration section).
"""

from __future__ import annotations

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.validation.published import TrainingRun, korthikanti_table5, megatron_core_weak_scaling
from stage_cosim.workload import synthesize


def relative_errors(runs: list[TrainingRun], cluster: str) -> list[float]:
    errors = []
    for run in runs:
        result, _, _ = simulate(synthesize(run.model, run.parallel()), resolve_cluster(cluster, run.gpus))
        errors.append(result.step_time_s / run.measured_step_s - 1)
    return errors


def test_korthikanti_table5_a100() -> None:
    errors = [abs(e) for e in relative_errors(korthikanti_table5(), "dgx-a100")]
    assert sum(errors) / len(errors) <= 0.035
    assert max(errors) <= 0.08


def test_megatron_core_weak_scaling_h100() -> None:
    errors = [abs(e) for e in relative_errors(megatron_core_weak_scaling(), "dgx-h100")]
    assert sum(errors) / len(errors) <= 0.065
    assert max(errors) <= 0.25      # the 32B row, the model's known outlier (README)


def test_moe_rows_with_the_same_calibration() -> None:
    """Checks, not fits. Mixtral 8x7B on 64 H100 (its step time derived from 468 TFLOP/s with
    Megatron-Core v0.9's formula) within the H100 table's level; DeepSeek-V3 FP8 on 2,048 H800 is
    the known miss (README: DualPipe's overlap of the all-to-all and the pipeline, node-limited
    routing and the run's memory savings are not modelled), guarded at its documented level."""
    from stage_cosim.validation.published import moe_published

    errors = {}
    for run in moe_published():
        cluster = resolve_cluster(run.cluster, run.gpus)
        result, _, _ = simulate(synthesize(run.model, run.parallel(), cluster.gpu), cluster)
        errors[run.name] = result.step_time_s / run.measured_step_s - 1
    assert abs(errors["mixtral-8x7b"]) <= 0.065
    assert 0.9 <= errors["deepseek-v3"] <= 1.4
