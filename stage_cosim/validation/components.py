"""Component microbenchmarks (GEMM, HBM streaming, NCCL collectives, flash attention) as typed
rows, and what the compute and network models predict for each.

These are the bottom of the calibration: each GPU family's GEMM, memory and scale-up / scale-out
efficiencies are fitted to the rows of its own GPUs here before any end-to-end table is looked
at (benchmarks/calibrate.py). The files are transcribed from public repositories at pinned
commits (data/SOURCES.md); the ``source`` column of every row points at the line holding its
number.

What a row measures must be what the model models, or it is left out of the fit and reported as
out of scope with the reason:

* GEMMs: cuBLASLt (Azure) and DeepGEMM rows by (m, n, k, groups) and dtype. The model sees a
  GEMM's FLOPs and bytes, not its shape, so a skinny GEMM (a side under 256: one tile row or
  column, wave quantization the model does not have) is out of scope; so are the MAMF rows
  (the best shape of a sweep, a ceiling, not a typical GEMM), used only where a family has no
  sweep of a dtype (H100 BF16).
* HBM: BabelStream kernels, each an achieved streaming bandwidth.
* MoE all-to-all: DeepEP's normal (throughput) kernels, a check of the network model's
  all-to-all against their bottleneck bandwidth (NVLink inside a node, RDMA across), fitted to
  nothing. The low-latency kernels (128 tokens, a latency regime) and DeepEP v2's "logical"
  bandwidth (which counts a rank's traffic to itself) are out of scope.
* NCCL: ring (and NCCL-default on A100, which has no NVLS) all-reduce, all-gather and
  reduce-scatter bus bandwidth of 1 GiB and more, where latency does not matter. NVLS rows are
  out of scope: an all-reduce reduced inside the NVSwitch (busbw above the link rate) is not an
  algorithm the network model has.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.hardware.gpu import GPU

# The GPU family (calibration section) of each GPU named in the microbenchmark files. H800 has
# H100 SXM's SMs and clocks; H200 its SMs and NVLink with faster HBM (its HBM rows are its own).
FAMILY_OF_GPU = {"A100-SXM4-80GB": "A100", "H100-SXM5-80GB": "H100", "H800-SXM": "H100", "H200-SXM-141GB": "H100",
                 "A100 (SXM, variant not stated)": "A100", "B200": "B200", "GB200-NVL72": "B200"}
# Our GPU preset for a microbenchmark's GPU (peaks and HBM of that part).
PRESET_OF_GPU = {"A100-SXM4-80GB": "A100-80GB", "A100 (SXM, variant not stated)": "A100-80GB",
                 "H100-SXM5-80GB": "H100-SXM", "H800-SXM": "H800", "H200-SXM-141GB": "H200", "B200": "B200",
                 "GB200-NVL72": "GB200"}
# The cluster preset whose scale-up domain a microbenchmark's one-node rows ran in.
CLUSTER_OF_GPU = {"A100-SXM4-80GB": "dgx-a100", "A100 (SXM, variant not stated)": "dgx-a100",
                  "H100-SXM5-80GB": "dgx-h100", "H800-SXM": "dgx-h800", "H200-SXM-141GB": "dgx-h200",
                  "B200": "dgx-b200", "GB200-NVL72": "gb200-nvl72"}
# Input operand bytes per element of a GEMM dtype (outputs are 16-bit in every row here).
_IN_BYTES = {"fp16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e4m3fn": 1, "fp8_e4m3_blockscaled_1x128_128x128": 1}
_FORMAT = {"fp16": "bf16", "bf16": "bf16", "fp8_e4m3": "fp8", "fp8_e4m3fn": "fp8",
           "fp8_e4m3_blockscaled_1x128_128x128": "fp8"}
SKINNY = 256            # a GEMM side below this is out of the model's scope (see the module note)
MIN_NCCL_BYTES = 1 << 30


def _rows(name: str) -> list[dict[str, str]]:
    with resources.files("stage_cosim.validation").joinpath("data", name).open() as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True)
class GemmRow:
    gpu: str
    dtype: str
    m: int
    n: int
    k: int
    groups: int
    tflops: float
    benchmark: str
    scope: str          # "" when the model covers it, else why not

    @property
    def fmt(self) -> str:
        return _FORMAT[self.dtype]

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.groups

    @property
    def nbytes(self) -> float:
        g = self.groups
        return _IN_BYTES[self.dtype] * (self.m * self.k * g + self.k * self.n * g) + 2 * self.m * self.n * g


@lru_cache(maxsize=1)
def gemm_rows() -> tuple[GemmRow, ...]:
    out = []
    for r in _rows("gemm_microbench.csv"):
        if r["gpu"] not in FAMILY_OF_GPU or r["latest_in_source"] != "true" or r["dtype"] not in _FORMAT:
            continue
        m, n, k = int(r["m"]), int(r["n"]), int(r["k"])
        scope = ""
        if r["benchmark"].startswith("mamf"):
            scope = "best shape of a sweep (a ceiling)"
        elif min(m, n, k) < SKINNY:
            scope = f"a side under {SKINNY} (tile and wave quantization)"
        out.append(GemmRow(r["gpu"], r["dtype"], m, n, k, int(r["groups"] or 1), float(r["tflops"]),
                           r["benchmark"], scope))
    return tuple(out)


def gemm_tflops(row: GemmRow, gpu: GPU) -> float:
    """The TFLOP/s the compute model gives one of ``row``'s GEMMs on ``gpu`` (a grouped GEMM
    runs its groups as one kernel at one group's shape)."""
    t = ComputeModel(gpu).duration_s(row.flops, row.nbytes, row.fmt, groups=row.groups)
    return row.flops / t / 1e12


