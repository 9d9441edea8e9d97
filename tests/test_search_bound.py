"""The search's lower bound on a step (search/bound.py) and the branch and bound built on it.

* The bound is a stage's kernels summed over the step: it never exceeds the simulated step
  (random configurations of a dense model with cp, fp8, interleaving and the zero-bubble and
  DualPipe schedules, a tied-embedding GPT, Mixture-of-Experts models, sliding-window and
  latent-attention layers), and it is exactly the kernels of the role graphs it never builds
  (every kernel a later pass waits for).
* Branch and bound gives the answer full enumeration gives, proven, simulating fewer.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.simulate import simulate
from stage_cosim.graph.ir import ATTENTION_KINDS
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import ModelConfig, get_preset
from stage_cosim.schedule.nodes import COMP
from stage_cosim.search.bound import SLACK, StepBound, exact_replay, policy_key, score_bound
from stage_cosim.search.evaluate import MEMORY_REASON, Objective, workload_of
from stage_cosim.search.optimize import OptimizeSettings, _key, optimize, tied
from stage_cosim.search.space import canonical, check, default_space

RELATIVE = 1e-9        # the bound may exceed the simulated step by rounding only

GPT_TIED = ModelConfig.build("gpt-tied", "gpt", layers=4, hidden=1024, heads=16, vocab=51200, max_seq=2048,
                             attention="unfused")
SMALL_MOE = dict(layers=4, hidden=1024, ffn=2048, heads=8, kv_heads=8)
# name -> (model, cluster, global batch, sequence, precision, space overrides)
CASES = {
    # cp up to 2 (8,192 tokens), bf16 and fp8, vp up to 4
    "llama": (get_preset("llama3-8b").with_overrides(layers=4), "dgx-h100:16", 32, 8192, {"dtype": "auto"},
              {"zero": (1, 3), "recompute": ("none", "full"), "sp": (True,)}),
    "gpt-tied": (GPT_TIED, "dgx-h100:8", 16, 2048, {}, {"zero": (0, 2), "vp": (1, 2)}),
    "mixtral": (get_preset("mixtral-8x7b").with_overrides(**SMALL_MOE), "dgx-h100:16", 32, 8192, {},
                {"zero": (1, 3), "recompute": ("none", "selective"), "sp": (True,)}),
    # sliding-window layers between global ones: two kinds of layer in turn
    "gpt-oss": (get_preset("gpt-oss-120b").with_overrides(layers=4), "dgx-h100:16", 16, 4096, {},
                {"zero": (1,), "recompute": ("none", "full"), "sp": (True,), "cp": (1,)}),
    # latent attention, a dense first layer before the experts
    "deepseek": (get_preset("deepseek-v3").with_overrides(layers=4), "dgx-h100:16", 16, 4096, {},
                 {"zero": (2,), "recompute": ("none",), "sp": (True,), "cp": (1,)}),
}


def _sample(case: str, n: int, seed: int, policies: int = 8):
    """(model, cluster, ``n`` random structurally feasible configurations): drawn from a few
    compiled-alike groups (compiling is what costs), every point of the space equally likely
    within them."""
    model, cluster_name, gb, seq, precision, overrides = CASES[case]
    cluster = resolve_cluster(cluster_name)
    space = default_space(model, cluster, gb, seq, precision=precision, overrides=overrides)
    rng = random.Random(seed)
    seen, groups = set(), defaultdict(list)
    for _ in range(20_000):
        p = canonical(space, {d.name: rng.choice(d.choices) for d in space.dimensions})
        k = _key(p)
        if k in seen:
            continue
        seen.add(k)
        par, _ = check(space, p, cluster)
        if par is not None:
            groups[policy_key(par)].append(par)
    keys = sorted(groups, key=str)
    keys = rng.sample(keys, min(policies, len(keys)))
    pool = [par for k in keys for par in groups[k]]
    return model, cluster, rng.sample(pool, min(n, len(pool)))


def _check_below(case: str, n: int, seed: int, policies: int = 8) -> list:
    model, cluster, configs = _sample(case, n, seed, policies)
    bound = StepBound(model, cluster)
    for par in configs:
        result = simulate(workload_of(model, par, cluster.gpu), cluster)[0]
        b = bound(par)
        assert 0 < b <= result.step_time_s * (1 + RELATIVE), (case, par.to_dict(), b, result.step_time_s)
        # the bound counts every kernel exactly where the simulator replays every node
        assert result.config["exact"] == exact_replay(par), par.to_dict()
    return configs


def test_bound_is_below_the_simulated_step() -> None:
    """A first sample of every kind of model (the slow test below draws the rest)."""
    total = 0
    for case, n in (("llama", 40), ("gpt-tied", 16), ("mixtral", 24), ("gpt-oss", 12), ("deepseek", 8)):
        total += len(_check_below(case, n, seed=1, policies=4))
    assert total >= 90


@pytest.mark.slow
@pytest.mark.parametrize("case, n", [("llama", 150), ("gpt-tied", 60), ("mixtral", 100), ("gpt-oss", 50),
                                     ("deepseek", 40)])
def test_bound_is_below_the_simulated_step_everywhere(case: str, n: int) -> None:
    """With the first sample, over 500 configurations: the dense model's cover cp, fp8 and
    interleaved pipelines, the MoE model's expert parallelism."""
    configs = _check_below(case, n, seed=2, policies=10)
    assert len(configs) >= n * 0.9
    if case == "llama":
        assert any(p.cp > 1 for p in configs) and any(p.dtype == "fp8" for p in configs)
        assert any(p.vp > 1 for p in configs) and any(p.tp_comm_overlap for p in configs)
        # every pipeline schedule the search tries (the split backward, the V, the two copies)
        assert {"zb-h1", "zb-v", "dualpipe", "dualpipev"} <= {p.schedule for p in configs}
    if case == "mixtral":
        assert any(p.ep > 1 for p in configs)


