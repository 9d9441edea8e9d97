"""Find the best parallelization: exact enumeration when the space is small, branch and bound
when it is larger, scipy when it is too large even to bound or a budget is set.

* Every point is first checked against the structural rules (divisibility, domain, batch);
  those checks are free and are counted by reason.
* If the structurally feasible points are few enough, all are evaluated: the answer is the
  proven optimum of the space. (The serving search settles some by proving them below its top
  list part-way through their evaluation: :meth:`Problem.exhaust`.)
* Otherwise, without a budget, every feasible point gets a lower bound on its step time (its
  busiest stage's kernels, :mod:`stage_cosim.search.bound`), and the points are evaluated in the
  order of their bounds until the next bound cannot beat (or tie) the best score found: the
  answer is again the proven optimum, and the points never simulated are counted as ruled out
  by their bound (or, checked first, by memory).
* Otherwise ``scipy.optimize.differential_evolution`` searches the index encoding of the space
  (one integer per dimension, ``integrality``), with a seed and a budget of simulations. The
  population is evaluated as one batch (``vectorized``, deferred updating), so the answer does
  not depend on how many workers share the batch. A space too large to bound starts it from the
  best-bounded points of a sample.
* Evaluations are cached by configuration: nothing is simulated twice.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from stage_cosim.hardware.cluster import Cluster
from stage_cosim.hardware.runtime import DEFAULT_HEADROOM
from stage_cosim.search.evaluate import MEMORY_REASON, OBJECTIVES, Evaluation, Objective, evaluate
from stage_cosim.search.keys import point_key as _key
from stage_cosim.search.runner import Runner, make_runner
from stage_cosim.search.space import SearchSpace, canonical, check

PENALTY = 1e12      # score of an infeasible point (its structural rank keeps DE moving)
DEFAULT_BUDGET = 300


@dataclass
class OptimizeSettings:
    objective: Objective = field(default_factory=Objective)
    seed: int = 0
    # simulations; None: the proven optimum (exhaustive if small, else branch and bound), or
    # DEFAULT_BUDGET beyond bound_limit
    budget: int | None = None
    exhaustive_limit: int = 1500        # enumerate when at most this many points are feasible
    # without a budget, branch and bound when at most this many points are feasible (each gets a
    # lower bound); beyond it, differential evolution started from the best-bounded points
    bound_limit: int = 200_000
    workers: int = 1
    ray: str | None = None
    top_k: int = 5
    # fraction of HBM kept free beyond the modelled memory (its runtime share included)
    headroom: float = DEFAULT_HEADROOM
    network_model: str = "calibrated"
    allow_cross_domain_tp: bool = False
    # Start from these points and only polish locally (a nested search warm-started by an
    # outer one), instead of exploring the whole space.
    seeds: tuple[dict[str, Any], ...] = ()


@dataclass
class OptimizeResult:
    objective: Objective
    evaluated: list[Evaluation]
    proven_optimal: bool
    infeasible: dict[str, int]
    space_size: int
    method: str
    interrupted: bool = False
    top_k: int = 5
    feasible: int | None = None     # distinct structurally feasible points of the space (None: not counted)
    # branch and bound's counts (feasible, bounded, simulated, pruned_by_memory, pruned_by_bound)
    # and the bounds it stopped at; None for another method
    bounds: dict[str, Any] | None = None

    @property
    def ranked(self) -> list[Evaluation]:
        return rank(self.evaluated)

    @property
    def best(self) -> Evaluation | None:
        r = self.ranked
        return r[0] if r else None

    def to_dict(self) -> dict[str, Any]:
        def entry(e: Evaluation) -> dict[str, Any]:
            return {**e.result, "point": e.point, "score": e.score}

        ranked = self.ranked
        by_dtype: dict[str, Any] = {}
        for e in ranked:
            by_dtype.setdefault(e.point.get("dtype") or (e.parallel or {}).get("dtype", "bf16"), e)
        return {
            "best": entry(ranked[0]) if ranked else None,
            # the best configuration of each precision the search was allowed (--dtype auto)
            "best_by_dtype": {d: entry(e) for d, e in sorted(by_dtype.items())},
            "top": [entry(e) for e in ranked[:self.top_k]],
            "proven_optimal": self.proven_optimal,
            "evaluations": len(self.evaluated),
            "infeasible": dict(sorted(self.infeasible.items())),
            "objective": self.objective.name,
            "method": self.method,
            "space_size": self.space_size,
            "interrupted": self.interrupted,
            # structurally feasible configurations never simulated (the infeasible ones do not
            # count: they need no simulation to be ruled out); 0 for a proven optimum
            "feasible": self.feasible,
            "unexplored": 0 if self.proven_optimal or self.feasible is None
            else max(0, self.feasible - len(self.evaluated)),
            # branch and bound: the feasible configurations, each bounded, and how each was
            # settled (simulated, over the memory, or ruled out by its bound); null otherwise
            "branch_and_bound": self.bounds,
        }


# Scores within this relative distance of each other are a tie. The simulator is deterministic,
# so two configurations that do the same work in the same time differ only by the rounding of
# sums taken in another order (some 1e-15 relative); 1e-9 is far above that and far below any
# difference the model resolves (a nanosecond of a one-second step, less than one kernel launch).
TIE = 1e-9


def tied(a: float, b: float) -> bool:
    """Whether two scores (or step times) are a tie: within :data:`TIE` of each other, relative."""
    return abs(a - b) <= TIE * max(abs(a), abs(b))


def _peak_fraction(e: Evaluation) -> float:
    """The share of HBM the configuration's busiest GPU holds (0 where the result has none)."""
    r = e.result or {}
    return r.get("peak_memory_bytes", 0) / r["memory_capacity_bytes"] if r.get("memory_capacity_bytes") else 0.0


