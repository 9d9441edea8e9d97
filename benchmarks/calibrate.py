"""Fit each GPU family's efficiency parameters, bottom-up, and say how well the fit holds out.

    python benchmarks/calibrate.py                 # fit and print (about 5 minutes on 2 cores)
    python benchmarks/calibrate.py --write         # and store it in the GPU records (hardware/data/gpus)
    python benchmarks/calibrate.py --family A100   # one family
    python benchmarks/calibrate.py --loo           # also leave-one-out per end-to-end row (slow)
    python benchmarks/calibrate.py --family H100 --sm-sharing
        # an experiment, never written: the end-to-end fit with SM sharing between
        # collectives and compute on (adapters/roofline/comm_sms.py)

1. **Components first.** Every parameter a microbenchmark pins is fitted to the microbenchmark
   rows of the family's own GPUs (stage_cosim/validation/components.py), and fixed:
   HBM streaming (BabelStream) -> memory_efficiency; GEMM sweeps (cuBLASLt, DeepGEMM) ->
   the GEMM efficiency and its small-GEMM half size per dtype; NCCL ring bus bandwidth in one
   node -> scale_up_efficiency, across nodes -> scale_out_efficiency; FlashAttention-2 ->
   a floor for attention_efficiency; the kernel the family's end-to-end runs use (H100: cuDNN's
   causal fused attention, forward and backward, from the FlashAttention-3 paper's comparison)
   -> attention_efficiency and attention_half_keys. Each file's error per row is printed (rows
   outside the model's scope are counted and named, not fitted).
2. **End to end, only what no microbenchmark pins**: the fixed cost per kernel; the training
   factor, the share of their microbenchmark rates that the tensor-core kernels (GEMMs of both
   formats, fused attention) keep in a training step (one for all: a GPU below its
   microbenchmark clocks under a sustained load; where no BF16 sweep exists, as on H100, the
   BF16 rate is the MAMF search's best shape); and where a family lacks a component measurement
   (H100 has no InfiniBand NCCL table) that component, bounded by what the microbenchmarks do
   say (attention at least FlashAttention-2's where the runs' own kernel is not measured). One
   parameter set for all the family's rows, each row run with its published layout alone (its
   software profile's defaults for the rest).
3. **Held out**: leave-one-source-out (refit without a source, predict it) where a family has
   several sources, leave-one-out per row with --loo; and a last line ``parameters on a bound:
   N``. A parameter on its bound is a mechanism the model lacks, not a bound to widen.

``--write`` stores the fit in every GPU record of the family (benchmarks/calibration_records.py):
each value with its source; a software profile's own attention set under efficiencies.<profile>.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np
from scipy.optimize import least_squares

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.fast import simulate_fast
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.adapters.roofline.routing import TokenRouting
from stage_cosim.adapters.roofline.simulate import make_network, simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import family_efficiencies, get_gpu
from stage_cosim.parallel.software import get_software, software_names

from stage_cosim.validation import components as comp
from stage_cosim.validation.published import (TrainingRun, korthikanti_table5, megatron_core_weak_scaling,
                                              nemo2407_fp8_h100)
from stage_cosim.workload import synthesize

from calibration_records import ProfileSets, write_records

CLUSTER_OF = {"korthikanti2022": "dgx-a100", "megatron-core-0.8": "dgx-h100", "nemo24.07_fp8_h100": "dgx-h100"}
FAMILY_OF = {"dgx-a100": "A100", "dgx-h100": "H100"}          # the families with end-to-end tables
FAMILIES = ("A100", "H100", "B200")
PRESET_OF_FAMILY = {"A100": "A100-80GB", "H100": "H100-SXM", "B200": "B200"}
PARAMS = ("matmul_efficiency", "matmul_half_flops", "attention_efficiency", "memory_efficiency",
          "kernel_overhead_us", "scale_up_efficiency", "scale_out_efficiency",
          "fp8_matmul_efficiency", "fp8_matmul_half_flops", "attention_half_keys")
# Physical ranges: an efficiency is a fraction of a peak; a half size between a tiny and a huge
# kernel; a fixed cost per kernel between a kernel boundary (even back to back in one stream,
# or replayed from a CUDA graph, one grid drains before the next fills the SMs: about a
# microsecond) and a slow launch.
BOUNDS = {"matmul_efficiency": (0.3, 1.0), "matmul_half_flops": (1e7, 1e12), "attention_efficiency": (0.1, 1.0),
          "memory_efficiency": (0.5, 1.0), "kernel_overhead_us": (1.0, 20.0), "scale_up_efficiency": (0.3, 1.0),
          "scale_out_efficiency": (0.3, 1.0), "fp8_matmul_efficiency": (0.3, 1.0),
          "fp8_matmul_half_flops": (1e7, 1e12), "attention_half_keys": (0.0, 16384.0),
          "training_factor": (0.3, 1.0)}
# The tensor-core kernels whose in-training rate is their microbenchmark rate times one factor
# (end_to_end_box): GEMMs in both number formats and fused attention.
TENSOR_CORE = ("matmul_efficiency", "fp8_matmul_efficiency", "attention_efficiency")
LOG_PARAMS = {"matmul_half_flops", "fp8_matmul_half_flops"}
# The attention kernel of the end-to-end tables' frameworks (Megatron-Core 0.8 and NeMo 24.07
# through Transformer Engine, which picks cuDNN's fused attention over FlashAttention on Hopper)
ATTENTION_KERNEL = {"kernel": "cudnn", "name": "cuDNN"}


# -- end-to-end rows ------------------------------------------------------------------------------


def runs_for(cluster: str) -> list[TrainingRun]:
    """Every published row measured on ``cluster``'s GPU family, the ones the fit uses."""
    runs = korthikanti_table5() + megatron_core_weak_scaling() + nemo2407_fp8_h100()
    return [r for r in runs if CLUSTER_OF[r.source] == cluster]


