"""ASTRA-sim's system layer, whole collectives (§3, §6 of ``astra-sim-cost-model.md``): a
collective cut into chunks, the chunks run through its phases (:mod:`astra_phases`) in each
rank's per-phase queues, and :class:`CollectiveModel`, which memoises that for replays that run
millions of collectives.

Part of the analytical model that :mod:`astra_system` describes; times are integer nanoseconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Mapping, MutableMapping, Sequence

from stage_cosim.adapters.astra_sim.astra_network import Network
from stage_cosim.adapters.astra_sim.astra_phases import (Phase, check_phase, phase_finish_times,
                                                         phase_sizes, plan_phases)
from stage_cosim.adapters.astra_sim.astra_system import ALL_GATHER, MAX_CHUNK_COPIES, AstraSystem
from stage_cosim.adapters.roofline.classes import group_shape
from stage_cosim.errors import UserError, require
from stage_cosim.hardware.network import NetworkDim

# -- §3: one collective in chunks -------------------------------------------------------------

def chunking(collective: str, size: int, splits: int, n_ranks: int) -> tuple[int, int]:
    """§3: (bytes per chunk, number of chunks) of one collective of ``size`` bytes.

    C = floor(size / S); for every collective but ALL_GATHER a chunk is at least one byte per
    rank (C = N, size = S * N when N > C), so even a collective of 0 bytes runs (the simulator
    times it as S * N bytes). Every chunk carries C bytes.
    """
    require(size >= 0, "comm_size", f"must not be negative, got {size}")
    chunk = size // splits
    if collective != ALL_GATHER and n_ranks > chunk:
        chunk, size = n_ranks, splits * n_ranks
    require(chunk > 0, "preferred-dataset-splits", f"an ALL_GATHER of {size} B is smaller than the split "
                                                   f"count {splits}: the simulator would loop forever")
    return chunk, -(-size // chunk)


# -- §6: chunks through the phases, per-rank queues ---------------------------------------------

def collective_finish_times(network: Sequence[NetworkDim] | Network, system: AstraSystem,
                            collective: str, size: int, starts: Mapping[int, int],
                            involved_dims: Sequence[bool] | None = None,
                            group: Sequence[int] | None = None,
                            tree_counters: MutableMapping[object, int] | None = None
                            ) -> dict[int, int]:
    """When each participating rank finishes one collective, given when each one issued it.

    ``starts`` maps every participating rank (all ranks, or the ranks of ``group``) to its issue
    time. Chunks (§3) go through the phases (§4) in each rank's per-phase queue, FIFO with
    active-chunks-per-dimension slots (§6); a phase of one chunk on one ring is computed by §5 once
    every rank of that ring has started it.

    doubleBinaryTree alternates its two trees chunk after chunk, and ASTRA-sim keeps counting
    across collectives (one counter per logical topology); pass the same ``tree_counters`` dict
    to successive calls to carry that count, as the workload replay does.
    """
    net = network if isinstance(network, Network) else Network(network)
    members = tuple(group) if group is not None else tuple(range(net.n_ranks))
    require(sorted(starts) == sorted(members), "collective",
            "start times must be given for exactly the participating ranks")
    model = CollectiveModel(net, system, tree_counters)
    ends = model.finish_times(collective, size, None if group is None else members,
                              [starts[r] for r in members], involved_dims)
    return dict(zip(members, ends))


class CollectiveModel:
    """Collectives on one network and system, memoised for replays that run millions of them.

    A collective's finish times relative to its earliest start depend only on the collective, its
    size, the shape of its group on the network (which dimension separates each pair of members
    and by how many hops, so every pair delay), the members' relative start times, and which
    doubleBinaryTree tree each phase begins with. Replays issue the same few collectives over and
    over, on groups of the same shape, mostly with all members starting together: each distinct
    case is computed once (§3 - §6) and looked up afterwards.
    """

    def __init__(self, net: Network, system: AstraSystem,
                 tree_counters: MutableMapping[object, int] | None = None) -> None:
        self.net = net
        self.system = system
        self.tree_counters = tree_counters if tree_counters is not None else {}
        self._plans: dict[tuple, tuple] = {}
        self._results: dict[tuple, tuple[int, ...]] = {}
        self._shapes: dict[tuple[int, ...], tuple] = {}
        self.evaluated = 0          # cases actually computed (the rest were looked up)

    def _normalized(self, members: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """None for a group of every rank: it runs as a global collective (§4)."""
        if members is not None and len(members) == self.net.n_ranks and sorted(members) == list(range(self.net.n_ranks)):
            return None
        return members

    def plan(self, collective: str, size: int, members: tuple[int, ...] | None,
             involved: Sequence[bool] | None = None) -> tuple:
        """(phases, bytes per phase, chunks, counter key per phase, shape) of one collective,
        checked against everything the simulator cannot run (§3, §5, §9)."""
        members = self._normalized(members)
        inv = tuple(involved) if involved is not None and members is None else None
        key = (collective, size, members, inv)
        found = self._plans.get(key)
        if found is not None:
            return found
        phases = plan_phases(collective, self.system, self.net, inv, members)
        if self.system.endpoint_delay_ns == 0 and phases and not phases[0].group:
            raise UserError("endpoint-delay", "0 makes the simulator abort (assertion)")
        if phases:
            chunk, n_chunks = chunking(collective, size, self.system.preferred_dataset_splits,
                                       self.net.n_ranks)
            ranks = self.net.n_ranks if members is None else len(members)
            require(n_chunks * ranks <= MAX_CHUNK_COPIES, "preferred-dataset-splits",
                    f"{n_chunks} chunks of one {collective} over {ranks} ranks are {n_chunks * ranks:,} chunk copies to "
                    f"simulate, more than the {MAX_CHUNK_COPIES:,} that run in reasonable time: use fewer splits")
            sizes = phase_sizes(phases, chunk)
            for ph, m in zip(phases, sizes):
                check_phase(ph, len(ph.rings[0]), m)
        else:
            sizes, n_chunks = [], 0
        counter_keys = tuple((("group", ph.rings) if ph.group else ("dim", ph.queue))
                             if ph.algorithm == "doubleBinaryTree" else None for ph in phases)
        shape = ("all", inv) if members is None else ("group", self.shape(members))
        found = self._plans[key] = (phases, sizes, n_chunks, counter_keys, shape)
        return found

    def shape(self, members: tuple[int, ...]) -> tuple:
        """What the pair delays of a group depend on (:func:`group_shape`), memoised."""
        found = self._shapes.get(members)
        if found is None:
            found = self._shapes[members] = group_shape(self.net, members)
        return found

    def finish_times(self, collective: str, size: int, members: tuple[int, ...] | None,
                     starts: Sequence[int], involved: Sequence[bool] | None = None) -> list[int]:
        """Each member's finish time (members in the given order; None: every rank, in rank
        order), given each member's issue time."""
        return self.prepared(collective, size, members, involved)(starts)

    def prepared(self, collective: str, size: int, members: tuple[int, ...] | None,
                 involved: Sequence[bool] | None = None) -> Callable[[Sequence[int]], list[int]]:
        """:meth:`finish_times` of one collective on one group, planned once (a replay issues
        the same collective on the same group again and again)."""
        if members is not None and self._normalized(members) is None and list(members) != sorted(members):
            everyone = self.prepared(collective, size, None, involved)

            def reordered(starts: Sequence[int]) -> list[int]:
                by_rank = dict(zip(members, starts))
                ends = everyone([by_rank[r] for r in range(self.net.n_ranks)])
                return [ends[r] for r in members]
            return reordered
        phases, sizes, n_chunks, counter_keys, shape = self.plan(collective, size, members, involved)
        if not phases:
            return list
        counters, results = self.tree_counters, self._results
        trees = [k for k in counter_keys if k is not None]
        no_trees = [0] * len(phases)
        base = (collective, size, shape)
        order = members if members is not None else tuple(range(self.net.n_ranks))

        def run(starts: Sequence[int]) -> list[int]:
            if trees:
                first_tree = [counters.get(k, 0) if k is not None else 0 for k in counter_keys]
                for k in trees:
                    counters[k] = counters.get(k, 0) + n_chunks
                parity: tuple[int, ...] = tuple(t % 2 for t in first_tree)
            else:
                first_tree, parity = no_trees, ()
            t0 = min(starts)
            rel = None if t0 == max(starts) else tuple(s - t0 for s in starts)
            key = (base, rel, parity)
            offsets = results.get(key)
            if offsets is None:
                self.evaluated += 1
                ends = _schedule(phases, sizes, n_chunks, dict(zip(order, starts)), self.system, self.net,
                                 first_tree)
                offsets = results[key] = tuple(ends[r] - t0 for r in order)
            return [t0 + o for o in offsets]
        return run


