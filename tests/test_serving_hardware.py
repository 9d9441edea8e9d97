"""The GPUs people serve on besides DGX (L40S, GH200, MI250, MI300X, MI325X, Gaudi 2 and 3): their
records hold the vendors' figures, their efficiencies come from the microbenchmarks where a row
measures them and say "uncalibrated" where none does (and the reports say so), their servers are
cluster presets, and a serving run on each decodes as fast as its memory lets it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from stage_cosim import api
from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import EFFICIENCIES, calibration_warning, get_gpu, gpu_records, uncalibrated
from stage_cosim.model import get_preset

VALIDATION = Path(__file__).resolve().parents[1] / "stage_cosim" / "validation" / "data"

# preset -> (vendor, architecture, dense BF16 TFLOPS, FP8 TFLOPS or None, memory GB, memory GB/s,
# scale-up GB/s each way per GPU), typed from each vendor's data sheet (hardware/data/SOURCES.md)
DATA_SHEETS = {
    "L40S": ("NVIDIA", "ada", 362, 733, 48, 864, 64 / 2),                 # PCIe Gen4 x16, 64 GB/s both ways
    "GH200": ("NVIDIA", "hopper", 989, 1979, 144, 4900, 900 / 2),
    "MI250": ("AMD", "cdna2", 362.1, None, 128, 3276.8, 6 * 100 / 2),     # 6 links of 100 GB/s
    "MI300X": ("AMD", "cdna3", 1307.4, 2614.9, 192, 5300, 7 * 128 / 2),   # 7 peers, 128 GB/s links
    "MI325X": ("AMD", "cdna3", 1307.4, 2614.9, 256, 6000, 7 * 128 / 2),
    "Gaudi2": ("Intel", "gaudi", 432, 865, 96, 2460, 21 * 100 / 8),       # 21 x 100 GbE
    "Gaudi3": ("Intel", "gaudi", 1835, 1835, 128, 3700, 21 * 200 / 8),    # 21 x 200 GbE
}
SERVERS = {"L40S": "l40s-pcie-8", "GH200": "gh200-nvl2", "MI250": "mi250-4", "MI300X": "mi300x-8",
           "MI325X": "mi325x-8", "Gaudi2": "gaudi2-hls", "Gaudi3": "gaudi3-hls"}


@pytest.mark.parametrize("name", sorted(DATA_SHEETS))
def test_records_hold_the_data_sheets(name: str) -> None:
    vendor, arch, bf16, fp8, mem, bw, link = DATA_SHEETS[name]
    g = get_gpu(name)
    assert (g.vendor, g.arch, g.bf16_tflops, g.fp8_tflops, g.hbm_GiB, g.hbm_GBps) == (vendor, arch, bf16, fp8, mem, bw)
    assert g.nvlink_GBps == pytest.approx(link)
    c = resolve_cluster(SERVERS[name])
    assert c.gpu == g and c.scale_up.bandwidth_GBps == pytest.approx(link)


def _rows(name: str, gpu: str) -> list[dict[str, str]]:
    with (VALIDATION / name).open() as f:
        return [r for r in csv.DictReader(f) if r["gpu"] == gpu and r.get("latest_in_source", "true") == "true"]


def test_mi300_efficiencies_are_its_microbenchmarks() -> None:
    """BabelStream: the memory efficiency that minimizes the squared relative errors over the
    MI300X rows is sum(1/m) / sum(B/m^2) (B the data sheet's 5.3 TB/s) — worked here from the
    file; the MAMF best BF16 shape over the peak is the GEMM ceiling. Both GPUs of the family
    carry them."""
    m = np.array([float(r["bandwidth_tbps"]) for r in _rows("hbm_bandwidth.csv", "MI300X")])
    assert len(m) == 5
    B = 5.3
    best = np.sum(1 / m) / np.sum(B / m**2)
    for name in ("MI300X", "MI325X"):
        g = get_gpu(name)
        assert g.memory_efficiency == pytest.approx(best, abs=5e-4)
    mamf = [r for r in _rows("gemm_microbench.csv", "MI300X") if r["benchmark"].startswith("mamf")]
    assert get_gpu("MI300X").matmul_efficiency == pytest.approx(float(mamf[0]["tflops"]) / 1307.4, abs=2e-3)
    # RCCL all-reduce on 8 GPUs at 8 GiB: bus bandwidth / link bandwidth, within the latency's share
    big = [r for r in _rows("nccl_busbw.csv", "MI300X") if r["gpus"] == "8" and int(r["bytes"]) == 8 << 30]
    assert get_gpu("MI300X").scale_up_efficiency == pytest.approx(float(big[0]["busbw_gbps"]) / 448, rel=0.01)


def test_gaudi_gemm_ceilings_are_their_mamf_rows() -> None:
    """The fitted GEMM efficiencies give back the MAMF rows' TFLOPS through the compute model
    (which adds the GEMM's memory traffic: the efficiency is a little above TFLOPS / peak)."""
    from stage_cosim.validation.components import GemmRow, gemm_tflops

    for name, peak in (("Gaudi2", 432), ("Gaudi3", 1835)):
        for r in _rows("gemm_microbench.csv", name):
            row = GemmRow(name, r["dtype"], int(r["m"]), int(r["n"]), int(r["k"]), 1, float(r["tflops"]), "mamf", "")
            assert gemm_tflops(row, get_gpu(name)) == pytest.approx(row.tflops, rel=0.002), (name, r["dtype"])
        assert float(r["tflops"]) / peak <= get_gpu(name).peak_tflops(row.fmt) / peak


def test_what_no_measurement_pins_is_marked_uncalibrated() -> None:
    """L40S and MI250 have no row at all: all ten borrowed; MI300X four (kernel overhead, the
    small-GEMM size, scale-out, attention's half keys); GH200 is the H100 family's, calibrated."""
    assert len(uncalibrated("L40S")) == len(uncalibrated("MI250")) == len(EFFICIENCIES)
    assert all("borrowed from A100" in s for s in uncalibrated("L40S").values())
    assert set(uncalibrated("MI300X")) == {"matmul_half_flops", "kernel_overhead_us", "scale_out_efficiency",
                                           "attention_half_keys"}
    assert uncalibrated("GH200") == {} and uncalibrated("H100-SXM") == {}
    assert gpu_records()["GH200"]["calibration_family"] == "H100"
    assert calibration_warning(get_gpu("H100-SXM")) is None
    assert calibration_warning(get_gpu("L40S").with_overrides(name="mine")) is None    # a hypothetical GPU's own
    line = calibration_warning(get_gpu("MI300X"))
    assert line.startswith("GPU MI300X: 4 of 10 efficiencies are uncalibrated") and "borrowed from H100" in line


def test_reports_name_the_borrowed_efficiencies(run_cli) -> None:
    args = ("--model", "llama3-8b", "--rate", "2", "--num-requests", "6", "--input-len", "256", "--output-len", "16")
    code, out, err = run_cli("serve-sim", "--cluster", "l40s-pcie-8:1", *args)
    assert code == 0 and "warning: GPU L40S: 10 of 10 efficiencies are uncalibrated" in err
    code, out, err = run_cli("serve-sim", "--cluster", "dgx-h100:1", *args)
    assert code == 0 and "uncalibrated" not in err
    code, out, err = run_cli("serve-sim", "--cluster", "gaudi3-hls:1", "--json", *args)
    assert code == 0 and json.loads(out)["warnings"][0].startswith("GPU Gaudi3: 8 of 10")
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--cluster", "mi250-4:1", "--phase", "decode",
                             "--batch", "1", "--context-len", "128")
    assert code == 0 and "warning: GPU MI250: 10 of 10" in err


def test_mi250_has_no_fp8_and_says_so_in_one_line(run_cli) -> None:
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--cluster", "mi250-4:1", "--phase", "decode",
                             "--batch", "1", "--context-len", "128", "--weight-dtype", "fp8")
    assert code == 2 and out == "" and err.count("\n") == 1 and "MI250 has none" in err


