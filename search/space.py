"""The space of parallelizations: named dimensions with finite choices, and feasibility.

A candidate is a point in a product of dimensions (``tp``, ``cp``, ``cp_comm``, ``pp``, ``vp``,
``micro_batch``, ``sp``, ``zero``, ``recompute`` …); ``dp`` is derived so that the degrees
multiply to the GPU count. A new parallelism (``ep``) is one more :class:`Dimension` plus its
rule in :func:`check`: the encoding, the enumeration and the optimizers do not change. A space
may be narrowed to some of each dimension's choices and given rules across dimensions
(:meth:`SearchSpace.narrowed`, :class:`Constraint`): what a framework's launch expresses.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.parallel.config import CP_COMMS, DTYPES, FP8_OPTIONS, MESH_AXES, RECOMPUTE

# The recomputation modes searched: Megatron-Core's (torchtitan's per-op mode, "op", is not one
# of the layouts the search plans, which its launch emitters write for Megatron-Core)
RECOMPUTE_SEARCHED = tuple(r for r in RECOMPUTE if r != "op")


@dataclass(frozen=True)
class Dimension:
    name: str
    choices: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.choices:
            raise UserError(self.name, "has no choices")


CP_MIN_TOKENS = 4096
# --cp-comm choices searched by default: all of them; a2a+p2p with each all-to-all group size
# of ``cp_a2a_size`` (Megatron's --hierarchical-context-parallel-sizes: the all-to-alls inside a
# scale-up domain, the ring across)
CP_SEARCHED = CP_COMMS


def powers_of_two(limit: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(int(math.log2(limit)) + 1)) if limit >= 1 else (1,)


@dataclass(frozen=True)
class Constraint:
    """A rule across dimensions that a space adds to the structural ones (a launch that cannot
    express some combination of values, each of which it can): a point is feasible only where
    ``holds`` of its canonical form is true, else infeasible by ``rule``."""

    rule: str
    holds: Callable[[dict[str, Any]], bool]


@dataclass(frozen=True)
class SearchSpace:
    """Everything that is searched, and the fixed context that the rules need."""

    model: ModelConfig
    num_gpus: int
    global_batch: int
    seq_len: int
    dimensions: tuple[Dimension, ...]
    fixed: dict[str, Any] = field(default_factory=dict)   # ParallelConfig fields held constant
    constraints: tuple[Constraint, ...] = ()

    @property
    def size(self) -> int:
        return math.prod(len(d.choices) for d in self.dimensions)

    def names(self) -> list[str]:
        return [d.name for d in self.dimensions]

    def point(self, index: Sequence[int]) -> dict[str, Any]:
        return {d.name: d.choices[int(i)] for d, i in zip(self.dimensions, index)}

    def points(self) -> Iterator[dict[str, Any]]:
        names = self.names()
        for combo in itertools.product(*(d.choices for d in self.dimensions)):
            yield dict(zip(names, combo))

    def restricted(self, name: str, value: Any) -> "SearchSpace":
        """The same space with dimension ``name`` held at ``value``."""
        dims = tuple(Dimension(d.name, (value,)) if d.name == name else d for d in self.dimensions)
        return replace(self, dimensions=dims)

    def narrowed(self, allowed: Mapping[str, Sequence[Any]], constraints: Sequence[Constraint] = ()) -> "SearchSpace":
        """The same space with each dimension named in ``allowed`` keeping only those of its
        choices (in its own order), and ``constraints`` added to its rules. A name that is not
        a dimension here (a field the space holds fixed, a dimension of other models) is the
        caller's to check."""
        dims = []
        for d in self.dimensions:
            if d.name in allowed:
                kept = tuple(c for c in d.choices if c in allowed[d.name])
                if not kept:
                    raise UserError(d.name, f"keeps none of its choices ({', '.join(map(str, d.choices))}) "
                                            f"within {', '.join(map(str, allowed[d.name]))}")
                d = Dimension(d.name, kept)
            dims.append(d)
        return replace(self, dimensions=tuple(dims), constraints=self.constraints + tuple(constraints))


MAX_MICRO_BATCH = 8          # the largest micro-batch the default space tries
# The pipeline schedules searched, by their one-chunk-per-stage name: with vp > 1 each is its
# chunked form (1f1b interleaved, zb-h1 ZB-V, dualpipe DualPipeV; see canonical()).
SCHEDULES_SEARCHED = ("1f1b", "zb-h1", "dualpipe")
CHUNKED = {"1f1b": "interleaved", "zb-h1": "zb-v", "dualpipe": "dualpipev"}


