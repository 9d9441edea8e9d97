"""Test helpers: ASTRA-sim inputs written by hand, in the layout the exporter uses, and the
binary's result read back (for tests that run the real simulator when ASTRA_SIM_BIN is set)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from stage_cosim.adapters.astra_sim.config_files import write_memory_json, write_network_yml, write_system_json
from stage_cosim.adapters.astra_sim.run import AstraSimError, run
from stage_cosim.adapters.astra_sim.astra_system import COLLECTIVES, AstraSystem
from stage_cosim.hardware.network import NetworkDim
from stage_cosim.trace.chakra import TraceNode, write_trace_file

BINARY = os.environ.get("ASTRA_SIM_BIN")
KINDS = {"is_cpu_op": "bool_val", "comm_type": "uint64_val", "comm_size": "uint64_val", "comm_tag": "uint64_val",
         "comm_src": "uint64_val", "comm_dst": "uint64_val", "pg_name": "string_val"}


def comp(i: int, micros: int, deps: tuple[int, ...] = ()) -> TraceNode:
    return TraceNode(i, f"comp{i}", 4, list(deps), [], micros, {"is_cpu_op": False}, {"is_cpu_op": "bool_val"})


def coll(i: int, ctype: int, size: int, deps: tuple[int, ...] = (), pg: str | None = None,
         micros: int = 0) -> TraceNode:
    attrs: dict[str, object] = {"is_cpu_op": False, "comm_type": ctype, "comm_size": size}
    if pg is not None:
        attrs["pg_name"] = pg
    return TraceNode(i, f"coll{i}", 7, list(deps), [], micros, attrs, {k: KINDS[k] for k in attrs})


def p2p(i: int, typ: int, peer: int, size: int, tag: int = 1, deps: tuple[int, ...] = ()) -> TraceNode:
    key = "comm_dst" if typ == 5 else "comm_src"
    attrs = {"comm_size": size, "comm_tag": tag, key: peer}
    return TraceNode(i, "send" if typ == 5 else "recv", typ, list(deps), [], 0, attrs, {k: KINDS[k] for k in attrs})


def system(**overrides: object) -> AstraSystem:
    settings: dict[str, object] = {"preferred_dataset_splits": 4, "local_mem_bw_GBps": 1600.0,
                                   "implementations": {c: ("ring",) for c in COLLECTIVES}}
    settings.update(overrides)
    return AstraSystem(**settings)  # type: ignore[arg-type]


def write_inputs(d: Path, ranks: dict[int, list[TraceNode]], dims: list[NetworkDim],
                 sysconf: AstraSystem | None = None, groups: dict[str, list[int]] | None = None) -> Path:
    """An ASTRA-sim run directory: traces/workload.<r>.et, system.json, network.yml,
    memory.json, comm_groups.json."""
    (d / "traces").mkdir(parents=True)
    for r, nodes in ranks.items():
        write_trace_file(d / "traces" / f"workload.{r}.et", nodes)
    write_system_json(sysconf or system(), d / "system.json")
    write_network_yml(dims, d / "network.yml")
    write_memory_json(d / "memory.json")
    (d / "comm_groups.json").write_text(json.dumps(groups or {}))
    return d


def replay_args(d: Path) -> list[str]:
    """``astra-sim replay`` with the binary's own flags on a run directory."""
    return ["astra-sim", "replay", f"--workload-configuration={d / 'traces' / 'workload'}",
            f"--system-configuration={d / 'system.json'}", "--network-configuration", str(d / "network.yml"),
            f"--remote-memory-configuration={d / 'memory.json'}", f"--comm-group-configuration={d / 'comm_groups.json'}"]


class RankEnd(NamedTuple):
    """What the binary prints for one rank: ``sys[r] finished, F cycles, exposed communication E cycles``."""

    finished: int
    exposed_comm: int


def run_binary(d: Path, ranks: int, timeout_s: float = 60.0) -> dict[int, RankEnd] | str:
    """The real simulator on a run directory: rank -> its RankEnd, or the kind of failure
    (signal, exit, deadlock, timeout)."""
    assert BINARY, "set ASTRA_SIM_BIN"
    try:
        out = run(BINARY, d, ranks, timeout_s).output
    except AstraSimError as exc:
        return exc.kind
    return {r: RankEnd(out.finished_ns[r], out.exposed_comm_ns[r]) for r in out.finished_ns}
