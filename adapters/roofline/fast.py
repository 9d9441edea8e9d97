"""The fast path of the roofline simulator: exploit the repetition of pipeline passes.

Every micro-batch's forward (or backward) of a model chunk on a stage is the same graph, and
in the calibrated network model each kind of communication has its own stream, so a pass runs
the same way whenever it starts (its nodes all wait, directly or not, for the previous pass's
last compute and for the pipeline receive). So:

1. simulate each pass template once, on its own, node by node (the event-driven engine);
2. replay the pipeline at pass granularity: a pass starts when the previous pass on its stage
   is done and its input has arrived; its output leaves after the template's exit time;
3. simulate the step-end nodes (gradient reductions, optimizer) node by node, each waiting for
   the absolute finish time of the pass nodes it depends on.

The first forward of each chunk, which waits on overlapped parameter gathers, is simulated
individually. The result equals the full node-level replay up to cross-pass overlaps the
templates cannot see (tests check the agreement). With SM sharing between collectives and
compute the step's tail is replayed node by node instead of step 3 (:mod:`.fast_tail`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable

from stage_cosim.adapters.roofline.breakdown import charge, intervals
from stage_cosim.adapters.roofline.comm_sms import CommSMs, comm_sms
from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.engine import WAIT, AgentProgram, DeadlockError, Replay, replay
from stage_cosim.adapters.roofline.fast_tail import NotAlone, TailState, exact, tail_replay
from stage_cosim.adapters.roofline.network import NetworkModel
from stage_cosim.adapters.roofline.run_cache import (
    RunCache, active, environment, nodes_content, rows_content, run_key,
)
from stage_cosim.parallel.axes import spans_stages
from stage_cosim.result import BREAKDOWN_KEYS
from stage_cosim.schedule.nodes import COLL, COMP, RECV, SEND, RoleGraph
from stage_cosim.workload import Workload



@dataclass
class _PassRun:
    start: list[float]
    end: list[float]
    exit: float
    sinks: float
    breakdown: dict[str, float]
    # per communication stream: (first start, last end) within the pass
    streams: dict[str, tuple[float, float]] | None = None
    # (start, end, category) of every node that occupies something (standalone block runs)
    spans: list[tuple[float, float, str]] | None = None


def _stream_use(prog: AgentProgram, rep: Replay, skip: int = 0) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for i in range(skip, len(prog.types)):
        st = prog.streams[i]
        if st is None or st == "compute" or st.startswith("wait"):
            continue
        lo, hi = out.get(st, (float("inf"), float("-inf")))
        out[st] = (min(lo, rep.start[0][i]), max(hi, rep.end[0][i]))
    return out


def _program(name: str, rank: int, rows_or_nodes: list, deps: list[list[int]], w: Workload, role: RoleGraph,
             compute: ComputeModel, network: NetworkModel, durations: dict,
             waits: list[float] | None = None, members: dict[str, tuple[int, ...]] | None = None) -> AgentProgram:
    """One agent program from template rows (tuples) or graph nodes; ``waits`` prepends WAIT
    nodes (index 0 … len-1) that finish at the given times; ``members``: the rank's group
    members by kind (computed here when not given)."""
    waits = waits or []
    nw = len(waits)
    n = nw + len(rows_or_nodes)
    prog = AgentProgram(name=name, rank=rank, ids=list(range(n)), types=[WAIT] * nw, deps=[[] for _ in waits],
                        duration=list(waits) + [0.0] * (n - nw), kind=[""] * n, coll=[None] * n, nbytes=[0] * n,
                        peer=[-1] * n, tag=[0] * n, group=[None] * n, members=[None] * n,
                        streams=[f"wait{i}" for i in range(nw)])
    if members is None:
        members = _members(w, rank)
    for j, item in enumerate(rows_or_nodes):
        i = nw + j
        if isinstance(item, tuple):
            _, typ, _, flops, _, mem, matmul, coll, cbytes, group, cat, _, _, groups, peer, tag, keys = item
        else:
            typ, flops, mem, matmul, coll, cbytes, group, cat, groups, peer, tag, keys = (
                item.type, item.flops, item.mem_bytes, item.matmul, item.coll, item.comm_bytes, item.group,
                item.category, item.groups, item.peer, item.tag, item.keys)
        prog.types.append(typ)
        prog.deps.append(deps[j])
        if typ == COMP:
            prog.duration[i] = compute.row_duration_s(durations, flops, mem, matmul, cat, groups, keys)
            prog.streams.append("compute")
        elif typ in (SEND, RECV):
            # the attention exchange's ring: this agent stands for its cp neighbours too
            prog.kind[i] = group
            prog.nbytes[i] = cbytes
            prog.tag[i] = tag
            prog.peer[i] = 0
            prog.peer_rank[i] = w.peer(rank, peer, group)
            prog.streams.append(network.stream(typ, group))
        else:
            prog.kind[i] = group
            prog.coll[i] = coll.value
            prog.nbytes[i] = cbytes
            prog.group[i] = (group, w.group_id(rank, group)) if spans_stages(group) else (group, role.stage)
            prog.members[i] = members[group]
            prog.streams.append(network.stream(typ, group))
    return prog


def _members(w: Workload, rank: int) -> dict[str, tuple[int, ...]]:
    return {k: tuple(w.group_members(rank, k)) for k in w.group_kinds}


def _window_breakdown(prog: AgentProgram, rep: Replay, lo: float, hi: float, waiting: str) -> dict[str, float]:
    return charge(intervals(prog.types, prog.kind, rep.start[0], rep.end[0]), lo, hi, waiting)


def simulate_fast(w: Workload, network: NetworkModel, compute: ComputeModel
                  ) -> tuple[list[float], list[dict[str, float]]]:
    """(finish time, breakdown) of each pipeline stage's representative rank."""
    roles = [w.role(s) for s in range(w.parallel.pp)]
    # SM sharing: every pass before the step's tail timed alone, as without it, the tail node
    # by node with the step end, whose gradient reductions take SMs from the last backward
    # passes (:mod:`.fast_tail`); the node-level replay where that would not be exact
    share = comm_sms(network, compute.gpu) if compute.comm_sm_sharing else None
    tail = TailState(roles) if share is not None else None
    if tail is not None:
        try:
            return _simulate_fast(w, network, compute, share, tail)
        except NotAlone:
            return exact(w, network, compute, share, _program)
    return _simulate_fast(w, network, compute, None, None)