def _graph_kernels(w, cluster) -> tuple[list[float], list[float]]:
    """Each stage's kernels from its role graph, as the simulator times them: (all of them,
    those that lead to a sink of their pass or are the step end's)."""
    compute = ComputeModel(cluster.gpu)

    def seconds(r) -> float:
        return compute.duration_s(r[3], r[5], r[6], r[10] in ATTENTION_KINDS, r[13], r[16])

    every, live = [], []
    for s in range(w.parallel.pp):
        role = w.role(s)
        per_template = {}
        for key, t in role.templates.items():
            rows, sinks = t.rows, set(t.sinks)
            reaches = [False] * len(rows)
            for j in range(len(rows) - 1, -1, -1):
                reaches[j] = reaches[j] or j in sinks
                if reaches[j]:
                    for d in rows[j][2]:
                        if d >= 0:
                            reaches[d] = True
            kernels = [(seconds(r), reaches[j]) for j, r in enumerate(rows) if r[1] == COMP]
            per_template[key] = (sum(d for d, _ in kernels), sum(d for d, ok in kernels if ok))
        tail = sum(compute.duration_s(n.flops, n.mem_bytes, n.matmul, n.category in ATTENTION_KINDS, n.groups, n.keys)
                   for n in (role.node(i) for i in range(role.step_end_start, role.num_nodes)) if n.type == COMP)
        every.append(sum(per_template[p.template][0] for p in role.passes) + tail)
        live.append(sum(per_template[p.template][1] for p in role.passes) + tail)
    return every, live


@pytest.mark.parametrize("case", sorted(CASES))
def test_bound_is_the_role_graphs_kernels(case: str) -> None:
    """Without building them, the bound sums exactly the kernels of the stages' role graphs;
    with ZeRO-3 it leaves out the weight-gradient kernels that only its in-pass reduce-scatter
    reads (nothing waits for them: they may still run when the next pass starts), never more."""
    model, cluster, configs = _sample(case, 6, seed=3, policies=3)
    bound = StepBound(model, cluster)
    for par in configs:
        every, live = _graph_kernels(workload_of(model, par, cluster.gpu), cluster)
        mine = bound.stage_times(par)
        for a, b in zip(mine, live):
            assert a <= b * (1 + RELATIVE), (case, par.to_dict(), mine, live)
        if par.zero != 3:
            assert mine == pytest.approx(every, rel=1e-12), (case, par.to_dict())
        assert bound(par) >= max(mine) * (1 - SLACK)       # (and, with a pipeline, its fill and drain)


