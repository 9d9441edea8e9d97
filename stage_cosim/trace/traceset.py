"""A trace set read for checking and simulation: ranks grouped into classes of equal traces.

Ranks of one pipeline stage run the same graph: their files differ only in the communicator
group each collective names (``pg_name``) and the rank each send or receive talks to
(``comm_dst`` / ``comm_src``). A class holds that graph once (:class:`NodeTable`); each rank
keeps only its own values of those attributes, one per *hole* of its class.

This module holds that data model, and builds it from node lists (:func:`from_nodes`); Chakra
files are read into it by :mod:`stage_cosim.trace.et_reader`, and :mod:`stage_cosim.trace.location`
finds a trace set on disk and reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from stage_cosim.trace.chakra import TraceNode, kind_of

COMP, SEND, RECV, COLL = 4, 5, 6, 7
# The attribute each rank of a class sets for itself, by node type.
VARYING = {COLL: "pg_name", SEND: "comm_dst", RECV: "comm_src"}

Attr = tuple[str, object]          # (the oneof field it was read from, its value)


@dataclass
class NodeTable:
    """The nodes every rank of one class runs, in file order.

    ``attrs`` holds each node's attributes except the varying one; ``holes`` are the positions
    of the nodes that have one (collectives, sends, receives). ``categories`` (our own
    workloads only) name what a node is for: the kind of communication (``tp``, ``dp``, ``pp``,
    ``embedding``) or the kernel's category.
    """

    ids: list[int]
    names: list[str]
    types: list[int]
    data_deps: list[list[int]]
    ctrl_deps: list[list[int]]
    duration_micros: list[int]
    attrs: list[dict[str, Attr]]
    holes: list[int]
    categories: list[str] | None = None
    # the byte template other files of the class are matched against (files only)
    runs: list[bytes] | None = field(default=None, repr=False)
    hole_canon: list[bytes] | None = field(default=None, repr=False)
    # per hole: its bytes before and after the varying attribute, and that attribute's name
    hole_fast: list[tuple[bytes, bytes, str] | None] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    def int_attr(self, i: int, name: str, default: int | None = None) -> int | None:
        a = self.attrs[i].get(name)
        if a is None:
            return default
        v = a[1]
        return v if isinstance(v, int) and not isinstance(v, bool) else default


@dataclass
class TraceSet:
    """Every rank's trace, by class. ``values_of(rank)`` is the rank's varying attribute per
    hole of its class: an :data:`Attr`, or None where the node lacks it."""

    classes: list[NodeTable]
    class_of: dict[int, int]
    groups: dict[str, list[int]] | None
    source: str
    _values: Mapping[int, list[Attr | None]] | Callable[[int], list[Attr | None]] = field(repr=False,
                                                                                        default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.class_of)

    def values_of(self, rank: int) -> list[Attr | None]:
        v = self._values
        return v(rank) if callable(v) else v[rank]

    def members_of(self, c: int) -> list[int]:
        return [r for r in self.ranks if self.class_of[r] == c]

    def node_count(self) -> int:
        return sum(len(self.classes[c]) for c in self.class_of.values())

    def nodes(self, rank: int) -> list[TraceNode]:
        """The rank's nodes as :class:`TraceNode` objects (for code that wants one node at a time)."""
        t = self.classes[self.class_of[rank]]
        hole_value = dict(zip(t.holes, self.values_of(rank)))
        out = []
        for i in range(len(t)):
            attrs = {k: v for k, (_, v) in t.attrs[i].items()}
            kinds = {k: kind for k, (kind, _) in t.attrs[i].items()}
            hv = hole_value.get(i)
            if hv is not None:
                attrs[VARYING[t.types[i]]], kinds[VARYING[t.types[i]]] = hv[1], hv[0]
            out.append(TraceNode(t.ids[i], t.names[i], t.types[i], list(t.data_deps[i]), list(t.ctrl_deps[i]),
                                 t.duration_micros[i], attrs, kinds))
        return out


# -- from nodes (another program's, tests', JSON traces) --------------------------------------

def _split_varying(node_type: int, attrs: dict[str, Attr]) -> tuple[dict[str, Attr], Attr | None]:
    name = VARYING.get(node_type)
    if name is None or name not in attrs:
        return attrs, None
    rest = dict(attrs)
    return rest, rest.pop(name)


def from_nodes(ranks: Mapping[int, list[TraceNode]], groups: dict[str, list[int]] | None,
               source: str = "traces") -> TraceSet:
    """Group ranks given as node lists into classes (equal but for the varying attributes)."""
    classes: list[NodeTable] = []
    index: dict[tuple, int] = {}
    class_of: dict[int, int] = {}
    values: dict[int, list[Attr | None]] = {}
    for rank in sorted(ranks):
        nodes = ranks[rank]
        rows, vals = [], []
        for n in nodes:
            attrs = {k: (n.attr_kinds.get(k) or kind_of(v), v) for k, v in n.attrs.items()}
            rest, value = _split_varying(n.type, attrs)
            rows.append((n.id, n.name, n.type, tuple(n.data_deps), tuple(n.ctrl_deps), n.duration_micros,
                         tuple(sorted((k, kind, _hashable(v)) for k, (kind, v) in rest.items())), rest))
            if n.type in VARYING:
                vals.append(value)
        key = tuple(r[:7] for r in rows)
        c = index.get(key)
        if c is None:
            c = index[key] = len(classes)
            classes.append(NodeTable(ids=[r[0] for r in rows], names=[r[1] for r in rows], types=[r[2] for r in rows],
                                     data_deps=[list(r[3]) for r in rows], ctrl_deps=[list(r[4]) for r in rows],
                                     duration_micros=[r[5] for r in rows], attrs=[r[7] for r in rows],
                                     holes=[i for i, r in enumerate(rows) if r[2] in VARYING]))
        class_of[rank] = c
        values[rank] = vals
    return TraceSet(classes, class_of, groups, source, values)


def _hashable(v: object) -> object:
    return tuple(v) if isinstance(v, list) else v