def _before(a: Evaluation, b: Evaluation) -> bool:
    """Whether ``a`` ranks before ``b``: :func:`rank`'s order for a pair."""
    if tied(a.score, b.score):
        return (_peak_fraction(a), a.score, _key(a.point)) < (_peak_fraction(b), b.score, _key(b.point))
    return a.score < b.score


def rank(evaluations: Any) -> list[Evaluation]:
    """The feasible evaluations, best first: by score, and among scores tied to within
    :data:`TIE` (relative to the best of the tied run) by more memory headroom, i.e. the lower
    peak fraction of HBM; then by the configuration, so the order never depends on arrival."""
    ordered = sorted((e for e in evaluations if e.feasible), key=lambda e: (e.score, _key(e.point)))
    out: list[Evaluation] = []
    i = 0
    while i < len(ordered):
        lead = ordered[i].score
        j = i + 1
        while j < len(ordered) and tied(ordered[j].score, lead):
            j += 1
        out += sorted(ordered[i:j], key=lambda e: (_peak_fraction(e), e.score, _key(e.point)))
        i = j
    return out


class Problem:
    """What a search searches: the rules a point must meet, one way to write each point, and
    the job that evaluates it. The default problem: training parallelizations."""

    def __init__(self, space: SearchSpace, cluster: Cluster, settings: OptimizeSettings) -> None:
        self.space, self.cluster, self.settings = space, cluster, settings

    def canonical(self, point: dict[str, Any]) -> dict[str, Any]:
        return canonical(self.space, point)

    def check(self, point: dict[str, Any]) -> tuple[Any, str | None]:
        """(the configuration of ``point``, or None and the rule it breaks)."""
        return check(self.space, point, self.cluster, self.settings.allow_cross_domain_tp)

    def job(self, config: Any, point: dict[str, Any]) -> tuple:
        """The runner job that evaluates ``point`` (a module-level function and its arguments)."""
        s = self.settings
        return (evaluate, self.space.model, self.cluster, config, point, s.objective, s.network_model, s.headroom)

    def exhaust(self, search: "_Search", points: list[dict[str, Any]]) -> None:
        """Settle every point of an exhaustive search: here, evaluate each (a problem whose
        points can be proven no better than the best found may skip the rest of their search)."""
        search.evaluate_many(points)


