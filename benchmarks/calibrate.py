"""Fit the few efficiency parameters of each GPU type to the published measurements.

    python benchmarks/calibrate.py            # print the fit
    python benchmarks/calibrate.py --write    # and store it in hardware/data/calibration.yaml
    python benchmarks/calibrate.py --family H100 --global-check
        # a global search (differential evolution over the same bounds, minimizing the mean
        # absolute error directly, started from the shipped set): is there a better parameter set?

Per GPU family, one parameter set for all rows (no per-row tuning): matmul efficiency, the
small-GEMM half-efficiency size, flash-attention efficiency, memory efficiency, kernel overhead,
scale-up and scale-out bus-bandwidth efficiency, and, where the family has FP8 rows, the FP8 GEMMs'
own efficiency and half-efficiency size. The H100 family is fitted to Megatron-Core's BF16 table
and NeMo 24.07's FP8 table together (one set for both). scipy minimizes a robust (soft-L1) loss of
the relative step-time errors.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import differential_evolution, least_squares

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import calibration
from stage_cosim.validation.published import (TrainingRun, korthikanti_table5, megatron_core_weak_scaling,
                                              nemo2407_fp8_h100)
from stage_cosim.workload import synthesize

CLUSTER_OF = {"korthikanti2022": "dgx-a100", "megatron-core-0.8": "dgx-h100", "nemo24.07_fp8_h100": "dgx-h100"}
FAMILY_OF = {"dgx-a100": "A100", "dgx-h100": "H100"}
PARAMS = ("matmul_efficiency", "matmul_half_flops", "attention_efficiency", "memory_efficiency",
          "kernel_overhead_us", "scale_up_efficiency", "scale_out_efficiency",
          "fp8_matmul_efficiency", "fp8_matmul_half_flops")
FP8_PARAMS = ("fp8_matmul_efficiency", "fp8_matmul_half_flops")
# Physically meaningful ranges: the fit may not leave them.
# (Flash attention reaches 30-75 % of dense peak on A100/H100 — FlashAttention-2's causal
# backward on H100 near the bottom, cuDNN/FlashAttention-3 forward near the top; streaming kernels
# 75-92 % of HBM; NCCL bus bandwidth 60-95 % of the link. FP8 GEMMs on Hopper reach a lower
# fraction of their twice-as-high peak than BF16 GEMMs: 40-80 %.)
BOUNDS = {"matmul_efficiency": (0.5, 0.9), "matmul_half_flops": (1e8, 1e11), "attention_efficiency": (0.3, 0.8),
          "memory_efficiency": (0.75, 0.92), "kernel_overhead_us": (1.0, 10.0), "scale_up_efficiency": (0.6, 0.95),
          "scale_out_efficiency": (0.6, 0.95), "fp8_matmul_efficiency": (0.4, 0.8),
          "fp8_matmul_half_flops": (1e8, 1e11)}
LOG_PARAMS = {"matmul_half_flops", "fp8_matmul_half_flops"}


def runs_for(cluster: str) -> list[TrainingRun]:
    """Every published row measured on ``cluster``'s GPU family, the ones the fit uses."""
    runs = korthikanti_table5() + megatron_core_weak_scaling() + nemo2407_fp8_h100()
    return [r for r in runs if CLUSTER_OF[r.source] == cluster]


def cluster_of(run: TrainingRun) -> str:
    return run.cluster or CLUSTER_OF[run.source]


@lru_cache(maxsize=None)
def _workload(run: TrainingRun):
    w = synthesize(run.model, run.parallel(), resolve_cluster(cluster_of(run), run.gpus).gpu)
    _ = w.roles  # build every stage once; the fit re-simulates them many times
    return w


def predict(run: TrainingRun, params: dict[str, float] | None = None) -> float:
    cluster = resolve_cluster(cluster_of(run), run.gpus)
    if params:
        cluster = replace(cluster, gpu=cluster.gpu.with_overrides(**params))
    result, _, _ = simulate(_workload(run), cluster)
    return result.step_time_s


def _uses_flash(runs: list[TrainingRun]) -> bool:
    return any(r.model.attention == "fused" for r in runs)


def _uses_fp8(runs: list[TrainingRun]) -> bool:
    return any(r.dtype == "fp8" for r in runs)


