"""One collective (or several groups' collectives at once) on a one-dimensional network, run
three ways for comparison: ASTRA-sim's congestion-aware analytical binary, our reproduction of
its congestion-unaware backend, and the calibrated network model on the equivalent cluster.

The congestion-aware backend builds a real graph of links and accepts one dimension only
(``Ring``, ``Switch`` or ``FullyConnected``; its ``construct_topology`` exits otherwise). Each
link serves one message at a time, first come first served, and a message crosses a switch
store-and-forward: the switch's outgoing link starts sending only once the whole message has
arrived. The run directory it reads is the one our exporter writes (``traces/``, system.json,
network.yml, memory.json, comm_groups.json), so :func:`write_run_dir` reuses those writers.

The equivalent cluster (:func:`cluster_doc`) gives every NPU its own scale-up domain, so every
byte crosses the scale-out network, whose bandwidth is one link's (converted from ASTRA-sim's
2^30-byte GB to our 10^9) and whose latency is one neighbour message's: two link hops through
the switch, one on a ring or a direct link. The GPU's efficiencies are set to 1: ASTRA-sim has
none, and the comparison is of the network models, not of our calibration to nccl-tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from stage_cosim.adapters.astra_sim.analytical import simulate_astra
from stage_cosim.adapters.astra_sim.astra_system import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER,
                                                         AstraSystem)
from stage_cosim.adapters.astra_sim.config_files import write_memory_json, write_network_yml, write_system_json
from stage_cosim.adapters.astra_sim.layout import TRACE_DIR, TRACE_PREFIX
from stage_cosim.adapters.astra_sim.run import run
from stage_cosim.adapters.roofline.collectives import OPS, model_bytes
from stage_cosim.adapters.roofline.contention import max_min_rates
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.errors import require
from stage_cosim.hardware.cluster import GIB_PER_GB, Cluster, cluster_from
from stage_cosim.hardware.network import TOPOLOGIES, NetworkDim
from stage_cosim.trace.chakra import TraceNode, write_trace_file
from stage_cosim.trace.location import GROUPS_FILE

BINARY_ENV = "ASTRA_SIM_CONGESTION_AWARE_BIN"
# Chakra's comm_type of each collective, by nccl-tests' name
COMM_TYPES = {"all-reduce": 0, "all-gather": 2, "all-to-all": 6, "reduce-scatter": 7}
# ASTRA-sim's implementation of each collective chosen as NCCL runs it: rings for the reductions
# and gathers, and all-to-all as a send to every peer at once ("direct"), not around a ring
IMPLEMENTATIONS = {ALL_REDUCE: ("ring",), ALL_GATHER: ("ring",), REDUCE_SCATTER: ("ring",),
                   ALL_TO_ALL: ("direct",)}
# link hops of a message between ring or switch neighbours
NEIGHBOUR_HOPS = {"Switch": 2, "Ring": 1, "FullyConnected": 1}


@dataclass(frozen=True)
class Case:
    """``op`` of nccl-tests' ``size`` on a one-dimensional ``topology`` of ``npus``; ``groups``:
    the groups that run it at the same time (empty: one collective over every NPU)."""

    topology: str
    npus: int
    op: str
    size: int
    groups: tuple[tuple[int, ...], ...] = ()
    bandwidth_GBps: float = 50.0        # per link per direction, ASTRA-sim's GB (2^30 B)
    latency_ns: float = 500.0           # per link

    def __post_init__(self) -> None:
        require(self.topology in TOPOLOGIES, "topology",
                f"ASTRA-sim's congestion-aware backend takes {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        require(self.op in COMM_TYPES, "op", f"must be one of {', '.join(COMM_TYPES)}, got {self.op!r}")
        require(self.npus >= 2, "npus", f"must be at least 2, got {self.npus}")
        members = [r for g in self.groups for r in g]
        require(len(members) == len(set(members)) and all(0 <= r < self.npus for r in members), "groups",
                f"must be disjoint sets of NPUs 0..{self.npus - 1}")

    @property
    def members(self) -> tuple[tuple[int, ...], ...]:
        return self.groups or (tuple(range(self.npus)),)

    def comm_size(self, n: int) -> int:
        """The trace's comm_size for a group of ``n``: ASTRA-sim's all-gather takes each rank's
        shard, every other collective each rank's whole buffer (nccl-tests' size)."""
        return self.size // n if self.op == "all-gather" else self.size


def system() -> AstraSystem:
    """The system configuration: the exporter's defaults (4 splits, 10 ns endpoint delay) with
    NCCL's algorithms, and no local reduction cost (the calibrated model has none)."""
    return AstraSystem(preferred_dataset_splits=4, implementations=dict(IMPLEMENTATIONS))


def _nodes(case: Case) -> dict[int, list[TraceNode]]:
    """Each rank's trace: its group's collective, or a 1 ns compute node outside every group."""
    ranks: dict[int, list[TraceNode]] = {}
    for k, group in enumerate(case.members):
        attrs: dict[str, object] = {"is_cpu_op": False, "comm_type": COMM_TYPES[case.op],
                                    "comm_size": case.comm_size(len(group))}
        if case.groups:
            attrs["pg_name"] = str(k + 1)        # the binary asserts group ids above 0
        for r in group:
            ranks[r] = [TraceNode(0, "collective", 7, [], [], 0, dict(attrs))]
    for r in range(case.npus):
        ranks.setdefault(r, [TraceNode(0, "idle", 4, [], [], 0, {"is_cpu_op": False})])
    return ranks


def _groups(case: Case) -> dict[str, list[int]]:
    return {str(k + 1): list(g) for k, g in enumerate(case.groups)}


