"""A trace set read for checking and simulation: ranks grouped into classes of equal traces.

Ranks of one pipeline stage run the same graph: their files differ only in the communicator
group each collective names (``pg_name``) and the rank each send or receive talks to
(``comm_dst`` / ``comm_src``). A class holds that graph once (:class:`NodeTable`); each rank
keeps only its own values of those attributes, one per *hole* of its class. Reading the file
of a rank whose class is known compares its bytes with the class's file, run by run, and
decodes only the holes, so a trace set of thousands of ranks reads in the time of a few files.

Where the traces are: :func:`locate` accepts an ASTRA-sim run directory as the exporter writes
it (``traces/`` with ``comm_groups.json`` beside it), a plain trace directory (the group file
inside it, or in the folder above), and an explicit group file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from google.protobuf.internal.decoder import _DecodeVarint32
from google.protobuf.message import DecodeError

from stage_cosim.errors import UserError
from stage_cosim.trace import et_def_pb2 as pb
from stage_cosim.trace.chakra import TRACE_NAME, TraceFormatError, TraceNode, kind_of, read_comm_groups

COMP, SEND, RECV, COLL = 4, 5, 6, 7
# The attribute each rank of a class sets for itself, by node type.
VARYING = {COLL: "pg_name", SEND: "comm_dst", RECV: "comm_src"}
GROUPS_FILE = "comm_groups.json"
JSON_NAME = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)\.json$")
_TYPE_CODES = {"INVALID_NODE": 0, "METADATA_NODE": 1, "MEM_LOAD_NODE": 2, "MEM_STORE_NODE": 3,
               "COMP_NODE": 4, "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7}

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


# -- from Chakra files ------------------------------------------------------------------------

def _frames(data: bytes, path: Path) -> list[tuple[int, int]]:
    """(start, end) of every length-prefixed message, the prefix included."""
    out = []
    pos, n = 0, len(data)
    while pos < n:
        start = pos
        try:
            size, pos = _DecodeVarint32(data, pos)
        except (IndexError, DecodeError) as exc:
            raise TraceFormatError(f"{path}: bad length prefix at byte {start}") from exc
        if pos + size > n:
            raise TraceFormatError(f"{path}: truncated message at byte {start}")
        pos += size
        out.append((start, pos))
    if not out:
        raise TraceFormatError(f"{path}: empty file (no GlobalMetadata)")
    return out


def _attrs(n: pb.Node) -> dict[str, Attr]:
    out: dict[str, Attr] = {}
    for a in n.attr:
        kind = a.WhichOneof("value")
        if kind is None:
            out[a.name] = ("", None)
            continue
        v = getattr(a, kind)
        out[a.name] = (kind, list(v.values) if kind.endswith("_list") else v)
    return out


def _parse_node(body: bytes, path: Path, at: int) -> pb.Node:
    try:
        return pb.Node.FromString(body)
    except DecodeError as exc:
        raise TraceFormatError(f"{path}: undecodable node at byte {at}") from exc


def _canonical(n: pb.Node) -> tuple[bytes, Attr | None]:
    """A hole node's bytes without its varying attribute, and that attribute's value."""
    name = VARYING[n.type]
    value: Attr | None = None
    for k, a in enumerate(n.attr):
        if a.name == name:
            kind = a.WhichOneof("value") or ""
            v = getattr(a, kind) if kind else None
            value = (kind, list(v.values) if kind.endswith("_list") else v)
            del n.attr[k]
            break
    return n.SerializeToString(), value


def _parse_table(data: bytes, path: Path) -> tuple[NodeTable, list[Attr | None]]:
    """Decode a whole file into a class (and its own hole values)."""
    frames = _frames(data, path)
    ids, names, types, ddeps, cdeps, durs, attrs, holes = [], [], [], [], [], [], [], []
    runs: list[bytes] = []
    canon: list[bytes] = []
    values: list[Attr | None] = []
    run_start = 0
    header_start, header_end = frames[0]
    try:
        pb.GlobalMetadata.FromString(data[header_end - _body_len(data, header_start):header_end])
    except DecodeError as exc:
        raise TraceFormatError(f"{path}: undecodable GlobalMetadata") from exc
    for start, end in frames[1:]:
        n = _parse_node(data[end - _body_len(data, start):end], path, start)
        i = len(ids)
        ids.append(n.id)
        names.append(n.name)
        types.append(n.type)
        ddeps.append(list(n.data_deps))
        cdeps.append(list(n.ctrl_deps))
        durs.append(n.duration_micros)
        a = _attrs(n)
        if n.type in VARYING:
            holes.append(i)
            name = VARYING[n.type]
            values.append(a.pop(name, None))
            runs.append(data[run_start:start])
            canon.append(_canonical(n)[0])
            run_start = end
        attrs.append(a)
    runs.append(data[run_start:])
    table = NodeTable(ids, names, types, ddeps, cdeps, durs, attrs, holes, runs=runs, hole_canon=canon)
    return table, values


def _body_len(data: bytes, start: int) -> int:
    size, _ = _DecodeVarint32(data, start)
    return size


class _Matcher:
    """Matches files against known classes; decoded hole nodes are shared across files (the
    same collective of one communicator group has the same bytes in every member's file)."""

    def __init__(self) -> None:
        self.holes: dict[bytes, tuple[bytes, Attr | None]] = {}

    def match(self, table: NodeTable, data: bytes, path: Path) -> list[Attr | None] | None:
        runs, canon = table.runs, table.hole_canon
        assert runs is not None and canon is not None
        pos = 0
        values: list[Attr | None] = []
        cache = self.holes
        n = len(data)
        for k, expected in enumerate(canon):
            run = runs[k]
            if not data.startswith(run, pos):
                return None
            pos += len(run)
            if pos >= n:
                return None
            try:
                size, body = _DecodeVarint32(data, pos)
            except (IndexError, DecodeError):
                return None
            end = body + size
            raw = data[body:end]
            hit = cache.get(raw)
            if hit is None:
                if end > n:
                    return None
                node = _parse_node(raw, path, pos)
                if node.type not in VARYING:
                    return None
                hit = cache[raw] = _canonical(node)
            if hit[0] != expected:
                return None
            values.append(hit[1])
            pos = end
        last = runs[-1]
        return values if len(data) - pos == len(last) and data.startswith(last, pos) else None


def read_files(files: Mapping[int, Path], groups: dict[str, list[int]] | None, source: str) -> TraceSet:
    """Read ``rank -> .et file``; files of a known class cost a byte comparison and their holes."""
    classes: list[NodeTable] = []
    class_of: dict[int, int] = {}
    values: dict[int, list[Attr | None]] = {}
    matcher = _Matcher()
    last = 0
    for rank in sorted(files):
        path = files[rank]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TraceFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
        found = None
        for c in [last] + [c for c in range(len(classes)) if c != last] if classes else []:
            v = matcher.match(classes[c], data, path)
            if v is not None:
                found = c
                values[rank] = v
                break
        if found is None:
            table, v = _parse_table(data, path)
            found = len(classes)
            classes.append(table)
            values[rank] = v
        class_of[rank] = last = found
    return TraceSet(classes, class_of, groups, source, values)


def _read_json_rank(path: Path) -> list[TraceNode]:
    doc = json.loads(path.read_text())
    nodes = []
    for d in doc["nodes"]:
        attrs = dict(d.get("attrs", {}))
        kinds = {k: kind_of(v) for k, v in attrs.items()}
        nodes.append(TraceNode(d["id"], d.get("name", ""), _TYPE_CODES.get(d["type"], 0),
                               list(d.get("data_deps", [])), list(d.get("ctrl_deps", [])),
                               d.get("duration_micros", 0), attrs, kinds))
    return nodes


# -- where the traces are -----------------------------------------------------------------------

@dataclass(frozen=True)
class Located:
    """A trace set on disk: its files (Chakra ``.et`` or our ``.json``), its group file, and the
    ASTRA-sim run directory around it when there is one (system.json, network.yml)."""

    trace_dir: Path
    files: dict[int, Path]
    fmt: str
    groups_file: Path | None
    run_dir: Path | None


def _trace_files(directory: Path) -> tuple[dict[int, Path], str] | None:
    found: dict[tuple[str, str], dict[int, Path]] = {}
    for p in directory.iterdir():
        m = TRACE_NAME.match(p.name)
        if m:
            found.setdefault(("et", m["prefix"]), {})[int(m["rank"])] = p
            continue
        m = JSON_NAME.match(p.name)
        if m:
            found.setdefault(("json", m["prefix"]), {})[int(m["rank"])] = p
    et = {k: v for k, v in found.items() if k[0] == "et"}
    pick = et or found
    if not pick:
        return None
    if len(pick) > 1:
        raise TraceFormatError(f"{directory}: several trace prefixes ({', '.join(sorted(p for _, p in pick))})")
    (fmt, _), files = next(iter(pick.items()))
    return files, fmt


def locate(path: Path, comm_groups: Path | None = None) -> Located:
    """Find the traces at ``path``: a trace directory, or a run directory holding ``traces/``.

    The group file is ``comm_groups`` if given, else ``comm_groups.json`` beside the traces, else
    the one in the folder above them (where the exporter puts it); none means every collective
    runs over all ranks."""
    path = Path(path)
    if not path.is_dir():
        raise TraceFormatError(f"{path}: not a directory")
    trace_dir = path
    found = _trace_files(path)
    if found is None and (path / "traces").is_dir():
        trace_dir = path / "traces"
        found = _trace_files(trace_dir)
    if found is None:
        raise TraceFormatError(f"{path}: no <prefix>.<rank>.et (or .json) files, here or in {path / 'traces'}")
    files, fmt = found
    if comm_groups is not None:
        if not Path(comm_groups).is_file():
            raise UserError("comm-groups", f"{comm_groups}: no such file")
        groups_file: Path | None = Path(comm_groups)
    else:
        groups_file = next((p for p in (trace_dir / GROUPS_FILE, trace_dir.parent / GROUPS_FILE) if p.is_file()), None)
    run_dir = next((d for d in (path, trace_dir.parent) if (d / "system.json").is_file()), None)
    return Located(trace_dir, files, fmt, groups_file, run_dir)


def read(located: Located) -> TraceSet:
    groups = read_comm_groups(located.groups_file) if located.groups_file is not None else None
    if located.fmt == "et":
        return read_files(located.files, groups, str(located.trace_dir))
    try:
        ranks = {r: _read_json_rank(p) for r, p in sorted(located.files.items())}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"{located.trace_dir}: unreadable JSON trace ({exc})") from None
    return from_nodes(ranks, groups, str(located.trace_dir))


def read_prefix(prefix: str, ranks: Iterable[int], groups_file: Path | None) -> TraceSet:
    """ASTRA-sim's ``--workload-configuration=PREFIX``: ``PREFIX.<rank>.et`` for every rank of the
    network (the simulator aborts on a missing one and never opens extra ones)."""
    files = {}
    for r in ranks:
        p = Path(f"{prefix}.{r}.et")
        if not p.is_file():
            raise UserError("workload-configuration", f"{p}: no such file (ASTRA-sim needs one trace per rank "
                                                      "of the network and aborts without it)")
        files[r] = p
    groups = read_comm_groups(groups_file) if groups_file is not None else None
    return read_files(files, groups, prefix)
