"""Parallelization search and hardware exploration."""

from __future__ import annotations

import json

import pytest

from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.search.evaluate import Objective
from stage_cosim.search.optimize import OptimizeSettings, optimize
from stage_cosim.search.space import default_space

MODEL = get_preset("llama3-8b").with_overrides(layers=8)
CLUSTER = resolve_cluster("dgx-h100:16")
# (the pipeline schedule held at 1F1B: these tests are of the search itself; the schedule as a
# dimension is tests/test_schedules.py's)
SMALL_SPACE = dict(overrides={"vp": (1, 2), "zero": (0, 1), "recompute": ("none", "full"), "micro_batch": (1, 2),
                              "schedule": ("1f1b",)})


def _space(**kw):
    return default_space(MODEL, CLUSTER, 32, 1024, **(SMALL_SPACE | kw))


@pytest.fixture(scope="module")
def exhaustive():
    return optimize(_space(), CLUSTER, OptimizeSettings())


@pytest.mark.slow
def test_exhaustive_is_proven_and_complete(exhaustive) -> None:
    r = exhaustive
    assert r.method == "exhaustive" and r.proven_optimal
    doc = r.to_dict()
    # every distinct configuration is either evaluated or counted under the rule it breaks
    from stage_cosim.search.space import canonical

    space = _space()
    distinct = {json.dumps(canonical(space, p), sort_keys=True) for p in space.points()}
    structural = sum(n for reason, n in r.infeasible.items() if reason != "does not fit in memory")
    assert doc["evaluations"] + structural == len(distinct) < r.space_size
    assert doc["best"]["step_time_s"] == min(e.score for e in r.evaluated if e.feasible)
    assert [e["step_time_s"] for e in doc["top"]] == sorted(e["step_time_s"] for e in doc["top"])
    keys = {"step_time_s", "tokens_per_s", "mfu", "hfu", "peak_memory_bytes", "breakdown", "config"}
    assert keys <= set(doc["best"])


@pytest.mark.slow
def test_differential_evolution_finds_the_proven_optimum(exhaustive) -> None:
    de = optimize(_space(), CLUSTER, OptimizeSettings(exhaustive_limit=0, budget=90, seed=3))
    assert de.method == "differential_evolution" and not de.proven_optimal
    assert len(de.evaluated) <= 90
    assert de.best.point == exhaustive.best.point


@pytest.mark.slow
def test_same_seed_same_answer_regardless_of_workers() -> None:
    settings = dict(exhaustive_limit=0, budget=24, seed=7)
    a = optimize(_space(), CLUSTER, OptimizeSettings(**settings))
    b = optimize(_space(), CLUSTER, OptimizeSettings(**settings, workers=2))
    assert a.to_dict()["best"]["point"] == b.to_dict()["best"]["point"]
    assert sorted(map(str, (e.point for e in a.evaluated))) == sorted(map(str, (e.point for e in b.evaluated)))


def test_cache_never_simulates_twice(monkeypatch) -> None:
    import stage_cosim.search.runner as runner

    seen = []
    real = runner.run_job

    def counting(job):
        seen.append(json.dumps(job[4], sort_keys=True))   # (evaluate, model, cluster, parallel, point, …)
        return real(job)

    monkeypatch.setattr(runner, "run_job", counting)
    optimize(_space(), CLUSTER, OptimizeSettings(exhaustive_limit=0, budget=30, seed=1))
    assert len(seen) == len(set(seen))


@pytest.mark.slow
def test_objectives(exhaustive) -> None:
    price = 2.5
    r = optimize(_space(), CLUSTER, OptimizeSettings(objective=Objective("cost", price)))
    best = r.to_dict()["best"]
    tokens = 32 * 1024
    assert best["score"] == pytest.approx(16 * price / 3600 * best["step_time_s"] / tokens * 1e6)
    # with a fixed GPU count, cost and tokens/GPU rank like step time
    assert best["point"] == exhaustive.best.point
    r2 = optimize(_space(), CLUSTER, OptimizeSettings(objective=Objective("tokens-per-gpu")))
    assert r2.best.point == exhaustive.best.point
    with pytest.raises(UserError, match="price"):
        Objective("cost")