def dims(case: Case) -> list[NetworkDim]:
    return [NetworkDim(case.topology, case.npus, case.bandwidth_GBps, case.latency_ns)]


def write_run_dir(case: Case, d: Path) -> Path:
    """The run directory the binary reads, in the exporter's layout."""
    (d / TRACE_DIR).mkdir(parents=True, exist_ok=True)
    for r, nodes in _nodes(case).items():
        write_trace_file(d / TRACE_DIR / f"{TRACE_PREFIX}.{r}.et", nodes)
    write_system_json(system(), d / "system.json")
    write_network_yml(dims(case), d / "network.yml")
    write_memory_json(d / "memory.json")
    (d / GROUPS_FILE).write_text(json.dumps(_groups(case)))
    return d


def aware_time_s(binary: str, case: Case, d: Path, timeout_s: float = 600.0) -> float:
    """The congestion-aware binary's time: the last rank's finish."""
    return run(binary, write_run_dir(case, d), case.npus, timeout_s).output.step_time_ns * 1e-9


def unaware_time_s(case: Case) -> float:
    """ASTRA-sim's congestion-unaware backend (our exact reproduction of it)."""
    return simulate_astra(_nodes(case), _groups(case), system(), dims(case)).step_time_ns * 1e-9


def cluster_doc(case: Case, topology: str | None = None) -> dict[str, Any]:
    """The equivalent cluster's YAML document (``topology``: the scale-out topology to name
    instead of the case's, e.g. a one-leaf ``fat-tree`` for a ``Switch``)."""
    return {
        "name": f"astra-{case.topology.lower()}-{case.npus}",
        "gpu": {"base": "H100-SXM", "scale_up_efficiency": 1.0, "scale_out_efficiency": 1.0},
        "num_gpus": case.npus,
        "scale_up": {"gpus_per_domain": 1, "bandwidth_GBps": case.bandwidth_GBps / GIB_PER_GB,
                     "latency_ns": case.latency_ns},
        "scale_out": {"bandwidth_GBps": case.bandwidth_GBps / GIB_PER_GB,
                      "latency_ns": NEIGHBOUR_HOPS[case.topology] * case.latency_ns,
                      "topology": topology or case.topology,
                      # one leaf holds every NPU: no tier above it
                      "switch_radix": 2 * max(2, case.npus)},
    }


def cluster(case: Case, topology: str | None = None) -> Cluster:
    return cluster_from(cluster_doc(case, topology))


def ours_time_s(case: Case, topology: str | None = None) -> float:
    """The calibrated model's time for the slowest group, every group running at once (ring
    all-reduce, as ASTRA-sim runs it; the other collectives have one algorithm each)."""
    network = CalibratedNetwork(cluster(case, topology), concurrent=bool(case.groups))
    algorithm = "ring" if case.op == "all-reduce" else "auto"
    return max(network.timed(OPS[case.op], model_bytes(case.op, case.size, len(g)), list(g), algorithm)[0]
               for g in case.members)


# -- max-min sharing on the binary's own links ----------------------------------------------------

def route(topology: str, n: int, src: int, dst: int) -> list[int]:
    """The directed links a message crosses, numbered as the binary builds them: a switch's
    NPU-to-switch link ``src`` and switch-to-NPU link ``n + dst``; a direct link per ordered
    pair; on a bidirectional ring the shorter way (clockwise on a tie), link ``i`` from NPU i to
    i+1 and ``n + i`` from i+1 to i."""
    if topology == "Switch":
        return [src, n + dst]
    if topology == "FullyConnected":
        return [src * n + dst]
    clockwise = (dst - src) % n
    if n - clockwise < clockwise:
        return [n + (src - k - 1) % n for k in range(n - clockwise)]
    return [(src + k) % n for k in range(clockwise)]


def flows(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(sources, destinations) of every group's flows at once: each member to the next of its
    group's ring (in the listed order), or to every other member for an all-to-all."""
    pairs = []
    for g in case.members:
        if case.op == "all-to-all":
            pairs += [(a, b) for a in g for b in g if a != b]
        else:
            pairs += [(g[i], g[(i + 1) % len(g)]) for i in range(len(g))]
    src, dst = zip(*pairs)
    return np.array(src), np.array(dst)


def max_min_rate(case: Case, topology: str | None = None) -> float:
    """The slowest flow's max-min fair rate, as a share of one link, with every flow of every
    group on ``topology``'s links (default: the case's) at once."""
    topology = topology or case.topology
    src, dst = flows(case)
    rows, cols = [], []
    for i, (s, t) in enumerate(zip(src, dst)):
        for link in route(topology, case.npus, int(s), int(t)):
            rows.append(i)
            cols.append(link)
    links = case.npus * case.npus if topology == "FullyConnected" else 2 * case.npus
    return float(max_min_rates(np.array(rows), np.array(cols), np.ones(links), len(src)).min())


def max_min_slowdown(case: Case) -> float:
    """The contention model's slowdown on the binary's links: the slowest flow's max-min rate
    there over its rate where only each NPU's one link out and one link in limit it (what the
    calibrated model's formulas assume). Not capped at 1 as the contention model caps it: on
    FullyConnected links an all-to-all is faster than through one NIC."""
    return max_min_rate(case) / max_min_rate(case, "Switch")


def max_min_time_s(case: Case) -> float:
    """The calibrated model's time at its bandwidth times the max-min slowdown on the binary's
    links (fluid flows, cut-through: a message's links all carry it at once)."""
    return ours_time_s(replace(case, bandwidth_GBps=case.bandwidth_GBps * max_min_slowdown(case)))
