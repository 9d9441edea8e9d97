"""Check a trace set (ours or another generator's) for what would make ASTRA-sim hang or abort.

The checks here need only the traces: node types, attributes and their integer fields,
dependencies, cycles, communicator groups, the order of collectives in every group, and the
pairing of sends with receives. What also depends on ASTRA-sim's system and network files
(message sizes per phase, implementations, the deadlocks of its one-operation-at-a-time rule)
is checked by :mod:`stage_cosim.adapters.astra_sim.astra_replay` on top of these.

A class of ranks with identical traces (:mod:`stage_cosim.trace.traceset`) is checked once; a
problem in it is reported for its first rank, with the number of ranks sharing it.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from stage_cosim.trace import location, traceset as ts_mod
from stage_cosim.trace.chakra import COLLECTIVE_NAMES, INT_FIELDS, NODE_TYPE_NAMES, TraceNode
from stage_cosim.trace.traceset import COLL, COMP, RECV, SEND, NodeTable, TraceSet

SUPPORTED_COLLECTIVES = {0: "ALL_REDUCE", 2: "ALL_GATHER", 6: "ALL_TO_ALL", 7: "REDUCE_SCATTER"}
BROADCAST = 5           # not simulated as a collective: its duration is replayed, rank by rank
MEM_LOAD, MEM_STORE = 2, 3
ALL_GATHER = 2


@dataclass(frozen=True)
class Problem:
    rank: int | None
    node: int | None
    message: str
    others: int = 0          # further ranks with the same trace, hence the same problem

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.node is not None:
            where.append(f"node {self.node}")
        also = f" (also in {self.others} other rank{'s' if self.others > 1 else ''} with the same trace)" \
            if self.others else ""
        return f"{' '.join(where) or 'trace set'}: {self.message}{also}"


def load_trace_set(directory: Path, groups_file: Path | None = None
                   ) -> tuple[dict[int, list[TraceNode]], dict[str, list[int]] | None]:
    """Every rank's nodes and the communicator groups of a trace directory (see
    :func:`stage_cosim.trace.location.locate` for where the group file is looked for)."""
    t = location.read(location.locate(directory, groups_file))
    return {r: t.nodes(r) for r in t.ranks}, t.groups


def issue_order(t: NodeTable) -> tuple[list[int], bool]:
    """Positions in the order the simulator would issue them when every node takes the same
    time (ready nodes by id), and whether the graph has a cycle."""
    pos = {nid: i for i, nid in enumerate(t.ids)}
    indeg = [0] * len(t)
    children: list[list[int]] = [[] for _ in range(len(t))]
    for i in range(len(t)):
        for d in set(t.data_deps[i]) | set(t.ctrl_deps[i]):
            j = pos.get(d)
            if j is not None:
                indeg[i] += 1
                children[j].append(i)
    ready = [(t.ids[i], i) for i in range(len(t)) if indeg[i] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(i)
        for c in children[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(ready, (t.ids[c], c))
    return out, len(out) != len(t)


def _int_attr(attrs: dict, name: str, found: list[str], node_type: int, *, required: bool) -> int | None:
    a = attrs.get(name)
    if a is None:
        if required:
            found.append(f"{NODE_TYPE_NAMES.get(node_type, node_type)} lacks attribute {name}")
        return None
    if a[0] not in INT_FIELDS:
        found.append(f"attribute {name} must be an integer field, is {a[0] or 'unset'}")
        return None
    return int(a[1])  # type: ignore[arg-type]


def _node_problems(typ: int, attrs: dict) -> list[str]:
    """What is wrong with one node's type and attributes (the same for every node that shares
    them: kernels repeat each micro-batch)."""
    msgs: list[str] = []
    if typ in (0, 1):
        msgs.append(f"node type {NODE_TYPE_NAMES.get(typ, typ)} is not runnable (unset types stall, METADATA aborts)")
    elif typ in (MEM_LOAD, MEM_STORE):
        # whatever the system: the binary aborts on them without remote memory, and its
        # remote-memory models are not reproduced here
        msgs.append("MEM_LOAD / MEM_STORE nodes: the simulator aborts on them without remote memory, and its "
                    "remote-memory models are not reproduced here")
    elif typ == COMP:
        # tensor_size 0 is a problem only for the simulator's roofline (roofline-enabled 1), which
        # skips such a node; that depends on the system file and is checked with it
        _int_attr(attrs, "tensor_size", msgs, typ, required=False)
        _int_attr(attrs, "num_ops", msgs, typ, required=False)
    elif typ == COLL:
        # A collective of 0 bytes runs (every chunk has at least a byte per rank) except an
        # all-gather, whose chunks are then empty.
        ctype = _int_attr(attrs, "comm_type", msgs, typ, required=True)
        size = _int_attr(attrs, "comm_size", msgs, typ, required=True)
        if ctype is not None and ctype not in SUPPORTED_COLLECTIVES and ctype != BROADCAST:
            msgs.append(f"collective {COLLECTIVE_NAMES.get(ctype, ctype)} is not simulated (the simulator aborts)")
        if size is not None and size < 0:
            msgs.append(f"attribute comm_size must not be negative, is {size}")
        if ctype == ALL_GATHER and size == 0:
            msgs.append("an ALL_GATHER of 0 B never completes (its chunks are empty)")
    elif typ in (SEND, RECV):
        _int_attr(attrs, "comm_tag", msgs, typ, required=True)
        size = _int_attr(attrs, "comm_size", msgs, typ, required=True)
        if size is not None and size <= 0:
            msgs.append(f"a message of {size} B (the simulator asserts on empty messages)")
    return msgs


def _class_problems(t: NodeTable, cyclic: bool) -> list[tuple[int | None, str]]:
    """(node id or None, message) of everything wrong with one class's graph."""
    out: list[tuple[int | None, str]] = []
    seen: set[int] = set()
    for nid in t.ids:
        if nid in seen:
            out.append((nid, "duplicate node id (the simulator keeps only the last)"))
        seen.add(nid)
    checked: dict[tuple[int, int], list[str]] = {}
    for i, nid in enumerate(t.ids):
        for deps in (t.data_deps[i], t.ctrl_deps[i]):
            for d in deps:
                if d not in seen:
                    out.append((nid, f"depends on node {d}, which is not in this rank's file"))
        attrs = t.attrs[i]
        key = (t.types[i], id(attrs))
        msgs = checked.get(key)
        if msgs is None:
            msgs = checked[key] = _node_problems(t.types[i], attrs)
        out += [(nid, m) for m in msgs]
    if cyclic:
        out.append((None, "dependency cycle (the simulator drops such nodes silently)"))
    return out


