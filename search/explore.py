"""Hardware design-space exploration: how fast would training be on a GPU or network that does
not exist yet, and what is it worth?

For each hardware candidate the step time is that of the best parallelization on it (a nested
search). Work is reused across candidates: the workload graphs do not depend on the hardware
(each parallelization is synthesized once), and the inner search is seeded by the baseline's
best configurations, re-checked (memory, domains) and re-simulated on the candidate; frontier
points are then confirmed by a full inner search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stage_cosim.errors import UserError
from stage_cosim.files import read_yaml
from stage_cosim.hardware.cluster import Cluster, cluster_from
from stage_cosim.hardware.network import SCALE_OUT_TOPOLOGIES
from stage_cosim.model import ModelConfig, resolve_model
from stage_cosim.search.evaluate import Objective, workload_of
from stage_cosim.search.optimize import OptimizeSettings, _key as _point_key, optimize
from stage_cosim.parallel.config import PRECISION_FIELDS, ParallelConfig
from stage_cosim.search.runner import run_job
from stage_cosim.search.space import check, default_space

PARTS = ("gpu", "scale_up", "scale_out")
# Variables whose values are choices, not magnitudes, with the choices
CHOICES: dict[str, tuple] = {"scale_out.topology": SCALE_OUT_TOPOLOGIES, "scale_out.in_network_reduction": (False, True)}
# Numeric variables that only take a grid, and why
GRID_ONLY = {"scale_out.switch_radix": "switches come in whole, even port counts"}
MODES = ("pareto", "budget")


@dataclass(frozen=True)
class Variable:
    """A numeric hardware field (``gpu.hbm_GBps``, ``scale_up.gpus_per_domain`` …)."""

    name: str
    low: float | None = None
    high: float | None = None
    values: tuple[float, ...] | None = None     # a grid instead of a range
    integer: bool = False
    # the values are choices (a topology's name, a switch on or off), not magnitudes: no
    # elasticity, the sensitivity lists each alternative's objective instead
    choice: bool = False

    @property
    def part(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.name.split(".", 1)[1]

    def bounds(self) -> tuple[float, float]:
        if self.values is not None:
            return 0.0, float(len(self.values) - 1)
        return float(self.low), float(self.high)  # type: ignore[arg-type]

    def decode(self, x: float) -> Any:
        if self.values is not None:
            return self.values[int(round(min(max(x, 0), len(self.values) - 1)))]
        v = min(max(x, self.low), self.high)  # type: ignore[type-var]
        return int(round(v)) if self.integer else float(v)


@dataclass(frozen=True)
class ExploreSpec:
    model: ModelConfig
    baseline: Cluster
    global_batch: int
    seq_len: int
    variables: tuple[Variable, ...]
    unit_cost: dict[str, float]          # $ per GPU per unit of each variable
    base_cost: float                     # $ per GPU for everything not varied
    mode: str = "pareto"
    budget: float | None = None          # $ per GPU (budget mode)
    points: int = 6                      # budget levels traced on the frontier
    inner_budget: int = 60               # simulations of a full inner search
    # simulations of the baseline's own search; None: what 'stage-cosim optimize' does without
    # --budget (exhaustive where the space is small, else its default budget), so the baseline is
    # the answer optimize gives on the same hardware
    baseline_budget: int | None = None
    reuse_top: int = 12                  # baseline configurations re-tried on each candidate
    candidates: int = 60                 # hardware candidates per scipy run
    seed: int = 0
    # the training precision of every inner search (dtype bf16, fp8 or auto, and FP8 options):
    # with fp8, gpu.fp8_tflops is a variable like any other
    precision: dict[str, Any] = field(default_factory=dict)
    # What a candidate is judged by (OBJECTIVES): a training step, or serving (its settings in
    # ``serving``)
    objective: str = "step-time"
    serving: dict[str, Any] = field(default_factory=dict)
    # unit prices of the scale-out network (hardware.fabric.PRICE_KEYS): a candidate's cost
    # then includes its network's switches, NICs, optics and cables, counted from its topology
    network_cost: dict[str, Any] | None = None

    @property
    def metric(self) -> str:
        """The result key of the objective's value (lower is better)."""
        return METRICS[self.objective]


def _num(doc: dict, key: str, where: str) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"{where}.{key}", f"must be a number, got {v!r}")
    return float(v)


