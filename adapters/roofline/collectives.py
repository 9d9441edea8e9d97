"""What nccl-tests would print on a cluster: the calibrated network model's time for one
collective, reported by nccl-tests' conventions (``stage-cosim collective``), and the check of
those figures against the shared nccl-tests rows (``stage-cosim collective --validate``,
:func:`stage_cosim.validation.components.busbw_report`).

nccl-tests' conventions, followed exactly (NVIDIA/nccl-tests ``doc/PERFORMANCE.md`` and each
test's ``GetCollByteCount``/``GetBw`` in ``src/*.cu``):

* **size** — the first column, what ``-b``/``-e``/``-f`` sweep (``bytes`` here): the largest
  buffer of one rank. All-reduce: each rank's buffer (its input, and its output). All-gather:
  the whole *output*, n shards of size/n, one from each rank. Reduce-scatter: the whole *input*;
  each rank keeps size/n of the sum. All-to-all: each rank's send buffer, size/n to every rank
  (itself included). Broadcast: the root's buffer. Sizes written with K, M or G are powers of 2
  (``1M`` is 1,048,576 bytes), as nccl-tests parses ``-b``/``-e``.
* **time** — one collective, averaged over the iterations (the model has no variance).
* **algbw** — size / time, in GB/s of 10^9 B/s.
* **busbw** — algbw times a factor of the collective and the rank count n, never of the
  algorithm: all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n,
  broadcast 1. It is the rate of the busiest link of an ideal point-to-point algorithm, so a
  ring's busbw is its link's achieved rate, and an NVLS all-reduce (reduced inside the switch,
  less traffic per link) shows a busbw above the link's. Every row of the shared file was
  printed so; the newest nccl-tests prints (n-1)/(n+1) for an all-reduce instead when
  ``NCCL_ALGO=NVLS`` or ``NVLSTree`` is set in its environment, which is not used here.

The model's own size conventions (:meth:`~stage_cosim.adapters.roofline.network.CalibratedNetwork.duration`):
each rank's buffer for all-reduce, reduce-scatter (its input), all-to-all (its send buffer) and
broadcast, but each rank's *shard* for all-gather, so an all-gather of size S is timed as
``duration("ALL_GATHER", S / n, ...)``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stage_cosim.adapters.roofline.network import ALGORITHMS, CalibratedNetwork
from stage_cosim.errors import UserError
from stage_cosim.hardware import Cluster, resolve_cluster
from stage_cosim.limits import MAX_RANKS, MAX_RANKS_TEXT

# The collectives, by their nccl-tests names (all_reduce_perf …, with dashes), as the model names them
OPS = {"all-reduce": "ALL_REDUCE", "all-gather": "ALL_GATHER", "reduce-scatter": "REDUCE_SCATTER",
       "all-to-all": "ALL_TO_ALL", "broadcast": "BROADCAST"}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_BYTES = 1 << 50             # 1 PiB: far above any GPU's memory, exact as a float
NETWORK_MODEL = "calibrated"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` over ``n`` ranks."""
    if op == "all-reduce":
        return 2 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise KeyError(op)


def model_bytes(op: str, size: int, n: int) -> float:
    """The ``nbytes`` the network model takes for an nccl-tests ``size``: an all-gather's shard
    (size / n); every other collective's per-rank buffer, the size itself."""
    return size / n if op == "all-gather" else size


def parse_op(text: str) -> str:
    """A collective by its name, ``all-reduce`` or nccl-tests' ``all_reduce``."""
    op = text.strip().lower().replace("_", "-")
    if op == "alltoall":
        op = "all-to-all"
    if op not in OPS:
        raise UserError("op", f"unknown collective {text!r} (known: {', '.join(OPS)})")
    return op


def parse_size(text: str) -> int:
    """``8``, ``64K``, ``1M``, ``8G``: bytes, with K/M/G powers of 2 as nccl-tests' -b/-e."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)\s*", text)
    if not m:
        raise UserError("bytes", f"{text!r} is not a size: an integer, optionally with K, M or G "
                                 f"(powers of 2: 1M = 1048576), e.g. 8,1M,1G")
    size = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if size <= 0:
        raise UserError("bytes", f"sizes must be positive, got {text.strip()!r}")
    if size > MAX_BYTES:
        raise UserError("bytes", f"{text.strip()!r} is more than the {MAX_BYTES:,} bytes (1024G x 1024) this command takes")
    return size


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (``8,1M,1G``)."""
    parts = text.split(",")
    if not text.strip() or any(not p.strip() for p in parts):
        raise UserError("bytes", f"expected sizes separated by commas, e.g. 8,1M,1G, got {text!r}")
    return [parse_size(p) for p in parts]


def format_size(size: int) -> str:
    """A size as nccl-tests' flags write it: ``1G``, ``64K``, or the bytes."""
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)


