"""Network dimensions, in the vocabulary ASTRA-sim's analytical backend uses.

A cluster's network is a list of dimensions, innermost first (dimension 0 varies fastest in
the rank numbering: rank = x0 + n0*x1 + n0*n1*x2 ...). Bandwidth is GB/s per link per
direction with GB = 2^30 bytes, as ASTRA-sim reads it; latency is ns per hop.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage_cosim.errors import require

TOPOLOGIES = ("Ring", "FullyConnected", "Switch")
# The scale-out network's designs beyond ASTRA-sim's one-switch view: switches in tiers of a
# given radix, each tier's uplinks thinner by its oversubscription. ``fat-tree``: a node's NICs on
# one leaf; ``rail-optimized``: NIC i of every node on rail i's leaves, one spine over all rails
# (DGX SuperPOD); ``rail-only``: rails never meet above the leaves, traffic changes rail over
# NVLink (Wang et al., "Rail-only", 2024).
TIERED_TOPOLOGIES = ("fat-tree", "rail-optimized", "rail-only")
SCALE_OUT_TOPOLOGIES = TOPOLOGIES + TIERED_TOPOLOGIES


@dataclass(frozen=True)
class NetworkDim:
    topology: str
    npus: int
    bandwidth_GBps: float
    latency_ns: float

    def __post_init__(self) -> None:
        require(self.topology in TOPOLOGIES, "topology",
                f"must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        require(isinstance(self.npus, int) and self.npus >= 1, "npus", f"must be a positive integer, got {self.npus!r}")
        require(self.bandwidth_GBps > 0, "bandwidth", f"must be positive, got {self.bandwidth_GBps!r}")
        require(self.latency_ns >= 0, "latency", f"must be non-negative, got {self.latency_ns!r}")

    @property
    def bytes_per_ns(self) -> float:
        """Bandwidth in bytes per nanosecond (GB = 2^30 B)."""
        return self.bandwidth_GBps * (1 << 30) / 1e9

    def hops(self, a: int, b: int) -> int:
        """Hops between positions ``a`` and ``b`` of this dimension."""
        if a == b:
            return 0
        if self.topology == "Ring":
            k = abs(a - b)
            return min(k, self.npus - k)
        return 1 if self.topology == "FullyConnected" else 2


def coordinates(rank: int, dims: list[NetworkDim] | tuple[NetworkDim, ...]) -> list[int]:
    out = []
    for d in dims:
        out.append(rank % d.npus)
        rank //= d.npus
    return out