def _decode_step(cluster: str, model: str = "bloom-7b1") -> float:
    return api.simulate({"model": model, "cluster": cluster, "phase": "decode", "batch": 1,
                         "context_len": 128})["step_time_s"]


def test_batch_one_decode_is_ordered_by_memory_bandwidth() -> None:
    """At batch 1 a decode step reads every weight once: its floor is 2 bytes x parameters over
    the achievable bandwidth (data-sheet bandwidth x the measured streaming efficiency), with a
    few percent on top for the kernels' fixed costs and the small KV cache. The steps come out in
    that floor's order, each within 25 % above it; MI300X (5.3 TB/s) decodes about 5x faster
    than L40S (864 GB/s)."""
    weights = 2 * get_preset("bloom-7b1").param_count()
    steps, floors = {}, {}
    for name, cluster in SERVERS.items():
        g = get_gpu(name)
        floors[name] = weights / (g.hbm_GBps * 1e9 * g.memory_efficiency)
        steps[name] = _decode_step(f"{cluster}:1")
        assert 1.0 <= steps[name] / floors[name] <= 1.25, (name, steps[name], floors[name])
    assert sorted(steps, key=steps.get) == sorted(floors, key=floors.get)
    ratio = steps["L40S"] / steps["MI300X"]
    assert ratio == pytest.approx(floors["L40S"] / floors["MI300X"], rel=0.1)
    assert 4.5 < ratio < 6


