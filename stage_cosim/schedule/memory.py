"""Memory accounting: the peak memory of one rank of a stage, by category (model states under
ZeRO, activations held under the pipeline schedule, workspace, FP8 caches and amax histories, an
inference step's KV cache), with the byte sizes of mixed-precision training's states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from stage_cosim.graph.precision import AMAX_TENSORS_BWD, AMAX_TENSORS_FWD
from stage_cosim.schedule.nodes import ceil_int, BlockInstance
from stage_cosim.schedule.pipeline import Pass

# Mixed-precision Adam: bf16 weights, fp32 main gradients, fp32 master weights + two moments.
# (FP8 parameters are stored in their own bytes per parameter: WeightSync.param_bytes.)
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12
# Adam reads grad, master, m, v (4 B each) and writes master, m, v (and the model's weight in
# its own precision: bf16, or FP8 parameters quantized from the master copy).
ADAM_STATE_BYTES_PER_PARAM = 16 + 12
ADAM_BYTES_PER_PARAM = ADAM_STATE_BYTES_PER_PARAM + WEIGHT_BYTES
ADAM_FLOPS_PER_PARAM = 12
FP32_BYTES = 4


@dataclass(frozen=True)
class RuntimeMemory:
    """What a rank's process holds beside its tensors, bytes (see :mod:`stage_cosim.hardware.runtime`):
    the CUDA context, cuBLAS workspaces, NCCL's buffers for the communicators it uses, and what
    the caching allocator loses to fragmentation. It depends on the GPU and where the rank's
    peers are, so a stage's memory has it only once a cluster is named."""

    cuda_context: int = 0
    cublas_workspace: int = 0
    nccl_buffers: int = 0
    fragmentation: int = 0

    @property
    def total(self) -> int:
        return self.cuda_context + self.cublas_workspace + self.nccl_buffers + self.fragmentation