def test_memory_headroom_and_domain_rule() -> None:
    big = default_space(get_preset("llama3-70b").with_overrides(layers=8), CLUSTER, 16, 4096,
                        overrides={"vp": (1,), "zero": (0,), "recompute": ("none",), "micro_batch": (1,), "sp": (False,),
                                   "schedule": ("1f1b",)})
    r = optimize(big, CLUSTER, OptimizeSettings(headroom=0.5))
    assert r.infeasible.get("does not fit in memory", 0) > 0
    for e in r.evaluated:
        if e.feasible:
            assert e.result["peak_memory_bytes"] <= CLUSTER.gpu.memory_bytes * 0.5
    assert all(e.point["tp"] <= 8 for e in r.evaluated)   # tp stays inside the 8-GPU NVLink domain


@pytest.mark.slow
def test_ray_path_matches_local() -> None:
    import ray          # a test dependency (pyproject's test extra): missing, the test fails, not skips
    settings = dict(exhaustive_limit=0, budget=12, seed=5)
    local = optimize(_space(), CLUSTER, OptimizeSettings(**settings))
    try:
        remote = optimize(_space(), CLUSTER, OptimizeSettings(**settings, ray="auto"))
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert remote.best.point == local.best.point and len(remote.evaluated) == len(local.evaluated)


def test_interrupt_returns_best_so_far() -> None:
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] >= 5

    r = optimize(_space(), CLUSTER, OptimizeSettings(), should_stop=stop)
    assert r.interrupted and not r.proven_optimal and 1 <= len(r.evaluated) <= 5


def test_optimize_cli(run_cli, tmp_path) -> None:
    png = tmp_path / "top.png"
    code, out, err = run_cli("optimize", "--model", "llama3-8b", "--layers", "8", "--cluster", "dgx-h100:16",
                             "--global-batch", "32", "--seq-len", "1024", "--budget", "20", "--json",
                             "--plot", str(png))
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) >= {"best", "top", "proven_optimal", "evaluations", "infeasible"}
    assert doc["evaluations"] <= 20 and png.read_bytes()[:4] == b"\x89PNG"
    code, out, _ = run_cli("optimize", "--model", "llama3-8b", "--layers", "8", "--cluster", "dgx-h100:16",
                           "--global-batch", "32", "--seq-len", "1024", "--budget", "12")
    assert code == 0 and "why #1 beats #2" in out and "infeasible, by rule" in out
    code, _, err = run_cli("optimize", "--cluster", "dgx-h100", "--global-batch", "8", "--seq-len", "512")
    assert code == 2 and "cluster:" in err


EXPLORE = """
model: llama3-8b
baseline: dgx-h100:16
global_batch: 32
seq_len: 1024
variables:
  gpu.hbm_GBps: {min: 2000, max: 6000}
  scale_up.bandwidth_GBps: {values: [300, 450, 900]}
cost: {base: 10000, gpu.hbm_GBps: 2, scale_up.bandwidth_GBps: 5}
points: 2
candidates: 12
inner_budget: 12
baseline_budget: 12
reuse_top: 4
"""


