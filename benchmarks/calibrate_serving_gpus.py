"""Fit the serving GPUs' efficiencies to their rows in the component microbenchmarks.

    python benchmarks/calibrate_serving_gpus.py            # fit and print, per family and row
    python benchmarks/calibrate_serving_gpus.py --write    # and store it in the GPU records

The families of calibrate.py (A100, H100, B200) have end-to-end training tables; the GPUs people
serve on besides them have, at most, component rows: MI300X (BabelStream, a hipBLASLt FP8 sweep,
FlashAttention-2, RCCL all-reduce in one node, the MAMF best BF16 shape) and Gaudi 2 / Gaudi 3
(the MAMF best BF16 and FP8 shapes). Each parameter a family's rows pin is fitted to them with the
same component predictions calibrate.py uses (stage_cosim/validation/components.py), in the
same order (HBM first: the GEMM and attention rows' memory-bound parts read it); every other
parameter keeps its record's value and its ``uncalibrated: borrowed from ...`` source, which the
reports of a run on that GPU name. MAMF rows are the best shape of a sweep: a ceiling, so the
fitted BF16/FP8 efficiency of a family with no sweep is an upper bound, and its source says so.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from scipy.optimize import least_squares

from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import GPU, get_gpu, gpu_records, parse_record, record_header, render_record
from stage_cosim.validation import components as comp

RECORDS = Path(__file__).resolve().parents[1] / "hardware" / "data" / "gpus"
# family -> (the microbenchmark tables' name of its measured GPU, its preset, its cluster preset)
MEASURED = {"MI300": ("MI300X", "MI300X", "mi300x-8"), "Gaudi2": ("Gaudi2", "Gaudi2", "gaudi2-hls"),
            "Gaudi3": ("Gaudi3", "Gaudi3", "gaudi3-hls")}
BOUNDS = {"memory_efficiency": (0.3, 1.0), "matmul_efficiency": (0.1, 1.0), "fp8_matmul_efficiency": (0.1, 1.0),
          "fp8_matmul_half_flops": (1e7, 1e12), "attention_efficiency": (0.05, 1.0),
          "scale_up_efficiency": (0.1, 1.0)}
LOG = {"fp8_matmul_half_flops"}


def _rows(name: str) -> list[dict[str, str]]:
    with resources.files("stage_cosim.validation").joinpath("data", name).open() as f:
        return list(csv.DictReader(f))


class Fit(NamedTuple):
    file: str
    params: tuple[str, ...]
    rows: list
    predict: Callable            # (row, GPU) -> the model's figure
    measured: Callable           # row -> the row's figure
    ceiling: bool = False        # MAMF best shapes: the fitted value is an upper bound


def fits_of(family: str) -> list[Fit]:
    part, preset, cluster = MEASURED[family]
    gemm = [r for r in _rows("gemm_microbench.csv") if r["gpu"] == part and r["latest_in_source"] == "true"]

    def gemm_row(r: dict[str, str]) -> comp.GemmRow:
        return comp.GemmRow(r["gpu"], r["dtype"], int(r["m"]), int(r["n"]), int(r["k"]), int(r["groups"] or 1),
                            float(r["tflops"]), r["benchmark"], "")

    def sweep(fmt: str) -> list[comp.GemmRow]:
        # a side under SKINNY is out of the model's scope (tile and wave quantization), as in calibrate.py
        return [gemm_row(r) for r in gemm if not r["benchmark"].startswith("mamf") and comp._FORMAT.get(r["dtype"]) == fmt
                and min(int(r["m"]), int(r["n"]), int(r["k"])) >= comp.SKINNY]

    def mamf(fmt: str) -> list[comp.GemmRow]:
        return [gemm_row(r) for r in gemm if r["benchmark"].startswith("mamf") and comp._FORMAT.get(r["dtype"]) == fmt]

    def nccl_predict(r: comp.NcclRow, gpu: GPU) -> float:
        c = resolve_cluster(cluster, r.per_node)
        return comp.nccl_busbw(r, CalibratedNetwork(replace(c, gpu=gpu)))

    hbm = [comp.HbmRow(r["gpu"], r["kernel"], float(r["bandwidth_tbps"])) for r in _rows("hbm_bandwidth.csv")
           if r["gpu"] == part and r["latest_in_source"] == "true"]
    attention = [comp.AttentionRow(r["gpu"], int(r["batch"]), int(r["seqlen"]), int(r["nheads"]), int(r["headdim"]),
                                   float(r["tflops"])) for r in _rows("attention_microbench.csv")
                 if r["gpu"] == part and r["implementation"].startswith("flash_attn_2") and r["pass"] == "fwd+bwd"]
    # ring all-reduce of 1 GiB and more on all 8 GPUs of a node (two GPUs of a full mesh share one
    # link of seven: not the per-GPU bandwidth the cluster model has)
    nccl = [comp.NcclRow(r["system"], r["gpu"], r["collective"], r["algorithm"], int(r["gpus"]), int(r["nodes"]),
                         int(r["bytes"]), float(r["busbw_gbps"]), "") for r in _rows("nccl_busbw.csv")
            if r["gpu"] == part and r["collective"] == "all_reduce" and r["latest_in_source"] == "true"
            and int(r["nodes"]) == 1 and int(r["gpus"]) == 8 and int(r["bytes"]) >= comp.MIN_NCCL_BYTES]
    gemm_predict = comp.gemm_tflops
    fits = [
        Fit("hbm_bandwidth.csv", ("memory_efficiency",), hbm, lambda r, g: comp.hbm_tbps(g), lambda r: r.tbps),
        Fit("gemm_microbench.csv (FP8 sweep)", ("fp8_matmul_efficiency", "fp8_matmul_half_flops"), sweep("fp8"),
            gemm_predict, lambda r: r.tflops),
        Fit("gemm_microbench.csv (BF16 MAMF best shape)", ("matmul_efficiency",), mamf("bf16"), gemm_predict,
            lambda r: r.tflops, ceiling=True),
        Fit("attention_microbench.csv (FlashAttention-2)", ("attention_efficiency",), attention,
            lambda r, g: comp.attention_tflops(r, g), lambda r: r.tflops),
        Fit("nccl_busbw.csv (one node, all-reduce)", ("scale_up_efficiency",), nccl, nccl_predict,
            lambda r: r.busbw_gbps),
    ]
    if not sweep("fp8"):
        fits.insert(2, Fit("gemm_microbench.csv (FP8 MAMF best shape)", ("fp8_matmul_efficiency",), mamf("fp8"),
                           gemm_predict, lambda r: r.tflops, ceiling=True))
    return [f for f in fits if f.rows]


def _fit_one(f: Fit, gpu: GPU) -> dict[str, float]:
    def coord(n: str, v: float) -> float:
        return np.log10(v) if n in LOG else v

    def values(x: np.ndarray) -> dict[str, float]:
        return {n: float(10 ** v if n in LOG else v) for n, v in zip(f.params, x)}

    def residuals(x: np.ndarray) -> np.ndarray:
        g = gpu.with_overrides(**values(x))
        return np.array([f.predict(r, g) / f.measured(r) - 1 for r in f.rows])

    lo = [coord(n, BOUNDS[n][0]) for n in f.params]
    hi = [coord(n, BOUNDS[n][1]) for n in f.params]
    x0 = np.clip([coord(n, getattr(gpu, n)) for n in f.params], np.add(lo, 1e-9), np.subtract(hi, 1e-9))
    return values(least_squares(residuals, x0, bounds=(lo, hi)).x)


def fit_family(family: str, verbose: bool = True) -> tuple[dict[str, float], dict[str, str]]:
    """The parameters ``family``'s rows pin, fitted file by file, and the source of each."""
    _, preset, _ = MEASURED[family]
    gpu = get_gpu(preset)
    params: dict[str, float] = {}
    sources: dict[str, str] = {}
    for f in fits_of(family):
        fitted = _fit_one(f, gpu.with_overrides(**params))
        params |= fitted
        g = gpu.with_overrides(**params)
        errs = [f.predict(r, g) / f.measured(r) - 1 for r in f.rows]
        bound = " (best shape of a sweep: a ceiling)" if f.ceiling else ""
        for p in f.params:
            sources[p] = (f"microbenchmark fit: {f.file}, {len(f.rows)} row{'s' if len(f.rows) > 1 else ''} of "
                          f"{MEASURED[family][0]}{bound}")
        if verbose:
            shown = ", ".join(f"{k} = {v:.4g}" for k, v in fitted.items())
            print(f"{family:<7} {f.file:<46} {len(f.rows):>2} rows  {shown}  "
                  f"mean |error| {100 * np.mean(np.abs(errs)):.1f} %, worst {100 * np.max(np.abs(errs)):.1f} %")
    return params, sources


def write_family(family: str, params: dict[str, float], sources: dict[str, str]) -> list[Path]:
    """Every record of ``family``: the fitted values with their sources, the rest as they were."""
    written = []
    for name, rec in gpu_records().items():
        if rec["calibration_family"] != family:
            continue
        path = RECORDS / f"{name}.yaml"
        text = path.read_text()
        rec = parse_record(text, path.name)
        for k, v in params.items():
            rec["efficiencies"]["default"][k] = {"value": round(v, 4) if v < 10 else float(f"{v:.4g}"),
                                                 "source": sources[k]}
        path.write_text(render_record(rec, record_header(text)))
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="store the fits in the GPU records")
    args = ap.parse_args()
    for family in MEASURED:
        params, sources = fit_family(family)
        if args.write:
            for p in write_family(family, params, sources):
                print(f"        wrote {p.name}")


if __name__ == "__main__":
    main()
