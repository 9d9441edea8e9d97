"""Pass and block runs kept from one simulation to the next (the search's candidates).

The fast path (:mod:`.fast`) times each pass template, and each kind of block, on its own: a
replay of one agent that depends on nothing but the rows it replays (each row's kernel or
communication and its dependencies), what the network's costs of the stage's groups depend on
(:meth:`~.network.CalibratedNetwork.cost_key`), the point-to-point costs of its messages, the
network and the kernel model. Candidates of a search share most of them: ZeRO 0-2 leave the
passes alone, the data-parallel degree only resizes groups the passes do not use, the middle
stages of a pipeline hold alike layers. Keyed by exactly those inputs, a run kept from an
earlier simulation is the run a fresh one computes, to the bit.

Reuse is on only inside :func:`reuse_runs` (the search's evaluations): a lone ``simulate`` or a
serving run, whose steps rarely repeat a template, does not pay for the keys.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Hashable, Iterator, NamedTuple

from stage_cosim.schedule.template_cache import HashedKey as Key

# How many replayed nodes the kept runs may hold in all (their start and end times and spans:
# under 200 bytes a node), the least recently used dropped first: under 200 MB.
LIMIT_NODES = 1_000_000


# Each distinct rows content once, as a Key: keys that hold it then compare it by identity (a
# new template's content is compared in full once, here, not in every key that holds it)
_CONTENTS: dict[Key, Key] = {}
CONTENTS_LIMIT = 512


def interned(parts: tuple) -> Key:
    """The one Key of ``parts`` (equal parts: the same object)."""
    key = Key(parts)
    found = _CONTENTS.get(key)
    if found is not None:
        return found
    if len(_CONTENTS) >= CONTENTS_LIMIT:
        _CONTENTS.clear()
    _CONTENTS[key] = key
    return key


class RunCache:
    """Runs by key, least recently used first out once they hold more than ``limit`` nodes."""

    def __init__(self, limit: int = LIMIT_NODES) -> None:
        self.limit = limit
        self.runs: OrderedDict[Hashable, Any] = OrderedDict()
        self.nodes = 0
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Any:
        run = self.runs.get(key)
        if run is None:
            self.misses += 1
            return None
        self.hits += 1
        self.runs.move_to_end(key)
        return run[0]

    def put(self, key: Hashable, run: Any, size: int | None = None) -> None:
        """Keep ``run`` (``size``: the nodes it holds, by default its ``end`` times')."""
        size = len(run.end) if size is None else size
        if size > self.limit or key in self.runs:
            return
        self.runs[key] = (run, size)
        self.nodes += size
        while self.nodes > self.limit:
            _, (_, dropped) = self.runs.popitem(last=False)
            self.nodes -= dropped

    def clear(self) -> None:
        self.runs.clear()
        self.nodes = self.hits = self.misses = 0


_CACHE = RunCache()
_depth = 0


@contextmanager
def reuse_runs() -> Iterator[RunCache]:
    """Inside, the fast path keeps its pass and block runs and reuses equal ones (they stay
    kept between uses, up to :data:`LIMIT_NODES`)."""
    global _depth
    _depth += 1
    try:
        yield _CACHE
    finally:
        _depth -= 1


def active() -> RunCache | None:
    """The kept runs while :func:`reuse_runs` is on, else None."""
    return _CACHE if _depth else None


def environment(network: Any, compute: Any) -> Hashable | None:
    """What every run depends on besides its rows and groups: the network's identity and the
    kernel model; None for a network that does not say what its costs depend on (nothing is
    then reused)."""
    identity = getattr(network, "identity", None)
    if identity is None or getattr(network, "cost_key", None) is None:
        return None
    return identity, compute


class Content(NamedTuple):
    """What a replay of some rows (or nodes) reads of them, and what it asks the network."""

    rows: Key                      # every column but the names, the phase and the block label
    groups: tuple[str, ...]        # the group kinds of its collectives
    sends: tuple[tuple, ...]       # the distinct (peer, group, bytes) of its sends


# the contents last taken, by the rows list they were taken of (a step's key and its runs' keys
# read the same templates)
_TAKEN: dict[int, tuple[list, Content]] = {}


def rows_content(rows: list[tuple]) -> Content:
    """The :class:`Content` of pass template ``rows``."""
    taken = _TAKEN.get(id(rows))
    if taken is not None and taken[0] is rows:
        return taken[1]
    content = _rows_content(rows)
    if len(_TAKEN) >= 64:
        _TAKEN.clear()
    _TAKEN[id(rows)] = (rows, content)
    return content


def _rows_content(rows: list[tuple]) -> Content:
    sends: dict[tuple, None] = {}
    groups: dict[str, None] = {}
    out = []
    for r in rows:
        out.append((r[1], r[2], r[3], r[5], r[6], r[7], r[8], r[9], r[10], r[13], r[14], r[15], r[16]))
        if r[1] == "COLL":
            groups[r[9]] = None
        elif r[1] == "SEND":
            sends[(r[14], r[9], r[8])] = None
    return Content(interned(tuple(out)), tuple(groups), tuple(sends))


def nodes_content(nodes: list) -> Content:
    """:func:`rows_content` of role-graph nodes (their ids and dependencies left out: the
    program they become says those), the ring's tags numbered by first appearance (they only
    pair a send with its receive)."""
    tags: dict[int, int] = {}
    sends: dict[tuple, None] = {}
    groups: dict[str, None] = {}
    out = []
    for n in nodes:
        tag = n.tag
        if n.type == "COLL":
            groups[n.group] = None
        elif n.type in ("SEND", "RECV"):
            tag = tags.setdefault(tag, len(tags))
            if n.type == "SEND":
                sends[(n.peer, n.group, n.comm_bytes)] = None
        out.append((n.type, n.flops, n.mem_bytes, n.matmul, n.coll, n.comm_bytes, n.group, n.category, n.groups,
                    n.peer, tag, n.keys))
    return Content(interned(tuple(out)), tuple(groups), tuple(sends))


def run_key(env: Hashable, content: Content, network: Any, peer: Any, rank: int,
            members: dict[str, tuple[int, ...]], *extra: Hashable) -> Key:
    """The key of a run of ``content`` by ``rank`` (``members``: its group members by kind;
    ``peer(rank, delta, kind)``: its message peers) with ``extra`` (its exits, sinks, waits …)."""
    groups = tuple(network.cost_key(members[g]) for g in content.groups)
    links = tuple(network.p2p(rank, peer(rank, d, g), nbytes) for d, g, nbytes in content.sends)
    return Key((env, content.rows, groups, links, extra))


def step_key(w: Any, env: Hashable, *flags: Hashable) -> Key:
    """What a simulation of workload ``w``'s step times depends on besides ``env`` and
    ``flags`` (how it is simulated): its stages' graphs, names aside
    (:meth:`~stage_cosim.schedule.nodes.RoleGraph.layout_key`), its meshes (every rank's
    groups and peers) and its communicator groups."""
    memo: dict[int, tuple] = {}

    def template_key(t: Any) -> tuple:
        found = memo.get(id(t))
        if found is None:
            segments = None if t.segments is None else tuple((lo, hi, entry) for _, lo, hi, entry, _ in t.segments)
            found = memo[id(t)] = (rows_content(t.rows).rows, tuple(t.exits), tuple(t.sinks), segments,
                                   t.last_prologue, t.pairs)
        return found

    roles = tuple(role.layout_key(template_key) for role in w.roles)
    return Key(("step", env, flags, tuple(sorted(w.meshes.items())), tuple(w.group_base.items()), roles))
