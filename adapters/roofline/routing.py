"""Where a routed token's copies go, for a dispatcher that deduplicates them per node.

Megatron-Core's ``flex`` dispatcher (DeepEP's kernels) sends a token across the scale-out
network once for each scale-up domain (node) holding one of its experts, to the GPU of the same
local rank there, which forwards it over NVLink to the experts of that node; the plain
``alltoall`` dispatcher sends one copy per expert. With group-limited routing (DeepSeek-V3:
256 experts in 8 groups, a token's 8 experts from its 4 best groups, one group per node) a token
reaches at most ``group_topk`` nodes, so deduplication halves what crosses the network.

What the network model needs is the expected number of domains a token reaches. Routing is taken
as balanced and uniform (every group, and every expert within the chosen groups, equally likely:
what the load-balancing loss aims at), and experts are placed in order on the expert-parallel
ranks, whose domains each hold an equal, contiguous share of them (groups map onto domains).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stage_cosim.model.config import ModelConfig
    from stage_cosim.parallel import ParallelConfig


@dataclass(frozen=True)
class TokenRouting:
    """A routed token's choice: ``topk`` of ``experts`` experts, taken from the ``group_topk``
    best of ``groups`` equal groups (unlimited routing: every expert its own group, and
    ``group_topk`` = ``topk``)."""

    experts: int
    topk: int
    groups: int
    group_topk: int

    @classmethod
    def of(cls, model: "ModelConfig", parallel: "ParallelConfig") -> "TokenRouting | None":
        """The routing whose copies the dispatcher deduplicates per node (None: the dispatcher
        sends every copy, or the model has no experts)."""
        if not model.is_moe or parallel.moe_token_dispatcher != "flex":
            return None
        if model.moe_router_num_groups is None:
            return cls(model.num_experts, model.moe_router_topk, model.num_experts, model.moe_router_topk)
        return cls(model.num_experts, model.moe_router_topk, model.moe_router_num_groups, model.moe_router_group_topk)

    @classmethod
    def of_manifest(cls, manifest: dict) -> "TokenRouting | None":
        """The same from a trace set's manifest (its model and parallel configuration)."""
        model, par = manifest.get("model") or {}, manifest.get("parallel") or {}
        experts = model.get("num_experts")
        if not experts or par.get("moe_token_dispatcher") != "flex":
            return None
        topk = int(model.get("moe_router_topk") or 1)
        groups, chosen = model.get("moe_router_num_groups"), model.get("moe_router_group_topk")
        if not groups or not chosen:
            return cls(int(experts), topk, int(experts), topk)
        return cls(int(experts), topk, int(groups), int(chosen))

    def domains_reached(self, domains: int) -> float:
        """The expected number of the ``domains`` domains (each holding experts / domains of the
        experts, in order) that hold at least one of a token's experts."""
        e, k, g, chosen = self.experts, self.topk, self.groups, self.group_topk
        if domains <= 1:
            return float(domains)
        if e % domains:
            raise ValueError(f"{e} experts do not spread evenly over {domains} domains")
        if g % domains and domains % g:          # groups straddle domains unevenly: not limited
            g, chosen = e, k
        per_group = e // g
        pool = chosen * per_group                # the experts of the chosen groups
        if g % domains == 0:
            # a domain holds g / domains whole groups; j of them chosen (hypergeometric)
            held = g // domains
            reached = sum(comb(held, j) * comb(g - held, chosen - j) / comb(g, chosen)
                          * (1 - comb(pool - j * per_group, k) / comb(pool, k))
                          for j in range(min(held, chosen) + 1))
        else:
            # a group spans domains / g domains, each holding experts / domains of it
            share = e // domains
            reached = chosen / g * (1 - comb(pool - share, k) / comb(pool, k))
        return domains * reached

    def remote_domains(self, domains: int) -> float:
        """The expected number of other domains than the sender's that a token reaches (by
        symmetry its own is reached as often as any other)."""
        return self.domains_reached(domains) * (domains - 1) / domains
