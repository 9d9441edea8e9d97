"""The ``astra`` network model: ASTRA-sim's congestion-unaware analytical backend, exactly.

Everything here runs :mod:`astra_replay` (ASTRA-sim's workload layer) with
:class:`~astra_collectives.CollectiveModel` (its system and network layers, which reproduce the
reference runs to the nanosecond):

* :func:`replay_trace_set` — any trace set, under a system and a network (what the binary
  prints, rank by rank); :func:`replay_files` reads the binary's own input files for it,
  :func:`simulate_run_dir` an exported run directory, and :func:`simulate_astra` takes plain
  per-rank node lists;
* :func:`replay_workload` — a synthesized workload as the exporter would write it, without
  writing it (the ``--network-model astra`` of ``simulate``, and the export's own check);
* :func:`input_problems` — what the binary would abort or hang on, as a list of problems;
* :func:`exit_warnings` — what it runs to the end but then trips on (its double free on exit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from stage_cosim.adapters.astra_sim.astra_collectives import CollectiveModel
from stage_cosim.adapters.astra_sim.astra_network import Network
from stage_cosim.adapters.astra_sim.astra_replay import (
    Agent, Deadlock, Outcome, Program, _Asymmetric, durations_ns, expand, make_agent, program_of, replay,
)
from stage_cosim.adapters.astra_sim.astra_system import COLLECTIVE_BY_CODE, AstraSystem
from stage_cosim.adapters.astra_sim.astra_workload import AstraRunResult, roofline_ns
from stage_cosim.adapters.roofline.classes import (
    ALL, K_COLL, K_RECV, K_SEND, Classes, membership, replay_ns, symmetric as is_symmetric, target_of, trace_classes,
)
from stage_cosim.errors import UserError
from stage_cosim.gc_pause import gc_paused
from stage_cosim.hardware.network import NetworkDim
from stage_cosim.trace.chakra import TraceNode
from stage_cosim.trace.traceset import COLL, TraceSet, from_nodes
from stage_cosim.trace.validate import Problem, validate

# A nominal machine for checking traces whose system and network are not given: every
# collective as one ring over its group, one chunk; one switch joining every rank.
NOMINAL_IMPLEMENTATIONS = {c: ("ring",) for c in COLLECTIVE_BY_CODE.values()}


def nominal(n_ranks: int) -> tuple[AstraSystem, list[NetworkDim]]:
    return (AstraSystem(preferred_dataset_splits=1, implementations=NOMINAL_IMPLEMENTATIONS),
            [NetworkDim("Switch", max(1, n_ranks), 100.0, 1000.0)])


@dataclass
class Replayed:
    """A replay's agents (one per simulated rank), their outcome, and which agent stands for
    each rank."""

    agents: list[Agent]
    outcome: Outcome
    agent_of_rank: Callable[[int], int]
    n_ranks: int
    warnings: list[str] = field(default_factory=list)   # what the binary trips on after its results

    @property
    def symmetric(self) -> bool:
        return len(self.agents) < self.n_ranks

    def result(self) -> AstraRunResult:
        return expand(self.outcome, self.agents, self.agent_of_rank, self.n_ranks)


# -- any trace set -------------------------------------------------------------------------------

@gc_paused()
def replay_trace_set(ts: TraceSet, system: AstraSystem, dims: Sequence[NetworkDim], *,
                     symmetric: bool = True, record: bool = False,
                     durations: Sequence[Sequence[int]] | None = None) -> Replayed:
    """Replay a (checked) trace set as the binary would; one rank per class where exact.
    ``durations`` (per class, per node in file order, ns) replaces the simulator's own compute
    times."""
    net = Network(list(dims))
    programs = [program_of(t, durations[c] if durations is not None else durations_ns(t, system))
                for c, t in enumerate(ts.classes)]
    members_of = membership(ts.groups, net.n_ranks)

    def one_per_class() -> tuple[list[Agent], Callable[[int], int]] | None:
        cl, reps = trace_classes(ts, members_of)
        if not is_symmetric(cl, reps, members_of, net):
            return None
        order = sorted(reps)
        index = {c: a for a, c in enumerate(order)}
        class_of = ts.class_of
        return ([make_agent(reps[c], programs[c], ts.values_of(reps[c])) for c in order],
                lambda r: index[class_of[r]])

    return _replay(net, system, members_of, record, one_per_class if symmetric and len(ts.classes) < net.n_ranks
                   else None, lambda r: make_agent(r, programs[ts.class_of[r]], ts.values_of(r)))


def _replay(net: Network, system: AstraSystem, members_of: Callable[[object], Sequence[int]], record: bool,
            one_per_class: Callable[[], tuple[list[Agent], Callable[[int], int]] | None] | None,
            agent: Callable[[int], Agent]) -> Replayed:
    """One agent per class where ``one_per_class`` finds that exact (and the replay confirms it),
    else one agent per rank."""
    n = net.n_ranks
    found = one_per_class() if one_per_class is not None else None
    if found is not None:
        agents, agent_of_rank = found
        try:
            out = replay(agents, members_of, agent_of_rank, CollectiveModel(net, system), net, check_symmetry=True,
                         record=record)
            return Replayed(agents, out, agent_of_rank, n)
        except _Asymmetric:
            pass
    agents = [agent(r) for r in range(n)]
    out = replay(agents, members_of, lambda r: r, CollectiveModel(net, system), net, record=record)
    return Replayed(agents, out, lambda r: r, n)


def input_problems(ts: TraceSet, system: AstraSystem, dims: Sequence[NetworkDim], limit: int = 20) -> list[Problem]:
    """What the binary aborts or hangs on under this system and network, beyond the trace
    checks of :func:`~stage_cosim.trace.validate.validate`: the rank count, endpoint-delay 0,
    roofline inputs (``tensor_size`` 0 only matters there), and every distinct collective's phases
    (missing implementation lists, implementations that cannot run it, zero-byte messages, an
    all-gather smaller than the split count, more chunk copies than can be simulated)."""
    net = Network(list(dims))
    n = net.n_ranks
    out: list[Problem] = []
    ranks = ts.ranks
    if ranks != list(range(n)):
        out.append(Problem(None, None, f"the network has {n} ranks but the traces are for ranks "
                                       f"{ranks[0]}..{ranks[-1]} ({len(ranks)} files); the simulator needs one "
                                       f"trace per network rank"))
        return out
    first_rank = {}
    for r in ranks:
        first_rank.setdefault(ts.class_of[r], r)
    for c, table in enumerate(ts.classes):
        if c not in first_rank:
            continue
        r0 = first_rank[c]
        try:
            durations_ns(table, system)
        except UserError as exc:
            out.append(Problem(r0, None, f"{exc.parameter}: {exc.rule}"))
    model = CollectiveModel(net, system)
    members_of = membership(ts.groups, n)
    seen: set[tuple] = set()
    for r in ranks:
        c = ts.class_of[r]
        table = ts.classes[c]
        for i, value in zip(table.holes, ts.values_of(r)):
            if table.types[i] != COLL:
                continue
            ctype = table.int_attr(i, "comm_type")
            size = table.int_attr(i, "comm_size")
            if ctype not in COLLECTIVE_BY_CODE or size is None:
                continue
            g = target_of(value, K_COLL)
            inv = table.attrs[i].get("involved_dim")
            key = (ctype, size, g, tuple(inv[1]) if inv and isinstance(inv[1], list) else None)
            if key in seen:
                continue
            seen.add(key)
            members = members_of(g)
            try:
                model.plan(COLLECTIVE_BY_CODE[ctype], size, None if g == ALL else tuple(members), key[3])
            except UserError as exc:
                out.append(Problem(r, table.ids[i], f"{exc.parameter}: {exc.rule}"))
                if len(out) >= limit:
                    return out
    return out


NOMINAL_NOTE = " (under a nominal network: give the system and network files to check the ones you will run)"


@dataclass
class Checked:
    """What :func:`check` found: problems (the simulator would abort or hang) and warnings (it
    runs and prints every result, but something else goes wrong)."""

    problems: list[Problem]
    warnings: list[str]


@gc_paused()
def check(ts: TraceSet, system: AstraSystem | None, dims: Sequence[NetworkDim] | None,
          limit: int = 1000) -> Checked:
    """Everything wrong with a trace set for the simulator: the trace checks, then (if those
    pass) the system- and network-dependent ones and a replay that finds the deadlocks of its
    one-operation-at-a-time rule. Without a system and network a nominal one is used (a
    deadlock can depend on timing: check with the files you will run), and what it finds is
    reported as found under it, never dropped."""
    problems = validate(ts, limit)
    if problems:
        return Checked(problems, [])
    given = system is not None and dims is not None
    if not given:
        system, dims = nominal(len(ts.class_of))
    assert system is not None and dims is not None
    where = "" if given else NOMINAL_NOTE
    problems = input_problems(ts, system, dims)
    if problems:
        return Checked([Problem(p.rank, p.node, p.message + where, p.others) for p in problems], [])
    try:
        replay_trace_set(ts, system, dims)
    except Deadlock as d:
        return Checked([Problem(None, None, deadlock_message(d) + where)], [])
    return Checked([], exit_warnings(trace_set_uses(ts, Network(list(dims)).n_ranks), system) if given else [])


# -- the binary's exit -------------------------------------------------------------------------------

def trace_set_uses(ts: TraceSet, n_ranks: int) -> dict[tuple[str, tuple[str, ...]], list[int]]:
    """(collective, the communicator groups smaller than the network it runs on) -> the ranks
    that run it on two or more such groups (see :func:`exit_warnings`)."""
    members_of = membership(ts.groups, n_ranks)
    full: dict[object, bool] = {}
    out: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for r in ts.ranks:
        table = ts.classes[ts.class_of[r]]
        per: dict[str, set[str]] = {}
        for i, value in zip(table.holes, ts.values_of(r)):
            if table.types[i] != COLL:
                continue
            name = COLLECTIVE_BY_CODE.get(table.int_attr(i, "comm_type"))  # type: ignore[arg-type]
            g = target_of(value, K_COLL)
            if name is None or g == ALL:
                continue
            if g not in full:
                full[g] = len(set(members_of(g))) >= n_ranks
            if not full[g]:
                per.setdefault(name, set()).add(str(g))
        for name, gs in per.items():
            if len(gs) > 1:
                out.setdefault((name, tuple(sorted(gs, key=lambda x: (len(x), x)))), []).append(r)
    return out


def workload_uses(w) -> dict[tuple[str, tuple[str, ...]], list[int]]:  # noqa: ANN001
    """:func:`trace_set_uses` of a synthesized workload's export (every rank of a pipeline stage
    uses groups of the same kinds)."""
    from stage_cosim.schedule.nodes import COLL as R_COLL

    out: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    n = w.world_size
    for s in range(w.parallel.pp):
        rank = w.mesh.rank(pp=s)
        per: dict[str, set[str]] = {}
        for kind in {(node.coll.value, node.group) for node in w.roles[s].nodes if node.type == R_COLL}:
            name, group = kind
            if name in COLLECTIVE_BY_CODE.values() and len(w.group_members(rank, group)) < n:
                per.setdefault(name, set()).add(str(w.group_id(rank, group)))
        for name, gs in per.items():
            if len(gs) > 1:
                ranks = [r for r in range(n) if w.role_of(r) == s]
                out.setdefault((name, tuple(sorted(gs, key=lambda x: (len(x), x)))), []).extend(ranks)
    return out


def exit_warnings(uses: Mapping[tuple[str, tuple[str, ...]], list[int]], system: AstraSystem) -> list[str]:
    """The binary's double free on exit: a communicator group smaller than the network gets its
    own plan per collective, which owns its implementation only when the implementation list has
    several entries (then it is a fresh ring); with one entry it holds the system's shared entry,
    yet frees it when the group is destroyed. A rank that runs one collective on two such groups
    frees that entry twice, after every rank's result is printed: the heap is corrupt, and the
    process may abort (status 134, e.g. "malloc_consolidate(): unaligned fastbin chunk detected")
    or exit 0, depending on the heap's layout. The results printed are correct, but results still
    queued in its asynchronous log when it dies are lost (a few runs in a hundred)."""
    by_collective: dict[str, tuple[tuple[str, ...], list[int]]] = {}
    for (name, groups), ranks in uses.items():
        impls = system.implementations.get(name, ())
        if len(impls) != 1:
            continue
        if name not in by_collective:
            by_collective[name] = (groups, [])
        by_collective[name][1].extend(ranks)
    out = []
    for name, (groups, ranks) in sorted(by_collective.items()):
        first, others = min(ranks), len(set(ranks)) - 1
        key = name.lower().replace("_", "-") + "-implementation"
        also = f" (as do {others} other rank{'s' if others > 1 else ''})" if others else ""
        shown = ", ".join(groups[:-1]) + f" and {groups[-1]}"
        out.append(f"rank {first} runs {name} on communicator groups {shown}{also}: with one {key} entry the "
                   f"simulator frees that entry once per group when it exits, a double free, so it may abort "
                   f"(status 134, heap corruption) as it prints its results, sometimes before its log has printed "
                   f"them all: a run without a finished line for every rank is incomplete (simulate --backend "
                   f"astra-sim runs it again)")
    return out


def deadlock_message(d: Deadlock, shown: int = 4) -> str:
    more = f"; … {len(d.stuck) - shown} more" if len(d.stuck) > shown else ""
    return ("deadlock under ASTRA-sim's rules (one communication operation at a time per rank, issued "
            f"in id order): {'; '.join(d.stuck[:shown])}{more}")


def replay_checked(ts: TraceSet, system: AstraSystem, dims: Sequence[NetworkDim], parameter: str, *,
                   symmetric: bool = True, record: bool = False,
                   durations: Sequence[Sequence[int]] | None = None) -> Replayed:
    """Check, then replay; anything the binary would abort or hang on is one UserError."""
    problems = validate(ts, 20) or input_problems(ts, system, dims)
    if problems:
        extra = f" ({len(problems)}{'+' if len(problems) >= 20 else ''} problems in all)" if len(problems) > 1 else ""
        raise UserError(parameter, f"{problems[0]}{extra}")
    try:
        return replay_trace_set(ts, system, dims, symmetric=symmetric, record=record, durations=durations)
    except Deadlock as d:
        raise UserError(parameter, deadlock_message(d)) from None


def simulate_astra(ranks: Mapping[int, Sequence[TraceNode]], groups: Mapping[str, Sequence[int]],
                   system: AstraSystem, network: Sequence[NetworkDim]) -> AstraRunResult:
    """Replay every rank's Chakra nodes as ASTRA-sim's congestion-unaware binary would (§7).

    At time 0 and whenever a node completes, a rank issues its dependency-free nodes in id
    order; compute needs the rank's one compute slot, collectives and sends its one
    communication slot, receives no slot. Sends finish at issue + D; receives at
    max(posted, arrival); a collective starts on each rank when that rank issues it and couples
    the ranks of its group. Inputs the simulator would abort or hang on are a UserError.
    """
    ts = from_nodes({r: list(ns) for r, ns in ranks.items()}, {str(k): list(v) for k, v in groups.items()})
    return replay_checked(ts, system, network, "traces").result()


# -- files -----------------------------------------------------------------------------------------

@gc_paused()
def replay_files(workload: str, system_file: Path, network_file: Path, memory_file: Path | None,
                 groups_file: Path | None, *, symmetric: bool = True) -> tuple[Replayed, int]:
    """The binary's inputs, by its own flags: (the replay, the number of ranks)."""
    from stage_cosim.adapters.astra_sim.config_files import read_memory_json, read_network_yml, read_system_json
    from stage_cosim.trace.location import read_prefix

    system = read_system_json(system_file)
    dims = read_network_yml(network_file)
    if memory_file is not None:
        read_memory_json(memory_file)
    n = Network(dims).n_ranks
    ts = read_prefix(workload, range(n), groups_file)
    rep = replay_checked(ts, system, dims, "workload-configuration", symmetric=symmetric)
    if any(len(impls) == 1 for impls in system.implementations.values()):
        rep.warnings = exit_warnings(trace_set_uses(ts, n), system)
    return rep, n