def _simulate_fast(w: Workload, network: NetworkModel, compute: ComputeModel, share: CommSMs | None,
                   tail: TailState | None) -> tuple[list[float], list[dict[str, float]]]:
    pp = w.parallel.pp
    roles = [w.role(s) for s in range(pp)]
    reps = [w.mesh.rank(pp=s) for s in range(pp)]
    waiting = "pipeline_bubble" if pp > 1 else "idle"
    durations: dict = {}
    single = lambda r: 0  # noqa: E731 (every member rank maps to the one simulated agent)
    tails = tail.tails if tail is not None else [len(r.passes) for r in roles]

    def run_one(prog: AgentProgram) -> Replay:
        parts: dict[Hashable, int] = {g: 1 for g in prog.group if g is not None}
        return replay([prog], network, parts, single, share)

    stage_members = [_members(w, r) for r in reps]
    # runs kept from earlier simulations (a search's; exact reuse, :mod:`.run_cache`)
    kept = active() if share is None else None
    env = environment(network, compute) if kept is not None else None
    if env is None:
        kept = None
    # Where each stage's groups lie, as far as the network's costs tell: stages placed alike
    # (every stage, when pp is the outermost axis) time a block of the same kind alike, so
    # it is simulated once for all of them (bitwise the same run). A network that cannot
    # tell, and a block with point-to-point messages (their cost depends on the peer), keep
    # a run per stage.
    placement_key = getattr(network, "placement_key", None)
    placed_as = [tuple((k, placement_key(m)) for k, m in sorted(stage_members[s].items())) if placement_key else s
                 for s in range(pp)]

    # 1. every pass template once, standalone (a template of blocks that follow each other:
    #    each kind of block once)
    template_runs: dict[tuple[int, tuple], _PassRun] = {}
    block_runs: dict[tuple, _PassRun] = {}
    segment_runs: list = []          # per stage: (template, segment index) -> the block's run
    for s, role in enumerate(roles):

        def standalone(rows: list[tuple], exits: list[int], sinks: list[int], _s=s, _role=role) -> _PassRun:
            key = None
            if kept is not None:
                key = run_key(env, rows_content(rows), network, w.peer, reps[_s], stage_members[_s], waiting,
                              tuple(exits), tuple(sinks))
                run = kept.get(key)
                if run is not None:
                    return run
            prog = _program(f"stage{_s}", reps[_s], rows, [[d for d in r[2] if d >= 0] for r in rows], w, _role,
                            compute, network, durations, members=stage_members[_s])
            rep = run_one(prog)
            end = rep.end[0]
            done = max((end[i] for i in sinks), default=max(end, default=0.0))
            spans = list(intervals(prog.types, prog.kind, rep.start[0], end))
            run = _PassRun(rep.start[0], end, max((end[e] for e in exits), default=0.0), done,
                           charge(spans, 0.0, done, waiting), _stream_use(prog, rep), spans)
            if key is not None:
                kept.put(key, run)
            return run

        def segment_run(t, k: int, _standalone=standalone, _s=s) -> _PassRun:  # noqa: ANN001
            return _segment_run(t, k, _standalone, block_runs, placed_as[_s], _s)

        segment_runs.append(segment_run)
        for key, t in role.templates.items():
            run = _composed(t, segment_run) if t.segments else None
            template_runs[(s, key)] = run or standalone(t.rows, t.exits, t.sinks)

    # 2. the pipeline, pass by pass
    t0s: list[list[float]] = [[0.0] * len(r.passes) for r in roles]
    runs: list[list[_PassRun]] = [[None] * len(r.passes) for r in roles]  # type: ignore[list-item]
    totals = [dict.fromkeys(BREAKDOWN_KEYS, 0.0) for _ in roles]
    arrivals: dict[tuple[int, int, int], float] = {}
    send_free = [0.0] * pp
    sinks_done = [0.0] * pp
    # when each communication stream of each stage is free again: a pass that would use a
    # stream still busy with the previous pass's tail (ZeRO-3's gradient reduce-scatter before
    # the next gathers) starts late enough that its first use finds it free
    stream_free: list[dict[str, float]] = [dict() for _ in range(pp)]
    nxt = [0] * pp
    prologue = [[i for i in range(r.passes[0].base) if r.node(i).type == COLL] if r.passes else [] for r in roles]
    gather_runs: dict[int, tuple[dict[int, float], list, set] | None] = {}
    remaining = sum(len(r.passes) for r in roles)
    charged: dict[int, tuple[tuple[str, float], ...]] = {}    # a run's non-zero breakdown entries
    while remaining:
        progressed = False
        for s, role in enumerate(roles):
            passes, total, free = role.passes, totals[s], stream_free[s]
            while nxt[s] < len(passes):
                k = nxt[s]
                pl = passes[k]
                ready = sinks_done[s]
                if pl.recv >= 0:
                    rv = role.node(pl.recv)
                    key = ((s + rv.peer) % pp, s, rv.tag)
                    if key not in arrivals:
                        break
                    arrival = arrivals.pop(key)
                    ready = max(ready, arrival)
                    if tail is not None:
                        tail.received(s, k, key, arrival, pl.recv)
                if tail is not None and k == tails[s]:
                    tail.begin_tail(s, sinks_done[s], send_free[s], free)
                t = role.templates[pl.template]
                if pl.param_deps and prologue[s]:
                    if s not in gather_runs:
                        gather_runs[s] = _gathers_alone(w, role, s, reps[s], prologue[s], compute, network,
                                                        durations, run_one, stage_members[s])
                        if tail is not None:
                            tail.gathers_end[s] = gather_runs[s][0]
                    # (with SM sharing the gathers slow the blocks they overlap: replayed together)
                    run = None if share is not None else _first_forward_composed(
                        role, pl, t, ready, gather_runs[s], segment_runs[s], waiting, since=sinks_done[s])
                    if run is None:
                        run = _first_forward(w, role, s, reps[s], pl, t, ready, prologue[s], compute, network,
                                             durations, run_one, waiting, since=sinks_done[s], kept=kept, env=env)
                    t0 = 0.0     # this run's times are absolute
                    if tail is not None and k < tails[s]:
                        tail.check_start(s, k, ready, free, with_gathers=True)
                else:
                    run = template_runs[(s, pl.template)]
                    t0 = ready
                    for st, (first, _) in (run.streams or {}).items():
                        t0 = max(t0, free.get(st, 0.0) - first)
                    if tail is not None and k < tails[s] and tail.gathering(s, t0):
                        # the step-start gathers still run (and take SMs): replayed with them
                        tail.check_start(s, k, t0, free, with_gathers=True)
                        run = _first_forward(w, role, s, reps[s], pl, t, t0, prologue[s], compute, network,
                                             durations, run_one, waiting, since=sinks_done[s])
                        t0 = 0.0
                    else:
                        if k < tails[s]:
                            total[waiting] += t0 - sinks_done[s]
                        if tail is not None and k < tails[s]:
                            tail.check_start(s, k, t0, free, with_gathers=False)
                if k < tails[s]:             # (a tail pass is charged by the tail's replay)
                    entries = charged.get(id(run))
                    if entries is None:          # (adding the zeros would change nothing)
                        entries = charged[id(run)] = tuple((c, v) for c, v in run.breakdown.items() if v)
                    for c, v in entries:
                        total[c] += v
                t0s[s][k] = t0
                runs[s][k] = run
                for st, (_, last) in (run.streams or {}).items():
                    free[st] = max(free.get(st, 0.0), t0 + last)
                exit_t = t0 + run.exit
                sinks_done[s] = t0 + run.sinks
                if pl.send >= 0:
                    sd = role.node(pl.send)
                    dst = (s + sd.peer) % pp
                    busy, delay = network.p2p(reps[s], reps[dst], sd.comm_bytes)
                    start = max(exit_t, send_free[s])
                    send_free[s] = start + busy
                    arrivals[(s, dst, sd.tag)] = start + delay
                    if tail is not None:
                        tail.sent[(s, dst, sd.tag)] = (start + delay, k)
                        tail.node_end[s][pl.send] = start + busy
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise DeadlockError("pipeline passes wait on receives that never arrive")
    if tail is not None:
        for s, role in enumerate(roles):
            if tails[s] == len(role.passes):         # (the step end waits on no pass node)
                tail.begin_tail(s, sinks_done[s], send_free[s], stream_free[s])
        return tail_replay(w, network, compute, share, tail, reps, stage_members, durations, t0s, runs, totals,
                           waiting, _program)

    # 3. the step end, every stage together (tied embeddings couple the first and last stage)
    programs = []
    participants: dict[Hashable, int] = {}
    for s, role in enumerate(roles):
        bases = [pl.base for pl in role.passes] + [role.step_end_start]

        def latest_end(ids: list[int], _s=s, _bases=bases) -> float:
            """When the last of the pass nodes ``ids`` ends (absolute; 0 for none): a node of a
            pass at its template's time, a pipeline send or receive between passes once the
            pass before is done, a step-start node (parameter gather) long done. The pass of
            consecutive ids is looked up once."""
            best, lo, hi = 0.0, 0, -1
            t0 = 0.0
            rel_end: list[float] = []
            for d in ids:
                if not lo <= d < hi:
                    k = bisect.bisect_right(_bases, d) - 1
                    if k < 0:
                        lo, hi, rel_end = 0, _bases[0], []
                        t0 = 0.0
                        continue
                    lo, hi = _bases[k], _bases[k + 1]
                    t0, rel_end = t0s[_s][k], runs[_s][k].end
                elif not rel_end and hi == _bases[0]:
                    continue        # another step-start node
                rel = d - lo
                v = t0 + rel_end[rel] if rel < len(rel_end) else sinks_done[_s]
                if v > best:
                    best = v
            return best

        tail = [role.node(i) for i in range(role.step_end_start, role.num_nodes)]
        waits, deps = [], []
        for j, n in enumerate(tail):
            waits.append(latest_end([d for d in n.deps if d < role.step_end_start]))
            deps.append([j] + [len(tail) + d - role.step_end_start for d in n.deps if d >= role.step_end_start])
        prog = _program(f"stage{s}", reps[s], tail, deps, w, role, compute, network, durations, waits=waits,
                        members=stage_members[s])
        programs.append(prog)
        for g, members in zip(prog.group, prog.members):
            if g is not None:   # one agent per stage among the group's members
                participants[g] = len({w.role_of(r) for r in members}) if spans_stages(g[0]) else 1
    rep = replay(programs, network, participants, w.role_of)
    finishes = []
    for s in range(pp):
        last = max(sinks_done[s], send_free[s])
        fin = max(last, max(rep.end[s][roles[s].num_nodes - roles[s].step_end_start:], default=0.0))
        # the step-end tail, charged like everything else
        one = Replay([rep.start[s]], [rep.end[s]], [fin])
        tail_bd = _window_breakdown(programs[s], one, sinks_done[s], fin, "idle")
        for c, v in tail_bd.items():
            totals[s][c] += v
        finishes.append(fin)
    step = max(finishes)
    for s in range(pp):
        totals[s][waiting] += step - finishes[s]    # charged over the whole step, as the full replay does
    return finishes, totals


