"""Event-driven replay of every agent's dependency graph.

An *agent* is a rank, or one representative rank of a role when symmetry is exploited (all
ranks of a pipeline stage run the same graph at the same times, so one stands for all).

Rules (ASTRA-sim's workload layer, generalized to several streams):

* a node is ready when its dependencies are done; ready nodes are issued in id order, each
  when the stream (execution slot) it needs is free; a node that needs no stream (a receive)
  is issued at once;
* a collective finishes when every participating agent has issued it; the network model
  turns the members' issue times into their finish times;
* a send occupies its stream for as long as the network model says; a receive finishes at
  the later of its issue and the data's arrival. Sends and receives pair by (src, dst, tag).

With SM sharing (``sm_share``, :mod:`.comm_sms`) a collective holds a share of its agent's SMs
from its issue to its finish, and the compute kernel running meanwhile progresses at the rate
the other SMs give (processor sharing): its remaining work is rescaled whenever a collective
starts or ends on its agent, so its finish moves mid-kernel. Without it every kernel takes
exactly its duration.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from stage_cosim.adapters.roofline.network import NetworkModel


WAIT = "WAIT"   # a placeholder node that only lets time pass, on a stream of its own


class DeadlockError(Exception):
    """Some nodes never became runnable (a collective or receive that nobody matches)."""


@dataclass
class AgentProgram:
    """One agent's nodes, column by column (index = position in id order)."""

    name: str
    rank: int
    ids: list[int]
    types: list[str]
    deps: list[list[int]]
    duration: list[float]                      # COMP: seconds
    kind: list[str]                            # comm kind: "tp", "dp", "pp", "embedding", "pg:7" …
    coll: list[str | None]
    nbytes: list[int]
    peer: list[int]                            # SEND: destination agent, RECV: source agent
    tag: list[int]
    group: list[Hashable | None]               # COLL: rendezvous instance
    members: list[tuple[int, ...] | None]      # COLL: the group's global ranks
    streams: list[str | None] = field(default_factory=list)
    involved: dict[int, tuple[bool, ...]] = field(default_factory=dict)   # COLL: network dims it spans
    # SEND: the destination's global rank where the agent stands for another rank (one rank
    # standing for a stage: a ring neighbour over cp is the same agent, another rank)
    peer_rank: dict[int, int] = field(default_factory=dict)


@dataclass
class Replay:
    start: list[list[float]]
    end: list[list[float]]
    finish: list[float]