def simulate_run_dir(run_dir: Path) -> AstraRunResult:
    """What ASTRA-sim's congestion-unaware binary will print for an exported run directory,
    computed from the files alone."""
    from stage_cosim.adapters.astra_sim.layout import TRACE_DIR, TRACE_PREFIX
    from stage_cosim.trace.writer import GROUPS_FILE

    groups = run_dir / GROUPS_FILE
    rep, _ = replay_files(str(run_dir / TRACE_DIR / TRACE_PREFIX), run_dir / "system.json", run_dir / "network.yml",
                          None, groups if groups.exists() else None)
    return rep.result()


# -- a synthesized workload -------------------------------------------------------------------------

class _StageOf(Mapping[int, int]):
    """rank -> pipeline stage, without a dict of every rank."""

    def __init__(self, w) -> None:  # noqa: ANN001
        self.w = w

    def __getitem__(self, r: int) -> int:
        if not 0 <= r < self.w.world_size:
            raise KeyError(r)
        return self.w.role_of(r)

    def get(self, r: int, default=None):  # noqa: ANN001, ANN201
        return self.w.role_of(r) if 0 <= r < self.w.world_size else default

    def __iter__(self):  # noqa: ANN204
        return iter(range(self.w.world_size))

    def __len__(self) -> int:
        return self.w.world_size