def _show(x: tuple[int, int, int] | None) -> str:
    return "nothing" if x is None else f"{COLLECTIVE_NAMES.get(x[0], x[0])} of {x[1]} B"


def validate(t: TraceSet, limit: int = 1000) -> list[Problem]:
    """Every problem found (at most ``limit``), each with rank and node id."""
    problems: list[Problem] = []
    ranks = t.ranks
    world = len(ranks)
    if ranks != list(range(world)):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))[:5]
        problems.append(Problem(None, None, f"ranks are not 0..{world - 1}; missing e.g. {missing}"))
    groups = t.groups or {}
    member_sets = {gid: set(m) for gid, m in groups.items()}
    for gid, members in groups.items():
        if len(member_sets[gid]) != len(members) or any(not 0 <= m < world for m in members):
            problems.append(Problem(None, None, f"group {gid} has repeated or out-of-range ranks {members[:8]}"))
    members_of: dict[int, list[int]] = defaultdict(list)
    for r in ranks:
        members_of[t.class_of[r]].append(r)
    # class by class: the graph itself, and what each hole needs from a rank's value
    shapes: dict[int, _ClassHoles] = {}
    for c, table in enumerate(t.classes):
        if c not in members_of:
            continue
        first, others = members_of[c][0], len(members_of[c]) - 1
        order, cyclic = issue_order(table)
        problems += [Problem(first, nid, msg, others) for nid, msg in _class_problems(table, cyclic)]
        shapes[c] = _ClassHoles(table, order)
        if len(problems) >= limit:
            return problems[:limit]
    # rank by rank: its groups and peers
    sends: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    layout: dict[int, tuple[int, int, dict[str, int]]] = {}
    patterns: dict[tuple, int] = {}
    for rank in ranks:
        c = t.class_of[rank]
        h = shapes[c]
        values = t.values_of(rank)
        bad: set[object] = set()
        # collectives: each distinct group value once
        for value in {values[k] for k in h.coll}:
            k = next(k for k in h.coll if values[k] == value)
            nid = h.ids[k]
            if value is not None and value[0] != "string_val":
                problems.append(Problem(rank, nid, "attribute pg_name must be a string"))
                bad.add(value)
                continue
            pg = "0" if value is None else (str(value[1]) or "0")
            if pg != "0":
                if pg not in groups:
                    problems.append(Problem(rank, nid, f"communicator group {pg} is not in the group file"
                                            if t.groups is not None else f"communicator group {pg} is used but "
                                            "there is no group file (give it with --comm-groups)"))
                    bad.add(value)
                    continue
                if rank not in member_sets[pg]:
                    problems.append(Problem(rank, nid, f"rank is not a member of its group {pg}"))
        # the order of collectives on each group, in two steps: here, the rank's pattern of
        # groups over its class's collectives (groups numbered by first use); below, a group whose
        # members share class, pattern and number needs no more (they issue the same sequence on
        # it), any other group has its members' sequences compared
        label: dict[object, int] = {}
        pattern = tuple(label.setdefault(values[k], len(label)) for k in h.coll_order)
        layout[rank] = (c, patterns.setdefault(pattern, len(patterns)),
                        {_pg(v): n for v, n in label.items() if v not in bad})
        # sends and receives
        for k in h.p2p:
            value = values[k]
            typ, nid = h.types[k], h.ids[k]
            name = "comm_dst" if typ == SEND else "comm_src"
            if value is None:
                problems.append(Problem(rank, nid, f"{NODE_TYPE_NAMES[typ]} lacks attribute {name}"))
                continue
            if value[0] not in INT_FIELDS:
                problems.append(Problem(rank, nid, f"attribute {name} must be an integer field, is {value[0]}"))
                continue
            peer = int(value[1])  # type: ignore[arg-type]
            if not 0 <= peer < world:
                problems.append(Problem(rank, nid, f"{name} {peer} is not a rank"))
            elif h.tag[k] is not None and h.size[k] is not None:
                if typ == SEND:
                    sends[(rank, peer, h.tag[k])].append((h.size[k], nid))
                else:
                    recvs[(peer, rank, h.tag[k])].append((h.size[k], nid))
        if len(problems) >= limit:
            return problems[:limit]
    used: set[str] = set()
    for _, _, pgs in layout.values():
        used.update(pgs)
    coll_seq: dict[str, dict[int, list[tuple[int, int, int]]]] = {}
    for pg in sorted(used):
        members = list(range(world)) if pg == "0" else groups.get(pg, [])
        keys = {(layout[m][0], layout[m][1], layout[m][2].get(pg)) if m in layout else None for m in members}
        if len(keys) == 1 and None not in keys and next(iter(keys))[2] is not None:
            continue
        seqs = {}
        for m in members:
            if m not in layout:
                continue
            h, values = shapes[t.class_of[m]], t.values_of(m)
            seqs[m] = [(h.ctype[k], h.size[k], h.ids[k]) for k in h.coll_order if _pg(values[k]) == pg]
        coll_seq[pg] = seqs
    problems += _sequence_problems(coll_seq, groups, world)
    problems += _p2p_problems(sends, recvs)
    return problems[:limit]


