"""ASTRA-sim's system layer, phase by phase (§4, §5 of ``astra-sim-cost-model.md``): the phases
every chunk of a collective goes through (:func:`plan_phases`), what the simulator cannot run
(:func:`check_phase`), and when each rank of a ring ends one phase of one chunk under each
implementation: ring, direct, halvingDoubling, doubleBinaryTree (:func:`phase_finish_times`).

Part of the analytical model that :mod:`astra_system` describes; times are integer nanoseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from stage_cosim.adapters.astra_sim.astra_network import Network, reduction_cost
from stage_cosim.adapters.astra_sim.astra_system import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL,
                                                         COLLECTIVES, GROUP_ENDPOINT_DELAY_NS,
                                                         REDUCE_SCATTER, AstraSystem, _impl_key)
from stage_cosim.errors import UserError, require
from stage_cosim.hardware.network import NetworkDim

# -- §5: one phase of one chunk ---------------------------------------------------------------

@dataclass(frozen=True)
class _Block:
    """``repeat`` identical steps: each rank receives from ``src[pos]`` a ``size``-byte message,
    then pays ``reduce`` ns of reduction before its next send (or before it ends)."""

    src: tuple[int, ...]
    size: int
    reduce: int
    repeat: int = 1


def _ring_blocks(kind: str, n: int, chunk: int, red: Callable[[int], int],
                 clockwise: bool = True) -> list[_Block]:
    """§5 ring: messages go to the next position (the previous one when anticlockwise);
    reductions on AR / RS steps 2..n."""
    step = -1 if clockwise else 1
    prev = tuple((i + step) % n for i in range(n))
    if kind == ALL_GATHER:
        return [_Block(prev, chunk, 0, n - 1)]
    m = chunk // n
    if kind == ALL_REDUCE:
        return [_Block(prev, m, red(m), n - 1), _Block(prev, m, 0, n - 1)]
    if kind == REDUCE_SCATTER:
        return [_Block(prev, m, red(m), n - 1)]
    return [_Block(prev, m, 0, n * (n - 1) // 2)]          # ALL_TO_ALL


def _partner(i: int, offset: int) -> int:
    """§5 halvingDoubling: partner of position i at distance o."""
    return i + offset if (i // offset) % 2 == 0 else i - offset


def _halving_doubling_blocks(kind: str, n: int, chunk: int,
                             red: Callable[[int], int]) -> list[_Block]:
    """§5 halvingDoubling: L = log2 n exchange steps (2L for ALL_REDUCE); reductions before
    steps 2..L of the reduce-scatter half."""
    levels = n.bit_length() - 1      # n is a power of two and kind not ALL_TO_ALL (check_phase)

    def step(offset: int, size: int, reduce: int) -> _Block:
        return _Block(tuple(_partner(i, offset) for i in range(n)), size, reduce)

    if kind == ALL_GATHER:
        return [step(n >> k, chunk << (k - 1), 0) for k in range(1, levels + 1)]
    rs = [step(1 << (k - 1), chunk >> k, red(chunk >> (k + 1)) if k < levels else 0)
          for k in range(1, levels + 1)]
    if kind == REDUCE_SCATTER:
        return rs
    # The binary halves its message size once more at the turn, then doubles it (integer sizes):
    # the all-gather half sends 2 (C >> (L+1)), 4 (C >> (L+1)) ... (C >> 1 when 2^(L+1) divides C).
    turn = chunk >> (levels + 1)
    ag = [step(1 << (k - 1), turn << (levels + 1 - k), 0) for k in range(levels, 0, -1)]
    return rs + ag


def _run_blocks(ranks: Sequence[int], starts: Sequence[int], blocks: Sequence[_Block],
                endpoint: int, net: Network) -> list[int]:
    """§5 per-rank recurrence shared by ring and halvingDoubling.

    send_i(1) = start_i + E; recv_i(k) = max(send_i(k), send_src(k) + D(src -> i, m_k));
    send_i(k+1) = recv_i(k) + E + R; the phase ends at send_i(K+1). When every rank starts
    together and each step's delays are uniform, all ranks share one scalar recurrence.
    """
    n = len(ranks)
    _require_message(min(b.size for b in blocks))
    delays = [[net.delay(ranks[b.src[i]], ranks[i], b.size) for i in range(n)] for b in blocks]
    if len(set(starts)) == 1 and all(len(set(d)) == 1 for d in delays):
        t = starts[0] + endpoint
        for b, d in zip(blocks, delays):
            t += b.repeat * (d[0] + endpoint + b.reduce)
        return [t] * n
    send = [s + endpoint for s in starts]
    for b, d in zip(blocks, delays):
        src, extra = b.src, endpoint + b.reduce
        for _ in range(b.repeat):
            send = [max(send[i], send[src[i]] + d[i]) + extra for i in range(n)]
    return send


def _require_message(size: int) -> None:
    """§9: the simulator asserts on a zero-byte message, so such a collective cannot run."""
    require(size > 0, "comm_size", "a collective phase would send zero-byte messages (the "
                                   "simulator asserts); use a larger size or fewer splits")


def _direct_one_round(ranks: Sequence[int], starts: Sequence[int], size: int, reduce: int,
                      endpoint: int, net: Network) -> list[int]:
    """§5 direct ALL_GATHER / ALL_TO_ALL / REDUCE_SCATTER: all n-1 messages leave at once;
    a rank ends E (+ R) after the last one arrives: 2E + Dmax (+ R)."""
    n = len(ranks)
    out = []
    for i in range(n):
        arrive = max([starts[i] + endpoint] + [starts[j] + endpoint + net.delay(ranks[j], ranks[i], size)
                                                for j in range(n) if j != i])
        out.append(arrive + endpoint + reduce)
    return out


def _direct_all_reduce(ranks: Sequence[int], starts: Sequence[int], size: int, reduce: int,
                       endpoint: int, net: Network, group_extra: int) -> list[int]:
    """§5 direct ALL_REDUCE: a reduce-scatter round then an all-gather round, 3E + 2D + R.

    Each received first-round message is processed at g = arrival + E + R. The second-round
    send to offset q leaves at max(trig, g_sorted[q-1]), trig being the first g at or after the
    last arrival; a rank ends E after its last second-round message arrives. With uniform links
    this is 3E + 2D + R; on a physical Ring the distances make the sends leave in a staircase.
    ``group_extra`` is the extra reduction a communicator-group ring of more than two ranks pays:
    its ring is ASTRA-sim's "local" kind, on which the second-round packets are reduced too, so
    the rank ends E + R after the last one arrives.
    """
    n = len(ranks)
    second: list[list[int]] = []         # second[i][q-1]: when i sends to offset q
    for i in range(n):
        arrivals = [starts[j] + endpoint + net.delay(ranks[j], ranks[i], size)
                    for j in range(n) if j != i]
        last = max(arrivals + [starts[i] + endpoint])
        processed = sorted(a + endpoint + reduce for a in arrivals)
        trig = next((g for g in processed if g >= last), max(last, processed[-1]))
        second.append([max(trig, g) for g in processed])
    ends = []
    for i in range(n):
        arrive = max(second[j][(i - j) % n - 1] + net.delay(ranks[j], ranks[i], size)
                     for j in range(n) if j != i)
        ends.append(arrive + endpoint + group_extra)
    return ends


def _inorder_tree(lo: int, hi: int, parent: int, parents: dict[int, int]) -> int:
    """Build a complete in-order binary tree over positions lo..hi; return its root."""
    mid = (lo + hi) // 2
    parents[mid] = parent
    if lo < mid:
        _inorder_tree(lo, mid - 1, mid, parents)
    if mid < hi:
        _inorder_tree(mid + 1, hi, mid, parents)
    return mid


def _double_binary_tree(ranks: Sequence[int], starts: Sequence[int], chunk: int, reduce: int,
                        endpoint: int, net: Network, tree: int) -> list[int]:
    """§5 doubleBinaryTree ALL_REDUCE (whole chunk per message), on tree 0 or 1.

    Tree 0 is rooted at position n-1 with an in-order tree over 0..n-2 below it; tree 1 is
    rooted at 0 over 1..n-1. Reduce up the tree, then broadcast down.
    """
    n = len(ranks)
    parents: dict[int, int] = {}
    root = n - 1 if tree == 0 else 0
    parents[root] = -1
    if n > 1:
        lo, hi = (0, n - 2) if tree == 0 else (1, n - 1)
        _inorder_tree(lo, hi, root, parents)
    children: dict[int, list[int]] = {p: [] for p in range(n)}
    for pos, par in parents.items():
        if par >= 0:
            children[par].append(pos)

    def d(a: int, b: int) -> int:
        return net.delay(ranks[a], ranks[b], chunk)

    send: dict[int, int] = {}

    def up(pos: int) -> int:
        kids = children[pos]
        if not kids:
            send[pos] = starts[pos] + endpoint
        else:
            ready = max(up(c) + d(c, pos) for c in kids)
            send[pos] = max(starts[pos], ready) + endpoint + reduce
        return send[pos]

    end = [0] * n
    end[root] = up(root)

    def down(pos: int) -> None:
        for c in children[pos]:
            end[c] = end[pos] + d(pos, c) + endpoint + (reduce if children[c] else 0)
            down(c)

    down(root)
    return end


# -- §4: the phases of one collective ---------------------------------------------------------

@dataclass(frozen=True)
class Phase:
    """One phase of every chunk: a collective ``kind`` run with ``algorithm`` over ``rings``.

    ``queue`` names the per-rank queue the phase waits in (a network dimension, or the group
    ring). ``clockwise`` is the ring direction: ASTRA-sim runs localBWAware's all-gather phases
    anticlockwise (they take the second half of the dimension's queues, whose direction is
    anticlockwise), everything else clockwise; it only matters when ranks start at different times.
    """

    kind: str
    algorithm: str
    queue: object
    rings: tuple[tuple[int, ...], ...]
    endpoint: int
    group: bool = False
    clockwise: bool = True


def _active_dims(net: Network, involved: Sequence[bool] | None) -> list[int]:
    """Dimensions with more than one rank that the collective involves (§4)."""
    flags = list(involved) if involved is not None else []
    flags += [True] * (len(net.dims) - len(flags))
    return [d for d, dim in enumerate(net.dims) if dim.npus > 1 and flags[d]]


def plan_phases(collective: str, system: AstraSystem, network: Sequence[NetworkDim] | Network,
                involved_dims: Sequence[bool] | None = None,
                group: Sequence[int] | None = None) -> list[Phase]:
    """§4: the ordered phases every chunk of ``collective`` goes through.

    A communicator group that is not all ranks is one logical ring in the listed order, using
    the first implementation only when the list has exactly one entry (else ring), ignoring
    involved_dim and paying endpoint delay 10; a group of all ranks is a global collective over
    every dimension (involved_dim ignored too). Otherwise one phase per active dimension,
    ascending (ALL_GATHER descending); localBWAware ALL_REDUCE reduce-scatters up, all-reduces on
    the last dimension and all-gathers back down, the way back anticlockwise.
    """
    net = network if isinstance(network, Network) else Network(network)
    require(collective in COLLECTIVES, "comm_type", f"unsupported collective {collective!r}")
    impls = system.implementation_list(collective)
    if group is not None and sorted(group) == list(range(net.n_ranks)):
        involved_dims = None            # a group of every rank runs as a global collective
    elif group is not None:
        ring = tuple(group)
        require(len(set(ring)) == len(ring) and all(0 <= r < net.n_ranks for r in ring),
                "comm group", f"must list distinct ranks below {net.n_ranks}, got {list(ring)}")
        if len(ring) < 2:
            return []
        algo = _base_algorithm(impls[0]) if len(impls) == 1 else "ring"
        return [Phase(collective, algo, "group", (ring,), GROUP_ENDPOINT_DELAY_NS, True)]
    require(len(impls) >= len(net.dims) or impls[0].startswith("one"), _impl_key(collective),
            f"needs one entry per network dimension ({len(net.dims)}), got {len(impls)}")
    if impls[0].startswith("one"):
        # one* implementations: a single logical ring over every rank, in rank order.
        return [Phase(collective, _base_algorithm(impls[0]), "one", (tuple(range(net.n_ranks)),),
                      system.endpoint_delay_ns)]
    dims = _active_dims(net, involved_dims)
    endpoint = system.endpoint_delay_ns
    phases: list[Phase] = []

    def add(kind: str, dim: int, clockwise: bool = True) -> None:
        phases.append(Phase(kind, impls[dim], dim, net.rings(dim), endpoint, clockwise=clockwise))

    if collective == ALL_REDUCE and system.collective_optimization == "localBWAware" and len(dims) > 1:
        for dim in dims[:-1]:
            add(REDUCE_SCATTER, dim)
        add(ALL_REDUCE, dims[-1])
        for dim in reversed(dims[:-1]):
            add(ALL_GATHER, dim, clockwise=False)
    else:
        for dim in (reversed(dims) if collective == ALL_GATHER else dims):
            add(collective, dim)
    return phases


def _base_algorithm(name: str) -> str:
    return {"oneRing": "ring", "oneDirect": "direct", "oneHalvingDoubling": "halvingDoubling"}.get(
        name, name)


def phase_sizes(phases: Sequence[Phase], chunk: int) -> list[int]:
    """§4: the bytes each rank holds entering each phase: a reduce-scatter leaves 1/n of its
    input, an all-gather n times it (integer division at every step, as ASTRA-sim does)."""
    sizes = []
    for ph in phases:
        sizes.append(chunk)
        n = len(ph.rings[0])
        if ph.kind == REDUCE_SCATTER:
            chunk //= n
        elif ph.kind == ALL_GATHER:
            chunk *= n
    return sizes


def check_phase(phase: Phase, n: int, size: int) -> None:
    """§5, §9: refuse a phase the simulator cannot run on a ring of ``n`` positions holding
    ``size`` bytes per rank: an algorithm that does not implement the collective or the rank
    count, or a step that would send a zero-byte message (the simulator asserts)."""
    if n < 2:
        return
    algo, kind = phase.algorithm, phase.kind
    if algo == "ring" or algo == "direct":
        smallest = size if kind == ALL_GATHER else size // n
    elif algo == "halvingDoubling":
        levels = n.bit_length() - 1
        require(n == 1 << levels, "halvingDoubling", f"needs a power-of-two rank count, got {n} "
                                                     "(the simulator never finishes)")
        require(kind != ALL_TO_ALL, "all-to-all-implementation",
                "halvingDoubling does not implement ALL_TO_ALL (the simulator exits)")
        smallest = size if kind == ALL_GATHER else size >> levels
        # ALL_REDUCE: at the turn the binary halves its message once more before doubling it
        # back, so its all-gather half sends 2 * (size >> (L+1)) bytes first: 0 below 2n bytes
        # (it aborts on "Assertion `chunk_size > 0'")
        require(kind != ALL_REDUCE or size >> (levels + 1) > 0, "comm_size",
                f"a halvingDoubling ALL_REDUCE phase over {n} ranks holding {size} bytes of a chunk sends 0-byte "
                f"messages in its all-gather half (2 * ({size} // {2 * n}) bytes), which the simulator aborts on "
                f"(Assertion chunk_size > 0): the phase needs at least {2 * n} bytes (a larger size or fewer splits)")
    elif algo == "doubleBinaryTree":
        require(kind == ALL_REDUCE, _impl_key(kind),
                f"doubleBinaryTree is reproduced for ALL_REDUCE only, not {kind}")
        require(n & (n - 1) == 0, "doubleBinaryTree", f"needs a power-of-two rank count, got {n} "
                                                      "(the simulator aborts)")
        smallest = size
    else:
        raise UserError("implementation", f"unknown implementation {algo!r}")
    _require_message(smallest)


def phase_finish_times(phase: Phase, ring: Sequence[int], starts: Sequence[int], size: int,
                       tree: int, system: AstraSystem, net: Network) -> list[int]:
    """§5: when each position of ``ring`` ends ``phase`` for one chunk holding ``size`` bytes
    per rank, given the positions' start times.

    ``tree`` picks doubleBinaryTree's tree (0: rooted at the last position, 1: at the first).
    """
    n = len(ring)
    if n < 2:
        return list(starts)
    check_phase(phase, n, size)
    E = phase.endpoint

    def red(m: int) -> int:
        return reduction_cost(system, m)

    algo, kind = phase.algorithm, phase.kind
    if algo == "ring":
        return _run_blocks(ring, starts, _ring_blocks(kind, n, size, red, phase.clockwise), E, net)
    if algo == "halvingDoubling":
        return _run_blocks(ring, starts, _halving_doubling_blocks(kind, n, size, red), E, net)
    if algo == "direct":
        m = size if kind == ALL_GATHER else size // n
        if kind == ALL_REDUCE:
            extra = red(m) if phase.group and n > 2 else 0
            return _direct_all_reduce(ring, starts, m, red(m), E, net, extra)
        return _direct_one_round(ring, starts, m, red(m) if kind == REDUCE_SCATTER else 0, E, net)
    return _double_binary_tree(ring, starts, size, red(size), E, net, tree % 2)
