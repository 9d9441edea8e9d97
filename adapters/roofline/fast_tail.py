"""The fast path with SM sharing: the step's tail replayed node by node.

With SM sharing (:mod:`.comm_sms`) a compute kernel slows down while a collective runs on its
rank, so a pass timed on its own is exact only if no collective from outside the pass runs
beside it. Inside a pass the template replay sees its own collectives; what it cannot see are
the step end's gradient reductions, which start during the last backward passes, and the
step-start parameter gathers, which run on into the passes after the first forward. So:

1. the passes before the *tail* — the first pass holding a node the step end waits on — are
   timed as the fast path times them (each pass alone, then pass by pass), except that a pass
   starting while a parameter gather still runs is replayed with the gathers, as the first
   forward is;
2. the tail (its passes' nodes, their pipeline messages, and the step end) is replayed node by
   node, every stage together, from the absolute times the passes before it left: a node's
   dependency before the tail becomes a WAIT node that ends when that node did, a message
   sent before the tail a WAIT that ends at its arrival.

This equals the node-level replay when nothing outside a replayed unit overlaps it: no
collective of an earlier pass (or the step-start parameter gathers) still running when a pass
starts, no message from a tail pass to an earlier pass of another stage, no kernel of the tail
starting before the passes before the tail are done. Where one fails, :class:`NotAlone` is
raised and the step is replayed node by node (:func:`exact`).
"""

from __future__ import annotations

import bisect
from typing import Hashable

from stage_cosim.adapters.roofline.breakdown import charge, intervals
from stage_cosim.adapters.roofline.engine import WAIT, replay
from stage_cosim.parallel.axes import spans_stages
from stage_cosim.result import BREAKDOWN_KEYS
from stage_cosim.schedule.nodes import COLL, COMP, PP_GROUP, RECV, SEND, RoleGraph

EPS = 1e-12


class NotAlone(Exception):
    """Something outside a pass's own replay overlaps it: the fast path would not be exact."""


def tail_start(role: RoleGraph) -> int:
    """The first pass holding a node (not a pipeline message) that the step end waits on
    (the number of passes where there is none)."""
    passes = role.passes
    if not passes:
        return 0
    bases = [pl.base for pl in passes]
    k_min = len(passes)
    for i in range(role.step_end_start, role.num_nodes):
        n = role.node(i)
        for d in n.deps + n.ctrl:
            if bases[0] <= d < role.step_end_start:
                k = bisect.bisect_right(bases, d) - 1
                if d < bases[k] + role.templates[passes[k].template].num_rows:
                    k_min = min(k_min, k)
    return k_min


class TailState:
    """What the pass-by-pass replay leaves for the tail: per stage, where its tail starts,
    the absolute ends of the pipeline messages before it, when each message arrives and which
    pass sent it, and the stage's state when its tail begins."""

    def __init__(self, roles: list[RoleGraph]) -> None:
        pp = len(roles)
        self.roles = roles
        self.tails = [tail_start(r) for r in roles]
        self.node_end: list[dict[int, float]] = [dict() for _ in range(pp)]
        self.sent: dict[tuple[int, int, int], tuple[float, int]] = {}    # (src, dst, tag) -> arrival, pass
        self.pre_sinks = [0.0] * pp
        self.pre_send_free = [0.0] * pp
        self.gathers_end: list[dict[int, float]] = [dict() for _ in range(pp)]

    def gathering(self, s: int, start: float) -> bool:
        """Whether a step-start parameter gather of stage ``s`` still runs at ``start``."""
        return max(self.gathers_end[s].values(), default=0.0) > start + EPS

    def check_start(self, s: int, k: int, start: float, free: dict[str, float], with_gathers: bool) -> None:
        """Pass ``k`` of stage ``s`` (before its tail) starts at ``start``: no collective of an
        earlier pass, nor (unless the pass is replayed with them) a parameter gather, may still
        run then."""
        late = max(free.values(), default=0.0)
        if not with_gathers:
            late = max(late, max(self.gathers_end[s].values(), default=0.0))
        if late > start + EPS:
            raise NotAlone(f"stage {s} pass {k}: a collective from before it runs beside it "
                           f"({', '.join(st for st, v in free.items() if v > start + EPS) or 'a parameter gather'})")

    def received(self, s: int, k: int, key: tuple[int, int, int], arrival: float, recv: int) -> None:
        if k < self.tails[s] and self.sent[key][1] >= self.tails[key[0]]:
            raise NotAlone(f"stage {s} pass {k} receives from a tail pass of stage {key[0]}")
        self.node_end[s][recv] = arrival

    def begin_tail(self, s: int, sinks_done: float, send_free: float, free: dict[str, float]) -> None:
        self.pre_sinks[s], self.pre_send_free[s] = sinks_done, send_free
        if self.tails[s] > 0:
            self.check_start(s, self.tails[s], sinks_done, free, with_gathers=False)