def cluster_of(run: TrainingRun) -> str:
    return run.cluster or CLUSTER_OF[run.source]


@lru_cache(maxsize=None)
def _workload(run: TrainingRun):
    w = synthesize(run.model, run.parallel(), resolve_cluster(cluster_of(run), run.gpus).gpu)
    _ = w.roles  # build every stage once; the fit re-simulates them many times
    return w


# The --sm-sharing experiment: every end-to-end row simulated with SM sharing between
# collectives and compute (ComputeModel.comm_sm_sharing), which the shipped simulator leaves off.
SM_SHARING = {"on": False}


def predict(run: TrainingRun, params: dict[str, float] | None = None) -> float:
    cluster = resolve_cluster(cluster_of(run), run.gpus)
    if params:
        cluster = replace(cluster, gpu=cluster.gpu.with_overrides(**params))
    if SM_SHARING["on"]:
        w = _workload(run)
        network = make_network("calibrated", cluster, TokenRouting.of(w.model, w.parallel))
        finishes, _ = simulate_fast(w, network, ComputeModel(cluster.gpu.for_software(w.parallel.software),
                                                                  comm_sm_sharing=True))
        return max(finishes)
    result, _, _ = simulate(_workload(run), cluster)
    return result.step_time_s


# -- a bounded least-squares fit of some parameters -----------------------------------------------


@dataclass(frozen=True)
class Box:
    """Parameters ``names`` as a vector (log10 where LOG_PARAMS says) within ``bounds``."""

    names: tuple[str, ...]
    bounds: dict[str, tuple[float, float]]

    def _coord(self, n: str, v: float) -> float:
        return float(np.log10(v)) if n in LOG_PARAMS else float(v)

    @property
    def lo(self) -> np.ndarray:
        return np.array([self._coord(n, self.bounds[n][0]) for n in self.names])

    @property
    def hi(self) -> np.ndarray:
        return np.array([self._coord(n, self.bounds[n][1]) for n in self.names])

    def vector(self, values: dict[str, float]) -> np.ndarray:
        x = np.array([self._coord(n, values[n]) for n in self.names])
        margin = 1e-6 * (self.hi - self.lo)
        return np.clip(x, self.lo + margin, self.hi - margin)

    def values(self, x: np.ndarray) -> dict[str, float]:
        return {n: float(10 ** v if n in LOG_PARAMS else v) for n, v in zip(self.names, x)}

    def on_bound(self, values: dict[str, float]) -> list[str]:
        """The parameters within 0.5 % of the box's width of a bound."""
        out = []
        for n, lo, hi in zip(self.names, self.lo, self.hi):
            v = self._coord(n, values[n])
            if min(v - lo, hi - v) <= 0.005 * (hi - lo):
                out.append(n)
        return out


