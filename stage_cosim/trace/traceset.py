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

from google.protobuf.message import DecodeError

from stage_cosim.errors import UserError
from stage_cosim.runtime import gc_paused
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


# -- from Chakra files ------------------------------------------------------------------------

def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """A base-128 varint at ``pos``: (value, position after it). IndexError when truncated."""
    b = data[pos]
    if b < 0x80:
        return b, pos + 1
    value, shift = b & 0x7F, 7
    pos += 1
    while True:
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return value, pos
        shift += 7


def _frames(data: bytes, path: Path) -> list[tuple[int, int, int]]:
    """(start, body start, end) of every length-prefixed message."""
    out = []
    pos, n = 0, len(data)
    try:
        while pos < n:
            size = data[pos]
            if size < 0x80:
                body = pos + 1
            else:
                size, body = _varint(data, pos)
            if body + size > n:
                raise TraceFormatError(f"{path}: truncated message at byte {pos}")
            out.append((pos, body, body + size))
            pos = body + size
    except IndexError:
        raise TraceFormatError(f"{path}: bad length prefix at byte {pos}") from None
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


_ATTR_TAG = 0x52          # Node.attr: field 10, length-delimited


class _NodeReader:
    """Decodes nodes: the fields the simulator reads by a walk over the wire format, the
    attributes once per distinct encoding (a kernel's attributes repeat every micro-batch, so
    their decoded dict is shared). Nodes in another field order go through protobuf."""

    def __init__(self) -> None:
        self.attr_sets: dict[bytes, dict[str, Attr] | None] = {}

    def head(self, body: bytes) -> tuple[int, str, int, list[int], list[int], int, int] | None:
        """(id, name, type, data_deps, ctrl_deps, duration_micros, where the attributes start)
        when the attributes come last; None for anything this walk does not know."""
        nid = typ = dur = 0
        name = ""
        data_deps: list[int] = []
        ctrl_deps: list[int] = []
        pos, n = 0, len(body)
        while pos < n:
            tag = body[pos]
            if tag == _ATTR_TAG:
                return nid, name, typ, data_deps, ctrl_deps, dur, pos
            v = body[pos + 1]                      # varints here are mostly one or two bytes
            if v < 0x80:
                pos += 2
            elif body[pos + 2] < 0x80:
                v = (v & 0x7F) | body[pos + 2] << 7
                pos += 3
            else:
                v, pos = _varint(body, pos + 1)
            if tag == 0x08:
                nid = v
            elif tag == 0x12:
                name = body[pos:pos + v].decode()
                pos += v
            elif tag == 0x18:
                typ = v
            elif tag == 0x22 or tag == 0x2A:       # ctrl_deps / data_deps, packed
                end = pos + v
                deps = ctrl_deps if tag == 0x22 else data_deps
                while pos < end:
                    d = body[pos]
                    if d < 0x80:
                        pos += 1
                    elif body[pos + 1] < 0x80:
                        d = (d & 0x7F) | body[pos + 1] << 7
                        pos += 2
                    else:
                        d, pos = _varint(body, pos)
                    deps.append(d)
            elif tag == 0x20 or tag == 0x28:       # the same, one unpacked element
                (ctrl_deps if tag == 0x20 else data_deps).append(v)
            elif tag == 0x38:
                dur = v
            elif tag != 0x30:                      # start_time_micros is skipped
                return None
        return nid, name, typ, data_deps, ctrl_deps, dur, n

    def attrs(self, blob: bytes) -> dict[str, Attr] | None:
        """The attributes encoded in ``blob`` (None if it holds anything but attributes)."""
        try:
            return self.attr_sets[blob]
        except KeyError:
            pass
        n = pb.Node.FromString(blob)
        found = _attrs(n) if all(fd.name == "attr" for fd, _ in n.ListFields()) else None
        self.attr_sets[blob] = found
        return found


