"""The best serving layout for a cluster: the most goodput per GPU under latency targets (or,
for hardware exploration, the most decode throughput per GPU).

A point is a serving layout: tensor and pipeline parallelism of an instance, for a model with
experts its expert parallelism and attention data-parallel ranks, the engine's batch limit,
and whether prompts and decodes run on separate pools (and in what ratio). Its score is its
**goodput per GPU**: the highest arrival rate at which at least ``attainment`` of the requests
meet every SLO (DistServe's definition), over the GPUs it takes.

Instances do not interact (requests are spread over them), so a layout is simulated on its
smallest unit — one instance, or the prefill and decode instances of one ratio — and the
cluster's GPU count only decides which layouts fit it (the count must be a multiple of the
unit). Each rate is judged on ``num_requests`` Poisson arrivals; above the unit's capacity
their queue grows through the run and the SLOs fail for its later part, so the search finds the
highest rate a run of that many requests sustains. Meeting the SLOs is not enough: a probe
too short to reach the rate's steady state (a burst of few requests that the batch absorbs
before any queue builds), or whose completions fall behind its arrivals, has not shown its rate
(:mod:`stage_cosim.search.sustained`); a layout's ``limited_by`` says what failed at its lowest failing rate.

Where the feasible layouts are few enough to settle them all, the answer is proven optimal
without simulating each to its edge: a layout whose rate search has failed at a rate below the
goodput of the layouts already in the top list cannot join it (see
:meth:`ServingProblem.exhaust`), and such a layout's search begins with the one probe whose
failure proves it (:func:`upward_run`), a rate far enough above its capacity that the probe ends
within its first requests.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Sequence

from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.inference.config import InferenceConfig
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.search.evaluate import Evaluation
from stage_cosim.search.space import Dimension, SearchSpace, powers_of_two
from stage_cosim.search.sustained import SLO_LIMIT, shortfall
from stage_cosim.serving.config import SLO, ServingConfig
from stage_cosim.serving.requests import RequestStream

if TYPE_CHECKING:
    from stage_cosim.search.optimize import OptimizeResult

SPLITS = ("none", "1:1", "1:2", "1:3", "2:1")      # prefill:decode instances of a disaggregated unit
MAX_NUM_SEQS = (32, 64, 128, 256, 512)
BISECTIONS = 5                                       # the rate to within 2^-5 of its bracket
PROBES = 24                                          # most probes before the bisection
GROWTH = 1.5                                         # the rate's step up while the SLOs hold


@dataclass(frozen=True)
class ServeTarget:
    """What a layout is judged by: the request mix (its rate is searched) and the SLOs."""

    stream: RequestStream
    slo: SLO
    attainment: float = 0.9
    inference: InferenceConfig = InferenceConfig("decode")
    serving: ServingConfig = ServingConfig()

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise UserError("attainment", f"must be in (0, 1], got {self.attainment!r}")
        if self.slo.ttft_s is None and self.slo.tpot_s is None:
            raise UserError("slo-ttft", "serving layouts are ranked by goodput under SLOs: give --slo-ttft "
                                        "and/or --slo-tpot")


def serving_space(model: ModelConfig, cluster: Cluster, overrides: dict[str, Sequence[Any]] | None = None
                  ) -> SearchSpace:
    """tp within a scale-up domain, pp, the batch limit, disaggregation; for a model with
    experts also ep, expert_tp and attention data-parallel ranks (adp)."""
    n = cluster.num_gpus
    domain = min(n, cluster.domain)
    dims: dict[str, tuple[Any, ...]] = {
        "tp": tuple(t for t in powers_of_two(min(domain, model.heads)) if model.kv_heads % t == 0 or t % model.kv_heads == 0),
        "pp": tuple(p for p in powers_of_two(min(n, model.layers, 8))),
        "max_num_seqs": MAX_NUM_SEQS,
        "split": SPLITS,
    }
    if model.is_moe:
        dims["ep"] = tuple(e for e in powers_of_two(min(n, model.num_experts)) if model.num_experts % e == 0)
        dims["expert_tp"] = powers_of_two(domain)
        dims["adp"] = powers_of_two(n)
    for name, values in (overrides or {}).items():
        if name not in dims:
            raise UserError(name, f"is not a serving search dimension (dimensions: {', '.join(dims)})")
        dims[name] = tuple(values)
    return SearchSpace(model, n, 1, 1, tuple(Dimension(k, v) for k, v in dims.items()))


def canonical(point: dict[str, Any]) -> dict[str, Any]:
    p = dict(point)
    if p.get("ep", 1) == 1 and "expert_tp" in p:
        p["expert_tp"] = p.get("tp", 1)
    return p


def _unit(point: dict[str, Any]) -> tuple[int, int]:
    """(prefill, decode) instances of a layout's unit; (1, 0): one instance doing both."""
    split = point.get("split", "none")
    if split == "none":
        return 1, 0
    p, d = (int(x) for x in split.split(":"))
    return p, d


