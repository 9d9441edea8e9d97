"""Predicted vs measured step time for every published training run in the validation data,
each run with its published layout alone (what a user would type: layout, precision, batch,
optimizer sharding; its software profile's defaults for the rest).

    python benchmarks/validate_published.py            # calibrated parameters as shipped

Korthikanti et al. 2022 (Table 5, A100 Selene), Megatron-Core 0.8 (H100 weak scaling, BF16; the
step time is derived from the published TFLOP/s with the table's own FLOP formula) and NeMo
Framework 24.07 (H100, FP8 with Transformer Engine's delayed scaling; the step time is
gbs * seq / (tokens/s/GPU * GPUs)), the rows the shipped calibration was fitted to; then checks
with the same parameters, never fitted: the Mixture-of-Experts rows (Mixtral 8x7B on 64 H100,
DeepSeek-V3 FP8 on 2,048 H800) and Llama 3 405B's pre-training configurations (BF16, up to
16,384 H100, cp16 at 131K tokens; the step time from the paper's TFLOP/s with PaLM's FLOP count).
Then the PyTorch-native rows of torchtitan and torchao (checks, never fitted), with the rows the
tool cannot express and why. Held-out errors (leave-one-source-out, leave-one-out) are
benchmarks/calibrate.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate import predict  # noqa: E402
from stage_cosim.validation.published import (  # noqa: E402
    TrainingRun, korthikanti_table5, llama3_herd_table4, megatron_core_weak_scaling, moe_published, nemo2407_fp8_h100,
    torchtitan_benchmarks,
)


def mapping(run: TrainingRun) -> str:
    """tp·pp·cp·dp (vp, micro-batch) as the tables give them."""
    degrees = f"{run.tp}·{run.pp}·{run.cp}·{run.dp}" if run.cp > 1 else f"{run.tp}·{run.pp}·{run.dp}"
    return degrees + (f" vp{run.vp}" if run.vp > 1 else "") + f" mb{run.micro_batch}"


def report(title: str, runs: list[TrainingRun]) -> None:
    print(f"\n{title}")
    print(f"{'run':<28} {'gpus':>6} {'tp·pp·[cp·]dp':>20} {'measured s':>11} {'predicted s':>12} {'error':>8}")
    errors = []
    for run in runs:
        pred = predict(run)
        err = pred / run.measured_step_s - 1
        errors.append(abs(err))
        print(f"{run.name:<28} {run.gpus:>6} {mapping(run):>20} {run.measured_step_s:>11.3f} {pred:>12.3f} "
              f"{100 * err:>+7.1f}%", flush=True)
    print(f"mean absolute error {100 * sum(errors) / len(errors):.2f} %, worst {100 * max(errors):.2f} %")


def main() -> None:
    report("Korthikanti et al. 2022, Table 5 (A100-80GB, Selene)", korthikanti_table5())
    report("Megatron-Core 0.8 weak scaling (H100, BF16)", megatron_core_weak_scaling())
    report("NeMo Framework 24.07 (H100, FP8 delayed scaling)", nemo2407_fp8_h100())
    report("Llama 3 405B pre-training, Table 4 (H100, BF16; checks, not fitted)", llama3_herd_table4())
    runs, unexpressed = torchtitan_benchmarks()
    report("torchtitan / torchao (FSDP2, TP, PP, CP, Float8; checks, not fitted; the H100 rows ran at 500 W)", runs)
    print(f"not expressible: {len(unexpressed)} of {len(runs) + len(unexpressed)} rows")
    for u in unexpressed:
        print(f"  {u.name}: {u.reason}")
    print("\nMixture of Experts (checks, not fitted: the same calibration)")
    print(f"{'run':<14} {'gpus':>5} {'tp':>3} {'ep':>3} {'pp':>3} {'vp':>3} {'dp':>4} {'precision':>9} "
          f"{'measured s':>11} {'predicted s':>12} {'error':>8}")
    for run in moe_published():
        pred = predict(run)
        precision = run.dtype + (f" {run.fp8_recipe}" if run.fp8_recipe else "")
        print(f"{run.name:<14} {run.gpus:>5} {run.tp:>3} {run.ep:>3} {run.pp:>3} {run.vp:>3} {run.dp:>4} {precision:>9} "
              f"{run.measured_step_s:>11.3f} {pred:>12.3f} {100 * (pred / run.measured_step_s - 1):>+7.1f}%", flush=True)


if __name__ == "__main__":
    main()