def _varying_span(body: bytes, name: str) -> tuple[int, int] | None:
    """Where the attribute ``name`` is encoded in a node's bytes (its whole field entry), when
    its entry starts with its name (as protobuf writes it); None otherwise."""
    head = b"\x0a" + bytes([len(name)]) + name.encode()
    pos, n = 0, len(body)
    try:
        while pos < n:
            start = pos
            tag, pos = _varint(body, pos)
            wire = tag & 7
            if wire == 0:
                _, pos = _varint(body, pos)
            elif wire == 2:
                ln, pos = _varint(body, pos)
                if tag == _ATTR_TAG and body.startswith(head, pos):
                    return start, pos + ln
                pos += ln
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                return None
    except IndexError:
        return None
    return None


def _parse_table(data: bytes, path: Path, reader: _NodeReader) -> tuple[NodeTable, list[Attr | None]]:
    """Decode a whole file into a class (and its own hole values)."""
    frames = _frames(data, path)
    ids, names, types, ddeps, cdeps, durs, attrs, holes = [], [], [], [], [], [], [], []
    runs: list[bytes] = []
    canon: list[bytes] = []
    raw: list[bytes] = []
    spans: list[tuple[int, int] | None] = []   # where each hole's varying attribute is
    values: list[Attr | None] = []
    run_start = 0
    try:
        pb.GlobalMetadata.FromString(data[frames[0][1]:frames[0][2]])
    except DecodeError as exc:
        raise TraceFormatError(f"{path}: undecodable GlobalMetadata") from exc
    for start, body_at, end in frames[1:]:
        body = data[body_at:end]
        try:
            head = reader.head(body)
        except (IndexError, UnicodeDecodeError):
            head = None
        a = None
        if head is not None and head[2] not in VARYING:
            a = reader.attrs(body[head[6]:])
        if a is not None:
            nid, name, typ, dd, cd, dur, _ = head  # type: ignore[misc]
        else:
            n = _parse_node(body, path, body_at)
            nid, name, typ, dd, cd, dur = n.id, n.name, n.type, list(n.data_deps), list(n.ctrl_deps), n.duration_micros
            a = _attrs(n)
            if typ in VARYING:
                holes.append(len(ids))
                values.append(a.pop(VARYING[typ], None))
                runs.append(data[run_start:start])
                canon.append(_canonical(n)[0])
                raw.append(body)
                spans.append(_varying_span(body, VARYING[typ]))
                run_start = end
        ids.append(nid)
        names.append(name)
        types.append(typ)
        ddeps.append(dd)
        cdeps.append(cd)
        durs.append(dur)
        attrs.append(a)
    runs.append(data[run_start:])
    fast = [(raw[k][:sp[0]], raw[k][sp[1]:], VARYING[types[i]]) if sp else None
            for k, (i, sp) in enumerate(zip(holes, spans))]
    return NodeTable(ids, names, types, ddeps, cdeps, durs, attrs, holes, runs=runs, hole_canon=canon,
                     hole_fast=fast), values


