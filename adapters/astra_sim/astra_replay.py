"""ASTRA-sim's workload layer, exactly and fast: replay rank programs in integer nanoseconds.

The rules are §7 of the cost model (``astra_system`` and the modules it names): at time 0 and whenever a node completes, a
rank issues its dependency-free nodes in id order, each when the resource it needs is free —
one compute slot, one communication slot shared by collectives and sends; a receive needs
none. A send ends at issue + D, a receive at max(posted, arrival); a collective couples the
ranks of its group and ends on each when :class:`CollectiveModel` says.

Two things make it fast enough to stand in for the simulator on real exports:

* **symmetry** — ranks whose traces are equal up to their groups and peers (every rank of a
  pipeline stage) behave identically when their groups have the same shape on the network and
  their peers are as far away. One rank per class is simulated; the others are checked to be
  such copies before (groups' shapes, peers' distances) and while replaying (every member of a
  collective that a simulated rank stands for must finish when that rank does). Where the
  check fails, every rank is replayed. The classes and the check before are the simulator's
  own (:mod:`stage_cosim.adapters.roofline.classes`), shared with its trace-set replay.
* **no per-event objects** — programs are columns of ints; events are tuples on one heap;
  collectives are memoised by shape.

A replay that cannot finish is a deadlock under ASTRA-sim's rules: :class:`Deadlock` says
which ranks hold their communication slot waiting for whom.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, Sequence

from stage_cosim.adapters.astra_sim.astra_collectives import CollectiveModel
from stage_cosim.adapters.astra_sim.astra_network import Network
from stage_cosim.adapters.astra_sim.astra_system import BROADCAST_CODE, COLLECTIVE_BY_CODE, AstraSystem
from stage_cosim.adapters.astra_sim.astra_workload import AstraRunResult, roofline_ns
from stage_cosim.adapters.roofline.classes import ALL, K_COLL, K_COMP, K_RECV, K_SEND, replay_ns, target_of
from stage_cosim.errors import UserError
from stage_cosim.hardware.network import NetworkDim
from stage_cosim.trace.traceset import COLL, COMP, RECV, SEND, NodeTable

K_TIMED = 4        # a broadcast (its duration, comm slot)
_KIND = {COMP: K_COMP, COLL: K_COLL, SEND: K_SEND, RECV: K_RECV}


class Deadlock(Exception):
    """Some nodes can never run: ``stuck`` names, per rank, what it waits for."""

    def __init__(self, stuck: list[str], ranks: list[int]) -> None:
        super().__init__("; ".join(stuck))
        self.stuck = stuck
        self.ranks = ranks


class _Asymmetric(Exception):
    """A rank does not behave like the rank that stands for it: replay every rank."""


# -- programs -------------------------------------------------------------------------------

@dataclass
class Program:
    """What every rank of a class runs, in node-id order, as columns."""

    ids: list[int]
    kind: list[int]
    dur: list[int]                       # compute: ns
    children: list[list[int]]
    indeg: list[int]
    coll: list[str | None]
    size: list[int]
    tag: list[int]
    involved: list[tuple[bool, ...] | None]
    hole_index: list[int]                # program position of each hole of the class
    names: list[str]
    categories: list[str] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @cached_property
    def breakdown_categories(self) -> list[str | None]:
        """Where each node's time is charged in a breakdown (None: a receive, which waits)."""
        from stage_cosim.adapters.roofline.breakdown import span_category

        cats = self.categories or [""] * len(self.ids)
        return [span_category(k, c) for k, c in zip(self.kind, cats)]


def durations_ns(table: NodeTable, system: AstraSystem) -> list[int]:
    """Each compute node's time as the simulator takes it (file order; 0 for other nodes)."""
    out = [0] * len(table)
    roofline = system.roofline_enabled
    for i, t in enumerate(table.types):
        if t != COMP:
            if t == COLL and table.int_attr(i, "comm_type") == BROADCAST_CODE:
                out[i] = replay_ns(table.duration_micros[i])
            continue
        a = table.attrs[i]
        cpu = a.get("is_cpu_op", (None, False))[1] is True
        if roofline and not cpu:
            out[i] = roofline_ns(table.int_attr(i, "num_ops", 0) or 0, table.int_attr(i, "tensor_size", 0) or 0,
                                 system, table.ids[i])
        else:
            out[i] = replay_ns(table.duration_micros[i])
    return out


