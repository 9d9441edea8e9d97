"""Inference steps' reduce-scatters and all-gathers inside one NVSwitch domain at no less than
half the measured nccl-tests all-reduce of the same whole buffer (Azure ND H100 v5, NVLS,
8 GPUs: nccl_busbw.csv), the exchange of an attention-data-parallel MoE step in TensorRT-LLM
(every rank's tokens gathered, the experts' output for all of them reduce-scattered)."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from stage_cosim.adapters.roofline.simulate import make_network
from stage_cosim.adapters.roofline.measured_allreduce import step_network
from stage_cosim.hardware import resolve_cluster

# nccl-tests' all-reduce over 8 H100 at 16 MiB: bus bandwidth 234.45 GB/s, so
# 16,777,216 / (234.45e9 x 8/14) = 125.23 us (nccl_busbw.csv, Azure ND H100 v5)
AR_16MIB_S = (16 << 20) / (234.45e9 * 8 / 14)


def _networks():  # noqa: ANN202
    cluster = resolve_cluster("dgx-h100:16")
    return make_network("calibrated", cluster), step_network(make_network("calibrated", cluster), cluster, True)


def test_h200_ring_gather_and_scatter_match_the_all_reduce_bus_bandwidth() -> None:
    """The assumption's measurement: on one 8-GPU H200 node at 16 GiB, ring all-gather and
    reduce-scatter reach 361.4 and 362.9 GB/s bus bandwidth against the ring all-reduce's 367.2,
    so each moves its buffer in half the all-reduce's time (within 2 %)."""
    with resources.files("stage_cosim.validation").joinpath("data", "nccl_busbw.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["gpu"] == "H200-SXM-141GB" and r["bytes"] == str(16 << 30)
                and r["gpus"] == "8" and r["algorithm"].startswith("Ring") and "nccl-tests" in r["tool"]]
    bus = {r["collective"]: float(r["busbw_gbps"]) for r in rows}
    assert bus == {"all_reduce": 367.2, "all_gather": 361.4, "reduce_scatter": 362.9}
    # busbw = algbw (n-1)/n for both halves, 2 (n-1)/n for the all-reduce: at equal bus
    # bandwidth a half takes half the all-reduce's time
    for half in ("all_gather", "reduce_scatter"):
        assert bus[half] / bus["all_reduce"] == pytest.approx(1.0, abs=0.02)


def test_reduce_scatter_and_all_gather_take_half_the_measured_all_reduce() -> None:
    """2,048 tokens x 4,096 x 2 bytes = 16 MiB per rank reduce-scattered over 8 H100 (the
    experts' output of an attention-DP8 step at 256 requests a rank): 125.23 / 2 = 62.6 us,
    where the calibrated network gives 45 us; an all-gather of 2 MiB shards (16 MiB whole) the
    same. Over two nodes (no one-domain sweep) and for an all-to-all, the model's."""
    model, serving = _networks()
    eight = list(range(8))
    want = AR_16MIB_S / 2
    assert want == pytest.approx(62.6e-6, rel=1e-3)
    assert serving.duration("REDUCE_SCATTER", 16 << 20, eight) == pytest.approx(want, rel=1e-12)
    assert serving.duration("ALL_GATHER", 2 << 20, eight) == pytest.approx(want, rel=1e-12)
    assert model.duration("REDUCE_SCATTER", 16 << 20, eight) < 0.75 * want
    sixteen = list(range(16))
    assert serving.duration("REDUCE_SCATTER", 16 << 20, sixteen) == model.duration("REDUCE_SCATTER", 16 << 20, sixteen)
    assert serving.duration("ALL_TO_ALL", 16 << 20, eight) == model.duration("ALL_TO_ALL", 16 << 20, eight)


def test_every_entry_of_the_network_sees_the_bound() -> None:
    """The replay's two entries: a collective's ends (no member before the last issue plus the
    measured half) and its span."""
    model, serving = _networks()
    eight = list(range(8))
    want = AR_16MIB_S / 2
    starts = [1.0 + 1e-6 * i for i in range(8)]
    ends = serving.collective("REDUCE_SCATTER", 16 << 20, eight, starts)
    assert min(ends) == pytest.approx(starts[-1] + want, rel=1e-9)
    if hasattr(model, "span"):
        assert serving.span("ALL_GATHER", 2 << 20, eight) == pytest.approx(want, rel=1e-12)
        assert serving.span("ALL_TO_ALL", 2 << 20, eight) == model.span("ALL_TO_ALL", 2 << 20, eight)