def replay(programs: Sequence[AgentProgram], network: NetworkModel, participants: dict[Hashable, int],
           agent_of_rank, sm_share=None) -> Replay:  # noqa: ANN001 (callable rank -> agent index; CommSMs)
    """Run all agents to completion. ``participants[group]`` is how many simulated agents take
    part in each rendezvous instance; ``agent_of_rank(r)`` maps a member rank to its agent;
    ``sm_share``: SM sharing between collectives and compute (:class:`.comm_sms.CommSMs`; None:
    none)."""
    if len(programs) == 1 and sm_share is None and _alone(programs[0], network, participants):
        return _replay_alone(programs[0], network)
    n_agents = len(programs)
    start = [[-1.0] * len(p.types) for p in programs]
    end = [[-1.0] * len(p.types) for p in programs]
    children: list[list[list[int]]] = []
    indeg: list[list[int]] = []
    for p in programs:
        ch: list[list[int]] = [[] for _ in p.types]
        deg = [0] * len(p.types)
        for i, ds in enumerate(p.deps):
            for d in ds:
                ch[d].append(i)
            deg[i] = len(ds)
        children.append(ch)
        indeg.append(deg)
        if not p.streams:
            p.streams = [("compute" if t == "COMP" else network.stream(t, k)) for t, k in zip(p.types, p.kind)]

    events: list[tuple[float, int, int, int]] = []   # (time, seq, agent, node): node finishes
    seq = 0
    busy: list[dict[str, bool]] = [dict() for _ in range(n_agents)]
    ready: list[dict[str, list[int]]] = [dict() for _ in range(n_agents)]
    rendezvous: dict[tuple[Hashable, int], list[tuple[int, int, float]]] = {}
    issued_on: list[dict[Hashable, int]] = [dict() for _ in range(n_agents)]
    mailbox: dict[tuple[int, int, int], list[float]] = {}
    waiting_recv: dict[tuple[int, int, int], list[tuple[int, int, float]]] = {}

    span = getattr(network, "span", None)     # (see _replay_alone)
    spans: dict[tuple, float] = {}

    def push(t: float, a: int, i: int) -> int:
        nonlocal seq
        heapq.heappush(events, (t, seq, a, i))
        seq += 1
        return seq - 1

    # SM sharing: per agent, the share of its SMs its running collectives hold, what each holds,
    # and its running compute kernels: node -> [work left (seconds at the full rate), when that
    # was counted, rate, the seq of its valid finish event]
    held = [0.0] * n_agents
    count = [0] * n_agents
    holding: dict[tuple[int, int], float] = {}
    running: list[dict[int, list]] = [dict() for _ in range(n_agents)]

    def rate(a: int) -> float:
        return 1.0 - min(held[a], sm_share.ceiling)

    def reshare(a: int, delta: float, now: float) -> None:
        """A collective took (``delta`` > 0) or gave back SMs: rescale the running kernel."""
        count[a] += 1 if delta > 0 else -1
        held[a] = held[a] + delta if count[a] else 0.0     # (no rounding left once none runs)
        for i, run in running[a].items():
            run[0] -= (now - run[1]) * run[2]
            run[1], run[2] = now, rate(a)
            run[3] = push(now + max(run[0], 0.0) / run[2], a, i)

    def issue(a: int, i: int, now: float) -> None:
        p = programs[a]
        start[a][i] = now
        t = p.types[i]
        if sm_share is not None and t == "COMP":
            r = rate(a)
            running[a][i] = [p.duration[i], now, r, push(now + p.duration[i] / r, a, i)]
        elif t == "COMP" or t == WAIT:
            push(now + p.duration[i], a, i)
        elif t == "COLL":
            if sm_share is not None:
                f = sm_share.fraction(p.coll[i], p.nbytes[i], p.members[i] or (p.rank,))
                if f > 0:
                    holding[(a, i)] = f
                    reshare(a, f, now)
            g = p.group[i]
            if span is not None and participants.get(g, 1) == 1 and i not in p.involved:
                # one agent stands for every member: the network's collective of equal starts
                # ends a span after them
                push(now + _span_of(p, i, span, spans), a, i)
                return
            k = issued_on[a].get(g, 0)
            issued_on[a][g] = k + 1
            key = (g, k)
            arrived = rendezvous.setdefault(key, [])
            arrived.append((a, i, now))
            if len(arrived) == participants.get(g, 1):
                del rendezvous[key]
                members = p.members[i] or (p.rank,)
                single = len(arrived) == 1        # one agent stands for every member
                if single:
                    starts = [now] * len(members)
                else:
                    issue_time = {ag: tm for ag, _, tm in arrived}
                    starts = [issue_time[agent_of_rank(r)] for r in members]
                if i in p.involved:
                    finishes = network.collective(p.coll[i], p.nbytes[i], members, starts, involved=p.involved[i])
                else:
                    finishes = network.collective(p.coll[i], p.nbytes[i], members, starts, kind=p.kind[i])
                # Each agent finishes when the member it stands for does.
                if single:
                    push(finishes[members.index(p.rank)], a, i)
                    return
                done = {agent_of_rank(r): f for r, f in zip(members, finishes)
                        if programs[agent_of_rank(r)].rank == r}
                for ag, node, _ in arrived:
                    push(done[ag], ag, node)
        elif t == "SEND":
            dst = p.peer[i]
            busy_for, delay = network.p2p(p.rank, p.peer_rank.get(i, programs[dst].rank), p.nbytes[i])
            push(now + busy_for, a, i)
            key = (a, dst, p.tag[i])
            arrival = now + delay
            waiters = waiting_recv.get(key)
            if waiters:
                ra, ri, posted = waiters.pop(0)
                push(max(posted, arrival), ra, ri)
            else:
                mailbox.setdefault(key, []).append(arrival)
        elif t == "RECV":
            key = (p.peer[i], a, p.tag[i])
            box = mailbox.get(key)
            if box:
                push(max(now, box.pop(0)), a, i)
            else:
                waiting_recv.setdefault(key, []).append((a, i, now))

    def make_ready(a: int, i: int, now: float) -> None:
        s = programs[a].streams[i]
        if s is None:
            issue(a, i, now)
        else:
            heapq.heappush(ready[a].setdefault(s, []), i)

    def pump(a: int, s: str, now: float) -> None:
        q = ready[a].get(s)
        if q and not busy[a].get(s):
            i = heapq.heappop(q)
            busy[a][s] = True
            issue(a, i, now)

    for a, p in enumerate(programs):
        for i in range(len(p.types)):
            if indeg[a][i] == 0:
                make_ready(a, i, 0.0)
        for s in list(ready[a]):
            pump(a, s, 0.0)

    while events:
        now, sq, a, i = heapq.heappop(events)
        if sm_share is not None:
            if programs[a].types[i] == "COMP":
                run = running[a].get(i)
                if run is None or sq != run[3]:
                    continue                # superseded by a rescaled finish
                del running[a][i]
            elif (a, i) in holding:
                reshare(a, -holding.pop((a, i)), now)
        end[a][i] = now
        p = programs[a]
        touched = set()
        s = p.streams[i]
        if s is not None:
            busy[a][s] = False
            touched.add(s)
        for c in children[a][i]:
            indeg[a][c] -= 1
            if indeg[a][c] == 0:
                make_ready(a, c, now)
                cs = p.streams[c]
                if cs is not None:
                    touched.add(cs)
        for s in touched:
            pump(a, s, now)

    stuck = [(programs[a].name, programs[a].ids[i]) for a in range(n_agents)
             for i in range(len(end[a])) if end[a][i] < 0]
    if stuck:
        raise DeadlockError(f"{len(stuck)} node(s) never finished, e.g. {stuck[:3]}")
    finish = [max(e, default=0.0) for e in end]
    return Replay(start, end, finish)


