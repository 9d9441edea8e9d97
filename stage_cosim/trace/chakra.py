"""Chakra execution traces (schema 0.0.4): read any trace set, and encode our nodes fast.

File layout: a varint-length-prefixed ``GlobalMetadata`` then length-prefixed ``Node``
messages. Reading goes through the generated protobuf classes; writing builds each role's
node bytes once and splices in the few attributes that differ per rank (communicator group,
pipeline peer), so stamping out a rank is byte concatenation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from google.protobuf.internal.decoder import _DecodeVarint32
from google.protobuf.internal.encoder import _VarintBytes
from google.protobuf.message import DecodeError

from stage_cosim.trace import et_def_pb2 as pb

SCHEMA_VERSION = "0.0.4"
COLLECTIVE_CODES = {"ALL_REDUCE": 0, "REDUCE": 1, "ALL_GATHER": 2, "GATHER": 3, "SCATTER": 4,
                    "BROADCAST": 5, "ALL_TO_ALL": 6, "REDUCE_SCATTER": 7, "REDUCE_SCATTER_BLOCK": 8,
                    "BARRIER": 9}
COLLECTIVE_NAMES = {v: k for k, v in COLLECTIVE_CODES.items()}
NODE_TYPE_NAMES = {v.number: v.name for v in pb.NodeType.DESCRIPTOR.values}
INT_FIELDS = ("int32_val", "int64_val", "uint32_val", "uint64_val", "sint32_val", "sint64_val",
              "fixed32_val", "fixed64_val", "sfixed32_val", "sfixed64_val")
TRACE_NAME = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)\.et$")


class TraceFormatError(Exception):
    """A file that is not a readable Chakra trace."""


# -- reading --------------------------------------------------------------------------------

@dataclass
class TraceNode:
    """A node read back from a trace, with its attributes decoded (integers as ints)."""

    id: int
    name: str
    type: int
    data_deps: list[int]
    ctrl_deps: list[int]
    duration_micros: int
    attrs: dict[str, object] = field(default_factory=dict)
    attr_kinds: dict[str, str] = field(default_factory=dict)   # attribute -> its oneof field

    @property
    def type_name(self) -> str:
        return NODE_TYPE_NAMES.get(self.type, f"UNKNOWN({self.type})")

    def int_attr(self, name: str, default: int | None = None) -> int | None:
        v = self.attrs.get(name, default)
        return v if isinstance(v, int) and not isinstance(v, bool) else default


def _attr_value(a: pb.AttributeProto) -> tuple[str, object]:
    kind = a.WhichOneof("value")
    if kind is None:
        return "", None
    v = getattr(a, kind)
    if kind.endswith("_list"):
        v = list(v.values)
    return kind, v


def read_trace_file(path: Path) -> tuple[pb.GlobalMetadata, list[TraceNode]]:
    """Parse one ``<prefix>.<rank>.et`` file."""
    data = path.read_bytes()
    pos, first = 0, True
    meta = pb.GlobalMetadata()
    nodes: list[TraceNode] = []
    while pos < len(data):
        try:
            size, pos = _DecodeVarint32(data, pos)
        except (IndexError, DecodeError) as exc:
            raise TraceFormatError(f"{path}: bad length prefix at byte {pos}") from exc
        chunk = data[pos:pos + size]
        if len(chunk) != size:
            raise TraceFormatError(f"{path}: truncated message at byte {pos}")
        pos += size
        try:
            if first:
                meta.ParseFromString(chunk)
                first = False
                continue
            n = pb.Node()
            n.ParseFromString(chunk)
        except DecodeError as exc:
            raise TraceFormatError(f"{path}: undecodable message at byte {pos - size}") from exc
        node = TraceNode(n.id, n.name, n.type, list(n.data_deps), list(n.ctrl_deps), n.duration_micros)
        for a in n.attr:
            kind, value = _attr_value(a)
            node.attrs[a.name] = value
            node.attr_kinds[a.name] = kind
        nodes.append(node)
    return meta, nodes


def trace_files(directory: Path) -> dict[int, Path]:
    """Rank -> trace file of every ``<prefix>.<rank>.et`` in ``directory`` (one prefix)."""
    found: dict[str, dict[int, Path]] = {}
    for p in directory.iterdir():
        m = TRACE_NAME.match(p.name)
        if m:
            found.setdefault(m["prefix"], {})[int(m["rank"])] = p
    if not found:
        raise TraceFormatError(f"{directory}: no <prefix>.<rank>.et files")
    if len(found) > 1:
        raise TraceFormatError(f"{directory}: several trace prefixes ({', '.join(sorted(found))})")
    return next(iter(found.values()))


def read_comm_groups(path: Path) -> dict[str, list[int]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{path}: unreadable communicator-group file ({exc.__class__.__name__})") from None
    if not isinstance(raw, dict) or not all(isinstance(v, list) for v in raw.values()):
        raise TraceFormatError(f"{path}: expected an object of group id -> list of ranks")
    try:
        return {str(k): [int(r) for r in v] for k, v in raw.items()}
    except (TypeError, ValueError):
        raise TraceFormatError(f"{path}: a group's ranks must be integers") from None


def read_trace_dir(directory: Path, groups_file: Path | None = None
                   ) -> tuple[dict[int, list[TraceNode]], dict[str, list[int]]]:
    """Every rank's nodes and the communicator groups of a trace directory.

    The group file is ``groups_file`` or the only ``*.json`` in the directory whose content is a
    group map (``comm_groups.json`` by our convention); absent means no groups.
    """
    files = trace_files(directory)
    ranks = {r: read_trace_file(p)[1] for r, p in sorted(files.items())}
    groups: dict[str, list[int]] = {}
    if groups_file is None:
        candidate = directory / "comm_groups.json"
        if candidate.exists():
            groups_file = candidate
    if groups_file is not None:
        groups = read_comm_groups(groups_file)
    return ranks, groups


# -- writing --------------------------------------------------------------------------------

def attr_bytes(name: str, **value) -> bytes:
    """One ``Node.attr`` entry (field 10), already framed, ready to append to node bytes."""
    body = pb.AttributeProto(name=name, **value).SerializeToString()
    return b"\x52" + _VarintBytes(len(body)) + body


def frame(message: bytes) -> bytes:
    return _VarintBytes(len(message)) + message


def metadata_bytes() -> bytes:
    return frame(pb.GlobalMetadata(version=SCHEMA_VERSION).SerializeToString())


def iter_framed(data: bytes) -> Iterator[bytes]:
    pos = 0
    while pos < len(data):
        size, pos = _DecodeVarint32(data, pos)
        yield data[pos:pos + size]
        pos += size


def kind_of(value: object) -> str:
    """The AttributeProto field a value without a recorded kind goes in (integers as uint64)."""
    if isinstance(value, bool):
        return "bool_val"
    if isinstance(value, int):
        return "uint64_val"
    if isinstance(value, float):
        return "double_val"
    if isinstance(value, list):
        return "bool_list" if all(isinstance(x, bool) for x in value) else "int64_list"
    return "string_val"


def node_message(node: TraceNode) -> pb.Node:
    """A TraceNode back into its protobuf message (attributes in the fields they were read from)."""
    msg = pb.Node(id=node.id, name=node.name, type=node.type, data_deps=node.data_deps, ctrl_deps=node.ctrl_deps,
                  duration_micros=node.duration_micros)
    for name, value in node.attrs.items():
        kind = node.attr_kinds.get(name) or kind_of(value)
        if kind.endswith("_list"):
            a = pb.AttributeProto(name=name)
            getattr(a, kind).values.extend(value)  # type: ignore[arg-type]
            msg.attr.append(a)
        else:
            msg.attr.append(pb.AttributeProto(name=name, **{kind: value}))
    return msg


def write_trace_file(path: Path, nodes: list[TraceNode]) -> None:
    """Write one rank's nodes as a Chakra file (any generator's nodes, e.g. read back)."""
    data = metadata_bytes() + b"".join(frame(node_message(n).SerializeToString()) for n in nodes)
    path.write_bytes(data)
