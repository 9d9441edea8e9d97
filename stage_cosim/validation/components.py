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
  out of scope: an all-reduce reduced inside the NVSwitch (busbw above the link rate) is an
  algorithm of the network model only on request (``stage-cosim collective --algorithm nvls``),
  never in a simulated step, so nothing is fitted to it.

Besides the fit, every row of the NCCL file that ``stage-cosim collective`` can express, at
every size and with the algorithm the row says NCCL ran, is a check (:func:`busbw_report`,
``stage-cosim collective --validate``), fitted to nothing.
"""

from __future__ import annotations

import csv
import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from importlib import resources
from typing import Any

from stage_cosim.adapters.roofline import collectives as co
from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.adapters.roofline.routing import TokenRouting
from stage_cosim.errors import UserError
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

    @property
    def nccl_algo(self) -> str:
        """The all-reduce algorithm the row ran, as the network model names it: a ring where
        its label says so (NCCL_NVLS_ENABLE=0 or NCCL_ALGO=ring), NVLS where it says so on a GPU
        that has it, else NCCL's own choice (auto; A100's "NVLS" label is not NVLS)."""
        if self.algorithm.startswith("Ring"):
            return "ring"
        if self.algorithm.startswith("NVLS") and not self.gpu.startswith("A100"):
            return "nvls"
        return "auto"


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
            scope = "NVLS (the reduction inside the NVSwitch): it pins NVLS's own share of the link rate, not the ring's efficiency"
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
    algorithm = row.nccl_algo if row.collective == "all_reduce" else None
    t = network.duration(_COLL[row.collective], nbytes, members, algorithm)
    return row.nbytes / t * _BUS[row.collective](n) / 1e9


@dataclass(frozen=True)
class AttentionRow:
    gpu: str
    batch: int
    seq: int
    heads: int
    head_dim: int
    tflops: float          # fwd + bwd, counted as 3.5 * 4 * b * s^2 * heads * head_dim (halved if causal)


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
class KernelAttentionRow:
    """One bar of a published attention-kernel comparison: one kernel, one pass, with or
    without a causal mask (TFLOP/s counted as its source does: the masked half not counted)."""
    gpu: str
    kernel: str            # flash_attn_2 | cudnn | flash_attn_3
    phase: str             # fwd | bwd
    causal: bool
    batch: int
    seq: int
    heads: int
    head_dim: int
    tflops: float


@lru_cache(maxsize=1)
def kernel_attention_rows() -> tuple[KernelAttentionRow, ...]:
    """The FlashAttention-3 paper's H100 comparison of FlashAttention-2, cuDNN and
    FlashAttention-3 (attention_kernels_h100.csv)."""
    return tuple(KernelAttentionRow(r["gpu"], r["implementation"], r["pass"], r["causal"] == "true", int(r["batch"]),
                                    int(r["seqlen"]), int(r["nheads"]), int(r["headdim"]), float(r["tflops"]))
                 for r in _rows("attention_kernels_h100.csv"))


def training_attention_rows(kernel: str, causal: bool) -> tuple[AttentionRow, ...]:
    """What ``kernel`` reaches over a training step's attention, forward and backward at their
    FLOP ratio (1 : 2.5), per sequence length of :func:`kernel_attention_rows`: the harmonic
    combination 3.5 / (1/fwd + 2.5/bwd), the figure a fwd+bwd benchmark prints. The source
    measures the backward without a mask only; a causal backward is taken to lose what the
    causal forward loses at the same length (its diagonal tiles are as partly masked, and its
    key tiles' loops as uneven), which is an assumption, stated where the rows are used."""
    rows = [r for r in kernel_attention_rows() if r.kernel == kernel]

    def rate(phase: str, masked: bool, seq: int) -> float | None:
        return next((r.tflops for r in rows if r.phase == phase and r.causal == masked and r.seq == seq), None)

    out = []
    for r in rows:
        if r.phase != "fwd" or r.causal != causal:
            continue
        bwd = rate("bwd", causal, r.seq)
        if bwd is None:
            plain_fwd, plain_bwd = rate("fwd", False, r.seq), rate("bwd", False, r.seq)
            if plain_fwd is None or plain_bwd is None:
                continue
            bwd = plain_bwd * r.tflops / plain_fwd
        out.append(AttentionRow(r.gpu, r.batch, r.seq, r.heads, r.head_dim, 3.5 / (1 / r.tflops + 2.5 / bwd)))
    return tuple(out)


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


def deepep_routing(nodes: int) -> TokenRouting:
    """The routing of DeepEP's normal-kernel tests (DeepSeek-V3's pre-training setting): 256
    experts, a token's 8 from its best min(nodes, 4) groups, one group per node."""
    return TokenRouting(experts=256, topk=8, groups=nodes, group_topk=min(nodes, 4))


def alltoall_gbps(row: AllToAllRow, network) -> float:  # noqa: ANN001 (a CalibratedNetwork)
    """The bottleneck link's bandwidth in the network model's all-to-all of ``row``'s tokens
    (each routed to top-k experts, ``hidden`` elements each): inside one node, the bytes a rank
    sends over NVLink to the other ranks (every copy) over the time; across nodes, as DeepEP's
    normal kernels run it (the flex dispatcher's deduplicated all-to-all), the bytes its NIC
    sends — each token once per other node it reaches — over the time."""
    members = _members(row, network.domain)
    n, m = len(members), row.per_node
    nbytes = row.tokens * row.topk * row.hidden * row.payload_bytes
    if row.domain == "NVLink":
        return nbytes * (m - 1) / n / network.duration("ALL_TO_ALL", nbytes, members) / 1e9
    routing = deepep_routing(row.nodes)
    routed = replace(network, routing=routing)
    crossing = row.tokens * row.hidden * row.payload_bytes * routing.remote_domains(n // m)
    return crossing / routed.routed_all_to_all(nbytes, members) / 1e9


# -- stage-cosim collective against every nccl-tests row it can express ------------------------------

VALIDATION_FILE = "nccl_busbw.csv"
_H200_DEFAULT = "RING/LL up to 1MiB, NVLS/SIMPLE from 2MiB"


@dataclass(frozen=True)
class BusbwCheck:
    """One row of the shared file, and what the command predicts for it (``reason``: why the
    command cannot express the row, else empty)."""

    system: str
    gpu: str
    op: str
    label: str              # the row's algorithm, as the source states it
    gpus: int
    nodes: int
    bytes: int
    measured_GBps: float | None
    cluster: str = ""
    algorithm: str = ""     # what the command is given (--algorithm)
    ran: str = ""           # what the model ran
    predicted_GBps: float | None = None
    measured_from: str = "busbw"     # or "time": busbw from the row's time by nccl-tests' definition
    reason: str = ""

    @property
    def error(self) -> float | None:
        if self.predicted_GBps is None or not self.measured_GBps:
            return None
        return self.predicted_GBps / self.measured_GBps - 1

    @property
    def short_system(self) -> str:
        return self.system.split(" (")[0].split(";")[0]


def _algorithm_for(label: str, op: str, arch: str, size: int) -> tuple[str | None, str]:
    """The ``--algorithm`` that runs what a row's label says NCCL ran, or (None, why not)."""
    if op != "all-reduce":
        if label.startswith(("Ring", "NCCL default")):
            return "auto", ""       # the model's one algorithm for it (a ring; all-to-all: sends)
        return None, f"{label.split(' ')[0]} {op} is not an algorithm of the model"
    if label.startswith("NVLSTree"):
        return None, "NVLSTree (NVLS inside nodes, a tree across) is not an algorithm of the model"
    if label.startswith("Ring"):
        return "ring", ""
    if "as labelled" in label and arch == "ampere":
        # NCCL_ALGO=NVLS on a GPU without it: NCCL falls back to its own choice, ring or tree
        return "auto", ""
    if label.startswith("NVLS"):
        return "nvls", ""
    if _H200_DEFAULT in label:      # the author's NCCL_DEBUG says which, by size
        return ("ring" if size <= 1 << 20 else "nvls"), ""
    if label.startswith("NCCL default"):
        if arch == "ampere":
            return "auto", ""       # no NVLS: NCCL's choice is between ring and tree, as auto's
        return None, "NCCL's default on a GPU with NVLS: the row does not say which algorithm NCCL chose"
    return None, f"algorithm {label!r} is not one the model has"


def _check(r: dict[str, str]) -> BusbwCheck:
    op = r["collective"].replace("_", "-")
    gpus, nodes, size = int(r["gpus"]), int(r["nodes"]), int(r["bytes"])
    measured, source = (float(r["busbw_gbps"]) if r["busbw_gbps"] else None), "busbw"
    base = dict(system=r["system"], gpu=r["gpu"], op=op, label=r["algorithm"], gpus=gpus, nodes=nodes, bytes=size)

    def out(why: str) -> BusbwCheck:
        return BusbwCheck(**base, measured_GBps=measured, measured_from=source, reason=why)

    if r["latest_in_source"] != "true":
        return out("superseded: a run its source has since replaced")
    if r["gpu"] not in CLUSTER_OF_GPU:
        return out("no cluster preset has its GPU")
    if op not in co.OPS:
        return out(f"collective {r['collective']} is not one the command has")
    if not measured and r["time_us"]:
        measured, source = size / (float(r["time_us"]) * 1e-6) * co.bus_factor(op, gpus) / 1e9, "time"
    if not measured:
        return out("no busbw (or time) recorded, or busbw rounds to 0.00")
    cloud = any(w in r["interconnect"] or w in r["system"] for w in ("TCPXO", "EFA", "GCP"))
    if nodes > 1 and cloud:
        return out("a cloud network (GCP TCPXO, AWS EFA) across nodes, unlike the presets' InfiniBand")
    spec = CLUSTER_OF_GPU[r["gpu"]]
    try:
        cluster = co.cluster_for(spec, gpus)
        members = co.ranks(cluster, gpus)
    except UserError as exc:
        return out(exc.rule)
    network = CalibratedNetwork(cluster)
    k, m = network._shape(members)
    if (k, m) != (nodes, gpus // nodes):
        return out(f"{gpus // nodes} GPU(s) in each of {nodes} nodes: the command takes a cluster's first ranks, "
                   f"filling its {network.domain}-GPU domains")
    algorithm, why = _algorithm_for(r["algorithm"], op, cluster.gpu.arch, size)
    if algorithm is None:
        return out(why)
    try:
        co.check_algorithm(network, op, members, algorithm)
    except UserError as exc:
        return out(exc.rule)
    p = co.measure(network, op, members, size, algorithm)
    return BusbwCheck(**base, measured_GBps=measured, cluster=f"{spec}:{cluster.num_gpus}", algorithm=algorithm,
                      ran=p.algorithm, predicted_GBps=p.busbw_GBps, measured_from=source)


def busbw_checks() -> list[BusbwCheck]:
    """Every row of ``stage_cosim/validation/data/nccl_busbw.csv``, predicted where the command
    can express it."""
    return [_check(r) for r in _rows(VALIDATION_FILE)]


BIG = MIN_NCCL_BYTES    # the bandwidth regime: the sizes the calibration's NCCL rows have


def busbw_report(checks: list[BusbwCheck] | None = None) -> dict[str, Any]:
    """The rows with their errors, the mean absolute error per system and algorithm (all sizes,
    and from 1 GiB up), and the rows the command cannot express, counted by reason."""
    checks = busbw_checks() if checks is None else checks
    done = [c for c in checks if not c.reason]
    groups: dict[tuple[str, str], list[BusbwCheck]] = defaultdict(list)
    for c in done:
        groups[(c.short_system, c.ran)].append(c)

    def mae(cs: list[BusbwCheck]) -> float | None:
        return sum(abs(c.error) for c in cs) / len(cs) if cs else None

    summary = [{"system": s, "algorithm": a, "rows": len(cs), "mae": mae(cs),
                "rows_1GiB": sum(c.bytes >= BIG for c in cs), "mae_1GiB": mae([c for c in cs if c.bytes >= BIG]),
                "mean_error_1GiB": (sum(c.error for c in cs if c.bytes >= BIG) / n
                                    if (n := sum(c.bytes >= BIG for c in cs)) else None)}
               for (s, a), cs in groups.items()]
    rows = [{**asdict(c), "error": c.error} for c in checks]
    return {"file": f"stage_cosim/validation/data/{VALIDATION_FILE}", "network_model": co.NETWORK_MODEL,
            "rows": rows, "expressed": len(done), "total": len(checks), "summary": summary,
            "mae": mae(done), "mae_1GiB": mae([c for c in done if c.bytes >= BIG]),
            "not_expressed": dict(Counter(c.reason for c in checks if c.reason).most_common())}


def format_busbw_report(report: dict[str, Any]) -> str:
    """:func:`busbw_report` as ``stage-cosim collective --validate`` prints it."""
    lines = [f"# {report['file']}: nccl-tests busbw, measured against the {report['network_model']} network model "
             f"(stage-cosim collective on the row's preset)",
             f"{'system':<24} {'op':<14} {'gpus':>4} {'nodes':>5} {'size':>6} {'algorithm':<6} {'ran':<5} "
             f"{'measured':>9} {'predicted':>9} {'error':>8}  cluster"]
    for r in report["rows"]:
        if r["reason"]:
            continue
        star = "*" if r["measured_from"] == "time" else " "
        lines.append(f"{r['system'].split(' (')[0].split(';')[0][:24]:<24} {r['op']:<14} {r['gpus']:>4} {r['nodes']:>5} "
                     f"{co.format_size(r['bytes']):>6} {r['algorithm']:<6} {r['ran']:<5} {r['measured_GBps']:>8.2f}{star} "
                     f"{r['predicted_GBps']:>9.2f} {r['error'] * 100:>+7.1f}%  {r['cluster']}")
    lines.append("(* measured busbw from the row's time by nccl-tests' definition: the row gives no busbw)")
    lines += ["", "mean absolute error per system and algorithm (the algorithm the model ran):",
              f"{'system':<24} {'algorithm':<9} {'rows':>4} {'all sizes':>9} {'rows':>5} {'>= 1 GiB':>9} {'signed':>8}"]

    def pct(v: float | None, sign: bool = False) -> str:
        return "—" if v is None else (f"{v * 100:+.1f}%" if sign else f"{v * 100:.1f}%")

    for s in report["summary"]:
        lines.append(f"{s['system'][:24]:<24} {s['algorithm']:<9} {s['rows']:>4} {pct(s['mae']):>9} "
                     f"{s['rows_1GiB']:>5} {pct(s['mae_1GiB']):>9} {pct(s['mean_error_1GiB'], True):>8}")
    lines.append(f"{'all':<24} {'':<9} {report['expressed']:>4} {pct(report['mae']):>9} "
                 f"{'':>5} {pct(report['mae_1GiB']):>9}")
    lines += ["", f"rows expressed: {report['expressed']} of {report['total']}; not expressed, by reason:"]
    for why, count in report["not_expressed"].items():
        lines.append(f"  {count:>4}  {why}")
    return "\n".join(lines)
