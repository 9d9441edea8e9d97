"""The scale-out network of a tiered topology as a compact link model: which links a flow
between two GPUs crosses, and how much each link carries.

Links, numbered densely so that a pattern of flows becomes a sparse flows x links matrix:

* each GPU's NIC, out and in (the NIC's bandwidth);
* each switch group's uplinks, up and down, at every tier below the top. A tier-1 group is a
  leaf: ``switch_radix / 2`` endpoints below it (half its ports down, half up, as a leaf of a
  non-blocking fat-tree is wired); a tier-t group holds ``(radix / 2)^t`` endpoints. A group's
  uplinks carry what its endpoints' NICs can, divided by the oversubscription of every tier up
  to it (``scale_out.oversubscription``, leaf first; tiers past the list are non-blocking).

Endpoints: in a ``fat-tree`` a node's NICs sit side by side on the leaves (GPU g is endpoint g);
in the rail designs NIC i of every node is on rail i (endpoint = node, one set of leaves per
rail). ``rail-optimized`` joins the rails at tier 2 (a spine over all of them, whose groups hold
every rail of their nodes); ``rail-only`` never joins them. In both, a flow between GPUs of
different rails first moves over NVLink to the GPU of the destination's rail in its own node
(NCCL's PXN, on by default), so the scale-out network carries it on one rail.

Planes (``scale_out.planes``) are identical networks that every flow is striped over evenly: each
link and each flow divide by the same number, so contention is that of one plane.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stage_cosim.hardware.cluster import Cluster


@dataclass(frozen=True)
class Fabric:
    topology: str
    num_gpus: int
    rails: int            # GPUs (NICs) per node; 1 where rails are not modelled (fat-tree)
    half: int             # endpoints below a leaf: half the switch's ports
    oversubscription: tuple[float, ...]   # tier 1 (leaf) first
    nic_GBps: float

    @classmethod
    def of(cls, cluster: Cluster) -> "Fabric | None":
        """The cluster's fabric; None where the scale-out network is one number (Switch, Ring,
        FullyConnected) or there is no scale-out traffic."""
        out = cluster.scale_out
        if not out.tiered or cluster.num_domains <= 1:
            return None
        rails = 1 if out.topology == "fat-tree" else cluster.rails
        return cls(out.topology, cluster.num_gpus, rails, out.switch_radix // 2, out.tiers_oversubscription,
                   out.bandwidth_GBps)

    @property
    def railed(self) -> bool:
        return self.topology != "fat-tree"

    @property
    def endpoints_per_rail(self) -> int:
        return -(-self.num_gpus // self.rails)

    @property
    def tiers(self) -> int:
        """Tiers of switches below the top one: a flow climbs at most this many uplinks."""
        t, reach = 0, 1
        while reach < self.endpoints_per_rail:
            t += 1
            reach *= self.half
        return max(0, t - 1)

    def over(self, tier: int) -> float:
        """The product of the oversubscriptions of tiers 1 … ``tier``."""
        return float(np.prod([self.oversubscription[i] if i < len(self.oversubscription) else 1.0
                              for i in range(tier)]))

    def _groups(self, gpus: np.ndarray, tier: int) -> tuple[np.ndarray, int, float]:
        """(each GPU's tier-``tier`` group, the number of groups, one group's uplink capacity
        in GB/s)."""
        unit = self.half ** tier
        if not self.railed:
            groups, count, endpoints = gpus // unit, -(-self.num_gpus // unit), unit
        else:
            node, rail = gpus // self.rails, gpus % self.rails
            per_rail = -(-self.endpoints_per_rail // unit)
            if tier >= 2 and self.topology == "rail-optimized":     # the spine joins the rails
                groups, count, endpoints = node // unit, per_rail, unit * self.rails
            else:
                groups, count, endpoints = rail * per_rail + node // unit, per_rail * self.rails, unit
        return groups, count, endpoints * self.nic_GBps / self.over(tier)

    def pxn(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Where each flow enters the scale-out network: on a railed fabric, the GPU of the
        destination's rail in the source's node (NVLink carries it there first)."""
        if not self.railed:
            return src
        return src - src % self.rails + dst % self.rails

    def incidence(self, src: np.ndarray, dst: np.ndarray, nic_only: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flow index, link index, capacity of every link in GB/s): the links each flow
        ``src[i] -> dst[i]`` crosses (after PXN), as coordinates of a sparse matrix."""
        src = self.pxn(src, dst)
        n = self.num_gpus
        flows = np.arange(len(src))
        rows, cols = [flows, flows], [src, n + dst]
        capacity = [np.full(2 * n, self.nic_GBps)]
        offset = 2 * n
        for tier in range(1, 0 if nic_only else self.tiers + 1):
            gs, count, cap = self._groups(src, tier)
            gd, _, _ = self._groups(dst, tier)
            crossing = gs != gd
            f = flows[crossing]
            rows += [f, f]
            cols += [offset + gs[crossing], offset + count + gd[crossing]]
            capacity.append(np.full(2 * count, cap))
            offset += 2 * count
        return np.concatenate(rows), np.concatenate(cols), np.concatenate(capacity)
