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
from stage_cosim.schedule.nodes import COLL, COMP, RECV, SEND, Node, RoleGraph, op_kind
from stage_cosim.trace import et_def_pb2 as pb
from stage_cosim.trace.chakra import COLLECTIVE_CODES, SCHEMA_VERSION, attr_bytes, metadata_bytes
from stage_cosim.trace.formats import FORMATS
from stage_cosim.trace.location import GROUPS_FILE
from stage_cosim.workload import Workload

TRACE_PREFIX = "workload"
MANIFEST_FILE = "manifest.json"
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
                    # fused attention: the keys each query sees in this kernel (ring steps: a chunk
                    # or half of one), and the rows of work its thread blocks split
                    [A(name="attention_keys", uint64_val=n.keys)] if n.keys else []) + (
                    [A(name="attention_rows", uint64_val=n.groups)] if n.keys and n.groups > 1 else []) + (
                    # a grouped GEMM: its equal GEMMs (one per local expert), each timed at its own shape
                    [A(name="gemm_groups", uint64_val=n.groups)] if not n.keys and n.groups > 1 else [])
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


class Stamper:
    """A role's template, ready to stamp ranks from.

    A node with a hole is its length prefix, its static body and the rank's fill (a group id, a
    peer) after it. The prefix depends only on the fill's length, so for each combination of
    fill lengths (a handful: peers and group ids of one, two or three digits) the file is a
    fixed list of static chunks with the fills between them, made once; a rank is that list with
    its fills put in place by one slice assignment and joined. No Python work per node or per
    hole: ring attention's traces have a send and a receive in every step of every layer."""

    def __init__(self, template: Template, header: bytes) -> None:
        self.header = header
        self.runs: list[bytes] = []        # static bytes before each hole's node
        self.bodies: list[bytes] = []      # each hole's node, without its fill
        self.holes: list[Hole] = []
        run: list[bytes] = []
        for item in template:
            if isinstance(item, bytes):
                run.append(item)
            else:
                self.runs.append(b"".join(run))
                self.bodies.append(item[0])
                self.holes.append(item[1])
                run = []
        self.tail = b"".join(run)
        self.keys = sorted(set(self.holes), key=repr)    # the distinct holes, in a fixed order
        self._chunks: dict[tuple[int, ...], list[bytes | None]] = {}

    def _chunks_for(self, lengths: dict[Hole, int]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k, (run, body, hole) in enumerate(zip(self.runs, self.bodies, self.holes)):
            out.append((self.header if k == 0 else b"") + run + _VarintBytes(len(body) + lengths[hole]) + body)
            out.append(None)
        out.append(self.tail if self.holes else self.header + self.tail)
        return out

    def stamp(self, fills: dict[Hole, bytes]) -> bytes:
        """One rank's file, given the rank's fill of each hole."""
        signature = tuple(len(fills[k]) for k in self.keys)
        chunks = self._chunks.get(signature)
        if chunks is None:
            chunks = self._chunks[signature] = self._chunks_for({k: len(fills[k]) for k in self.keys})
        parts = chunks.copy()
        parts[1::2] = map(fills.__getitem__, self.holes)
        return b"".join(parts)  # type: ignore[arg-type]


def stamp_chakra(template: Template, fills: dict[Hole, bytes], header: bytes) -> bytes:
    """One rank's file from its role's template (see :class:`Stamper`, which write_traces
    keeps per role)."""
    return Stamper(template, header).stamp(fills)


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
        stampers = [Stamper(t, header) for t in templates]
        holes = [set(st.keys) for st in stampers]
        del templates
    for rank in range(w.world_size):
        if fmt == "chakra":
            stage = w.role_of(rank)
            data = stampers[stage].stamp(chakra_holes(w, rank, holes[stage]))
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