def _segment_run(t, k: int, standalone, block_runs: dict[tuple, _PassRun], placed_as: Hashable,  # noqa: ANN001
                 stage: int) -> _PassRun:
    """The standalone run of segment ``k`` of template ``t``, its ids relative to the block.
    ``block_runs`` is shared by the stages: a run is keyed by where the stage's groups lie
    (``placed_as``), or by the ``stage`` for a block with point-to-point messages."""
    segments = t.segments
    kind, lo, hi, _, src = segments[k]
    # what the rest waits on: the next block's entry, or (the last block) the pass's exits
    # and sinks
    if k + 1 < len(segments):
        exits = sinks = tuple(sorted(d - lo for d in segments[k + 1][3] if lo <= d < hi))
    else:
        exits = tuple(e - lo for e in t.exits if lo <= e < hi)
        sinks = tuple(i - lo for i in t.sinks if lo <= i < hi)
    first_row, block = src             # the generated block of this kind (ids from first_row)
    p2p = block_runs.get(("p2p", kind))
    if p2p is None:
        p2p = block_runs[("p2p", kind)] = any(r[1] in (SEND, RECV) for r in block)
    key = (kind, exits, sinks, stage if p2p else placed_as)
    run = block_runs.get(key)
    if run is None:
        # its ids made relative (outside ones dropped)
        rows = [(*r[:2], tuple(d - first_row for d in r[2] if d >= first_row), *r[3:]) for r in block]
        run = block_runs[key] = standalone(rows, list(exits), list(sinks))
    return run