def fit_box(box: Box, start: dict[str, float], residuals: Callable[[dict[str, float]], np.ndarray],
            max_nfev: int = 60) -> dict[str, float]:
    """Least squares of ``residuals`` (relative errors) over ``box``, from ``start``, with a robust
    loss (about linear beyond 5 %: one row the model cannot explain does not drag every
    parameter towards it)."""
    if not box.names:
        return {}
    res = least_squares(lambda x: residuals(box.values(x)), box.vector(start), bounds=(box.lo, box.hi),
                        diff_step=1e-3, x_scale=box.hi - box.lo, max_nfev=max_nfev, loss="soft_l1", f_scale=0.05)
    return box.values(res.x)


# -- 1. components ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComponentFit:
    """One microbenchmark file's share of a family's fit: the parameters it pins and the rows."""

    file: str
    params: tuple[str, ...]
    rows: tuple                       # the file's rows of the family's GPUs
    predict: Callable                 # (row, parameters) -> the model's figure for the row
    measured: Callable                # row -> the row's figure
    # The rows measure an older kernel than the software profiles run (FlashAttention-2 where
    # Megatron-Core and NeMo run cuDNN's fused attention): the fitted value is a floor for the
    # parameter, not its value.
    floor: bool = False

    def in_scope(self) -> list:
        return [r for r in self.rows if not getattr(r, "scope", "")]

    def errors(self, params: dict[str, float], rows: list | None = None) -> np.ndarray:
        rows = self.in_scope() if rows is None else rows
        return np.array([self.predict(r, params) / self.measured(r) - 1 for r in rows])

    def fit(self, params: dict[str, float]) -> dict[str, float]:
        """Its parameters fitted to its rows, every other parameter at ``params``."""
        fixed = dict(params)
        return fit_box(Box(self.params, BOUNDS), fixed, lambda v: self.errors(fixed | v), max_nfev=200)


def _gpu(row_gpu: str, params: dict[str, float]):
    return get_gpu(comp.PRESET_OF_GPU[row_gpu]).with_overrides(**params)


def _network(row: "comp.NcclRow | comp.AllToAllRow", params: dict[str, float]) -> CalibratedNetwork:
    """The network of the preset a communication microbenchmark ran on, with ``params``: one
    domain of the row's GPUs, or 8-GPU nodes."""
    gpus = row.per_node if row.nodes == 1 else 8 * row.nodes
    cluster = resolve_cluster(comp.CLUSTER_OF_GPU[row.gpu], gpus)
    return CalibratedNetwork(replace(cluster, gpu=cluster.gpu.with_overrides(**params)))


def _nccl_predict(row: comp.NcclRow, params: dict[str, float]) -> float:
    return comp.nccl_busbw(row, _network(row, params))


def _alltoall_predict(row: comp.AllToAllRow, params: dict[str, float]) -> float:
    return comp.alltoall_gbps(row, _network(row, params))