def program_of(table: NodeTable, dur: Sequence[int]) -> Program:
    """A class's nodes in id order (dependencies on absent ids are the validator's to report)."""
    n = len(table)
    order = sorted(range(n), key=table.ids.__getitem__)
    pos = {table.ids[i]: k for k, i in enumerate(order)}
    children: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    kind, coll, size, tag, involved, names, durs = [], [], [], [], [], [], []
    for k, i in enumerate(order):
        deps = table.data_deps[i]
        ctrl = table.ctrl_deps[i]
        ds = {pos[d] for d in (deps + ctrl if ctrl else deps) if d in pos}
        indeg[k] = len(ds)
        for d in ds:
            children[d].append(k)
        t = table.types[i]
        kd = _KIND.get(t)
        if kd is None:
            raise UserError("traces", f"node {table.ids[i]}: node type {t} is not simulated")
        a = table.attrs[i]
        ctype = a.get("comm_type")
        if kd == K_COLL and ctype is not None and ctype[1] == BROADCAST_CODE:
            kd = K_TIMED
        kind.append(kd)
        durs.append(dur[i])
        coll.append(COLLECTIVE_BY_CODE.get(ctype[1]) if ctype is not None and kd == K_COLL else None)  # type: ignore[arg-type]
        size.append(table.int_attr(i, "comm_size", 0) or 0)
        tag.append(table.int_attr(i, "comm_tag", 0) or 0)
        inv = a.get("involved_dim")
        involved.append(tuple(bool(x) for x in inv[1]) if inv is not None and isinstance(inv[1], list) else None)  # type: ignore[union-attr]
        names.append(table.names[i])
    for ch in children:
        ch.sort()
    hole_index = [pos[table.ids[i]] for i in table.holes]
    cats = [table.categories[i] for i in order] if table.categories else None
    return Program(ids=[table.ids[i] for i in order], kind=kind, dur=durs, children=children, indeg=indeg,
                   coll=coll, size=size, tag=tag, involved=involved, hole_index=hole_index, names=names,
                   categories=cats)


@dataclass
class Agent:
    """A simulated rank: its program and its own groups and peers (``target``)."""

    rank: int
    prog: Program
    target: list[object]


def make_agent(rank: int, prog: Program, values: Sequence[tuple[str, object] | None]) -> Agent:
    target: list[object] = [None] * len(prog)
    kind = prog.kind
    for k, v in zip(prog.hole_index, values):
        target[k] = target_of(v, kind[k])
    return Agent(rank, prog, target)


# -- the replay -------------------------------------------------------------------------------

@dataclass
class Outcome:
    """Per simulated rank (agent): when it finished, its compute time, its communication time
    (the union of its communication nodes' spans), and, when recorded, every node's span."""

    finish: list[int]
    gpu: list[int]
    comm: list[int]
    start: list[list[int]] | None = None
    end: list[list[int]] | None = None
    collectives_evaluated: int = 0


