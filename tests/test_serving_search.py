"""The serving-layout search's rate search: where it starts, and the probe that rules a layout
out below a floor without running the rates under it."""

from __future__ import annotations

import pytest

from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference.config import BatchShape
from stage_cosim.serving.config import SLO
from stage_cosim.serving.requests import RequestStream
from stage_cosim.serving.steptime import StepTimer


@pytest.fixture(scope="module")
def case():
    from stage_cosim.model import resolve_model
    from stage_cosim.search import serving as search

    model = resolve_model("llama3-8b").with_overrides(layers=4)
    cluster = resolve_cluster("dgx-h100", 2)
    target = search.ServeTarget(RequestStream(rate=1.0, input_len=512, output_len=64),
                                SLO(ttft_s=0.05, tpot_s=0.004), 0.9)
    problem = search.ServingProblem(search.serving_space(model, cluster), cluster, target, 100)
    return model, cluster, target, problem


def _probes(monkeypatch) -> list[float]:
    """The arrival rates of the probes run from now on (each run's requests, by their mean gap)."""
    from stage_cosim.serving import run as serving_run

    real, rates = serving_run.simulate_serving, []

    def counted(dep, requests, slo, **kw):  # noqa: ANN001, ANN202
        rates.append(requests.rate)
        return real(dep, requests, slo, **kw)

    monkeypatch.setattr(serving_run, "simulate_serving", counted)
    return rates


@pytest.mark.parametrize("split", ["none", "1:1"])
def test_the_first_rate_is_the_units_capacity_with_full_steps(case, split) -> None:
    """Worked by hand from two step times of a fresh timer: a chunk of prompt tokens and a
    decode step of the batch limit at the context halfway through the output (the KV cache
    holds every request here); a colocated instance shares its time, pools each do one."""
    from dataclasses import replace

    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.search import serving as search

    model, cluster, target, problem = case
    config, _ = problem.check({"tp": 1, "pp": 1, "max_num_seqs": 32, "split": split})
    dep = search._deploy(model, cluster, config, target)
    assert dep.kind.kv.tokens // (512 + 64) >= 32
    timer = StepTimer(model, ParallelConfig(tp=1), target.inference, replace(cluster, num_gpus=config["unit_gpus"]))
    windows = frozenset(model.layer_windows())
    chunk = dep.serving.chunk_tokens
    prefill = chunk / (512 * timer(BatchShape.uniform(1, chunk, 0, windows)))
    decode = 32 / (64 * timer(BatchShape.uniform(32, 1, 512 + 32, windows)))
    want = 1 / (1 / prefill + 1 / decode) if split == "none" else min(prefill, decode)
    assert search.first_rate(dep, target) == pytest.approx(want, rel=1e-12)


@pytest.mark.slow
def test_a_failing_jump_probe_rules_out_a_layout_whose_full_search_is_below_it(case, monkeypatch) -> None:
    """Far below a floor, the search runs one probe, at the highest rate of its upward run under
    the floor; it fails, and the layout's search run to its end without a floor ends below it."""
    from stage_cosim.search import serving as search

    model, cluster, target, problem = case
    point = {"tp": 1, "pp": 1, "max_num_seqs": 32, "split": "none"}
    config, _ = problem.check(point)
    full = search.goodput(model, cluster, config, point, target, 100)
    assert full.feasible
    good = full.result["goodput_requests_per_s_per_gpu"]
    floor = 8 * good
    rates = _probes(monkeypatch)
    ev = search.goodput(model, cluster, config, point, target, 100, floor)
    assert search.is_ruled_out(ev) and len(rates) == 1
    below = ev.result["ruled_out_below"]
    assert good < below < floor and 1.5 * below >= floor        # the last rate of the run under it


def _started_low(monkeypatch) -> None:
    """Every rate search starts 20 times under its usual start: far under its edge, so that a
    floor near the edge leaves several rates of the upward run under it."""
    from stage_cosim.search import serving as search

    real = search.first_rate
    monkeypatch.setattr(search, "first_rate", lambda dep, target: real(dep, target) / 20)


@pytest.mark.slow
def test_a_holding_jump_probe_leaves_the_search_as_without_a_floor(case, monkeypatch) -> None:
    """A search started far under its edge jumps to the highest rate of its upward run below a
    floor under its goodput; that rate holds, the search goes on from it, checks the rates under
    it last, and ends where the search without a floor ends: the same goodput and report."""
    from stage_cosim.search import serving as search

    model, cluster, target, problem = case
    point = {"tp": 2, "pp": 1, "max_num_seqs": 256, "split": "none"}
    config, _ = problem.check(point)
    _started_low(monkeypatch)
    full = search.goodput(model, cluster, config, point, target, 100)
    assert full.feasible
    floor = 0.9 * full.result["goodput_requests_per_s_per_gpu"]
    rates = _probes(monkeypatch)
    ev = search.goodput(model, cluster, config, point, target, 100, floor)
    assert ev.feasible and ev.score == full.score
    assert ev.result["report"]["slo"] == full.result["report"]["slo"]
    # the jump's probe first, the start (the lowest rate) among the last; no run twice
    assert rates[0] > 5 * min(rates) and rates.index(min(rates)) > 1 and len(rates) == len(set(rates))


@pytest.mark.slow
def test_a_layout_ruled_out_above_its_jump_probe_never_runs_the_rates_under_it(case, monkeypatch) -> None:
    """Under a floor just above its goodput, a search started far under its edge jumps, the
    jump's rate holds, and a probe above it fails below the floor: the layout is ruled out
    without the rates under the jump's ever being run, and its search without a floor, run to
    the end, ends below the bound it is ruled out by."""
    from stage_cosim.search import serving as search

    model, cluster, target, problem = case
    point = {"tp": 2, "pp": 1, "max_num_seqs": 256, "split": "none"}
    config, _ = problem.check(point)
    _started_low(monkeypatch)
    full_rates = _probes(monkeypatch)
    full = search.goodput(model, cluster, config, point, target, 100)
    good = full.result["goodput_requests_per_s_per_gpu"]
    start, full_probes = min(full_rates), len(full_rates)
    rates = _probes(monkeypatch)
    ev = search.goodput(model, cluster, config, point, target, 100, 1.2 * good)
    assert search.is_ruled_out(ev)
    assert good < ev.result["ruled_out_below"] < 1.2 * good
    assert min(rates) > 5 * start and len(rates) < full_probes