def role_program(role, dur: Sequence[int]) -> tuple[Program, list[tuple[str, object]]]:  # noqa: ANN001
    """A role graph as a replay program, and each hole's symbolic target: ("pg", group kind)
    or ("peer", (kind, shift)): the pipeline's neighbour, or the cp ring's."""
    from stage_cosim.schedule.nodes import COLL as R_COLL, COMP as R_COMP, SEND as R_SEND

    nodes = role.nodes
    n = len(nodes)
    children: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    kind, coll, holes, syms = [0] * n, [None] * n, [], []
    cats = ["compute"] * n
    for i, node in enumerate(nodes):
        deps = node.deps
        if node.ctrl:
            deps = sorted(set(deps) | set(node.ctrl))
        indeg[i] = len(deps)
        for d in deps:
            children[d].append(i)           # i ascending: children stay sorted
        t = node.type
        if t != R_COMP:
            holes.append(i)
            if t == R_COLL:
                kind[i] = K_COLL
                coll[i] = node.coll.value
                cats[i] = node.group
                syms.append(("pg", node.group))
            else:
                kind[i] = K_SEND if t == R_SEND else K_RECV
                cats[i] = node.group or "pp"
                syms.append(("peer", (node.group or "pp", node.peer)))
    size = [node.comm_bytes for node in nodes]
    tag = [node.tag for node in nodes]
    names = [node.name for node in nodes]
    prog = Program(ids=list(range(n)), kind=kind, dur=list(dur), children=children, indeg=indeg, coll=coll,
                   size=size, tag=tag, involved=[None] * n, hole_index=holes, names=names, categories=cats)
    return prog, syms


