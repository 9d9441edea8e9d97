"""What a serving engine is configured with, and the latency targets it is judged by.

Names follow vLLM's engine arguments where it has one (``max_num_seqs``; ``chunk_tokens`` is its
``max_num_batched_tokens`` with chunked prefill; ``hbm_utilization`` its
``gpu_memory_utilization``; ``kv_block_size`` its ``block_size``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from stage_cosim.errors import UserError, positive_int, require
from stage_cosim.serving.steptime import DEFAULT_RESOLUTION

ROUTING = ("least-loaded", "round-robin")


def _positive_seconds(value: float | None, parameter: str) -> None:
    if value is not None:
        require(isinstance(value, (int, float)) and value > 0 and math.isfinite(value), parameter,
                f"must be a positive number of seconds, got {value!r}")


def _graph_sizes(value: object) -> tuple[int, ...]:
    """``value`` (a comma-separated string or a sequence) as sorted distinct positive ints."""
    items = value.split(",") if isinstance(value, str) else value
    rule = f"must be positive integers (batch sizes), comma-separated, got {value!r}"
    try:
        sizes = [int(x) if isinstance(x, str) else x for x in items]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise UserError("cuda-graph-sizes", rule) from None
    require(bool(sizes) and all(not isinstance(x, bool) and isinstance(x, int) and x > 0 for x in sizes),
            "cuda-graph-sizes", rule)
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class ServingConfig:
    """How each serving instance schedules its steps."""

    max_num_seqs: int = 256
    """Requests running at once on one attention rank, decoding or being prefilled (vLLM's
    max_num_seqs)."""
    chunk_tokens: int = 8192
    """Tokens one step may process on one attention rank: every decode token and the prompt chunks
    that fill the rest (vLLM's max_num_batched_tokens with chunked prefill). A prompt longer than
    this takes several steps."""
    enable_chunked_prefill: bool = True
    """Prompts split over steps, batched with the decodes (vLLM's --enable-chunked-prefill); off: a
    step runs whole prompts only while any can be admitted, and decodes otherwise (vLLM's V0
    default scheduler)."""
    kv_block_size: int = 16
    """Tokens per KV-cache block: the cache is paged in blocks of this many tokens per sequence
    (vLLM's block_size)."""
    hbm_utilization: float = 0.9
    """Fraction of HBM the engine may use: weights, working set and KV cache (vLLM's
    gpu_memory_utilization)."""
    step_overhead_s: float = 0.0
    """Host seconds per step not overlapped with the GPU (scheduling, sampling bookkeeping)."""
    step_resolution: float = DEFAULT_RESOLUTION
    """Resolution of the step-time grid whose simulated shapes the steps are interpolated from; 0:
    every step's shape simulated exactly."""
    prefill_gpus: int | None = None
    """Disaggregated serving: GPUs that run prompts only (with decode-gpus; the rest of the cluster
    idle). Neither given: every instance runs both."""
    decode_gpus: int | None = None
    """Disaggregated serving: GPUs that run decodes only (with prefill-gpus)."""
    routing: str = "least-loaded"
    """Which instance (and, with attention data parallelism, which of its ranks) a request joins."""
    enable_prefix_caching: bool = False
    """Automatic prefix caching (vLLM's --enable-prefix-caching): full KV blocks kept by content and
    reused by later prompts that share them."""
    cuda_graph_sizes: tuple[int, ...] | None = None
    """Batch sizes the engine captured CUDA graphs for, padding a step of decodes only up to the
    next one (dummy requests: every token-sized kernel runs for them too; TensorRT-LLM's
    cuda_graph_config batch_sizes with enable_padding, vLLM's --cuda-graph-sizes); a batch past
    the largest runs as it is. None: no padding."""
    guaranteed_no_evict: bool = False
    """A request is admitted only while the cache can hold every admitted request's prompt and
    whole output at once, so nothing is ever preempted (TensorRT-LLM's GUARANTEED_NO_EVICT
    capacity scheduler policy); off: admitted while its prompt fits, preempting when decodes
    outgrow the cache (vLLM's scheduler)."""
    kv_offloading_size: float = 0.0
    """GiB of host memory per engine — an instance, or each attention-DP rank of one — summed
    over its GPUs as vLLM's --kv-offloading-size counts it, for a second tier of the prefix cache: blocks evicted from HBM are kept there and a
    prompt that hits them loads them back at the GPU's measured host-to-device rate instead of
    prefilling them again; 0: no offload. Needs prefix caching."""
    request_timeout_s: float | None = None
    """Seconds a client waits for a request before giving up (the engine aborts it and frees its
    cache); no timeout: clients wait forever."""
    request_overhead_s: float = 0.0
    """Host seconds per request outside the engine's steps (API server: tokenizing, detokenizing,
    the HTTP round trip), half before the engine sees it and half after its last token."""

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
        require(isinstance(self.guaranteed_no_evict, bool), "guaranteed-no-evict",
                f"must be true or false, got {self.guaranteed_no_evict!r}")
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes", _graph_sizes(self.cuda_graph_sizes))
        require(not isinstance(self.kv_offloading_size, bool) and isinstance(self.kv_offloading_size, (int, float))
                and 0 <= self.kv_offloading_size < math.inf, "kv-offloading-size",
                f"must be a non-negative number of GiB, got {self.kv_offloading_size!r}")
        require(not self.kv_offloading_size or self.enable_prefix_caching, "kv-offloading-size",
                "is a second tier of the prefix cache: give --enable-prefix-caching too")
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

    ttft_s: float | None = None
    """Time-to-first-token target, seconds."""
    tpot_s: float | None = None
    """Time-per-output-token target, seconds: the mean time per output token after the first."""

    def __post_init__(self) -> None:
        _positive_seconds(self.ttft_s, "slo-ttft")
        _positive_seconds(self.tpot_s, "slo-tpot")

    def to_dict(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}
