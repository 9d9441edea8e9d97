"""Our ASTRA-sim model against the real simulator's reference runs, to the nanosecond.

Every ``status=ok``, ``binary=Unaware`` row of ``astra-sim-reference.csv`` is one test: its
inputs come from the case folder of ``astra-sim-reference-cases.tar.gz`` (the case's own
traces for up to 16 ranks; for 64 and 128 ranks, traces rebuilt from the row in exactly the
shape the small cases' traces have, a shape checked against every small case below). The
simulator's own stdout is checked against the CSV too, so both references vouch for each other.
Hand-worked examples of the cost-model file pin the individual rules.
"""

from __future__ import annotations

import csv
import json
import re
import tarfile
from pathlib import Path

import pytest

from stage_cosim.adapters.astra_sim.config_files import (read_memory_json, read_network_yml,
                                                         read_system_json, system_json_dict,
                                                         write_memory_json, write_network_yml,
                                                         write_system_json)
from stage_cosim.adapters.astra_sim.analytical import simulate_astra
from stage_cosim.adapters.astra_sim.astra_collectives import (chunking, collective_finish_times,
                                                             collective_time)
from stage_cosim.adapters.astra_sim.astra_network import Network, message_delay, reduction_cost
from stage_cosim.adapters.astra_sim.astra_phases import plan_phases
from stage_cosim.adapters.astra_sim.astra_system import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL,
                                                         COLLECTIVES, REDUCE_SCATTER, AstraSystem)
from stage_cosim.adapters.astra_sim.astra_workload import compute_duration_ns
from stage_cosim.errors import UserError
from stage_cosim.hardware.network import NetworkDim
from stage_cosim.trace.chakra import TraceNode, read_comm_groups, read_trace_dir, write_trace_file

# The reference runs are committed beside the tests; without them this module fails (a missing
# reference is a broken checkout, not a reason to skip 2,000 tests).
DATA = Path(__file__).resolve().parent / "data" / "astra_sim"
CSV_PATH = DATA / "astra-sim-reference.csv"
TARBALL = DATA / "astra-sim-reference-cases.tar.gz"

assert CSV_PATH.is_file() and TARBALL.is_file(), f"ASTRA-sim reference material missing from {DATA}"

with CSV_PATH.open(newline="") as fh:
    ROWS = [r for r in csv.DictReader(fh) if r["binary"] == "Unaware" and r["status"] == "ok"]
ROW_IDS = [r["case_id"] for r in ROWS]
assert len(ROWS) == 558, f"{CSV_PATH} holds {len(ROWS)} Unaware/ok runs, not the reference's 558"

CODES = {"AR": 0, "AG": 2, "A2A": 6, "RS": 7}
RESULT_COLUMNS = ("finished_max_ns", "finished_min_ns", "finished_rank0_ns", "exposed_comm_rank0_ns")