def _merge_streams(streams: dict[str, tuple[float, float]], run: _PassRun, offset: float) -> None:
    for st, (first, last) in (run.streams or {}).items():
        lo_t, hi_t = streams.get(st, (float("inf"), float("-inf")))
        streams[st] = (min(lo_t, first + offset), max(hi_t, last + offset))


def _composed(t, segment_run) -> _PassRun | None:  # noqa: ANN001
    """A pass template's run from one standalone run per kind of block (``t.segments``): each
    block starts when the exits of the one before are done. Exact when nothing of a block
    outlives the exits the next one waits for (every stream is then idle when it starts);
    None where that fails (the whole template is replayed instead)."""
    n = t.num_rows
    start = [0.0] * n
    end = [0.0] * n
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    streams: dict[str, tuple[float, float]] = {}
    busy_until = 0.0
    for k, (_kind, lo, hi, entry, _src) in enumerate(t.segments):
        offset = max((end[d] for d in entry if d >= 0), default=0.0)
        if busy_until > offset + 1e-12:
            return None
        run = segment_run(t, k)
        start[lo:hi] = [x + offset for x in run.start]
        end[lo:hi] = [x + offset for x in run.end]
        busy_until = max(end[lo:hi], default=offset)
        for c, v in run.breakdown.items():
            breakdown[c] += v
        _merge_streams(streams, run, offset)
    total = max(end, default=0.0)
    exit_t = max((end[e] for e in t.exits), default=0.0)
    sinks = max((end[i] for i in t.sinks), default=total)
    if total > sinks + 1e-12:
        return None
    return _PassRun(start, end, exit_t, sinks, breakdown, streams)