def workload_durations(w, cluster, system: AstraSystem) -> Callable:  # noqa: ANN001
    """Per role, each node's compute time in ns exactly as the export writes it for the binary:
    whole microseconds with the rounding error carried (replay), or the binary's roofline."""
    from stage_cosim.adapters.astra_sim.durations import replay_durations
    from stage_cosim.adapters.roofline.kernels import step_compute_model
    from stage_cosim.schedule.nodes import COMP as R_COMP

    if system.roofline_enabled:
        def roofline(role) -> list[int]:  # noqa: ANN001
            return [roofline_ns(max(1, n.flops), max(1, n.mem_bytes), system) if n.type == R_COMP else 0
                    for n in role.nodes]
        return roofline
    # an inference step's kernels as every other command prices them (the measured GEMMs)
    micros = replay_durations(step_compute_model(cluster.gpu, w.inference is not None, w.parallel.software))

    def replayed(role) -> list[int]:  # noqa: ANN001
        us = micros(role)
        return [replay_ns(us[i]) if n.type == R_COMP else 0 for i, n in enumerate(role.nodes)]
    return replayed


@gc_paused()
def replay_workload(w, cluster, system: AstraSystem, *, symmetric: bool = True,  # noqa: ANN001
                    record: bool = False) -> Replayed:
    """What the binary prints for the workload's export under ``system`` (one rank per pipeline
    stage when that is exact), without writing anything."""
    dims = cluster.network_dims()
    net = Network(list(dims))
    n = w.world_size
    durations = workload_durations(w, cluster, system)
    built = [role_program(role, durations(role)) for role in w.roles]
    groups = w.communicator_groups()
    members_of = membership(groups, n)

    def resolve(rank: int, sym: tuple[str, object]) -> object:
        kind, key = sym
        if kind == "pg":
            return str(w.group_id(rank, str(key)))
        group, shift = key  # type: ignore[misc]
        return w.peer(rank, int(shift), str(group))

    def agent(rank: int) -> Agent:
        prog, syms = built[w.role_of(rank)]
        value = {s: resolve(rank, s) for s in set(syms)}
        target: list[object] = [None] * len(prog)
        for k, s in zip(prog.hole_index, syms):
            target[k] = value[s]
        return Agent(rank, prog, target)

    distinct = [sorted({(K_COLL if s[0] == "pg" else K_SEND, s) for s in syms}) for _, syms in built]
    reps = {s: w.mesh.rank(pp=s) for s in range(w.parallel.pp)}

    def targets(r: int) -> Iterable[tuple[int, object]]:
        return [(k, resolve(r, s)) for k, s in distinct[w.role_of(r)]]

    def pairs(r: int) -> Iterable[tuple[int, object, object]]:
        s0 = w.role_of(r)
        return [(k, resolve(reps[s0], s), resolve(r, s)) for k, s in distinct[s0]]

    def one_per_stage() -> tuple[list[Agent], Callable[[int], int]] | None:
        cl = Classes(_StageOf(w), n, pairs, targets)
        if not is_symmetric(cl, reps, members_of, net):
            return None
        return [agent(reps[s]) for s in range(w.parallel.pp)], w.role_of

    return _replay(net, system, members_of, record, one_per_stage if symmetric and w.parallel.pp < n else None, agent)


