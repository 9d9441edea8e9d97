"""Kernel costs of inference steps (serving) from measured microbenchmarks, not from the training fit.

The training calibration prices a GEMM at ``peak · efficiency · F / (F + half_flops)``: a knee
fitted to training steps, whose GEMMs are all large. A serving step's GEMMs are mostly small
in one dimension (the step's tokens) and large in the others (the weights), so that knee turns
into a floor per GEMM (on A100, 31 GFLOP: every decode GEMM ≥ ~130 µs whatever its size) that
tensor parallelism cannot shrink and every MoE expert pays again. Here a GEMM of F FLOPs moving
B bytes costs

    max(F / rate(F), B / achievable HBM bandwidth) + kernel overhead

with ``rate(F)`` the GPU's measured GEMM throughput at that size (the microbenchmark table,
interpolated in log F; outside the measured sizes, the nearest measured rate: never a
per-kernel floor), and the achievable bandwidth the measured STREAM triad bandwidth. A GPU or number format without measurements falls back to the record's peak ·
``matmul_efficiency`` (its large-GEMM asymptote) and ``hbm_GBps · memory_efficiency``.
Every other kernel of the step (attention, norms, the KV-cache writes) moves its bytes at the
same measured bandwidth, so a step has one HBM rate; their compute side (attention's FLOP rate,
the vector rate) is the training model's.

Every inference step is priced this way (:func:`step_compute_model`): ``simulate --phase``,
``serve-sim`` and the serving search give the same step the same time.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from stage_cosim.adapters.roofline.compute import ATTENTION_FLAVOURS, ComputeModel
from stage_cosim.hardware.gpu import GPU, MATMUL_PEAKS, gpu_records


def _format_of(dtype: str) -> str | None:
    """The number format of a microbenchmark row's dtype (fp16 runs at the BF16 rate)."""
    d = dtype.lower()
    if d in ("fp16", "bf16"):
        return "bf16"
    if d.startswith("fp8"):
        return "fp8"
    if d.startswith("fp4"):
        return "fp4"
    return None


def _table(name: str) -> list[dict[str, str]]:
    with resources.files("stage_cosim.validation").joinpath("data", name).open() as f:
        return list(csv.DictReader(f))


@lru_cache(maxsize=None)
def gemm_points(part: str, fmt: str) -> tuple[tuple[float, float], ...]:
    """(GEMM FLOPs, measured FLOP/s) of ``part`` in ``fmt``, by size (the best row per size)."""
    best: dict[float, float] = {}
    for r in _table("gemm_microbench.csv"):
        if r["gpu"] != part or _format_of(r["dtype"]) != fmt or not r.get("tflops"):
            continue
        groups = int(r["groups"]) if r.get("groups") else 1
        f = 2.0 * int(r["m"]) * int(r["n"]) * int(r["k"]) * int(r["batch"] or 1) / groups
        best[f] = max(best.get(f, 0.0), float(r["tflops"]) * 1e12)
    # the envelope: a larger GEMM runs at least as fast as a smaller one could (an odd skinny
    # shape measured at one size does not make every GEMM of that size slow)
    out: list[tuple[float, float]] = []
    for f, rate in sorted(best.items()):
        if not out or rate > out[-1][1]:
            out.append((f, rate))
    return tuple(out)


@lru_cache(maxsize=None)
def hbm_Bps(part: str) -> float | None:
    """The measured STREAM triad bandwidth of ``part`` (B/s; the best run where several are
    published), or None: a kernel that reads two streams and writes one, as a GEMM's operands
    and result move."""
    rates = [float(r["bandwidth_tbps"]) * 1e12 for r in _table("hbm_bandwidth.csv")
             if r["gpu"] == part and r["kernel"] == "triad"]
    return max(rates) if rates else None


#: The attention_microbench.csv rows each attention flavour's rates come from (implementation).
FLAVOUR_ROWS = {"flashmla": "FlashMLA dense MLA decode"}


@lru_cache(maxsize=None)
def flavour_rates(flavour: str, arch: str) -> tuple[float | None, float | None]:
    """(share of the BF16 tensor-core peak, share of the HBM peak) that attention ``flavour``'s
    kernel measures on a GPU of ``arch`` (its best row of each: a compute-bound FLOP rate, a
    memory-bound bandwidth), or None where no such GPU measured it. Shares, not rates: the
    kernel is written for its architecture (FlashMLA: SM90), so an H100 or H200 runs it as the
    H800 that measured it does, at their own peaks."""
    by_part = {r.get("part"): r for r in gpu_records().values()}
    compute = memory = None
    for r in _table("attention_microbench.csv"):
        rec = by_part.get(r["gpu"])
        if r["implementation"] != FLAVOUR_ROWS[flavour] or rec is None or rec["arch"] != arch:
            continue
        if r["tflops"]:
            share = float(r["tflops"]) / rec["bf16_tflops"]
            compute = max(compute or 0.0, share)
        if r["achieved_mem_gbps"]:
            share = float(r["achieved_mem_gbps"]) / rec["hbm_GBps"]
            memory = max(memory or 0.0, share)
    return compute, memory