def replay(agents: Sequence[Agent], members_of: Callable[[object], Sequence[int]], agent_of_rank: Callable[[int], int],
           collectives: CollectiveModel, net: Network, *, check_symmetry: bool = False, record: bool = False,
           name_of: Callable[[int, int], str] | None = None) -> Outcome:
    """Run every agent to completion (see the module docstring). ``agent_of_rank(r)``: the agent
    that is (or stands for) rank ``r``."""
    n_agents = len(agents)
    BIG = 1 << 62
    KIND = [a.prog.kind for a in agents]
    DUR = [a.prog.dur for a in agents]
    CHILDREN = [a.prog.children for a in agents]
    indeg = [list(a.prog.indeg) for a in agents]
    start = [[-1] * len(a.prog) for a in agents]
    end = [[-1] * len(a.prog) for a in agents]
    left = [len(a.prog) for a in agents]
    comp_busy = [False] * n_agents
    comm_busy = [False] * n_agents
    ready_comp: list[list[int]] = [[] for _ in agents]
    ready_comm: list[list[int]] = [[] for _ in agents]
    events: list[tuple[int, int, int, int]] = []
    seq = 0
    groups: dict[object, _Group] = {}
    issued_on: list[dict[object, int]] = [defaultdict(int) for _ in agents]
    rendezvous: dict[tuple[object, int], list[tuple[int, int, int]]] = {}
    mailbox: dict[tuple[int, int, int], list[int]] = {}
    waiting_recv: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    agent_rank = [a.rank for a in agents]
    heappush, heappop = heapq.heappush, heapq.heappop

    def group(g: object) -> "_Group":
        found = groups.get(g)
        if found is None:
            found = groups[g] = _Group(g, members_of(g), agent_of_rank, agent_rank)
        return found

    def collective_done(gr: "_Group", arrived: list[tuple[int, int, int]]) -> None:
        nonlocal seq
        a0, i0, _ = arrived[0]
        prog = agents[a0].prog
        key = (prog.coll[i0], prog.size[i0], prog.involved[i0])
        run = gr.prepared.get(key)
        if run is None:
            run = gr.prepared[key] = collectives.prepared(prog.coll[i0] or "", prog.size[i0],
                                                          None if gr.id == ALL else gr.members, prog.involved[i0])
        issue_at = [0] * n_agents
        for a, _, t in arrived:
            issue_at[a] = t
        ends = run([issue_at[a] for a in gr.member_agents])
        if check_symmetry and gr.stood_for:
            for e, j in zip(ends, gr.rep_index):
                if e != ends[j]:
                    raise _Asymmetric
        pos = gr.position
        for a, i, _ in arrived:
            heappush(events, (ends[pos[agent_rank[a]]], seq, a, i))
            seq += 1

    def issue_comm(a: int, i: int, now: int) -> None:
        nonlocal seq
        ag = agents[a]
        prog = ag.prog
        start[a][i] = now
        k = prog.kind[i]
        if k == K_TIMED:
            heappush(events, (now + prog.dur[i], seq, a, i))
            seq += 1
            return
        if k == K_COLL:
            g = ag.target[i]
            n = issued_on[a][g]
            issued_on[a][g] = n + 1
            key = (g, n)
            arrived = rendezvous.get(key)
            if arrived is None:
                arrived = rendezvous[key] = []
            arrived.append((a, i, now))
            gr = group(g)
            if len(arrived) == gr.participants:
                del rendezvous[key]
                collective_done(gr, arrived)
            return
        dst = ag.target[i]
        d = net.delay(ag.rank, dst, prog.size[i])  # type: ignore[arg-type]
        heappush(events, (now + d, seq, a, i))
        seq += 1
        key = (a, agent_of_rank(dst), prog.tag[i])  # type: ignore[arg-type]
        arrival = now + d
        waiters = waiting_recv.get(key)
        if waiters:
            ra, ri, posted = waiters.pop(0)
            heappush(events, (max(posted, arrival), seq, ra, ri))
            seq += 1
        else:
            mailbox.setdefault(key, []).append(arrival)

    def issue_recv(a: int, i: int, now: int) -> None:
        nonlocal seq
        ag = agents[a]
        start[a][i] = now
        key = (agent_of_rank(ag.target[i]), a, ag.prog.tag[i])  # type: ignore[arg-type]
        box = mailbox.get(key)
        if box:
            heappush(events, (max(now, box.pop(0)), seq, a, i))
            seq += 1
        else:
            waiting_recv.setdefault(key, []).append((a, i, now))

    for a in range(n_agents):
        kind = KIND[a]
        for i, d in enumerate(indeg[a]):
            if d == 0:
                k = kind[i]
                if k == K_COMP:
                    ready_comp[a].append(i)
                elif k == K_RECV:
                    issue_recv(a, i, 0)
                else:
                    ready_comm[a].append(i)
        heappush(events, (0, seq, a, -1))     # the agent's first issue, in agent order
        seq += 1

    while events:
        now, _, a, i = heappop(events)
        rc, rm = ready_comp[a], ready_comm[a]
        if i >= 0:                            # node i has finished
            end[a][i] = now
            left[a] -= 1
            kind = KIND[a]
            k = kind[i]
            if k == K_COMP:
                comp_busy[a] = False
            elif k != K_RECV:
                comm_busy[a] = False
            deg = indeg[a]
            for c in CHILDREN[a][i]:
                deg[c] -= 1
                if deg[c] == 0:
                    kc = kind[c]
                    if kc == K_COMP:
                        heappush(rc, c)
                    elif kc == K_RECV:
                        issue_recv(a, c, now)
                    else:
                        heappush(rm, c)
        # issue ready nodes in id order while their slot is free
        while True:
            c = rc[0] if rc and not comp_busy[a] else BIG
            m = rm[0] if rm and not comm_busy[a] else BIG
            if c < m:
                heappop(rc)
                comp_busy[a] = True
                start[a][c] = now
                heappush(events, (now + DUR[a][c], seq, a, c))
                seq += 1
            elif m != BIG:
                heappop(rm)
                comm_busy[a] = True
                issue_comm(a, m, now)
            else:
                break

    if any(left):
        raise _deadlock(agents, start, end, rendezvous, waiting_recv, lambda g: group(g).members, agent_of_rank,
                        name_of)
    finish, gpu, comm = [], [], []
    for a, ag in enumerate(agents):
        prog = ag.prog
        finish.append(max(end[a], default=0))
        gpu.append(sum(d for d, k in zip(prog.dur, prog.kind) if k == K_COMP))
        spans = sorted((start[a][i], end[a][i]) for i, k in enumerate(prog.kind) if k != K_COMP)
        total, upto = 0, -1
        for s, e in spans:
            if e <= upto:
                continue
            total += e - max(s, upto)
            upto = e
        comm.append(total)
    return Outcome(finish, gpu, comm, start if record else None, end if record else None, collectives.evaluated)