def component_fits(family: str) -> list[ComponentFit]:
    def mine(rows: tuple) -> tuple:
        return tuple(r for r in rows if comp.FAMILY_OF_GPU[r.gpu] == family)

    gemm = mine(comp.gemm_rows())
    fits = [
        ComponentFit("hbm_bandwidth.csv", ("memory_efficiency",),
                     tuple(r for r in mine(comp.hbm_rows()) if comp.PRESET_OF_GPU[r.gpu] == PRESET_OF_FAMILY[family]),
                     lambda r, p: comp.hbm_tbps(_gpu(r.gpu, p)), lambda r: r.tbps),
        ComponentFit("gemm_microbench.csv (BF16/FP16)", ("matmul_efficiency", "matmul_half_flops"),
                     tuple(r for r in gemm if r.fmt == "bf16"),
                     lambda r, p: comp.gemm_tflops(r, _gpu(r.gpu, p)), lambda r: r.tflops),
        ComponentFit("gemm_microbench.csv (FP8)", ("fp8_matmul_efficiency", "fp8_matmul_half_flops"),
                     # H200's rows run at another power limit and clocks: H100 and H800 only
                     tuple(r for r in gemm if r.fmt == "fp8" and r.gpu != "H200-SXM-141GB"),
                     lambda r, p: comp.gemm_tflops(r, _gpu(r.gpu, p)), lambda r: r.tflops),
        ComponentFit("nccl_busbw.csv (one node)", ("scale_up_efficiency",),
                     tuple(r for r in mine(comp.nccl_rows()) if r.nodes == 1),
                     _nccl_predict, lambda r: r.busbw_gbps),
        ComponentFit("nccl_busbw.csv (across nodes, one GPU each)", ("scale_out_efficiency",),
                     tuple(r for r in mine(comp.nccl_rows()) if r.per_node == 1 and r.nodes > 1),
                     _nccl_predict, lambda r: r.busbw_gbps),
        ComponentFit("moe_alltoall_microbench.csv (DeepEP normal kernels: a check, fitted to nothing)", (),
                     mine(comp.alltoall_rows()), _alltoall_predict, lambda r: r.gbps),
        ComponentFit("attention_microbench.csv (FlashAttention-2)", ("attention_efficiency",),
                     mine(comp.attention_rows()),
                     lambda r, p: comp.attention_tflops(r, _gpu(r.gpu, p)), lambda r: r.tflops, floor=True),
        ComponentFit("attention_kernels_h100.csv (FlashAttention-2 without a mask, fwd+bwd: the floor, a second source)",
                     ("attention_efficiency", "attention_half_keys"),
                     mine(comp.training_attention_rows("flash_attn_2", causal=False)),
                     lambda r, p: comp.attention_tflops(r, _gpu(r.gpu, p)), lambda r: r.tflops, floor=True),
        # The kernel the end-to-end rows run: Megatron-Core and NeMo train through Transformer
        # Engine, which prefers cuDNN's fused attention on Hopper, causal (its backward's mask
        # taken to cost what the forward's does: the source measures it without one). A causal
        # kernel's rate falls off with its length far sooner than an unmasked one's (its
        # diagonal tiles are partly masked, its loops half as long on average): the half-rate
        # key length is fitted with it, to the causal kernels training runs.
        ComponentFit(f"attention_kernels_h100.csv ({ATTENTION_KERNEL['name']}, causal fwd+bwd: the runs' kernel)",
                     ("attention_efficiency", "attention_half_keys"),
                     mine(comp.training_attention_rows(ATTENTION_KERNEL["kernel"], causal=True)),
                     lambda r, p: comp.attention_tflops(r, _gpu(r.gpu, p)), lambda r: r.tflops),
    ]
    return [f for f in fits if f.in_scope()]


def component_sources(comps: "Components") -> dict[str, str]:
    """The source --write records beside each parameter the components pin (floors pin none)."""
    return {p: f"microbenchmark fit: {f.file}, rows of {' + '.join(sorted({r.gpu for r in f.in_scope()}))}"
            for f in comps.fits if not f.floor for p in f.params}


class Components(NamedTuple):
    params: dict[str, float]          # every parameter: the pinned ones fitted, the rest as given
    fits: list[ComponentFit]
    # what the files' rows give their parameters (floors included) as each file's fit left
    # them: its own, and the earlier files' for the parameters it does not fit
    by_file: dict[str, dict[str, float]]

    @property
    def values(self) -> dict[str, float]:
        """What the files' rows give their parameters, the later file's where two fit one."""
        return self.by_file[self.fits[-1].file] if self.fits else {}

    @property
    def pinned(self) -> set[str]:
        """The parameters a microbenchmark pins (a floor file pins none)."""
        return {p for f in self.fits if not f.floor for p in f.params}


