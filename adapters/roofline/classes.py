"""Ranks that run alike: what the simulator's trace-set replay and ASTRA-sim's exact replay share.

A trace set's ranks fall into classes of equal traces (every rank of a pipeline stage), which
differ only in their holes: each communication node's group or peer. Ranks of a class behave
identically when their groups have the same shape on the network and their peers are as far
away, so one rank per class can stand for its class. This module holds

* the holes' vocabulary: node kinds (:data:`K_COLL` ...), a hole's target (:func:`target_of`),
  the group of every rank (:data:`ALL`), groups' members (:func:`membership`);
* a replayed compute node's time (:func:`replay_ns`);
* ranks on the network (:class:`Topology`) and a group's shape on it (:func:`group_shape`);
* classes and representatives (:class:`Classes`, :func:`trace_classes`,
  :func:`choose_representatives`) and the rule that one rank per class stands exactly for its
  class (:func:`symmetric`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from stage_cosim.errors import require
from stage_cosim.hardware.network import NetworkDim, coordinates
from stage_cosim.trace.traceset import COLL, RECV, SEND, TraceSet

K_COMP, K_COLL, K_SEND, K_RECV = 0, 1, 2, 3
ALL = "0"          # the communicator "group" of every rank


def target_of(value: tuple[str, object] | None, node_kind: int) -> object:
    """A hole's value as the replay uses it: a group id, or a peer rank."""
    if node_kind == K_COLL:
        return ALL if value is None else (str(value[1]) or ALL)
    return -1 if value is None else int(value[1])  # type: ignore[call-overload]


def membership(groups: Mapping[str, Sequence[int]] | None, n: int) -> Callable[[object], Sequence[int]]:
    """Group id -> its members (:data:`ALL`: every one of the ``n`` ranks; an unknown id: none)."""
    everyone = tuple(range(n))
    groups = groups or {}

    def members(g: object) -> Sequence[int]:
        return everyone if g == ALL else groups.get(str(g), ())

    return members


def replay_ns(duration_micros: int) -> int:
    """A replayed compute node's time: whole microseconds, and 1 ns for 0 (§7 of ASTRA-sim's cost model)."""
    return duration_micros * 1000 if duration_micros else 1


# -- ranks on the network -----------------------------------------------------------------------

class Topology:
    """The network dimensions with each rank's coordinates precomputed."""

    def __init__(self, dims: Sequence[NetworkDim]) -> None:
        require(len(dims) >= 1, "network", "needs at least one dimension")
        self.dims: tuple[NetworkDim, ...] = tuple(dims)
        self.n_ranks = math.prod(d.npus for d in self.dims)
        self.coords: list[tuple[int, ...]] = [tuple(coordinates(r, list(self.dims)))
                                              for r in range(self.n_ranks)]


def group_shape(net: Topology, members: tuple[int, ...]) -> tuple:
    """What the pair delays of a group depend on: per member and network dimension, the
    coordinate relabelled by first appearance (Switch, FullyConnected: only equality
    matters) or shifted by the first member's (Ring: distances matter). Groups of equal
    shape have equal delays between the members at equal positions."""
    rows = []
    labels: list[dict[int, int]] = [{} for _ in net.dims]
    first = net.coords[members[0]]
    for r in members:
        row = []
        for d, (dim, x) in enumerate(zip(net.dims, net.coords[r])):
            if dim.topology == "Ring":
                row.append((x - first[d]) % dim.npus)
            else:
                row.append(labels[d].setdefault(x, len(labels[d])))
        rows.append(tuple(row))
    return tuple(rows)


# -- classes -----------------------------------------------------------------------------------

@dataclass
class Classes:
    """Ranks by class, each class's representative, and how to see a rank's groups and peers
    next to its representative's (``pairs(rank)``: (node kind, representative's target, own))."""

    class_of: Mapping[int, int]
    n_ranks: int
    pairs: Callable[[int], Iterable[tuple[int, object, object]]]
    targets: Callable[[int], Iterable[tuple[int, object]]]