@dataclass
class StageMemory:
    """Peak memory of one rank of a stage, bytes by category."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    workspace: int
    # weights + gradients + optimizer state of the transformer layers alone (what published
    # per-GPU figures usually count) and of the embedding / output layer.
    states_layers: int
    states_embedding_head: int
    # FP8: quantized weight copies kept across micro-batches; delayed scaling's amax histories
    fp8_weight_cache: int = 0
    fp8_amax_history: int = 0
    # An inference step: the KV cache of the step's requests (held from step to step).
    kv_cache: int = 0
    # The process's own memory on the GPU (zero until a cluster is named: Workload.memory).
    runtime: RuntimeMemory = field(default_factory=RuntimeMemory)

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.workspace
                + self.fp8_weight_cache + self.fp8_amax_history + self.kv_cache + self.runtime.total)

    def with_runtime(self, runtime: RuntimeMemory) -> "StageMemory":
        return replace(self, runtime=runtime)

    def to_dict(self) -> dict[str, int]:
        rt = self.runtime
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace,
                "fp8_weight_cache": self.fp8_weight_cache, "fp8_amax_history": self.fp8_amax_history,
                "kv_cache": self.kv_cache, "runtime": rt.total,
                "total": self.total, "model_states_layers": self.states_layers,
                "model_states_embedding_and_head": self.states_embedding_head,
                "runtime_cuda_context": rt.cuda_context, "runtime_cublas_workspace": rt.cublas_workspace,
                "runtime_nccl_buffers": rt.nccl_buffers, "runtime_fragmentation": rt.fragmentation}


def amax_history_bytes(inst_modules: int, history_len: int) -> int:
    """Memory of delayed scaling's state: per FP8 module, for its three forward and two backward
    tensors, an fp32 amax history plus a scale and an inverse scale."""
    return FP32_BYTES * inst_modules * (AMAX_TENSORS_FWD + AMAX_TENSORS_BWD) * (history_len + 2)


def unique_weights(instances: list[BlockInstance], tied: bool):
    """(instance, weight index) pairs, counting a tied table once when both ends are here."""
    has_embedding = any(i.kind == "embedding" for i in instances)
    for inst in instances:
        for j, ws in enumerate(inst.compiled.sharded.weight_syncs):
            if tied and has_embedding and inst.kind == "head" and ws.weight.name == "word_embedding":
                continue
            yield inst, j


def replicas(degrees: dict[str, int], axes: tuple[str, ...]) -> int:
    """How many ranks hold a replica of a weight (the size of its data-parallel group)."""
    return math.prod(degrees[a] for a in axes)


def block_params(instances: list[BlockInstance], tied: bool, as_bytes: bool = False
                  ) -> dict[tuple[str, tuple[str, ...]], float]:
    """Parameters per rank of each block (or their bytes as stored: bf16, or FP8 parameters),
    by the data-parallel axes that replicate them."""
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for inst, j in unique_weights(instances, tied):
        ws = inst.compiled.sharded.weight_syncs[j]
        key = (inst.label, ws.replicas)
        out[key] = out.get(key, 0.0) + inst.costs.weight_params[j] * (ws.param_bytes if as_bytes else 1)
    return out


def training_memory(instances: list[BlockInstance], order: list[Pass], chunks: dict[int, list[BlockInstance]], *,
            zero: int, degrees: dict[str, int], tied: bool) -> StageMemory:
    """Peak memory of a rank: model states (ZeRO divides each weight's over its own
    data-parallel group), activations held under the schedule, workspace."""
    from stage_cosim.schedule.pipeline import peak_in_flight

    layer_params: dict[tuple[str, ...], float] = {}
    other_params: dict[tuple[str, ...], float] = {}
    stored: dict[tuple[str, ...], float] = {}            # bytes of the weights as stored
    layer_stored: dict[tuple[str, ...], float] = {}
    for inst, j in unique_weights(instances, tied):
        into = layer_params if inst.kind == "layer" else other_params
        ws = inst.compiled.sharded.weight_syncs[j]
        into[ws.replicas] = into.get(ws.replicas, 0.0) + inst.costs.weight_params[j]
        nbytes = inst.costs.weight_params[j] * ws.param_bytes
        stored[ws.replicas] = stored.get(ws.replicas, 0.0) + nbytes
        if inst.kind == "layer":
            layer_stored[ws.replicas] = layer_stored.get(ws.replicas, 0.0) + nbytes

    def divisor(dp: int, from_stage: int) -> int:
        return dp if zero >= from_stage else 1

    def total(params: dict[tuple[str, ...], float], nbytes: int, from_stage: int) -> float:
        """Bytes of one kind of model state: ZeRO stage ``from_stage`` on shards it."""
        return sum(n * nbytes / divisor(replicas(degrees, axes), from_stage) for axes, n in params.items())

    def states(params: dict[tuple[str, ...], float], weight_bytes: dict[tuple[str, ...], float]) -> float:
        out = 0.0
        for axes, n in params.items():
            dp = replicas(degrees, axes)
            out += (weight_bytes.get(axes, 0.0) / divisor(dp, 3)
                    + n * (GRAD_BYTES / divisor(dp, 2) + OPTIMIZER_BYTES / divisor(dp, 1)))
        return out

    other_stored = {axes: v - layer_stored.get(axes, 0.0) for axes, v in stored.items()}

    params = {axes: layer_params.get(axes, 0.0) + other_params.get(axes, 0.0)
              for axes in dict.fromkeys([*layer_params, *other_params])}
    saved = {c: sum(i.costs.saved_bytes for i in insts) for c, insts in chunks.items()}
    activations = peak_in_flight(order, saved)
    workspace = max((i.costs.workspace_bytes + i.costs.exchange_bytes for i in instances), default=0.0)
    if zero >= 3:
        # The gathered weights of the block in use and of the one being prefetched.
        biggest = max((sum(n * ws.param_bytes for n, ws in zip(i.costs.weight_params, i.compiled.sharded.weight_syncs))
                       for i in instances), default=0.0)
        workspace += 2 * biggest
    # FP8: the quantized weights kept from the first micro-batch on, and delayed scaling's state
    cache = sum(i.costs.cached_bytes for i in instances)
    history = sum(amax_history_bytes(i.compiled.sharded.fp8_modules, i.compiled.sharded.policy.precision.amax_history_len)
                  for i in instances if i.compiled.sharded.policy.precision.delayed)
    return StageMemory(
        weights=ceil_int(sum(v / divisor(replicas(degrees, axes), 3) for axes, v in stored.items())),
        gradients=ceil_int(total(params, GRAD_BYTES, 2)),
        optimizer=ceil_int(total(params, OPTIMIZER_BYTES, 1)), activations=ceil_int(activations),
        workspace=ceil_int(workspace), states_layers=ceil_int(states(layer_params, layer_stored)),
        states_embedding_head=ceil_int(states(other_params, other_stored)),
        fp8_weight_cache=ceil_int(cache), fp8_amax_history=ceil_int(history))


def inference_memory(instances: list[BlockInstance], num_microbatches: int, tied: bool,
                      overlapped: list[BlockInstance] | None = None) -> StageMemory:
    """Memory of a rank in an inference step: the weights (no gradients, no optimizer, no
    activations held for a backward), the KV cache of every micro-batch's requests, and the
    largest forward working set of one block (with two-batch overlap, ``overlapped`` are the
    second micro-batch's blocks: its cache too, and both working sets at once)."""
    layer = other = 0.0
    for inst, j in unique_weights(instances, tied):
        ws = inst.compiled.sharded.weight_syncs[j]
        nbytes = inst.costs.weight_params[j] * ws.param_bytes   # as the weights are stored
        if inst.kind == "layer":
            layer += nbytes
        else:
            other += nbytes
    kv = sum(i.costs.cache_bytes for i in [*instances, *(overlapped or ())]) * num_microbatches
    # (with the attention exchange's buffers: context parallelism's ring or gathered keys)
    workspace = sum(max((i.costs.workspace_bytes + i.costs.exchange_bytes for i in insts), default=0.0)
                    for insts in (instances, overlapped) if insts)
    return StageMemory(weights=ceil_int(layer + other), gradients=0, optimizer=0, activations=0,
                       workspace=ceil_int(workspace), states_layers=ceil_int(layer), states_embedding_head=ceil_int(other),
                       kv_cache=ceil_int(kv))
