"""Chakra output: exact schema, determinism, read-back, and the validator on broken traces."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from stage_cosim.parallel import ParallelConfig
from stage_cosim.trace import et_def_pb2 as pb
from stage_cosim.trace.chakra import attr_bytes, frame, iter_framed, read_trace_file, trace_files
from stage_cosim.trace.validate import load_trace_set, validate_trace_set
from stage_cosim.trace.writer import GROUPS_FILE, atomic_directory, write_traces
from stage_cosim.workload import synthesize

CONFIGS = [
    dict(dp=2, tp=2, pp=2, global_batch=8, seq_len=256),
    dict(dp=2, tp=2, pp=2, sp=True, zero=1, recompute="selective", global_batch=8, seq_len=256),
    dict(dp=1, tp=2, pp=2, vp=2, global_batch=4, seq_len=256, recompute="full"),
    dict(dp=4, tp=1, pp=1, zero=3, global_batch=8, seq_len=256),
    dict(dp=1, tp=1, pp=4, schedule="gpipe", global_batch=4, seq_len=256),
]


def _write(w, tmp_path: Path, fmt: str = "chakra") -> Path:
    out = tmp_path / f"traces-{fmt}"
    with atomic_directory(out, force=True) as d:
        write_traces(w, d, fmt)
    return out


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_synthesized_traces_validate(gpt_small, llama_small, tmp_path, cfg, family) -> None:
    model = gpt_small if family == "gpt" else llama_small
    w = synthesize(model, ParallelConfig(**cfg))
    out = _write(w, tmp_path)
    ranks, groups = load_trace_set(out)
    assert len(ranks) == w.world_size
    assert validate_trace_set(ranks, groups) == []


def test_schema_details(llama_small, tmp_path) -> None:
    w = synthesize(llama_small, ParallelConfig(dp=2, tp=2, pp=2, global_batch=4, seq_len=256))
    out = _write(w, tmp_path)
    groups = json.loads((out / GROUPS_FILE).read_text())
    for rank, path in trace_files(out).items():
        meta, nodes = read_trace_file(path)
        assert meta.version == "0.0.4"
        role = w.role(w.role_of(rank))
        assert len(nodes) == len(role.nodes)
        for n, ours in zip(nodes, role.nodes):
            assert n.type in (4, 5, 6, 7)            # every node typed, no metadata nodes
            assert n.data_deps == ours.deps
            if n.type == 4:
                assert n.attr_kinds["num_ops"] == "uint64_val" and n.attrs["num_ops"] >= 1
                assert n.attr_kinds["tensor_size"] == "uint64_val" and n.attrs["tensor_size"] == ours.mem_bytes
            if n.type == 7:
                assert n.attr_kinds["pg_name"] == "string_val"
                assert rank in groups[n.attrs["pg_name"]]
                assert n.attrs["comm_size"] == ours.comm_bytes       # bytes, not elements
                assert n.attrs["comm_type"] in (0, 2, 6, 7)
            if n.type == 5:
                assert n.attrs["comm_dst"] == w.peer(rank, +1 if ours.peer > 0 else -1)


def test_groups_follow_rank_mapping(llama_small) -> None:
    """Default axis order puts tp innermost: tp groups are runs of consecutive ranks."""
    w = synthesize(llama_small, ParallelConfig(dp=2, tp=4, pp=2, global_batch=4, seq_len=256))
    groups = list(w.communicator_groups().values())
    assert [0, 1, 2, 3] in groups and [0, 4] in groups and [8, 12] in groups
    w2 = synthesize(llama_small, ParallelConfig(dp=2, tp=4, pp=2, global_batch=4, seq_len=256,
                                                axis_order=("dp", "tp", "pp")))
    assert [0, 2, 4, 6] in list(w2.communicator_groups().values())


def test_output_is_deterministic(llama_small, tmp_path) -> None:
    cfg = ParallelConfig(dp=2, tp=2, pp=2, sp=True, global_batch=8, seq_len=256)

    def digest(sub: str) -> str:
        out = tmp_path / sub
        with atomic_directory(out, force=False) as d:
            write_traces(synthesize(llama_small, cfg), d)
        h = hashlib.sha256()
        for p in sorted(out.iterdir()):
            h.update(p.name.encode() + p.read_bytes())
        return h.hexdigest()

    assert digest("a") == digest("b")


def test_json_format_matches_chakra(llama_small, tmp_path) -> None:
    w = synthesize(llama_small, ParallelConfig(dp=2, pp=2, global_batch=4, seq_len=256))
    a, _ = load_trace_set(_write(w, tmp_path, "chakra"))
    b, groups = load_trace_set(_write(w, tmp_path, "json"))
    assert validate_trace_set(b, groups) == []
    for r in a:
        assert [(n.id, n.type, n.data_deps, n.attrs) for n in a[r]] == [(n.id, n.type, n.data_deps, n.attrs) for n in b[r]]


# -- the validator on deliberately broken traces -----------------------------------------------

def _rewrite(path: Path, edit) -> None:
    """Apply ``edit(list[pb.Node])`` to a trace file in place."""
    data = path.read_bytes()
    msgs = list(iter_framed(data))
    nodes = []
    for m in msgs[1:]:
        n = pb.Node()
        n.ParseFromString(m)
        nodes.append(n)
    edit(nodes)
    path.write_bytes(frame(msgs[0]) + b"".join(frame(n.SerializeToString()) for n in nodes))


def _first(nodes, node_type):
    return next(n for n in nodes if n.type == node_type)


def _set_attr(node, name, **value):
    for a in node.attr:
        if a.name == name:
            node.attr.remove(a)
            break
    node.attr.append(pb.AttributeProto(name=name, **value))


BREAKAGES = {
    "duplicate id": (lambda ns: setattr(ns[1], "id", ns[0].id), "duplicate node id"),
    "missing dependency": (lambda ns: ns[-1].data_deps.append(10**9), "not in this rank's file"),
    "cycle": (lambda ns: ns[0].data_deps.append(ns[-1].id), "cycle"),
    "untyped": (lambda ns: setattr(ns[0], "type", pb.INVALID_NODE), "not runnable"),
    "float attribute": (lambda ns: _set_attr(_first(ns, pb.COMM_COLL_NODE), "comm_size", double_val=1.0), "integer field"),
    "int pg_name": (lambda ns: _set_attr(_first(ns, pb.COMM_COLL_NODE), "pg_name", uint64_val=1), "must be a string"),
    "unsupported collective": (lambda ns: _set_attr(_first(ns, pb.COMM_COLL_NODE), "comm_type", uint64_val=9), "not simulated"),
    "collective size mismatch": (lambda ns: _set_attr(_first(ns, pb.COMM_COLL_NODE), "comm_size", uint64_val=12345), "mismatch"),
    "unknown group": (lambda ns: _set_attr(_first(ns, pb.COMM_COLL_NODE), "pg_name", string_val="999"), "not in the group file"),
    "unmatched send": (lambda ns: _set_attr(_first(ns, pb.COMM_SEND_NODE), "comm_tag", uint64_val=77777), "matching receive"),
    "send size": (lambda ns: _set_attr(_first(ns, pb.COMM_SEND_NODE), "comm_size", uint64_val=3), "the send carries"),
    "MEM_LOAD node": (lambda ns: setattr(_first(ns, pb.COMP_NODE), "type", pb.MEM_LOAD_NODE), "MEM_LOAD"),
}


@pytest.mark.parametrize("kind", sorted(BREAKAGES))
def test_validator_catches(llama_small, tmp_path, kind) -> None:
    w = synthesize(llama_small, ParallelConfig(dp=2, tp=2, pp=2, global_batch=4, seq_len=256))
    out = _write(w, tmp_path)
    edit, needle = BREAKAGES[kind]
    _rewrite(out / "workload.0.et", edit)
    ranks, groups = load_trace_set(out)
    problems = validate_trace_set(ranks, groups)
    assert problems, kind
    assert any(needle in str(p) for p in problems), [str(p) for p in problems[:5]]
    assert any("rank 0" in str(p) for p in problems)


def test_atomic_directory_leaves_nothing_on_failure(tmp_path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(out, force=False) as d:
            (d / "partial").write_text("x")
            raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_attr_bytes_roundtrip() -> None:
    node = pb.Node(id=3, name="x")
    extra = attr_bytes("pg_name", string_val="17")
    parsed = pb.Node()
    parsed.ParseFromString(node.SerializeToString() + extra)
    assert parsed.attr[0].name == "pg_name" and parsed.attr[0].string_val == "17"


def _same_nodes(a, b) -> bool:
    key = lambda n: (n.id, n.name, n.type, list(n.data_deps), list(n.ctrl_deps), n.duration_micros,  # noqa: E731
                     dict(n.attrs), dict(n.attr_kinds))
    return [key(n) for n in a] == [key(n) for n in b]


def test_trace_set_reader_equals_protobuf(llama_small, gpt_small, tmp_path) -> None:
    """The class-by-class reader (a wire-format walk, byte comparison against the class's file)
    gives every rank exactly the nodes protobuf decodes from its file, also for files it must
    decode the slow way: fields in another order, unknown fields, a rank differing in one node."""
    from stage_cosim.trace import location

    w = synthesize(gpt_small, ParallelConfig(dp=2, tp=2, pp=2, global_batch=8, seq_len=256))
    out = _write(w, tmp_path)

    # rank 5: one node with its attributes first and its other fields after them, one with an
    # IOInfo the walk does not know (protobuf accepts fields in any order)
    data = (out / "workload.5.et").read_bytes()
    msgs = list(iter_framed(data))
    n3, n4 = pb.Node.FromString(msgs[4]), pb.Node.FromString(msgs[5])
    head = pb.Node(id=n3.id, name=n3.name, type=n3.type, data_deps=n3.data_deps, duration_micros=7)
    odd = pb.Node(attr=n3.attr).SerializeToString() + head.SerializeToString()
    n4.inputs.values = "x"
    (out / "workload.5.et").write_bytes(b"".join(frame(m) for m in msgs[:4]) + frame(odd) + frame(n4.SerializeToString())
                                        + b"".join(frame(m) for m in msgs[6:]))
    _rewrite(out / "workload.6.et", lambda ns: _set_attr(_first(ns, pb.COMM_COLL_NODE), "comm_size", uint64_val=77))
    t = location.read(location.locate(out))
    assert len(t.classes) == 4          # two stages, and the two ranks edited above
    for rank, path in trace_files(out).items():
        assert _same_nodes(t.nodes(rank), read_trace_file(path)[1]), rank