class _Group:
    """A communicator group as the replay uses it: its members, the agent of each, how many
    agents take part, and (where agents stand for several members) which member each is checked
    against."""

    def __init__(self, g: object, members: Sequence[int], agent_of_rank: Callable[[int], int],
                 agent_rank: Sequence[int]) -> None:
        self.id = g
        self.members = tuple(members)
        self.member_agents = [agent_of_rank(m) for m in self.members]
        self.participants = len(set(self.member_agents))
        self.position = {m: j for j, m in enumerate(self.members)}
        rep_index = [self.position.get(agent_rank[a], j) for j, a in enumerate(self.member_agents)]
        self.stood_for = any(j != r for j, r in enumerate(rep_index))
        self.rep_index = rep_index
        self.prepared: dict[tuple, Callable[[Sequence[int]], list[int]]] = {}


def _deadlock(agents: Sequence[Agent], start: list[list[int]], end: list[list[int]],
              rendezvous: Mapping[tuple[object, int], list[tuple[int, int, int]]],
              waiting_recv: Mapping[tuple[int, int, int], list[tuple[int, int, int]]],
              members: Callable[[object], tuple[int, ...]], agent_of_rank: Callable[[int], int],
              name_of: Callable[[int, int], str] | None) -> Deadlock:
    """Say who waits for whom."""
    def node(a: int, i: int) -> str:
        ag = agents[a]
        name = name_of(a, i) if name_of else ag.prog.names[i]
        return f"node {ag.prog.ids[i]}{f' ({name})' if name else ''}"

    stuck: list[str] = []
    ranks: set[int] = set()
    for (g, _), arrived in rendezvous.items():
        here = {agents[a].rank for a, _, _ in arrived}
        absent = [m for m in members(g) if agents[agent_of_rank(m)].rank not in here]
        for a, i, _ in arrived:
            coll = agents[a].prog.coll[i]
            stuck.append(f"rank {agents[a].rank} {node(a, i)} holds its communication slot in {coll} on group {g}, "
                         f"which rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent[:6]))} "
                         f"{'have' if len(absent) > 1 else 'has'} not issued")
            ranks.add(agents[a].rank)
    for (src, _, tag), waiters in waiting_recv.items():
        for a, i, _ in waiters:
            if end[a][i] < 0:
                stuck.append(f"rank {agents[a].rank} {node(a, i)} waits for a message from rank "
                             f"{agents[src].rank} (tag {tag})")
                ranks.add(agents[a].rank)
    for a, ag in enumerate(agents):
        if ag.rank in ranks:
            continue
        pending = [i for i in range(len(ag.prog)) if start[a][i] < 0]
        if pending:
            stuck.append(f"rank {ag.rank} {node(a, pending[0])} and {len(pending) - 1} later node(s) never start")
            ranks.add(ag.rank)
    # what the ranks holding their slot keep from running
    for a, ag in enumerate(agents):
        held = any(agents[x].rank == ag.rank for arrived in rendezvous.values() for x, _, _ in arrived)
        if not held:
            continue
        blocked = [i for i in range(len(ag.prog)) if start[a][i] < 0 and ag.prog.kind[i] in (K_SEND, K_COLL)
                   and all(end[a][j] >= 0 for j in range(len(ag.prog)) if i in ag.prog.children[j])]
        if blocked:
            stuck.append(f"rank {ag.rank} {node(a, blocked[0])} is ready but queued behind it")
    return Deadlock(stuck, sorted(ranks))


# -- results ----------------------------------------------------------------------------------

def expand(outcome: Outcome, agents: Sequence[Agent], agent_of_rank: Callable[[int], int], n_ranks: int) -> AstraRunResult:
    """Per rank, what the simulator prints (each rank as the agent that stands for it)."""
    finished, exposed, gpu, comm = {}, {}, {}, {}
    for r in range(n_ranks):
        a = agent_of_rank(r)
        finished[r] = outcome.finish[a]
        gpu[r] = outcome.gpu[a]
        exposed[r] = outcome.finish[a] - outcome.gpu[a]
        comm[r] = outcome.comm[a]
    return AstraRunResult(finished, exposed, gpu, comm)


def network_of(dims: Sequence[NetworkDim]) -> Network:
    return Network(list(dims))
