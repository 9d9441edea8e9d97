"""Compute-node time on a GPU: a roofline with calibrated efficiencies.

    t = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + kernel overhead

GEMMs run on tensor cores at the dense peak of their number format (BF16, or FP8 / MXFP8 for
the GEMMs an FP8 recipe quantizes): achievable = peak * efficiency * F / (F + half_flops), so
small GEMMs fall off smoothly (wave quantization, launch); a grouped GEMM of g equal GEMMs (the
local experts of an MoE layer) reaches what one GEMM of F/g does, so small experts fall off too.
FP8 GEMMs have their own efficiency and half-efficiency size. Fused (flash) attention kernels
reach their own fraction of peak, attention_efficiency, of the format they compute in (softmax
and masking inside the kernel keep them below GEMMs), times two shape terms:

* k / (k + attention_half_keys) for a kernel whose thread blocks each loop over k keys (a
  query tile's fixed prologue and epilogue amortize over its loop: the chunks of ring
  attention run slower than one kernel over the whole sequence);
* min(1, tiles / SMs), tiles = ceil(rows / attention_block_rows): FlashAttention gives each
  thread block one tile of 128 rows — queries forward (its grid is query blocks x batch x
  heads), keys backward (key blocks x batch x heads) — one block per SM (FlashAttention-3 on
  Hopper; FlashAttention-2's smaller Ampere blocks can pair up on an SM, not modelled), so a
  kernel over fewer rows than that leaves SMs idle for its whole length (a ring step over
  s/(2cp) queries of a few heads). A partial last wave is not charged: causal tiles differ in length
  and are issued longest first, so the short ones fill it.

The kernel's rows come in ``groups`` (for a GEMM: the equal GEMMs of a grouped GEMM); a kernel
that does not say (``groups`` <= 1: another generator's trace, an inference engine's kernel,
which splits the keys over thread blocks when its queries are too few) gets no occupancy term.
Everything else runs at the vector (CUDA-core) rate. Memory-bound kernels reach peak
HBM bandwidth * memory_efficiency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stage_cosim.graph.ir import ATTENTION_KINDS
from stage_cosim.hardware.gpu import GPU


#: Attention kernels with a rate of their own, named by the op in place of its number format,
#: with the format their tensor cores compute in: multi-latent attention's absorbed decode runs
#: DeepSeek's FlashMLA (BF16 MMA over a cache of one shared 576-wide latent "head"), whose
#: measured rates (attention_microbench.csv) are far from FlashAttention's on the same GPU.
ATTENTION_FLAVOURS = {"flashmla": "bf16"}


def matmul_format(matmul: bool | str) -> str:
    """The number format of a compute node's tensor-core work ('' for none). Nodes carry it as a
    format name; ``True`` (a matmul of unknown format, e.g. from a foreign trace) means BF16. An
    attention flavour (``ATTENTION_FLAVOURS``) comes back as itself: the kernel rates resolve it."""
    if matmul is True:
        return "bf16"
    return matmul or ""


@dataclass(frozen=True)
class ComputeModel:
    gpu: GPU
    # SM sharing: a compute kernel runs at the share of the SMs the collectives running beside
    # it on its rank leave free (comm_sms.py). Off by default: the shipped calibration was fitted
    # without it.
    comm_sm_sharing: bool = False

    def matmul_rate(self, flops: float, fmt: str) -> float:
        """Achievable FLOP/s of one GEMM of ``flops`` in number format ``fmt``."""
        g = self.gpu
        peak = g.peak_tflops(fmt)
        if peak is None:
            raise ValueError(f"{g.name} has no {fmt} tensor cores")
        if fmt == "bf16":
            eff, half = g.matmul_efficiency, g.matmul_half_flops
        else:
            eff, half = g.fp8_matmul_efficiency, g.fp8_matmul_half_flops
        return peak * 1e12 * eff * flops / (flops + half)

    def attention_rate(self, fmt: str, keys: float = 0.0, rows: float = 0.0) -> float:
        """Achievable FLOP/s of a fused attention kernel whose thread blocks loop over ``keys``
        and which splits ``rows`` rows of work over them (0: not known)."""
        g = self.gpu
        # a flavour runs here as the generic kernel in its format: the training model has no
        # kernel of its own (the inference model's rates do: kernels.py)
        rate = g.peak_tflops(ATTENTION_FLAVOURS.get(fmt, fmt) or "bf16") * 1e12 * g.attention_efficiency
        if keys > 0:
            rate *= keys / (keys + g.attention_half_keys)
        if rows > 1 and g.sm_count:
            rate *= min(1.0, math.ceil(rows / g.attention_block_rows) / g.sm_count)
        return rate

    @property
    def memory_bandwidth(self) -> float:
        """B/s a memory-bound kernel reaches: peak HBM bandwidth * memory_efficiency."""
        g = self.gpu
        return g.hbm_GBps * 1e9 * g.memory_efficiency

    def attention_bandwidth(self, fmt: str) -> float:
        """B/s a fused attention kernel of format (or flavour) ``fmt`` streams its inputs at."""
        return self.memory_bandwidth

    def duration_s(self, flops: float, nbytes: float, matmul: bool | str, attention: bool = False,
                   groups: int = 1, keys: float = 0.0) -> float:
        """``groups``: the equal GEMMs of a grouped GEMM (each runs at its own shape's rate), or
        for fused attention the rows its thread blocks split; ``keys``: for fused attention,
        the length of each thread block's loop (the keys each query sees in this kernel)."""
        g = self.gpu
        fmt = matmul_format(matmul)
        if attention and flops > 0:
            rate = self.attention_rate(fmt, keys, groups)
        elif fmt and flops > 0:
            rate = self.matmul_rate(flops / max(1, groups), fmt)
        else:
            rate = g.vector_peak_tflops * 1e12
        t_flops = flops / rate if flops > 0 else 0.0
        t_mem = nbytes / (self.attention_bandwidth(fmt) if attention else self.memory_bandwidth)
        return max(t_flops, t_mem) + g.kernel_overhead_us * 1e-6

    def row_duration_s(self, memo: dict, flops: int, nbytes: int, matmul: bool | str, category: str,
                       groups: int, keys: int) -> float:
        """:meth:`duration_s` of a compute row of a role graph (its category names fused
        attention), remembered in ``memo`` under what it depends on: a step repeats the same
        kernels many times over, and the replays, the fast path and the search's bounds time them
        alike through this one method."""
        attention = category in ATTENTION_KINDS
        key = (flops, nbytes, matmul, attention, groups, keys)
        d = memo.get(key)
        if d is None:
            d = memo[key] = self.duration_s(flops, nbytes, matmul, attention, groups, keys)
        return d

    def duration_of(self, flops: float, nbytes: float, op_kind: str, groups: int = 1, keys: float = 0.0) -> float:
        """:meth:`duration_s` for a kernel named by its ``op_kind`` (matmul, attention, vector;
        with the number format where it is not BF16: matmul_fp8 …) and, for attention, the keys
        each query sees in it and its rows of work (in ``groups``)."""
        from stage_cosim.schedule.nodes import parse_op_kind

        base, fmt = parse_op_kind(op_kind)
        return self.duration_s(flops, nbytes, fmt, base == "attention", groups, keys)

    def node_duration_s(self, node) -> float:  # noqa: ANN001 (a role graph's Node)
        """The time of one compute node of a role graph."""
        from stage_cosim.schedule.nodes import op_kind

        return self.duration_of(node.flops, node.mem_bytes, op_kind(node.category, node.matmul), node.groups,
                                node.keys)