def choose_representatives(cl: Classes, members_of: Callable[[object], Sequence[int]]) -> dict[int, int]:
    """One rank per class, chosen so that representatives talk to representatives: starting
    from rank 0, each representative's groups and peers name the representatives of the classes
    they reach."""
    rep: dict[int, int] = {}
    for start in range(cl.n_ranks):
        c0 = cl.class_of[start]
        if c0 in rep:
            continue
        rep[c0] = start
        todo = [start]
        while todo:
            r = todo.pop()
            for kind, t in cl.targets(r):
                for m in (members_of(t) if kind == K_COLL else (t,)):
                    if isinstance(m, int) and 0 <= m < cl.n_ranks and cl.class_of[m] not in rep:
                        rep[cl.class_of[m]] = m
                        todo.append(m)
    return rep


_HOLE_KIND = {COLL: K_COLL, SEND: K_SEND, RECV: K_RECV}


def trace_classes(ts: TraceSet, members_of: Callable[[object], Sequence[int]]) -> tuple[Classes, dict[int, int]]:
    """The trace set's classes for the symmetry check, and each class's representative."""
    kinds = [[_HOLE_KIND[t.types[i]] for i in t.holes] for t in ts.classes]
    reps: dict[int, int] = {}

    def targets(r: int) -> Iterable[tuple[int, object]]:
        c = ts.class_of[r]
        try:
            seen = set(zip(kinds[c], ts.values_of(r)))
        except TypeError:              # an unhashable attribute value: take every rank apart
            return [(K_SEND, -1)]
        return {(k, target_of(v, k)) for k, v in seen}

    def pairs(r: int) -> Iterable[tuple[int, object, object]]:
        c = ts.class_of[r]
        try:
            seen = set(zip(kinds[c], ts.values_of(reps[c]), ts.values_of(r)))
        except TypeError:
            return [(K_SEND, -1, -2)]   # never equivalent
        return [(k, target_of(a, k), target_of(b, k)) for k, a, b in seen]

    cl = Classes(ts.class_of, len(ts.class_of), pairs, targets)
    reps.update(choose_representatives(cl, members_of))
    return cl, reps


def symmetric(cl: Classes, rep: Mapping[int, int], members_of: Callable[[object], Sequence[int]],
              net: Topology) -> bool:
    """Whether one rank per class stands exactly for its class (see the module docstring):
    representatives talk only to representatives, and every other rank is a copy of its
    representative (its groups of the same shape and classes, its peers of the same classes and
    as far away on the lowest network dimension their ends differ in)."""
    shapes: dict[object, tuple] = {}

    def shape_of(g: object) -> tuple:
        found = shapes.get(g)
        if found is None:
            members = tuple(members_of(g))
            classes = tuple(cl.class_of.get(m, -1) for m in members)
            found = shapes[g] = (classes, group_shape(net, members) if members else ())
        return found

    def link(a: int, b: int) -> tuple[int, int] | None:
        ca, cb = net.coords[a], net.coords[b]
        for d, (x, y) in enumerate(zip(ca, cb)):
            if x != y:
                return d, net.dims[d].hops(x, y)
        return None

    rep_set = set(rep.values())
    # representatives talk only to representatives
    for r in rep_set:
        for kind, t in cl.targets(r):
            if kind == K_COLL:
                members = members_of(t)
                for m in members:
                    if rep.get(cl.class_of.get(m, -1)) not in members:
                        return False
            elif not (isinstance(t, int) and 0 <= t < cl.n_ranks and rep.get(cl.class_of[t]) == t):
                return False
    # every other rank is a copy of its representative
    checked: set[tuple] = set()
    for r in range(cl.n_ranks):
        c = cl.class_of[r]
        if rep[c] == r:
            continue
        for kind, tr, tm in cl.pairs(r):
            key = (kind, tr, tm) if kind == K_COLL else (kind, rep[c], tr, r, tm)
            if key in checked:
                continue
            checked.add(key)
            if kind == K_COLL:
                if shape_of(tr) != shape_of(tm):
                    return False
            else:
                if not (isinstance(tm, int) and 0 <= tm < cl.n_ranks):
                    return False
                if cl.class_of[tm] != cl.class_of[tr] or link(rep[c], tr) != link(r, tm):  # type: ignore[arg-type]
                    return False
    return True
