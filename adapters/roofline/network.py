"""Network models: how long collectives and point-to-point messages take, and which stream
(execution slot) each communication node occupies on its rank.

Two models share one interface (:class:`NetworkModel`):

* :class:`CalibratedNetwork` — what real clusters do: NCCL-like choice between ring and tree,
  hierarchical (intra-domain, then inter-domain) decomposition, achievable bus bandwidth per
  link type, and one stream per kind of parallelism so tp, dp and pp traffic overlap each other
  and compute. The all-reduce algorithm is a parameter (``algorithm``, NCCL_ALGO's role):
  ``auto`` (the default, what every ``simulate`` uses: the fastest of ring, tree, NVLS inside an
  NVSwitch domain and CollNet where the scale-out switches reduce), ``ring``, ``tree``, ``nvls``
  (NVLink SHARP) or ``collnet``. On a tiered scale-out network the inter-domain steps run at the
  NIC's rate times their flows' slowdown under contention (:mod:`.contention`).
* ``astra`` (:mod:`stage_cosim.adapters.astra_sim.analytical`) — ASTRA-sim's
  congestion-unaware analytical backend, reproduced exactly. It runs its own replay, in the
  ASTRA-sim package, which builds on this one: :mod:`stage_cosim.adapters.simulate` picks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from stage_cosim.adapters.roofline.contention import Contention
from stage_cosim.adapters.roofline.routing import TokenRouting
from stage_cosim.adapters.roofline.topology import Fabric
from stage_cosim.hardware.cluster import Cluster

# The network models of the built-in simulator, by name (--network-model): the engine's, and
# ASTRA-sim's (its package's; stage_cosim.adapters.simulate dispatches).
NETWORK_MODELS = ("calibrated", "astra")
# NCCL's all-reduce algorithms the calibrated model has (NCCL_ALGO): "auto" takes the fastest of
# ring, tree, NVLS (where it can run) and collnet (where the switches reduce) by the model's own
# times, as NCCL's tuner picks by size and scale.
ALGORITHMS = ("auto", "ring", "tree", "nvls", "collnet")
# GPU architectures whose NVSwitch reduces in the switch (NVLink SHARP: third-generation NVSwitch
# and later), and the share of the scale-up link's rate an NVLS all-reduce reaches: the switch's
# reduction, not the links, limits it, so the share is of the data-sheet link rate, not of the
# ring's achieved one (scale_up_efficiency). Fitted to nccl-tests' NVLS rows of 8 GiB and more
# (shared nccl_busbw.csv): Azure ND H100 v5 478.87 GB/s busbw at 8 GiB and the 8x H200 node's
# 477-482 GB/s, against 700 at the full link rate (0.684); AWS p6-b200 838 GB/s at 8 GiB against
# 1,400 (0.599).
NVLS_ARCHES = ("hopper", "blackwell")
NVLS_EFFICIENCY = {"hopper": 0.684, "blackwell": 0.599}
# The communicator-group kind of the MoE token dispatcher's all-to-alls
ROUTED_KIND = "ep"


class NetworkModel(Protocol):
    name: str

    def stream(self, node_type: str, kind: str) -> str | None:
        """The execution slot a COLL/SEND/RECV node of group ``kind`` needs (None: no slot)."""

    def collective(self, coll: str, nbytes: int, members: Sequence[int], starts: Sequence[float],
                   kind: str = "") -> list[float]:
        """Finish time of each member, given when each member issued the collective (seconds);
        ``kind``: its communicator group's kind (tp, dp, ep ...)."""

    def p2p(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        """(how long the send occupies its slot, delay from send issue to arrival), seconds."""


@dataclass
class CalibratedNetwork:
    """Collective costs from link bandwidth * efficiency and per-hop latency (alpha-beta),
    with NCCL's algorithm choice and a two-level (scale-up, scale-out) decomposition."""

    cluster: Cluster
    name: str = "calibrated"
    # The all-reduce algorithm (one of ALGORITHMS), for every all-reduce unless a call names its
    # own. Where NVLS cannot run an all-reduce (a GPU without NVLink SHARP, ranks in several
    # domains) the model falls back to auto, as NCCL does; nvls_unavailable() says why.
    algorithm: str = "auto"
    # The workload's routed tokens where its dispatcher deduplicates them per domain (the flex
    # dispatcher): its all-to-alls over ep send each token across domains once per domain
    # reached (routed_all_to_all). None: every routed copy is sent.
    routing: TokenRouting | None = None
    # On a tiered scale-out network, whether every group of a collective's kind runs it at once
    # (a step of SPMD training: all dp groups all-reduce together and share the spine), or the
    # group runs alone (nccl-tests on the cluster's first ranks).
    concurrent: bool = True
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        c, g = self.cluster, self.cluster.gpu
        self.bw_up = c.scale_up.bandwidth_GBps * 1e9 * g.scale_up_efficiency
        self.lat_up = c.scale_up.latency_ns * 1e-9
        self.bw_out = c.scale_out.flat_bandwidth_GBps * 1e9 * g.scale_out_efficiency
        self.lat_out = c.scale_out.latency_ns * 1e-9
        self.domain = c.domain
        fabric = Fabric.of(c)
        self.contention = Contention(fabric, self.domain, self.concurrent) if fabric is not None else None

    def _out(self, pattern: str, members: Sequence[int]) -> tuple[float, float]:
        """(bandwidth, latency) of the scale-out step of a collective over ``members`` whose
        flows follow ``pattern``: the NIC's, times the slowdown of its flows' sharing of a
        tiered network (:mod:`~stage_cosim.adapters.roofline.contention`)."""
        if self.contention is None:
            return self.bw_out, self.lat_out
        return self.bw_out * self.contention.slowdown(pattern, members), self.lat_out

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

    def _allreduce(self, nbytes: float, n: int, bw: float, lat: float, algorithm: str = "auto",
                   tree_bw: float | None = None, collnet: bool = False) -> tuple[float, str]:
        """(time, algorithm) of a one-level all-reduce of ``nbytes`` per rank over ``n`` ranks:
        ``ring``, ``tree``, ``collnet`` (where ``collnet``: the switches reduce), or ``auto``, the
        fastest (ring where they tie); ``tree_bw``: the tree's bandwidth where its flows share
        links otherwise than the ring's."""
        if n <= 1:
            return 0.0, "ring"
        ring = 2 * (n - 1) * (nbytes / n / bw + lat)
        if algorithm == "ring":
            return ring, "ring"
        if algorithm == "collnet" or (algorithm == "auto" and collnet):
            # SHARP: each rank's buffer goes up the switches' reduction tree once and the sum
            # comes back down once; one latency each way
            net = nbytes / bw + 2 * lat
            if algorithm == "collnet" or net < ring:
                return net, "collnet"
        # Double binary tree: log-depth latency, about the same bandwidth term as the ring.
        tree = 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / (tree_bw or bw)
        if algorithm == "tree" or tree < ring:
            return tree, "tree"
        return ring, "ring"

    def _nvls(self, nbytes: float, m: int) -> float:
        """An all-reduce of ``nbytes`` per rank over ``m`` ranks of one NVSwitch domain, reduced
        in the switch (NVLink SHARP). The switch reads every rank's buffer once and adds it up
        (multimem.ld_reduce): each rank's link carries its ``nbytes`` out and its 1/m share of
        the sum in; each rank then stores its share once and the switch multicasts it to all
        (multimem.st): 1/m out, the whole result in. Out and in run at once, both pipelined, so
        each link carries (1 + 1/m)·nbytes each way at the scale-up rate, where a ring carries
        2(m-1)/m·nbytes; one latency for the reduction's round trip, one for the multicast. The
        switch reduces at NVLS_EFFICIENCY of the link's data-sheet rate."""
        rate = self.cluster.scale_up.bandwidth_GBps * 1e9 * NVLS_EFFICIENCY[self.cluster.gpu.arch]
        return (1 + 1 / m) * nbytes / rate + 2 * self.lat_up

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

    def cost_key(self, members: Sequence[int]) -> tuple:
        """Everything the cost of any collective over ``members`` depends on besides its kind,
        size and this network: the group's size, the domains it spans and, on a tiered
        scale-out network, where its flows lie (what :meth:`timed` and :meth:`routed_all_to_all`
        key their caches by). Equal keys: equal times, to the bit."""
        k, _ = self._shape(members)
        return len(members), k, self.contention.key(members) if self.contention is not None and k > 1 else None

    @property
    def identity(self) -> tuple:
        """What this network's costs depend on besides each call's arguments (equal identities,
        equal costs)."""
        return type(self).__name__, self.cluster, self.algorithm, self.routing, self.concurrent

    def nvls_unavailable(self, members: Sequence[int]) -> str | None:
        """Why NVLS cannot run an all-reduce over ``members`` (None: it can)."""
        g, up = self.cluster.gpu, self.cluster.scale_up
        if g.arch not in NVLS_ARCHES:
            return (f"{g.name} ({g.arch}) has no NVLink SHARP: NVLS needs a Hopper or Blackwell GPU "
                    f"on an NVSwitch")
        if up.topology != "Switch":
            return f"the scale-up network is a {up.topology}, not an NVSwitch: NVLS reduces inside the switch"
        k, _ = self._shape(members)
        if k > 1:
            return (f"the {len(members)} ranks span {k} NVLink domains of {self.domain}; NVLS runs inside one "
                    f"(NCCL's NVLS across nodes, NVLSTree, is not modelled)")
        return None

    def collnet_unavailable(self, members: Sequence[int]) -> str | None:
        """Why CollNet (reduction in the scale-out switches) cannot run an all-reduce over
        ``members`` (None: it can)."""
        if not self.cluster.scale_out.in_network_reduction:
            return "the scale-out switches do not reduce (set scale_out.in_network_reduction: true)"
        if self._shape(members)[0] == 1:
            return f"the {len(members)} ranks are in one scale-up domain: no scale-out step to reduce in the switches"
        return None

    def duration(self, coll: str, nbytes: int, members: Sequence[int], algorithm: str | None = None) -> float:
        """How long ``coll`` of ``nbytes`` (the per-collective convention noted at each case)
        takes over ``members``; ``algorithm`` overrides the network's for this all-reduce."""
        return self.timed(coll, nbytes, members, algorithm)[0]

    def timed(self, coll: str, nbytes: int, members: Sequence[int], algorithm: str | None = None) -> tuple[float, str]:
        """(duration, the algorithm that ran it): for an all-reduce ``ring``, ``tree`` or
        ``nvls`` (across domains: the algorithm of the inter-domain step, rings inside); the
        other collectives have one algorithm each, ``ring`` (all-gather, reduce-scatter,
        broadcast) or ``p2p`` (all-to-all: a send to and a receive from every peer)."""
        n = len(members)
        algorithm = self.algorithm if algorithm is None else algorithm
        if n <= 1:
            return 0.0, "p2p" if coll == "ALL_TO_ALL" else "ring"
        k, m = self._shape(members)
        key = (coll, nbytes, n, k, algorithm)
        if self.contention is not None and k > 1:
            key += self.contention.key(members)
        if key in self._cache:
            return self._cache[key]
        up = (self.bw_up, self.lat_up)
        out = self._out("all-to-all" if coll == "ALL_TO_ALL" else "ring", members) if k > 1 else (self.bw_out, self.lat_out)
        name = "ring"
        if coll == "ALL_REDUCE":            # nbytes: each rank's buffer
            if algorithm not in ALGORITHMS:
                raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
            if algorithm == "nvls" and self.nvls_unavailable(members) is None:
                t, name = self._nvls(nbytes, m), "nvls"
            else:
                level = "auto" if algorithm == "nvls" else algorithm
                if k == 1:
                    t, name = self._allreduce(nbytes, m, *up, "auto" if level == "collnet" else level)
                    if level in ("auto", "collnet") and self.nvls_unavailable(members) is None:
                        nvls = self._nvls(nbytes, m)
                        if nvls < t:
                            t, name = nvls, "nvls"
                else:
                    collnet = self.collnet_unavailable(members) is None
                    if level == "collnet" and not collnet:
                        level = "auto"
                    tree_bw = self._out("tree", members)[0] if level in ("auto", "tree") else None
                    inter, name = self._allreduce(nbytes / m, k, *out, level, tree_bw, collnet)
                    t = self._gather_like(nbytes, m, *up) + inter + self._gather_like(nbytes, m, *up)
        elif coll == "REDUCE_SCATTER":      # nbytes: each rank's input
            t = self._gather_like(nbytes, m, *up) + self._gather_like(nbytes / m, k, *out)
        elif coll == "ALL_GATHER":          # nbytes: each rank's shard
            t = self._gather_like(nbytes * k, k, *out) + self._gather_like(nbytes * n, m, *up)
        elif coll == "ALL_TO_ALL":          # nbytes: each rank's whole send buffer
            intra = (m - 1) * (nbytes / n / self.bw_up + self.lat_up)
            inter = (n - m) * nbytes / n / out[0] + (self.lat_out if k > 1 else 0.0)
            t, name = max(intra, inter), "p2p"
        elif coll == "BROADCAST":           # nbytes: the root's buffer, which every rank receives
            # NCCL's ring broadcast: a chain, pipelined in chunks, so the whole buffer crosses the
            # chain's slowest link once; one latency per hop (m-1 inside each domain, k-1 between)
            bw = min(self.bw_up if m > 1 else math.inf, out[0] if k > 1 else math.inf)
            t = nbytes / bw + (n - k) * self.lat_up + (k - 1) * self.lat_out
        else:
            raise ValueError(f"collective {coll} has no cost model")
        self._cache[key] = (t, name)
        return t, name

    def routed_all_to_all(self, nbytes: int, members: Sequence[int]) -> float:
        """The dispatch (or combine) all-to-all of a deduplicating dispatcher, ``nbytes`` each
        rank's routed copies (one per expert a token goes to), as DeepEP runs it: a token
        crosses the scale-out network once for each other domain it reaches, to the GPU of the
        same local rank there, which forwards it over NVLink to the GPUs of its domain holding
        the token's experts. The forwarding pipelines behind the RDMA receive and is not charged
        (DeepEP's measurements name RDMA the bottleneck at every scale from 2 to 8 nodes, where
        a forward per rank reached would make NVLink one); what the sender sends to its own
        domain's experts goes over NVLink as in the plain all-to-all, at the same time."""
        k, m = self._shape(members)
        if k == 1 or self.routing is None:
            return self.duration("ALL_TO_ALL", nbytes, members)
        n = len(members)
        key = ("routed", nbytes, n, k) + (self.contention.key(members) if self.contention is not None else ())
        if key not in self._cache:
            try:
                remote = self.routing.remote_domains(k)
            except ValueError:          # experts not spread evenly over the domains: every copy
                return self.duration("ALL_TO_ALL", nbytes, members)
            inter = nbytes / self.routing.topk * remote / self._out("all-to-all", members)[0] + self.lat_out
            intra = (m - 1) * (nbytes / n / self.bw_up + self.lat_up)
            self._cache[key] = (max(inter, intra), "p2p")
        return self._cache[key][0]

    def span(self, coll: str, nbytes: int, members: Sequence[int], kind: str = "") -> float:
        """How long ``coll`` takes from the last member's issue to every member's finish (its
        communicator group's ``kind`` says whether it is the routed dispatch)."""
        if coll == "ALL_TO_ALL" and kind == ROUTED_KIND and self.routing is not None:
            return self.routed_all_to_all(nbytes, members)
        return self.duration(coll, nbytes, members)

    def collective(self, coll: str, nbytes: int, members: Sequence[int], starts: Sequence[float],
                   kind: str = "") -> list[float]:
        end = max(starts) + self.span(coll, nbytes, members, kind)
        return [end] * len(members)

    def p2p(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        if src // self.domain == dst // self.domain:
            t = self.lat_up + nbytes / self.bw_up
        else:
            t = self.lat_out + nbytes / self.bw_out
        return t, t
