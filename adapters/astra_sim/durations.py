"""The compute durations an export writes into its traces (``--compute replay``): each compute
node's time from our GPU model in whole microseconds, the simulator's unit, with the rounding
error carried from node to node in each rank's compute order, so that a chain of short kernels
keeps its total to within 1 µs (a 3 µs norm would otherwise be off by up to 17 %, and 0 would
become 1 ns).

Both the exporter (:mod:`export`) and the replay of an export without writing it
(:mod:`analytical`) use them: the replay times every node exactly as the binary will read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stage_cosim.schedule.nodes import COMP, RoleGraph, op_kind

if TYPE_CHECKING:
    from stage_cosim.adapters.roofline.compute import ComputeModel


def replay_durations(compute: ComputeModel):  # noqa: ANN201 (Durations)
    """duration_micros per node of a role, rounded with the error carried along (see above)."""
    cache: dict[int, list[int]] = {}
    kernel_ns: dict[tuple[int, int, bool, str], float] = {}     # a kernel recurs every micro-batch

    def durations(role: RoleGraph) -> list[int]:
        if id(role) in cache:
            return cache[id(role)]
        out = [0] * len(role.nodes)
        exact_ns = 0.0
        written_us = 0
        for n in role.nodes:
            if n.type != COMP:
                continue
            key = (n.flops, n.mem_bytes, n.matmul, n.category, n.groups, n.keys)
            t = kernel_ns.get(key)
            if t is None:
                t = kernel_ns[key] = compute.duration_of(n.flops, n.mem_bytes, op_kind(n.category, n.matmul),
                                                         n.groups, n.keys) * 1e9
            exact_ns += t
            target = round(exact_ns / 1000)
            out[n.id] = max(0, target - written_us)
            written_us += out[n.id]
        cache[id(role)] = out
        return out

    return durations