def layout(space: SearchSpace, point: dict[str, Any], cluster: Cluster, target: ServeTarget
           ) -> tuple[dict[str, Any] | None, str | None]:
    """The layout of ``point`` (parallel fields, serving fields, unit GPUs), or the rule it breaks."""
    m = space.model
    tp, pp = point.get("tp", 1), point.get("pp", 1)
    adp = point.get("adp", 1)
    ep, etp = point.get("ep", 1), point.get("expert_tp", tp)
    if m.heads % tp or (m.kv_heads % tp and tp % m.kv_heads) or m.ffn % tp:
        return None, "tp does not divide heads / kv-heads / ffn"
    if pp > m.layers:
        return None, "more pipeline stages than layers"
    instance = tp * pp * adp
    p, d = _unit(point)
    unit = instance * (p + d)
    if space.num_gpus % unit:
        return None, "the unit's GPUs do not divide the cluster's"
    par_kw: dict[str, Any] = dict(tp=tp, pp=pp, dp=adp)
    if m.is_moe:
        par_kw.update(ep=ep, expert_tp=etp)
        if (tp * adp) % (ep * etp):
            return None, "expert-tp * ep does not divide tp * attention ranks"
    elif adp > 1:
        return None, "attention data parallelism needs experts"
    try:
        par = ParallelConfig(**par_kw)
        inference = replace(target.inference, attention_dp=adp > 1)
        inference.parallel(par, m)
    except UserError as exc:
        return None, f"{exc.parameter}: {exc.rule.split(',')[0]}"
    serving = replace(target.serving, max_num_seqs=point.get("max_num_seqs", target.serving.max_num_seqs),
                      chunk_tokens=max(target.serving.chunk_tokens, point.get("max_num_seqs", 0)),
                      prefill_gpus=instance * p if d else None, decode_gpus=instance * d if d else None)
    return {"parallel": par.to_dict(), "attention_dp": adp > 1, "serving": serving.to_dict(), "unit_gpus": unit,
            "instance_gpus": instance}, None


def rule_of(exc: UserError) -> str:
    """The rule a layout broke without that layout's own figures, so that the layouts failing for
    one reason are counted together ("cluster: weights and the largest step's working set per GPU
    leave no KV cache in N of N GiB", not one line per layout)."""
    subject, colon, rest = exc.rule.partition(": ")
    rule = rest if colon and " on tp" in subject else exc.rule      # "<model> on tp2 pp1: ..." names the layout
    rule = re.sub(r"\s*\([^)]*\)", "", rule)                          # "(141.2 GiB)"
    rule = re.sub(r"\d+(?:[.,]\d+)*", "N", rule)
    return f"{exc.parameter}: {rule}"


# Step timers shared by the layouts of one search (a few instance layouts, each with five batch
# limits and several pool ratios): a timer's cache of simulated step shapes is most of what a
# layout's probes cost, and a step's time depends on the instance and the GPUs it is priced on,
# not on the engine's limits. Keyed by everything a timer depends on; the oldest is dropped
# past TIMERS so that a long exploration does not hold every hardware point's.
TIMERS = 32
_timers: dict[tuple, Any] = {}


