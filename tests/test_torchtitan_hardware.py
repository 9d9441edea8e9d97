"""The hardware torchtitan's own H100 rows ran on, pinned to what its benchmark documents state
and to the GEMM measurements that describe a 500 W H100 (not to the rows' step times, which stay
checks): Meta's Grand Teton hosts, whose H100s carry 96 GB of HBM2e at 2.4 TB/s and 400 Gb/s of
RDMA per GPU at a 500 W power limit; their BF16 and FP8 GEMM efficiencies are the H100 SXM
record's scaled by Meta's GEMM throughput at 500 W over the 700 W part's on the same footing."""

from __future__ import annotations

import csv
import re
from dataclasses import replace
from importlib import resources

import pytest

from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import get_gpu
from stage_cosim.validation import components as comp
from stage_cosim.validation.published import GRAND_TETON_H100, torchtitan_benchmarks


def _rows(name: str) -> list[dict[str, str]]:
    text = resources.files("stage_cosim.validation").joinpath("data", name).read_text()
    return list(csv.DictReader(text.splitlines()))


def _grand_teton():
    return resolve_cluster(GRAND_TETON_H100, 16)


def test_grand_teton_h100_is_the_sxm_part_with_the_documents_memory() -> None:
    """96 GB of HBM2e at 2.4 TB/s peak (the documents' hardware list); every other field but the
    two GEMM efficiencies is the H100 SXM record's: peaks, attention, memory-bound kernels and
    links have no measurement at 500 W."""
    cluster = _grand_teton()
    sxm = get_gpu("H100-SXM")
    gpu = cluster.gpu
    assert (gpu.hbm_GiB, gpu.hbm_GBps) == (96, 2400)
    assert replace(gpu, name=sxm.name, hbm_GiB=sxm.hbm_GiB, hbm_GBps=sxm.hbm_GBps,
                   matmul_efficiency=sxm.matmul_efficiency, fp8_matmul_efficiency=sxm.fp8_matmul_efficiency) == sxm
    # what a memory-bound kernel streams: the H100 family's efficiency times the slower HBM
    assert comp.hbm_tbps(gpu) / comp.hbm_tbps(sxm) == pytest.approx(2400 / 3350)
    # hosts of 8 on NVLink (the DGX H100's switch), 400 Gb/s of RDMA per GPU = 50 GB/s
    dgx = resolve_cluster("dgx-h100", 16)
    assert cluster.scale_up == dgx.scale_up
    assert cluster.scale_out.bandwidth_GBps == 400 / 8


def test_grand_teton_gemm_efficiencies_are_the_500w_measurements_over_the_700w_ones() -> None:
    """BF16: the best of Meta's 500 W shapes (585.23 TFLOP/s at 8192^3) over the 700 W MAMF
    search's best shape (794.5); FP8: 8192^3 at both powers (FBGEMM's rowwise GEMM at 500 W,
    1125.51, over cuBLASLt at 700 W, 1290.1). Each scales the H100 record's efficiency, and the
    model's GEMM rate at 8192^3 drops by that measured ratio."""
    low = _rows("gemm_power_limited.csv")
    assert {r["power_limit_w"] for r in low} == {"500"} and len(low) == 6
    h100 = [r for r in _rows("gemm_microbench.csv") if r["gpu"] == "H100-SXM5-80GB"]
    bf16_500 = max(float(r["tflops"]) for r in low if r["dtype"] == "bf16")
    bf16_700 = max(float(r["tflops"]) for r in h100 if r["dtype"] == "bf16" and r["benchmark"].startswith("mamf"))
    cube = ("8192", "8192", "8192")
    fp8_500 = next(float(r["tflops"]) for r in low if r["dtype"].startswith("fp8") and (r["m"], r["n"], r["k"]) == cube)
    fp8_700 = next(float(r["tflops"]) for r in h100 if r["dtype"] == "fp8_e4m3" and (r["m"], r["n"], r["k"]) == cube)
    assert (bf16_500, bf16_700, fp8_500, fp8_700) == (585.23, 794.5, 1125.51, 1290.1)
    sxm, gpu = get_gpu("H100-SXM"), _grand_teton().gpu
    assert gpu.matmul_efficiency == round(sxm.matmul_efficiency * bf16_500 / bf16_700, 4)
    assert gpu.fp8_matmul_efficiency == round(sxm.fp8_matmul_efficiency * fp8_500 / fp8_700, 4)
    for fmt, ratio in (("bf16", bf16_500 / bf16_700), ("fp8_e4m3", fp8_500 / fp8_700)):
        row = comp.GemmRow("H100-SXM5-80GB", fmt, 8192, 8192, 8192, 1, 0.0, "", "")
        assert comp.gemm_tflops(row, gpu) / comp.gemm_tflops(row, sxm) == pytest.approx(ratio, rel=1e-3)


def test_the_rows_that_name_grand_teton_run_on_it_and_no_others() -> None:
    """The rows whose hardware note names Grand Teton, the 96 GB of HBM2e, the 500 W limit and
    400 Gb/s of RDMA per GPU; torchao's H100 rows, whose variant is not stated, stay on the DGX
    H100."""
    notes = {i: r["gpu_note"] for i, r in enumerate(_rows("torchtitan_benchmarks.csv"))}
    runs = {int(r.name.rsplit("#", 1)[1]): r for r in torchtitan_benchmarks()[0]}
    teton = {i for i, n in notes.items() if "Grand Teton" in n}
    for i in teton:
        assert re.search(r"\b96GB HBM2e\b", notes[i]) and "500W power limit" in notes[i], notes[i]
        assert "400Gb/s RDMA per GPU" in notes[i], notes[i]
    assert {i for i, r in runs.items() if r.cluster == GRAND_TETON_H100} == teton & set(runs)
    assert len(teton & set(runs)) == 28              # 30 rows, the 2 eager ones refused
    assert {runs[i].cluster for i in (32, 33, 34)} == {"dgx-h100"}
