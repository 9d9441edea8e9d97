"""Compute-node time on a GPU: a roofline with calibrated efficiencies.

    t = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + kernel overhead

GEMMs run on tensor cores: achievable = peak * matmul_efficiency * F / (F + matmul_half_flops),
so small GEMMs fall off smoothly (wave quantization, launch). Fused (flash) attention kernels
reach their own fraction of peak, attention_efficiency (softmax and masking inside the kernel
keep them below GEMMs). Everything else runs at the vector (CUDA-core) rate. Memory-bound
kernels reach peak HBM bandwidth * memory_efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage_cosim.hardware.gpu import GPU


@dataclass(frozen=True)
class ComputeModel:
    gpu: GPU

    def duration_s(self, flops: float, nbytes: float, matmul: bool, attention: bool = False) -> float:
        g = self.gpu
        if attention and flops > 0:
            rate = g.bf16_tflops * 1e12 * g.attention_efficiency
        elif matmul and flops > 0:
            rate = g.bf16_tflops * 1e12 * g.matmul_efficiency * flops / (flops + g.matmul_half_flops)
        else:
            rate = g.vector_peak_tflops * 1e12
        t_flops = flops / rate if flops > 0 else 0.0
        t_mem = nbytes / (g.hbm_GBps * 1e9 * g.memory_efficiency)
        return max(t_flops, t_mem) + g.kernel_overhead_us * 1e-6

    def duration_of(self, flops: float, nbytes: float, op_kind: str) -> float:
        """:meth:`duration_s` for a kernel named by its ``op_kind`` (matmul, attention, vector)."""
        return self.duration_s(flops, nbytes, op_kind == "matmul", op_kind == "attention")