def fit_components(family: str, base: dict[str, float]) -> Components:
    """The parameters the family's microbenchmarks pin, fitted file by file (in order: the HBM
    rate first, which the GEMM and attention rows' memory-bound parts use); a floor file's
    value is kept apart, the parameter stays as given."""
    params, values, by_file = dict(base), {}, {}
    fits = component_fits(family)
    for f in fits:
        fitted = f.fit(params)
        values |= fitted
        by_file[f.file] = dict(values)
        if not f.floor:
            params |= fitted
    return Components(params, fits, by_file)


# -- 2. end to end ----------------------------------------------------------------------------------


def end_to_end_box(family: str, comps: Components) -> Box:
    """What no microbenchmark of ``family`` pins, with the bounds the microbenchmarks imply:
    the fixed cost per kernel; the share of their microbenchmark rates the tensor-core kernels
    keep in training (``training_factor``: one for GEMMs of both formats and attention, as
    sustained clocks under an 8-GPU load would take; a microbenchmark runs a kernel alone, in
    bursts); and a component no microbenchmark of the family measures (attention where no
    measurement of the runs' kernel exists, at least FlashAttention-2's; scale-out where no
    nccl-tests sweep across nodes does)."""
    runs = runs_for(_cluster(family))
    names = ["kernel_overhead_us", "training_factor"]
    bounds = dict(BOUNDS)
    uses = {"attention_efficiency": any(r.model.attention == "fused" for r in runs),
            "scale_out_efficiency": any(r.gpus > 8 for r in runs)}
    for p, used in uses.items():
        if used and p not in comps.pinned:
            names.append(p)
    if "attention_efficiency" in names and "attention_efficiency" in comps.values:
        bounds["attention_efficiency"] = (comps.values["attention_efficiency"], BOUNDS["attention_efficiency"][1])
    return Box(tuple(names), bounds)


def microbenchmark_rates(family: str, comps: Components) -> dict[str, float]:
    """The tensor-core efficiencies of ``family``'s microbenchmarks, which the training factor
    scales: each component fit's, and for the BF16 GEMM without a sweep the best shape of the
    MAMF search."""
    rates = {p: comps.params[p] for p in TENSOR_CORE if p in comps.pinned}
    if "matmul_efficiency" not in rates:
        rates["matmul_efficiency"] = bf16_ceiling(family)
    return rates


def in_training(family: str, pinned: dict[str, float], rates: dict[str, float], v: dict[str, float]
                ) -> dict[str, float]:
    """The GPU parameters of an end-to-end point ``v``: the pinned ones, ``v``'s own, and each
    microbenchmark rate in ``rates`` times ``v``'s training factor (a free attention efficiency
    is already an in-training one)."""
    f = v["training_factor"]
    out = pinned | {k: x for k, x in v.items() if k != "training_factor"}
    out |= {k: x * f for k, x in rates.items() if k not in v}
    return derived(family, out)


def bf16_ceiling(family: str) -> float:
    """The best BF16 GEMM efficiency the family's MAMF searches found (each row against its own
    GPU's peak)."""
    return max(r.tflops / get_gpu(comp.PRESET_OF_GPU[r.gpu]).bf16_tflops for r in comp.gemm_rows()
               if comp.FAMILY_OF_GPU[r.gpu] == family and r.fmt == "bf16" and r.scope.startswith("best"))


# A family without an end-to-end table takes its tensor cores' in-training rates from its own
# microbenchmarks times what a reference family, run by the same frameworks and kernel
# libraries, keeps of its microbenchmark rates in its fitted end-to-end set (the H100 family's
# GEMMs run at about 0.81 of their microbenchmark rates in training, BF16 and FP8 alike: see
# docs/validation.md#bottom-up). Without it a Blackwell GEMM would run at its full
# microbenchmark rate where a Hopper one runs at 0.81 of its own.
CARRY_OVER = {"B200": "H100"}


def carried_over(family: str, comps: Components) -> dict[str, float]:
    """The GEMM efficiencies of ``family`` carried over from its CARRY_OVER reference (none if
    it has none): its microbenchmark value times the reference's shipped / microbenchmark ratio."""
    ref = CARRY_OVER.get(family)
    if ref is None:
        return {}
    shipped = family_efficiencies(ref)
    ref_values = fit_components(ref, shipped).values
    out = {"matmul_efficiency": bf16_ceiling(family) * shipped["matmul_efficiency"] / bf16_ceiling(ref)}
    if "fp8_matmul_efficiency" in comps.values and "fp8_matmul_efficiency" in ref_values:
        out["fp8_matmul_efficiency"] = (comps.values["fp8_matmul_efficiency"] * shipped["fp8_matmul_efficiency"]
                                        / ref_values["fp8_matmul_efficiency"])
    return out