@pytest.mark.parametrize("case", ["llama", "mixtral"])
def test_a_shared_bound_is_each_configurations_own(case: str) -> None:
    """One StepBound shares blocks between configurations (those alike in their degrees and
    switches, whatever their schedule or virtual stages): each bound is the one a StepBound
    of its own gives, to the last bit, over configurations of every schedule, cp, fp8 and ep."""
    model, cluster, configs = _sample(case, 40, seed=5, policies=4)
    shared = StepBound(model, cluster)
    mine = [shared(par) for par in configs]
    assert len({(p.schedule, p.vp) for p in configs}) > 2
    assert mine == [StepBound(model, cluster)(par) for par in configs]


def test_score_bounds_follow_the_objective() -> None:
    """Every objective grows with the step time at a fixed GPU count and batch: a bound on the
    step bounds its score (lower is better)."""
    tokens, gpus = 32 * 1024, 16
    for name, price in (("step-time", 0.0), ("tokens-per-gpu", 0.0), ("cost", 2.5)):
        objective = Objective(name, price)
        lo, hi = score_bound(objective, 1.0, tokens, gpus), score_bound(objective, 1.5, tokens, gpus)
        assert lo < hi
        real = {"step_time_s": 1.5, "tokens_per_s": tokens / 1.5, "tokens_per_s_per_gpu": tokens / 1.5 / gpus,
                "config": {"num_gpus": gpus}}
        assert hi == objective.score(real)


# -- branch and bound ---------------------------------------------------------------------------

BB_MODEL = get_preset("llama3-8b").with_overrides(layers=4)
BB_CLUSTER = resolve_cluster("dgx-h100:16")
BB_SPACE = {"vp": (1, 2), "zero": (0, 1, 3), "recompute": ("none", "full"), "micro_batch": (1, 2),
            "cp_comm": ("p2p",)}


def _bb_space():
    return default_space(BB_MODEL, BB_CLUSTER, 32, 4096, overrides=BB_SPACE)


@pytest.fixture(scope="module")
def enumerated():
    return optimize(_bb_space(), BB_CLUSTER, OptimizeSettings(headroom=0.9))


def test_branch_and_bound_is_the_enumerated_optimum(enumerated) -> None:
    """On a space small enough to simulate whole, branch and bound (forced: exhaustive_limit 0)
    answers what full enumeration answers, says it is proven, and simulates fewer; every
    configuration is accounted for (simulated, over the memory, or ruled out by its bound)."""
    assert enumerated.method == "exhaustive" and enumerated.proven_optimal
    r = optimize(_bb_space(), BB_CLUSTER, OptimizeSettings(headroom=0.9, exhaustive_limit=0))
    assert r.method == "branch_and_bound" and r.proven_optimal and not r.interrupted
    assert r.best.point == enumerated.best.point and r.best.score == enumerated.best.score
    bb = r.bounds
    assert bb["feasible"] == bb["bounded"] == enumerated.feasible == len(enumerated.evaluated)
    assert bb["simulated"] + bb["pruned_by_memory"] + bb["pruned_by_bound"] == bb["feasible"]
    assert bb["simulated"] == sum(e.feasible for e in r.evaluated) < bb["feasible"]
    assert bb["pruned_by_memory"] == sum(e.reason == MEMORY_REASON for e in r.evaluated) > 0
    assert bb["pruned_by_bound"] > 0 and len(r.evaluated) == bb["simulated"] + bb["pruned_by_memory"]
    # what it left unsimulated is slower than the optimum (the enumeration simulated it)
    seen = {_key(e.point) for e in r.evaluated}
    best = r.best.score
    for e in enumerated.evaluated:
        if _key(e.point) not in seen and e.feasible:
            assert e.score > best and not tied(e.score, best)
    doc = r.to_dict()
    assert doc["proven_optimal"] and doc["unexplored"] == 0 and doc["branch_and_bound"] == bb
    assert doc["best"]["point"] == enumerated.to_dict()["best"]["point"]
    json.dumps(doc)


@pytest.mark.slow
def test_branch_and_bound_under_other_objectives_and_workers(enumerated) -> None:
    """The bound follows the objective (tokens per GPU, cost), and workers (which bound the
    space in shares and simulate in batches) give the same proven answer."""
    for objective in (Objective("tokens-per-gpu"), Objective("cost", 3.0)):
        r = optimize(_bb_space(), BB_CLUSTER, OptimizeSettings(headroom=0.9, exhaustive_limit=0, objective=objective))
        assert r.proven_optimal and r.best.point == enumerated.best.point
    r = optimize(_bb_space(), BB_CLUSTER, OptimizeSettings(headroom=0.9, exhaustive_limit=0, workers=2))
    assert r.method == "branch_and_bound" and r.proven_optimal and r.best.point == enumerated.best.point
    assert r.bounds["bounded"] == r.bounds["feasible"]