@pytest.fixture(scope="session")
def cases_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference cases, extracted once per test session (per xdist worker)."""
    root = tmp_path_factory.mktemp("astra_reference")
    with tarfile.open(TARBALL) as tar:
        if hasattr(tarfile, "data_filter"):       # Python >= 3.10.12 / 3.11.4
            tar.extractall(root, filter="data")
        else:
            tar.extractall(root)
    return root / "cases"


# -- rebuilding the simple workloads from a CSV row ------------------------------------------------

def _comp(node_id: int, duration_us: int, deps: list[int] | None = None, name: str = "comp",
          **attrs: int) -> TraceNode:
    return TraceNode(node_id, name, 4, deps or [], [], duration_us, {"is_cpu_op": False, **attrs})


def _coll(node_id: int, kind: str, size: int, deps: list[int] | None = None,
          **attrs: object) -> TraceNode:
    return TraceNode(node_id, f"coll_{kind}", 7, deps or [], [], 0,
                     {"is_cpu_op": False, "comm_type": CODES[kind], "comm_size": size, **attrs})


def _idle() -> TraceNode:
    """What ranks outside every group / pair run: a 1 ns compute node."""
    return _comp(0, 0, name="idle")


def parse_comm_groups(text: str) -> dict[str, list[int]]:
    """``k=[a..b step s]`` (group k is a, a+s, ... b) or ``k=[a,b,...]``, joined with ``; ``."""
    groups: dict[str, list[int]] = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        key, body = item.split("=", 1)
        body = body.strip()[1:-1]
        m = re.fullmatch(r"(\d+)\.\.(\d+) step (\d+)", body)
        if m:
            a, b, s = map(int, m.groups())
            groups[key.strip()] = list(range(a, b + 1, s))
        else:
            groups[key.strip()] = [int(x) for x in body.split(",")]
    return groups


def build_collective(row: dict[str, str], n: int) -> dict[int, list[TraceNode]]:
    """One collective on every rank (or on every rank of its group, pg_name = group id)."""
    kind, size = row["collective"], int(row["comm_size_bytes"])
    attrs: dict[str, object] = {}
    if row["involved_dim"]:
        attrs["involved_dim"] = [v == "1" for v in row["involved_dim"].split(";")]
    if not row["comm_groups"]:
        return {r: [_coll(0, kind, size, **attrs)] for r in range(n)}
    group_of = {r: k for k, members in parse_comm_groups(row["comm_groups"]).items() for r in members}
    return {r: [_coll(0, kind, size, pg_name=group_of[r], **attrs)] if r in group_of else [_idle()]
            for r in range(n)}


def build_send_recv(row: dict[str, str], n: int) -> dict[int, list[TraceNode]]:
    """SEND/RECV pairs in the listed order; optional chaining and a leading compute node."""
    items = [s.strip() for s in row["workload_description"].split(";")]
    chained = any("chained by data deps" in s for s in items)
    first_comp: dict[int, int] = {}
    ranks: dict[int, list[TraceNode]] = {r: [] for r in range(n)}
    for s in items:
        m = re.fullmatch(r"rank (\d+) first runs COMP (\d+) us \(p2p node depends on it\)", s)
        if m:
            rank, dur = int(m[1]), int(m[2])
            first_comp[rank] = dur
            ranks[rank].append(_comp(0, dur))
    for s in items:
        m = re.fullmatch(r"SEND/RECV (\d+)->(\d+) (\d+) B tag (\d+)", s)
        if not m:
            continue
        src, dst, size, tag = map(int, m.groups())
        for rank, name, typ in ((src, "send", 5), (dst, "recv", 6)):
            nodes = ranks[rank]
            deps = [nodes[-1].id] if nodes and (chained or rank in first_comp) else []
            nodes.append(TraceNode(len(nodes), name, typ, deps, [], 0,
                                   {"is_cpu_op": False, "comm_src": src, "comm_dst": dst,
                                    "comm_size": size, "comm_tag": tag}))
    return {r: nodes or [_idle()] for r, nodes in ranks.items()}


_ELEMENT = re.compile(r"n(?P<id>\d+) (?P<spec>.+)")


def _dag_node(element: str, rank: int, deps: list[int]) -> TraceNode:
    m = _ELEMENT.fullmatch(element.strip())
    assert m, element
    node_id, spec = int(m["id"]), m["spec"].strip()
    if (c := re.fullmatch(r"COMP (\d+) us", spec)):
        return _comp(node_id, int(c[1]), deps)
    if (c := re.fullmatch(r"COMP \((\d+) us on rank 0, (\d+) us elsewhere\)", spec)):
        return _comp(node_id, int(c[1]) if rank == 0 else int(c[2]), deps)
    if (c := re.fullmatch(r"COMP\(num_ops=(\d+), tensor_size=(\d+) B, duration_micros=(\d+)\)", spec)):
        return _comp(node_id, int(c[3]), deps, num_ops=int(c[1]), tensor_size=int(c[2]))
    if (c := re.fullmatch(r"(AR|AG|RS|A2A) (\d+) B", spec)):
        return _coll(node_id, c[1], int(c[2]), deps)
    raise AssertionError(f"unknown DAG element {element!r}")


def build_dag(row: dict[str, str], n: int) -> dict[int, list[TraceNode]]:
    """``a || (b -> c)``: ``->`` chains by data dependency, ``||`` runs independently;
    ``k x (COMP t us -> AR s B)``: layers whose compute nodes chain and each feed their AR."""
    desc = re.sub(r" \(independent(, no deps)?\)$", "", row["workload_description"])
    layered = re.fullmatch(r"(\d+) x \(COMP (\d+) us -> (AR|AG|RS|A2A) (\d+) B\), "
                           r"COMP_i\+1 depends only on COMP_i", desc)
    ranks: dict[int, list[TraceNode]] = {}
    for r in range(n):
        nodes: list[TraceNode] = []
        if layered:
            layers, dur, kind, size = int(layered[1]), int(layered[2]), layered[3], int(layered[4])
            for i in range(layers):
                prev = [2 * i - 2] if i else []
                nodes += [_comp(2 * i, dur, prev), _coll(2 * i + 1, kind, size, [2 * i])]
        else:
            for branch in desc.split(" || "):
                branch = branch.strip()
                if branch.startswith("(") and branch.endswith(")"):
                    branch = branch[1:-1]
                previous: list[int] = []
                for element in branch.split(" -> "):
                    node = _dag_node(element, r, previous)
                    nodes.append(node)
                    previous = [node.id]
        ranks[r] = nodes
    return ranks


BUILDERS = {"collective": build_collective, "send_recv": build_send_recv, "dag": build_dag}


def build_workload(row: dict[str, str]) -> dict[int, list[TraceNode]]:
    return BUILDERS[row["workload_kind"]](row, int(row["total_npus"]))


def load_case(row: dict[str, str], cases: Path):
    """(traces, groups, system, network) of one case: the traces when present, else rebuilt."""
    case = cases / row["case_id"]
    groups = read_comm_groups(case / "groups.json") if (case / "groups.json").exists() else {}
    if (case / "wl").is_dir():
        ranks, _ = read_trace_dir(case / "wl")
    else:
        ranks = build_workload(row)
    return ranks, groups, read_system_json(case / "sys.json"), read_network_yml(case / "net.yml")


# -- the reference rows ---------------------------------------------------------------------------

@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_reference_row(row: dict[str, str], cases_dir: Path) -> None:
    ranks, groups, system, network = load_case(row, cases_dir)
    result = simulate_astra(ranks, groups, system, network)
    finished = result.finished_ns
    got = {"finished_max_ns": max(finished.values()), "finished_min_ns": min(finished.values()),
           "finished_rank0_ns": finished[0], "exposed_comm_rank0_ns": result.exposed_comm_ns[0]}
    expected = {k: int(row[k]) for k in RESULT_COLUMNS}
    if row["comm_time_rank0_ns"]:
        got["comm_time_rank0_ns"] = result.comm_time_ns[0]
        expected["comm_time_rank0_ns"] = int(row["comm_time_rank0_ns"])
    if row["gpu_time_rank0_ns"]:
        got["gpu_time_rank0_ns"] = result.gpu_time_ns[0]
        expected["gpu_time_rank0_ns"] = int(row["gpu_time_rank0_ns"])
    assert got == expected


# through the command line: every eighth row in the fast tier, all of them in the slow one
CLI_ROWS = [row if i % 8 == 0 else pytest.param(row, marks=pytest.mark.slow) for i, row in enumerate(ROWS)]


@pytest.mark.parametrize("row", CLI_ROWS, ids=ROW_IDS)
def test_reference_row_through_the_command_line(row: dict[str, str], cases_dir: Path, tmp_path: Path,
                                                run_cli) -> None:
    """``stage-cosim astra-sim replay`` with the binary's own flags on the case's own files (the
    64- and 128-rank cases' traces, which the tarball leaves out, are rebuilt and written first)."""
    case = cases_dir / row["case_id"]
    workload = case / "wl" / "et"
    if not (case / "wl").is_dir():
        (tmp_path / "wl").mkdir()
        for r, nodes in build_workload(row).items():
            write_trace_file(tmp_path / "wl" / f"et.{r}.et", nodes)
        workload = tmp_path / "wl" / "et"
    args = ["astra-sim", "replay", f"--workload-configuration={workload}", f"--system-configuration={case / 'sys.json'}",
            f"--network-configuration={case / 'net.yml'}", "--remote-memory-configuration", str(case / "mem.json")]
    if (case / "groups.json").exists():
        args.append(f"--comm-group-configuration={case / 'groups.json'}")
    code, out, err = run_cli(*args)
    assert code == 0, err
    lines = {int(m[1]): (int(m[2]), int(m[3])) for m in _FINISHED.finditer(out)}
    assert sorted(lines) == list(range(int(row["n_ranks"])))
    finished = [t for t, _ in lines.values()]
    got = {"finished_max_ns": max(finished), "finished_min_ns": min(finished), "finished_rank0_ns": lines[0][0],
           "exposed_comm_rank0_ns": lines[0][1]}
    assert got == {k: int(row[k]) for k in RESULT_COLUMNS}
    stats = {(int(m[1]), m[2]): int(m[3]) for m in _STAT.finditer(out)}
    for column, key in (("comm_time_rank0_ns", "Comm"), ("gpu_time_rank0_ns", "GPU")):
        if row[column]:
            assert stats[(0, key)] == int(row[column])
    # every rank, against the binary's own output for the case: its finished and exposed
    # communication line and its Wall / GPU / Comm time statistics
    binary = (case / "out_Unaware.txt").read_text(errors="replace")
    assert lines == {int(m[1]): (int(m[2]), int(m[3])) for m in _FINISHED.finditer(binary)}
    assert stats == {(int(m[1]), m[2]): int(m[3]) for m in _STAT.finditer(binary)}


_FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")
_STAT = re.compile(r"sys\[(\d+)\], (Wall|GPU|Comm) time: (\d+)")


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_simulator_stdout_agrees_with_csv(row: dict[str, str], cases_dir: Path) -> None:
    """The CSV's numbers are what the simulator printed (one ``finished`` line per rank)."""
    text = (cases_dir / row["case_id"] / "out_Unaware.txt").read_text(errors="replace")
    lines = {int(m[1]): (int(m[2]), int(m[3])) for m in _FINISHED.finditer(text)}
    assert len(lines) == int(row["n_finished_lines"]) == int(row["n_ranks"])
    finished = [t for t, _ in lines.values()]
    assert max(finished) == int(row["finished_max_ns"])
    assert min(finished) == int(row["finished_min_ns"])
    assert lines[0] == (int(row["finished_rank0_ns"]), int(row["exposed_comm_rank0_ns"]))


TRACED_ROWS = [r for r in ROWS if int(r["total_npus"]) <= 16]


@pytest.mark.parametrize("row", TRACED_ROWS, ids=[r["case_id"] for r in TRACED_ROWS])
def test_rebuilt_workload_matches_real_traces(row: dict[str, str], cases_dir: Path) -> None:
    """The builders used for the 64/128-rank cases reproduce every small case's traces exactly,
    so the large cases run the workload the simulator ran."""
    ranks, _ = read_trace_dir(cases_dir / row["case_id"] / "wl")

    def canon(nodes: list[TraceNode]) -> list[tuple]:
        return sorted((n.id, n.name, n.type, sorted(n.data_deps), sorted(n.ctrl_deps),
                       n.duration_micros, n.attrs) for n in nodes)

    built = build_workload(row)
    assert sorted(built) == sorted(ranks)
    for r in ranks:
        assert canon(built[r]) == canon(ranks[r]), f"rank {r}"


def test_rebuilt_groups_match_group_files(cases_dir: Path) -> None:
    for row in ROWS:
        if row["comm_groups"]:
            assert parse_comm_groups(row["comm_groups"]) == read_comm_groups(
                cases_dir / row["case_id"] / "groups.json"), row["case_id"]


# -- hand-worked examples of the cost-model file -----------------------------------------------

def _system(**overrides: object) -> AstraSystem:
    settings: dict[str, object] = {"preferred_dataset_splits": 4, "local_mem_bw_GBps": 1600.0,
                                   "implementations": {c: ("ring",) * 3 for c in COLLECTIVES}}
    settings.update(overrides)
    return AstraSystem(**settings)  # type: ignore[arg-type]


RING8 = [NetworkDim("Ring", 8, 50.0, 500.0)]
RING4 = [NetworkDim("Ring", 4, 50.0, 500.0)]
SWITCH8 = [NetworkDim("Switch", 8, 400.0, 936.25)]


def test_message_and_reduction_costs() -> None:
    # §1: 32 KiB over one Ring hop at 50 GB/s (2^30) and 500 ns: floor(500 + 610.35).
    assert message_delay(RING8, 0, 1, 32768) == 1110
    assert message_delay(RING8, 0, 3, 32768) == 2110             # three hops
    assert message_delay(RING8, 0, 5, 32768) == 2110             # the shorter way round
    assert message_delay(SWITCH8, 0, 5, 1 << 20) == 4313         # Switch: two hops
    # only the lowest differing dimension is charged
    two_d = [NetworkDim("Switch", 8, 400.0, 936.25), NetworkDim("Switch", 16, 50.0, 500.0)]
    assert message_delay(two_d, 0, 9, 1 << 20) == message_delay(two_d, 0, 1, 1 << 20) == 4313
    assert message_delay(two_d, 0, 8, 1 << 20) == 20531
    # §2: R(32768) at 1,600 GB/s = 3 * floor(20.48)
    assert reduction_cost(_system(), 32768) == 60
    assert reduction_cost(_system(local_mem_bw_GBps=None), 32768) == 0


def test_chunking() -> None:
    assert chunking(ALL_REDUCE, 1 << 20, 4, 8) == (262144, 4)
    assert chunking(ALL_REDUCE, 1 << 20, 3, 8) == (349525, 4)       # 4 chunks of 349,525 B
    assert chunking(ALL_REDUCE, 100, 4, 64) == (64, 4)              # at least N bytes a chunk
    assert chunking(ALL_GATHER, 100, 4, 64) == (25, 4)              # not for ALL_GATHER
    with pytest.raises(UserError):
        chunking(ALL_GATHER, 3, 4, 8)                               # the simulator never ends


def test_ring_all_reduce_base_case() -> None:
    # §6: m = 32,768, D = 1,110, R = 60, T_chunk = 2*7*1,120 + 10 + 7*60 = 16,110; 4 chunks.
    assert collective_time(RING8, _system(), ALL_REDUCE, 1 << 20) == 64440
    assert collective_time(RING8, _system(preferred_dataset_splits=1), ALL_REDUCE, 1 << 20) == 43025
    assert collective_time(RING8, _system(active_chunks_per_dimension=2), ALL_REDUCE, 1 << 20) == 32220


def test_ring_phase_formulas() -> None:
    # §5 with one chunk: D = 500 + floor(m / 53.687...) and E = 10, R(m) = 3 floor(m / 1600).
    s1 = _system(preferred_dataset_splits=1)
    n, m = 8, (1 << 20) // 8
    d, r = message_delay(RING8, 0, 1, m), reduction_cost(s1, m)
    assert collective_time(RING8, s1, REDUCE_SCATTER, 1 << 20) == (n - 1) * (d + 10 + r) + 10
    assert collective_time(RING8, s1, ALL_TO_ALL, 1 << 20) == n * (n - 1) // 2 * (d + 10) + 10
    d_ag = message_delay(RING8, 0, 1, 1 << 20)
    assert collective_time(RING8, s1, ALL_GATHER, 1 << 20) == (n - 1) * (d_ag + 10) + 10


def test_direct_halving_doubling_and_tree_formulas() -> None:
    s1 = _system(preferred_dataset_splits=1,
                 implementations={c: (impl,) for c, impl in ((ALL_REDUCE, "direct"),
                                                             (ALL_GATHER, "direct"),
                                                             (REDUCE_SCATTER, "direct"),
                                                             (ALL_TO_ALL, "direct"))})
    n, size = 8, 1 << 20
    m = size // n
    d, r = message_delay(SWITCH8, 0, 1, m), reduction_cost(s1, m)
    assert collective_time(SWITCH8, s1, ALL_REDUCE, size) == 3 * 10 + 2 * d + r
    assert collective_time(SWITCH8, s1, REDUCE_SCATTER, size) == 2 * 10 + d + r
    assert collective_time(SWITCH8, s1, ALL_TO_ALL, size) == 2 * 10 + d
    # halvingDoubling reduce-scatter: steps of C/2, C/4, C/8; reductions before steps 2..3.
    hd = _system(preferred_dataset_splits=1,
                 implementations={c: ("halvingDoubling",) for c in (ALL_REDUCE, REDUCE_SCATTER)})
    steps = [size >> k for k in (1, 2, 3)]
    expected = 10 + sum(message_delay(SWITCH8, 0, 1, s) + 10 for s in steps) \
        + sum(reduction_cost(hd, s) for s in steps[1:])
    assert collective_time(SWITCH8, hd, REDUCE_SCATTER, size) == expected
    # doubleBinaryTree: the root ends at E + L(D+E+R), the slowest leaf at 2E + (2L-1)(D+E+R) + D.
    dbt = _system(preferred_dataset_splits=1, implementations={ALL_REDUCE: ("doubleBinaryTree",)})
    d, r = message_delay(SWITCH8, 0, 1, size), reduction_cost(dbt, size)
    ends = collective_finish_times(SWITCH8, dbt, ALL_REDUCE, size, {k: 0 for k in range(8)})
    assert ends[7] == 10 + 3 * (d + 10 + r)
    assert max(ends.values()) == 2 * 10 + 5 * (d + 10 + r) + d


def test_multi_dimension_flow_shop_and_local_bw_aware() -> None:
    net = [NetworkDim("Ring", 4, 100.0, 500.0), NetworkDim("Switch", 2, 50.0, 1000.0)]
    base = _system()
    # §6 baseline: T = sum_d t_d + (chunks - 1) * max_d t_d, t_d the one-chunk time per dimension.
    t = [collective_time([net[0]], _system(preferred_dataset_splits=1), ALL_REDUCE, 1 << 18),
         collective_time([net[1]], _system(preferred_dataset_splits=1), ALL_REDUCE, 1 << 18)]
    # a 1-D network of dimension 1 alone renumbers ranks, but its one ring is the same pair
    assert collective_time(net, base, ALL_REDUCE, 1 << 20) == sum(t) + 3 * max(t)
    phases = plan_phases(ALL_REDUCE, _system(collective_optimization="localBWAware"), net)
    assert [(p.kind, p.queue) for p in phases] == [(REDUCE_SCATTER, 0), (ALL_REDUCE, 1),
                                                   (ALL_GATHER, 0)]
    assert [(p.kind, p.queue) for p in plan_phases(ALL_GATHER, base, net)] == [
        (ALL_GATHER, 1), (ALL_GATHER, 0)]
    # §6 localBWAware, 2-D, A = 1: AR_j = max((j+1) r, AR_{j-1}) + a; AG_j = max(AG_{j-1}, AR_j) + g.
    lbw = _system(collective_optimization="localBWAware")
    one = _system(preferred_dataset_splits=1)
    r = collective_time([net[0]], one, REDUCE_SCATTER, 1 << 18)
    a = collective_time([net[1]], one, ALL_REDUCE, (1 << 18) // 4)
    g = collective_time([net[0]], one, ALL_GATHER, (1 << 18) // 4)
    ar_end, ag_end = 0, 4 * r
    for j in range(4):
        ar_end = max((j + 1) * r, ar_end) + a
        ag_end = max(ag_end, ar_end) + g
    assert collective_time(net, lbw, ALL_REDUCE, 1 << 20) == ag_end


def test_group_ring_uses_listed_order_and_endpoint_10() -> None:
    phases = plan_phases(ALL_REDUCE, _system(endpoint_delay_ns=50), RING8, group=[3, 1, 2])
    assert len(phases) == 1 and phases[0].rings == ((3, 1, 2),) and phases[0].endpoint == 10
    two = _system(implementations={ALL_REDUCE: ("direct", "ring")})
    assert plan_phases(ALL_REDUCE, two, RING8, group=[0, 1])[0].algorithm == "ring"


def _coll_node(node_id: int, code: int, size: int, deps: list[int] | None = None,
               pg: str | None = None) -> TraceNode:
    attrs: dict[str, object] = {"is_cpu_op": False, "comm_type": code, "comm_size": size}
    if pg:
        attrs["pg_name"] = pg
    return TraceNode(node_id, "coll", 7, deps or [], [], 0, attrs)


def test_astra_sim_md_reference_points() -> None:
    """The rows of astra-sim.md's table that the reference CSV corroborates.

    Two rows are left out because the reference runs contradict them: "8 ranks, 1 MiB ALL_REDUCE,
    localBWAware, Switch 8 at 400 GB/s and 936.25 ns -> 55222" (p4_015 runs the same collective
    on the same network and finishes it at 111368; with one dimension localBWAware is baseline,
    as p1_021 shows), and "4 ranks, 100 us compute then the 1 MiB ALL_REDUCE -> 142244" (every
    compute -> collective chain in the reference adds the two, e.g. p4_007's rank 0: 50000 +
    64440 = 114440, which gives 100000 + 43000 = 143000 here).
    """
    sys4 = _system()
    ranks = {r: [_coll_node(0, 0, 1 << 20)] for r in range(4)}
    assert simulate_astra(ranks, {}, sys4, RING4).step_time_ns == 43000
    ranks = {r: [_coll_node(0, 7, 1 << 20)] for r in range(4)}
    assert simulate_astra(ranks, {}, sys4, RING4).step_time_ns == 22240
    p2p = {"comm_src": 0, "comm_dst": 1, "comm_size": 1 << 20, "comm_tag": 0}
    ranks = {0: [TraceNode(0, "send", 5, [], [], 0, dict(p2p))],
             1: [TraceNode(0, "recv", 6, [], [], 0, dict(p2p))]}
    assert simulate_astra(ranks, {}, sys4, [NetworkDim("Ring", 2, 50.0, 500.0)]).step_time_ns == 20031
    ranks = {r: [_coll_node(0, 0, 1 << 20, pg="1" if r < 2 else "2")] for r in range(4)}
    assert simulate_astra(ranks, {"1": [0, 1], "2": [2, 3]}, sys4, RING4).step_time_ns == 24620
    ranks = {r: [_comp(0, 100), _coll_node(1, 0, 1 << 20, [0])] for r in range(4)}
    assert simulate_astra(ranks, {}, sys4, RING4).step_time_ns == 100000 + 43000


def test_double_binary_tree_alternates_across_collectives() -> None:
    """ASTRA-sim's tree counter runs on from one collective to the next: with one chunk each,
    the first ALL_REDUCE uses the tree rooted at the last rank, the second the one rooted at 0."""
    dbt = _system(preferred_dataset_splits=1, implementations={ALL_REDUCE: ("doubleBinaryTree",)})
    counters: dict[object, int] = {}
    starts = {r: 0 for r in range(8)}
    first = collective_finish_times(SWITCH8, dbt, ALL_REDUCE, 1 << 20, starts, tree_counters=counters)
    second = collective_finish_times(SWITCH8, dbt, ALL_REDUCE, 1 << 20, starts, tree_counters=counters)
    assert min(first, key=first.get) == 7 and min(second, key=second.get) == 0


def test_workload_layer_slots_and_exposed_communication() -> None:
    sys8 = _system()
    # compute overlaps a collective; two independent collectives serialize on the comm slot
    ranks = {r: [_comp(0, 100), _coll_node(1, 0, 1 << 20), _coll_node(2, 0, 1 << 20)]
             for r in range(8)}
    result = simulate_astra(ranks, {}, sys8, RING8)
    assert result.finished_ns[0] == 128880 and result.gpu_time_ns[0] == 100000
    assert result.exposed_comm_ns[0] == 28880 and result.comm_time_ns[0] == 128880
    # a late start on one rank propagates through the ring
    ranks = {r: [_comp(0, 50 if r == 0 else 10), _coll_node(1, 0, 1 << 20, [0])] for r in range(8)}
    finished = simulate_astra(ranks, {}, sys8, RING8).finished_ns
    assert finished[0] == 114440 and min(finished.values()) == 106670


def test_roofline_compute_time() -> None:
    roof = _system(roofline_enabled=True, peak_perf_TFLOPS=900.0)
    node = _comp(0, 7, num_ops=987654321, tensor_size=1234567)
    assert compute_duration_ns(node, roof) == 1097                 # compute-bound at 900 TFLOP/s
    node = _comp(0, 7, num_ops=1_000_000_000, tensor_size=1_000_000_000)
    assert compute_duration_ns(node, roof) == 625000               # memory-bound at 1,600 GB/s
    assert compute_duration_ns(node, _system()) == 7000            # replay when roofline is off
    assert compute_duration_ns(_comp(0, 0), _system()) == 1


def test_invalid_workloads_are_rejected() -> None:
    with pytest.raises(UserError, match="endpoint-delay"):
        collective_time(RING8, _system(endpoint_delay_ns=0), ALL_REDUCE, 1 << 20)
    ranks = {r: [_coll_node(0, 0, 1 << 20 if r else 1 << 10)] for r in range(8)}
    with pytest.raises(UserError, match="differs"):
        simulate_astra(ranks, {}, _system(), RING8)
    with pytest.raises(UserError, match="implementation"):
        collective_time(RING8, _system(implementations={}), ALL_REDUCE, 1 << 20)


# -- configuration files ------------------------------------------------------------------------

def test_config_files_round_trip(tmp_path: Path, cases_dir: Path) -> None:
    for row in ROWS[:40] + ROWS[-40:]:
        case = cases_dir / row["case_id"]
        system, dims = read_system_json(case / "sys.json"), read_network_yml(case / "net.yml")
        write_system_json(system, tmp_path / "sys.json")
        write_network_yml(dims, tmp_path / "net.yml")
        assert read_system_json(tmp_path / "sys.json") == system
        assert read_network_yml(tmp_path / "net.yml") == dims
        assert json.loads((case / "sys.json").read_text()) == system_json_dict(system)
        assert read_memory_json(case / "mem.json") == "NO_MEMORY_EXPANSION"
    first = (tmp_path / "sys.json").read_bytes()
    write_system_json(system, tmp_path / "sys.json")
    assert (tmp_path / "sys.json").read_bytes() == first                    # deterministic
    write_memory_json(tmp_path / "mem.json")
    assert json.loads((tmp_path / "mem.json").read_text()) == {"memory-type": "NO_MEMORY_EXPANSION"}


def test_network_yml_format_and_errors(tmp_path: Path) -> None:
    dims = [NetworkDim("Switch", 8, 400.0, 936.25), NetworkDim("Switch", 128, 50.0, 2000.0)]
    write_network_yml(dims, tmp_path / "net.yml")
    assert (tmp_path / "net.yml").read_text() == (
        "topology: [ Switch, Switch ]\nnpus_count: [ 8, 128 ]\n"
        "bandwidth: [ 400, 50 ]\nlatency: [ 936.25, 2000 ]\n")
    bad = {
        "topology: Ring\nnpus_count: [ 8 ]\nbandwidth: [ 50 ]\nlatency: [ 500 ]\n": "topology",
        "topology: [ Ring ]\nnpus_count: 8\nbandwidth: [ 50 ]\nlatency: [ 500 ]\n": "npus_count",
        "topology: [ Ring ]\nnpus_count: [ 8, 2 ]\nbandwidth: [ 50 ]\nlatency: [ 500 ]\n": "network",
        "topology: [ Torus ]\nnpus_count: [ 8 ]\nbandwidth: [ 50 ]\nlatency: [ 500 ]\n": "topology",
        "topology: [ Ring ]\nnpus_count: [ 8 ]\nlatency: [ 500 ]\n": "bandwidth",
    }
    for text, key in bad.items():
        (tmp_path / "bad.yml").write_text(text)
        with pytest.raises(UserError) as info:
            read_network_yml(tmp_path / "bad.yml")
        assert info.value.parameter.startswith(key) and "\n" not in str(info.value)


def test_system_json_errors(tmp_path: Path) -> None:
    cases = {
        '{"scheduling-policy": "LIFO"}': "preferred-dataset-splits",
        '{"preferred-dataset-splits": 0}': "preferred-dataset-splits",
        '{"preferred-dataset-splits": 4, "scheduling-policy": "RANDOM"}': "scheduling-policy",
        '{"preferred-dataset-splits": 4, "all-reduce-implementation": "ring"}':
            "all-reduce-implementation",
        '{"preferred-dataset-splits": 4, "all-gather-implementation": ["tree"]}':
            "all-gather-implementation",
        '{"preferred-dataset-splits": 4, "local-mem-bw": -1}': "local-mem-bw",
        '[1, 2]': "system-configuration",
    }
    for text, key in cases.items():
        (tmp_path / "sys.json").write_text(text)
        with pytest.raises(UserError) as info:
            read_system_json(tmp_path / "sys.json")
        assert info.value.parameter == key
    (tmp_path / "mem.json").write_text('{"memory-type": "CXL"}')
    with pytest.raises(UserError, match="memory-type"):
        read_memory_json(tmp_path / "mem.json")


def test_network_helper_rings() -> None:
    net = Network([NetworkDim("Ring", 4, 1.0, 1.0), NetworkDim("Switch", 8, 1.0, 1.0),
                   NetworkDim("Switch", 4, 1.0, 1.0)])
    assert net.ring_of(37, 0) == (36, 37, 38, 39)
    assert net.ring_of(37, 1) == tuple(range(33, 64, 4))
    assert net.ring_of(37, 2) == (5, 37, 69, 101)
    for dim in range(3):
        rings = net.rings(dim)
        assert sorted(r for ring in rings for r in ring) == list(range(128))
        assert all(net.ring_of(ring[0], dim) == ring for ring in rings)