@pytest.mark.slow
def test_explore_frontier(run_cli, tmp_path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(EXPLORE)
    png = tmp_path / "front.png"
    code, out, err = run_cli("explore", str(spec), "--json", "--plot", str(png))
    assert code == 0, err
    doc = json.loads(out)
    front = doc["frontier"]
    assert front and all(c["confirmed"] for c in front)
    costs = [c["cost_per_gpu"] for c in front]
    steps = [c["step_time_s"] for c in front]
    assert costs == sorted(costs) and steps == sorted(steps, reverse=True)   # a frontier
    assert {d["variable"] for d in doc["sensitivity"]} == {"gpu.hbm_GBps", "scale_up.bandwidth_GBps"}
    # more HBM bandwidth never slows training down
    hbm = next(d for d in doc["sensitivity"] if d["variable"] == "gpu.hbm_GBps")
    assert hbm["elasticity"] <= 1e-9
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("bad, param", [
    ("variables: {gpu.colour: {min: 1, max: 2}}", "variables.gpu.colour"),
    ("variables: {gpu.hbm_GBps: {min: 5, max: 1}}", "variables.gpu.hbm_GBps"),
    ("mode: dream", "mode"),
    ("cost: {gpu.bf16_tflops: 3}", "cost.gpu.bf16_tflops"),
])
def test_explore_bad_spec(run_cli, tmp_path, bad, param) -> None:
    import yaml

    doc = yaml.safe_load(EXPLORE)
    doc.update(yaml.safe_load(bad))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    code, _, err = run_cli("explore", str(spec))
    assert code == 2 and err.startswith(f"error: {param}:"), err


@pytest.mark.slow
def test_seeded_local_search_improves_on_its_seed(exhaustive) -> None:
    worst = exhaustive.ranked[-1]
    r = optimize(_space(), CLUSTER, OptimizeSettings(exhaustive_limit=0, budget=40, seeds=(worst.point,)))
    assert r.method == "local search from seeds" and not r.proven_optimal
    assert r.best.score < worst.score and len(r.evaluated) <= 40


@pytest.mark.slow
def test_expert_parallelism_is_searched_with_its_rules() -> None:
    """ep and expert_tp are dimensions of a MoE model's space; the layout rules count as reasons;
    cp folds into the ranks the experts re-factor (tp*cp*dp), as in ParallelConfig; differential
    evolution finds the exhaustive optimum."""
    moe = get_preset("mixtral-8x7b").with_overrides(layers=4, hidden=1024, ffn=2048, heads=8, kv_heads=8)
    space = default_space(moe, CLUSTER, 32, 1024, overrides={"vp": (1,), "zero": (1,), "recompute": ("none",),
                                                             "micro_batch": (1,), "sp": (True,), "pp": (1, 2),
                                                             "cp": (1, 2), "cp_comm": ("p2p",),
                                                             "schedule": ("1f1b",)})
    assert {"ep", "expert_tp"} <= set(space.names()) and space.point([0] * len(space.names()))["ep"] == 1
    truth = optimize(space, CLUSTER, OptimizeSettings())
    assert truth.proven_optimal and truth.infeasible.get("expert-tp * ep does not divide tp * cp * dp", 0) > 0
    assert any(e.point["ep"] > 1 for e in truth.evaluated if e.feasible)
    # layouts whose experts need cp's ranks: ep*expert_tp divides tp*cp*dp but not tp*dp
    needs_cp = [e.parallel for e in truth.evaluated
                if e.feasible and (e.parallel["tp"] * e.parallel["dp"]) % (e.parallel["ep"] * e.parallel["expert_tp"])]
    assert needs_cp and all(p["cp"] == 2 and p["edp"] == 1 for p in needs_cp)
    # (174 distinct configurations pass the structural rules: a budget of about a third of them)
    found = optimize(space, CLUSTER, OptimizeSettings(exhaustive_limit=0, budget=60, seed=0))
    assert found.best.point == truth.best.point
    assert "ep" not in default_space(MODEL, CLUSTER, 32, 1024).names()     # a dense model has no experts


def test_expert_layout_with_context_parallelism_is_feasible() -> None:
    """Mixtral on 4 GPUs as tp1 cp2 dp2 with ep4: the experts re-factor all 4 ranks (edp 1),
    which ParallelConfig accepts; the search's rule is the same one."""
    from stage_cosim.search.space import check

    cluster = resolve_cluster("dgx-h100:4")
    space = default_space(get_preset("mixtral-8x7b"), cluster, 8, 8192)
    par, reason = check(space, dict(tp=1, cp=2, cp_comm="p2p", pp=1, ep=4, expert_tp=1), cluster)
    assert reason is None and (par.dp, par.cp, par.ep, par.edp) == (2, 2, 4, 1)
    par, reason = check(space, dict(tp=1, cp=2, cp_comm="p2p", pp=2, ep=4, expert_tp=1), cluster)
    assert par is None and reason == "expert-tp * ep does not divide tp * cp * dp"     # 1*2*1 ranks per stage


def test_optimize_report_names_the_expert_layout() -> None:
    """The text report of `stage-cosim optimize` shows ep and expert_tp wherever the expert
    layout is not the dense one (ep 1, expert_tp = tp)."""
    from stage_cosim.cli.optimize_cmd import describe_point

    base = dict(dp=4, tp=2, pp=2, cp=1, vp=1, micro_batch=1, sp=True, zero=2, recompute="none", dtype="bf16")
    assert describe_point({}, base | dict(ep=4, expert_tp=2)) == "dp4 tp2 pp2 ep4 expert_tp2 mb1 sp zero2"
    assert describe_point({}, base | dict(ep=1, expert_tp=1)) == "dp4 tp2 pp2 ep1 expert_tp1 mb1 sp zero2"
    assert describe_point({}, base | dict(ep=1, expert_tp=2)) == "dp4 tp2 pp2 mb1 sp zero2"     # dense layout
    assert "ep" not in describe_point({}, base)                                                 # a dense model


# A hand-made landscape over (micro_batch, zero, vp): step time, None where it does not fit in
# memory. From the start (mb1, ZeRO-1, vp1) every single move is worse or does not fit; the
# optimum (mb2, ZeRO-3, vp1) is two moves away, across the memory wall of (mb2, ZeRO-1). The ten
# vp settings are a plateau of slightly worse points a descent would polish one by one first.
def _wall_time(mb: int, zero: int, vp: int) -> float | None:
    base = {(1, 1): 10.0, (2, 1): None, (1, 3): 11.0, (2, 3): 5.0}[(mb, zero)]
    return None if base is None else base + 0.1 * (vp - 1)


def _wall_job(point: dict) -> object:
    from stage_cosim.search.evaluate import MEMORY_REASON, Evaluation

    t = _wall_time(point["micro_batch"], point["zero"], point["vp"])
    return Evaluation(point, None, t is not None, None if t is not None else MEMORY_REASON, t, None)


def test_local_search_crosses_a_memory_wall() -> None:
    """A move that does not fit in memory is tried with the memory settings changed beside it:
    the first descent from (mb1, ZeRO-1) reaches (mb2, ZeRO-3) within a budget that single moves
    spend on the plateau (they reach it only after polishing every vp setting: 30 simulations)."""
    from stage_cosim.search.optimize import Problem
    from stage_cosim.search.space import Dimension, SearchSpace

    class Wall(Problem):
        def canonical(self, point: dict) -> dict:
            return dict(point)

        def check(self, point: dict) -> tuple:
            return point, None

        def job(self, config: object, point: dict) -> tuple:
            return (_wall_job, point)

    space = SearchSpace(get_preset("llama3-8b"), 8, 8, 1024, (Dimension("micro_batch", (1, 2)),
                        Dimension("zero", (1, 3)), Dimension("vp", tuple(range(1, 11)))))
    cluster = resolve_cluster("dgx-h100:8")
    settings = OptimizeSettings(seeds=({"micro_batch": 1, "zero": 1, "vp": 1},), budget=20, exhaustive_limit=0)
    r = optimize(space, cluster, settings, problem=Wall(space, cluster, settings))
    assert r.best.point == {"micro_batch": 2, "zero": 3, "vp": 1} and r.best.score == 5.0


def test_the_feasible_points_are_each_points_structural_rules() -> None:
    """The enumeration keys each canonical point once and checks it once: the same feasible
    configurations, in the same order, and the same count of each broken rule, as checking
    every distinct canonical point on its own. The DualPipe rule (two copies of the model
    states) rules some points out and keeps others (its parameter count is taken once a model,
    so two models in one process must each get their own)."""
    from collections import Counter

    from stage_cosim.schedule.memory import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES
    from stage_cosim.search.optimize import _feasible, _key, _Search
    from stage_cosim.search.runner import SerialRunner
    from stage_cosim.search.space import _dualpipe_states_exceed, canonical, check

    big = get_preset("llama3-70b").with_overrides(layers=8)
    space = default_space(big, CLUSTER, 16, 4096, overrides={"micro_batch": (1, 2), "recompute": ("none",),
                                                              "zero": (0, 3)})
    search = _Search(space, CLUSTER, OptimizeSettings(), SerialRunner(), None, None)
    got = _feasible(search)
    ref: dict = {}
    reasons: Counter = Counter()
    for p in space.points():
        c = canonical(space, p)
        if _key(c) not in ref:
            par, reason = check(space, c, CLUSTER)
            ref[_key(c)] = par
            reasons[reason] += reason is not None
    assert [_key(p) for p in got] == [k for k, par in ref.items() if par is not None]
    assert search.reasons == +reasons
    assert reasons["dualpipe: its two copies of the parameters do not fit in memory"] > 0
    assert any(p["schedule"] == "dualpipe" for p in got)
    # the rule against its closed form (2 copies x parameters / (pp x tp) x 18 bytes at ZeRO-0),
    # for two models one after the other
    for model in (big, MODEL):
        s = default_space(model, CLUSTER, 16, 4096)
        for tp in (1, 8):
            states = 2 * model.param_count() / tp * (WEIGHT_BYTES + GRAD_BYTES + OPTIMIZER_BYTES)
            point = {"tp": tp, "pp": 1, "zero": 0, "schedule": "dualpipe"}
            assert _dualpipe_states_exceed(s, point, CLUSTER, 16 // tp) == (states > CLUSTER.gpu.memory_bytes)
