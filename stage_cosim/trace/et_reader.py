"""Reading Chakra ``.et`` files into a :class:`~stage_cosim.trace.traceset.TraceSet`, fast.

The first file of a class is decoded whole (the fields the simulator reads by a walk over the
wire format, protobuf for the rest). Reading the file of a rank whose class is known compares
its bytes with the class's file, run by run, and decodes only the holes, so a trace set of
thousands of ranks reads in the time of a few files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from google.protobuf.message import DecodeError

from stage_cosim.gc_pause import gc_paused
from stage_cosim.trace import et_def_pb2 as pb
from stage_cosim.trace.chakra import TraceFormatError
from stage_cosim.trace.traceset import VARYING, Attr, NodeTable, TraceSet

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