def test_serve_sim_on_each_server_decodes_at_its_memory_bandwidth() -> None:
    """One request at a time through serve-sim on one GPU of each server: every step decodes a
    batch of 1, so the time per output token follows the weights' floor (2 bytes x parameters
    over the data-sheet bandwidth x the measured streaming efficiency): the same order, and
    L40S against MI300X within 15 % of the floors' ratio (about 5x)."""
    weights = 2 * get_preset("llama3-8b").param_count()
    tpot, floors = {}, {}
    for name, cluster in SERVERS.items():
        # three requests 10 s apart: each finishes before the next arrives
        stream = [{"arrival_s": 10.0 * i, "input_len": 128, "output_len": 32} for i in range(3)]
        rep = api.serve_sim({"model": "llama3-8b", "cluster": f"{cluster}:1", "requests": stream})
        assert rep["requests"]["completed"] == 3 and rep["requests"]["rejected"] == 0, name
        assert rep["steps"]["decodes_per_step"]["mean"] <= 1.0 + 1e-9, name     # batch 1 throughout
        g = get_gpu(name)
        tpot[name] = rep["latency_s"]["tpot"]["mean"]
        floors[name] = weights / (g.hbm_GBps * 1e9 * g.memory_efficiency)
    assert sorted(tpot, key=tpot.get) == sorted(floors, key=floors.get)
    assert tpot["L40S"] / tpot["MI300X"] == pytest.approx(floors["L40S"] / floors["MI300X"], rel=0.15)


def test_l40s_servers_talk_over_pcie() -> None:
    """No NVLink: a tp=2 all-reduce of the same bytes takes about 450 / 32 times longer inside
    an L40S server than inside a DGX H100 (their scale-up bandwidths x efficiencies)."""
    from stage_cosim.adapters.roofline.network import CalibratedNetwork

    nbytes = 1 << 30
    l40s, h100 = (CalibratedNetwork(resolve_cluster(c)) for c in ("l40s-pcie-8:8", "dgx-h100:8"))
    t_l40s = l40s.duration("ALL_REDUCE", nbytes, [0, 1])
    t_h100 = h100.duration("ALL_REDUCE", nbytes, [0, 1])
    expected = (450 * get_gpu("H100-SXM").scale_up_efficiency) / (32 * get_gpu("L40S").scale_up_efficiency)
    assert t_l40s / t_h100 == pytest.approx(expected, rel=0.05)


def test_clusters_lists_the_servers(run_cli) -> None:
    code, out, err = run_cli("clusters")
    assert code == 0
    for name, server in SERVERS.items():
        line = next(x for x in out.splitlines() if x.startswith(server + " "))
        assert name in line
    with pytest.raises(UserError, match="unknown preset"):
        resolve_cluster("mi300x-16")
