"""The bill of materials of a cluster's scale-out network: switches, links and transceivers,
counted from its topology, and their price from unit prices a spec gives.

Counting rule (a folded Clos, the fewest switches of the given radix ``r`` that wire every NIC):
with ``h = r / 2`` (a non-top switch has half its ports down, half up), a network of ``N``
endpoints needs ``T`` tiers, the least with ``N <= 2 h^T`` (one tier: one switch of ``r``
ports). Tier 1 takes the ``N`` NIC links on ``N / h`` leaves; each tier's uplinks are its
downlinks divided by its oversubscription (``scale_out.oversubscription``, leaf first; tiers
past the list are non-blocking), and the top tier takes them on switches with every port down
(``ports / r``). So a non-blocking two-tier fat-tree of 1,024 NICs and 64-port switches is 32
leaves and 16 spines, 2,048 links; a 4:1 leaf uplink leaves 4 spines and 1,280 links.

The designs differ in what the tree spans: ``fat-tree`` and ``Switch`` (one switch to the
collectives, priced as the fat-tree of its radix) one tree over every GPU; ``rail-optimized``
one leaf set per rail (NIC *i* of every node, a partly filled leaf per rail at most) under one
spine over all rails; ``rail-only`` a separate tree per rail, no spine
joining them. ``planes`` repeat the whole network (each GPU's NIC has a port on every plane).
``Ring`` and ``FullyConnected`` have no switches to count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stage_cosim.errors import UserError, require
from stage_cosim.hardware.cluster import Cluster

# What a network price list names: $ per GPU's NIC, per switch port (a switch costs its radix
# times this), per transceiver and per cable; optics and cables may be priced per link tier
# (a list: NIC-to-leaf first, then leaf-to-spine, ...), a number prices every tier alike.
PRICE_KEYS = ("nic", "switch_port", "optic", "cable")


@dataclass(frozen=True)
class FabricCount:
    """One cluster's scale-out hardware (every plane together)."""

    nics: int                         # one per GPU
    switches: tuple[int, ...]         # per tier, leaf first
    links: tuple[int, ...]            # per link tier: NIC-to-leaf first, then each tier's uplinks
    radix: int

    @property
    def switch_ports(self) -> int:
        return sum(self.switches) * self.radix

    @property
    def optics(self) -> tuple[int, ...]:
        """Transceivers per link tier: one at each end of every link."""
        return tuple(2 * n for n in self.links)


def tiers_for(endpoints: int, radix: int) -> int:
    """The tiers of the smallest folded Clos of ``radix``-port switches with ``endpoints`` ports down."""
    half, t = radix // 2, 1
    while endpoints > 2 * half ** t:
        t += 1
    return t


def _tree(endpoints: int, radix: int, over: tuple[float, ...]) -> tuple[list[int], list[int]]:
    """(switches per tier, links per link tier) of one folded Clos over ``endpoints`` NICs."""
    tiers = tiers_for(endpoints, radix)
    half = radix // 2
    switches, links, ports = [], [endpoints], endpoints
    for t in range(1, tiers + 1):
        if t == tiers:
            switches.append(math.ceil(ports / radix))
            break
        switches.append(math.ceil(ports / half))
        ports = math.ceil(ports / (over[t - 1] if t - 1 < len(over) else 1.0))
        links.append(ports)
    return switches, links


def count(cluster: Cluster) -> FabricCount:
    """The scale-out network's switches and links for the cluster's GPUs (the rule above)."""
    out = cluster.scale_out
    require(out.topology not in ("Ring", "FullyConnected"), "scale_out.topology",
            f"a {out.topology} scale-out network has no switches to price (give a switched or tiered topology)")
    n, radix, over = cluster.num_gpus, out.switch_radix, out.tiers_oversubscription
    if out.topology == "rail-only":
        rails = cluster.rails
        sw, ln = _tree(math.ceil(n / rails), radix, over)
        sw, ln = [rails * s for s in sw], [rails * x for x in ln]
    else:
        sw, ln = _tree(n, radix, over)
        if out.topology == "rail-optimized" and len(sw) > 1:
            # each rail's nodes on leaves of their own, a partly filled leaf per rail at most
            sw[0] = cluster.rails * math.ceil(math.ceil(n / cluster.rails) / (radix // 2))
    planes = out.planes
    return FabricCount(nics=n, switches=tuple(planes * s for s in sw), links=tuple(planes * x for x in ln),
                       radix=radix)


def _per_tier(price: float | list[float], tiers: int, key: str) -> list[float]:
    if isinstance(price, list):
        require(len(price) >= tiers, f"network_cost.{key}",
                f"prices {len(price)} link tiers, the network has {tiers} (NIC-to-leaf first)")
        return [float(p) for p in price[:tiers]]
    return [float(price)] * tiers


def check_prices(prices: object, where: str = "network_cost") -> dict:
    """A network price list as a spec gives it: each of PRICE_KEYS a non-negative number (optic
    and cable: or a list per link tier); a missing key is priced 0."""
    if not isinstance(prices, dict):
        raise UserError(where, f"must map {', '.join(PRICE_KEYS)} to $ prices")
    for k, v in prices.items():
        if k not in PRICE_KEYS:
            raise UserError(f"{where}.{k}", f"is not a network price (prices: {', '.join(PRICE_KEYS)})")
        vals = v if isinstance(v, list) and k in ("optic", "cable") else [v]
        for x in vals:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise UserError(f"{where}.{k}", f"must be a non-negative number of $"
                                f"{' (or a list per link tier)' if k in ('optic', 'cable') else ''}, got {v!r}")
    return dict(prices)


def cost_per_gpu(cluster: Cluster, prices: dict) -> float:
    """$ per GPU of the cluster's scale-out network at ``prices`` (check_prices)."""
    c = count(cluster)
    tiers = len(c.links)
    total = c.nics * float(prices.get("nic", 0.0)) + c.switch_ports * float(prices.get("switch_port", 0.0))
    total += sum(o * p for o, p in zip(c.optics, _per_tier(prices.get("optic", 0.0), tiers, "optic")))
    total += sum(x * p for x, p in zip(c.links, _per_tier(prices.get("cable", 0.0), tiers, "cable")))
    return total / cluster.num_gpus