class _Search:
    def __init__(self, space: SearchSpace, cluster: Cluster, settings: OptimizeSettings, runner: Runner,
                 progress: Callable[[dict], None] | None, should_stop: Callable[[], bool] | None,
                 problem: Problem | None = None) -> None:
        self.space, self.cluster, self.settings, self.runner = space, cluster, settings, runner
        self.progress, self.should_stop = progress, should_stop
        self.problem = problem or Problem(space, cluster, settings)
        self.cache: dict[tuple, Evaluation] = {}
        # the best evaluation so far, kept as each arrives: the progress reports it after every
        # evaluation, and ranking the whole cache each time made a search quadratic in its size
        self._best: Evaluation | None = None
        self.budget: int | None = None       # most evaluations; the rest of a batch is skipped
        self.structural: dict[tuple, tuple[Any, str | None]] = {}
        self.reasons: Counter[str] = Counter()
        self.step_bound: Any = None          # the lower bounds' StepBound (its blocks serve the memory check)
        self.compiled_bound: Any = None      # ... and the CompiledBound around it (many configurations at once)

    def canonical(self, point: dict[str, Any]) -> dict[str, Any]:
        return self.problem.canonical(point)

    def structure(self, point: dict[str, Any]) -> tuple[Any, str | None]:
        return self._structure(_key(self.canonical(point)), point)

    def _structure(self, k: tuple, point: dict[str, Any]) -> tuple[Any, str | None]:
        """:meth:`structure` of ``point``, whose canonical form's key is ``k``."""
        hit = self.structural.get(k)
        if hit is None:
            hit = self.structural[k] = self.problem.check(point)
            if hit[1]:
                self.reasons[hit[1]] += 1
        return hit

    def evaluate_many(self, points: list[dict[str, Any]]) -> list[Evaluation | None]:
        """Evaluations in the order given (None for structurally infeasible points)."""
        todo: dict[tuple, tuple[Any, dict[str, Any]]] = {}
        points = [self.canonical(p) for p in points]
        for p in points:
            config, _ = self.structure(p)
            k = _key(p)
            if config is not None and k not in self.cache and k not in todo:
                if self.budget is not None and len(self.cache) + len(todo) >= self.budget:
                    break
                todo[k] = (config, p)
        if todo:
            keys = list(todo)
            jobs = [self.problem.job(config, p) for config, p in todo.values()]
            self.runner.map(jobs, lambda i, ev: self._record(keys[i], ev))
        return [self.cache.get(_key(p)) for p in points]

    def _record(self, key: tuple, ev: Evaluation) -> None:
        self.cache[key] = ev
        if ev.feasible and (self._best is None or _before(ev, self._best)):
            self._best = ev
        if not ev.feasible and ev.reason:
            self.reasons[ev.reason] += 1
        if self.progress is not None:
            b = self.best()
            self.progress({"evaluations": len(self.cache), "best_score": b.score if b else None,
                           "best_point": b.point if b else None})
        if self.should_stop is not None and self.should_stop():
            raise KeyboardInterrupt

    def best(self) -> Evaluation | None:
        return self._best


def optimize(space: SearchSpace, cluster: Cluster, settings: OptimizeSettings | None = None, *,
             progress: Callable[[dict], None] | None = None,
             should_stop: Callable[[], bool] | None = None, problem: Problem | None = None) -> OptimizeResult:
    """The best configuration of ``space`` on ``cluster``. When the space leaves the precision
    to the search (a ``dtype`` dimension) and is too large to enumerate, each precision is
    searched on its own, with the whole budget, so that both best configurations are real
    optima of their part of the space rather than whatever one search happened to visit."""
    settings = settings or OptimizeSettings()
    dtypes = next((d.choices for d in space.dimensions if d.name == "dtype"), ())
    if len(dtypes) > 1 and problem is None and not _enumerable(space, cluster, settings):
        parts = [_optimize(space.restricted("dtype", d), cluster, settings, progress, should_stop) for d in dtypes]
        reasons: Counter[str] = Counter()
        for r in parts:
            reasons.update(r.infeasible)
        bounds = [r.bounds for r in parts if r.bounds is not None]
        return OptimizeResult(settings.objective, [e for r in parts for e in r.evaluated],
                              all(r.proven_optimal for r in parts), dict(reasons), space.size,
                              f"{parts[0].method}, per dtype", any(r.interrupted for r in parts), settings.top_k,
                              None if any(r.feasible is None for r in parts) else sum(r.feasible for r in parts),
                              _merged(bounds) if bounds else None)
    return _optimize(space, cluster, settings, progress, should_stop, problem)


def _feasible(search: "_Search") -> list[dict[str, Any]]:
    """The distinct structurally feasible points of the search's space."""
    unique: dict[tuple, dict[str, Any]] = {}
    for p in search.space.points():
        c = search.canonical(p)
        unique.setdefault(_key(c), c)
    # (each canonical point keyed once: the space has some 200,000 points)
    return [p for k, p in unique.items() if search._structure(k, p)[0] is not None]


def _small_enough(n: int, settings: OptimizeSettings) -> bool:
    """Whether ``n`` feasible points are all simulated (the answer is then the proven optimum)."""
    return n <= settings.exhaustive_limit and (settings.budget is None or settings.budget >= n)


