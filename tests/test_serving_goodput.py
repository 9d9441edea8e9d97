"""A serving probe's rate counts as sustained only if the run reaches a steady state and its
completions keep up with its arrivals, not merely because its requests met the SLOs."""

from __future__ import annotations

import csv
from dataclasses import replace

import numpy as np
import pytest

from stage_cosim.hardware import resolve_cluster
from stage_cosim.serving.config import SLO
from stage_cosim.serving.requests import RequestStream


def _report(in_system_s: float, steady_rate: float) -> dict:
    """The two report figures the checks read."""
    return {"latency_s": {"e2e": {"mean": in_system_s}}, "throughput": {"steady_requests_per_s": steady_rate}}


def test_the_checks_on_hand_worked_runs() -> None:
    """100 requests one a second (0 .. 99 s): 99 gaps over 99 s, 1 request/s; between the 20th
    and 80th percentile (requests 19 and 79) 60 arrivals in 60 s. 40 s in the system holds 40
    requests on average (Little), under half the run's 100: steady; 60 s holds 60: not. The middle
    completions at 0.95/s keep up with the middle arrivals at 1/s; at 0.85/s they fall behind.
    20 requests within 1 ms that each take 2 s are a burst: about 38,000 at once on average."""
    from stage_cosim.search.sustained import STEADY, THROUGHPUT, arrival_rate, shortfall

    even = np.arange(100, dtype=np.float64)
    assert arrival_rate(even) == pytest.approx(1.0, rel=1e-12)
    assert shortfall(even, _report(40.0, 0.95)) is None
    assert shortfall(even, _report(60.0, 0.95)) == STEADY
    assert shortfall(even, _report(40.0, 0.85)) == THROUGHPUT
    burst = np.linspace(0.0, 1e-3, 20)
    assert shortfall(burst, _report(2.0, 1e4)) == STEADY
    assert arrival_rate(np.zeros(20)) == float("inf")


@pytest.fixture(scope="module")
def case():
    """A 4-layer Llama-3 8B on one H100 under SLOs a burst of 20 requests meets with room to spare
    (fixed lengths, so every request spends about as long in the system)."""
    from stage_cosim.model import resolve_model
    from stage_cosim.search import serving as search

    model = resolve_model("llama3-8b").with_overrides(layers=4)
    cluster = resolve_cluster("dgx-h100", 1)
    target = search.ServeTarget(RequestStream(rate=1.0, input_len=512, output_len=64, lengths="fixed"),
                                SLO(ttft_s=0.5, tpot_s=0.05), 0.9)
    point = {"tp": 1, "pp": 1, "max_num_seqs": 64, "split": "none"}
    config, reason = search.ServingProblem(search.serving_space(model, cluster), cluster, target, 20).check(point)
    assert reason is None
    return model, cluster, target, point, config


def _achieved(case, rate: float, n: int, tmp_path) -> tuple[float, float, float]:
    """A run of ``n`` requests at ``rate``, read back from its per-request CSV: (the arrival rate
    it drew, completed requests over the makespan, longest over mean time in the system)."""
    from stage_cosim.search import serving as search
    from stage_cosim.serving.run import simulate_serving

    model, cluster, target, _, config = case
    dep = search._deploy(model, cluster, config, target)
    path = tmp_path / "requests.csv"
    simulate_serving(dep, replace(target.stream, rate=rate, num_requests=n).generate(), target.slo, requests_out=path)
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["finish_s"]]
    assert len(rows) == n
    arrival = np.array([float(r["arrival_s"]) for r in rows])
    finish = np.array([float(r["finish_s"]) for r in rows])
    drawn = (n - 1) / (arrival.max() - arrival.min())
    in_system = finish - arrival
    return drawn, n / (finish.max() - arrival.min()), in_system.max() / in_system.mean()


def test_few_requests_no_longer_report_the_rate_offered(case, monkeypatch, tmp_path) -> None:
    """20 requests per probe. Judged by the SLOs alone, a probe at millions of requests per second
    holds (the batch takes the whole burst), and the search reports a rate over a thousand times
    what its run completes per second. Now the rate is bounded by what the run achieved.

    The bound, from the per-request CSV: the n requests arrive over S = (n-1)/λ seconds (λ the
    rate drawn) and each leaves by the last arrival plus the longest time in the system W_max,
    so completed requests over the makespan are at least n / (S + W_max). A steady state needs
    λW <= n/2 (W the mean time in the system), so S >= 2W(n-1)/n; with W_max <= 1.1 W (fixed
    lengths, checked) that is n / (S (1 + 0.55 n/(n-1))) >= λ n/(n-1) / 1.58 > λ / 1.5."""
    from stage_cosim.search import serving as search

    model, cluster, target, point, config = case
    with monkeypatch.context() as m:
        m.setattr(search, "shortfall", lambda arrival, report: None)           # the SLOs alone
        old = search.goodput(model, cluster, config, point, target, 20)
    _, achieved_old, _ = _achieved(case, old.result["rate_per_unit"], 20, tmp_path)
    assert old.result["rate_per_unit"] > 1000 * achieved_old

    ev = search.goodput(model, cluster, config, point, target, 20)
    assert ev.feasible and ev.result["limited_by"] == "requests"
    rate = ev.result["rate_per_unit"]
    drawn, achieved, spread = _achieved(case, rate, 20, tmp_path)
    assert spread <= 1.1
    assert drawn <= 1.5 * achieved
    assert rate <= 3 * achieved                  # the nominal rate: a sample of 20 draws slower or faster


def test_the_default_probe_length_keeps_the_slo_edge(case) -> None:
    """With 500 requests per probe the same layout under tight SLOs is limited by the SLOs: the
    checks only cap a rate the SLOs would have let through."""
    from stage_cosim.search import serving as search

    model, cluster, _, point, config = case
    target = replace(case[2], slo=SLO(ttft_s=0.02, tpot_s=0.002))
    ev = search.goodput(model, cluster, config, point, target, 500)
    assert ev.feasible and ev.result["limited_by"] == "slo"


@pytest.mark.slow
def test_cli_says_when_the_probe_length_caps_the_rates(run_cli) -> None:
    """The text report says the rates are capped by the probe length, naming the flag; fewer than
    20 requests per probe are refused with one line naming it."""
    args = ("optimize", "--phase", "serve", "--model", "llama3-8b", "--layers", "4", "--cluster", "dgx-h100:1",
            "--slo-ttft", "0.5", "--slo-tpot", "0.05", "--input-len", "512", "--output-len", "64",
            "--lengths", "fixed")
    code, out, err = run_cli(*args, "--num-requests", "20")
    assert code == 0, err
    assert "5 of these rates are capped by the probe length" in out and "--num-requests" in out
    code, out, err = run_cli(*args, "--num-requests", "10")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "num-requests" in err