def tail_replay(w, network, compute, share, st: TailState, reps: list[int], members: list[dict],  # noqa: ANN001
                durations: dict, t0s: list[list[float]], runs: list, totals: list[dict[str, float]],
                waiting: str, program) -> tuple[list[float], list[dict[str, float]]]:  # noqa: ANN001
    """The tails of every stage, node by node, after the passes before them (see the module);
    ``program``: the fast path's agent program of a list of nodes (``fast._program``)."""
    pp = len(st.roles)
    programs, los = [], []
    participants: dict[Hashable, int] = {}
    recv_pass = []                      # per stage: (source stage, tag) -> the receiving pass
    for s, role in enumerate(st.roles):
        got = {}
        for k, pl in enumerate(role.passes):
            if pl.recv >= 0:
                rv = role.node(pl.recv)
                got[((s + rv.peer) % pp, rv.tag)] = k
        recv_pass.append(got)
    for s, role in enumerate(st.roles):
        passes, k0 = role.passes, st.tails[s]
        if k0 == 0:
            lo = 0
        elif k0 < len(passes):
            lo = passes[k0].base if passes[k0].recv < 0 else min(passes[k0].base, passes[k0].recv)
        else:
            lo = role.step_end_start
        bases = [pl.base for pl in passes]

        def end_of(d: int, _s=s, _role=role, _bases=bases) -> float:
            if d in st.node_end[_s]:
                return st.node_end[_s][d]
            if not _bases or d < _bases[0]:
                return st.gathers_end[_s].get(d, 0.0)     # a step-start gather
            k = bisect.bisect_right(_bases, d) - 1
            if d - _bases[k] >= len(runs[_s][k].end):
                raise NotAlone(f"stage {_s}: the tail waits on a message between passes whose end is not known")
            return t0s[_s][k] + runs[_s][k].end[d - _bases[k]]

        items = [role.node(i) for i in range(lo, role.num_nodes)]
        n = len(items)
        waits, deps, converted = [], [], {}
        for j, node in enumerate(items):
            at = max((end_of(d) for d in node.deps + node.ctrl if d < lo), default=0.0)
            if node.type == SEND and node.group == PP_GROUP:
                at = max(at, st.pre_send_free[s])
                dst = (s + node.peer) % pp
                if recv_pass[dst].get((s, node.tag), len(st.roles[dst].passes)) < st.tails[dst]:
                    raise NotAlone(f"stage {s} sends to a pass before stage {dst}'s tail")
            elif node.type == RECV and node.group == PP_GROUP:
                src = (s + node.peer) % pp
                sent = st.sent.get((src, s, node.tag))
                if sent is not None and sent[1] < st.tails[src]:
                    at, converted[j] = max(at, sent[0]), True      # it arrived from before the tail
            waits.append(at)
            deps.append([j] + [n + d - lo for d in node.deps + node.ctrl if d >= lo])
        prog = program(f"stage{s}", reps[s], items, deps, w, role, compute, network, durations, waits=waits,
                        members=members[s])
        for j, node in enumerate(items):
            i = n + j
            if j in converted:
                prog.types[i], prog.streams[i] = WAIT, None
            elif node.type in (SEND, RECV):
                if node.group == PP_GROUP:
                    prog.peer[i] = (s + node.peer) % pp
                    prog.peer_rank[i] = reps[prog.peer[i]]
                else:
                    prog.peer[i] = s            # the attention ring: the agent stands for its neighbours
        programs.append(prog)
        los.append(lo)
        for g, m in zip(prog.group, prog.members):
            if g is not None:
                participants[g] = len({w.role_of(r) for r in m}) if spans_stages(g[0]) else 1
    rep = replay(programs, network, participants, w.role_of, share)
    finishes, out = [], []
    for s, prog in enumerate(programs):
        if st.tails[s] > 0:
            first = min((rep.start[s][i] for i, t in enumerate(prog.types) if t in (COLL, COMP)), default=float("inf"))
            if first < st.pre_sinks[s] - EPS:
                raise NotAlone(f"stage {s}: a node of the tail starts before the passes before the tail end")
        fin = max(max(rep.end[s], default=0.0), st.pre_send_free[s], st.pre_sinks[s])
        bd = dict(totals[s])
        for c, v in charge(intervals(prog.types, prog.kind, rep.start[s], rep.end[s]), st.pre_sinks[s], fin,
                           waiting).items():
            bd[c] += v
        finishes.append(fin)
        out.append(bd)
    step = max(finishes)
    for s in range(pp):
        out[s][waiting] += step - finishes[s]
    return finishes, out


def exact(w, network, compute, share, program) -> tuple[list[float], list[dict[str, float]]]:  # noqa: ANN001
    """Every node of one rank per stage replayed (the node-level replay), with SM sharing: the
    tail replay with every stage's tail from its first node."""
    pp = w.parallel.pp
    st = TailState([w.role(s) for s in range(pp)])
    st.tails = [0] * pp
    reps = [w.mesh.rank(pp=s) for s in range(pp)]
    members = [{k: tuple(w.group_members(r, k)) for k in w.group_kinds} for r in reps]
    return tail_replay(w, network, compute, share, st, reps, members, {}, [[] for _ in range(pp)],
                       [[] for _ in range(pp)], [dict.fromkeys(BREAKDOWN_KEYS, 0.0) for _ in range(pp)],
                       "pipeline_bubble" if pp > 1 else "idle", program)