# -- the engine's view, for breakdowns and timelines -------------------------------------------------

_TYPE_NAMES = ("COMP", "COLL", "SEND", "RECV", "COLL")


def engine_view(done: Replayed):  # noqa: ANN201 (list[AgentProgram], Replay)
    """The replay as the event engine's programs and times (seconds), so that breakdowns and
    timelines read it like any other replay. Needs a replay run with ``record=True``."""
    from stage_cosim.adapters.roofline.engine import AgentProgram, Replay

    out = done.outcome
    assert out.start is not None and out.end is not None, "replay with record=True"
    programs = []
    for _a, ag in enumerate(done.agents):
        p = ag.prog
        n = len(p)
        types = [_TYPE_NAMES[k] for k in p.kind]
        cats = p.categories or ["compute" if k == 0 else f"pg:{t}" if k == K_COLL else "pp"
                                for k, t in zip(p.kind, ag.target)]
        programs.append(AgentProgram(
            name=f"rank{ag.rank}", rank=ag.rank, ids=list(p.ids), types=types, deps=[[] for _ in range(n)],
            duration=[d * 1e-9 for d in p.dur], kind=["" if k == 0 else c for k, c in zip(p.kind, cats)],
            coll=list(p.coll), nbytes=list(p.size), peer=[t if isinstance(t, int) else -1 for t in ag.target],
            tag=list(p.tag), group=[t if k == K_COLL else None for k, t in zip(p.kind, ag.target)],
            members=[None] * n, streams=["compute" if k == 0 else None if k == K_RECV else "comm" for k in p.kind]))
    rep = Replay([[t * 1e-9 for t in s] for s in out.start], [[t * 1e-9 for t in e] for e in out.end],
                 [f * 1e-9 for f in out.finish])
    return programs, rep