# -- one agent on its own ----------------------------------------------------------------------

def _span_of(p: AgentProgram, i: int, span: Callable[..., float], spans: dict[tuple, float]) -> float:
    """The network's ``span`` of collective node ``i`` issued by every member at once, looked up
    once per distinct collective of a replay (``spans``)."""
    members = p.members[i] or (p.rank,)
    key = (p.coll[i], p.nbytes[i], id(members), p.kind[i])
    d = spans.get(key)
    if d is None:
        d = spans[key] = span(p.coll[i], p.nbytes[i], members, p.kind[i])
    return d


def _alone(p: AgentProgram, network: NetworkModel, participants: dict[Hashable, int]) -> bool:
    """Whether :func:`_replay_alone` replays ``p`` as :func:`replay` does: one agent whose every
    collective has no other participant, messages only to itself, no dimensions named per
    collective, on a network that says what a collective issued by every member at once takes
    (``span``)."""
    if p.involved or getattr(network, "span", None) is None:
        return False
    if any(participants.get(g, 1) != 1 for g in p.group if g is not None):
        return False
    return all(d == 0 for d, t in zip(p.peer, p.types) if t == "SEND" or t == "RECV")


def _replay_alone(p: AgentProgram, network: NetworkModel) -> Replay:
    """:func:`replay` of one agent standing for every member of its groups (the fast path's
    pass templates and blocks, timed on their own), event for event: nodes issued in the same
    order, ties broken the same way, every time the same sum. A collective then starts when its
    one agent issues it, so it ends ``span`` later (the network's ``collective`` of equal
    starts: their max plus that span); it is looked up once per distinct collective."""
    types, streams, duration = p.types, p.streams, p.duration
    if not streams:
        streams = p.streams = [("compute" if t == "COMP" else network.stream(t, k)) for t, k in zip(types, p.kind)]
    n = len(types)
    start = [-1.0] * n
    end = [-1.0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i, ds in enumerate(p.deps):
        for d in ds:
            children[d].append(i)
        indeg[i] = len(ds)
    span = network.span                               # type: ignore[attr-defined]
    spans: dict[tuple, float] = {}
    events: list[tuple[float, int, int]] = []
    seq = 0
    busy: dict[str, bool] = {}
    ready: dict[str, list[int]] = {}
    mailbox: dict[int, list[float]] = {}
    waiting_recv: dict[int, list[tuple[int, float]]] = {}
    push, pop = heapq.heappush, heapq.heappop

    def issue(i: int, now: float) -> None:
        nonlocal seq
        start[i] = now
        t = types[i]
        if t == "COMP" or t == WAIT:
            push(events, (now + duration[i], seq, i))
            seq += 1
        elif t == "COLL":
            push(events, (now + _span_of(p, i, span, spans), seq, i))
            seq += 1
        elif t == "SEND":
            busy_for, delay = network.p2p(p.rank, p.peer_rank.get(i, p.rank), p.nbytes[i])
            push(events, (now + busy_for, seq, i))
            seq += 1
            tag = p.tag[i]
            arrival = now + delay
            waiters = waiting_recv.get(tag)
            if waiters:
                ri, posted = waiters.pop(0)
                push(events, (max(posted, arrival), seq, ri))
                seq += 1
            else:
                mailbox.setdefault(tag, []).append(arrival)
        elif t == "RECV":
            tag = p.tag[i]
            box = mailbox.get(tag)
            if box:
                push(events, (max(now, box.pop(0)), seq, i))
                seq += 1
            else:
                waiting_recv.setdefault(tag, []).append((i, now))

    def pump(s: str, now: float) -> None:
        q = ready.get(s)
        if q and not busy.get(s):
            busy[s] = True
            issue(pop(q), now)

    for i in range(n):
        if indeg[i] == 0:
            s = streams[i]
            if s is None:
                issue(i, 0.0)
            else:
                push(ready.setdefault(s, []), i)
    for s in list(ready):
        pump(s, 0.0)

    while events:
        now, _, i = pop(events)
        end[i] = now
        touched = set()
        s = streams[i]
        if s is not None:
            busy[s] = False
            touched.add(s)
        for c in children[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                cs = streams[c]
                if cs is None:
                    issue(c, now)
                else:
                    push(ready.setdefault(cs, []), c)
                    touched.add(cs)
        for s in touched:
            pump(s, now)

    stuck = [(p.name, p.ids[i]) for i in range(n) if end[i] < 0]
    if stuck:
        raise DeadlockError(f"{len(stuck)} node(s) never finished, e.g. {stuck[:3]}")
    return Replay([start], [end], [max(end, default=0.0)])
