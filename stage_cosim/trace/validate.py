"""Check a trace set (ours or another generator's) for what would make ASTRA-sim hang or abort."""

from __future__ import annotations

import heapq
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from stage_cosim.trace.chakra import (
    COLLECTIVE_NAMES, INT_FIELDS, TraceFormatError, TraceNode, read_comm_groups,
    read_trace_file, trace_files,
)

COMP, SEND, RECV, COLL = 4, 5, 6, 7
SUPPORTED_COLLECTIVES = {0: "ALL_REDUCE", 2: "ALL_GATHER", 6: "ALL_TO_ALL", 7: "REDUCE_SCATTER"}
JSON_NAME = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)\.json$")
_TYPE_CODES = {"INVALID_NODE": 0, "METADATA_NODE": 1, "MEM_LOAD_NODE": 2, "MEM_STORE_NODE": 3,
               "COMP_NODE": 4, "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7}


@dataclass(frozen=True)
class Problem:
    rank: int | None
    node: int | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.node is not None:
            where.append(f"node {self.node}")
        return f"{' '.join(where) or 'trace set'}: {self.message}"


def _read_json_rank(path: Path) -> list[TraceNode]:
    doc = json.loads(path.read_text())
    nodes = []
    for d in doc["nodes"]:
        attrs = dict(d.get("attrs", {}))
        kinds = {k: ("bool_val" if isinstance(v, bool) else "uint64_val" if isinstance(v, int)
                     else "string_val" if isinstance(v, str) else "double_val") for k, v in attrs.items()}
        nodes.append(TraceNode(d["id"], d.get("name", ""), _TYPE_CODES.get(d["type"], 0),
                               list(d.get("data_deps", [])), list(d.get("ctrl_deps", [])),
                               d.get("duration_micros", 0), attrs, kinds))
    return nodes


def load_trace_set(directory: Path, groups_file: Path | None = None
                   ) -> tuple[dict[int, list[TraceNode]], dict[str, list[int]] | None]:
    """Every rank's nodes (Chakra ``.et`` or our ``.json``) and the communicator groups
    (``groups_file``, else ``comm_groups.json`` beside the traces if there is one)."""
    if not directory.is_dir():
        raise TraceFormatError(f"{directory}: not a directory")
    try:
        files = trace_files(directory)
        ranks = {r: read_trace_file(p)[1] for r, p in sorted(files.items())}
    except TraceFormatError:
        jsons = {int(m["rank"]): p for p in directory.iterdir() if (m := JSON_NAME.match(p.name))}
        if not jsons:
            raise
        try:
            ranks = {r: _read_json_rank(p) for r, p in sorted(jsons.items())}
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TraceFormatError(f"{directory}: unreadable JSON trace ({exc})") from None
    groups_path = groups_file or directory / "comm_groups.json"
    groups = read_comm_groups(groups_path) if groups_path.exists() else None
    return ranks, groups


def _issue_order(nodes: list[TraceNode]) -> tuple[list[TraceNode], bool]:
    """Nodes in the order the simulator would issue them when every node takes the same time
    (ready nodes by id), and whether the graph has a cycle."""
    by_id = {n.id: n for n in nodes}
    indeg = {n.id: 0 for n in nodes}
    children: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        for d in set(n.data_deps) | set(n.ctrl_deps):
            if d in by_id:
                indeg[n.id] += 1
                children[d].append(n.id)
    ready = [i for i, k in indeg.items() if k == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(by_id[i])
        for c in children[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(ready, c)
    return out, len(out) != len(by_id)


def _check_int(n: TraceNode, rank: int, name: str, problems: list[Problem], *, required: bool,
               positive: bool = False) -> int | None:
    if name not in n.attrs:
        if required:
            problems.append(Problem(rank, n.id, f"{n.type_name} lacks attribute {name}"))
        return None
    if n.attr_kinds.get(name) not in INT_FIELDS:
        problems.append(Problem(rank, n.id, f"attribute {name} must be an integer field, is {n.attr_kinds.get(name)}"))
        return None
    v = int(n.attrs[name])  # type: ignore[arg-type]
    if positive and v <= 0:
        problems.append(Problem(rank, n.id, f"attribute {name} must be positive, is {v}"))
    return v


def _show(x: tuple[int, int, int] | None) -> str:
    return "nothing" if x is None else f"{COLLECTIVE_NAMES.get(x[0], x[0])} of {x[1]} B"


def validate_trace_set(ranks: dict[int, list[TraceNode]], groups: dict[str, list[int]] | None,
                       limit: int = 1000) -> list[Problem]:
    """Every problem found (at most ``limit``), each with rank and node id."""
    problems: list[Problem] = []
    world = len(ranks)
    if sorted(ranks) != list(range(world)):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))[:5]
        problems.append(Problem(None, None, f"ranks are not 0..{world - 1}; missing e.g. {missing}"))
    groups = groups or {}
    for gid, members in groups.items():
        if len(set(members)) != len(members) or any(not 0 <= m < world for m in members):
            problems.append(Problem(None, None, f"group {gid} has repeated or out-of-range ranks {members[:8]}"))
    # (group id, rank) -> [(type, size, node id)] in issue order
    coll_seq: dict[str, dict[int, list[tuple[int, int, int]]]] = defaultdict(dict)
    sends: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)   # (src, dst, tag) -> [(size, id)]
    recvs: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, nodes in sorted(ranks.items()):
        seen: set[int] = set()
        for n in nodes:
            if n.id in seen:
                problems.append(Problem(rank, n.id, "duplicate node id (the simulator keeps only the last)"))
            seen.add(n.id)
        for n in nodes:
            for d in list(n.data_deps) + list(n.ctrl_deps):
                if d not in seen:
                    problems.append(Problem(rank, n.id, f"depends on node {d}, which is not in this rank's file"))
            if n.type in (0, 1):
                problems.append(Problem(rank, n.id, f"node type {n.type_name} is not runnable "
                                                    "(unset types stall, METADATA aborts)"))
            elif n.type == COMP:
                ts = _check_int(n, rank, "tensor_size", problems, required=False)
                _check_int(n, rank, "num_ops", problems, required=False)
                if ts == 0:
                    problems.append(Problem(rank, n.id, "tensor_size 0 makes the simulator skip the node and stall its dependents"))
            elif n.type == COLL:
                ctype = _check_int(n, rank, "comm_type", problems, required=True)
                size = _check_int(n, rank, "comm_size", problems, required=True, positive=True)
                if ctype is not None and ctype not in SUPPORTED_COLLECTIVES:
                    problems.append(Problem(rank, n.id, f"collective {COLLECTIVE_NAMES.get(ctype, ctype)} is not simulated"))
                pg = n.attrs.get("pg_name", "")
                if "pg_name" in n.attrs and n.attr_kinds.get("pg_name") != "string_val":
                    problems.append(Problem(rank, n.id, "attribute pg_name must be a string"))
                    continue
                pg = str(pg or "0")
                if pg != "0":
                    if pg not in groups:
                        problems.append(Problem(rank, n.id, f"communicator group {pg} is not in the group file"))
                        continue
                    if rank not in groups[pg]:
                        problems.append(Problem(rank, n.id, f"rank is not a member of its group {pg}"))
            elif n.type in (SEND, RECV):
                peer_attr = "comm_dst" if n.type == SEND else "comm_src"
                peer = _check_int(n, rank, peer_attr, problems, required=True)
                tag = _check_int(n, rank, "comm_tag", problems, required=True)
                size = _check_int(n, rank, "comm_size", problems, required=True, positive=True)
                if peer is not None and not 0 <= peer < world:
                    problems.append(Problem(rank, n.id, f"{peer_attr} {peer} is not a rank"))
                elif peer is not None and tag is not None and size is not None:
                    key = (rank, peer, tag) if n.type == SEND else (peer, rank, tag)
                    (sends if n.type == SEND else recvs)[key].append((size, n.id))
        order, cyclic = _issue_order(nodes)
        if cyclic:
            problems.append(Problem(rank, None, "dependency cycle (the simulator drops such nodes silently)"))
        for n in order:
            if n.type == COLL and n.attr_kinds.get("pg_name", "string_val") == "string_val":
                pg = str(n.attrs.get("pg_name", "") or "0")
                ctype, size = n.int_attr("comm_type"), n.int_attr("comm_size")
                if ctype is not None and size is not None:
                    coll_seq[pg].setdefault(rank, []).append((ctype, size, n.id))
        if len(problems) >= limit:
            return problems[:limit]
    for pg, per_rank in coll_seq.items():
        members = list(range(world)) if pg == "0" else groups.get(pg, [])
        if not members:
            continue
        # Compare every member with the sequence most members issue (the first member's on a tie).
        signature = {m: tuple((t, s) for t, s, _ in per_rank.get(m, [])) for m in members}
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
                    problems.append(Problem(m, a[2] if a else None,
                                            f"collective #{i} in group {pg} is {_show(a)}, but rank "
                                            f"{ref_rank} issues {_show(b)} (mismatch deadlocks)"))
                    break
    for key in sorted(set(sends) | set(recvs)):
        s, r = sorted(sends.get(key, [])), sorted(recvs.get(key, []))
        src, dst, tag = key
        if len(s) != len(r):
            rank, node = (src, s[0][1]) if len(s) > len(r) else (dst, r[0][1])
            problems.append(Problem(rank, node, f"{len(s)} send(s) from rank {src} to rank {dst} with tag {tag} "
                                                f"but {len(r)} matching receive(s)"))
        elif [x for x, _ in s] != [x for x, _ in r]:
            problems.append(Problem(dst, r[0][1], f"receive from rank {src} with tag {tag} expects "
                                                  f"{[x for x, _ in r]} B, the send carries {[x for x, _ in s]} B"))
    return problems[:limit]
