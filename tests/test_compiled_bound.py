"""The lower bounds of many configurations at once (search/compiled.py).

CompiledBound computes each term once for every configuration that shares it (a group's
blocks and placement, a stage's figures) and composes it per configuration; each bound must be
the one StepBound gives configuration by configuration, which the bound tests hold below the
simulated step. Here: equal to 1e-12 relative on 500 random feasible configurations of five
models (dense with cp, FP8, interleaved, zero-bubble and DualPipe pipelines; a tied-embedding
GPT; Mixture-of-Experts with ep; sliding-window and latent-attention layers; ZeRO 0-3), taken
in one call and in another order; and branch and bound's bounds, order, answer and counts are
those the per-configuration bounds give.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from stage_cosim.search.bound import StepBound, score_bound
from stage_cosim.search.compiled import CompiledBound
from stage_cosim.search.evaluate import Objective
from stage_cosim.search import optimize as opt
from stage_cosim.search.optimize import OptimizeSettings, _bounded, _feasible, _key, _Search, optimize
from stage_cosim.search.runner import SerialRunner
from tests.test_search_bound import BB_CLUSTER, _bb_space, _sample

RELATIVE = 1e-12
# (case, configurations): 500 in all
SAMPLES = (("llama", 200), ("gpt-tied", 60), ("mixtral", 140), ("gpt-oss", 60), ("deepseek", 40))


def _agree(model, cluster, configs, network_model: str | None = "calibrated") -> np.ndarray:
    """CompiledBound's bounds of ``configs`` (one call), checked against StepBound's."""
    mine = CompiledBound(model, cluster, network_model)(configs)
    reference = StepBound(model, cluster, network_model)
    expected = np.array([reference(par) for par in configs])
    assert mine.shape == expected.shape and np.all(expected > 0)
    worst = np.max(np.abs(mine - expected) / expected)
    assert worst <= RELATIVE, (worst, configs[int(np.argmax(np.abs(mine - expected) / expected))].to_dict())
    return mine


@pytest.mark.parametrize("case, n", SAMPLES)
def test_compiled_bounds_are_the_step_bounds(case: str, n: int) -> None:
    model, cluster, configs = _sample(case, n, seed=11, policies=12)
    assert len(configs) >= 0.9 * n
    mine = _agree(model, cluster, configs)
    # another order, another call: each configuration's bound is its own, whatever shares it
    order = list(range(len(configs)))
    random.Random(3).shuffle(order)
    again = CompiledBound(model, cluster)([configs[i] for i in order])
    assert np.array_equal(again, mine[order])
    schedules = {p.schedule for p in configs}
    if case == "llama":
        assert any(p.cp > 1 for p in configs) and any(p.dtype == "fp8" for p in configs)
        assert {"interleaved", "zb-h1", "zb-v", "dualpipe", "dualpipev"} <= schedules
        assert {1, 3} <= {p.zero for p in configs} and any(p.tp_comm_overlap for p in configs)
    if case == "gpt-tied":
        assert {0, 2} <= {p.zero for p in configs}
    if case == "mixtral":
        assert any(p.ep > 1 for p in configs) and 3 in {p.zero for p in configs}


def test_without_a_network_model_too() -> None:
    """With no network model to bound the communication with (every stream figure 0)."""
    model, cluster, configs = _sample("llama", 40, seed=12, policies=4)
    _agree(model, cluster, configs, network_model=None)


def test_branch_and_bound_bounds_and_counts_are_the_per_configuration_ones(monkeypatch) -> None:
    """The search bounds its space with CompiledBound: the bounds (scores), their order, and
    so the answer and every count are those of StepBound configuration by configuration."""
    space = _bb_space()
    settings = OptimizeSettings(headroom=0.9, exhaustive_limit=0)
    search = _Search(space, BB_CLUSTER, settings, SerialRunner(), None, None)
    feasible = _feasible(search)
    got = _bounded(search, feasible)
    reference = StepBound(space.model, BB_CLUSTER)
    tokens = space.global_batch * space.seq_len
    expected = sorted(((score_bound(Objective(), reference(search.structure(p)[0]), tokens, BB_CLUSTER.num_gpus),
                        _key(p)) for p in feasible))
    assert [k for _, k, _ in got] == [k for _, k in expected]
    assert [b for b, _, _ in got] == pytest.approx([b for b, _ in expected], rel=RELATIVE, abs=0)
    # the memory check reads the blocks the compiled bound bound
    assert search.step_bound is search.compiled_bound.bound
    r = optimize(space, BB_CLUSTER, settings)
    assert r.method == "branch_and_bound" and r.proven_optimal
    # the same search bounding configuration by configuration (the search before CompiledBound)
    monkeypatch.setattr(opt, "_compiled_bound", lambda search: _OneByOne(search))
    before = optimize(space, BB_CLUSTER, settings)
    assert before.proven_optimal and before.best.point == r.best.point and before.best.score == r.best.score
    assert before.bounds == r.bounds
    assert sorted(map(_key, (e.point for e in before.evaluated))) == sorted(map(_key, (e.point for e in r.evaluated)))


class _OneByOne:
    """StepBound one configuration at a time, behind CompiledBound's call."""

    def __init__(self, search) -> None:
        self.bound = search.step_bound = search.step_bound or StepBound(search.space.model, search.cluster)

    def __call__(self, configs) -> np.ndarray:
        return np.array([self.bound(par) for par in configs])
