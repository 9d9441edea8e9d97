"""Where the time goes: charge every instant of a window to one category.

Compute while a kernel runs; otherwise exposed communication of the first kind active in
``EXPOSED_PRIORITY`` order (tensor parallelism is on the critical path, data parallelism the
most overlappable); otherwise waiting (a pipeline bubble, or idle without pipelining). A posted
receive is waiting, not communication.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from stage_cosim.parallel.axes import category_of
from stage_cosim.result import BREAKDOWN_KEYS

EXPOSED_PRIORITY = ("tp", "pp", "embedding", "dp")
NOT_CHARGED = ("RECV", "WAIT")   # a receive waits; a WAIT node only lets time pass


def intervals(types: Sequence[str], kinds: Sequence[str], start: Sequence[float], end: Sequence[float]
              ) -> Iterable[tuple[float, float, str]]:
    """(start, end, category) of every node that occupies something."""
    for i, t in enumerate(types):
        if t in NOT_CHARGED:
            continue
        cat = "compute" if t == "COMP" else category_of(kinds[i])
        cat = cat if cat == "compute" or cat in EXPOSED_PRIORITY else "other"
        yield start[i], end[i], cat


def charge(spans: Iterable[tuple[float, float, str]], lo: float, hi: float, waiting: str) -> dict[str, float]:
    """Seconds by category over [lo, hi] (they add up to hi - lo)."""
    events: list[tuple[float, int, str]] = []
    for s, e, cat in spans:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            events += [(s, 1, cat), (e, -1, cat)]
    events.sort()
    out = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    active: dict[str, int] = {}
    prev = lo

    def account(t0: float, t1: float) -> None:
        if t1 <= t0:
            return
        if active.get("compute"):
            out["compute"] += t1 - t0
            return
        for kind in EXPOSED_PRIORITY + ("other",):
            if active.get(kind):
                out[f"exposed_{kind}"] += t1 - t0
                return
        out[waiting] += t1 - t0

    for t, delta, cat in events:
        account(prev, t)
        active[cat] = active.get(cat, 0) + delta
        prev = t
    account(prev, hi)
    return out
