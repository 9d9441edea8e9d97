"""What a hardware exploration is asked: the hardware fields it varies (ranges, grids, choices),
their prices, the objective a candidate is judged by, and the inner searches' settings; read
from an explore YAML file (or its content, as the bridge receives it) and checked in full before
any search starts, so that a bad spec fails in one line rather than in the middle of a search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stage_cosim.errors import UserError
from stage_cosim.files import read_yaml
from stage_cosim.hardware.cluster import Cluster, cluster_from
from stage_cosim.hardware.network import SCALE_OUT_TOPOLOGIES
from stage_cosim.model import ModelConfig, resolve_model
from stage_cosim.parallel.config import PRECISION_FIELDS, ParallelConfig
from stage_cosim.search.space import default_space

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