@dataclass(frozen=True)
class HbmRow:
    gpu: str
    kernel: str
    tbps: float


@lru_cache(maxsize=1)
def hbm_rows() -> tuple[HbmRow, ...]:
    return tuple(HbmRow(r["gpu"], r["kernel"], float(r["bandwidth_tbps"])) for r in _rows("hbm_bandwidth.csv")
                 if r["gpu"] in FAMILY_OF_GPU and r["latest_in_source"] == "true")


def hbm_tbps(gpu: GPU) -> float:
    """The streaming bandwidth a memory-bound kernel reaches in the model, TB/s."""
    return gpu.hbm_GBps * gpu.memory_efficiency / 1e3


# nccl-tests' bus-bandwidth factor per collective over n ranks
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}
_COLL = {"all_reduce": "ALL_REDUCE", "all_gather": "ALL_GATHER", "reduce_scatter": "REDUCE_SCATTER",
         "all_to_all": "ALL_TO_ALL"}


@dataclass(frozen=True)
class NcclRow:
    system: str
    gpu: str
    collective: str
    algorithm: str
    gpus: int
    nodes: int
    nbytes: int
    busbw_gbps: float
    scope: str

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes


@lru_cache(maxsize=1)
def nccl_rows() -> tuple[NcclRow, ...]:
    out = []
    for r in _rows("nccl_busbw.csv"):
        if r["gpu"] not in FAMILY_OF_GPU or r["latest_in_source"] != "true" or not r["busbw_gbps"]:
            continue
        if r["collective"] not in _COLL or int(r["bytes"]) < MIN_NCCL_BYTES:
            continue
        algo = r["algorithm"]
        family = FAMILY_OF_GPU[r["gpu"]]
        scope = ""
        if "TCPXO" in r["interconnect"] or "GCP" in r["system"] or "EFA" in r["interconnect"]:
            scope = "a cloud network (TCPXO, EFA), unlike the presets' InfiniBand"
        elif algo.startswith("Ring") or "as labelled" in algo or (algo.startswith("NCCL default") and family == "A100"):
            scope = ""         # a ring (A100 has no NVLS, whatever the label says)
        elif algo.startswith("NVLS") or algo.startswith("NCCL default"):
            scope = "NVLS (the reduction inside the NVSwitch) is not an algorithm of the network model yet"
        else:
            scope = f"algorithm {algo!r} is not one the network model has"
        out.append(NcclRow(r["system"], r["gpu"], r["collective"], algo, int(r["gpus"]), int(r["nodes"]),
                           int(r["bytes"]), float(r["busbw_gbps"]), scope))
    return tuple(out)