def _timer(model: ModelConfig, par: ParallelConfig, inference: InferenceConfig, unit: Cluster,
           resolution: float):  # noqa: ANN202 (StepTimer)
    from stage_cosim.serving.instance import attention_dp
    from stage_cosim.serving.steptime import StepTimer

    par = replace(par, dp=par.dp if attention_dp(inference) else 1)     # as instance_kind times it
    # An instance within one scale-up domain never crosses the scale-out fabric, the one thing
    # a cluster's GPU count decides (its tiers' contention): its step times are the same in a
    # unit of any size, so the layouts of every pool ratio share its timer.
    gpus = par.tp * par.pp * par.dp * par.cp
    shared = gpus <= unit.domain
    key = (model, par, inference, resolution, None if shared else unit.num_gpus,
           tuple((f.name, getattr(unit, f.name)) for f in fields(unit) if f.name != "num_gpus"))
    timer = _timers.pop(key, None)
    if timer is None:
        timer = StepTimer(model, par, inference, unit, resolution)
    _timers[key] = timer                                                # most recently used last
    while len(_timers) > TIMERS:
        del _timers[next(iter(_timers))]
    return timer


def _deploy(model: ModelConfig, cluster: Cluster, config: dict[str, Any], target: ServeTarget):  # noqa: ANN202
    """The layout's unit deployed (its instance's step timer shared, see _timer); raises the
    UserError of a layout that does not fit."""
    from stage_cosim.serving.instance import instance_kind
    from stage_cosim.serving.run import deploy

    par = ParallelConfig(**{k: v for k, v in config["parallel"].items()
                            if k in ParallelConfig.__dataclass_fields__})
    serving = ServingConfig(**config["serving"])
    inference = replace(target.inference, attention_dp=config["attention_dp"])
    unit = replace(cluster, num_gpus=config["unit_gpus"])
    kind = instance_kind(model, par, inference, unit, serving,
                         _timer(model, par, inference, unit, serving.step_resolution))
    return deploy(model, par, inference, unit, serving, kind)


def goodput(model: ModelConfig, cluster: Cluster, config: dict[str, Any], point: dict[str, Any],
            target: ServeTarget, num_requests: int, floor: float | None = None) -> Evaluation:
    """Simulate the layout's unit at increasing rates; its goodput per GPU (an Evaluation whose
    score is GPU-seconds per request, the inverse). A probe holds when ``attainment`` of its
    requests meet the SLOs and it reaches a steady state that keeps up with them (:func:`shortfall`).

    ``floor``: a goodput per GPU the layout is only of interest above. Once a probe has failed
    at a rate whose share per GPU is below it, the layout is ruled out (see :func:`ruled_out`)
    and its search ends there. Its first probe is then the highest rate of its upward run under
    the floor (:func:`upward_run`): if that holds, the search goes on from it, every rate it
    probes the one it probes without a floor, and checks the rates under it last. A layout that
    is not ruled out has the goodput it has without one."""
    from stage_cosim.serving.run import simulate_serving

    try:
        dep = _deploy(model, cluster, config, target)
    except UserError as exc:
        return Evaluation(point, config, False, rule_of(exc), None, None)
    unit = dep.cluster
    stream = replace(target.stream, num_requests=num_requests)

    short: dict[float, str] = {}        # rates whose probe met the SLOs without showing the rate sustained

    def run(rate: float) -> dict[str, Any] | None:
        # a probe's report is only needed if it holds: it ends as soon as it cannot hold
        requests = replace(stream, rate=rate).generate()
        report = simulate_serving(dep, requests, target.slo, stop=failed(target, dep.serving.request_overhead_s))
        why = shortfall(requests.arrival_s, report) if ok(report) else None
        if why is not None:
            short[rate] = why
            return None
        return report

    def ok(report: dict[str, Any] | None) -> bool:
        return report is not None and report["slo"]["attainment"] >= target.attainment

    # Start from the unit's capacity with every step full (see first_rate), then grow or shrink
    # the rate by half until the SLOs fail or hold, and bisect between the last rate that held
    # and the first that failed.
    rate = first_rate(dep, target)
    lo, lo_report, hi = 0.0, None, math.inf
    # Once a rate has failed, every rate the search goes on to accept is below it (it halves
    # below a failure, or bisects between a success and the failure above it): the goodput it
    # ends at is under the lowest failure so far, or the layout misses the SLOs at any rate.
    def below_floor() -> bool:
        return floor is not None and hi / unit.num_gpus < floor

    # Below a floor, the search first probes the highest rate of its upward run (the start
    # times 1.5, 2.25, …) still below the floor (see upward_run): if that fails, the layout is
    # ruled out whatever the rates under it do, and a rate far above the unit's capacity fails
    # within the first few requests, where each rate under it that holds is a whole run. If it
    # holds, the search goes on from there as if the rates under it had held, and checks them
    # last, only if nothing rules the layout out before.
    under: list[float] = []
    probes = PROBES
    chain = upward_run(rate, floor, unit.num_gpus) if floor is not None else []
    if chain:
        report = run(chain[-1])
        if not ok(report):
            return ruled_out(point, config, chain[-1] / unit.num_gpus)
        under, lo, lo_report, rate = chain[:-1], chain[-1], report, chain[-1] * GROWTH
        probes -= len(chain)

    for _ in range(probes):
        report = run(rate)
        if ok(report):
            lo, lo_report = rate, report
            if hi < math.inf:
                break
            rate *= GROWTH
        else:
            hi = rate
            if below_floor():
                return ruled_out(point, config, hi / unit.num_gpus)
            if lo_report is not None:
                break
            rate /= 2
            if rate < 1e-4:
                return Evaluation(point, config, False, "misses the SLOs at any rate", None, None)
    for _ in range(BISECTIONS if hi < math.inf and lo_report is not None else 0):
        mid = (lo + hi) / 2
        report = run(mid)
        if ok(report):
            lo, lo_report = mid, report
        else:
            hi = mid
            if below_floor():
                return ruled_out(point, config, hi / unit.num_gpus)
    for r in under:
        if not ok(run(r)):
            return ruled_out(point, config, r / unit.num_gpus)
    if lo_report is None:
        return Evaluation(point, config, False, "misses the SLOs at any rate", None, None)
    per_gpu = lo / unit.num_gpus
    result = {"goodput_requests_per_s_per_gpu": per_gpu, "gpu_seconds_per_request": 1 / per_gpu,
              "rate_per_unit": lo, "unit_gpus": unit.num_gpus,
              "instance_gpus": config["instance_gpus"], "layout": config, "report": lo_report,
              "tokens_per_s_per_gpu": lo_report["throughput"]["output_tokens_per_s_per_gpu"],
              "cluster_goodput_requests_per_s": per_gpu * cluster.num_gpus,
              "limited_by": short.get(hi, SLO_LIMIT) if hi < math.inf else None}
    return Evaluation(point, config, True, None, 1 / per_gpu, result)


