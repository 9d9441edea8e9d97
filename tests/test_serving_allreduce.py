"""Inference steps' tensor-parallel all-reduces at the measured nccl-tests sweep of their GPU
(Azure ND H100 v5, NVLS, 8 GPUs: nccl_busbw.csv), not the large-buffer fit of the network."""

from __future__ import annotations

import pytest

from stage_cosim.adapters.roofline.measured_allreduce import measured_allreduce, measured_time, step_network
from stage_cosim.adapters.roofline.simulate import make_network
from stage_cosim.hardware import resolve_cluster


def _alg_time(nbytes: int, busbw_GBps: float, n: int = 8) -> float:
    """nccl-tests' time from its bus bandwidth: busbw = algbw * 2(n-1)/n, algbw = bytes / time."""
    return nbytes / (busbw_GBps * 1e9 * n / (2 * (n - 1)))


def test_h100_sweep_is_nccl_tests_time_at_each_size() -> None:
    """16 MiB at 234.45 GB/s bus bandwidth: 16,777,216 / (234.45e9 x 8/14) = 125.2 us; 8 MiB at
    172.13: 85.3 us; a size between them takes a time between them."""
    points = measured_allreduce("H100-SXM5-80GB", 8)
    assert len(points) == 24
    assert measured_time(points, 16 << 20) == pytest.approx(_alg_time(16 << 20, 234.45), rel=1e-12)
    assert measured_time(points, 16 << 20) == pytest.approx(125.2e-6, rel=1e-3)
    assert measured_time(points, 8 << 20) == pytest.approx(85.3e-6, rel=1e-3)
    mid = measured_time(points, 12 << 20)
    assert 85.3e-6 < mid < 125.2e-6
    # no sweep over 2 H100s: nothing measured, the model alone
    assert measured_allreduce("H100-SXM5-80GB", 2) == ()


def test_inference_all_reduce_is_no_faster_than_measured() -> None:
    """A decode step's all-reduce of 186 tokens x 16,384 x 2 bytes (6.1 MB) over tp8: the
    calibrated network gives 23.7 us (its large-buffer NVLS rate), nccl-tests measure 71 us
    at that size (between 4 MiB at 128.73 GB/s and 8 MiB at 172.13); the inference step gets
    the measurement, a training step the model; a 1 GiB bucket is the model's either way (its
    fit is of those)."""
    cluster = resolve_cluster("dgx-h100:8")
    model = make_network("calibrated", cluster)
    serving = step_network(make_network("calibrated", cluster), cluster, inference=True)
    training = step_network(model, cluster, inference=False)
    members = list(range(8))
    nbytes = 186 * 16384 * 2
    lo, hi = _alg_time(4 << 20, 128.73), _alg_time(8 << 20, 172.13)
    t = serving.duration("ALL_REDUCE", nbytes, members)
    assert lo < t < hi
    assert t == pytest.approx(70.8e-6, rel=0.01)
    assert model.duration("ALL_REDUCE", nbytes, members) < 0.4 * t
    assert training is model
    big = 1 << 30
    assert serving.duration("ALL_REDUCE", big, members) == pytest.approx(
        max(model.duration("ALL_REDUCE", big, members), _alg_time(big, 466.35)), rel=1e-12)
    # an all-to-all (no measured bound) and the all-reduce over two GPUs (no sweep) are the model's
    assert serving.duration("ALL_TO_ALL", nbytes, members) == model.duration("ALL_TO_ALL", nbytes, members)
    assert serving.duration("ALL_REDUCE", nbytes, [0, 1]) == model.duration("ALL_REDUCE", nbytes, [0, 1])


def test_every_entry_of_the_network_sees_the_measured_all_reduce() -> None:
    """The replay asks a network for a collective's end (``collective``) or, on its fast path,
    for its span: both carry the measured floor; the wrapped network's identity differs from
    the bare model's, so no run kept for one is reused for the other."""
    cluster = resolve_cluster("dgx-h100:8")
    model = make_network("calibrated", cluster)
    serving = step_network(make_network("calibrated", cluster), cluster, inference=True)
    members, nbytes = list(range(8)), 16 << 20
    want = _alg_time(nbytes, 234.45)
    assert serving.collective("ALL_REDUCE", nbytes, members, [1.0] * 8) == pytest.approx([1.0 + want] * 8, rel=1e-12)
    if hasattr(model, "span"):
        assert serving.span("ALL_REDUCE", nbytes, members) == pytest.approx(want, rel=1e-12)
        assert serving.span("ALL_TO_ALL", nbytes, members) == model.span("ALL_TO_ALL", nbytes, members)
    if getattr(model, "identity", None) is not None:
        assert serving.identity != model.identity


def test_405b_decode_step_pays_the_measured_all_reduces() -> None:
    """Llama 3.1 405B FP8 at tp8, 186 requests at 3,072 tokens: 253 all-reduces of
    186 x 16,384 x 2 bytes (two per layer, one for the embedding) sit on the step's critical
    path, so the step grows by 253 x (measured - model) over the bare network's; and the head's
    vocabulary-parallel gather of the last tokens' logits (186 x 16,128 x 2 bytes a rank: a
    48 MB buffer) by half the measured all-reduce of 48 MB less the model's gather."""
    from stage_cosim.inference import InferenceConfig
    from stage_cosim.inference.config import BatchShape
    from stage_cosim.model import resolve_model
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.serving.steptime import StepTimer

    m = resolve_model("llama3.1-405b")
    cluster = resolve_cluster("dgx-h100:8")
    timer = StepTimer(m, ParallelConfig(tp=8), InferenceConfig("decode", kv_cache_dtype="fp8", weight_dtype="fp8"),
                      cluster, 0)
    shape = BatchShape.uniform(186, 1, 3071, frozenset(m.layer_windows()))
    measured = timer.simulate(shape)
    timer._network = make_network("calibrated", cluster)        # noqa: SLF001 (the bare model)
    bare = timer.simulate(shape)
    nbytes, members = 186 * 16384 * 2, list(range(8))
    points = measured_allreduce("H100-SXM5-80GB", 8)
    extra = measured_time(points, nbytes) - timer._network.duration("ALL_REDUCE", nbytes, members)   # noqa: SLF001
    shard = 186 * (129024 // 8) * 2          # the vocabulary padded to 128 x tp, over tp
    gather = measured_time(points, 8 * shard) / 2 - timer._network.duration("ALL_GATHER", shard, members)  # noqa: SLF001
    assert gather == pytest.approx(8e-6, abs=1e-6)
    assert measured - bare == pytest.approx(253 * extra + gather, rel=1e-6)      # 11.0 ms: 34.5 -> 45.5 ms