def _merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Branch-and-bound counts of searches of parts of a space, added up (the lowest bound the
    lowest, the bound stopped at the highest)."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if isinstance(v, int) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            elif v is not None:
                out[k] = v if out.get(k) is None else (min if k == "lowest_bound" else max)(out[k], v)
            else:
                out.setdefault(k, None)
    return out


def _boundable(search: "_Search") -> bool:
    """Whether the search's points have lower bounds: the training problem (not a caller's
    own), under an objective that grows with the step time."""
    return type(search.problem) is Problem and search.settings.objective.name in OBJECTIVES


def _enumerable(space: SearchSpace, cluster: Cluster, settings: OptimizeSettings) -> bool:
    from stage_cosim.search.runner import SerialRunner

    return _small_enough(len(_feasible(_Search(space, cluster, settings, SerialRunner(), None, None))), settings)


def _optimize(space: SearchSpace, cluster: Cluster, settings: OptimizeSettings,
              progress: Callable[[dict], None] | None, should_stop: Callable[[], bool] | None,
              problem: Problem | None = None) -> OptimizeResult:
    runner = make_runner(settings.workers, settings.ray)
    search = _Search(space, cluster, settings, runner, progress, should_stop, problem)
    interrupted = False
    bounds: dict[str, Any] | None = None
    try:
        feasible = _feasible(search)
        exhaustive = _small_enough(len(feasible), settings)
        bounded = (not exhaustive and not settings.seeds and settings.budget is None and _boundable(search)
                   and len(feasible) <= settings.bound_limit)
        if settings.seeds and not exhaustive:
            method = "local search from seeds"
        else:
            method = "exhaustive" if exhaustive else "branch_and_bound" if bounded else "differential_evolution"
        try:
            if exhaustive:
                search.problem.exhaust(search, feasible)
            elif bounded:
                bounds = {}
                _branch_and_bound(search, feasible, bounds)
            elif settings.seeds:
                budget = settings.budget or DEFAULT_BUDGET
                search.budget = budget
                search.evaluate_many(list(settings.seeds))
                _local_search(search, budget)
            else:
                budget = settings.budget or DEFAULT_BUDGET
                # a space too large to bound starts from the best-bounded points of a sample
                warm = (_warm_start(search, feasible) if settings.budget is None and _boundable(search)
                        and len(feasible) > settings.bound_limit else [])
                # scipy explores; a discrete local search around the best polishes the answer
                _differential_evolution(search, max(1, int(budget * 0.6)), warm)
                _local_search(search, budget)
        except KeyboardInterrupt:
            interrupted = True
    finally:
        runner.close()
    proven = (exhaustive or bounds is not None) and not interrupted
    return OptimizeResult(settings.objective, list(search.cache.values()), proven, dict(search.reasons), space.size,
                          method, interrupted, settings.top_k, len(feasible), bounds)


# Points bounded to warm-start differential evolution on a space too large to bound whole.
WARM_SAMPLE = 2000


# Configurations bounded at once between progress reports (and checks for a stop).
BOUND_SHARE = 512


def _compiled_bound(search: _Search) -> Any:
    """The search's :class:`~stage_cosim.search.compiled.CompiledBound` (made once; its
    StepBound's blocks serve the memory check)."""
    from stage_cosim.search.compiled import CompiledBound

    if search.compiled_bound is None:
        search.compiled_bound = CompiledBound(search.space.model, search.cluster, search.settings.network_model,
                                              bound=search.step_bound, software=search.space.fixed.get("software"))
        search.step_bound = search.compiled_bound.bound
    return search.compiled_bound


