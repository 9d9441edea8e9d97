"""Predicted vs measured step time for every published training run in the validation data.

    python benchmarks/validate_published.py            # calibrated parameters as shipped
    python benchmarks/validate_published.py --loo      # also leave-one-out: refit without each row

Korthikanti et al. 2022 (Table 5, A100 Selene) and Megatron-Core 0.8 (H100 weak scaling; the
step time is derived from the published TFLOP/s with the table's own FLOP formula), the rows the
calibration is fitted to; then the Mixture-of-Experts rows (Mixtral 8x7B on 64 H100, DeepSeek-V3
FP8 on 2,048 H800) as checks with the same parameters (not fitted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate import CLUSTER_OF, FAMILY_OF, fit, predict  # noqa: E402

FITTED: dict[str, dict[str, float]] = {}   # the shipped calibration: the leave-one-out fits start there

from stage_cosim.validation.published import korthikanti_table5, megatron_core_weak_scaling, moe_published  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loo", action="store_true", help="leave-one-out error (refits once per row)")
    args = ap.parse_args()
    from stage_cosim.hardware.gpu import calibration

    FITTED.update({src: calibration().get(FAMILY_OF[cl]) or {} for src, cl in CLUSTER_OF.items()})
    for title, runs in (("Korthikanti et al. 2022, Table 5 (A100-80GB, Selene)", korthikanti_table5()),
                        ("Megatron-Core 0.8 weak scaling (H100)", megatron_core_weak_scaling())):
        print(f"\n{title}")
        print(f"{'run':<18} {'gpus':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'measured s':>11} {'predicted s':>12} {'error':>8}"
              + (f" {'LOO pred s':>11} {'LOO err':>8}" if args.loo else ""))
        errors, loo_errors = [], []
        for i, run in enumerate(runs):
            pred = predict(run)
            err = pred / run.measured_step_s - 1
            errors.append(abs(err))
            line = (f"{run.name:<18} {run.gpus:>5} {run.tp:>3} {run.pp:>3} {run.dp:>4} {run.measured_step_s:>11.3f} "
                    f"{pred:>12.3f} {100 * err:>+7.1f}%")
            if args.loo:
                # a local refit from the shipped parameters, without this row
                params = fit(CLUSTER_OF[run.source], exclude=i, start=FITTED.get(run.source), max_nfev=16)
                p_loo = predict(run, params)
                e_loo = p_loo / run.measured_step_s - 1
                loo_errors.append(abs(e_loo))
                line += f" {p_loo:>11.3f} {100 * e_loo:>+7.1f}%"
            print(line, flush=True)
        print(f"mean absolute error {100 * sum(errors) / len(errors):.2f} %, worst {100 * max(errors):.2f} %"
              + (f"; leave-one-out mean {100 * sum(loo_errors) / len(loo_errors):.2f} %, "
                 f"worst {100 * max(loo_errors):.2f} %" if args.loo else ""))
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
