"""ASTRA-sim's network layer (§1, §2 of ``astra-sim-cost-model.md``): the delay of one message
between two ranks, and the cost of reducing one.

Part of the analytical model that :mod:`astra_system` describes; times are integer nanoseconds.
"""

from __future__ import annotations

import math
from typing import Sequence

from stage_cosim.adapters.astra_sim.astra_system import AstraSystem
from stage_cosim.adapters.roofline.classes import Topology
from stage_cosim.hardware.network import NetworkDim

# -- §1, §2: one message, one reduction -----------------------------------------------------------

class Network(Topology):
    """The network dimensions with each rank's coordinates precomputed, and a delay cache.

    Message delays are looked up millions of times in large collectives, so they are memoised
    per (source, destination, bytes).
    """

    def __init__(self, dims: Sequence[NetworkDim]) -> None:
        super().__init__(dims)
        self._bpns = [d.bytes_per_ns for d in self.dims]
        self._cache: dict[tuple[int, int, int], int] = {}
        self._rings: dict[int, tuple[tuple[int, ...], ...]] = {}

    def delay(self, src: int, dst: int, size: int) -> int:
        """§1: floor(hops * latency + bytes / bandwidth) on the lowest differing dimension."""
        key = (src, dst, size)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        a, b = self.coords[src], self.coords[dst]
        value = 0
        for d, (x, y) in enumerate(zip(a, b)):
            if x != y:
                dim = self.dims[d]
                value = math.floor(dim.hops(x, y) * dim.latency_ns + size / self._bpns[d])
                break
        self._cache[key] = value
        return value

    def ring_of(self, rank: int, dim: int) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only in dimension ``dim``, by coordinate."""
        stride = math.prod(d.npus for d in self.dims[:dim])
        base = rank - self.coords[rank][dim] * stride
        return tuple(base + k * stride for k in range(self.dims[dim].npus))

    def rings(self, dim: int) -> tuple[tuple[int, ...], ...]:
        """Every ring of dimension ``dim`` (memoised: plans are rebuilt per collective)."""
        found = self._rings.get(dim)
        if found is None:
            stride = math.prod(d.npus for d in self.dims[:dim])
            n = self.dims[dim].npus
            found = tuple(tuple(base + k * stride for k in range(n))
                          for base in range(self.n_ranks) if (base // stride) % n == 0)
            self._rings[dim] = found
        return found


def message_delay(network: Sequence[NetworkDim] | Network, src: int, dst: int, size: int) -> int:
    """§1: the time one message of ``size`` bytes takes from rank ``src`` to rank ``dst``."""
    net = network if isinstance(network, Network) else Network(network)
    return net.delay(src, dst, size)


def reduction_cost(system: AstraSystem, size: int) -> int:
    """§2: R(m) = 3 * floor(m / (local-mem-bw * 1e9) * 1e9); 0 without local-mem-bw.

    Local memory bandwidth is decimal GB/s here, unlike the network's 2^30.
    """
    if system.local_mem_bw_GBps is None:
        return 0
    return 3 * math.floor(size / (system.local_mem_bw_GBps * 1e9) * 1e9)
