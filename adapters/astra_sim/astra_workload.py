"""ASTRA-sim's workload layer (§7 of ``astra-sim-cost-model.md``), its pieces outside the replay
itself (:mod:`astra_replay`; :func:`analytical.simulate_astra` replays plain node lists): what a
run prints per rank (:class:`AstraRunResult`) and how long a compute node takes (replayed or
roofline).

Part of the analytical model that :mod:`astra_system` describes; times are integer nanoseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage_cosim.adapters.astra_sim.astra_system import AstraSystem
from stage_cosim.adapters.roofline.classes import replay_ns
from stage_cosim.errors import UserError, require
from stage_cosim.trace.chakra import TraceNode

# -- §7: the workload layer -------------------------------------------------------------------

@dataclass
class AstraRunResult:
    """Per-rank results, as ASTRA-sim prints them (``sys[r] finished, T cycles, exposed
    communication X cycles``, and ``GPU time`` / ``Comm time``)."""

    finished_ns: dict[int, int]
    exposed_comm_ns: dict[int, int]
    gpu_time_ns: dict[int, int]
    comm_time_ns: dict[int, int]

    @property
    def step_time_ns(self) -> int:
        """The largest finish time over ranks: the step time."""
        return max(self.finished_ns.values(), default=0)


def compute_duration_ns(node: TraceNode, system: AstraSystem) -> int:
    """§7: replay duration_micros * 1000 (0 gives 1 ns), or the roofline time
    floor(num_ops / min(local-mem-bw * 1e9 * num_ops / tensor_size, peak-perf * 1e12) * 1e9).
    Host (is_cpu_op) nodes are always replayed."""
    if not system.roofline_enabled or node.attrs.get("is_cpu_op") is True:
        return replay_ns(node.duration_micros)
    return roofline_ns(_int_attr(node, "num_ops", 0), _int_attr(node, "tensor_size", 0), system, node.id)


def roofline_ns(num_ops: int, tensor_size: int, system: AstraSystem, node_id: int | None = None) -> int:
    """The simulator's roofline time of a compute node (roofline-enabled 1)."""
    where = f"node {node_id} " if node_id is not None else ""
    require(tensor_size > 0, f"{where}tensor_size",
            "roofline compute needs tensor_size > 0 (the simulator skips the node and stalls)")
    require(num_ops > 0, f"{where}num_ops", "roofline compute needs num_ops > 0")
    require(system.local_mem_bw_GBps is not None and system.peak_perf_TFLOPS is not None,
            "roofline-enabled", "needs local-mem-bw and peak-perf")
    perf = min(system.local_mem_bw_GBps * 1e9 * (float(num_ops) / float(tensor_size)),
               system.peak_perf_TFLOPS * 1e12)
    return int(float(num_ops) / perf * 1e9)


def _int_attr(node: TraceNode, name: str, default: int | None = None) -> int:
    value = node.attrs.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"node {node.id} {name}", f"must be an integer attribute, got {value!r}")
    return value