def _pg(value: object) -> str:
    """A collective's group: its pg_name, "0" (all ranks) when absent or empty."""
    return "0" if value is None else (str(value[1]) or "0")  # type: ignore[index]


class _ClassHoles:
    """A class's holes as the per-rank checks read them (k: the hole's index)."""

    def __init__(self, table: NodeTable, order: list[int]) -> None:
        self.ids = [table.ids[i] for i in table.holes]
        self.types = [table.types[i] for i in table.holes]
        self.ctype = [table.int_attr(i, "comm_type") for i in table.holes]
        self.size = [table.int_attr(i, "comm_size") for i in table.holes]
        self.tag = [table.int_attr(i, "comm_tag") for i in table.holes]
        self.coll = [k for k, typ in enumerate(self.types) if typ == COLL]
        self.p2p = [k for k, typ in enumerate(self.types) if typ != COLL]
        k_of = {i: k for k, i in enumerate(table.holes)}
        # collectives in issue order, but for broadcasts (they couple no one)
        self.coll_order = [k_of[i] for i in order if table.types[i] == COLL and i in k_of
                           and self.ctype[k_of[i]] != BROADCAST]


def _sequence_problems(coll_seq: Mapping[str, dict[int, list[tuple[int, int, int]]]],
                       groups: Mapping[str, list[int]], world: int) -> list[Problem]:
    """Every member of a group must issue the same collectives in the same order."""
    out = []
    for pg, per_rank in coll_seq.items():
        members = list(range(world)) if pg == "0" else groups.get(pg, [])
        if not members:
            continue
        # Compare every member with the sequence most members issue (the first member's on a tie).
        signature = {m: tuple((c, s) for c, s, _ in per_rank.get(m, [])) for m in members}
        counts: dict[tuple, int] = defaultdict(int)
        for sig in signature.values():
            counts[sig] += 1
        majority = max(counts.values())
        ref_rank = next(m for m in members if counts[signature[m]] == majority)
        ref = per_rank.get(ref_rank, [])
        for m in members:
            if signature[m] == signature[ref_rank]:
                continue
            seq = per_rank.get(m, [])
            for i in range(max(len(seq), len(ref))):
                a = seq[i] if i < len(seq) else None
                b = ref[i] if i < len(ref) else None
                if a is None or b is None or a[:2] != b[:2]:
                    out.append(Problem(m, a[2] if a else None,
                                       f"collective #{i} in group {pg} differs between ranks: this rank "
                                       f"issues {_show(a)}, rank {ref_rank} {_show(b)} (the mismatch deadlocks)"))
                    break
    return out


