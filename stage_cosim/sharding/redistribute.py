"""Redistribution: a tensor's change of placement becomes the collectives that make it.

:class:`PassState` is what one pass (forward, or backward with its recomputation) of a block
builds up while its ops are propagated: the steps so far, each tensor's placement and the
steps that produce it. :meth:`PassState.redistribute` moves a tensor to the placement an op
requires: where its current placement differs, the placement change on each axis
(:func:`~stage_cosim.sharding.placement.collective_for`) is the collective. Every intermediate
placement is remembered, so another op needing part of the way reuses it, and the backward
starts from what the forward kept.
"""

from __future__ import annotations

import sympy as sp

from stage_cosim.graph.dims import degree_symbol
from stage_cosim.graph.ir import Tensor
from stage_cosim.parallel.axes import BLOCK_AXES, group_name
from stage_cosim.sharding.layout import DATA_PARALLEL, Placements, compute_placement, local_bytes
from stage_cosim.sharding.placement import Collective, Partial, Shard, collective_for
from stage_cosim.sharding.steps import ShardingPolicy, Step


class PassState:
    """The steps, placements and producers of one pass, and the redistributions it made."""

    def __init__(self, policy: ShardingPolicy, phase_default: str, placements: dict[Tensor, Placements],
                 weights: list[Tensor]) -> None:
        self.policy = policy
        self.phase_default = phase_default
        self.placements = placements
        self.steps: list[Step] = []
        self.producers: dict[Tensor, tuple[int, ...]] = {}
        self.memo: dict[tuple[int, Placements], Tensor] = {}
        self.gathered: dict[tuple[int, Placements], bool] = {}   # did an all-gather make it
        self.origin: dict[tuple[int, Placements], Tensor] = {}   # what it was made from here
        self.reads: dict[int, dict[int, Tensor]] = {}             # tensor -> what it was read from
        self.aliases: dict[int, Tensor] = {}                      # a mesh change's output -> its data
        self.weights = weights
        self.pairs = 0                          # send/recv pairs so far (the ring's steps)
        self.gathered_bytes = sp.Integer(0)     # K/V gathered over cp (the all-gather exchange)
        self.transient = sp.Integer(0)          # ring and all-to-all buffers (the exchange rule)

    # -- placements --------------------------------------------------------------------------

    def stored(self, w: Tensor) -> Placements:
        """Where a weight lives between uses: as computed, and under ZeRO-3 also sharded (on
        its first label) over the data-parallel axes."""
        zero3 = self.policy.zero == 3
        return tuple(Shard(w.labels[0]) if zero3 and dpar and p is not None else p
                     for p, dpar in zip(compute_placement(w), DATA_PARALLEL))

    def placement(self, t: Tensor) -> Placements:
        if t not in self.placements:
            if t.kind == "weight":
                self.placements[t] = self.stored(t)
            else:
                raise KeyError(f"tensor {t.name} has no placement")
        return self.placements[t]

    # -- steps ----------------------------------------------------------------------------------

    def collective(self, name: str, coll: Collective, axes: tuple[str, ...], nbytes: sp.Expr,
                   deps: tuple[int, ...], phase: str) -> int:
        idx = len(self.steps)
        self.steps.append(Step(idx, name, phase, "collective", group_name(axes), sp.Integer(0), sp.Integer(0),
                               sp.Integer(0), deps, collective=coll, axes=axes, comm_bytes=nbytes))
        return idx

    # -- redistribution -------------------------------------------------------------------------

    def redistribute(self, t: Tensor, want: Placements, phase: str) -> Tensor:
        """``t`` moved to placement ``want`` (None entries: left as they are), one collective per
        axis that changes. Every intermediate placement is remembered, so another op needing
        part of the way reuses it (and the backward reuses what the forward kept)."""
        have = self.placement(t)
        if have == want:
            self._read(t, t)
            return t
        key = (id(t), want)
        if key in self.memo:
            self._read(t, self.origin[key])
            return self.memo[key]
        # Reductions first (they shrink the data: a reduce-scatter before an all-to-all moves
        # less), then the axes in table order.
        order = sorted(range(len(BLOCK_AXES)), key=lambda i: not isinstance(have[i], Partial))
        path: list[tuple[int, Placements]] = []
        cur_pl = have
        for i in order:
            if want[i] is None or cur_pl[i] == want[i]:
                continue
            cur_pl = cur_pl[:i] + (want[i],) + cur_pl[i + 1:]
            path.append((i, cur_pl))
        start, cur, cur_pl, origin = 0, t, have, t
        for j in range(len(path) - 1, -1, -1):
            if (id(t), path[j][1]) in self.memo:
                start, cur, cur_pl = j + 1, self.memo[(id(t), path[j][1])], path[j][1]
                origin = self.origin[(id(t), cur_pl)]
                break
        self._read(t, origin)
        deps = self.producers.get(cur, ())
        gathered = self.gathered.get((id(t), cur_pl), False)
        for i, new_pl in path[start:]:
            axis = BLOCK_AXES[i]
            coll = collective_for(cur_pl[i], new_pl[i])
            nxt = Tensor(f"{t.name}@{axis}:{new_pl[i]!r}", t.labels, t.dtype, t.kind, t.tp_shard,
                         t.residual, t.grad_of, mesh=t.mesh)
            if coll is not None:
                idx = self.collective(f"{t.name}.{coll.short.lower()}_{axis}", coll, (axis,),
                                      local_bytes(cur, cur_pl), deps, phase)
                deps = (idx,)
                if axis == "cp" and coll in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
                    # K/V gathered for attention (and their unreduced gradients) live only for
                    # the op; nothing of it exists while cp = 1
                    cp = degree_symbol("cp")
                    full = local_bytes(cur, cur_pl) * (cp if coll == Collective.ALL_GATHER else 1)
                    self.gathered_bytes += full * sp.Min(cp - 1, 1)
            gathered = gathered or coll is Collective.ALL_GATHER
            self.placements[nxt] = new_pl
            self.producers[nxt] = deps
            self.memo[(id(t), new_pl)] = nxt
            self.gathered[(id(t), new_pl)] = gathered
            self.origin[(id(t), new_pl)] = origin
            cur, cur_pl = nxt, new_pl
        return cur

    def _read(self, t: Tensor, origin: Tensor) -> None:
        """``t`` was read starting from ``origin`` (itself, or a redistributed copy kept)."""
        self.reads.setdefault(id(t), {})[id(origin)] = origin

    def reuse(self, kept: dict[tuple[int, Placements], Tensor], gathered: dict) -> None:
        """Start from the forward's kept redistributions (see :meth:`kept`)."""
        for key, tensor in kept.items():
            self.memo[key] = tensor
            self.gathered[key] = gathered[key]
            self.origin[key] = tensor

    def kept(self, replayed: set[int]) -> dict[tuple[int, Placements], Tensor]:
        """The redistributed forward tensors the backward reuses rather than redistributes
        again: all but those an all-gather made (those are gathered again, keeping only the
        shard, as Megatron's sequence-parallel layers do) and those recomputation replays."""
        return {k: v for k, v in self.memo.items() if not self.gathered[k] and k[0] not in replayed}
