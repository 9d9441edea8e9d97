"""Where the time goes: charge every instant of a window to one category.

Compute while a kernel runs; otherwise exposed communication of the first kind active in
``EXPOSED_PRIORITY`` order (tensor and expert parallelism are on the critical path, then the
attention exchange over cp, data parallelism the most overlappable); otherwise waiting (a
pipeline bubble, or idle without pipelining). A posted
receive is waiting, not communication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from stage_cosim.parallel.axes import category_of
from stage_cosim.result import BREAKDOWN_KEYS

if TYPE_CHECKING:
    from stage_cosim.adapters.roofline.engine import AgentProgram, Replay

EXPOSED_PRIORITY = ("tp", "ep", "cp", "pp", "embedding", "dp")
NOT_CHARGED = ("RECV", "WAIT")   # a receive waits; a WAIT node only lets time pass


def intervals(types: Sequence[str], kinds: Sequence[str], start: Sequence[float], end: Sequence[float]
              ) -> Iterable[tuple[float, float, str]]:
    """(start, end, category) of every node that occupies something."""
    of_kind: dict[str, str] = {}           # (a handful of kinds: each looked up once)
    for i, t in enumerate(types):
        if t in NOT_CHARGED:
            continue
        if t == "COMP":
            yield start[i], end[i], "compute"
            continue
        k = kinds[i]
        cat = of_kind.get(k)
        if cat is None:
            cat = of_kind[k] = _category(category_of(k))
        yield start[i], end[i], cat


def _category(cat: str) -> str:
    return cat if cat == "compute" or cat in EXPOSED_PRIORITY else "other"


def span_category(node_kind: int, kind: str) -> str | None:
    """:func:`intervals`' category of an ASTRA-sim replay node (0 compute, 3 receive, else
    communication of ``kind``); None for a receive."""
    if node_kind == 3:
        return None
    return "compute" if node_kind == 0 else _category(category_of(kind))


# Which category an instant goes to: the first active in this order (compute first).
_CHARGE_ORDER = ("compute",) + EXPOSED_PRIORITY + ("other",)
_CHARGED_TO = {"compute": "compute", **{k: f"exposed_{k}" for k in EXPOSED_PRIORITY + ("other",)}}


# (categories by their position in _CHARGE_ORDER, to count them in a list)
_POSITION = {c: j for j, c in enumerate(_CHARGE_ORDER)}
_CHARGED_AT = [_CHARGED_TO[c] for c in _CHARGE_ORDER]


def charge(spans: Iterable[tuple[float, float, str]], lo: float, hi: float, waiting: str) -> dict[str, float]:
    """Seconds by category over [lo, hi] (they add up to hi - lo): each stretch between two
    consecutive span ends goes to the first category active over it, in time order. (Which of
    the events at one instant comes first does not matter: none of them adds time.)"""
    events: list[tuple[float, int, int]] = []
    add = events.append
    position = _POSITION
    for s, e, cat in spans:
        if s < lo:
            s = lo
        if e > hi:
            e = hi
        if e > s:
            j = position[cat]
            add((s, 1, j))
            add((e, -1, j))
    events.sort()
    events.append((hi, 0, position["other"]))
    totals = [0.0] * len(_CHARGE_ORDER)
    idle = 0.0
    active = [0] * len(_CHARGE_ORDER)
    prev = lo
    for t, delta, j in events:
        if t > prev:
            for k, n in enumerate(active):
                if n:
                    totals[k] += t - prev
                    break
            else:
                idle += t - prev
            prev = t
        active[j] += delta
    out = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    for k, v in enumerate(totals):
        out[_CHARGED_AT[k]] += v
    out[waiting] += idle
    return out


def step_breakdown(prog: AgentProgram, rep: Replay, a: int, step: float, pipelined: bool) -> dict[str, float]:
    """Seconds by category over the whole step of agent ``a`` of a replay (a workload's or a
    trace set's): the time no node occupies is a pipeline bubble where the step is pipelined."""
    spans = intervals(prog.types, prog.kind, rep.start[a], rep.end[a])
    return charge(spans, 0.0, step, "pipeline_bubble" if pipelined else "idle")
