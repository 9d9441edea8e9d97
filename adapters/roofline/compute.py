"""Compute-node time on a GPU: a roofline with calibrated efficiencies.

    t = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + kernel overhead

Matmul-class kernels (GEMMs, attention) run on tensor cores: achievable = peak *
matmul_efficiency * F / (F + matmul_half_flops), so small GEMMs fall off smoothly (wave
quantization, launch). Everything else runs at the vector (CUDA-core) rate. Memory-bound
kernels reach peak HBM bandwidth * memory_efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage_cosim.hardware.gpu import GPU


@dataclass(frozen=True)
class ComputeModel:
    gpu: GPU

    def duration_s(self, flops: float, nbytes: float, matmul: bool) -> float:
        g = self.gpu
        if matmul and flops > 0:
            rate = g.bf16_tflops * 1e12 * g.matmul_efficiency * flops / (flops + g.matmul_half_flops)
        else:
            rate = g.vector_peak_tflops * 1e12
        t_flops = flops / rate if flops > 0 else 0.0
        t_mem = nbytes / (g.hbm_GBps * 1e9 * g.memory_efficiency)
        return max(t_flops, t_mem) + g.kernel_overhead_us * 1e-6