def cluster_for(spec: str, gpus: int | None) -> Cluster:
    """The cluster of ``--cluster``: a preset, ``preset:COUNT`` or a YAML file, resolved as
    everywhere; a bare preset name is as many of its scale-up domains as ``gpus`` need."""
    if gpus is not None and gpus > MAX_RANKS:
        raise UserError("gpus", f"{gpus:,} ranks, more than the {MAX_RANKS_TEXT}")
    cluster = resolve_cluster(spec)
    explicit = ":" in spec or spec.endswith((".yaml", ".yml")) or Path(spec).is_file()
    if not explicit and gpus is not None and gpus > cluster.num_gpus:
        d = cluster.domain
        cluster = resolve_cluster(spec, -(-gpus // d) * d)
    return cluster


def ranks(cluster: Cluster, gpus: int) -> list[int]:
    """The collective's ranks: the cluster's first ``gpus``, filling its scale-up domains in
    order, as the model needs them: inside one domain, or over whole domains."""
    if gpus < 2:
        raise UserError("gpus", f"must be at least 2 (a collective moves data between ranks), got {gpus}")
    if gpus > cluster.num_gpus:
        raise UserError("gpus", f"{gpus} ranks, more than the cluster's {cluster.num_gpus} GPUs "
                                f"(give --cluster NAME:COUNT with enough)")
    d = cluster.domain
    if gpus > d and gpus % d:
        raise UserError("gpus", f"{gpus} ranks fill {gpus // d} scale-up domain(s) of {d} and part of another: give "
                                f"at most {d} or a multiple of {d} (the model spreads a collective evenly over domains)")
    return list(range(gpus))


def check_algorithm(network: CalibratedNetwork, op: str, members: list[int], algorithm: str) -> None:
    """Refuse an algorithm the collective cannot run on these ranks (one line naming why)."""
    if algorithm not in ALGORITHMS:
        raise UserError("algorithm", f"unknown algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    if algorithm == "auto":
        return
    if op == "all-to-all":
        raise UserError("algorithm", f"{algorithm}: all-to-all has no algorithm choice (NCCL runs it as a send to "
                                     f"and a receive from every peer); give auto")
    if op != "all-reduce" and algorithm != "ring":
        raise UserError("algorithm", f"{algorithm}: the model runs {algorithm} for all-reduce only; its {op} is a "
                                     f"ring (give auto or ring)")
    if algorithm == "nvls":
        why = network.nvls_unavailable(members)
        if why is not None:
            raise UserError("algorithm", f"nvls: {why}")
    if algorithm == "collnet":
        why = network.collnet_unavailable(members)
        if why is not None:
            raise UserError("algorithm", f"collnet: {why}")


@dataclass(frozen=True)
class Point:
    """One line of nccl-tests' output."""

    bytes: int
    time_s: float
    algbw_GBps: float
    busbw_GBps: float
    algorithm: str          # the algorithm the model ran (auto: the one it chose)


def measure(network: CalibratedNetwork, op: str, members: list[int], size: int, algorithm: str = "auto") -> Point:
    """The model's nccl-tests line for one size (``algorithm`` as checked by
    :func:`check_algorithm`)."""
    n = len(members)
    t, name = network.timed(OPS[op], model_bytes(op, size, n), members, algorithm)
    algbw = size / t / 1e9
    return Point(size, t, algbw, algbw * bus_factor(op, n), name)


def nccl_tests(cluster: Cluster, op: str, gpus: int | None, sizes: list[int], algorithm: str = "auto") -> dict[str, Any]:
    """What ``<op>_perf`` would print for ``sizes`` on the cluster's first ``gpus`` ranks (all of
    them when None), by the calibrated network model: the JSON of ``stage-cosim collective``."""
    op = parse_op(op)
    members = ranks(cluster, cluster.num_gpus if gpus is None else gpus)
    # nccl-tests runs one collective on the job's ranks: nothing else shares the network
    network = CalibratedNetwork(cluster, concurrent=False)
    check_algorithm(network, op, members, algorithm)
    k, m = network._shape(members)
    points = [measure(network, op, members, s, algorithm) for s in sizes]
    return {"cluster": cluster.name, "gpu": cluster.gpu.name, "op": op, "gpus": len(members), "domains": k,
            "gpus_per_domain": m, "algorithm": algorithm, "network_model": NETWORK_MODEL,
            "results": [asdict(p) for p in points]}


def format_table(report: dict[str, Any]) -> str:
    """nccl-tests' columns: size, time, algbw, busbw, and the algorithm that ran."""
    k, m = report["domains"], report["gpus_per_domain"]
    where = f"{k} scale-up domain{'s' if k > 1 else ''} of {m}"
    lines = [f"# {report['op']} on {report['gpus']} {report['gpu']} GPUs of {report['cluster']} ({where}), "
             f"{report['network_model']} network model, algorithm {report['algorithm']}",
             "#",
             f"# {'size':>12}  {'time':>10}  {'algbw':>8}  {'busbw':>8}  algorithm",
             f"# {'(B)':>12}  {'(us)':>10}  {'(GB/s)':>8}  {'(GB/s)':>8}"]
    for r in report["results"]:
        lines.append(f"  {r['bytes']:>12}  {r['time_s'] * 1e6:>10.2f}  {r['algbw_GBps']:>8.2f}  "
                     f"{r['busbw_GBps']:>8.2f}  {r['algorithm']}")
    lines.append("# busbw = algbw x " + {"all-reduce": "2(n-1)/n", "broadcast": "1"}.get(report["op"], "(n-1)/n")
                 + " (nccl-tests' definition); GB/s = 10^9 B/s")
    return "\n".join(lines)