@dataclass(frozen=True)
class _Box:
    """The fitted parameters of one family as a vector: log10 where LOG_PARAMS says, within BOUNDS;
    every other parameter stays at ``base``."""

    names: tuple[str, ...]
    base: dict[str, float]

    @classmethod
    def of(cls, cluster: str, runs: list[TrainingRun], start: dict[str, float] | None = None) -> "_Box":
        base = dict(calibration()["default"]) | (calibration().get(FAMILY_OF[cluster]) or {}) | (start or {})
        # parameters no row depends on stay where they are (A100 rows use unfused attention and
        # BF16 only)
        names = tuple(p for p in PARAMS if (p != "attention_efficiency" or _uses_flash(runs))
                      and (p not in FP8_PARAMS or _uses_fp8(runs)))
        return cls(names, base)

    def _coord(self, n: str, v: float) -> float:
        return float(np.log10(v)) if n in LOG_PARAMS else v

    @property
    def lo(self) -> np.ndarray:
        return np.array([self._coord(n, BOUNDS[n][0]) for n in self.names])

    @property
    def hi(self) -> np.ndarray:
        return np.array([self._coord(n, BOUNDS[n][1]) for n in self.names])

    def start(self, margin: float) -> np.ndarray:
        """``base`` as a vector, pulled ``margin`` inside the bounds."""
        x = np.array([self._coord(n, self.base[n]) for n in self.names], dtype=float)
        return np.clip(x, self.lo + margin, self.hi - margin)

    def params(self, x: np.ndarray) -> dict[str, float]:
        return self.base | {n: float(10 ** v if n in LOG_PARAMS else v) for n, v in zip(self.names, x)}

    def fitted(self, x: np.ndarray) -> dict[str, float]:
        # (the family's FP8 parameters only where FP8 rows fitted them; otherwise the defaults)
        return {n: v for n, v in self.params(x).items()
                if n in PARAMS and (n not in FP8_PARAMS or n in self.names)}


def fit(cluster: str, exclude: int | None = None, start: dict[str, float] | None = None,
        max_nfev: int = 60, verbose: bool = False) -> dict[str, float]:
    """Least-squares fit of the relative step-time errors within the physical bounds."""
    runs = [r for i, r in enumerate(runs_for(cluster)) if i != exclude]
    box = _Box.of(cluster, runs, start)

    def residuals(x: np.ndarray) -> np.ndarray:
        p = box.params(x)
        res = np.array([predict(r, p) / r.measured_step_s - 1 for r in runs])
        if verbose:
            print(f"   mean |error| {100 * np.mean(np.abs(res)):.2f} % at "
                  f"{ {k: float(f'{v:.4g}') for k, v in box.fitted(x).items()} }", flush=True)
        return res

    lo, hi = box.lo, box.hi
    # A robust loss (about linear beyond 5 %): the mean absolute error is what we report, and one
    # row the model cannot explain should not drag every parameter towards it.
    res = least_squares(residuals, box.start(1e-6), bounds=(lo, hi), diff_step=1e-2, x_scale=hi - lo,
                        max_nfev=max_nfev, loss="soft_l1", f_scale=0.05)
    return box.fitted(res.x)


def global_check(cluster: str, generations: int = 12, seed: int = 0) -> tuple[float, dict[str, float]]:
    """Lowest mean absolute error differential evolution finds within the bounds, and its parameters."""
    runs = runs_for(cluster)
    box = _Box.of(cluster, runs)

    def mean_abs_error(x: np.ndarray) -> float:
        p = box.params(x)
        return float(np.mean([abs(predict(r, p) / r.measured_step_s - 1) for r in runs]))

    res = differential_evolution(mean_abs_error, list(zip(box.lo, box.hi)), x0=box.start(1e-9), seed=seed,
                                 maxiter=generations, popsize=5, polish=False, updating="immediate")
    return float(res.fun), box.fitted(res.x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="store the fit in hardware/data/calibration.yaml")
    ap.add_argument("--family", choices=sorted(FAMILY_OF.values()), default=None, help="fit only this GPU family")
    ap.add_argument("--verbose", action="store_true", help="print the error at every parameter set tried")
    ap.add_argument("--global-check", action="store_true",
                    help="search the whole bounded box for a lower mean error instead of fitting (slow: hundreds of "
                         "evaluations of every row of the family)")
    args = ap.parse_args()
    if args.global_check:
        for cluster, family in FAMILY_OF.items():
            if not args.family or family == args.family:
                err, params = global_check(cluster)
                print(f"{family}: lowest mean |error| found {100 * err:.2f} % with "
                      f"{ {k: float(f'{v:.4g}') for k, v in params.items()} }")
        return
    fitted = {k: v for k, v in calibration().items() if k != "default"}
    for cluster, family in FAMILY_OF.items():
        if args.family and family != args.family:
            continue
        params = fit(cluster, verbose=args.verbose)
        fitted[family] = {k: float(f"{v:.4g}") for k, v in params.items()}
        print(f"{family}: {fitted[family]}")
        by_source: dict[str, list[float]] = {}
        for r in runs_for(cluster):
            by_source.setdefault(r.source, []).append(predict(r, params) / r.measured_step_s - 1)
        for source, errs in by_source.items():
            print(f"   {source}: mean |error| {100 * np.mean(np.abs(errs)):.2f} %, "
                  f"worst {100 * np.max(np.abs(errs)):.2f} % ({len(errs)} rows)")
    if args.write:
        path = Path(__file__).resolve().parents[1] / "hardware" / "data" / "calibration.yaml"
        text = path.read_text()
        head = text.split("\ndefault:")[0]
        doc = {"default": calibration()["default"], **fitted}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(head + "\n" + yaml.safe_dump(doc, sort_keys=False))
        tmp.replace(path)        # whole or not at all
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
