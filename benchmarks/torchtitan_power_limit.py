"""torchtitan's own H100 rows (Meta's Grand Teton hosts: 96 GB of HBM2e at 2.4 TB/s, a 500 W
power limit) predicted on the GPU that describes them (their GEMM efficiencies scaled by Meta's
GEMM measurements at 500 W, stage_cosim/validation/data/grand_teton_h100.yaml) and on the same
GPU at the 700 W part's GEMM efficiencies: what the power limit accounts for, row by row.

    python benchmarks/torchtitan_power_limit.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate import predict  # noqa: E402
from stage_cosim.hardware.gpu import get_gpu  # noqa: E402
from stage_cosim.validation.published import GRAND_TETON_H100, torchtitan_benchmarks  # noqa: E402


def main() -> None:
    sxm = get_gpu("H100-SXM")
    at_700w = {"matmul_efficiency": sxm.matmul_efficiency, "fp8_matmul_efficiency": sxm.fp8_matmul_efficiency}
    runs = [r for r in torchtitan_benchmarks()[0] if r.cluster == GRAND_TETON_H100]
    print(f"{'run':<28} {'precision':>14} {'measured s':>11} {'700 W GEMMs':>12} {'500 W GEMMs':>12}")
    errors = {"700 W": [], "500 W": []}
    for run in runs:
        for key, pred in (("700 W", predict(run, at_700w)), ("500 W", predict(run))):
            errors[key].append(pred / run.measured_step_s - 1)
        precision = run.dtype + (f" {run.fp8_recipe}" if run.fp8_recipe else "")
        print(f"{run.name:<28} {precision:>14} {run.measured_step_s:>11.3f} {100 * errors['700 W'][-1]:>+11.1f}% "
              f"{100 * errors['500 W'][-1]:>+11.1f}%", flush=True)
    for key, errs in errors.items():
        print(f"{key} GEMMs: mean absolute error {100 * sum(map(abs, errs)) / len(errs):.1f} % over {len(errs)} rows")


if __name__ == "__main__":
    main()
