"""The ``astra`` network model: ASTRA-sim's congestion-unaware analytical backend, exactly.

It plugs ASTRA-sim's collective and message costs (:mod:`astra_model`, which reproduces the
reference runs to the nanosecond) into our event-driven engine, with ASTRA-sim's execution
rule of one communication operation at a time per rank (collectives and sends share one slot;
a posted receive occupies none). Times are whole nanoseconds, as the simulator counts them.

:func:`simulate_run_dir` reads an exported ASTRA-sim run directory back from disk (system.json,
network.yml, the traces and their groups) and predicts what the simulator will print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from stage_cosim.adapters.roofline.astra_model import (
    AstraRunResult, AstraSystem, Network, collective_finish_times, compute_duration_ns,
)
from stage_cosim.adapters.roofline.engine import replay
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.hardware.network import NetworkDim


@dataclass
class AstraNetwork:
    dims: Sequence[NetworkDim]
    system: AstraSystem
    name: str = "astra"
    tree_counters: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.net = Network(list(self.dims))
        self.everyone = tuple(range(self.net.n_ranks))

    @classmethod
    def for_cluster(cls, cluster: Cluster, settings=None) -> "AstraNetwork":  # noqa: ANN001
        from stage_cosim.adapters.astra_sim.export import AstraSettings, system_for

        return cls(cluster.network_dims(), system_for(cluster, "replay", settings or AstraSettings()))

    def stream(self, node_type: str, kind: str) -> str | None:
        return None if node_type == "RECV" else "comm"

    def collective(self, coll: str, nbytes: int, members: Sequence[int], starts: Sequence[float],
                   involved: Sequence[bool] | None = None) -> list[float]:
        group = None if tuple(sorted(members)) == self.everyone else list(members)
        start_ns = {r: int(round(t * 1e9)) for r, t in zip(members, starts)}
        finish = collective_finish_times(self.net, self.system, coll, nbytes, start_ns, involved, group,
                                         self.tree_counters)
        return [finish[r] * 1e-9 for r in members]

    def p2p(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        d = self.net.delay(src, dst, nbytes) * 1e-9
        return d, d


def simulate_run_dir(run_dir: Path) -> AstraRunResult:
    """What ASTRA-sim's congestion-unaware binary will print for an exported run directory,
    computed from the files alone."""
    from stage_cosim.adapters.astra_sim.config_files import read_network_yml, read_system_json
    from stage_cosim.adapters.astra_sim.export import TRACE_DIR
    from stage_cosim.trace.validate import load_trace_set
    from stage_cosim.trace.writer import GROUPS_FILE

    system = read_system_json(run_dir / "system.json")
    dims = read_network_yml(run_dir / "network.yml")
    ranks, groups = load_trace_set(run_dir / TRACE_DIR, run_dir / GROUPS_FILE)
    return simulate_trace_set(ranks, groups or {}, system, dims)


def simulate_trace_set(ranks: dict, groups: dict, system: AstraSystem, dims: Sequence[NetworkDim]) -> AstraRunResult:
    """Our engine with ASTRA-sim's rules: compute by replay or roofline as system.json says."""
    from stage_cosim.adapters.roofline.simulate import programs_from_traces

    programs, participants = programs_from_traces(ranks, groups, None)
    for prog, rank in zip(programs, sorted(ranks)):
        nodes = sorted(ranks[rank], key=lambda n: n.id)
        for i, node in enumerate(nodes):
            if prog.types[i] == "COMP":
                prog.duration[i] = compute_duration_ns(node, system) * 1e-9
    network = AstraNetwork(dims, system)
    rep = replay(programs, network, participants, lambda r: r)
    finished = {p.rank: int(round(f * 1e9)) for p, f in zip(programs, rep.finish)}
    gpu = {p.rank: int(round(sum(d for d, t in zip(p.duration, p.types) if t == "COMP") * 1e9)) for p in programs}
    exposed = {r: finished[r] - gpu[r] for r in finished}
    comm = {}
    for a, p in enumerate(programs):
        spans = sorted((rep.start[a][i], rep.end[a][i]) for i, t in enumerate(p.types) if t != "COMP")
        total, end = 0.0, float("-inf")
        for s, e in spans:
            if e <= end:
                continue
            total += e - max(s, end)
            end = e
        comm[p.rank] = int(round(total * 1e9))
    return AstraRunResult(finished, exposed, gpu, comm)
