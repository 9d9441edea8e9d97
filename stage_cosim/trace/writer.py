"""Write a Workload as one trace file per rank (Chakra protobuf or readable JSON).

Each role's nodes are serialized once into a template of static byte runs and a few
rank-dependent holes (the communicator group of a collective, the peer of a send or receive).
Stamping a rank fills the holes with that rank's values: a join of byte strings.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

from google.protobuf.internal.encoder import _VarintBytes

from stage_cosim.errors import UserError
from stage_cosim.schedule.program import COLL, COMP, RECV, SEND, Node, RoleGraph, op_kind
from stage_cosim.trace import et_def_pb2 as pb
from stage_cosim.trace.chakra import COLLECTIVE_CODES, SCHEMA_VERSION, attr_bytes, metadata_bytes
from stage_cosim.trace.traceset import GROUPS_FILE
from stage_cosim.workload import Workload

TRACE_PREFIX = "workload"
MANIFEST_FILE = "manifest.json"
FORMATS = ("chakra", "json")
_NODE_TYPE = {COMP: pb.COMP_NODE, COLL: pb.COMM_COLL_NODE, SEND: pb.COMM_SEND_NODE, RECV: pb.COMM_RECV_NODE}

# A hole in a template: ("pg", group kind) for a collective, ("dst"|"src", kind, shift) for a
# send or receive (the pipeline's, or the attention exchange's ring over cp).
Hole = tuple[Union[str, int], ...]
Template = list[Union[bytes, tuple[bytes, Hole]]]


def node_hole(n: Node) -> Hole | None:
    if n.type == COLL:
        return ("pg", n.group)
    if n.type == SEND:
        return ("dst", n.group, n.peer)
    if n.type == RECV:
        return ("src", n.group, n.peer)
    return None


def static_attrs(n: Node) -> list[pb.AttributeProto]:
    """The attributes every rank of the role shares. Integers go in integer fields (uint64)."""
    A = pb.AttributeProto
    if n.type == COMP:
        # num_ops >= 1 and tensor_size >= 1: the simulator's roofline divides by both, and a
        # zero tensor_size makes it skip the node and stall everything after it. op_kind (which
        # the simulator ignores) tells a reader how our GPU model times the kernel.
        return [A(name="is_cpu_op", bool_val=False), A(name="num_ops", uint64_val=max(1, n.flops)),
                A(name="tensor_size", uint64_val=max(1, n.mem_bytes)),
                A(name="op_kind", string_val=op_kind(n.category, n.matmul))] + (
                    # fused attention: the keys each query sees in this kernel (ring steps: a chunk)
                    [A(name="attention_keys", uint64_val=n.keys)] if n.keys else [])
    if n.type == COLL:
        return [A(name="is_cpu_op", bool_val=False),
                A(name="comm_type", uint64_val=COLLECTIVE_CODES[n.coll.value]),
                A(name="comm_size", uint64_val=n.comm_bytes)]
    return [A(name="is_cpu_op", bool_val=False), A(name="comm_size", uint64_val=n.comm_bytes),
            A(name="comm_tag", uint64_val=n.tag)]


# Per role: each node's duration_micros (compute nodes), or None to leave the placeholder 0.
Durations = Callable[[RoleGraph], Sequence[int]]


def chakra_template(role: RoleGraph, durations: Sequence[int] | None = None) -> Template:
    template: Template = []
    run: list[bytes] = []
    for n in role.nodes:
        body = pb.Node(id=n.id, name=n.name, type=_NODE_TYPE[n.type], data_deps=n.deps,
                       ctrl_deps=n.ctrl, duration_micros=durations[n.id] if durations else 0,
                       attr=static_attrs(n)).SerializeToString()
        hole = node_hole(n)
        if hole is None:
            run.append(_VarintBytes(len(body)) + body)
        else:
            if run:
                template.append(b"".join(run))
                run = []
            template.append((body, hole))
    if run:
        template.append(b"".join(run))
    return template


def chakra_holes(w: Workload, rank: int, holes: set[Hole]) -> dict[Hole, bytes]:
    out: dict[Hole, bytes] = {}
    for hole in holes:
        if hole[0] == "pg":
            out[hole] = attr_bytes("pg_name", string_val=str(w.group_id(rank, str(hole[1]))))
        else:
            out[hole] = attr_bytes("comm_dst" if hole[0] == "dst" else "comm_src",
                                   uint64_val=w.peer(rank, int(hole[2]), str(hole[1])))
    return out


def stamp_chakra(template: Template, fills: dict[Hole, bytes], header: bytes) -> bytes:
    parts = [header]
    for item in template:
        if isinstance(item, bytes):
            parts.append(item)
        else:
            body, hole = item
            extra = fills[hole]
            parts.append(_VarintBytes(len(body) + len(extra)))
            parts.append(body)
            parts.append(extra)
    return b"".join(parts)


# -- JSON (the same graphs, readable) ------------------------------------------------------------

def node_json(n: Node, duration_micros: int = 0) -> dict:
    attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in static_attrs(n)}
    d = {"id": n.id, "name": n.name, "type": pb.NodeType.Name(_NODE_TYPE[n.type]),
         "data_deps": n.deps, "ctrl_deps": n.ctrl, "duration_micros": duration_micros, "attrs": attrs}
    return d


def rank_json(w: Workload, rank: int, durations: Sequence[int] | None = None) -> bytes:
    role = w.role(w.role_of(rank))
    nodes = []
    for n in role.nodes:
        d = node_json(n, durations[n.id] if durations else 0)
        hole = node_hole(n)
        if hole is not None:
            if hole[0] == "pg":
                d["attrs"]["pg_name"] = str(w.group_id(rank, str(hole[1])))
            else:
                d["attrs"]["comm_dst" if hole[0] == "dst" else "comm_src"] = w.peer(rank, int(hole[2]), str(hole[1]))
        nodes.append(d)
    doc = {"schema": SCHEMA_VERSION, "rank": rank, "nodes": nodes}
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


# -- output directories ---------------------------------------------------------------------------

@contextmanager
def atomic_directory(out: Path, force: bool) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``out`` only if the block finishes.

    An existing non-empty ``out`` is refused unless ``force``; a failed run leaves nothing.
    """
    if out.exists() and not out.is_dir():
        raise UserError("out", f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError("out", f"{out} exists and is not empty (use --force to replace it)")
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError("out", f"cannot create {parent}: {exc.strerror}") from None
    scratch = parent / f".{out.name}.partial-{os.getpid()}"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir()
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    trash = parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, trash)
    os.replace(scratch, out)
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)


