"""One serving instance: the GPUs that hold one copy of the model, its KV-cache budget and its
step times.

An instance is a model replica over ``tp · pp`` GPUs; with attention data parallelism
(``--attention-dp``, Mixture-of-Experts models) it is ``dp`` attention replicas sharing the
experts over ``tp · pp · dp`` GPUs, each replica (an attention *rank* here) with its own
requests and its own KV cache, every step synchronous over all of them (the experts' all-to-all
joins them). Without it, ``dp`` replicas are independent instances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from stage_cosim.errors import UserError, require
from stage_cosim.inference.config import BatchShape, InferenceConfig
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel.config import ParallelConfig
from stage_cosim.serving.config import ServingConfig
from stage_cosim.serving.offload import host_to_device_GBps
from stage_cosim.serving.steptime import StepTimer

GiB = 1 << 30


@dataclass(frozen=True)
class KVLayout:
    """The paged KV cache of one attention rank, as the fullest GPU of the rank sees it.

    A sequence with ``n`` cached tokens holds ``ceil(n / block_size)`` blocks in each global
    attention layer; a sliding-window layer frees the blocks that fall out of its window, so it
    holds at most ``ceil(window / block_size) + 1``; a chunked-attention layer is held at the
    same bound for its chunk (the peak of its chunks' blocks: earlier chunks' are freed).
    """

    block_size: int
    bytes_per_token: tuple[tuple[int | None, float], ...]   # per attention window
    capacity_bytes: float                                    # per GPU, for the cache
    # A hybrid model's fixed state per sequence (its SSM layers' scan state and convolution
    # window), held from the sequence's first token whatever its length
    state_bytes: float = 0.0
    # KV offload: host memory per GPU for the prefix cache's second tier, and the rate each GPU
    # loads its shard of a block back at (10^9 B/s); 0 bytes: no offload
    host_bytes: float = 0.0
    host_to_device_GBps: float = 0.0

    def usage(self, tokens):  # noqa: ANN001, ANN201 (int or int array -> bytes)
        blocks = (np.asarray(tokens) + self.block_size - 1) // self.block_size
        out = self.state_bytes * (np.asarray(tokens) > 0)
        for window, per_token in self.bytes_per_token:
            held = blocks if window is None else np.minimum(blocks, -(-window // self.block_size) + 1)
            out = out + held * (per_token * self.block_size)
        return out

    def usage_of(self, tokens: int) -> float:
        """Bytes per GPU a sequence with ``tokens`` cached tokens holds (:meth:`usage` for one)."""
        blocks = -(-tokens // self.block_size)
        return sum(b * min(blocks, cap) for b, cap in self._per_block) + (self.state_bytes if tokens > 0 else 0.0)

    @cached_property
    def _per_block(self) -> tuple[tuple[float, float], ...]:
        return tuple((per_token * self.block_size, math.inf if w is None else -(-w // self.block_size) + 1)
                     for w, per_token in self.bytes_per_token)

    @property
    def tokens(self) -> int | None:
        """Tokens of one long sequence the cache holds (what vLLM reports as its KV capacity);
        None where a sequence's tokens take no room (a pure state-space model: no KV cache, its
        fixed state per sequence is what limits admission, :attr:`sequences`)."""
        if not any(b > 0 for _, b in self.bytes_per_token) and self.state_bytes > 0:
            return None
        per_block = self.usage(self.block_size)
        if per_block <= 0:
            return 0
        lo, hi = 0, 1
        while self.usage(hi) <= self.capacity_bytes and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.usage(mid) <= self.capacity_bytes else (lo, mid)
        return lo

    @property
    def sequences(self) -> int | None:
        """Sequences whose fixed state fits beside nothing else (None: the model holds none)."""
        return int(self.capacity_bytes // self.state_bytes) if self.state_bytes > 0 else None


@dataclass
class InstanceKind:
    """What every instance of a pool shares: its layout, step times and KV-cache budget."""

    parallel: ParallelConfig      # the instance's configuration (dp: its attention ranks)
    gpus: int
    ranks: int
    timer: StepTimer
    kv: KVLayout
    weights_bytes: float          # per GPU
    workspace_bytes: float        # per GPU, the largest step's forward working set
    transfer_bytes_per_token: float   # KV cache of one token over the whole instance (disaggregation)

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "attention_ranks": self.ranks, "tp": self.parallel.tp, "pp": self.parallel.pp,
                "ep": self.parallel.ep, "weights_bytes_per_gpu": self.weights_bytes,
                "workspace_bytes_per_gpu": self.workspace_bytes, "kv_capacity_bytes_per_gpu": self.kv.capacity_bytes,
                "kv_capacity_tokens_per_rank": self.kv.tokens,
                "kv_bytes_per_token_per_gpu": sum(b for _, b in self.kv.bytes_per_token),
                "state_bytes_per_sequence_per_gpu": self.kv.state_bytes,
                "state_capacity_sequences_per_rank": self.kv.sequences,
                "kv_offload_bytes_per_gpu": self.kv.host_bytes,
                "host_to_device_GBps": self.kv.host_to_device_GBps}


def attention_dp(inference: InferenceConfig) -> bool:
    return bool(getattr(inference, "attention_dp", False))


def instance_kind(model: ModelConfig, parallel: ParallelConfig, inference: InferenceConfig, cluster,  # noqa: ANN001
                  serving: ServingConfig, timer: StepTimer | None = None) -> InstanceKind:
    """An instance of ``parallel``'s layout on ``cluster``'s GPUs with ``serving``'s budget;
    ``timer``: a step timer of the same model, instance layout, inference, cluster and
    resolution to reuse (the serving search shares one over the batch limits and pool ratios it
    tries: step times do not depend on the engine's limits, and the timer's cache of simulated
    shapes is most of a run's cost). Its cluster may differ in GPU count where the instance
    fits in one scale-up domain: the count shapes only the scale-out fabric, which such an
    instance's collectives never cross."""
    ranks = parallel.dp if attention_dp(inference) else 1
    par = replace(parallel, dp=ranks)
    gpus = par.tp * par.pp * ranks * par.cp
    if timer is None:
        timer = StepTimer(model, par, inference, cluster, serving.step_resolution)
    else:
        same_cluster = timer.cluster == cluster or (gpus <= min(cluster.domain, timer.cluster.domain)
                                                    and replace(timer.cluster, num_gpus=cluster.num_gpus) == cluster)
        require(timer.model == model and timer.parallel == par and timer.inference == inference
                and same_cluster and timer.resolution == serving.step_resolution,
                "timer", "must time the same model, instance layout, inference, cluster and resolution")
    # The largest step a rank runs: a full token budget over as many requests as it may hold.
    seqs = min(serving.max_num_seqs, serving.chunk_tokens)
    windows = frozenset(model.layer_windows())
    biggest = BatchShape.uniform(seqs, max(1, serving.chunk_tokens // seqs), 0, windows)
    m, shape = timer.split(biggest)
    w = timer.workload(shape, m)
    stages = range(par.pp)
    mems = [w.memory(s, cluster) for s in stages]
    weights = max(mem.weights for mem in mems)
    workspace = max(mem.workspace + mem.activations for mem in mems)
    per_window: dict[int | None, float] = {}
    for s in stages:
        for window, b in w.kv_cache_bytes_per_token_by_window(s).items():
            per_window[window] = max(per_window.get(window, 0.0), b)
    capacity = serving.hbm_utilization * cluster.gpu.memory_bytes - weights - workspace - max(m.runtime.total for m in mems)
    if capacity <= 0:
        raise UserError("cluster", f"{model.name} on tp{par.tp} pp{par.pp}{f' ep{par.ep}' if par.ep > 1 else ''}: "
                                   f"weights ({weights / GiB:.1f} GiB) and the largest step's working set "
                                   f"({workspace / GiB:.1f} GiB) per GPU leave no KV cache in "
                                   f"{serving.hbm_utilization:g} of {cluster.gpu.memory_bytes / GiB:.0f} GiB")
    host, h2d = 0.0, 0.0
    if serving.kv_offloading_size:
        # vLLM's size is the instance's, summed over its GPUs: each GPU of an attention rank
        # keeps its own shard of every offloaded block
        host = serving.kv_offloading_size * GiB / (gpus // ranks)
        h2d = host_to_device_GBps(cluster.gpu.name)
    kv = KVLayout(serving.kv_block_size, tuple(sorted(per_window.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))),
                  capacity, max(w.state_bytes_per_sequence(s) for s in stages), host, h2d)
    ranks_per_stage = par.world_size // par.pp
    per_token_all = sum(sum(w.kv_cache_bytes_per_token_by_window(s).values()) for s in stages) * ranks_per_stage
    return InstanceKind(par, gpus, ranks, timer, kv, weights, workspace, per_token_all / ranks)


def kv_transfer_s(kind: InstanceKind, tokens: int, cluster) -> float:  # noqa: ANN001
    """Seconds to move one request's KV cache of ``tokens`` tokens from a prefill instance to a
    decode instance: every GPU sends its shard over its own NIC at once."""
    nbytes = kind.transfer_bytes_per_token * tokens / max(1, kind.gpus // kind.ranks)
    out = cluster.scale_out
    return out.latency_ns * 1e-9 + nbytes / (out.flat_bandwidth_GBps * 1e9)


def pool_instances(pool_gpus: int, kind: InstanceKind, parameter: str) -> int:
    if pool_gpus % kind.gpus:
        raise UserError(parameter, f"{pool_gpus} GPUs do not divide into instances of {kind.gpus} GPUs "
                                   f"(tp{kind.parallel.tp} x pp{kind.parallel.pp}"
                                   f"{f' x attention-dp{kind.ranks}' if kind.ranks > 1 else ''})")
    return pool_gpus // kind.gpus