def first_rate(dep, target: ServeTarget) -> float:  # noqa: ANN001 (Deployment)
    """The rate a layout's search starts from (requests/s of its unit): its capacity were every
    step full, from two step times of each instance: a chunk of ``chunk_tokens`` prompt tokens,
    and a decode step of as many requests as the batch limit and the KV cache allow, at the
    context of a request halfway through its output. A colocated instance shares its time
    between the two; pools of a disaggregated unit each do one, the slower pool sets the rate.

    An estimate, not a bound: it only decides where the rate search begins (the search grows
    or halves the rate from it until the SLOs fail or hold). It replaces a run of every request
    queued at once, which simulated every step of a whole probe to find a start."""
    from stage_cosim.inference.config import BatchShape
    from stage_cosim.serving.engine import DECODE, PREFILL

    stream = target.stream
    prompt, output = stream.input_len + stream.prefix_len, stream.output_len
    serving = dep.serving
    windows = frozenset(dep.model.layer_windows())
    pools = {}
    for role, kind, count in dep.pools:
        timer, overhead = kind.timer, serving.step_overhead_s
        chunk = serving.chunk_tokens
        prefill = chunk / (prompt * (timer(BatchShape.uniform(1, chunk, 0, windows)) + overhead))
        held = kind.kv.tokens
        batch = serving.max_num_seqs if held is None else max(1, min(serving.max_num_seqs, held // (prompt + output)))
        step = timer(BatchShape.uniform(batch, 1, prompt + output // 2, windows)) + overhead
        decode = batch / (output * step)
        per_rank = prefill if role == PREFILL else decode if role == DECODE else 1 / (1 / prefill + 1 / decode)
        pools[role] = per_rank * kind.ranks * count
    return max(1e-3, min(pools.values()))


def upward_run(start: float, floor: float, gpus: int) -> list[float]:
    """The rates the search probes going up from ``start`` (``start`` times ``GROWTH`` again
    and again, the same products in the same order, within its ``PROBES``) while their share of
    ``gpus`` is below ``floor``; empty where only ``start`` is (the search then runs as it
    does without a floor).

    Why probing the last of them first loses nothing (:func:`goodput`). Without a floor the
    search probes ``start`` and, while the SLOs hold, each next rate of this run, and its
    goodput is below its first failure (every rate it accepts after a failure is below that
    one). If the last rate fails, the first failure comes at or before it, below the floor: the
    layout is ruled out. If it holds, either a rate under it fails (a failure below the floor:
    ruled out), or they all hold and the search without a floor reaches the last rate and goes
    on from it exactly as this one does. So a failure below the floor that this search finds
    from there rules the layout out either way; otherwise it probes the rates under the last
    before it answers, and if they all hold, its goodput is that of the search without a
    floor."""
    run, rate = [start], start
    while len(run) < PROBES and rate * GROWTH / gpus < floor:
        rate *= GROWTH
        run.append(rate)
    return run if len(run) > 1 else []


def ruled_out(point: dict[str, Any], config: dict[str, Any], below: float) -> Evaluation:
    """A layout whose goodput per GPU is proven below ``below``: not ranked (not feasible) and
    with no reason (it breaks no rule); its result says why it was left."""
    return Evaluation(point, config, False, None, None, {"ruled_out_below": below})


def is_ruled_out(e: Evaluation) -> bool:
    return not e.feasible and e.reason is None and "ruled_out_below" in (e.result or {})


def failed(target: ServeTarget, request_overhead_s: float):  # noqa: ANN201
    """``stop`` for a probe run (see Cluster.run): whether, at simulated time ``now``, so many
    requests have certainly missed an SLO that the run's attainment is below the target
    whatever happens next. Every timestamp the engine has still to write is at least ``now``,
    so a request with no first token whose TTFT would already exceed the target misses it, and
    so does one still decoding whose tokens so far already average above the TPOT target; the
    margin covers the rounding of the API server's share that the report adds afterwards."""
    import numpy as np

    ttft, tpot = target.slo.ttft_s, target.slo.tpot_s
    post = request_overhead_s / 2
    margin = 1 + 1e-9

    def stop(log, now: float) -> bool:  # noqa: ANN001 (RequestLog)
        n = len(log.arrival)
        arrival = np.asarray(log.arrival)
        first, finish = np.asarray(log.first_token), np.asarray(log.finish)
        missed = np.asarray(log.rejected) | np.asarray(log.dropped)
        started = ~np.isnan(first)
        if ttft is not None:
            # a first token still to come is at least ``now``; one written, as the report reads it
            seen = np.where(started, first + post, now + post) - arrival
            missed |= seen > ttft * margin
        if tpot is not None:
            out = np.maximum(1, np.asarray(log.output_len) - 1)
            until = np.where(np.isnan(finish), now, finish)
            missed |= started & (np.asarray(log.output_len) > 1) & ((until - first) / out > tpot * margin)
        arrived = arrival <= now
        missed &= arrived
        return (n - int(np.count_nonzero(missed))) / max(1, n) < target.attainment

    return stop


class ServingProblem:
    """The serving search for :func:`stage_cosim.search.optimize.optimize`."""

    def __init__(self, space: SearchSpace, cluster: Cluster, target: ServeTarget, num_requests: int) -> None:
        self.space, self.cluster, self.target, self.num_requests = space, cluster, target, num_requests
        self.floor: float | None = None      # the goodput per GPU a layout must beat to matter

    def canonical(self, point: dict[str, Any]) -> dict[str, Any]:
        return canonical(point)

    def check(self, point: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        """The layout, or the rule it breaks: structural, or a unit that leaves no KV cache
        (found without simulating a request, so that such layouts are not counted as feasible
        layouts to simulate)."""
        config, reason = layout(self.space, point, self.cluster, self.target)
        if config is None:
            return None, reason
        try:
            _deploy(self.space.model, self.cluster, config, self.target)
        except UserError as exc:
            return None, rule_of(exc)
        return config, None

    def job(self, config: dict[str, Any], point: dict[str, Any]) -> tuple:
        return (goodput, self.space.model, self.cluster, config, point, self.target, self.num_requests, self.floor)

    def exhaust(self, search, points: list[dict[str, Any]]) -> None:  # noqa: ANN001 (optimize's _Search)
        """Settle every feasible layout, the likeliest best first (no pipeline, one pool, the
        widest tp: the cheapest to simulate, and the fastest steps), a batch of one per worker
        at a time. A layout searched after ``top_k`` others have a goodput is searched with the
        ``top_k``-th best goodput so far as its floor (see :func:`goodput`): one proven below it
        is ruled out, and neither the best nor any layout of the top ``top_k`` can be one, so
        the answer and its list are those of simulating every layout to the end."""
        settings = search.settings
        k = max(1, settings.top_k)
        batch = 8 if settings.ray else max(1, settings.workers)
        order = sorted(points, key=lambda p: (p.get("pp", 1), p.get("split", "none") != "none", -p.get("tp", 1),
                                              p.get("max_num_seqs", 0), str(sorted(p.items()))))
        try:
            for i in range(0, len(order), batch):
                found = sorted((e.result["goodput_requests_per_s_per_gpu"] for e in search.cache.values()
                                if e.feasible), reverse=True)
                self.floor = found[k - 1] if len(found) >= k else None
                search.evaluate_many(order[i:i + batch])
        finally:
            self.floor = None


def proof(result: OptimizeResult) -> tuple[bool, int | None]:
    """(proven optimal, feasible layouts never settled): one statement, counted as optimize
    counts (distinct canonical layouts, not raw grid points). Every feasible layout settled —
    simulated, or ruled out below the best found (:func:`goodput`'s floor) — is a proof
    whatever method visited them; None: the space was not counted."""
    unexplored = None if result.feasible is None else max(0, result.feasible - len(result.evaluated))
    proven = result.proven_optimal or (unexplored == 0 and not result.interrupted)
    return proven, 0 if proven else unexplored


def optimize_serving(model: ModelConfig, cluster: Cluster, target: ServeTarget, settings, *,  # noqa: ANN001
                     overrides: dict[str, Sequence[Any]] | None = None, num_requests: int = 300,
                     progress=None, should_stop=None) -> dict[str, Any]:  # noqa: ANN001
    """The serving layouts of ``model`` on ``cluster`` ranked by goodput per GPU under the SLOs."""
    from stage_cosim.search.optimize import optimize

    space = serving_space(model, cluster, overrides)
    result = optimize(space, cluster, settings, progress=progress, should_stop=should_stop,
                      problem=ServingProblem(space, cluster, target, num_requests))
    ranked = result.ranked

    def entry(e: Evaluation) -> dict[str, Any]:
        r = dict(e.result or {})
        report = r.pop("report", {})
        r["latency_s"] = report.get("latency_s")
        r["slo"] = report.get("slo")
        r["throughput"] = report.get("throughput")
        return {**r, "point": e.point, "score": e.score}

    proven, unexplored = proof(result)
    ruled = sum(1 for e in result.evaluated if is_ruled_out(e))
    return {"best": entry(ranked[0]) if ranked else None, "top": [entry(e) for e in ranked[:settings.top_k]],
            "proven_optimal": proven, "evaluations": len(result.evaluated) - ruled, "ruled_out": ruled,
            "infeasible": dict(sorted(result.infeasible.items())), "objective": "goodput-per-gpu",
            "method": result.method, "space_size": result.space_size, "interrupted": result.interrupted,
            "unexplored": 0 if proven else unexplored, "feasible": result.feasible,
            "target": {"slo": target.slo.to_dict(), "attainment": target.attainment,
                       "input_len": target.stream.input_len, "output_len": target.stream.output_len,
                       "lengths": target.stream.lengths, "requests_per_probe": num_requests}}


# -- decode throughput (hardware exploration) --------------------------------------------------

@dataclass(frozen=True)
class DecodeTarget:
    """A decode step of ``batch_per_gpu`` requests per GPU at ``context_len``: its throughput
    per GPU is what HBM bandwidth buys."""

    batch_per_gpu: int = 32
    context_len: int = 4096
    inference: InferenceConfig = InferenceConfig("decode")

    def __post_init__(self) -> None:
        for name in ("batch_per_gpu", "context_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UserError(f"serving.{name}", f"must be a positive integer, got {v!r}")


def decode_rate(model: ModelConfig, cluster: Cluster, config: dict[str, Any], point: dict[str, Any],
                target: DecodeTarget) -> Evaluation:
    """The layout's decode step at the target batch and context: output tokens/s per GPU (an
    Evaluation whose score is GPU-seconds per output token)."""
    from stage_cosim.adapters.roofline.simulate import simulate
    from stage_cosim.workload import synthesize

    par = ParallelConfig(**{k: v for k, v in config["parallel"].items() if k in ParallelConfig.__dataclass_fields__})
    gpus = config["instance_gpus"]
    batch = target.batch_per_gpu * gpus
    inf = replace(target.inference, phase="decode", batch=batch, context_len=target.context_len,
                  attention_dp=config["attention_dp"])
    try:
        w = synthesize(model, par, inference=inf)
    except UserError as exc:
        return Evaluation(point, config, False, rule_of(exc), None, None)
    unit = replace(cluster, num_gpus=gpus)
    if max(w.memory(s, unit).total for s in range(par.pp)) > unit.gpu.memory_bytes:
        return Evaluation(point, config, False, "the batch's KV cache does not fit in memory", None, None)
    result, _, _ = simulate(w, unit)
    per_gpu = batch / result.step_time_s / gpus
    doc = {"decode_tokens_per_s_per_gpu": per_gpu, "gpu_seconds_per_token": 1 / per_gpu,
           "step_time_s": result.step_time_s, "instance_gpus": gpus, "layout": config,
           "mbu": result.inference["mbu"] if result.inference else None}
    return Evaluation(point, config, True, None, 1 / per_gpu, doc)


class DecodeProblem(ServingProblem):
    """The decode-throughput search: layouts of single instances (no pools, no batch limit)."""

    def __init__(self, space: SearchSpace, cluster: Cluster, target: DecodeTarget) -> None:
        super().__init__(space, cluster, ServeTarget(RequestStream(rate=1.0), SLO(tpot_s=1.0),
                                                     inference=target.inference), 0)
        self.decode = target

    def check(self, point: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        return layout(self.space, point, self.cluster, self.target)    # decode_rate checks the memory

    def exhaust(self, search, points: list[dict[str, Any]]) -> None:  # noqa: ANN001 (optimize's _Search)
        search.evaluate_many(points)

    def job(self, config: dict[str, Any], point: dict[str, Any]) -> tuple:
        return (decode_rate, self.space.model, self.cluster, config, point, self.decode)


@dataclass(frozen=True)
class ServingInner:
    """A serving objective as the inner search of a hardware exploration."""

    objective: str
    target: Any                      # ServeTarget or DecodeTarget
    num_requests: int = 300

    def space(self, model: ModelConfig, cluster: Cluster) -> SearchSpace:
        if self.objective == "decode-throughput":
            return serving_space(model, cluster, {"split": ("none",), "max_num_seqs": (MAX_NUM_SEQS[-1],)})
        return serving_space(model, cluster)

    def problem(self, space: SearchSpace, cluster: Cluster):  # noqa: ANN201
        if self.objective == "decode-throughput":
            return DecodeProblem(space, cluster, self.target)
        return ServingProblem(space, cluster, self.target, self.num_requests)


def serving_inner(objective: str, model: ModelConfig, settings: dict[str, Any]) -> ServingInner:
    """The inner search of a serving objective from an explore spec's ``serving`` settings."""
    inf_kw = {k: settings[k] for k in ("weight_dtype", "kv_cache_dtype") if k in settings}
    inference = InferenceConfig("decode", **inf_kw)
    if objective == "decode-throughput":
        return ServingInner(objective, DecodeTarget(settings.get("batch_per_gpu", 32),
                                                    settings.get("context_len", 4096), inference))
    stream_kw = {k: settings[k] for k in ("input_len", "output_len", "lengths") if k in settings}
    if "length_spread" in settings:
        stream_kw["spread"] = settings["length_spread"]
    slo = SLO(settings.get("slo_ttft"), settings.get("slo_tpot"))
    serving = ServingConfig(**({"chunk_tokens": settings["chunk_tokens"]} if "chunk_tokens" in settings else {}))
    target = ServeTarget(RequestStream(rate=1.0, **stream_kw), slo, settings.get("attainment", 0.9), inference,
                         serving)
    num = settings.get("num_requests", 300)
    if isinstance(num, bool) or not isinstance(num, int) or num < 20:
        raise UserError("serving.num_requests", f"must be an integer of at least 20, got {num!r}")
    return ServingInner(objective, target, num)