def _schedule(phases: list[Phase], sizes: list[int], n_chunks: int, starts: dict[int, int],
              system: AstraSystem, net: Network, first_tree: list[int]) -> dict[int, int]:
    """§6 as a small event simulation: a rank starts a queued (chunk, phase) when one of the A
    slots of that phase's queue is free; a chunk leaving a phase joins its next queue in the same
    nanosecond; queues are first-in-first-out (so localBWAware's reduce-scatters, all queued at
    the start, run ahead of the all-gathers that share their dimension)."""
    slots_per_queue = system.active_chunks_per_dimension
    ring_index: list[dict[int, tuple[int, int]]] = []
    for ph in phases:
        index = {}
        for ri, ring in enumerate(ph.rings):
            for pos, r in enumerate(ring):
                index[r] = (ri, pos)
        ring_index.append(index)
    free: dict[tuple[int, object], int] = {}
    waiting: dict[tuple[int, object], deque[tuple[int, int]]] = {}
    pending: dict[tuple[int, int, int], dict[int, int]] = {}
    finish = dict(starts)
    events: list[tuple[int, int, int, int, int]] = []    # (time, seq, rank, chunk, phase)
    seq = 0

    def start_waiting(rank: int, queue: object, now: int) -> None:
        nonlocal seq
        key = (rank, queue)
        q = waiting.get(key)
        while q and free.get(key, slots_per_queue) > 0:
            j, p = q.popleft()
            free[key] = free.get(key, slots_per_queue) - 1
            ri, _ = ring_index[p][rank]
            ring = phases[p].rings[ri]
            got = pending.setdefault((j, p, ri), {})
            got[rank] = now
            if len(got) == len(ring):
                del pending[(j, p, ri)]
                ends = phase_finish_times(phases[p], ring, [got[r] for r in ring], sizes[p],
                                          first_tree[p] + j, system, net)
                for r, e in zip(ring, ends):
                    seq += 1
                    heapq.heappush(events, (e, seq, r, j, p))

    def enqueue(rank: int, j: int, p: int, now: int) -> None:
        queue = phases[p].queue
        waiting.setdefault((rank, queue), deque()).append((j, p))
        start_waiting(rank, queue, now)

    for rank in sorted(starts, key=lambda r: (starts[r], r)):
        for j in range(n_chunks):
            waiting.setdefault((rank, phases[0].queue), deque()).append((j, 0))
    for rank in sorted(starts, key=lambda r: (starts[r], r)):
        seq += 1
        heapq.heappush(events, (starts[rank], seq, rank, -1, -1))
    while events:
        now, _, rank, j, p = heapq.heappop(events)
        if j < 0:
            start_waiting(rank, phases[0].queue, now)
            continue
        key = (rank, phases[p].queue)
        free[key] = free.get(key, slots_per_queue) + 1
        if p + 1 < len(phases):
            enqueue(rank, j, p + 1, now)
        else:
            finish[rank] = max(finish[rank], now)
        start_waiting(rank, phases[p].queue, now)
    require(not pending, "collective", "internal error: a phase never gathered all its ranks")
    return finish


def collective_time(network: Sequence[NetworkDim], system: AstraSystem, collective: str,
                    size: int, involved_dims: Sequence[bool] | None = None,
                    group: Sequence[int] | None = None) -> int:
    """The slowest rank's time for one collective issued by every participant at time 0."""
    net = Network(network)
    ranks = list(group) if group is not None else range(net.n_ranks)
    return max(collective_finish_times(net, system, collective, size, {r: 0 for r in ranks},
                                       involved_dims, group).values())
