"""Fit the few efficiency parameters of each GPU type to the published measurements.

    python benchmarks/calibrate.py            # print the fit
    python benchmarks/calibrate.py --write    # and store it in hardware/data/calibration.yaml

Per GPU family, one parameter set for all rows (no per-row tuning): matmul efficiency, the
small-GEMM half-efficiency size, memory efficiency, kernel overhead, scale-up and scale-out
bus-bandwidth efficiency. scipy minimizes the mean squared relative error of step time.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import minimize

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import calibration
from stage_cosim.validation.published import TrainingRun, korthikanti_table5, megatron_core_weak_scaling
from stage_cosim.workload import synthesize

CLUSTER_OF = {"korthikanti2022": "dgx-a100", "megatron-core-0.8": "dgx-h100"}
FAMILY_OF = {"dgx-a100": "A100", "dgx-h100": "H100"}
PARAMS = ("matmul_efficiency", "matmul_half_flops", "memory_efficiency", "kernel_overhead_us",
          "scale_up_efficiency", "scale_out_efficiency")
# Search box (physically meaningful ranges) and scale of each parameter for the optimizer.
BOUNDS = {"matmul_efficiency": (0.4, 1.0), "matmul_half_flops": (1e7, 5e10), "memory_efficiency": (0.4, 0.95),
          "kernel_overhead_us": (0.0, 20.0), "scale_up_efficiency": (0.3, 1.0), "scale_out_efficiency": (0.3, 1.0)}
LOG_PARAMS = {"matmul_half_flops"}


def runs_for(cluster: str) -> list[TrainingRun]:
    runs = korthikanti_table5() + megatron_core_weak_scaling()
    return [r for r in runs if CLUSTER_OF[r.source] == cluster]


@lru_cache(maxsize=None)
def _workload(run: TrainingRun):
    w = synthesize(run.model, run.parallel())
    w.roles  # build every stage once; the fit re-simulates them many times
    return w


def predict(run: TrainingRun, params: dict[str, float] | None = None) -> float:
    cluster = resolve_cluster(CLUSTER_OF[run.source], run.gpus)
    if params:
        cluster = replace(cluster, gpu=cluster.gpu.with_overrides(**params))
    result, _, _ = simulate(_workload(run), cluster)
    return result.step_time_s


def fit(cluster: str, exclude: int | None = None) -> dict[str, float]:
    runs = [r for i, r in enumerate(runs_for(cluster)) if i != exclude]
    base = calibration()["default"] | (calibration().get(FAMILY_OF[cluster]) or {})

    def decode(x: np.ndarray) -> dict[str, float]:
        out = {}
        for v, name in zip(x, PARAMS):
            lo, hi = BOUNDS[name]
            if name in LOG_PARAMS:
                lo, hi = np.log(lo), np.log(hi)
            val = lo + (hi - lo) / (1 + np.exp(-v))          # squash into the box
            out[name] = float(np.exp(val) if name in LOG_PARAMS else val)
        return out

    def encode(params: dict[str, float]) -> np.ndarray:
        xs = []
        for name in PARAMS:
            lo, hi = BOUNDS[name]
            val = float(params[name])
            if name in LOG_PARAMS:
                lo, hi, val = np.log(lo), np.log(hi), np.log(val)
            frac = min(max((val - lo) / (hi - lo), 1e-4), 1 - 1e-4)
            xs.append(np.log(frac / (1 - frac)))
        return np.array(xs)

    def loss(x: np.ndarray) -> float:
        p = decode(x)
        errs = [predict(r, p) / r.measured_step_s - 1 for r in runs]
        return float(np.mean(np.square(errs)))

    res = minimize(loss, encode(base), method="Nelder-Mead", options={"maxiter": 400, "xatol": 1e-3, "fatol": 1e-7})
    return decode(res.x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="store the fit in hardware/data/calibration.yaml")
    args = ap.parse_args()
    fitted = {}
    for cluster, family in FAMILY_OF.items():
        params = fit(cluster)
        fitted[family] = {k: float(f"{v:.4g}") for k, v in params.items()}
        errs = [predict(r, params) / r.measured_step_s - 1 for r in runs_for(cluster)]
        print(f"{family}: {fitted[family]}")
        print(f"   mean |error| {100 * np.mean(np.abs(errs)):.2f} %, worst {100 * np.max(np.abs(errs)):.2f} %")
    if args.write:
        path = Path(__file__).resolve().parents[1] / "hardware" / "data" / "calibration.yaml"
        text = path.read_text()
        head = text.split("\ndefault:")[0]
        doc = {"default": calibration()["default"], **fitted}
        path.write_text(head + "\n" + yaml.safe_dump(doc, sort_keys=False))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