def software_sets(family: str, comps: Components, factor: float, factor_source: str) -> ProfileSets:
    """The attention efficiencies of each software profile whose release runs another fused
    attention kernel than the family's end-to-end tables (ATTENTION_KERNEL), from that kernel's
    microbenchmark on the family's GPUs, causal, forward and backward (attention_kernels_h100.csv;
    else attention_microbench.csv's FlashAttention-2 rows, which pin its efficiency alone),
    times the family's training ``factor`` (what its tensor-core kernels keep in training).
    A profile without a measurement of its kernel on the family runs the default set."""
    out: ProfileSets = {}
    for name in software_names():
        kernel = get_software(name).attention_kernel
        if kernel is None or kernel == ATTENTION_KERNEL["kernel"]:
            continue
        rows = tuple(r for r in comp.training_attention_rows(kernel, causal=True)
                     if comp.FAMILY_OF_GPU[r.gpu] == family)
        names, file = ("attention_efficiency", "attention_half_keys"), f"attention_kernels_h100.csv ({kernel}, causal fwd+bwd)"
        if not rows and kernel == "flash_attn_2":
            rows = tuple(r for r in comp.attention_rows() if comp.FAMILY_OF_GPU[r.gpu] == family)
            names, file = ("attention_efficiency",), "attention_microbench.csv (FlashAttention-2)"
        if not rows:
            continue
        fit = ComponentFit(file, names, rows, lambda r, p: comp.attention_tflops(r, _gpu(r.gpu, p)),
                           lambda r: r.tflops)
        v = fit.fit(comps.params)
        gpus = " + ".join(sorted({r.gpu for r in rows}))
        print(f"  software profile {name} (its attention: {kernel}): "
              + ", ".join(f"{n} {v[n]:.4g}" for n in names)
              + f" on {file}, rows of {gpus} ({_pct(fit.errors(comps.params | v))}); in training "
              f"attention_efficiency {v['attention_efficiency'] * factor:.4g}")
        src = f"microbenchmark fit: {file}, rows of {gpus}"
        out[name] = {"attention_efficiency": (v["attention_efficiency"] * factor,
                                              f"{src}, times {factor_source} {factor:.4g}")}
        if "attention_half_keys" in names:
            out[name]["attention_half_keys"] = (v["attention_half_keys"], src)
    return out


def _cluster(family: str) -> str | None:
    """The cluster of ``family``'s end-to-end tables (None: it has none)."""
    return {v: k for k, v in FAMILY_OF.items()}.get(family)


# The source --write records beside a parameter derived(family, ...) sets.
DERIVED = {"H100": {"matmul_half_flops": "derived: the FP8 GEMM's half size, at the same time per GEMM"}}


def derived(family: str, params: dict[str, float]) -> dict[str, float]:
    """Parameters that follow from others: without a BF16 GEMM sweep, the BF16 half size is
    the FP8 one's in time (a GEMM reaches half its rate after the same fixed time whatever its
    number format: launch, prologue, the first wave)."""
    if family == "H100":
        g = get_gpu(PRESET_OF_FAMILY[family])
        rate_bf16 = g.bf16_tflops * params["matmul_efficiency"]
        rate_fp8 = g.fp8_tflops * params["fp8_matmul_efficiency"]
        return params | {"matmul_half_flops": params["fp8_matmul_half_flops"] * rate_bf16 / rate_fp8}
    return params


def fit_end_to_end(family: str, pinned: dict[str, float], rates: dict[str, float], box: Box,
                   runs: list[TrainingRun], max_nfev: int = 40) -> tuple[dict[str, float], dict[str, float]]:
    """(the GPU parameters, the end-to-end values) that fit ``runs`` best."""
    def residuals(v: dict[str, float]) -> np.ndarray:
        p = in_training(family, pinned, rates, v)
        return np.array([predict(r, p) / r.measured_step_s - 1 for r in runs])

    v = fit_box(box, pinned | {"training_factor": 0.8}, residuals, max_nfev)
    return in_training(family, pinned, rates, v), v


