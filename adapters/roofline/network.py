"""Network models: how long collectives and point-to-point messages take, and which stream
(execution slot) each communication node occupies on its rank.

Two models share one interface (:class:`NetworkModel`):

* :class:`CalibratedNetwork` — what real clusters do: NCCL-like choice between ring and tree,
  hierarchical (intra-domain, then inter-domain) decomposition, achievable bus bandwidth per
  link type, and one stream per kind of parallelism so tp, dp and pp traffic overlap each other
  and compute.
* ``astra`` (:mod:`stage_cosim.adapters.astra_sim.analytical`) — ASTRA-sim's
  congestion-unaware analytical backend, reproduced exactly. It runs its own replay, in the
  ASTRA-sim package, which builds on this one: :mod:`stage_cosim.adapters.simulate` picks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from stage_cosim.hardware.cluster import Cluster

# The network models of the built-in simulator, by name (--network-model): the engine's, and
# ASTRA-sim's (its package's; stage_cosim.adapters.simulate dispatches).
NETWORK_MODELS = ("calibrated", "astra")


class NetworkModel(Protocol):
    name: str

    def stream(self, node_type: str, kind: str) -> str | None:
        """The execution slot a COLL/SEND/RECV node of group ``kind`` needs (None: no slot)."""

    def collective(self, coll: str, nbytes: int, members: Sequence[int], starts: Sequence[float]) -> list[float]:
        """Finish time of each member, given when each member issued the collective (seconds)."""

    def p2p(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        """(how long the send occupies its slot, delay from send issue to arrival), seconds."""


@dataclass
class CalibratedNetwork:
    """Collective costs from link bandwidth * efficiency and per-hop latency (alpha-beta),
    with NCCL's algorithm choice and a two-level (scale-up, scale-out) decomposition."""

    cluster: Cluster
    name: str = "calibrated"
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        c, g = self.cluster, self.cluster.gpu
        self.bw_up = c.scale_up.bandwidth_GBps * 1e9 * g.scale_up_efficiency
        self.lat_up = c.scale_up.latency_ns * 1e-9
        self.bw_out = c.scale_out.bandwidth_GBps / c.scale_out.oversubscription * 1e9 * g.scale_out_efficiency
        self.lat_out = c.scale_out.latency_ns * 1e-9
        self.domain = c.domain

    def stream(self, node_type: str, kind: str) -> str | None:
        if node_type == "RECV":
            return None          # a posted receive waits for data, it occupies nothing
        if node_type == "SEND" and kind == "pp":
            return "send"        # pipeline sends
        # One stream per communicator kind (the cp ring's sends too): PyTorch's ProcessGroupNCCL
        # runs every collective of a process group on that group's one internal NCCL stream,
        # whichever stream issued it, so they run one at a time in issue order. FSDP issues its
        # all-gathers from its unshard stream and its reduce-scatters from its post-backward
        # stream, over the same (data-parallel) group: they share this stream.
        return f"comm:{kind}"

    # -- one level --------------------------------------------------------------------------

    @staticmethod
    def _ring(steps: int, nbytes_per_step: float, bw: float, lat: float) -> float:
        return steps * (nbytes_per_step / bw + lat)

    def _allreduce(self, nbytes: float, n: int, bw: float, lat: float) -> float:
        if n <= 1:
            return 0.0
        ring = 2 * (n - 1) * (nbytes / n / bw + lat)
        # Double binary tree: log-depth latency, about the same bandwidth term as the ring.
        tree = 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw
        return min(ring, tree)

    def _gather_like(self, out_bytes: float, n: int, bw: float, lat: float) -> float:
        """All-gather (or reduce-scatter) moving (n-1)/n of ``out_bytes`` through each rank."""
        if n <= 1:
            return 0.0
        return (n - 1) * (out_bytes / n / bw + lat)

    # -- the interface --------------------------------------------------------------------------

    def _shape(self, members: Sequence[int]) -> tuple[int, int]:
        """(domains spanned, members per domain)."""
        domains = {r // self.domain for r in members}
        k = len(domains)
        return k, max(1, len(members) // k)

    def placement_key(self, members: Sequence[int]) -> tuple[int, int]:
        """What a collective's cost depends on besides its kind and size: collectives over
        member lists with equal keys take equally long (the fast simulator times a block once
        for all pipeline stages whose groups are placed alike)."""
        return len(members), self._shape(members)[0]

    def duration(self, coll: str, nbytes: int, members: Sequence[int]) -> float:
        n = len(members)
        if n <= 1:
            return 0.0
        k, m = self._shape(members)
        key = (coll, nbytes, n, k)
        if key in self._cache:
            return self._cache[key]
        up, out = (self.bw_up, self.lat_up), (self.bw_out, self.lat_out)
        if coll == "ALL_REDUCE":
            t = (self._gather_like(nbytes, m, *up) + self._allreduce(nbytes / m, k, *out)
                 + self._gather_like(nbytes, m, *up))
            if k == 1:
                t = self._allreduce(nbytes, m, *up)
        elif coll == "REDUCE_SCATTER":      # nbytes: each rank's input
            t = self._gather_like(nbytes, m, *up) + self._gather_like(nbytes / m, k, *out)
        elif coll == "ALL_GATHER":          # nbytes: each rank's shard
            t = self._gather_like(nbytes * k, k, *out) + self._gather_like(nbytes * n, m, *up)
        elif coll == "ALL_TO_ALL":          # nbytes: each rank's whole send buffer
            intra = (m - 1) * (nbytes / n / self.bw_up + self.lat_up)
            inter = (n - m) * nbytes / n / self.bw_out + (self.lat_out if k > 1 else 0.0)
            t = max(intra, inter)
        else:
            raise ValueError(f"collective {coll} has no cost model")
        self._cache[key] = t
        return t

    def collective(self, coll: str, nbytes: int, members: Sequence[int], starts: Sequence[float]) -> list[float]:
        end = max(starts) + self.duration(coll, nbytes, members)
        return [end] * len(members)

    def p2p(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        if src // self.domain == dst // self.domain:
            t = self.lat_up + nbytes / self.bw_up
        else:
            t = self.lat_out + nbytes / self.bw_out
        return t, t