PRECISION_KEYS = PRECISION_FIELDS
SPEC_KEYS = frozenset({"model", "model_config", "baseline", "global_batch", "seq_len", "variables", "cost",
                       "network_cost", "mode",
                       "budget", "points", "inner_budget", "baseline_budget", "reuse_top", "candidates", "seed", "objective", "serving",
                       *PRECISION_KEYS})
# Objectives: a training step's time; serving: the decode throughput of the best serving layout
# (as seconds per output token per GPU), or its goodput under SLOs (as GPU-seconds per request)
OBJECTIVES = ("step-time", "decode-throughput", "goodput")
METRICS = {"step-time": "step_time_s", "decode-throughput": "gpu_seconds_per_token",
           "goodput": "gpu_seconds_per_request"}
# The serving settings each serving objective takes (``serving:`` in the spec).
SERVING_KEYS = {"decode-throughput": {"batch_per_gpu", "context_len", "weight_dtype", "kv_cache_dtype"},
                "goodput": {"slo_ttft", "slo_tpot", "attainment", "input_len", "output_len", "lengths",
                            "length_spread", "num_requests", "chunk_tokens", "weight_dtype", "kv_cache_dtype"}}


def load_spec(path: Path) -> ExploreSpec:
    return spec_from_dict(read_yaml(path, "spec"), str(path))


