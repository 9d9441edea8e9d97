"""Flow-level contention on a tiered scale-out network: a collective's inter-domain flows, as
NCCL places them, share the fabric's links max-min fairly, and the slowest flow sets its time.

What the calibrated model needs from this is one number per pattern, the *slowdown*: the
slowest flow's max-min rate on the fabric divided by its rate where only the NICs limit it (a
non-blocking network). The model multiplies its scale-out bandwidth by it for that collective,
so a non-blocking fabric changes nothing and the NIC sharing the alpha-beta formulas already
count (an all-to-all's k-1 peers per NIC) is not counted twice.

Flows, per collective over ``k`` domains of ``m`` member ranks each (``D[j][l]``: domain j's
l-th member), all carrying equal bytes at once (NCCL pipelines every step):

* ``ring`` (ring all-reduce, reduce-scatter, all-gather, broadcast's chain): one ring per local
  index l, through the domains in order, ``D[j][l] -> D[j+1][l]`` (NCCL's channels, one NIC each);
* ``tree``: NCCL's double binary tree over the domains per local index, both directions of every
  edge (reduce up, broadcast down, pipelined); the second tree mirrors the first;
* ``all-to-all``: ``D[a][l] -> D[b][l]`` for every ordered pair of domains (with PXN, every
  rank's data for domain b's l-th rank leaves through its node's NIC on that rank's rail).

Concurrent groups: every group of a communicator kind runs the same collective at the same time
(they execute the same program), so the pattern is the union over the collective's group and
all its translates that tile the world (all dp groups' all-reduces cross the spine together).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import sparse

from stage_cosim.adapters.roofline.topology import Fabric

PATTERNS = ("ring", "tree", "all-to-all")


def max_min_rates(rows: np.ndarray, cols: np.ndarray, capacity: np.ndarray, flows: int) -> np.ndarray:
    """Max-min fair rates of ``flows`` flows, flow ``rows[i]`` crossing link ``cols[i]``, by
    progressive filling: raise every unfrozen flow's rate together until a link fills, freeze the
    flows crossing it, repeat. A flow crossing no link is unlimited (inf)."""
    a = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(flows, len(capacity)))
    at = a.T.tocsr()
    rate = np.zeros(flows)
    left = capacity.astype(float).copy()
    active = np.asarray(a.sum(axis=1)).ravel() > 0
    rate[~active] = np.inf
    tol = 1e-9 * capacity.max() if len(capacity) else 0.0
    while active.any():
        count = at @ active.astype(float)
        used = count > 0
        step = np.min(left[used] / count[used])
        rate[active] += step
        left -= step * count
        full = used & (left <= tol)
        frozen = (a @ full.astype(float)) > 0
        active &= ~frozen
    return rate


def domains_of(members: Sequence[int], domain: int) -> list[list[int]]:
    """The members grouped by scale-up domain, domains in order, members in order."""
    out: dict[int, list[int]] = {}
    for r in sorted(members):
        out.setdefault(r // domain, []).append(r)
    return list(out.values())


def _tree_edges(k: int) -> list[tuple[int, int]]:
    """(child, parent) of NCCL's double binary tree over k positions. The first tree links
    position r to the one its lowest set bit points up to (r with that bit cleared and the next
    one set, or cleared where that is past the end), so most edges join near positions; the
    second is the first mirrored (k even) or shifted by one (k odd), so that every position is
    a leaf in one of them."""
    one = []
    for r in range(1, k):
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        one.append((r, up if up < k else r ^ bit))
    if k % 2 == 0:
        two = [(k - 1 - c, k - 1 - p) for c, p in one]
    else:
        two = [((c + 1) % k, (p + 1) % k) for c, p in one]
    return one + two


def flows(pattern: str, members: Sequence[int], domain: int) -> tuple[np.ndarray, np.ndarray]:
    """(sources, destinations) of one group's inter-domain flows of ``pattern``."""
    dom = domains_of(members, domain)
    k, m = len(dom), min(len(d) for d in dom)
    d = np.array([x[:m] for x in dom])            # k x m
    if pattern == "ring":
        return d.ravel(), np.roll(d, -1, axis=0).ravel()
    if pattern == "tree":
        e = np.array(_tree_edges(k)).reshape(-1, 2)
        child, parent = d[e[:, 0]].ravel(), d[e[:, 1]].ravel()
        return np.concatenate([child, parent]), np.concatenate([parent, child])
    if pattern == "all-to-all":
        a, b = np.nonzero(~np.eye(k, dtype=bool))
        return d[a].ravel(), d[b].ravel()
    raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")


def concurrent_groups(members: Sequence[int], world: int) -> list[np.ndarray]:
    """The group and its translates that tile the ``world`` ranks (a mesh axis's groups), or the
    group alone where its translates do not tile the world."""
    base = np.array(sorted(members))
    offsets = base - base[0]
    covered = np.zeros(world, dtype=bool)
    out = []
    for r in range(world):
        if covered[r]:
            continue
        g = r + offsets
        if g[-1] >= world or covered[g].any():
            return [base]
        covered[g] = True
        out.append(g)
    return out


class Contention:
    """Slowdowns of a fabric's patterns, cached by the pattern's shape (the group's offsets)."""

    def __init__(self, fabric: Fabric, domain: int, concurrent: bool = True) -> None:
        self.fabric = fabric
        self.domain = domain
        self.concurrent = concurrent
        self._cache: dict[tuple, float] = {}

    def key(self, members: Sequence[int]) -> tuple:
        """What a slowdown depends on: the group's shape, and where it lies when it runs alone."""
        first = min(members)
        shape = tuple(r - first for r in sorted(members))
        return shape if self.concurrent else (first, shape)

    def slowdown(self, pattern: str, members: Sequence[int]) -> float:
        """The slowest flow's max-min rate on the fabric over its rate on NICs alone (<= 1)."""
        key = (pattern, self.key(members))
        found = self._cache.get(key)
        if found is None:
            groups = concurrent_groups(members, self.fabric.num_gpus) if self.concurrent else [np.array(sorted(members))]
            pairs = [flows(pattern, g, self.domain) for g in groups]
            src = np.concatenate([p[0] for p in pairs])
            dst = np.concatenate([p[1] for p in pairs])
            found = self._cache[key] = self.ratio(src, dst)
        return found

    def ratio(self, src: np.ndarray, dst: np.ndarray) -> float:
        if not len(src):
            return 1.0
        fabric = max_min_rates(*self.fabric.incidence(src, dst), len(src))
        nics = max_min_rates(*self.fabric.incidence(src, dst, nic_only=True), len(src))
        return float(min(1.0, fabric.min() / nics.min()))