@dataclass
class WriteStats:
    files: int
    bytes_written: int


def write_traces(w: Workload, directory: Path, fmt: str = "chakra",
                 progress: Callable[[int], None] | None = None, durations: Durations | None = None,
                 prefix: str = TRACE_PREFIX) -> WriteStats:
    """Write every rank's trace and the communicator-group file into ``directory``.

    ``durations`` fills each compute node's ``duration_micros`` (per role), for simulators
    that replay durations instead of computing a roofline."""
    if fmt not in FORMATS:
        raise UserError("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    total = 0
    ext = "et" if fmt == "chakra" else "json"
    if fmt == "chakra":
        header = metadata_bytes()
        templates = [chakra_template(role, durations(role) if durations else None) for role in w.roles]
        holes = [{item[1] for item in t if not isinstance(item, bytes)} for t in templates]
    for rank in range(w.world_size):
        if fmt == "chakra":
            stage = w.role_of(rank)
            data = stamp_chakra(templates[stage], chakra_holes(w, rank, holes[stage]), header)
        else:
            data = rank_json(w, rank, durations(w.role(w.role_of(rank))) if durations else None)
        fd = os.open(directory / f"{prefix}.{rank}.{ext}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        total += len(data)
        if progress is not None and (rank & 1023) == 1023:
            progress(1024)
    if progress is not None:
        progress(w.world_size & 1023)
    groups = json.dumps(w.communicator_groups(), separators=(",", ":")).encode()
    (directory / GROUPS_FILE).write_bytes(groups)
    return WriteStats(w.world_size + 1, total + len(groups))
