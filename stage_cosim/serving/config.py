"""What a serving engine is configured with, and the latency targets it is judged by.

Names follow vLLM's engine arguments where it has one (``max_num_seqs``; ``chunk_tokens`` is its
``max_num_batched_tokens`` with chunked prefill; ``hbm_utilization`` its
``gpu_memory_utilization``; ``kv_block_size`` its ``block_size``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from stage_cosim.errors import positive_int, require
from stage_cosim.serving.steptime import DEFAULT_RESOLUTION

ROUTING = ("least-loaded", "round-robin")


def _positive_seconds(value: float | None, parameter: str) -> None:
    if value is not None:
        require(isinstance(value, (int, float)) and value > 0 and math.isfinite(value), parameter,
                f"must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class ServingConfig:
    """How each serving instance schedules its steps."""

    # Requests running at once on one attention rank (decoding or being prefilled).
    max_num_seqs: int = 256
    # Tokens one step may process on one attention rank: every decode token and the prompt
    # chunks that fill the rest (chunked prefill). A prompt longer than this takes several steps.
    chunk_tokens: int = 8192
    # Prompts split over steps, batched with the decodes (vLLM's --enable-chunked-prefill); off:
    # a step runs whole prompts only while any can be admitted, and decodes otherwise (vLLM's
    # V0 default scheduler).
    enable_chunked_prefill: bool = True
    # The KV cache is paged in blocks of this many tokens per sequence.
    kv_block_size: int = 16
    # Fraction of HBM the engine may use (weights, working set and KV cache).
    hbm_utilization: float = 0.9
    # Host time per step not overlapped with the GPU (scheduling, sampling bookkeeping).
    step_overhead_s: float = 0.0
    # Step-time cache grid (see :mod:`stage_cosim.serving.steptime`); 0: every shape exactly.
    step_resolution: float = DEFAULT_RESOLUTION
    # Disaggregated serving: GPUs running prompts only, and GPUs running decodes only (the
    # rest of the cluster idle); both None: every instance runs both.
    prefill_gpus: int | None = None
    decode_gpus: int | None = None
    # Which instance (and, with attention data parallelism, which of its ranks) a request joins.
    routing: str = "least-loaded"
    # Automatic prefix caching (vLLM's --enable-prefix-caching): full KV blocks kept by content
    # and reused by later prompts that share them (see :mod:`stage_cosim.serving.prefix`).
    enable_prefix_caching: bool = False
    # The client gives up on a request not finished this many seconds after it arrived (the
    # engine aborts it and frees its cache); None: clients wait forever.
    request_timeout_s: float | None = None
    # Host time per request outside the steps (API server: tokenizing, detokenizing, the HTTP
    # round trip), half before the engine sees it and half after its last token.
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        positive_int(self.max_num_seqs, "max-num-seqs")
        positive_int(self.chunk_tokens, "chunk-tokens")
        positive_int(self.kv_block_size, "kv-block-size")
        require(self.chunk_tokens >= self.max_num_seqs, "chunk-tokens",
                f"must be at least max-num-seqs ({self.max_num_seqs}): every running request decodes "
                f"one token per step, got {self.chunk_tokens}")
        require(isinstance(self.hbm_utilization, (int, float)) and 0 < self.hbm_utilization <= 1,
                "hbm-utilization", f"must be in (0, 1], got {self.hbm_utilization!r}")
        require(isinstance(self.step_overhead_s, (int, float)) and 0 <= self.step_overhead_s < math.inf,
                "step-overhead", f"must be a non-negative number of seconds, got {self.step_overhead_s!r}")
        require(isinstance(self.step_resolution, (int, float)) and 0 <= self.step_resolution < 1,
                "step-resolution", f"must be in [0, 1), got {self.step_resolution!r}")
        require((self.prefill_gpus is None) == (self.decode_gpus is None), "prefill-gpus",
                "disaggregated serving needs both --prefill-gpus and --decode-gpus")
        if self.prefill_gpus is not None:
            positive_int(self.prefill_gpus, "prefill-gpus")
            positive_int(self.decode_gpus, "decode-gpus")
        require(isinstance(self.enable_chunked_prefill, bool), "enable-chunked-prefill",
                f"must be true or false, got {self.enable_chunked_prefill!r}")
        require(isinstance(self.enable_prefix_caching, bool), "enable-prefix-caching",
                f"must be true or false, got {self.enable_prefix_caching!r}")
        _positive_seconds(self.request_timeout_s, "request-timeout")
        require(isinstance(self.request_overhead_s, (int, float)) and 0 <= self.request_overhead_s < math.inf,
                "request-overhead", f"must be a non-negative number of seconds, got {self.request_overhead_s!r}")
        require(self.routing in ROUTING, "routing", f"must be one of {', '.join(ROUTING)}, got {self.routing!r}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_gpus is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet to count towards goodput (None: no target)."""

    ttft_s: float | None = None      # time to first token
    tpot_s: float | None = None      # mean time per output token after the first

    def __post_init__(self) -> None:
        _positive_seconds(self.ttft_s, "slo-ttft")
        _positive_seconds(self.tpot_s, "slo-tpot")

    def to_dict(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}