@pytest.mark.slow
def test_branch_and_bound_per_precision() -> None:
    """With the precision left to the search (--dtype auto), each precision is searched on its
    own, each proven: the best of each is the enumerated best of its half of the space."""
    space = default_space(BB_MODEL, BB_CLUSTER, 32, 4096, precision={"dtype": "auto"},
                          overrides=BB_SPACE | {"zero": (1,), "vp": (1,)})
    truth = optimize(space, BB_CLUSTER, OptimizeSettings(headroom=0.9, exhaustive_limit=10**6))
    r = optimize(space, BB_CLUSTER, OptimizeSettings(headroom=0.9, exhaustive_limit=0))
    assert r.method == "branch_and_bound, per dtype" and r.proven_optimal
    assert r.best.point == truth.best.point
    assert r.to_dict()["best_by_dtype"].keys() == truth.to_dict()["best_by_dtype"].keys() == {"bf16", "fp8"}
    for dtype, entry in r.to_dict()["best_by_dtype"].items():
        assert entry["point"] == truth.to_dict()["best_by_dtype"][dtype]["point"]
    bb = r.bounds
    assert bb["bounded"] == bb["feasible"] == r.feasible == truth.feasible
    assert bb["simulated"] + bb["pruned_by_memory"] + bb["pruned_by_bound"] == bb["feasible"]


def test_a_budget_or_a_space_too_large_to_bound_keeps_differential_evolution(monkeypatch) -> None:
    """A budget asks for a search of that many simulations (differential evolution, as before);
    a space with more feasible points than bound_limit is searched by differential evolution
    started from the best-bounded points of a sample."""
    from stage_cosim.search import optimize as opt

    space = default_space(BB_MODEL, BB_CLUSTER, 32, 4096, overrides=BB_SPACE | {"zero": (1,), "vp": (1,)})
    r = optimize(space, BB_CLUSTER, OptimizeSettings(exhaustive_limit=0, budget=6))
    assert r.method == "differential_evolution" and r.bounds is None and len(r.evaluated) <= 6
    calls = []
    real = opt._warm_start

    def spy(search, feasible):
        calls.append(len(feasible))
        warm = real(search, feasible)
        calls.append(warm)
        return warm

    monkeypatch.setattr(opt, "_warm_start", spy)
    monkeypatch.setattr(opt, "DEFAULT_BUDGET", 10)
    r = optimize(space, BB_CLUSTER, OptimizeSettings(exhaustive_limit=0, bound_limit=4, seed=1))
    assert r.method == "differential_evolution" and not r.proven_optimal and r.bounds is None
    assert calls[0] == r.feasible and len(r.evaluated) <= 10
    # the sample's best-bounded point was among the first population's, so it was evaluated
    assert _key(calls[1][0]) in {_key(e.point) for e in r.evaluated}


def test_the_report_says_how_branch_and_bound_settled_the_space(capsys) -> None:
    from stage_cosim.cli.optimize_cmd import print_report

    entry = {"point": {"tp": 1}, "score": 1.0, "step_time_s": 1.0, "mfu": 0.5, "peak_memory_bytes": 1 << 30,
             "breakdown": {"compute": 1.0}, "config": {"parallel": {"dp": 8, "tp": 1, "pp": 1, "micro_batch": 1,
                                                                    "zero": 1}}}
    doc = {"best": entry, "top": [entry], "best_by_dtype": {}, "proven_optimal": True, "method": "branch_and_bound",
           "evaluations": 30, "infeasible": {}, "space_size": 4000, "interrupted": False, "feasible": 2000,
           "unexplored": 0, "branch_and_bound": {"feasible": 2000, "bounded": 2000, "simulated": 20,
                                                 "pruned_by_memory": 10, "pruned_by_bound": 1970}}
    print_report(doc, Objective(), 5)
    out = capsys.readouterr().out
    assert "proven optimum (branch and bound" in out.splitlines()[0]
    assert ("branch and bound: 2,000 of 2,000 feasible configurations bounded; 20 simulated, 10 over the memory, "
            "1,970 ruled out by their bound") in out