def _members(row: "NcclRow | AllToAllRow", domain: int) -> list[int]:
    """The ranks of a row's collective: ``per_node`` GPUs in each of ``nodes`` scale-up domains."""
    return [node * domain + i for node in range(row.nodes) for i in range(row.per_node)]


def nccl_busbw(row: NcclRow, network) -> float:  # noqa: ANN001 (a CalibratedNetwork)
    """nccl-tests' bus bandwidth (GB/s) the network model gives ``row``'s collective: its ranks
    are ``per_node`` GPUs in each of ``nodes`` scale-up domains."""
    members = _members(row, network.domain)
    n = len(members)
    # our sizes: an all-gather's per-rank shard; every other collective's per-rank buffer
    nbytes = row.nbytes // n if row.collective == "all_gather" else row.nbytes
    t = network.duration(_COLL[row.collective], nbytes, members)
    return row.nbytes / t * _BUS[row.collective](n) / 1e9


@dataclass(frozen=True)
class AttentionRow:
    gpu: str
    batch: int
    seq: int
    heads: int
    head_dim: int
    tflops: float          # fwd + bwd, counted as 3.5 * 4 * b * s^2 * heads * head_dim (non-causal)


@lru_cache(maxsize=1)
def attention_rows() -> tuple[AttentionRow, ...]:
    """FlashAttention-2 (fwd + bwd) rows of the Azure guide on the families' GPUs."""
    out = []
    for r in _rows("attention_microbench.csv"):
        if r["gpu"] not in FAMILY_OF_GPU or r.get("latest_in_source", "true") != "true":
            continue
        if not r["implementation"].startswith("flash_attn_2") or r["pass"] != "fwd+bwd":
            continue
        out.append(AttentionRow(r["gpu"], int(r["batch"]), int(r["seqlen"]), int(r["nheads"]), int(r["headdim"]),
                                float(r["tflops"])))
    return tuple(out)


def attention_tflops(row: AttentionRow, gpu: GPU) -> float:
    """What the compute model gives a non-causal fused attention kernel of ``row``'s shape."""
    rows = math.ceil(row.seq / gpu.attention_block_rows) * gpu.attention_block_rows * row.batch * row.heads
    return ComputeModel(gpu).attention_rate("bf16", keys=row.seq, rows=rows) / 1e12


@dataclass(frozen=True)
class AllToAllRow:
    gpu: str
    op: str                # dispatch | combine
    ep: int
    nodes: int
    tokens: int
    hidden: int
    topk: int
    payload_bytes: int     # per element: FP8 dispatch 1, BF16 combine 2
    gbps: float            # the bottleneck link's bandwidth, GB/s
    domain: str            # NVLink | RDMA: which link is the bottleneck
    scope: str

    @property
    def per_node(self) -> int:
        return self.ep // self.nodes


@lru_cache(maxsize=1)
def alltoall_rows() -> tuple[AllToAllRow, ...]:
    out = []
    for r in _rows("moe_alltoall_microbench.csv"):
        if r["gpu"] not in FAMILY_OF_GPU:
            continue
        scope = "" if "normal" in r["kernel"] else "low-latency kernels: a latency regime, not a bandwidth"
        out.append(AllToAllRow(r["gpu"], r["op"], int(r["ep_size"]), int(r["nodes"]), int(r["tokens_per_batch"]),
                               int(r["hidden"]), int(r["topk"]), 1 if r["payload_dtype"] == "fp8" else 2,
                               float(r["bandwidth_gbps"]), r["bandwidth_domain"], scope))
    return tuple(out)


def alltoall_gbps(row: AllToAllRow, network) -> float:  # noqa: ANN001 (a CalibratedNetwork)
    """The bottleneck link's bandwidth in the network model's all-to-all of ``row``'s tokens
    (each sends its top-k copies of ``hidden`` elements): the bytes a rank sends over NVLink
    (to the other ranks of its node) or over its NIC (to the other nodes), over the time."""
    members = _members(row, network.domain)
    n, m = len(members), row.per_node
    nbytes = row.tokens * row.topk * row.hidden * row.payload_bytes
    t = network.duration("ALL_TO_ALL", nbytes, members)
    crossing = (m - 1) / n if row.domain == "NVLink" else (n - m) / n
    return nbytes * crossing / t / 1e9
