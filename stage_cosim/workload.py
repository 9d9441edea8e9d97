"""Synthesis: a model and a parallel configuration become a Workload (one graph per role).

model ──► blocks (symbolic graph, forward + derived backward)
      ──► sharded blocks (placements, collectives inferred; compiled once per architecture)
      ──► role graphs (pipeline schedule, ZeRO, step-end reductions; one per pipeline stage)
      ──► per-rank views (communicator groups and pipeline peers resolved on demand)
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cached_property
from typing import Any

from stage_cosim.errors import UserError, require
from stage_cosim.graph.dims import B, S, T, W, degree_symbol, model_values
from stage_cosim.graph.precision import BF16, Precision, inference_precision, resolve_precision
from stage_cosim.inference.config import BatchShape, InferenceConfig
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel.axes import (
    BLOCK_AXES, DENSE, EXPERT, GROUP, GROUP_KINDS, MESHES, PIPELINE_AXIS, group_mesh, peer_axis, resolve_group,
)
from stage_cosim.parallel.config import ParallelConfig
from stage_cosim.parallel.mesh import DeviceMesh
from stage_cosim.gc_pause import gc_paused
from stage_cosim.schedule.memory import StageMemory
from stage_cosim.schedule.nodes import COLL, COMP, PP_GROUP, RECV, SEND, RoleGraph
from stage_cosim.schedule.program import ModelBlocks, build_role, stage_memory
from stage_cosim.sharding.numeric import BlockCosts, CompiledBlock, compiled_blocks, compiled_inference_blocks
from stage_cosim.sharding.steps import ShardingPolicy


class Workload:
    """Everything synthesis knows about one training step on every rank.

    Role graphs (one per pipeline stage) are built on first use: asking for a stage's memory
    or a single role does not build the others.
    """

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, meshes: dict[str, DeviceMesh],
                 role_args: dict[str, Any], precision: Precision = BF16, inference: InferenceConfig | None = None,
                 shape: BatchShape | None = None) -> None:
        self.model = model
        self.parallel = parallel
        self.meshes = meshes
        self.mesh = meshes[DENSE]        # the dense mesh names the ranks (the expert mesh re-factors them)
        self.precision = precision
        self._role_args = role_args
        self._roles: dict[int, RoleGraph] = {}
        # An inference step (None: a training step) and the shape of each of its micro-batches.
        self.inference = inference
        self.shape = shape

    def check_gpu(self, gpu: "GPU") -> None:  # noqa: F821
        """The workload's FP8 kernels must be those ``gpu`` runs (its recipe default and operand
        layouts): a workload synthesized for one GPU is not simulated on another."""
        if self.inference is not None:
            inference_precision(self.inference.weight_dtype, gpu)     # what the GPU cannot run is refused
            return
        if not self.precision.fp8:
            return
        want = resolve_precision(self.parallel, gpu)
        if want != self.precision:
            def says(p: Precision) -> str:
                return f"{p.recipe} {'with' if p.transposes else 'without'} transposed FP8 copies"

            raise UserError("cluster", f"the workload's FP8 kernels are {says(self.precision)}, but {gpu.name} "
                                       f"runs {says(want)}: synthesize it for this cluster's GPU")

    @property
    def two_batch(self) -> bool:
        """An inference step whose passes each run two micro-batches at once (two-batch overlap)."""
        return self._role_args.get("overlapped") is not None

    def role(self, stage: int) -> RoleGraph:
        if stage not in self._roles:
            with gc_paused():
                self._roles[stage] = build_role(stage, **self._role_args)
        return self._roles[stage]

    @property
    def roles(self) -> list[RoleGraph]:
        return [self.role(s) for s in range(self.parallel.pp)]

    def memory(self, stage: int, cluster: "Cluster | None" = None) -> StageMemory:  # noqa: F821
        """Peak memory of a rank of ``stage``; on ``cluster`` with the process's own memory
        (CUDA context, cuBLAS workspaces, NCCL buffers, fragmentation: ``runtime``), which
        depends on the GPU and on where the rank's peers are."""
        base = self._roles[stage].memory if stage in self._roles else stage_memory(stage, **self._role_args)
        if cluster is None:
            return base
        from stage_cosim.process_memory import runtime_memory

        return base.with_runtime(runtime_memory(self, stage, cluster, base))

    def stage_layers(self, stage: int) -> list[int]:
        """The model layers a stage holds (every chunk of it)."""
        counts = self._role_args["layers_per_vstage"]
        pp, vp = self._role_args["pp"], self._role_args["vp"]
        out: list[int] = []
        for c in range(vp):
            vs = c * pp + stage
            start = sum(counts[:vs])
            out += range(start, start + counts[vs])
        return out

    def kv_cache_bytes_per_token(self, stage: int) -> float:
        """An inference step: the KV cache one token of one sequence occupies on a rank of
        ``stage`` (a sliding-window layer holds only the last ``window`` tokens)."""
        return sum(self.kv_cache_bytes_per_token_by_window(stage).values())

    def kv_cache_bytes_per_token_by_window(self, stage: int) -> dict[int | None, float]:
        """An inference step: the KV cache bytes one cached token of one sequence takes on a
        rank of ``stage``, summed over the layers of each attention window (None: global)."""
        blocks: ModelBlocks = self._role_args["blocks"]
        kv = dict(self.shape.kv_tokens) if self.shape is not None else {}
        out: dict[int | None, float] = {}
        for i in self.stage_layers(stage):
            window = self.model.layer_window(i)
            costs = blocks.layers[i][1]
            if kv.get(window) and costs.cache_bytes - costs.state_bytes > 1e-9 * costs.cache_bytes:
                # an SSM layer's fixed state is not per token (state_bytes_per_sequence)
                out[window] = out.get(window, 0.0) + (costs.cache_bytes - costs.state_bytes) / kv[window]
        return out

    def state_bytes_per_sequence(self, stage: int) -> float:
        """An inference step: the fixed state one sequence holds on a rank of ``stage`` whatever
        its length (the scan state and convolution window of each SSM layer; 0 without)."""
        blocks: ModelBlocks = self._role_args["blocks"]
        if self.shape is None or not self.shape.sequences:
            return 0.0
        return sum(blocks.layers[i][1].state_bytes for i in self.stage_layers(stage)) / self.shape.sequences

    # -- ranks and groups ---------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def role_of(self, rank: int) -> int:
        return self.mesh.coord(rank, PIPELINE_AXIS)

    @cached_property
    def group_base(self) -> dict[str, int]:
        """First communicator-group id of each kind in use (ids are 1-based; 0 means all
        ranks), kind by kind in :data:`~stage_cosim.parallel.axes.GROUP_KINDS` order."""
        base, nxt = {}, 1
        for kind in GROUP_KINDS:
            if self._group_kind_used(kind.name):
                base[kind.name] = nxt
                nxt += self._group_count(kind.name)
        return base

    def _mesh(self, kind: str) -> DeviceMesh:
        return self.meshes[group_mesh(kind)]

    def _group_count(self, kind: str) -> int:
        along = math.prod(self._mesh(kind).size[a] for a in GROUP[kind].axes)
        # mirror pairs: along/2 of them in each line of the axis (along is even: DualPipe's pp)
        return self.world_size // along * (along // 2 if GROUP[kind].mirror else 1)

    def _line(self, rank: int, kind: str) -> list[int]:
        """The members of ``rank``'s group along a mirror kind's axis, in coordinate order."""
        mesh, (axis,) = self._mesh(kind), GROUP[kind].axes
        return sorted(mesh.group_members(rank, axis), key=lambda m: mesh.coord(m, axis))

    @staticmethod
    def _pairs(line: list[int]) -> list[list[int]]:
        """A line's mirror pairs, positions i and n-1-i, by i (each pair in coordinate order)."""
        return [[line[i], line[-1 - i]] for i in range(len(line) // 2)]

    @property
    def group_kinds(self) -> list[str]:
        """The communicator-group kinds this workload's collectives run on."""
        return list(self.group_base)

    def _group_kind_used(self, kind: str) -> bool:
        if GROUP[kind].endpoints:   # the embedding group of the first and last stage
            return self.model.shares_embedding and self.parallel.pp > 1 and self.inference is None
        if GROUP[kind].mirror:      # DualPipe's two parameter copies
            return self.parallel.schedule == "dualpipe" and self.parallel.pp > 1 and self.inference is None
        if group_mesh(kind) == EXPERT and not self.model.is_moe:
            return False
        if GROUP[kind].on_demand:
            return kind in self._groups_in_passes
        # what a collective over the kind's axes runs on (a dp-and-cp group with cp = 1 is dp's)
        return resolve_group(GROUP[kind].axes, self._mesh(kind).size) == kind

    @cached_property
    def _groups_in_passes(self) -> set[str]:
        """The communicator groups the pass templates' collectives run on."""
        return {r[9] for role in self.roles for t in role.templates.values() for r in t.generated_rows() if r[1] == COLL}

    def group_id(self, rank: int, kind: str) -> int:
        g, mesh = GROUP[kind], self._mesh(kind)
        index = mesh.group_index(rank, g.axes)
        if g.mirror:        # the line's pairs are numbered by their first position
            n = mesh.size[g.axes[0]]
            c = mesh.coord(rank, g.axes[0])
            index = index * (n // 2) + min(c, n - 1 - c)
        return self.group_base[kind] + index

    def group_members(self, rank: int, kind: str) -> list[int]:
        g = GROUP[kind]
        if g.mirror:
            line = self._line(rank, kind)
            c = line.index(rank)
            return self._pairs(line)[min(c, len(line) - 1 - c)]
        members = self._mesh(kind).group_members(rank, g.axes)
        return [members[0], members[-1]] if g.endpoints else members

    def communicator_groups(self) -> dict[str, list[int]]:
        """Every group id -> its ranks (the communicator-group file)."""
        out: dict[str, list[int]] = {}
        for kind, base in self.group_base.items():
            g = GROUP[kind]
            if g.mirror:
                mesh, (axis,) = self._mesh(kind), g.axes
                lines = [sorted(m, key=lambda r: mesh.coord(r, axis)) for m in mesh.groups(g.axes)]
                for i, pair in enumerate(p for line in lines for p in self._pairs(line)):
                    out[str(base + i)] = pair
                continue
            for i, members in enumerate(self._mesh(kind).groups(g.axes)):
                out[str(base + i)] = [members[0], members[-1]] if g.endpoints else members
        return out

    def group_counts(self) -> dict[str, int]:
        """How many communicator groups of each kind, in id order (ids are consecutive from 1,
        kind by kind)."""
        return {kind: self._group_count(kind) for kind in self.group_base}

    def peer(self, rank: int, delta: int, kind: str = PIPELINE_AXIS) -> int:
        """The peer of a send or receive of communication kind ``kind`` (the pipeline's, or the
        attention exchange's ring over cp) ``delta`` coordinates away."""
        return self.mesh.shift(rank, peer_axis(kind), delta)

    # -- summaries ----------------------------------------------------------------------------

    def role_summary(self, stage: int) -> dict[str, Any]:
        role = self.role(stage)
        flops = model_flops = matmul_flops = mem = 0
        comm: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        counts: dict[str, int] = defaultdict(int)
        for n in role.nodes:
            counts[n.type] += 1
            if n.type == COMP:
                flops += n.flops
                model_flops += n.model_flops
                matmul_flops += n.flops if n.matmul else 0
                mem += n.mem_bytes
            elif n.type == COLL:
                comm[n.group][n.coll.value] += n.comm_bytes
            elif n.type in (SEND, RECV):
                comm[n.group or PP_GROUP][n.type] += n.comm_bytes
        return {
            "stage": stage,
            "ranks": self.world_size // self.parallel.pp,
            "layers": [min(role.layers), max(role.layers)] if role.layers else [],
            "num_layers": len(role.layers),
            "nodes": dict(sorted(counts.items())),
            "flops": flops,
            "matmul_flops": matmul_flops,
            "model_flops": model_flops,
            "memory_bytes_moved": mem,
            "comm_bytes": {g: dict(sorted(v.items())) for g, v in sorted(comm.items())},
            "peak_memory_bytes": role.memory.to_dict(),
        }

    @cached_property
    def _flop_totals(self) -> tuple[int, int, int]:
        matmul = executed = model = 0
        for role in self.roles:
            e, m, mm = role.compute_totals()
            executed, model, matmul = executed + e, model + m, matmul + mm
        ranks = self.world_size // self.parallel.pp     # every rank of a stage runs its graph
        return matmul * ranks, executed * ranks, model * ranks

    def total_matmul_flops(self) -> int:
        """Matmul FLOPs of one step summed over every rank."""
        return self._flop_totals[0]

    def total_executed_flops(self) -> int:
        """Every FLOP of one step (recomputation included) summed over every rank."""
        return self._flop_totals[1]

    def total_model_flops(self) -> int:
        """Model FLOPs of one step (the published formulas' convention) over every rank."""
        return self._flop_totals[2]


DEFAULT_GPU = "H100-SXM"      # the GPU FP8 kernels are laid out for when no GPU is given


def precision_for(parallel: ParallelConfig, gpu: "GPU | None" = None) -> Precision:  # noqa: F821
    """The precision ``parallel`` asks for, as ``gpu`` (by default an H100) runs it."""
    if parallel.dtype == "bf16":
        return BF16
    from stage_cosim.hardware.gpu import get_gpu

    return resolve_precision(parallel, gpu if gpu is not None else get_gpu(DEFAULT_GPU))


def training_blocks(model: ModelConfig, parallel: ParallelConfig, precision: Precision,
                    cache: dict | None = None) -> ModelBlocks:
    """The compiled blocks of a training step of ``model`` under ``parallel`` bound to their numbers
    (the embedding, every layer, the head): what :func:`synthesize` builds the stages from, and
    what a search bounds a configuration's compute with, without its graphs.

    ``cache`` (a dict the caller keeps for this one ``model``, e.g. for the lifetime of a search)
    holds what many configurations share: the model's layer kinds and switches, its copy with
    each padded vocabulary, each policy's compiled blocks, and each block bound to each set of
    numbers (the model, micro-batch, sequence, window, expert load and degrees: everything its
    numbers are made of). Every entry is what an uncached call computes, so the blocks are the
    same to the bit; only how often each piece is computed changes."""
    memo: dict = {} if cache is None else cache
    if memo.setdefault(("model",), model) is not model and memo[("model",)] != model:
        raise ValueError("a training-blocks cache serves one model")

    def once(key: tuple, make: Any) -> Any:
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = make()
        return hit

    def arch() -> tuple:
        switches = model.switches()
        kinds = tuple(zip(model.layer_kinds(), model.layer_windows()))
        # each distinct layer kind ((mixer, MLP) kind; global attention or each sliding window)
        # is evaluated once
        return switches, kinds, tuple(dict.fromkeys(kinds)), tuple((a, degree_symbol(a)) for a in BLOCK_AXES)

    switches, kinds, distinct, axes = once(("arch",), arch)
    hybrid = switches.hybrid_kinds
    vocab = parallel.padded_vocab(model.vocab)
    padded = once(("padded", vocab), lambda: model.with_overrides(vocab=vocab))
    policy = ShardingPolicy(sp=parallel.sp, zero=parallel.zero, recompute=parallel.recompute,
                            grad_reduce_dtype=parallel.grad_reduce_dtype, precision=precision,
                            moe_token_dispatcher=parallel.moe_token_dispatcher if model.is_moe else "alltoall",
                            cp_ring=parallel.cp_ring, cp_a2a=parallel.cp_a2a,
                            cp_load_balance=parallel.cp_load_balance or parallel.cp == 1)
    compiled = once(("compiled", policy), lambda: compiled_blocks(switches, policy))
    degrees = parallel.degrees()
    # what a block's numbers are made of besides the model (the types too: an int and a float
    # that compare equal may round differently)
    numbers = (vocab, parallel.micro_batch, parallel.seq_len, parallel.moe_load, type(parallel.moe_load),
               tuple(degrees[a] for a, _ in axes))

    def bind(window: int | None) -> dict:
        values = model_values(padded, parallel.micro_batch, parallel.seq_len, window, parallel.moe_load)
        for axis, symbol in axes:
            values[symbol] = degrees[axis]
        return values

    def costs(block: CompiledBlock, window: int | None = None) -> BlockCosts:
        def make() -> BlockCosts:
            return block.evaluate(once(("values", numbers, window, type(window)), lambda: bind(window)))

        # (the compiled block is held by its policy's entry: its id is not reused)
        return once(("costs", id(block), numbers, window, type(window)), make)

    layer_costs = {(k, w): costs(compiled.block(k, hybrid), w) for k, w in distinct}
    layer_blocks = once(("layers", policy), lambda: tuple(compiled.block(k, hybrid) for k, _ in kinds))
    return ModelBlocks((compiled.embedding, costs(compiled.embedding)),
                       tuple(zip(layer_blocks, map(layer_costs.__getitem__, kinds))),
                       (compiled.head, costs(compiled.head)))


def synthesize(model: ModelConfig, parallel: ParallelConfig, gpu: "GPU | None" = None, *,  # noqa: F821
               precision: Precision | None = None, inference: InferenceConfig | None = None) -> Workload:
    """Build the role graphs of one training step of ``model`` under ``parallel`` (or, with
    ``inference``, of one prefill or decode step).

    ``gpu`` matters for FP8 only (the default recipe, and whether FP8 GEMMs need transposed
    operand copies): the kernels are those for that GPU (by default an H100). ``precision``,
    already resolved for a GPU, may be given instead."""
    if inference is not None:
        par = inference.parallel(parallel, model)
        par.check_against(model, training=False)
        if model.position == "learned":
            require(inference.context <= model.max_seq, "context-len" if inference.phase == "decode" else "input-len",
                    f"must not exceed the model's learned positions ({model.max_seq}), got {inference.context}")
        inference_precision(inference.weight_dtype, gpu)     # what the GPU cannot run is refused
        return synthesize_step(model, par, inference.shape(par.micro_batch, set(model.layer_windows())),
                               inference.kv_cache_dtype, inference)
    parallel.check_against(model)
    if precision is None:
        precision = precision_for(parallel, gpu)
    blocks = training_blocks(model, parallel, precision)
    degrees = parallel.degrees()
    orders = parallel.mesh_orders()
    meshes = {DENSE: DeviceMesh.build({a: degrees[a] for a in MESHES[DENSE]}, orders[DENSE],
                                      parallel.mesh_splits())}
    if model.is_moe:
        meshes[EXPERT] = DeviceMesh.build({a: degrees[a] for a in MESHES[EXPERT]}, orders[EXPERT])
    role_args = dict(pp=parallel.pp, vp=parallel.vp, schedule=parallel.schedule,
                     num_microbatches=parallel.num_microbatches,
                     layers_per_vstage=parallel.layers_per_stage(model.layers), blocks=blocks,
                     zero=parallel.zero, tied_embeddings=model.shares_embedding,
                     degrees=degrees | dict(meshes[DENSE].size), overlap_param_gather=parallel.overlap_param_gather,
                     tp_comm_overlap=parallel.tp_comm_overlap, overlap_grad_reduce=parallel.overlap_grad_reduce,
                     block_cache={})
    return Workload(model, parallel, meshes, role_args, precision)


def step_symbol_values(model: ModelConfig, parallel: ParallelConfig, window: int | None = None) -> dict:
    """An inference step's symbols bound to numbers for a layer with ``window``: everything but
    the batch shape's (b sequences, s new tokens each, t cached tokens each, w keys per query)."""
    padded = model.with_overrides(vocab=parallel.padded_vocab(model.vocab))
    values = model_values(padded, 1, 1, window, parallel.moe_load)
    for symbol in (B, S, T, W):
        del values[symbol]
    degrees = parallel.degrees()
    for axis in BLOCK_AXES:
        values[degree_symbol(axis)] = degrees[axis]
    return values


def synthesize_step(model: ModelConfig, parallel: ParallelConfig, shape: BatchShape, kv_cache_dtype: str = "bf16",
                    inference: InferenceConfig | None = None) -> Workload:
    """The role graphs of one inference step whose every micro-batch has ``shape``: the
    forward passes of ``parallel.num_microbatches`` micro-batches (``parallel`` as
    :meth:`InferenceConfig.parallel` makes it), each layer reading its KV cache, the weights
    in ``inference.weight_dtype``. Latent attention runs absorbed where every sequence has one
    new token (a decode step), expanded from the cached latents otherwise."""
    precision = (inference_precision(inference.weight_dtype, activation_scale=inference.fp8_activation_scale)
                 if inference is not None else inference_precision("bf16"))
    policy = ShardingPolicy(precision=precision,
                            moe_token_dispatcher=parallel.moe_token_dispatcher if model.is_moe else "alltoall",
                            cp_ring=parallel.cp_ring, cp_a2a=parallel.cp_a2a,
                            cp_load_balance=parallel.cp_load_balance or parallel.cp == 1)
    compiled = compiled_inference_blocks(model.switches(), policy, kv_cache_dtype,
                                         absorb=model.multi_latent_attention and shape.tokens == shape.sequences)
    degrees = parallel.degrees()

    bound: dict[int | None, dict] = {}

    def costs(block: CompiledBlock, shape: BatchShape, window: int | None = None, *, attends: bool = False
              ) -> BlockCosts:
        if window not in bound:
            bound[window] = step_symbol_values(model, parallel, window)
        values = dict(bound[window])
        b, s, t, w = shape.symbols(window) if attends else (shape.sequences, shape.tokens / shape.sequences, 1, 1)
        values.update({B: b, S: s, T: t, W: w})
        return block.evaluate(values)

    hybrid = model.switches().hybrid_kinds
    kinds = list(zip(model.layer_kinds(), model.layer_windows()))

    def model_blocks(shape: BatchShape) -> ModelBlocks:
        layer_costs = {(k, w): costs(compiled.block(k, hybrid), shape, w, attends=True) for k, w in set(kinds)}
        return ModelBlocks((compiled.embedding, costs(compiled.embedding, shape)),
                           tuple((compiled.block(k, hybrid), layer_costs[(k, w)]) for k, w in kinds),
                           (compiled.head, costs(compiled.head, shape)))

    # two-batch overlap: the micro-batch runs as two whose passes share the rank (a micro-batch of
    # one sequence cannot be split and runs whole)
    overlap = inference is not None and inference.two_batch_overlap and shape.sequences >= 2
    halves = shape.halves() if overlap else (shape,)
    blocks = model_blocks(halves[0])
    orders = parallel.mesh_orders()
    meshes = {DENSE: DeviceMesh.build({a: degrees[a] for a in MESHES[DENSE]}, orders[DENSE], parallel.mesh_splits())}
    if model.is_moe:
        meshes[EXPERT] = DeviceMesh.build({a: degrees[a] for a in MESHES[EXPERT]}, orders[EXPERT])
    role_args = dict(pp=parallel.pp, vp=1, schedule=parallel.schedule, num_microbatches=parallel.num_microbatches,
                     layers_per_vstage=parallel.layers_per_stage(model.layers), blocks=blocks, zero=0,
                     tied_embeddings=model.shares_embedding, degrees=degrees, inference=True,
                     overlapped=model_blocks(halves[1]) if overlap else None, block_cache={})
    return Workload(model, parallel, meshes, role_args, precision, inference, halves[0])