def fit(cluster: str, exclude: int | None = None, start: dict[str, float] | None = None,
        max_nfev: int = 40, verbose: bool = False) -> dict[str, float]:
    """The whole fit of ``cluster``'s family (components, then end to end without row ``exclude``)."""
    family = FAMILY_OF[cluster]
    base = family_efficiencies(family) | (start or {})
    comps = fit_components(family, base)
    runs = [r for i, r in enumerate(runs_for(cluster)) if i != exclude]
    params, _ = fit_end_to_end(family, comps.params, microbenchmark_rates(family, comps),
                               end_to_end_box(family, comps), runs, max_nfev)
    return {k: params[k] for k in PARAMS}


# -- the report ---------------------------------------------------------------------------------------


def _pct(errs) -> str:
    errs = np.abs(np.asarray(errs))
    return f"mean |error| {100 * errs.mean():.1f} %, worst {100 * errs.max():.1f} % ({len(errs)} rows)"


def report_family(family: str, loo: bool) -> tuple[dict[str, float], dict[str, str], ProfileSets, int]:
    """Fit ``family`` and print the report: every parameter's value, the source of each one the
    fit pins (what --write stores), the software profiles' own attention sets, and how many
    parameters are on a bound."""
    cluster = _cluster(family)
    base = family_efficiencies(family)
    print(f"\n== {family} ==")
    comps = fit_components(family, base)
    pinned, fits = comps.params, comps.fits
    sources = component_sources(comps)
    on_bound: list[str] = []
    print("components (fitted to the microbenchmarks of the family's GPUs, then fixed):")
    for f in fits:
        box = Box(f.params, BOUNDS)
        mine = comps.by_file[f.file]
        on_bound += box.on_bound(mine)
        values = ", ".join(f"{n} {mine[n]:.4g} [{BOUNDS[n][0]:g}, {BOUNDS[n][1]:g}]" for n in f.params) \
            or "with the parameters above"
        out = [r for r in f.rows if getattr(r, "scope", "")]
        print(f"  {f.file}: {values}" + (" (a floor for the kernels the profiles run)" if f.floor else ""))
        print(f"      fitted rows: {_pct(f.errors(mine))}"
              + (f"; outside the model's scope: {len(out)} rows ({_pct(f.errors(mine, out))}; "
                 f"{sorted({r.scope for r in out})[0]} ...)" if out else ""))
    if cluster is None:
        # (no end-to-end table: the GEMMs' in-training rates carried over from a reference
        # family; what no microbenchmark pins keeps its hand-set default)
        carried = carried_over(family, comps)
        if carried:
            ref = CARRY_OVER[family]
            print(f"end to end: no published end-to-end table; carried over from {ref} (its shipped / "
                  f"microbenchmark ratio times this family's microbenchmark): "
                  + ", ".join(f"{p} {v:.4g}" for p, v in carried.items()))
            pinned = pinned | carried
            sources |= {p: f"derived: this family's microbenchmark ({'BF16 MAMF ceiling' if p == 'matmul_efficiency' else 'gemm_microbench.csv (FP8)'}) "
                           f"times the {ref} family's shipped / microbenchmark ratio" for p in carried}
        unpinned = [p for p in PARAMS if p not in comps.pinned | set(carried)]
        print(f"  not fitted, the defaults: {', '.join(f'{p} {pinned[p]:.4g}' for p in unpinned)}")
        profiles: ProfileSets = {}
        if carried:
            factor = carried["matmul_efficiency"] / bf16_ceiling(family)
            profiles = software_sets(family, comps, factor, f"the {ref} family's training factor")
        print(f"  on a bound: {', '.join(on_bound) if on_bound else 'none'}")
        # (only what the microbenchmarks pin is the family's; the rest stays the default section's)
        return {k: pinned[k] for k in PARAMS if k not in unpinned}, sources, profiles, len(on_bound)
    box = end_to_end_box(family, comps)
    rates = microbenchmark_rates(family, comps)
    runs = runs_for(cluster)
    params, v = fit_end_to_end(family, pinned, rates, box, runs)
    on_bound += box.on_bound(v)
    tables = ", ".join(dict.fromkeys(r.source for r in runs))
    scaled = [p for p in rates if p not in v]
    sources |= {p: f"end-to-end fit: {tables}" for p in box.names if p in PARAMS} | DERIVED.get(family, {})
    sources |= {p: f"end-to-end fit: {tables} (the in-training share {v['training_factor']:.4g} of the "
                   f"microbenchmark's {rates[p]:.4g})" for p in scaled}
    print("end to end (only what no microbenchmark pins):")
    print("  " + ", ".join(f"{n} {v[n]:.4g} [{box.bounds[n][0]:.3g}, {box.bounds[n][1]:.3g}]" for n in box.names))
    print("  in training: " + ", ".join(f"{p} {params[p]:.4g} (microbenchmark {rates[p]:.4g})" for p in scaled))
    by_source: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        by_source.setdefault(r.source, []).append(i)
    for source, idx in by_source.items():
        errs = [predict(runs[i], params) / runs[i].measured_step_s - 1 for i in idx]
        line = f"  {source}: fitted {_pct(errs)}"
        if len(by_source) > 1:
            held, _ = fit_end_to_end(family, pinned, rates, box, [r for j, r in enumerate(runs) if j not in idx])
            errs = [predict(runs[i], held) / runs[i].measured_step_s - 1 for i in idx]
            line += f"; leave-one-source-out {_pct(errs)}"
        print(line, flush=True)
    if loo:
        errs = []
        for i, r in enumerate(runs):
            held, _ = fit_end_to_end(family, pinned, rates, box, [q for j, q in enumerate(runs) if j != i], max_nfev=16)
            errs.append(predict(r, held) / r.measured_step_s - 1)
        print(f"  leave-one-out: {_pct(errs)}")
    profiles = software_sets(family, comps, v["training_factor"], "the training factor")
    print(f"  on a bound: {', '.join(on_bound) if on_bound else 'none'}")
    return {k: params[k] for k in PARAMS}, sources, profiles, len(on_bound)


