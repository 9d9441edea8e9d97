"""The search's memory check from the blocks its bounds already hold (search/memory.py).

Its figure is the synthesized workload's, to the byte, on random structurally feasible
configurations of several models (dense with cp, fp8 and interleaved or zero-bubble pipelines,
a tied-embedding GPT, Mixture-of-Experts with expert parallelism, sliding-window and latent
attention), every ZeRO stage and recomputation mode; and the fit decision is the one
``evaluate`` takes (it rules out the same configurations before simulating them).
"""

from __future__ import annotations

import pytest

from stage_cosim.search.bound import StepBound
from stage_cosim.search.evaluate import MEMORY_REASON, Objective, evaluate, workload_of
from stage_cosim.search.memory import fits, peak_bytes
from tests.test_search_bound import _sample

# (case, configurations): 520 in all
SAMPLES = (("llama", 200), ("gpt-tied", 60), ("mixtral", 160), ("gpt-oss", 60), ("deepseek", 40))


def _synthesized_peak(model, cluster, par) -> int:
    w = workload_of(model, par, cluster.gpu)
    return max(w.memory(s, cluster).total for s in range(par.pp))


@pytest.mark.parametrize("case, n", SAMPLES)
def test_memory_from_blocks_is_the_synthesized_workloads(case: str, n: int) -> None:
    model, cluster, configs = _sample(case, n, seed=7, policies=12)
    assert len(configs) >= 0.9 * n
    bound = StepBound(model, cluster)
    peaks = []
    for par in configs:
        bound(par)            # (the blocks as a search holds them: shared across configurations)
        blocks, precision = bound.blocks(par)
        mine = peak_bytes(model, cluster, par, blocks, precision)
        assert mine == _synthesized_peak(model, cluster, par), (case, par.to_dict())
        peaks.append((mine, par))
    if case == "llama":
        assert {1, 3} <= {p.zero for _, p in peaks} and any(p.cp > 1 for _, p in peaks)
        assert any(p.dtype == "fp8" for _, p in peaks) and any(p.vp > 1 for _, p in peaks)
        assert {p.recompute for _, p in peaks} == {"none", "full"}
    if case == "mixtral":
        assert any(p.ep > 1 for _, p in peaks)
    # the decision, at a headroom that puts the HBM among the sample's peaks: the same
    # configurations are ruled out as evaluate rules out (before it simulates anything)
    ordered = sorted(m for m, _ in peaks)
    capacity = ordered[len(ordered) // 2]
    headroom = 1 - capacity / cluster.gpu.memory_bytes
    over = [(m, p) for m, p in peaks if not fits(model, cluster, p, *bound.blocks(p), headroom=headroom)]
    assert 0 < len(over) < len(peaks)
    assert all(m > cluster.gpu.memory_bytes * (1 - headroom) for m, _ in over)
    for _, par in over[:20]:
        e = evaluate(model, cluster, par, {}, Objective(), headroom=headroom)
        assert not e.feasible and e.reason == MEMORY_REASON


def test_branch_and_bound_synthesizes_only_what_it_simulates(monkeypatch) -> None:
    """Branch and bound settles the configurations over the memory from the bounds' blocks:
    it synthesizes only those it simulates, and its answer, its evaluations (the ones over the
    memory recorded as evaluate records them) and its counts are those it gives checking
    memory by synthesis."""
    from stage_cosim.search import evaluate as evaluate_mod
    from stage_cosim.search import optimize as opt
    from tests.test_search_bound import BB_CLUSTER, _bb_space

    settings = opt.OptimizeSettings(headroom=0.9, exhaustive_limit=0)
    synthesized = []
    real = evaluate_mod.workload_of

    def counted(model, par, gpu=None):
        synthesized.append(par)
        return real(model, par, gpu)

    monkeypatch.setattr(evaluate_mod, "workload_of", counted)
    fast = opt.optimize(_bb_space(), BB_CLUSTER, settings)
    assert fast.bounds["pruned_by_memory"] > 0
    assert len(synthesized) == fast.bounds["simulated"]
    monkeypatch.setattr(opt, "_memory_checked", lambda search, points: points)
    slow = opt.optimize(_bb_space(), BB_CLUSTER, settings)
    assert len(synthesized) == fast.bounds["simulated"] + slow.bounds["simulated"] + slow.bounds["pruned_by_memory"]
    assert fast.to_dict() == slow.to_dict()
    assert sorted(map(repr, (e.to_dict() for e in fast.evaluated))) == \
        sorted(map(repr, (e.to_dict() for e in slow.evaluated)))