class _Matcher:
    """Matches files against known classes. A hole whose bytes equal the class's but for the
    varying attribute costs two comparisons and a lookup of that attribute's bytes (the same
    group or peer recurs all over a file); any other hole is decoded and compared whole."""

    _INVALID = ("", object())

    def __init__(self) -> None:
        self.holes: dict[bytes, tuple[bytes, Attr | None]] = {}
        self.middles: dict[bytes, Attr | None | tuple] = {}

    def _middle(self, mid: bytes, name: str) -> Attr | None | tuple:
        found = self.middles.get(mid, self)
        if found is not self:
            return found  # type: ignore[return-value]
        value: Attr | None | tuple = self._INVALID
        try:
            n = pb.Node.FromString(mid)
            if len(n.attr) == 1 and n.attr[0].name == name and len(n.ListFields()) == 1:
                value = _attrs(n)[name]
        except DecodeError:
            pass
        self.middles[mid] = value
        return value

    def match(self, table: NodeTable, data: bytes, path: Path) -> list[Attr | None] | None:
        runs, canon = table.runs, table.hole_canon
        assert runs is not None and canon is not None
        fast = table.hole_fast
        assert fast is not None
        pos = 0
        values: list[Attr | None] = []
        append = values.append
        cache, middles, invalid = self.holes, self.middles, self._INVALID
        n = len(data)
        startswith, endswith = data.startswith, data.endswith
        for k, expected in enumerate(canon):
            run = runs[k]
            if not startswith(run, pos):
                return None
            pos += len(run)
            try:
                size = data[pos]
                if size < 0x80:
                    body = pos + 1
                else:
                    size, body = _varint(data, pos)
            except IndexError:
                return None
            end = body + size
            if end > n:
                return None
            f = fast[k]
            if f is not None:
                before, after, name = f
                cut = end - len(after)
                if cut >= body + len(before) and startswith(before, body) and endswith(after, body, end):
                    mid = data[body + len(before):cut]
                    v = middles.get(mid, invalid)
                    if v is invalid:
                        v = self._middle(mid, name)
                    if v is not invalid:
                        append(v)  # type: ignore[arg-type]
                        pos = end
                        continue
            raw = data[body:end]
            hit = cache.get(raw)
            if hit is None:
                node = _parse_node(raw, path, pos)
                if node.type not in VARYING:
                    return None
                hit = cache[raw] = _canonical(node)
            if hit[0] != expected:
                return None
            append(hit[1])
            pos = end
        last = runs[-1]
        return values if n - pos == len(last) and data.startswith(last, pos) else None


@gc_paused()
def read_files(files: Mapping[int, Path], groups: dict[str, list[int]] | None, source: str) -> TraceSet:
    """Read ``rank -> .et file``; files of a known class cost a byte comparison and their holes."""
    classes: list[NodeTable] = []
    class_of: dict[int, int] = {}
    values: dict[int, list[Attr | None]] = {}
    matcher = _Matcher()
    reader = _NodeReader()
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
            table, v = _parse_table(data, path, reader)
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


def manifest_ranks(located: Located) -> tuple[int, Path] | None:
    """The world size a trace set's manifest gives (an export's ``ranks``, a synth's rank count),
    and the manifest: beside the traces, else in their run directory."""
    for d in dict.fromkeys((located.trace_dir, located.run_dir or located.trace_dir.parent)):
        path = d / "manifest.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(doc, dict):
            continue
        counts, par = doc.get("counts"), doc.get("parallel")
        n = doc.get("ranks") or (counts.get("ranks") if isinstance(counts, dict) else None) \
            or (par.get("world_size") if isinstance(par, dict) else None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, path
    return None


def missing_files(located: Located, world: int) -> list[Path]:
    """The trace files of ranks 0..world-1 that are not there, named as the present ones are."""
    some = next(iter(located.files.values()))
    m = (TRACE_NAME if located.fmt == "et" else JSON_NAME).match(some.name)
    ext = "et" if located.fmt == "et" else "json"
    return [located.trace_dir / f"{m['prefix']}.{r}.{ext}" for r in range(world) if r not in located.files]


def _groups(path: Path | None, parameter: str) -> dict[str, list[int]] | None:
    """The communicator groups of ``path``; an unreadable file is an error naming the flag that
    gave it (or would have: ``--comm-groups``, the binary's ``--comm-group-configuration``)."""
    if path is None:
        return None
    try:
        return read_comm_groups(path)
    except TraceFormatError as exc:
        raise UserError(parameter, str(exc)) from None


def read(located: Located) -> TraceSet:
    groups = _groups(located.groups_file, "comm-groups")
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
    groups = _groups(groups_file, "comm-group-configuration")
    try:
        return read_files(files, groups, prefix)
    except TraceFormatError as exc:
        raise UserError("workload-configuration", str(exc)) from None