def measured_rate(points: tuple[tuple[float, float], ...], flops: float) -> float:
    """The measured rate at ``flops``: linear in log F between measured sizes, the nearest
    measured one outside them."""
    if flops <= points[0][0]:
        return points[0][1]
    if flops >= points[-1][0]:
        return points[-1][1]
    for (f0, r0), (f1, r1) in zip(points, points[1:]):
        if f0 <= flops <= f1:
            x = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return r0 + x * (r1 - r0)
    return points[-1][1]   # pragma: no cover - the loop covers every size in range


def part_of(gpu: GPU) -> str | None:
    """The data-sheet name the microbenchmark tables use for ``gpu`` (None: not a shipped record)."""
    return gpu_records().get(gpu.name, {}).get("part")


@dataclass(frozen=True)
class InferenceComputeModel(ComputeModel):
    """The training compute model with GEMMs priced by the measured tables (see the module).

    The tables measure a shipped part at its data-sheet peaks; what this GPU gets is their
    fraction of those peaks applied to its own, so a GPU whose peaks a design exploration varies
    (``gpu.hbm_GBps``, ``gpu.bf16_tflops``, ...) scales with them, and the shipped part is priced
    at exactly its measurements."""

    _hbm: float = field(init=False, repr=False, compare=False)
    _part: str = field(init=False, repr=False, compare=False)
    # this GPU's tensor-core peak per number format over its shipped record's (1 unless an
    # exploration varies it)
    _peak_ratio: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        g = self.gpu
        part = part_of(g) or ""
        object.__setattr__(self, "_part", part)
        record = gpu_records()[g.name] if part else {}
        measured = hbm_Bps(part) if part else None
        hbm = (measured * (g.hbm_GBps / record["hbm_GBps"]) if measured else super().memory_bandwidth)
        object.__setattr__(self, "_hbm", hbm)
        ratios = {}
        for fmt, key in MATMUL_PEAKS.items():
            shipped, own = record.get(key), g.peak_tflops(fmt)
            ratios[fmt] = own / shipped if shipped and own else 1.0
        object.__setattr__(self, "_peak_ratio", ratios)

    @property
    def memory_bandwidth(self) -> float:
        """The measured STREAM triad rate, scaled to this GPU's HBM peak: every kernel of an
        inference step moves its bytes at it (the decode attention's KV cache above all:
        FlashMLA's memory-bound decode reaches 3,000 GB/s on an H800, about the triad)."""
        return self._hbm

    def attention_rate(self, fmt: str, keys: float = 0.0, rows: float = 0.0) -> float:
        """A flavour's measured rate where its kernel was measured on this architecture (no shape
        terms: FlashMLA splits the keys over the SMs itself, and its rows are the headline of a
        long-context decode, the shape it serves); else the training model's fused attention."""
        if fmt in ATTENTION_FLAVOURS:
            share = flavour_rates(fmt, self.gpu.arch)[0]
            if share is not None:
                return share * self.gpu.peak_tflops(ATTENTION_FLAVOURS[fmt]) * 1e12
        return super().attention_rate(fmt, keys, rows)

    def attention_bandwidth(self, fmt: str) -> float:
        """A flavour's measured bandwidth where its kernel was measured on this architecture (as
        a share of the HBM peak); else the step's one measured rate."""
        if fmt in ATTENTION_FLAVOURS:
            share = flavour_rates(fmt, self.gpu.arch)[1]
            if share is not None:
                return share * self.gpu.hbm_GBps * 1e9
        return self._hbm

    def matmul_rate(self, flops: float, fmt: str) -> float:
        g = self.gpu
        points = gemm_points(self._part, fmt) if self._part else ()
        if points:
            # a grouped GEMM (an MoE layer's local experts) runs each group at its own size's
            # rate (duration_s asks for it), all in one kernel: one launch, no floor per expert
            return measured_rate(points, flops) * self._peak_ratio[fmt]
        peak = g.peak_tflops(fmt)
        if peak is None:
            raise ValueError(f"{g.name} has no {fmt} tensor cores")
        eff = g.matmul_efficiency if fmt == "bf16" else g.fp8_matmul_efficiency
        return peak * 1e12 * eff


def step_compute_model(gpu: GPU, inference: bool, software: str | None = None) -> ComputeModel:
    """The kernel model of a step: for an inference step (``simulate --phase prefill|decode``,
    a serving run's steps, the serving search) GEMMs from the measured microbenchmarks, so that
    one step has one time whichever command asks; for a training step the training fit, which
    the published training runs calibrate, with the kernels of the step's software profile
    ``software`` (its own efficiencies in the GPU's record, :meth:`GPU.for_software`)."""
    return InferenceComputeModel(gpu) if inference else ComputeModel(gpu.for_software(software))


def traces_compute_model(gpu: GPU, manifest: dict | None) -> ComputeModel:
    """:func:`step_compute_model` of the step written traces hold, as their manifest describes
    it (an inference step's say so; a training step's name their software profile)."""
    manifest = manifest or {}
    return step_compute_model(gpu, bool(manifest.get("inference")), (manifest.get("parallel") or {}).get("software"))