def spec_from_dict(doc: object, where: str = "spec") -> ExploreSpec:
    """An ExploreSpec from the content of an explore YAML file."""
    if not isinstance(doc, dict):
        raise UserError("spec", f"{where}: expected a mapping")
    for k in doc:
        if k not in SPEC_KEYS:
            raise UserError(k, f"is not an explore setting (settings: {', '.join(sorted(SPEC_KEYS))})")
    objective = doc.get("objective", "step-time")
    if objective not in OBJECTIVES:
        raise UserError("objective", f"must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    training = objective == "step-time"
    for k in ("baseline", "variables") + (("global_batch", "seq_len") if training else ()):
        if k not in doc:
            raise UserError(k, "is required in the explore spec" + ("" if training else f" (objective {objective})"))
    serving = doc.get("serving") or {}
    if training and serving:
        raise UserError("serving", "sets a serving objective's workload; the objective is step-time")
    if not training:
        if not isinstance(serving, dict):
            raise UserError("serving", "must map serving settings to values")
        for k in serving:
            if k not in SERVING_KEYS[objective]:
                raise UserError(f"serving.{k}", f"is not a {objective} setting (settings: "
                                                f"{', '.join(sorted(SERVING_KEYS[objective]))})")
        for k in ("global_batch", "seq_len", *PRECISION_KEYS):
            if k in doc:
                raise UserError(k, f"is a training setting; the objective is {objective}")
    if "model" not in doc and "model_config" not in doc:
        raise UserError("model", "is required in the explore spec (a preset, a config.json, or model_config)")
    baseline = cluster_from(doc["baseline"])     # a preset, a YAML file, or the description itself
    variables = []
    if not isinstance(doc["variables"], dict) or not doc["variables"]:
        raise UserError("variables", "must map field names to {min, max} or {values: [...]}")
    for name, v in doc["variables"].items():
        part, _, fld = str(name).partition(".")
        if part not in PARTS or not fld:
            raise UserError(f"variables.{name}", f"must be <part>.<field> with part in {', '.join(PARTS)}")
        current = getattr(getattr(baseline, part), fld, None)
        if not isinstance(v, dict):
            raise UserError(f"variables.{name}", "must be {min, max} or {values: [...]}")
        if name in CHOICES:
            vals = v.get("values")
            if set(v) != {"values"} or not isinstance(vals, list) or not vals or any(
                    x not in CHOICES[name] or type(x) is not type(CHOICES[name][0]) for x in vals):
                raise UserError(f"variables.{name}.values", f"must be a non-empty list of choices from "
                                f"{', '.join(map(str, CHOICES[name]))}")
            variables.append(Variable(name, values=tuple(dict.fromkeys(vals)), choice=True))
            continue
        if isinstance(current, bool) or not isinstance(current, (int, float)):
            raise UserError(f"variables.{name}", "is not a numeric field of the baseline cluster"
                            + (" (a list per tier cannot vary: give one number)" if isinstance(current, tuple) else ""))
        if name in GRID_ONLY and "values" not in v:
            raise UserError(f"variables.{name}", f"takes a grid ({{values: [...]}}): {GRID_ONLY[name]}")
        integer = isinstance(current, int)
        if "values" in v:
            vals = v["values"]
            if not isinstance(vals, list) or not vals or not all(isinstance(x, (int, float)) for x in vals):
                raise UserError(f"variables.{name}.values", "must be a non-empty list of numbers")
            variables.append(Variable(name, values=tuple(sorted(vals)), integer=integer))
        else:
            lo, hi = _num(v, "min", f"variables.{name}"), _num(v, "max", f"variables.{name}")
            if not 0 < lo < hi:
                raise UserError(f"variables.{name}", f"needs 0 < min < max, got {lo}, {hi}")
            variables.append(Variable(name, lo, hi, integer=integer))
    network_cost = doc.get("network_cost")
    if network_cost is not None:
        from stage_cosim.hardware.fabric import check_prices, count

        network_cost = check_prices(network_cost)
        count(baseline)           # (a network with no switches to price: said here, once)
    elif any(v.part == "scale_out" and v.field in ("topology", "switch_radix", "planes") for v in variables):
        raise UserError("network_cost", "is required to vary the network's structure (its prices make "
                                        "one design cost more than another)")
    cost = doc.get("cost") or {}
    if not isinstance(cost, dict):
        raise UserError("cost", "must map variable names (and 'base') to $ per GPU per unit")
    unit = {}
    for k, c in cost.items():
        if k != "base" and k not in {v.name for v in variables}:
            raise UserError(f"cost.{k}", "prices a field that is not a variable")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0:
            raise UserError(f"cost.{k}", f"must be a non-negative number, got {c!r}")
        if k != "base":
            unit[k] = float(c)
    mode = doc.get("mode", "pareto")
    if mode not in MODES:
        raise UserError("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "budget" and not isinstance(doc.get("budget"), (int, float)):
        raise UserError("budget", "the budget mode needs budget ($ per GPU)")
    if doc.get("budget") is not None:
        b = doc["budget"]
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise UserError("budget", f"must be a positive number of $ per GPU, got {b!r}")
    ints = {}
    for k in ("global_batch", "seq_len", "points", "inner_budget", "baseline_budget", "reuse_top", "candidates", "seed"):
        if k in doc:
            val = doc[k]
            if isinstance(val, bool) or not isinstance(val, int) or (val <= 0 and k != "seed"):
                raise UserError(k, f"must be a positive integer, got {val!r}")
            ints[k] = val
    if doc.get("model_config") is not None:
        from stage_cosim.model.hf import model_from_hf_dict

        model = model_from_hf_dict(doc["model_config"], "model_config")
    else:
        model = resolve_model(str(doc["model"]))
    precision = {k: doc[k] for k in PRECISION_KEYS if k in doc}
    # checked here, in one line, rather than in the middle of a search
    if training:
        default_space(model, baseline, ints.get("global_batch", 1), ints.get("seq_len", 1), precision=precision)
        _check_baseline_precision(precision, baseline)
    else:
        from stage_cosim.search.serving import serving_inner

        serving_inner(objective, model, serving)
        ints.setdefault("global_batch", 1)
        ints.setdefault("seq_len", 1)
    return ExploreSpec(model, baseline, variables=tuple(variables), unit_cost=unit,
                       base_cost=float(cost.get("base", 0.0)), mode=mode,
                       budget=float(doc["budget"]) if doc.get("budget") is not None else None,
                       precision=precision, objective=objective, serving=dict(serving),
                       network_cost=network_cost, **ints)


def _check_baseline_precision(precision: dict[str, Any], baseline: Cluster) -> None:
    """FP8 options need dtype fp8 (or auto), and a fixed fp8 must run on the baseline's GPU (its
    recipe included): said here, not as "no parallelization fits" after a search."""
    from stage_cosim.graph.precision import resolve_precision

    opts = {k: v for k, v in precision.items() if k != "dtype" and v is not None}
    dtype = precision.get("dtype") or "bf16"
    if dtype == "bf16":
        ParallelConfig(dtype="bf16", **opts)
    elif dtype == "fp8":
        resolve_precision(ParallelConfig(dtype="fp8", zero=3, **opts), baseline.gpu)


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
