"""The rules of the MoE token dispatcher's ops: the mesh change and the permutations.

Tokens cross between the meshes unmoved: a ``mesh_change`` re-reads a tensor split by tokens
(every rank of a stage holding its own) on the other mesh. The routed tokens' permutation into
expert order (``permute``, dispatch) and back (``unpermute``, combine) require and produce the
layouts of the token dispatcher: with ``alltoall`` every expert axis splits the token slots,
so the experts' need for their own experts' tokens (``Shard(e)`` over ep) is an all-to-all and
expert_tp's for all of them an all-gather; with ``allgather`` the tokens are gathered over ep
and expert_tp before the permutation, and the combined outputs are partial sums reduced after.
"""

from __future__ import annotations

import sympy as sp

from stage_cosim.graph.ir import Op, Tensor
from stage_cosim.parallel.axes import AXIS, BLOCK_AXES
from stage_cosim.sharding.layout import Placements, local_numel, token_layout
from stage_cosim.sharding.placement import PARTIAL, REPLICATE, Partial, Placement, Shard
from stage_cosim.sharding.redistribute import PassState
from stage_cosim.sharding.rules import Rule, register

# The expert axes over which each token dispatcher gathers the tokens before permuting them
# (the others exchange permuted token slots).
_GATHERED: dict[str, tuple[str, ...]] = {"alltoall": (), "flex": (), "allgather": ("ep", "expert_tp")}


@register("mesh_change")
class MeshChange(Rule):
    def run(self, pas: PassState, op: Op, phase: str) -> None:
        """Each input in the token layout of its mesh is its output in the token layout of the
        other: the same data, no step."""
        deps: list[int] = []
        for t, out in zip(op.inputs, op.outputs):
            lt = pas.redistribute(t, token_layout(t), phase)
            deps.extend(pas.producers.get(lt, ()))
            pas.placements[out] = token_layout(out)
            pas.aliases[id(out)] = lt
        for out in op.outputs:
            pas.producers[out] = tuple(sorted(set(deps)))


@register("permute", "unpermute")
class Route(Rule):
    def run(self, pas: PassState, op: Op, phase: str) -> None:
        """Permutation into expert order (``permute``) or back (``unpermute``) on the expert
        mesh. Token tensors (label ``n``) and token slots (``c``) are split as the dispatcher
        lays them out; the kernel is memory-bound."""
        gathered = _GATHERED[pas.policy.moe_token_dispatcher]
        deps: list[int] = []
        local_inputs: list[Tensor] = []
        partial = [False] * len(BLOCK_AXES)
        for t in op.inputs:
            have = pas.placement(t)
            want: list[Placement | None] = []
            for i, axis in enumerate(BLOCK_AXES):
                if AXIS[axis].mesh != t.mesh:
                    want.append(None)
                elif axis not in gathered:
                    want.append(Shard("c") if "c" in t.labels else Shard("n") if "n" in t.labels else REPLICATE)
                elif "c" in t.labels and isinstance(have[i], Partial):
                    want.append(PARTIAL)            # a partial sum stays one through the combine
                    partial[i] = True
                else:
                    want.append(Shard("e") if "c" in t.labels and AXIS[axis].shards == "e" else REPLICATE)
            lt = pas.redistribute(t, tuple(want), phase)
            local_inputs.append(lt)
            deps.extend(pas.producers.get(lt, ()))
        out_pls: list[Placements] = []
        for out in op.outputs:
            pl: list[Placement | None] = []
            for i, axis in enumerate(BLOCK_AXES):
                if AXIS[axis].mesh != out.mesh:
                    pl.append(None)
                elif axis not in gathered:
                    pl.append(Shard("c") if "c" in out.labels else Shard("n"))
                elif "c" in out.labels:
                    pl.append(Shard("e") if AXIS[axis].shards == "e" else REPLICATE)
                else:   # tokens summed from the experts held here: the other ranks' are missing
                    pl.append(PARTIAL if AXIS[axis].shards == "e" or partial[i] else REPLICATE)
            out_pls.append(tuple(pl))
        flops = op.flops_per_element * local_numel(op.outputs[0], out_pls[0])
        idx = self.compute(pas, op, phase, local_inputs, out_pls, flops, sp.Integer(0), deps)
        for out, pl in zip(op.outputs, out_pls):
            pas.placements[out] = pl
            pas.producers[out] = (idx,)
