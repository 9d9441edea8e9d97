"""Serving-engine profiles: what a release of an engine schedules by default, and what its host
side costs, as data (``data/<engine>.yaml``, one file per engine release).

A profile gives the release's scheduler defaults (``max_num_seqs``,
``chunk_tokens`` — the token budget of a step, vLLM's ``max_num_batched_tokens`` — whether
prompts are chunked, the preemption mode, whether automatic prefix caching is on, whether
admission reserves a request's whole output — TensorRT-LLM's ``GUARANTEED_NO_EVICT``) and its host
overheads: per step (scheduling, sampling bookkeeping, the tensor-parallel workers' RPC, which
grows with tp where the engine broadcasts each step's inputs to its workers) and per request
(API server). A profile's overheads come from the published measurements its ``source`` names,
or are zero where it says ``uncalibrated`` (``benchmarks/validate_serving.py`` shows the fit of
a per-step overhead on the throughput rows and its errors held out by source); nothing is tuned
per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from stage_cosim.errors import UserError

PREEMPTION_MODES = ("recompute",)
#: The engine a serving run models unless told: vLLM's current (V1) engine, the most common
#: open serving stack and the one the measuring harnesses (benchmark_serving) come from.
DEFAULT_ENGINE = "vllm-v1"


@dataclass(frozen=True)
class EngineProfile:
    name: str
    release: str
    max_num_seqs: int
    chunk_tokens: int                   # the token budget of a step (vLLM's max_num_batched_tokens)
    enable_chunked_prefill: bool
    preemption_mode: str
    enable_prefix_caching: bool
    guaranteed_no_evict: bool           # admission reserves the prompt and whole output
    step_overhead_s: float              # per step at tp1
    step_overhead_per_tp_s: float       # and per tensor-parallel worker beyond the first
    request_overhead_s: float
    calibration: str                    # where the overheads come from

    def step_overhead(self, tp: int) -> float:
        return self.step_overhead_s + self.step_overhead_per_tp_s * max(0, tp - 1)

    def settings(self, tp: int = 1) -> dict[str, Any]:
        """ServingConfig fields of this engine for instances of ``tp`` GPUs."""
        return {"max_num_seqs": self.max_num_seqs, "chunk_tokens": self.chunk_tokens,
                "enable_chunked_prefill": self.enable_chunked_prefill, "enable_prefix_caching": self.enable_prefix_caching,
                "guaranteed_no_evict": self.guaranteed_no_evict,
                "step_overhead_s": self.step_overhead(tp), "request_overhead_s": self.request_overhead_s}

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def engine_names() -> list[str]:
    data = resources.files("stage_cosim.serving").joinpath("data")
    return sorted(p.name[:-5] for p in data.iterdir() if p.name.endswith(".yaml"))


@lru_cache(maxsize=None)
def engine_profile(name: str) -> EngineProfile:
    """The profile of engine release ``name`` (one of :func:`engine_names`)."""
    names = engine_names()
    if not isinstance(name, str) or name not in names:
        raise UserError("engine", f"must be one of {', '.join(names)}, got {name!r}")
    doc = yaml.safe_load(resources.files("stage_cosim.serving").joinpath("data", f"{name}.yaml").read_text())
    over = doc.get("overheads", {})
    sched = doc["scheduler"]
    profile = EngineProfile(name=name, release=str(doc["release"]), max_num_seqs=int(sched["max_num_seqs"]),
                            chunk_tokens=int(sched["chunk_tokens"]),
                            enable_chunked_prefill=bool(sched["enable_chunked_prefill"]),
                            preemption_mode=str(sched["preemption_mode"]),
                            enable_prefix_caching=bool(sched["enable_prefix_caching"]),
                            guaranteed_no_evict=bool(sched.get("guaranteed_no_evict", False)),
                            step_overhead_s=float(over.get("step_s", 0.0)),
                            step_overhead_per_tp_s=float(over.get("step_per_tp_worker_s", 0.0)),
                            request_overhead_s=float(over.get("request_s", 0.0)),
                            calibration=str(over.get("source", "uncalibrated")).strip())
    if profile.preemption_mode not in PREEMPTION_MODES:
        raise UserError("engine", f"{name}: preemption_mode {profile.preemption_mode!r} is not modelled "
                                  f"(only {', '.join(PREEMPTION_MODES)})")
    return profile