def _bounded(search: _Search, points: list[dict[str, Any]], stats: dict[str, Any] | None = None
             ) -> list[tuple[float, tuple, dict[str, Any]]]:
    """(lower bound on the score, key, point) of each point, lowest first. With workers, the
    points go out in shares of configurations compiled alike."""
    from stage_cosim.gc_pause import gc_paused
    from stage_cosim.search.bound import policy_key, score_bound
    from stage_cosim.search.compiled import CompiledBound, bound_many

    space, cluster, settings = search.space, search.cluster, search.settings
    tokens, gpus = space.global_batch * space.seq_len, cluster.num_gpus
    configs = [search.structure(p)[0] for p in points]
    steps: list[float] = [0.0] * len(points)
    if (settings.workers > 1 or settings.ray) and len(points) > 64:
        groups: dict[tuple, list[int]] = {}
        for j, par in enumerate(configs):
            groups.setdefault(policy_key(par), []).append(j)
        shares = max(1, settings.workers) * 4 if not settings.ray else 32
        per = max(1, -(-len(points) // shares))
        flat = [j for g in groups.values() for j in g]
        chunks = [flat[k:k + per] for k in range(0, len(flat), per)]
        done = [0]

        def got(i: int, values: list[float]) -> None:
            for j, v in zip(chunks[i], values):
                steps[j] = v
            done[0] += len(values)
            if stats is not None:
                stats["bounded"] = done[0]
            if search.should_stop is not None and search.should_stop():
                raise KeyboardInterrupt

        search.runner.map([(bound_many, space.model, cluster, [configs[j] for j in c], settings.network_model)
                           for c in chunks], got)
    else:
        compiled = _compiled_bound(search)
        # each group's configurations in one share, alike groups one after the other (the
        # bound keeps only the latest groups: CompiledBound.order)
        order = CompiledBound.order(configs)
        # (the cycle collector paused over every share, not share by share: each share's end
        # set off a full collection of the bounds' caches, 10 % of the bounds' time)
        with gc_paused():
            for j in range(0, len(order), BOUND_SHARE):
                if search.should_stop is not None and search.should_stop():
                    raise KeyboardInterrupt
                share = order[j:j + BOUND_SHARE]
                for i, v in zip(share, compiled([configs[i] for i in share]).tolist()):
                    steps[i] = v
                if stats is not None:
                    stats["bounded"] = min(len(configs), j + BOUND_SHARE)
    out = [(score_bound(settings.objective, t, tokens, gpus), _key(p), p) for t, p in zip(steps, points)]
    out.sort(key=lambda x: (x[0], x[1]))
    return out


def _branch_and_bound(search: _Search, feasible: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Evaluate the feasible points in the order of their lower bounds until the next bound
    cannot beat the lowest score found, nor tie it (:func:`rank`'s ties go by memory headroom,
    so a tied point must be simulated too): every point left has a score above the best's.

    ``stats`` gets the counts, as they stand when the search ends or is interrupted."""
    stats.update(feasible=len(feasible), bounded=0, simulated=0, pruned_by_memory=0, pruned_by_bound=0,
                 lowest_bound=None, stopped_at_bound=None)
    order = _bounded(search, feasible, stats)
    stats["lowest_bound"] = order[0][0] if order else None
    batch = max(1, search.settings.workers) if not search.settings.ray else 8
    lowest: float | None = None

    def ruled_out(b: float) -> bool:
        return lowest is not None and b > lowest and not tied(b, lowest)

    i = 0
    try:
        while i < len(order) and not ruled_out(order[i][0]):
            take = []
            while i < len(order) and len(take) < batch and not ruled_out(order[i][0]):
                take.append(order[i][2])
                i += 1
            for e in search.evaluate_many(_memory_checked(search, take)):
                if e is None:
                    continue
                if e.feasible:
                    stats["simulated"] += 1
                    lowest = e.score if lowest is None else min(lowest, e.score)
                elif e.reason == MEMORY_REASON:
                    stats["pruned_by_memory"] += 1
    finally:
        stats["pruned_by_bound"] = len(order) - i
        stats["stopped_at_bound"] = order[i][0] if i < len(order) else None


def _memory_checked(search: _Search, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``points`` (canonical), each one over the memory recorded as ``evaluate`` records it,
    without synthesizing it: its peak from the blocks its bound was computed from
    (:mod:`stage_cosim.search.memory`, the same figure to the byte). All are returned, so
    the caller counts them as it counts any evaluation."""
    from stage_cosim.search.bound import StepBound
    from stage_cosim.search.memory import fits

    space, cluster = search.space, search.cluster
    bound = search.step_bound = search.step_bound or StepBound(space.model, cluster, search.settings.network_model,
                                                               space.fixed.get("software"))
    for p in points:
        k = _key(p)
        par = search._structure(k, p)[0]
        if par is None or k in search.cache:
            continue
        if not fits(space.model, cluster, par, *bound.blocks(par), headroom=search.settings.headroom):
            search._record(k, Evaluation(p, par.to_dict(), False, MEMORY_REASON, None, None))
    return points


def _warm_start(search: _Search, feasible: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best-bounded points of an even sample of at most :data:`WARM_SAMPLE` feasible points."""
    step = max(1, len(feasible) // WARM_SAMPLE)
    return [p for _, _, p in _bounded(search, feasible[::step][:WARM_SAMPLE])]


def _differential_evolution(search: _Search, budget: int, warm: list[dict[str, Any]] = ()) -> None:
    """``warm``: points, best first, that start in the initial population (half of it at most)."""
    from scipy.optimize import differential_evolution

    space = search.space
    dims = space.dimensions
    bounds = [(0, len(d.choices) - 1) for d in dims]

    def objective(x: np.ndarray) -> np.ndarray:
        # x: (n_dims, S) — the whole population at once (vectorized)
        cols = np.atleast_2d(x)
        points = [space.point(np.rint(cols[:, j]).astype(int)) for j in range(cols.shape[1])]
        evals = search.evaluate_many(points)
        out = []
        for p, e in zip(points, evals):
            if e is None or not e.feasible:
                # infeasible: penalized, ranked by how far the degrees overshoot (a gentle slope)
                out.append(PENALTY * (1 + sum(np.log2(float(p[k])) for k in ("tp", "pp") if k in p)))
            else:
                out.append(e.score)
        return np.array(out)

    def stop(*_args: Any, **_kw: Any) -> bool:
        return len(search.cache) >= budget

    search.budget = budget
    popsize = max(5, min(15, budget // (4 * len(dims)) or 5))
    init: Any = "sobol"
    if warm:
        from scipy.stats import qmc

        size = popsize * len(dims)
        index = {d.name: {str(c): j for j, c in enumerate(d.choices)} for d in dims}
        rows = []
        for p in warm:
            if len(rows) >= size // 2:
                break
            # a choice that means nothing in context was collapsed (canonical): any one will do
            row = [index[d.name].get(str(p.get(d.name)), 0) for d in dims]
            if _key(search.canonical(space.point(row))) == _key(p):
                rows.append(row)
        need = size - len(rows)
        sample = qmc.Sobol(len(dims), seed=search.settings.seed).random_base2(max(0, math.ceil(math.log2(need))))[:need]
        init = np.vstack([np.array(rows, dtype=float).reshape(-1, len(dims)),
                          sample * np.array([hi for _, hi in bounds], dtype=float)])
    differential_evolution(objective, bounds, integrality=[True] * len(dims), seed=search.settings.seed,
                           popsize=popsize, maxiter=10_000, polish=False, vectorized=True, updating="deferred",
                           callback=stop, tol=0, atol=0, init=init)


# The settings that trade time for memory. A move that does not fit in memory is tried again
# with each other setting of these: one step alone cannot cross a memory wall that the search
# must cross with two (a larger micro-batch fits only with the optimizer state sharded further).
MEMORY_DIMENSIONS = ("zero", "recompute")


def _local_search(search: _Search, budget: int) -> None:
    """Steepest descent over single-dimension moves (and, where a move does not fit in memory,
    that move paired with a change of a memory setting), from the best point and then from the
    next best ones not yet polished, until the budget is spent or every point is a polished one."""
    search.budget = budget
    dims = search.space.dimensions
    polished: set[tuple] = set()
    while len(search.cache) < budget:
        ranked = rank(search.cache.values())
        start = next((e for e in ranked if _key(e.point) not in polished), None)
        if start is None:
            return
        current = start
        while len(search.cache) < budget:
            polished.add(_key(current.point))
            neighbours = [search.canonical({**current.point, d.name: c})
                          for d in dims for c in d.choices if c != current.point[d.name]]
            fresh = [p for p in neighbours if _key(p) not in search.cache and search.structure(p)[0] is not None]
            search.evaluate_many(fresh)
            too_big = [e.point for e in map(search.cache.get, map(_key, neighbours))
                       if e is not None and e.reason == MEMORY_REASON]
            paired = {_key(q): q for p in too_big for d in dims if d.name in MEMORY_DIMENSIONS
                      for q in [search.canonical({**p, d.name: c}) for c in d.choices if c != p[d.name]]}
            fresh = [q for k, q in paired.items() if k not in search.cache and search.structure(q)[0] is not None]
            search.evaluate_many(fresh)
            neighbours += list(paired.values())
            # every neighbour simulated, now or before, is in the cache
            known = [search.cache[_key(p)] for p in neighbours if _key(p) in search.cache]
            better = [e for e in known if e.feasible and e.score < current.score]
            if not better:
                break
            current = rank(better)[0]
        if len(search.cache) >= budget:
            return