def sharing_slowdown(family: str) -> None:
    """What SM sharing alone does to the family's end-to-end rows: each row's step with it over
    without, at the shipped efficiencies, per source."""
    runs = runs_for(_cluster(family))
    slower: dict[str, list[float]] = {}
    for r in runs:
        SM_SHARING["on"] = False
        off = predict(r)
        SM_SHARING["on"] = True
        slower.setdefault(r.source, []).append(predict(r) / off - 1)
    print(f"\n== {family}: SM sharing at the shipped efficiencies (each row with it over without) ==")
    for source, xs in slower.items():
        print(f"  {source}: {100 * np.mean(xs):.1f} % slower on average ({100 * min(xs):.1f} to "
              f"{100 * max(xs):.1f} %, {len(xs)} rows)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true",
                    help="store the fit in every GPU record of the family (hardware/data/gpus)")
    ap.add_argument("--family", choices=FAMILIES, default=None, help="fit only this GPU family")
    ap.add_argument("--loo", action="store_true", help="also leave-one-out per end-to-end row (refits once per row)")
    ap.add_argument("--sm-sharing", action="store_true",
                    help="an experiment, never written: simulate the end-to-end rows with SM sharing between "
                         "collectives and compute")
    args = ap.parse_args()
    if args.sm_sharing:
        if args.write:
            ap.error("--sm-sharing is an experiment; it writes nothing (leave out --write)")
        sharing_slowdown(args.family or "H100")
        SM_SHARING["on"] = True
    fitted: dict[str, tuple[dict[str, float], dict[str, str], ProfileSets]] = {}
    bound = 0
    for family in FAMILIES:
        if args.family and family != args.family:
            continue
        params, sources, profiles, n = report_family(family, args.loo)
        bound += n
        fitted[family] = ({k: params[k] for k in sources}, sources, profiles)
    print(f"\nparameters on a bound: {bound}")
    if args.write:
        for path in write_records(fitted):
            print(f"wrote {path}")

if __name__ == "__main__":
    main()