def _gathers_alone(w: Workload, role: RoleGraph, s: int, rank: int, prologue: list[int], compute: ComputeModel,
                   network: NetworkModel, durations: dict, run_one, members: dict  # noqa: ANN001
                   ) -> tuple[dict[int, float], list, set]:
    """The step-start parameter gathers of a stage from time 0, on their own: (end by node
    id, their spans, the streams they use)."""
    gathers = [role.node(i) for i in prologue]
    prog = _program(f"stage{s}", rank, gathers, [[] for _ in gathers], w, role, compute, network, durations,
                    members=members)
    rep = run_one(prog)
    return ({nid: rep.end[0][j] for j, nid in enumerate(prologue)},
            list(intervals(prog.types, prog.kind, rep.start[0], rep.end[0])),
            {st for st in prog.streams if st is not None})


def _first_forward_composed(role: RoleGraph, pl, t, ready: float, gathers, segment_run,  # noqa: ANN001
                            waiting: str, since: float) -> _PassRun | None:
    """:func:`_first_forward` from the blocks' standalone runs: the parameter gathers use
    streams of their own, so they run as they do alone, and each block starts when what it
    waits for outside itself (the block before, its gathers, the pass's input at ``ready``)
    is done. Exact where every block's first kernels wait for that same time and nothing of a
    block outlives the start of the next; None otherwise (and where a block shares a stream
    with the gathers): the pass is replayed with the gathers instead."""
    if not t.segments:
        return None
    gather_end, gather_spans, gather_streams = gathers
    base, n = pl.base, t.num_rows
    start = [0.0] * n
    end = [0.0] * n
    spans = list(gather_spans)
    streams: dict[str, tuple[float, float]] = {}
    busy_until = 0.0
    for k, (_kind, lo, hi, _entry, _src) in enumerate(t.segments):
        run = segment_run(t, k)
        if gather_streams & set(run.streams or ()):
            return None
        # when the block's nodes could start for what they wait on outside the block
        outside: list[tuple[bool, float]] = []      # (a first node of the block, that time)
        for i in range(lo, hi):
            node = role.node(base + i)
            first, at = True, 0.0
            for d in node.deps:
                if base + lo <= d < base + hi:
                    first = False
                elif base <= d < base + lo:
                    at = max(at, end[d - base])
                else:
                    at = max(at, gather_end.get(d, ready))   # a gather, or the input / previous pass
            if node.ctrl:
                at = max(at, ready)
            outside.append((first, at))
        offset = max(at for _, at in outside)
        if busy_until > offset + 1e-12 or any(first and at < offset - 1e-12 for first, at in outside):
            return None
        start[lo:hi] = [x + offset for x in run.start]
        end[lo:hi] = [x + offset for x in run.end]
        busy_until = max(end[lo:hi], default=offset)
        spans += [(a + offset, b + offset, c) for a, b, c in run.spans or ()]
        _merge_streams(streams, run, offset)
    total = max(end, default=ready)
    exit_t = max((end[e] for e in t.exits), default=ready)
    sinks = max((end[i] for i in t.sinks), default=total)
    if total > sinks + 1e-12:
        return None
    return _PassRun(start, end, exit_t, sinks, charge(spans, since, sinks, waiting), streams)


