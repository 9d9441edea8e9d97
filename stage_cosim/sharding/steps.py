"""A sharded block's program and the policy it is built under: the propagation's input
(:class:`ShardingPolicy`) and output (:class:`ShardedBlock`: one rank's steps forward and
backward, :class:`Step`, and its weights' gradient reductions, :class:`WeightSync`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import sympy as sp

from stage_cosim.graph.ir import Block, Tensor
from stage_cosim.graph.precision import BF16, Precision
from stage_cosim.parallel.config import RECOMPUTE
from stage_cosim.sharding.placement import Collective


@dataclass(frozen=True)
class ShardingPolicy:
    """The execution choices that change a block's sharded program (not its sizes)."""

    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    # Megatron accumulates and reduces bf16 training's gradients in fp32 by default.
    grad_reduce_dtype: str = "fp32"
    # BF16, or the FP8 recipe that rewrites the layers' GEMMs and inserts their casts.
    precision: Precision = BF16
    moe_token_dispatcher: str = "alltoall"
    # The attention exchange over cp (numbers, because they decide how many steps there are):
    # ranks passing K/V round a ring, ranks swapping heads for sequence by all-to-all (1, 1:
    # the placement rules' all-gather of K and V), and whether the sequence is load-balanced.
    cp_ring: int = 1
    cp_a2a: int = 1
    cp_load_balance: bool = True

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0..3, got {self.zero}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute}")
        if self.cp_ring < 1 or self.cp_a2a < 1:
            raise ValueError(f"cp_ring and cp_a2a must be positive, got {self.cp_ring}, {self.cp_a2a}")


@dataclass
class Step:
    """One node of a rank's program: a compute kernel or a collective."""

    index: int
    name: str
    phase: str                 # "fwd", "bwd" or "recompute"
    kind: str                  # "compute", "collective", "send" or "recv"
    category: str              # compute: the op kind; communication: its group's name
    flops: sp.Expr
    model_flops: sp.Expr
    mem_bytes: sp.Expr         # bytes read plus written
    deps: tuple[int, ...]
    collective: Collective | None = None
    axes: tuple[str, ...] = ()  # collective: the mesh axes its group spans
    comm_bytes: sp.Expr = sp.Integer(0)
    # Matmul-class kernels: the tensor-core number format ("bf16", "fp8", "mxfp8"); "" for
    # every other kernel. (Truthy exactly for the FLOPs the published formulas count.)
    matmul: str = ""
    # A grouped GEMM: this many equal GEMMs in one kernel (one per local expert), each as
    # efficient as its own shape allows. A fused attention kernel: the rows of work its thread
    # blocks split (:func:`~stage_cosim.sharding.context_parallel.attention_rows`), which
    # decide how many SMs it keeps busy.
    groups: sp.Expr = sp.Integer(1)
    prologue: bool = False     # gathers the block's weights (ZeRO-3): may run a block ahead
    first_microbatch: bool = False   # runs in the first micro-batch's forward only (FP8 weight cache)
    # send / recv: the peer's coordinate on the first of ``axes``, relative to this rank's, and
    # which send/recv pair of the pass this is (a send and the receive it feeds share it)
    peer: int = 0
    pair: int = -1
    # fused attention kernels: the length of each thread block's loop as a share of the layer's
    # keys (the sequence, or its window): the keys each query sees in this kernel (a step of the
    # ring: a chunk, or half of one); 0 for other steps
    key_share: float = 0.0


@dataclass(frozen=True)
class WeightSync:
    """One weight's gradient reductions, once per step after the last micro-batch's backward
    (from where the backward leaves the gradient to where the optimizer wants it)."""

    weight: Tensor
    params: sp.Expr                                       # elements held per rank before ZeRO
    # (the mesh axes of its group, collective, bytes), in order
    grad_collectives: tuple[tuple[tuple[str, ...], Collective, sp.Expr], ...]
    replicas: tuple[str, ...]                             # the data-parallel axes ZeRO shards over
    param_bytes: float = 2.0                              # bytes per parameter as stored (bf16; FP8 params)


@dataclass
class ShardedBlock:
    block: Block
    policy: ShardingPolicy
    fwd: list[Step]
    bwd: list[Step]
    fwd_exit: tuple[int, ...]          # steps that produce the block's output
    bwd_exit: tuple[int, ...]          # steps that produce the gradient of the block's input
    saved_bytes: sp.Expr               # activations kept from forward to backward, one micro-batch
    workspace_bytes: sp.Expr           # transient activations while recomputing (full recompute)
    weight_syncs: list[WeightSync]
    boundary_bytes: sp.Expr            # the output activation (and its gradient) on one rank
    # FP8: the quantized weight copies kept across micro-batches, and the number of FP8 modules
    # (GEMMs, FP8 attention) that each keep a scaling state.
    cached_bytes: sp.Expr = sp.Integer(0)
    fp8_modules: int = 0
    cache_bytes: sp.Expr = sp.Integer(0)   # the KV cache an inference step reads, on one rank
    # transient buffers of the attention exchange (ring receive buffers, gathered K/V)
    exchange_bytes: sp.Expr = sp.Integer(0)


def iter_steps(sb: ShardedBlock) -> Iterable[Step]:
    yield from sb.fwd
    yield from sb.bwd
