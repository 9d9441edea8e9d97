"""Evaluate one parallelization: synthesize, check memory, simulate, score.

Evaluations are plain data (picklable), so they can run in worker processes or on a Ray
cluster; the optimizer caches them by configuration, so no configuration is simulated twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.hardware.runtime import DEFAULT_HEADROOM
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig

OBJECTIVES = ("step-time", "tokens-per-gpu", "cost")
MEMORY_REASON = "does not fit in memory"


@dataclass(frozen=True)
class Objective:
    name: str = "step-time"
    price_per_gpu_hour: float = 0.0     # for "cost"

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise UserError("objective", f"must be one of {', '.join(OBJECTIVES)}, got {self.name!r}")
        if self.name == "cost" and self.price_per_gpu_hour <= 0:
            raise UserError("price", "the cost objective needs --price (per GPU-hour) > 0")

    def score(self, result: dict[str, Any]) -> float:
        """Lower is better."""
        if self.name == "step-time":
            return result["step_time_s"]
        if self.name == "tokens-per-gpu":
            return -result["tokens_per_s_per_gpu"]
        return self.cost_per_million_tokens(result)

    def cost_per_million_tokens(self, result: dict[str, Any]) -> float:
        gpus = result["config"]["num_gpus"]
        dollars_per_s = gpus * self.price_per_gpu_hour / 3600
        return dollars_per_s / result["tokens_per_s"] * 1e6

    def describe(self, value: float) -> str:
        if self.name == "step-time":
            return f"{value:.4f} s/step"
        if self.name == "tokens-per-gpu":
            return f"{-value:,.1f} tokens/s/GPU"
        return f"${value:.4f} per million tokens"


@dataclass
class Evaluation:
    point: dict[str, Any]
    parallel: dict[str, Any] | None
    feasible: bool
    reason: str | None
    score: float | None
    result: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def workload_of(model: ModelConfig, par: ParallelConfig, gpu=None):  # noqa: ANN001, ANN201 (GPU, Workload)
    """The graphs of a parallelization depend on the hardware only through the FP8 kernels
    its GPU runs: a hardware search re-simulates the same few workloads on many clusters, so
    they are kept (a bounded cache)."""
    from stage_cosim.workload import precision_for

    return _workload(model, par, precision_for(par, gpu))


@lru_cache(maxsize=16)
def _workload(model: ModelConfig, par: ParallelConfig, precision):  # noqa: ANN001, ANN202
    from stage_cosim.workload import synthesize

    return synthesize(model, par, precision=precision)


def evaluate(model: ModelConfig, cluster: Cluster, par: ParallelConfig, point: dict[str, Any],
             objective: Objective, network_model: str = "calibrated", headroom: float = DEFAULT_HEADROOM
             ) -> Evaluation:
    """Simulate ``par`` unless it does not fit in memory (checked first: it needs no graph): its
    peak, the process's runtime memory on this cluster included, within HBM less ``headroom``."""
    from stage_cosim.adapters.roofline.run_cache import reuse_runs
    from stage_cosim.adapters.simulate import simulate
    from stage_cosim.gc_pause import gc_paused
    from stage_cosim.schedule.template_cache import reuse_templates

    w = workload_of(model, par, cluster.gpu)
    capacity = cluster.gpu.memory_bytes * (1 - headroom)
    peak = max(w.memory(s, cluster).total for s in range(par.pp))
    if peak > capacity:
        return Evaluation(point, par.to_dict(), False, MEMORY_REASON, None, None)
    # the cached graphs are large: full collections would rescan them all; candidates share
    # most pass templates and their runs (reused exactly: the same result as a fresh simulate)
    with gc_paused(), reuse_templates(), reuse_runs():
        result, _, _ = simulate(w, cluster, network_model)
    d = result.to_dict()
    return Evaluation(point, par.to_dict(), True, None, objective.score(d), d)


def gpus_for_training_state(model: ModelConfig, cluster: Cluster, headroom: float = DEFAULT_HEADROOM,
                            fp8_param_gather: bool = False) -> tuple[int, str]:
    """A lower bound on the GPUs any training configuration of ``model`` needs, and why: its
    weights (bf16: 2 bytes a parameter, 1 kept in FP8), gradients (fp32: 4) and Adam state (fp32
    master weights and two moments: 12), spread evenly over every GPU (ZeRO-3 over all of them),
    must fit in each GPU's HBM less ``headroom``; activations and the runtime only add to it."""
    import math

    from stage_cosim.schedule.memory import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES

    per_param = (1 if fp8_param_gather else WEIGHT_BYTES) + GRAD_BYTES + OPTIMIZER_BYTES
    usable = cluster.gpu.memory_bytes * (1 - headroom)
    params = model.param_count()
    need = math.ceil(params * per_param / usable)
    return need, (f"memory: needs >= {need:,} GPUs (the weights, gradients and Adam state of {params / 1e9:,.1f} B "
                  f"parameters, {per_param} bytes each, over {usable / (1 << 30):.1f} GiB usable per GPU, before "
                  f"activations); the cluster has {cluster.num_gpus:,}")