def _first_forward(w: Workload, role: RoleGraph, s: int, rank: int, pl, t, ready: float, prologue: list[int],  # noqa: ANN001
                   compute: ComputeModel, network: NetworkModel, durations: dict, run_one,  # noqa: ANN001
                   waiting: str, since: float, kept: RunCache | None = None, env: Hashable = None) -> _PassRun:
    """The first forward of a chunk with the step-start parameter gathers running alongside:
    absolute times from 0 (WAIT node 0 holds the pass back until ``ready``); ``kept``: runs
    kept from earlier simulations (``env``: their environment, :mod:`.run_cache`)."""
    gathers = [role.node(i) for i in prologue]
    npro = len(gathers)
    rows = t.rows
    deps: list[list[int]] = [[] for _ in gathers]
    node_ids = list(range(pl.base, pl.base + len(rows)))
    gather_pos = {nid: 1 + j for j, nid in enumerate(prologue)}  # +1: WAIT node first
    for _j, nid in enumerate(node_ids):
        node = role.node(nid)
        ds = []
        for d in node.deps + node.ctrl:
            if pl.base <= d < pl.base + len(rows):
                ds.append(1 + npro + d - pl.base)
            elif d in gather_pos:
                ds.append(gather_pos[d])
            else:
                ds.append(0)  # the receive or the previous pass: both done by ``ready``
        deps.append(sorted(set(ds)))
    items = gathers + [role.node(i) for i in node_ids]
    key = None
    if kept is not None:
        members = _members(w, rank)
        key = run_key(env, nodes_content(items), network, w.peer, rank, members, waiting, "first", ready, since,
                      tuple(map(tuple, deps)), tuple(t.exits), tuple(t.sinks))
        run = kept.get(key)
        if run is not None:
            return run
    # dependencies are numbered in the whole program: the WAIT node 0, the gathers, the pass
    prog = _program(f"stage{s}", rank, items, deps, w, role, compute, network, durations, waits=[ready])
    rep = run_one(prog)
    end = rep.end[0][1 + npro:]
    start = rep.start[0][1 + npro:]
    exit_t = max((end[e] for e in t.exits), default=ready)
    sinks = max((end[i] for i in t.sinks), default=max(end, default=ready))
    bd = _window_breakdown(prog, rep, since, sinks, waiting)
    run = _PassRun(start, end, exit_t, sinks, bd, _stream_use(prog, rep, skip=1 + npro))
    if key is not None:
        kept.put(key, run)
    return run