def _p2p_problems(sends: Mapping[tuple[int, int, int], list[tuple[int, int]]],
                  recvs: Mapping[tuple[int, int, int], list[tuple[int, int]]]) -> list[Problem]:
    out = []
    for key in sorted(set(sends) | set(recvs)):
        s, r = sorted(sends.get(key, [])), sorted(recvs.get(key, []))
        src, dst, tag = key
        if len(s) != len(r):
            rank, node = (src, s[0][1]) if len(s) > len(r) else (dst, r[0][1])
            out.append(Problem(rank, node, f"{len(s)} send(s) from rank {src} to rank {dst} with tag {tag} "
                                           f"but {len(r)} matching receive(s)"))
        elif [x for x, _ in s] != [x for x, _ in r]:
            out.append(Problem(dst, r[0][1], f"receive from rank {src} with tag {tag} expects "
                                             f"{[x for x, _ in r]} B, the send carries {[x for x, _ in s]} B"))
    return out


def validate_trace_set(ranks: Mapping[int, list[TraceNode]] | TraceSet, groups: dict[str, list[int]] | None = None,
                       limit: int = 1000) -> list[Problem]:
    """:func:`validate` for node lists (or a :class:`TraceSet`)."""
    t = ranks if isinstance(ranks, TraceSet) else ts_mod.from_nodes(ranks, groups)
    return validate(t, limit)