def default_space(model: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int, *,
                  allow_cross_domain_tp: bool = False, fixed: dict[str, Any] | None = None,
                  overrides: dict[str, Sequence[Any]] | None = None,
                  precision: dict[str, Any] | None = None) -> SearchSpace:
    """Megatron-style choices: powers of two for the degrees and micro-batch, vp up to 4.

    ``precision``: ``dtype`` (bf16, fp8, or auto: the search picks, a ``dtype`` dimension) and the
    FP8 options (held fixed; they apply to the FP8 points)."""
    n = cluster.num_gpus
    tp_limit = n if allow_cross_domain_tp else min(n, cluster.domain)
    dims = {
        "tp": powers_of_two(min(tp_limit, model.heads)),
        # context parallelism while each rank keeps at least 4K tokens of the sequence (shorter
        # chunks leave the attention kernels and the ring too little work to be worth it)
        "cp": tuple(c for c in powers_of_two(min(n, max(1, seq_len // CP_MIN_TOKENS))) if n % c == 0),
        "cp_comm": CP_SEARCHED,
        # a2a+p2p's all-to-all groups, powers of two from 2 within a scale-up domain (a group of
        # cp ranks is plain a2a: canonical() says so)
        "cp_a2a_size": tuple(a for a in powers_of_two(min(cluster.domain, max(1, seq_len // CP_MIN_TOKENS), n))
                             if a > 1) or (2,),
        "pp": tuple(p for p in powers_of_two(min(n, model.layers)) if n % p == 0),
        "vp": (1, 2, 4),
        "schedule": SCHEDULES_SEARCHED,
        "micro_batch": powers_of_two(min(MAX_MICRO_BATCH, global_batch)),
        "sp": (False, True),
        "zero": (0, 1, 2, 3),
        "recompute": RECOMPUTE_SEARCHED,
    }
    fixed = dict(fixed or {})
    precision = dict(precision or {})
    dtype = precision.pop("dtype", None) or "bf16"
    if dtype not in DTYPES + ("auto",):
        raise UserError("dtype", f"must be one of {', '.join(DTYPES + ('auto',))}, got {dtype!r}")
    for key in precision:
        if key not in FP8_OPTIONS:
            raise UserError(key, f"is not a precision option (options: dtype, {', '.join(FP8_OPTIONS)})")
    fixed.update({k: v for k, v in precision.items() if v is not None})
    if precision:           # the FP8 options, checked once here rather than at every point
        ParallelConfig(dtype="fp8", zero=3, **{k: v for k, v in precision.items() if v is not None})
    if dtype == "auto":
        dims["dtype"] = DTYPES
    else:
        fixed["dtype"] = dtype
    if model.is_moe:
        # expert layers re-factor the same ranks: ep shares out the experts, expert_tp shards
        # each one (inside a scale-up domain, as tp)
        dims["ep"] = tuple(e for e in powers_of_two(min(n, model.num_experts)) if model.num_experts % e == 0)
        dims["expert_tp"] = powers_of_two(tp_limit)
    for name, values in (overrides or {}).items():
        if name not in dims:
            raise UserError(name, f"is not a search dimension (dimensions: {', '.join(dims)})")
        dims[name] = tuple(values)
    return SearchSpace(model, n, global_batch, seq_len, tuple(Dimension(k, v) for k, v in dims.items()), fixed)


# -- feasibility -------------------------------------------------------------------------------

def _sharded(point: dict[str, Any]) -> int:
    """The product of the searched mesh degrees: every axis of the rank mesh but dp, which
    takes the GPUs that are left."""
    return math.prod(point.get(axis, 1) for axis in MESH_AXES if axis != "dp")


def canonical(space: SearchSpace, point: dict[str, Any]) -> dict[str, Any]:
    """The same configuration written one way: choices that mean nothing in their context
    collapse (sequence parallelism without tp, virtual stages without pp, ZeRO without dp).

    Points that only differ in such choices are one configuration (simulated once), and a
    search step that turns tp off does not land on an "infeasible" sp=True point.
    """
    p = dict(point)
    if p.get("tp", 1) == 1 and "sp" in p:
        p["sp"] = False
    if p.get("cp", 1) == 1:
        if "cp_comm" in p:
            p["cp_comm"] = "p2p"
    elif p.get("cp_comm") == "a2a+p2p" and p.get("cp_a2a_size") in (1, p["cp"]):
        # all-to-all groups of one rank are the plain ring, one group of every cp rank plain a2a
        p["cp_comm"] = "p2p" if p["cp_a2a_size"] == 1 else "a2a"
    if "cp_a2a_size" in p and p.get("cp_comm") != "a2a+p2p":
        p["cp_a2a_size"] = None
    if p.get("pp", 1) == 1 and "vp" in p:
        p["vp"] = 1
    if "schedule" in p:
        # no pipeline: no schedule to choose; virtual stages: the schedule's chunked form
        p["schedule"] = "1f1b" if p.get("pp", 1) == 1 else p["schedule"]
        p["schedule"] = CHUNKED.get(p["schedule"], p["schedule"]) if p.get("vp", 1) > 1 else p["schedule"]
    sharded = _sharded(p)
    if "zero" in p and sharded and space.num_gpus % sharded == 0 and space.num_gpus // sharded == 1:
        p["zero"] = 0
    return p

def check(space: SearchSpace, point: dict[str, Any], cluster: Cluster,
          allow_cross_domain_tp: bool = False) -> tuple[ParallelConfig | None, str | None]:
    """The ParallelConfig of ``point``, or None and the name of the rule it breaks."""
    m = space.model
    tp, pp, vp = point.get("tp", 1), point.get("pp", 1), point.get("vp", 1)
    mb = point.get("micro_batch", 1)
    sharded = _sharded(point)
    if space.num_gpus % sharded:
        return None, "degrees do not divide the GPU count"
    dp = space.num_gpus // sharded
    if m.heads % tp or m.kv_heads % tp or m.ffn % tp:
        return None, "tp does not divide heads / kv-heads / ffn"
    if pp * vp > m.layers:
        return None, "more pipeline stages than layers"
    if space.global_batch % (dp * mb):
        return None, "global batch not divisible by dp * micro-batch"
    m_count = space.global_batch // (dp * mb)
    schedule = point.get("schedule")
    if schedule in CHUNKED:            # (a point written before canonical())
        schedule = CHUNKED[schedule] if vp > 1 and pp > 1 else schedule
    if vp > 1 and schedule in (None, "interleaved") and m_count % pp:
        return None, "interleaving needs micro-batches divisible by pp"
    if tp > cluster.domain and not allow_cross_domain_tp:
        return None, "tp exceeds the scale-up domain"
    if tp < cluster.domain and cluster.domain % tp:
        return None, "tp splits scale-up domains unevenly"
    kw = dict(space.fixed)
    cp = point.get("cp", kw.get("cp", 1))
    ep, etp = point.get("ep", 1), point.get("expert_tp", tp)
    # expert layers re-factor the tp*cp*dp ranks of a stage (ParallelConfig's rule)
    if (tp * cp * dp) % (ep * etp):
        return None, "expert-tp * ep does not divide tp * cp * dp"
    if etp > cluster.domain and not allow_cross_domain_tp:
        return None, "expert-tp exceeds the scale-up domain"
    if m.is_moe:
        kw.update(ep=ep, expert_tp=etp)
    if schedule is not None:
        kw["schedule"] = schedule
        if schedule == "dualpipe" and _dualpipe_states_exceed(space, point, cluster, dp):
            return None, "dualpipe: its two copies of the parameters do not fit in memory"
    kw.update(dp=dp, tp=tp, pp=pp, vp=vp, micro_batch=mb, global_batch=space.global_batch,
              seq_len=space.seq_len, sp=bool(point.get("sp", False)), zero=point.get("zero", 0),
              recompute=point.get("recompute", "none"))
    if cp > 1 or "cp" in point:
        kw.update(cp=cp, cp_comm=point.get("cp_comm", kw.get("cp_comm", "p2p")),
                  cp_a2a_size=point.get("cp_a2a_size", kw.get("cp_a2a_size")))
        if kw["cp_comm"] != "a2a+p2p":
            kw["cp_a2a_size"] = None
    if "dtype" in point:
        kw["dtype"] = point["dtype"]
    if kw.get("dtype", "bf16") == "bf16":          # the FP8 options belong to the FP8 points
        kw = {k: v for k, v in kw.items() if k not in FP8_OPTIONS}
    try:
        par = ParallelConfig(**kw)
        par.check_against(m)
        if par.dtype != "bf16":
            from stage_cosim.graph.precision import resolve_precision

            resolve_precision(par, cluster.gpu)      # what the GPU cannot run is infeasible
    except UserError as exc:
        return None, f"{exc.parameter}: {exc.rule.split(',')[0]}"
    if space.constraints:
        c = canonical(space, point)
        broken = next((k.rule for k in space.constraints if not k.holds(c)), None)
        if broken is not None:
            return None, broken
    return par, None


def _dualpipe_states_exceed(space: SearchSpace, point: dict[str, Any], cluster: Cluster, dp: int) -> bool:
    """Whether DualPipe's two copies of the model states (weights, gradients, Adam state) alone,
    spread as evenly as the point's degrees allow, exceed a GPU's whole memory: a lower bound
    on the largest stage's, so a point ruled out here is over the memory when simulated too
    (what does not fit beyond the states is the simulation's memory check's to say)."""
    from stage_cosim.schedule.memory import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES

    zero = point.get("zero", 0)
    shard = dp * point.get("cp", 1)         # ZeRO shards over the data-parallel ranks
    per_param = (WEIGHT_BYTES / (shard if zero >= 3 else 1) + GRAD_BYTES / (shard if zero >= 2 else 1)
                 + OPTIMIZER_BYTES / (shard if zero >= 1 else 1))
    split = point.get("pp", 1) * max(point.get("tp", 1), point.get("ep", 1) * point.get("expert_tp", 1))
    states = 2 * space.model.param_count() / split * per_param
    return states > cluster.gpu.memory_bytes
