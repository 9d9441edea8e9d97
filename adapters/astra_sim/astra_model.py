"""An exact re-implementation of ASTRA-sim's congestion-unaware analytical backend.

ASTRA-sim is a C++ program users build themselves, so the project cannot count on having it.
This module reproduces what its congestion-unaware binary prints (per-rank finish time and
exposed communication) from the rules in ``astra-sim-cost-model.md``, which were inferred from
the real simulator and checked against every successful reference run. Section numbers in the
comments (§1 ... §7) refer to that file.

Three layers, as in ASTRA-sim:

* network (§1, §2): the delay of one message between two ranks, and the reduction cost;
* system (§3 - §6): one collective, chunked, run phase by phase over the network dimensions
  (or over a communicator group's logical ring), with each rank's per-dimension queues;
* workload (§7): event-driven replay of every rank's Chakra node graph, one compute slot and
  one communication slot per rank, collectives coupling the ranks of their group.

All times are integer nanoseconds (ASTRA-sim's cycles).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, MutableMapping, Sequence

from stage_cosim.adapters.roofline.classes import Topology, group_shape, replay_ns
from stage_cosim.errors import UserError, require
from stage_cosim.hardware.network import NetworkDim
from stage_cosim.trace.chakra import TraceNode

# -- vocabulary ---------------------------------------------------------------------------------

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER",
                                                      "ALL_TO_ALL")
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
# Chakra CollectiveCommType codes of the collectives ASTRA-sim simulates.
COLLECTIVE_BY_CODE = {0: ALL_REDUCE, 2: ALL_GATHER, 6: ALL_TO_ALL, 7: REDUCE_SCATTER}
# A BROADCAST is not simulated as a collective: it holds the rank's communication slot for its
# duration_micros (0 gives 1 ns), on each rank alone.
BROADCAST_CODE = 5
IMPLEMENTATIONS = ("ring", "direct", "halvingDoubling", "doubleBinaryTree", "oneRing",
                   "oneDirect", "oneHalvingDoubling")
SCHEDULING_POLICIES = ("LIFO", "FIFO")
OPTIMIZATIONS = ("baseline", "localBWAware")
# A communicator group that is not all ranks always pays this endpoint delay (§2).
GROUP_ENDPOINT_DELAY_NS = 10
# Bounds on preferred-dataset-splits. Every split is a chunk that each member of a collective's
# group carries through every phase: the replay holds a queue entry and an event per chunk and
# member (about 90 B) and spends 4-10 µs of CPU on each, per distinct collective
# (``python benchmarks/astra_replay_speed.py --splits …`` measures it; docs/guide/astra-sim.md
# has the figures). So chunks x members is bounded, at 2^20: about 100 MB and 5-10 s for one
# collective (4096 splits over 256 ranks took 5.5 s, 2048 over 512 ranks 10.5 s; 4096 over 512
# ranks, twice the bound, did not finish in 300 s). The splits alone are bounded at 4096 as well,
# where the binary is already slow (61 s of CPU for one all-reduce over 64 ranks); its own
# examples use 4 to 64.
MAX_DATASET_SPLITS = 4096
MAX_CHUNK_COPIES = 1 << 20

# Chakra node types (et_def.proto NodeType).
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7


@dataclass(frozen=True)
class AstraSystem:
    """The settings of ASTRA-sim's system configuration (system.json) that change timing.

    ``implementations`` maps a collective name (``"ALL_REDUCE"`` ...) to one implementation per
    network dimension, exactly as the ``*-implementation`` lists of the file. ``extra`` keeps
    keys this model does not interpret (``boost-mode``, ``trace-enabled`` ...) so that reading
    and writing a file round-trips them.
    """

    scheduling_policy: str = "LIFO"
    collective_optimization: str = "baseline"
    endpoint_delay_ns: int = 10
    active_chunks_per_dimension: int = 1
    preferred_dataset_splits: int = 1
    implementations: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    local_mem_bw_GBps: float | None = None
    peak_perf_TFLOPS: float | None = None
    roofline_enabled: bool = False
    extra: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling-policy",
                f"must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        require(self.collective_optimization in OPTIMIZATIONS, "collective-optimization",
                f"must be one of {', '.join(OPTIMIZATIONS)}, got {self.collective_optimization!r}")
        _require_int(self.endpoint_delay_ns, "endpoint-delay", minimum=0)
        _require_int(self.active_chunks_per_dimension, "active-chunks-per-dimension", minimum=1)
        _require_int(self.preferred_dataset_splits, "preferred-dataset-splits", minimum=1)
        require(self.preferred_dataset_splits <= MAX_DATASET_SPLITS, "preferred-dataset-splits",
                f"must be at most {MAX_DATASET_SPLITS}, got {self.preferred_dataset_splits} (each split is a chunk "
                f"that every group member carries through every phase: more cannot be simulated in reasonable time)")
        impls: dict[str, tuple[str, ...]] = {}
        for coll, names in dict(self.implementations).items():
            require(coll in COLLECTIVES, "implementations",
                    f"keys must be {', '.join(COLLECTIVES)}, got {coll!r}")
            names = (names,) if isinstance(names, str) else tuple(names)
            for name in names:
                require(name in IMPLEMENTATIONS, _impl_key(coll),
                        f"entries must be one of {', '.join(IMPLEMENTATIONS)}, got {name!r}")
            impls[coll] = names
        object.__setattr__(self, "implementations", MappingProxyType(impls))
        for value, key in ((self.local_mem_bw_GBps, "local-mem-bw"),
                           (self.peak_perf_TFLOPS, "peak-perf")):
            require(value is None or (_is_number(value) and value > 0), key,
                    f"must be a positive number or absent, got {value!r}")
        object.__setattr__(self, "roofline_enabled", bool(self.roofline_enabled))
        object.__setattr__(self, "extra", tuple((str(k), v) for k, v in self.extra))

    def __hash__(self) -> int:
        # The implementation map and ``extra`` values are not hashable as stored; hash a
        # canonical form so systems can key caches.
        return hash((self.scheduling_policy, self.collective_optimization, self.endpoint_delay_ns,
                     self.active_chunks_per_dimension, self.preferred_dataset_splits,
                     tuple(sorted(self.implementations.items())), self.local_mem_bw_GBps,
                     self.peak_perf_TFLOPS, self.roofline_enabled, repr(self.extra)))

    def implementation_list(self, collective: str) -> tuple[str, ...]:
        """The per-dimension implementations of ``collective``; a missing list is an error
        because the real simulator then never completes the collective."""
        impls = self.implementations.get(collective)
        if not impls:
            raise UserError(_impl_key(collective), "missing: the simulator aborts on a collective "
                                                   "without its implementation list")
        return impls


def _impl_key(collective: str) -> str:
    return collective.lower().replace("_", "-") + "-implementation"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_int(value: object, key: str, minimum: int) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key,
            f"must be an integer >= {minimum}, got {value!r}")


# -- §1, §2: one message, one reduction -----------------------------------------------------------

class Network(Topology):
    """The network dimensions with each rank's coordinates precomputed, and a delay cache.

    Message delays are looked up millions of times in large collectives, so they are memoised
    per (source, destination, bytes).
    """

    def __init__(self, dims: Sequence[NetworkDim]) -> None:
        super().__init__(dims)
        self._bpns = [d.bytes_per_ns for d in self.dims]
        self._cache: dict[tuple[int, int, int], int] = {}
        self._rings: dict[int, tuple[tuple[int, ...], ...]] = {}

    def delay(self, src: int, dst: int, size: int) -> int:
        """§1: floor(hops * latency + bytes / bandwidth) on the lowest differing dimension."""
        key = (src, dst, size)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        a, b = self.coords[src], self.coords[dst]
        value = 0
        for d, (x, y) in enumerate(zip(a, b)):
            if x != y:
                dim = self.dims[d]
                value = math.floor(dim.hops(x, y) * dim.latency_ns + size / self._bpns[d])
                break
        self._cache[key] = value
        return value

    def ring_of(self, rank: int, dim: int) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only in dimension ``dim``, by coordinate."""
        stride = math.prod(d.npus for d in self.dims[:dim])
        base = rank - self.coords[rank][dim] * stride
        return tuple(base + k * stride for k in range(self.dims[dim].npus))

    def rings(self, dim: int) -> tuple[tuple[int, ...], ...]:
        """Every ring of dimension ``dim`` (memoised: plans are rebuilt per collective)."""
        found = self._rings.get(dim)
        if found is None:
            stride = math.prod(d.npus for d in self.dims[:dim])
            n = self.dims[dim].npus
            found = tuple(tuple(base + k * stride for k in range(n))
                          for base in range(self.n_ranks) if (base // stride) % n == 0)
            self._rings[dim] = found
        return found


def message_delay(network: Sequence[NetworkDim] | Network, src: int, dst: int, size: int) -> int:
    """§1: the time one message of ``size`` bytes takes from rank ``src`` to rank ``dst``."""
    net = network if isinstance(network, Network) else Network(network)
    return net.delay(src, dst, size)


def reduction_cost(system: AstraSystem, size: int) -> int:
    """§2: R(m) = 3 * floor(m / (local-mem-bw * 1e9) * 1e9); 0 without local-mem-bw.

    Local memory bandwidth is decimal GB/s here, unlike the network's 2^30.
    """
    if system.local_mem_bw_GBps is None:
        return 0
    return 3 * math.floor(size / (system.local_mem_bw_GBps * 1e9) * 1e9)


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


# -- §7: the workload layer -------------------------------------------------------------------

@dataclass
class AstraRunResult:
    """Per-rank results, as ASTRA-sim prints them (``sys[r] finished, T cycles, exposed
    communication X cycles``, and ``GPU time`` / ``Comm time``)."""

    finished_ns: dict[int, int]
    exposed_comm_ns: dict[int, int]
    gpu_time_ns: dict[int, int]
    comm_time_ns: dict[int, int]

    @property
    def step_time_ns(self) -> int:
        """The largest finish time over ranks: the step time."""
        return max(self.finished_ns.values(), default=0)


def compute_duration_ns(node: TraceNode, system: AstraSystem) -> int:
    """§7: replay duration_micros * 1000 (0 gives 1 ns), or the roofline time
    floor(num_ops / min(local-mem-bw * 1e9 * num_ops / tensor_size, peak-perf * 1e12) * 1e9).
    Host (is_cpu_op) nodes are always replayed."""
    if not system.roofline_enabled or node.attrs.get("is_cpu_op") is True:
        return replay_ns(node.duration_micros)
    return roofline_ns(_int_attr(node, "num_ops", 0), _int_attr(node, "tensor_size", 0), system, node.id)


def roofline_ns(num_ops: int, tensor_size: int, system: AstraSystem, node_id: int | None = None) -> int:
    """The simulator's roofline time of a compute node (roofline-enabled 1)."""
    where = f"node {node_id} " if node_id is not None else ""
    require(tensor_size > 0, f"{where}tensor_size",
            "roofline compute needs tensor_size > 0 (the simulator skips the node and stalls)")
    require(num_ops > 0, f"{where}num_ops", "roofline compute needs num_ops > 0")
    require(system.local_mem_bw_GBps is not None and system.peak_perf_TFLOPS is not None,
            "roofline-enabled", "needs local-mem-bw and peak-perf")
    perf = min(system.local_mem_bw_GBps * 1e9 * (float(num_ops) / float(tensor_size)),
               system.peak_perf_TFLOPS * 1e12)
    return int(float(num_ops) / perf * 1e9)


def _int_attr(node: TraceNode, name: str, default: int | None = None) -> int:
    value = node.attrs.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"node {node.id} {name}", f"must be an integer attribute, got {value!r}")
    return value


def simulate_astra(ranks: Mapping[int, Sequence[TraceNode]], groups: Mapping[str, Sequence[int]],
                   system: AstraSystem, network: Sequence[NetworkDim]) -> AstraRunResult:
    """Replay every rank's Chakra nodes as ASTRA-sim's congestion-unaware binary would (§7).

    At time 0 and whenever a node completes, a rank issues its dependency-free nodes in id
    order; compute needs the rank's one compute slot, collectives and sends its one
    communication slot, receives no slot. Sends finish at issue + D; receives at
    max(posted, arrival); a collective starts on each rank when that rank issues it and couples
    the ranks of its group. Inputs the simulator would abort or hang on are a UserError.
    """
    from stage_cosim.adapters.astra_sim.analytical import replay_checked
    from stage_cosim.trace.traceset import from_nodes

    ts = from_nodes({r: list(ns) for r, ns in ranks.items()}, {str(k): list(v) for k, v in groups.items()})
    return replay_checked(ts, system, network, "traces").result()
