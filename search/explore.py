"""Hardware design-space exploration: how fast would training be on a GPU or network that does
not exist yet, and what is it worth?

For each hardware candidate the step time is that of the best parallelization on it (a nested
search). Work is reused across candidates: the workload graphs do not depend on the hardware
(each parallelization is synthesized once), and the inner search is seeded by the baseline's
best configurations, re-checked (memory, domains) and re-simulated on the candidate; frontier
points are then confirmed by a full inner search.

What is varied, priced and judged (the spec) is read and checked in :mod:`explore_spec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.model import ModelConfig
from stage_cosim.search.evaluate import Objective, workload_of
from stage_cosim.search.explore_spec import ExploreSpec
from stage_cosim.search.optimize import OptimizeSettings, _key as _point_key, optimize
from stage_cosim.search.runner import run_job
from stage_cosim.search.space import check, default_space


def apply(baseline: Cluster, values: dict[str, float]) -> Cluster:
    """A hypothetical cluster: the baseline with some fields replaced."""
    parts: dict[str, dict[str, float]] = {}
    for name, v in values.items():
        part, _, fld = name.partition(".")
        parts.setdefault(part, {})[fld] = v
    c = baseline
    if "gpu" in parts:
        c = replace(c, gpu=c.gpu.with_overrides(**parts["gpu"]))
    if "scale_up" in parts:
        c = replace(c, scale_up=replace(c.scale_up, **parts["scale_up"]))
    if "scale_out" in parts:
        c = replace(c, scale_out=replace(c.scale_out, **parts["scale_out"]))
    return c


def baseline_values(spec: ExploreSpec) -> dict[str, float]:
    return {v.name: getattr(getattr(spec.baseline, v.part), v.field) for v in spec.variables}


def cost_per_gpu(spec: ExploreSpec, values: dict[str, Any]) -> float:
    """$ per GPU of a candidate: the base, each numeric variable's unit price, and with
    ``network_cost`` its scale-out network counted from its topology (hardware.fabric)."""
    cost = spec.base_cost + sum(spec.unit_cost.get(k, 0.0) * v for k, v in values.items()
                                if not isinstance(v, (str, bool)))
    if spec.network_cost is not None:
        from stage_cosim.hardware.fabric import cost_per_gpu as fabric_cost

        cost += fabric_cost(apply(spec.baseline, values), spec.network_cost)
    return cost


def cost_range(spec: ExploreSpec) -> tuple[float, float]:
    """The cheapest and dearest candidate's cost: the variables' bounds, every choice's value
    (a network's cost is not monotonic in its choices) — at most 4,096 corners, else the bounds
    alone."""
    import itertools

    ends = [v.values if v.choice else (v.decode(v.bounds()[0]), v.decode(v.bounds()[1])) for v in spec.variables]
    if math.prod(len(e) for e in ends) > 4096:
        ends = [e[:1] + e[-1:] for e in ends]
    costs = [cost_per_gpu(spec, dict(zip((v.name for v in spec.variables), combo))) for combo in itertools.product(*ends)]
    return min(costs), max(costs)


@dataclass
class Candidate:
    values: dict[str, float]
    cost_per_gpu: float
    step_time_s: float | None            # the objective's value (a step time, or its serving metric)
    best: dict[str, Any] | None          # the best configuration's simulate result (+ point)
    confirmed: bool = False              # by a full inner search
    metric: str = "step_time_s"          # the objective's result key (ExploreSpec.metric)
    # whether the inner search proved ``best`` optimal on this hardware (every feasible
    # configuration simulated), and else how many feasible ones it left (None: not searched)
    proven_optimal: bool = False
    unexplored: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"values": self.values, "cost_per_gpu": self.cost_per_gpu, self.metric: self.step_time_s,
                "best": self.best, "confirmed": self.confirmed, "proven_optimal": self.proven_optimal,
                "unexplored": self.unexplored}


@dataclass
class Explorer:
    spec: ExploreSpec
    progress: Callable[[dict], None] | None = None
    should_stop: Callable[[], bool] | None = None
    cache: dict[tuple, Candidate] = field(default_factory=dict)
    seeds: list[dict[str, Any]] = field(default_factory=list)      # baseline's best points
    visited: list[tuple] = field(default_factory=list)              # the last full search's points
    done: int = 0                                                   # candidate evaluations asked for

    def _settings(self) -> OptimizeSettings:
        return OptimizeSettings(objective=Objective("step-time"), seed=self.spec.seed, budget=self.spec.inner_budget,
                                top_k=self.spec.reuse_top)

    @property
    def _inner(self):  # noqa: ANN202 (ServingInner, or None for the training objective)
        if self.spec.objective == "step-time":
            return None
        from stage_cosim.search.serving import serving_inner

        return serving_inner(self.spec.objective, self.spec.model, self.spec.serving)

    def _space(self, cluster: Cluster):  # noqa: ANN202
        inner = self._inner
        if inner is not None:
            return inner.space(self.spec.model, cluster)
        return default_space(self.spec.model, cluster, self.spec.global_batch, self.spec.seq_len,
                             precision=self.spec.precision)

    def _problem(self, space, cluster: Cluster):  # noqa: ANN001, ANN202
        inner = self._inner
        return inner.problem(space, cluster) if inner is not None else None

    def search(self, cluster: Cluster, settings: OptimizeSettings):  # noqa: ANN201 (OptimizeResult)
        """The inner search on ``cluster``."""
        space = self._space(cluster)
        return optimize(space, cluster, settings, should_stop=self.should_stop, problem=self._problem(space, cluster))

    def candidate(self, values: dict[str, float], best: dict[str, Any] | None, confirmed: bool = False) -> Candidate:
        metric = self.spec.metric
        try:
            cost = cost_per_gpu(self.spec, values)
        except UserError:       # a design the cluster's rules refuse is never a candidate
            if best is not None:
                raise
            cost = math.inf
        return Candidate(values, cost, best[metric] if best else None, best, confirmed, metric)

    def full_search(self, values: dict[str, float], seeds: tuple[dict[str, Any], ...] = ()) -> Candidate:
        """The best parallelization on this hardware: a full search, or a local search from
        ``seeds`` (the configurations that won on similar hardware)."""
        cluster = apply(self.spec.baseline, values)
        result = self.search(cluster, replace(self._settings(), seeds=seeds))
        self.visited = [_point_key(e.point) for e in result.evaluated]
        ranked = result.ranked
        best = {**ranked[0].result, "point": ranked[0].point, "score": ranked[0].score} if ranked else None
        cand = self.candidate(values, best, True)
        cand.proven_optimal, cand.unexplored = result.proven_optimal, result.to_dict()["unexplored"]
        self.cache[self._key(values)] = cand
        return cand

    @staticmethod
    def _key(values: dict[str, float]) -> tuple:
        return tuple(sorted((k, v if isinstance(v, (str, bool)) else round(v, 6)) for k, v in values.items()))

    def quick(self, values: dict[str, float]) -> Candidate:
        """Best of the baseline's top configurations, re-checked and re-simulated here. Every
        call is one step of the progress (``done`` of ``total``: :func:`planned_evaluations`),
        a candidate already evaluated included."""
        key = self._key(values)
        cand = self.cache.get(key)
        if cand is None:
            if self.should_stop is not None and self.should_stop():
                raise KeyboardInterrupt
            best = _best_of(self, values, self.seeds)
            cand = self.candidate(values, best)
            self.cache[key] = cand
        self.done += 1
        if self.progress is not None:
            self.progress({"done": self.done, "total": planned_evaluations(self.spec), "candidates": len(self.cache),
                           "values": values, "step_time_s": cand.step_time_s, "cost_per_gpu": cand.cost_per_gpu})
        return cand


def _simulate_cached(model: ModelConfig, par, cluster: Cluster) -> dict[str, Any] | None:  # noqa: ANN001
    from stage_cosim.adapters.roofline.simulate import simulate

    w = workload_of(model, par, cluster.gpu)
    if max(w.memory(s, cluster).total for s in range(par.pp)) > cluster.gpu.memory_bytes:
        return None
    result, _, _ = simulate(w, cluster)
    return result.to_dict()


def _best_of(ex: "Explorer", values: dict[str, float], points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best of ``points`` on the hardware ``values`` (re-checked and re-simulated)."""
    try:
        cluster = apply(ex.spec.baseline, values)
    except UserError:       # a design the cluster's rules refuse (rails that split a node): no step
        return None
    space = ex._space(cluster)
    problem = ex._problem(space, cluster)
    metric = ex.spec.metric
    best = None
    for point in points:
        if problem is None:
            par, _ = check(space, point, cluster)
            r = _simulate_cached(ex.spec.model, par, cluster) if par is not None else None
        else:
            config, _ = problem.check(point)
            ev = run_job(problem.job(config, point)) if config is not None else None
            r = ev.result if ev is not None and ev.feasible else None
        if r is not None and (best is None or r[metric] < best[metric]):
            best = {**r, "point": point}
    return best


def _minimize_step(ex: Explorer, max_cost: float | None, seed: int) -> None:
    """scipy differential evolution over the variables: least step time within ``max_cost``."""
    from scipy.optimize import differential_evolution

    spec = ex.spec
    bounds = [v.bounds() for v in spec.variables]
    integrality = [v.values is not None or v.integer for v in spec.variables]

    def decode(x: np.ndarray) -> dict[str, float]:
        return {v.name: v.decode(xi) for v, xi in zip(spec.variables, x)}

    def f(x: np.ndarray) -> float:
        values = decode(x)
        c = ex.quick(values)
        if c.step_time_s is None:
            return 1e9
        over = 0.0 if max_cost is None else max(0.0, c.cost_per_gpu - max_cost) / max(max_cost, 1.0)
        return c.step_time_s * (1 + 100 * over) + (1e3 * over if over else 0.0)

    popsize, maxiter = _de_sizes(spec)
    differential_evolution(f, bounds, integrality=integrality, seed=seed, popsize=popsize, maxiter=maxiter,
                           polish=False, updating="deferred", init="sobol", tol=0, atol=0)


def _de_sizes(spec: ExploreSpec) -> tuple[int, int]:
    """(popsize, maxiter) of each scipy run: about ``spec.candidates`` evaluations."""
    n = len(spec.variables)
    popsize = max(4, spec.candidates // (4 * n) or 4)
    return popsize, max(1, spec.candidates // (popsize * n) - 1)


def planned_evaluations(spec: ExploreSpec) -> int:
    """The candidate evaluations an exploration asks for, at most (its progress total): each
    scipy run evaluates its population at the start and once per generation (scipy's population:
    max(5, popsize x the variables that vary) members, rounded up to a power of two for its Sobol
    start; a run that converges stops early), one run per budget level, then the sensitivity's
    two neighbours of the baseline per variable (a choice: each other choice)."""
    popsize, maxiter = _de_sizes(spec)
    varying = sum(1 for v in spec.variables if v.bounds()[0] != v.bounds()[1])
    members = max(5, popsize * max(1, varying))
    members = 1 << (members - 1).bit_length()
    runs = 1 if spec.mode == "budget" else spec.points
    return runs * members * (maxiter + 1) + sum(len(v.values) - 1 if v.choice else 2 for v in spec.variables)


def pareto_front(cands: list[Candidate]) -> list[Candidate]:
    pts = sorted((c for c in cands if c.step_time_s is not None), key=lambda c: (c.cost_per_gpu, c.step_time_s))
    front, best = [], math.inf
    for c in pts:
        if c.step_time_s < best - 1e-12:
            front.append(c)
            best = c.step_time_s
    return front


def sensitivity(ex: Explorer, base: dict[str, float], step0: float) -> list[dict[str, Any]]:
    """Elasticity of step time to each variable around the baseline: d ln(step) / d ln(x),
    from the neighbouring grid values or +-10 % within bounds."""
    out = []
    for v in ex.spec.variables:
        x0 = base[v.name]
        if v.choice:        # the objective on each other choice, no elasticity
            alts = {str(x): ex.quick({**base, v.name: x}).step_time_s for x in v.values if x != x0}
            out.append({"variable": v.name, "baseline": x0, "elasticity": None, "step_time_s": alts})
            continue
        if v.values is not None:
            idx = min(range(len(v.values)), key=lambda i: abs(v.values[i] - x0))
            lo_x, hi_x = v.values[max(0, idx - 1)], v.values[min(len(v.values) - 1, idx + 1)]
        else:
            lo_x, hi_x = v.decode(x0 * 0.9), v.decode(x0 * 1.1)
        pts = []
        for x in (lo_x, hi_x):
            if x != x0:
                c = ex.quick({**base, v.name: x})
                if c.step_time_s is not None:
                    pts.append((x, c.step_time_s))
        if not pts:
            out.append({"variable": v.name, "elasticity": None})
            continue
        el = np.mean([(math.log(t) - math.log(step0)) / (math.log(x) - math.log(x0)) for x, t in pts])
        out.append({"variable": v.name, "baseline": x0, "elasticity": float(el),
                    "step_time_s": {str(x): t for x, t in pts}})
    return sorted(out, key=lambda d: -abs(d["elasticity"] or 0.0))


def explore(spec: ExploreSpec, progress: Callable[[dict], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    ex = Explorer(spec, progress, should_stop)
    base = baseline_values(spec)
    interrupted = False
    # the baseline: its own search (as optimize runs it), polished by the same local search that confirms the
    # frontier (so the baseline and the frontier are searched alike); its top configurations
    # seed every other candidate
    cluster = apply(spec.baseline, base)
    result = ex.search(cluster, replace(ex._settings(), budget=spec.baseline_budget))
    if not result.ranked:
        raise UserError("baseline", "no parallelization of the model fits the baseline cluster"
                        if spec.objective == "step-time" else f"no serving layout of the model works on the baseline "
                                                              f"cluster ({spec.objective})")
    top = [e.point for e in result.ranked[:spec.reuse_top]]
    baseline = ex.full_search(base, tuple(top[:3]))
    # the polish starts from the first search's best: proven with it, and what neither
    # simulated is what is left unexplored
    baseline.proven_optimal = baseline.proven_optimal or result.proven_optimal
    if baseline.proven_optimal:
        baseline.unexplored = 0
    elif result.feasible is not None:
        seen = {_point_key(e.point) for e in result.evaluated} | set(ex.visited)
        baseline.unexplored = max(0, result.feasible - len(seen))
    ex.seeds = [baseline.best["point"]] + [p for p in top if p != baseline.best["point"]]
    ex.seeds = ex.seeds[:spec.reuse_top]
    try:
        if spec.mode == "budget":
            _minimize_step(ex, spec.budget, spec.seed)
        else:
            lo, hi = cost_range(spec)
            for i, level in enumerate(np.linspace(lo, hi, spec.points)):
                _minimize_step(ex, float(level) if i < spec.points - 1 else None, spec.seed + i)
    except KeyboardInterrupt:
        interrupted = True
    cands = list(ex.cache.values())
    if spec.mode == "budget":
        ok = [c for c in cands if c.step_time_s is not None and c.cost_per_gpu <= spec.budget]
        chosen = sorted(ok, key=lambda c: c.step_time_s)[:1]
    else:
        chosen = pareto_front(cands)
    if not interrupted:
        # confirm each answer with a nested search on its own hardware, warm-started from its
        # best configuration so far, the baseline's best ones, and the winners on the hardware
        # confirmed before it (good configurations carry over between similar machines)
        winners: list[dict[str, Any]] = []
        for c in chosen:
            if not c.confirmed:
                start = ((c.best["point"],) if c.best else ()) + tuple(winners[-3:]) + tuple(ex.seeds[:3])
                confirmed = ex.full_search(c.values, start)
                if confirmed.best and confirmed.best["point"] not in winners:
                    winners.append(confirmed.best["point"])
        # and the baseline gets the same chance: every winner, re-simulated on it
        better = _best_of(ex, base, winners)
        if better is not None and better[spec.metric] < baseline.step_time_s:
            found = ex.candidate(base, better, True)
            # (a proven optimum is never beaten; what is left unexplored stays as counted)
            found.proven_optimal, found.unexplored = baseline.proven_optimal, baseline.unexplored
            baseline = ex.cache[ex._key(base)] = found
        # the sensitivity below re-tries the baseline's configuration first
        ex.seeds = [baseline.best["point"]] + [p for p in winners + ex.seeds if p != baseline.best["point"]]
        ex.seeds = ex.seeds[:spec.reuse_top]
        cands = list(ex.cache.values())
        chosen = [ex.cache[ex._key(c.values)] for c in chosen]
        if spec.mode == "pareto":
            chosen = pareto_front(chosen + [baseline])
    sens = sensitivity(ex, base, baseline.step_time_s) if not interrupted else []
    return {
        "mode": spec.mode,
        "baseline": baseline.to_dict(),
        "frontier" if spec.mode == "pareto" else "best": [c.to_dict() for c in chosen],
        "candidates_evaluated": len(ex.cache),
        "all": [{"values": c.values, "cost_per_gpu": c.cost_per_gpu, spec.metric: c.step_time_s} for c in cands],
        "objective": spec.objective, "metric": spec.metric,
        "sensitivity": sens,
        "interrupted": interrupted,
    }
