"""Sharding propagation: a block's logical ops become one rank's steps, collectives inferred.

For every op and every mesh axis that shards tensors inside a block (the table
:data:`~stage_cosim.parallel.axes.AXES`), one label is chosen as the op's *sharded label* on
that axis (Megatron's strategy, stated as two rules):

* a *label axis* shards its label whenever the op touches it (``dp``: the micro-batch ``b``);
* the *tensor-parallel* rule (``tp``): the label a weight operand (or weight-gradient result) is
  sharded on; otherwise the residual-stream layout for ops that run in it (``s`` with sequence
  parallelism, nothing without); otherwise whatever label an activation input is already
  sharded on.

An op that cannot run with that label sharded (a norm over ``h``) gets none. An op runs on
the mesh its results live on (the dense mesh, or for expert layers the expert mesh) and only
that mesh's axes shard it; a tensor's placement on the other mesh's axes is None.

Tokens cross between the meshes unmoved: a ``mesh_change`` re-reads a tensor split by tokens
(every rank of a stage holding its own) on the other mesh. The routed tokens' permutation into
expert order (``permute``, dispatch) and back (``unpermute``, combine) require and produce the
layouts of the token dispatcher: with ``alltoall`` every expert axis splits the token slots,
so the experts' need for their own experts' tokens (``Shard(e)`` over ep) is an all-to-all and
expert_tp's for all of them an all-gather; with ``allgather`` the tokens are gathered over ep
and expert_tp before the permutation, and the combined outputs are partial sums reduced after.

Each operand must then be ``Shard(label)`` if it has the label and ``Replicate()`` if not, and
the result is ``Shard(label)`` if it keeps the label and ``Partial()`` if the op summed it away.
Where an operand's current placement differs from the required one, the placement change
(:func:`~stage_cosim.sharding.placement.collective_for`) is the collective. The backward pass is
propagated by the same rules, so Megatron's conjugate collectives, the sequence-parallel
re-gathers and the ZeRO-3 re-gathers are derived rather than listed.

Weights are computed replicated over the *data-parallel* axes (those that hold weight
replicas); their gradients leave the backward Partial there, and the once-per-step reduction
runs over all of a mesh's data-parallel axes together, as one communicator group, which is
also the group ZeRO shards over.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import sympy as sp

from stage_cosim.graph.autodiff import differentiate
from stage_cosim.graph.cost import op_flops
from stage_cosim.graph.dims import DTYPE_BYTES, LABEL_SIZE, L, degree_symbol
from stage_cosim.graph.ir import ATTENTION_KINDS, Block, Op, Tensor
from stage_cosim.graph.precision import BF16, Precision, apply_precision
from stage_cosim.parallel.axes import AXIS, BLOCK_AXES, data_parallel_axes, group_name
from stage_cosim.parallel.config import RECOMPUTE
from stage_cosim.sharding.placement import (
    PARTIAL, REPLICATE, Collective, Partial, Placement, Shard, collective_for,
)

# The expert axes over which each token dispatcher gathers the tokens before permuting them
# (the others exchange permuted token slots).
_GATHERED: dict[str, tuple[str, ...]] = {"alltoall": (), "allgather": ("ep", "expert_tp")}
# Whether each block axis holds weight replicas, in BLOCK_AXES order.
_DATA_PARALLEL = tuple(AXIS[a].data_parallel for a in BLOCK_AXES)

# Per-axis placements of one tensor, in BLOCK_AXES order (None: an axis of another mesh).
Placements = tuple[Placement | None, ...]


def _on(mesh: str) -> tuple[bool, ...]:
    return tuple(AXIS[a].mesh == mesh for a in BLOCK_AXES)


@dataclass(frozen=True)
class ShardingPolicy:
    """The execution choices that change a block's sharded program (not its sizes)."""

    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    # Megatron accumulates and reduces bf16 training's gradients in fp32 by default.
    grad_reduce_dtype: str = "fp32"
    # BF16, or the FP8 recipe that rewrites the layers' GEMMs and inserts their casts.
    precision: Precision = BF16
    moe_token_dispatcher: str = "alltoall"
    # The attention exchange over cp (numbers, because they decide how many steps there are):
    # ranks passing K/V round a ring, ranks swapping heads for sequence by all-to-all (1, 1:
    # the placement rules' all-gather of K and V), and whether the sequence is load-balanced.
    cp_ring: int = 1
    cp_a2a: int = 1
    cp_load_balance: bool = True

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0..3, got {self.zero}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute}")
        if self.cp_ring < 1 or self.cp_a2a < 1:
            raise ValueError(f"cp_ring and cp_a2a must be positive, got {self.cp_ring}, {self.cp_a2a}")


@dataclass
class Step:
    """One node of a rank's program: a compute kernel or a collective."""

    index: int
    name: str
    phase: str                 # "fwd", "bwd" or "recompute"
    kind: str                  # "compute", "collective", "send" or "recv"
    category: str              # compute: the op kind; communication: its group's name
    flops: sp.Expr
    model_flops: sp.Expr
    mem_bytes: sp.Expr         # bytes read plus written
    deps: tuple[int, ...]
    collective: Collective | None = None
    axes: tuple[str, ...] = ()  # collective: the mesh axes its group spans
    comm_bytes: sp.Expr = sp.Integer(0)
    # Matmul-class kernels: the tensor-core number format ("bf16", "fp8", "mxfp8"); "" for
    # every other kernel. (Truthy exactly for the FLOPs the published formulas count.)
    matmul: str = ""
    # A grouped GEMM: this many equal GEMMs in one kernel (one per local expert), each as
    # efficient as its own shape allows. A fused attention kernel: the rows of work its thread
    # blocks split (:func:`attention_rows`), which decide how many SMs it keeps busy.
    groups: sp.Expr = sp.Integer(1)
    prologue: bool = False     # gathers the block's weights (ZeRO-3): may run a block ahead
    first_microbatch: bool = False   # runs in the first micro-batch's forward only (FP8 weight cache)
    # send / recv: the peer's coordinate on the first of ``axes``, relative to this rank's, and
    # which send/recv pair of the pass this is (a send and the receive it feeds share it)
    peer: int = 0
    pair: int = -1
    # fused attention kernels: the length of each thread block's loop as a share of the layer's
    # keys (the sequence, or its window): the keys each query sees in this kernel (a step of the
    # ring: a chunk, or half of one); 0 for other steps
    key_share: float = 0.0


@dataclass(frozen=True)
class WeightSync:
    """One weight's gradient reductions, once per step after the last micro-batch's backward
    (from where the backward leaves the gradient to where the optimizer wants it)."""

    weight: Tensor
    params: sp.Expr                                       # elements held per rank before ZeRO
    # (the mesh axes of its group, collective, bytes), in order
    grad_collectives: tuple[tuple[tuple[str, ...], Collective, sp.Expr], ...]
    replicas: tuple[str, ...]                             # the data-parallel axes ZeRO shards over
    param_bytes: float = 2.0                              # bytes per parameter as stored (bf16; FP8 params)


@dataclass
class ShardedBlock:
    block: Block
    policy: ShardingPolicy
    fwd: list[Step]
    bwd: list[Step]
    fwd_exit: tuple[int, ...]          # steps that produce the block's output
    bwd_exit: tuple[int, ...]          # steps that produce the gradient of the block's input
    saved_bytes: sp.Expr               # activations kept from forward to backward, one micro-batch
    workspace_bytes: sp.Expr           # transient activations while recomputing (full recompute)
    weight_syncs: list[WeightSync]
    boundary_bytes: sp.Expr            # the output activation (and its gradient) on one rank
    # FP8: the quantized weight copies kept across micro-batches, and the number of FP8 modules
    # (GEMMs, FP8 attention) that each keep a scaling state.
    cached_bytes: sp.Expr = sp.Integer(0)
    fp8_modules: int = 0
    cache_bytes: sp.Expr = sp.Integer(0)   # the KV cache an inference step reads, on one rank
    # transient buffers of the attention exchange (ring receive buffers, gathered K/V)
    exchange_bytes: sp.Expr = sp.Integer(0)


def _degree(axis: str) -> sp.Symbol:
    return degree_symbol(axis)



def compute_placement(w: Tensor) -> Placements:
    """Where a weight is when an op reads it: sharded on its tensor-parallel label (or on a
    label axis's label it has, other than over data-parallel axes), replicated elsewhere."""
    out: list[Placement | None] = []
    for axis in BLOCK_AXES:
        rule = AXIS[axis]
        if rule.mesh != w.mesh:
            out.append(None)
        elif rule.shards is None:
            out.append(Shard(w.tp_shard) if w.tp_shard else REPLICATE)
        elif not rule.data_parallel and rule.shards in w.labels:
            out.append(Shard(rule.shards))
        else:
            out.append(REPLICATE)
    return tuple(out)


def weight_replicas(w: Tensor) -> tuple[str, ...]:
    """The data-parallel axes that hold replicas of ``w`` (its gradient and ZeRO group)."""
    return data_parallel_axes(w.mesh)


def token_layout(t: Tensor) -> Placements:
    """``t`` split by tokens over every axis of its mesh (each axis shards its token label,
    if ``t`` has it): the layout in which a stage's ranks each hold their own tokens."""
    return tuple(None if AXIS[a].mesh != t.mesh else
                 Shard(AXIS[a].tokens) if AXIS[a].tokens in t.labels else REPLICATE for a in BLOCK_AXES)


def local_numel(t: Tensor, pl: Placements) -> sp.Expr:
    n = t.numel()
    for axis, p in zip(BLOCK_AXES, pl):
        if isinstance(p, Shard) and p.label in t.labels:
            n = n / _degree(axis)
    return n


def local_bytes(t: Tensor, pl: Placements) -> sp.Expr:
    return local_numel(t, pl) * DTYPE_BYTES[t.dtype]


class _Pass:
    """Propagates one pass (forward, or backward with its recomputation) of one block."""

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
        if policy.zero == 3 and weights:
            # ZeRO-3 keeps parameters sharded over their data-parallel group and gathers a
            # whole block (one gather per group) before each pass.
            groups: dict[tuple[str, ...], list[Tensor]] = {}
            for w in weights:
                groups.setdefault(weight_replicas(w), []).append(w)
            for axes, ws in groups.items():
                nbytes = sp.Add(*(local_bytes(w, self.stored(w)) for w in ws))
                name = f"{phase_default}.zero3_gather" if len(groups) == 1 else \
                    f"{phase_default}.zero3_gather_{group_name(axes)}"
                idx = self._collective(name, Collective.ALL_GATHER, axes, nbytes, deps=(), phase=phase_default)
                self.steps[idx].prologue = True
                for w in ws:
                    self.placements[w] = compute_placement(w)
                    self.producers[w] = (idx,)

    # -- placements --------------------------------------------------------------------------

    def stored(self, w: Tensor) -> Placements:
        """Where a weight lives between uses: as computed, and under ZeRO-3 also sharded (on
        its first label) over the data-parallel axes."""
        zero3 = self.policy.zero == 3
        return tuple(Shard(w.labels[0]) if zero3 and dpar and p is not None else p
                     for p, dpar in zip(compute_placement(w), _DATA_PARALLEL))

    def placement(self, t: Tensor) -> Placements:
        if t not in self.placements:
            if t.kind == "weight":
                self.placements[t] = self.stored(t)
            else:
                raise KeyError(f"tensor {t.name} has no placement")
        return self.placements[t]

    # -- steps ----------------------------------------------------------------------------------

    def _collective(self, name: str, coll: Collective, axes: tuple[str, ...], nbytes: sp.Expr,
                    deps: tuple[int, ...], phase: str) -> int:
        idx = len(self.steps)
        self.steps.append(Step(idx, name, phase, "collective", group_name(axes), sp.Integer(0), sp.Integer(0),
                               sp.Integer(0), deps, collective=coll, axes=axes, comm_bytes=nbytes))
        return idx

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
                idx = self._collective(f"{t.name}.{coll.short.lower()}_{axis}", coll, (axis,),
                                       local_bytes(cur, cur_pl), deps, phase)
                deps = (idx,)
                if axis == "cp" and coll in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
                    # K/V gathered for attention (and their unreduced gradients) live only for
                    # the op; nothing of it exists while cp = 1
                    full = local_bytes(cur, cur_pl) * (_degree("cp") if coll == Collective.ALL_GATHER else 1)
                    self.gathered_bytes += full * sp.Min(_degree("cp") - 1, 1)
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

    # -- the sharded label of an op on each axis ---------------------------------------------

    @staticmethod
    def _operands(op: Op) -> list[tuple[Tensor, str]]:
        """(tensor, the letters the op calls its dimensions) for every input."""
        return list(zip(op.inputs, op.letters()[0]))

    def _out_letters(self, op: Op) -> list[str]:
        return op.letters()[1]

    def choose(self, op: Op) -> tuple[str | None, ...]:
        """The op's sharded label on each block axis (None: not sharded on it)."""
        operands = self._operands(op)
        all_letters = set("".join(l for _, l in operands) + "".join(self._out_letters(op)))
        chosen: list[str | None] = []
        for i, axis in enumerate(BLOCK_AXES):
            if AXIS[axis].mesh != op.mesh:
                chosen.append(None)
                continue
            label = AXIS[axis].shards
            if label is None:
                label = self._tensor_parallel_label(op, operands, i)
            elif label not in all_letters:
                # an op over the cached key sequence alone (inference): the axis's key label
                label = AXIS[axis].keys if AXIS[axis].keys and AXIS[axis].keys in all_letters else None
            if label is not None and (label in op.unsharded or axis in op.replicated_over):
                label = None
            chosen.append(label)
        return tuple(chosen)

    def _tensor_parallel_label(self, op: Op, operands: list[tuple[Tensor, str]], i: int) -> str | None:
        """Megatron's tensor parallelism: a weight operand's (or weight-gradient result's)
        shard label; else the residual-stream layout; else what an activation input is
        already sharded on over this axis."""
        for t, letters in operands:
            if t.kind == "weight" and t.tp_shard:
                return letters[t.labels.index(t.tp_shard)]
        for out in op.outputs:
            if out.kind == "weight_grad" and out.tp_shard:
                return out.tp_shard
        if op.residual:
            return _residual_label(self.policy)
        for t, letters in operands:
            p = self.placement(t)[i]
            if t.kind != "weight" and isinstance(p, Shard) and p.label in t.labels:
                return letters[t.labels.index(p.label)]
        return None

    # -- ops --------------------------------------------------------------------------------------

    def run(self, op: Op, phase: str) -> None:
        if op.kind == "view":
            self._view(op)
            return
        if op.kind == "mesh_change":
            self._mesh_change(op, phase)
            return
        if op.kind in ("permute", "unpermute"):
            self._route(op, phase)
            return
        if op.kind in ATTENTION_KINDS and (self.policy.cp_ring > 1 or self.policy.cp_a2a > 1):
            self._attention_exchange(op, phase)
            return
        labels = self.choose(op)
        operands = self._operands(op)
        partial = self._partial_axes(op, labels)
        on = _on(op.mesh)
        local_inputs: list[Tensor] = []
        deps: list[int] = [i for t in op.after for i in self.producers.get(t, ())]
        for t, letters in operands:
            want = tuple(None if not here else PARTIAL if keep else
                         Shard(t.labels[letters.index(l)]) if l is not None and l in letters else REPLICATE
                         for l, keep, here in zip(labels, partial, on))
            if t.kind == "weight":   # replicas over the data-parallel axes (ZeRO-3 gathered them)
                want = tuple(REPLICATE if dpar and w is not None else w for w, dpar in zip(want, _DATA_PARALLEL))
            lt = self.redistribute(t, want, phase)
            local_inputs.append(lt)
            deps.extend(self.producers.get(lt, ()))

        def local(letter: str, _labels=labels) -> sp.Expr:
            n = LABEL_SIZE[letter]
            for axis, l in zip(BLOCK_AXES, _labels):
                if l == letter:
                    n = n / _degree(axis)
            return n

        out_letters = self._out_letters(op)
        out_pls: list[Placements] = []
        for out, letters in zip(op.outputs, out_letters):
            pl: list[Placement | None] = []
            for l, keep, here in zip(labels, partial, on):
                if not here:
                    pl.append(None)
                elif keep:
                    pl.append(PARTIAL)
                elif l is None:
                    pl.append(REPLICATE)
                elif l in letters:
                    pl.append(Shard(out.labels[letters.index(l)]))
                elif op.kind == "cross_entropy" or out.kind == "amax":
                    # the loss is all-reduced inside the op (below); an amax is each rank's own
                    # (or its group's, reduced below)
                    pl.append(REPLICATE)
                else:
                    pl.append(PARTIAL)
            out_pls.append(tuple(pl))

        out_numel = local_numel(op.outputs[0], out_pls[0])
        flops, model_flops = op_flops(op, local, out_numel)
        # Model FLOPs count each distinct computation once: an op that an axis does not shard
        # (a router without sequence parallelism; the logits of an inference step's last tokens,
        # which no longer have a sequence for cp to split) is repeated on every rank of it.
        for axis, l, here in zip(BLOCK_AXES, labels, on):
            if here and l is None:
                model_flops = model_flops / _degree(axis)
        if op.kind in ATTENTION_KINDS and not self.policy.cp_load_balance:
            # Contiguous chunks: the last cp rank's queries see every key before them, the
            # most work of all (2 - 1/cp times the average); the step waits for it, so this
            # rank's graph is that rank's.
            flops *= 2 - 1 / _degree("cp")
        idx = self._compute(op, phase, local_inputs, out_pls, flops, model_flops, deps)
        if op.kind == "einsum" and "e" in "".join(op.einsum_operands()[0]) and op.mesh != "dense":
            self.steps[idx].groups = local("e")     # the experts this rank holds
        if op.kind in ATTENTION_KINDS and (rows := attention_rows(op, local)) is not None:
            self.steps[idx].groups = rows
        last = (idx,)
        if op.amax_group:
            # current scaling of a tensor gathered over a group: one max all-reduce of its amax
            for axis in op.amax_group:
                j = self._collective(f"{op.name}.amax.ar_{axis}", Collective.ALL_REDUCE, (axis,),
                                     sp.Integer(DTYPE_BYTES["fp32"]), last, phase)
                self.steps[j].first_microbatch = op.cached and phase == "fwd"
                last = (j,)
        if op.kind == "cross_entropy":
            # Vocabulary-parallel cross-entropy: the max, the sum of exponentials and the target
            # logit are reductions over the sharded vocabulary, one all-reduce of (b, s) each.
            loss = op.outputs[0]
            for axis, l in zip(BLOCK_AXES, labels):
                if l is not None and l not in loss.labels:
                    for what in ("max", "sum_exp", "target_logit"):
                        j = self._collective(f"{op.name}.{what}.ar_{axis}", Collective.ALL_REDUCE, (axis,),
                                             local_numel(loss, out_pls[0]) * DTYPE_BYTES["fp32"],
                                             last, phase)
                        last = (j,)
        for out, pl in zip(op.outputs, out_pls):
            self.placements[out] = pl
            reduced = out is op.outputs[0] if not op.amax_group else out is op.outputs[-1]
            self.producers[out] = last if reduced else (idx,)

    def _compute(self, op: Op, phase: str, local_inputs: list[Tensor], out_pls: list[Placements],
                 flops: sp.Expr, model_flops: sp.Expr, deps: list[int]) -> int:
        """The kernel step of ``op``: its FLOPs, and the bytes of its local inputs and outputs
        (a gather reads the rows its indices pick, as many as it writes, not the whole table)."""
        if op.kind == "lookup":
            rows = local_bytes(op.outputs[0], out_pls[0])
            mem = local_bytes(local_inputs[1], self.placements[local_inputs[1]]) + 2 * rows
        else:
            mem = op.memory_passes * sp.Add(*(local_bytes(t, self.placements[t]) for t in local_inputs),
                                            *(local_bytes(o, p) for o, p in zip(op.outputs, out_pls)))
        # Model FLOPs count balanced routing: the busiest expert rank's extra load is time, not work.
        model_flops = model_flops.subs(L, 1) if model_flops.has(L) else model_flops
        idx = len(self.steps)
        matmul = (op.precision or "bf16") if op.kind in ("einsum", "attention", "attention_grad") else ""
        self.steps.append(Step(idx, op.name, phase, "compute", op.kind, flops,
                               model_flops if phase != "recompute" else sp.Integer(0), mem,
                               tuple(sorted(set(deps))), matmul=matmul,
                               first_microbatch=op.cached and phase == "fwd",
                               key_share=1.0 if op.kind in ATTENTION_KINDS else 0.0))
        return idx

    def _mesh_change(self, op: Op, phase: str) -> None:
        """Each input in the token layout of its mesh is its output in the token layout of the
        other: the same data, no step."""
        deps: list[int] = []
        for t, out in zip(op.inputs, op.outputs):
            lt = self.redistribute(t, token_layout(t), phase)
            deps.extend(self.producers.get(lt, ()))
            self.placements[out] = token_layout(out)
            self.aliases[id(out)] = lt
        for out in op.outputs:
            self.producers[out] = tuple(sorted(set(deps)))

    def _route(self, op: Op, phase: str) -> None:
        """Permutation into expert order (``permute``) or back (``unpermute``) on the expert
        mesh. Token tensors (label ``n``) and token slots (``c``) are split as the dispatcher
        lays them out; the kernel is memory-bound."""
        gathered = _GATHERED[self.policy.moe_token_dispatcher]
        deps: list[int] = []
        local_inputs: list[Tensor] = []
        partial = [False] * len(BLOCK_AXES)
        for t in op.inputs:
            have = self.placement(t)
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
            lt = self.redistribute(t, tuple(want), phase)
            local_inputs.append(lt)
            deps.extend(self.producers.get(lt, ()))
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
        idx = self._compute(op, phase, local_inputs, out_pls, flops, sp.Integer(0), deps)
        for out, pl in zip(op.outputs, out_pls):
            self.placements[out] = pl
            self.producers[out] = (idx,)

    # -- the attention exchange over cp ---------------------------------------------------------

    def _step(self, name: str, kind: str, phase: str, deps: list[int] | tuple[int, ...], *,
              category: str = "", flops: sp.Expr = sp.S.Zero, model_flops: sp.Expr = sp.S.Zero,
              mem: sp.Expr = sp.S.Zero, nbytes: sp.Expr = sp.S.Zero, peer: int = 0, pair: int = -1,
              matmul: str = "", key_share: float = 0.0) -> int:
        idx = len(self.steps)
        axes = ("cp",) if kind in ("send", "recv") else ()
        self.steps.append(Step(idx, name, phase, kind, category or group_name(axes), flops,
                               model_flops if phase != "recompute" else sp.Integer(0), mem,
                               tuple(sorted(set(deps))), axes=axes, comm_bytes=nbytes, matmul=matmul,
                               peer=peer, pair=pair, key_share=key_share))
        return idx

    def _attention_exchange(self, op: Op, phase: str) -> None:
        """Fused attention whose keys and values arrive in pieces: the one op the placement
        rules cannot express (Transformer Engine's context-parallel attention).

        The operands stay sharded on the sequence over cp. With ``cp_a2a`` > 1 the queries, keys
        and values are first swapped by all-to-all from sequence- to head-sharded inside groups
        of that many cp ranks (DeepSpeed-Ulysses; the output swaps back). With ``cp_ring`` > 1
        the remaining ranks pass K/V round a ring: at each of ``cp_ring`` steps a rank sends the
        K/V chunk it holds to the next rank and receives the previous one's while flash
        attention runs on the chunk it has; the partial outputs are merged by their log-sum-exp.
        The backward runs the ring again with K/V and dK/dV (dK/dV one step behind) and adds up
        each step's gradients. Under the load-balanced split every step costs 1/cp_ring of the
        rank's causal work; with contiguous chunks the last rank works at every step after the
        first (a diagonal half block, then whole blocks) and the ring waits for it.
        """
        pol = self.policy
        forward = op.kind == "attention"
        cp = BLOCK_AXES.index("cp")
        labels = self.choose(op)
        on = _on(op.mesh)

        def placed(t: Tensor, letters: str, grad: bool = False) -> Placements:
            pl: list[Placement | None] = []
            for i, (l, here) in enumerate(zip(labels, on)):
                if not here:
                    pl.append(None)
                elif i == cp:   # every activation keeps its own piece of the sequence (a KV cache its tokens)
                    own = next((label for label in ("s", AXIS["cp"].keys) if label in t.labels), None)
                    pl.append(Shard(own) if own else PARTIAL if grad else REPLICATE)
                elif l is not None and l in letters:
                    pl.append(Shard(t.labels[letters.index(l)]))
                elif grad and l is not None:
                    pl.append(PARTIAL)
                else:
                    pl.append(REPLICATE)
            if t.kind == "weight":
                pl = [REPLICATE if dpar and p is not None else p for p, dpar in zip(pl, _DATA_PARALLEL)]
            return tuple(pl)

        local_inputs: list[Tensor] = []
        ready: list[tuple[int, ...]] = []
        for t, letters in self._operands(op):
            lt = self.redistribute(t, placed(t, letters), phase)
            local_inputs.append(lt)
            ready.append(self.producers.get(lt, ()))

        def local(letter: str) -> sp.Expr:
            n = LABEL_SIZE[letter]
            for axis, l in zip(BLOCK_AXES, labels):
                if l == letter:
                    n = n / _degree(axis)
            return n

        out_pls = [placed(o, letters, grad=not forward) for o, letters in zip(op.outputs, self._out_letters(op))]
        flops, model_flops = op_flops(op, local, local_numel(op.outputs[0], out_pls[0]))
        in_bytes = [local_bytes(t, self.placements[t]) for t in local_inputs]
        out_bytes = [local_bytes(o, pl) for o, pl in zip(op.outputs, out_pls)]
        mem = op.memory_passes * sp.Add(*in_bytes, *out_bytes)
        # forward inputs q, keys, v (and sinks); backward dout, q, keys, v, out, lse
        query = 0 if forward else 1
        keyed = list(op.key_inputs)
        kv = sp.Add(*(in_bytes[i] for i in keyed))
        q_bytes, o_bytes = in_bytes[query], out_bytes[0]
        a2a_axes = ("cp",) if pol.cp_ring == 1 else ("cp_a2a",)
        ring, stride = pol.cp_ring, pol.cp_a2a          # ring neighbours are cp_a2a coordinates apart

        def swap(indices: list[int], deps_of: list[tuple[int, ...]], nbytes: list[sp.Expr],
                 what: str) -> list[tuple[int, ...]]:
            """All-to-all of the given operands (by index) inside the cp_a2a groups."""
            out = list(deps_of)
            if pol.cp_a2a > 1:
                for i in indices:
                    out[i] = (self._collective(f"{op.name}.{what}{i}.a2a_{group_name(a2a_axes)}",
                                               Collective.ALL_TO_ALL, a2a_axes, nbytes[i], deps_of[i], phase),)
            return out

        # forward: q, k, v to head-sharded; backward: dout (q, k, v and out were saved head-sharded)
        ready = swap([query, *keyed] if forward else [0], ready, in_bytes, "in")
        everything = sorted({d for r in ready for d in r})
        kv_ready = sorted({d for i in keyed for d in ready[i]})
        # each step's work and kernel shape; the graph is the last cp rank's (see ring_steps)
        steps = ring_steps(ring - 1, ring, pol.cp_load_balance, forward)
        rows = attention_rows(op, local, keys=local("s"))   # a step's keys held: a chunk, as its queries
        kernels: list[int] = []
        recvs: list[int] = []
        accums: list[int] = []
        for j in range(ring):
            if ring > 1 and (j < ring - 1 or not forward):
                if forward:
                    nbytes, what = kv, "kv"
                else:   # K/V forward round the ring, dK/dV one step behind
                    nbytes = kv if j == 0 else (2 * kv if j < ring - 1 else kv)
                    what = "kv" if j == 0 else ("kv_dkv" if j < ring - 1 else "dkv")
                deps = kv_ready if j == 0 else [recvs[-1]] + ([] if forward else [accums[-1]])
                pair = self.pairs
                self.pairs += 1
                direction = 1 if forward else -1
                self._step(f"{op.name}.{what}_send{j}", "send", phase, deps, nbytes=nbytes,
                           peer=direction * stride, pair=pair)
                recvs.append(self._step(f"{op.name}.{what}_recv{j}", "recv", phase, deps, nbytes=nbytes,
                                        peer=-direction * stride, pair=pair))
            deps = everything if j == 0 else [recvs[j - 1], kernels[-1]]
            kernels.append(self._step(f"{op.name}.step{j}" if ring > 1 else op.name, "compute", phase, deps,
                                      category=op.kind, flops=flops * steps[j].work, model_flops=model_flops / ring,
                                      mem=mem, matmul=op.precision or "bf16", key_share=steps[j].loop))
            if rows is not None:
                self.steps[kernels[-1]].groups = rows * steps[j].rows
            if ring > 1 and not forward:
                # dQ += this step's dQ; dK/dV += this step's (in the buffer that travels)
                n = sp.Add(*(local_numel(op.inputs[i], self.placements[local_inputs[i]]) for i in [query, *keyed]))
                accums.append(self._step(f"{op.name}.accumulate{j}", "compute", phase,
                                         [kernels[-1]] + ([recvs[j - 1]] if j else []), category="pointwise",
                                         flops=n, mem=n * 3 * DTYPE_BYTES["bf16"]))
        last = [kernels[-1]]
        if ring > 1 and forward:
            # merge the partial outputs by their log-sum-exp (kept until the ring is done)
            n_out = local_numel(op.outputs[0], out_pls[0])
            n_lse = local_numel(op.outputs[1], out_pls[1])
            for j in range(ring):
                last = [self._step(f"{op.name}.merge{j}", "compute", phase, last, category="pointwise",
                                   flops=3 * n_out, mem=n_out * (DTYPE_BYTES["bf16"] + 2 * DTYPE_BYTES["fp32"])
                                   + n_lse * 3 * DTYPE_BYTES["fp32"])]
        done = tuple(accums[-1:] or last)
        # dK, dV: the last step's gradients and the ring's returning buffer
        outs = [tuple(sorted(set(done) | {recvs[-1]})) if not forward and ring > 1 and i in op.key_outputs
                else done for i in range(len(op.outputs))]
        outs = swap([0] if forward else [0, *op.key_outputs], outs, out_bytes, "out")
        for o, pl, deps in zip(op.outputs, out_pls, outs):
            self.placements[o] = pl
            self.producers[o] = deps
        # Buffers alive while the exchange runs (Transformer Engine): the ring's double-buffered
        # K/V receives and every step's partial output until they are merged (fp32 accumulator);
        # backward K/V and dK/dV double-buffered plus the dQ accumulator; the all-to-all copies.
        if ring > 1:
            ring_bytes = 2 * kv + ring * o_bytes + 2 * o_bytes if forward else 4 * kv + q_bytes
        else:
            ring_bytes = sp.Integer(0)
        swapped = (q_bytes + kv + o_bytes) if pol.cp_a2a > 1 else sp.Integer(0)
        self.transient = sp.Max(self.transient, ring_bytes + swapped)

    def _partial_axes(self, op: Op, labels: tuple[str | None, ...]) -> tuple[bool, ...]:
        """Axes on which a sum stays a partial sum: a linear op outside the residual stream whose
        every input is partial there (two row-parallel outputs added before their one
        reduction, as a parallel-residual layer does)."""
        if not op.passthrough or op.residual:
            return (False,) * len(BLOCK_AXES)
        return tuple(l is None and all(isinstance(self.placement(t)[i], Partial) for t in op.inputs)
                     for i, l in enumerate(labels))

    def _view(self, op: Op) -> None:
        """Splits and joins move no data; placements follow the labels through."""
        base = op.inputs[0]
        pl = self.placement(base)
        deps: list[int] = list(self.producers.get(base, ()))
        for other in op.inputs[1:]:
            want = tuple(p if not isinstance(p, Shard) or p.label in other.labels else REPLICATE for p in pl)
            lt = self.redistribute(other, want, self.phase_default)
            deps.extend(self.producers.get(lt, ()))
        for out in op.outputs:
            out_pl = []
            for p in pl:
                if isinstance(p, Shard) and p.label not in out.labels:
                    raise ValueError(f"{op.name}: cannot carry {p} into {out.labels}")
                out_pl.append(p)
            self.placements[out] = tuple(out_pl)
            self.producers[out] = tuple(sorted(set(deps)))


@dataclass(frozen=True)
class RingStep:
    """One step of the ring on one cp rank, relative to that rank's load-balanced share:
    ``work``, the share of a rank's attention work it does (under load balancing every rank
    does 1 in all); ``loop``, the length of its thread blocks' loop as a share of the
    sequence; ``rows``, the rows of work they split, as a share of the rank's query rows."""

    work: sp.Rational
    loop: float
    rows: sp.Rational


def ring_steps(rank: int, ring: int, load_balance: bool = True, forward: bool = True) -> list[RingStep]:
    """The steps of the ring of ``ring`` ranks on the ``rank``-th of them. At step j it holds
    the keys and values of rank ``rank - j`` (mod ring).

    Load-balanced, a rank holds chunks i and 2*ring-1-i of the sequence's 2*ring (2c tokens).
    Step 0 is the diagonal: its 2c queries against its own 2c keys, causal. Every later step is
    half a block: from an earlier rank, all 2c queries against the visitor's first chunk; from
    a later one, the rank's second chunk of queries against all 2c of its keys. Each is 1/ring of
    the rank's work. Forward, a thread block loops over keys and the rows are queries; backward
    (FlashAttention splits the keys over thread blocks) the reverse.

    Contiguous chunks (no load balancing, c tokens each): the diagonal block, then a whole block
    of queries against each earlier rank's keys (twice the diagonal's unmasked half), nothing
    against later ones (masked): rank i does (2i + 1)/ring of the balanced share, the last rank
    2 - 1/ring of it."""
    one = sp.Integer(1)
    out = [RingStep(one / ring, 1.0 / ring, one)]
    for j in range(1, ring):
        earlier = j <= rank            # the visitor's tokens come before the rank's (own chunk)
        if not load_balance:
            out.append(RingStep(2 * one / ring if earlier else sp.Integer(0), 1.0 / ring, one))
        elif earlier == forward:       # forward from an earlier rank / backward from a later one
            out.append(RingStep(one / ring, 0.5 / ring, one))
        else:
            out.append(RingStep(one / ring, 1.0 / ring, one / 2))
    return out


def attention_rows(op: Op, local, keys: sp.Expr | None = None) -> sp.Expr | None:  # noqa: ANN001
    """The rows of work a fused attention kernel splits over thread blocks: its query rows
    (sequences x queries x query heads) forward; its key rows backward (``keys``, or the key
    sequence, per sequence and query head), where FlashAttention gives each thread block a tile
    of keys and loops over the queries. None for a kernel over a KV cache (an inference
    engine's, which splits the keys too when the queries are few). ``local``: label -> size."""
    if any(t.kind == "kv_cache" for t in op.inputs):
        return None
    n = local("s") if op.kind == "attention" else (keys if keys is not None else local("t"))
    return local("b") * n * local("g") * local("q")


def _residual_label(policy: ShardingPolicy) -> str | None:
    """The label the residual stream is sharded on over the tensor-parallel axis."""
    return "s" if policy.sp else None


def input_placement(t: Tensor, policy: ShardingPolicy) -> Placements:
    """Block inputs arrive in the residual-stream layout: a label axis shards its label, the
    tensor-parallel axis the residual layout (token ids stay replicated over tp)."""
    out: list[Placement | None] = []
    for axis in BLOCK_AXES:
        if AXIS[axis].mesh != t.mesh:
            out.append(None)
            continue
        label = AXIS[axis].shards
        if label is None:
            # a KV cache is split by heads, as the attention that reads it
            label = t.tp_shard if t.kind == "kv_cache" else _residual_label(policy) if t.residual else None
        elif t.kind == "kv_cache" and label not in t.labels:
            label = AXIS[axis].keys or None     # (cp: each rank caches its own tokens)
        out.append(Shard(label) if label is not None and label in t.labels else REPLICATE)
    return tuple(out)


def _selective_region(block: Block) -> tuple[list[Op], set[int]]:
    """The attention-core ops that selective recomputation replays, and the ids of the tensors
    that leave that region (its checkpointed outputs, which are kept rather than replayed)."""
    core = [op for op in block.ops if op.attention_core]
    # Flash attention never stores the score matrix: nothing to gain by replaying it.
    if any(op.kind == "attention" for op in core):
        return [], set()
    inside = {id(op) for op in core}
    produced = {id(t) for op in core for t in op.outputs}
    leaving = {id(t) for op in block.ops if id(op) not in inside for t in op.inputs if id(t) in produced}
    return core, leaving


def _backward_order(block: Block, bwd_ops: list[Op], recompute: str) -> tuple[list[tuple[str, Op]], set[int]]:
    """Backward ops, with the forward ops that recomputation replays placed where needed, and
    the ids of the forward tensors those replays reproduce (not kept from the forward)."""
    if recompute == "full":
        # (the FP8 weight casts are not replayed: their copies are kept)
        ops = [op for op in block.ops if not op.cached]
        replayed = {id(t) for op in ops for t in op.outputs}
        return [("recompute", op) for op in ops] + [("bwd", op) for op in bwd_ops], replayed
    if recompute == "selective":
        core, leaving = _selective_region(block)
        replayed = {id(t) for op in core for t in op.outputs} - leaving
        order: list[tuple[str, Op]] = []
        pending = bool(core)
        for op in bwd_ops:
            if pending and any(id(t) in replayed for t in op.inputs):
                order.extend(("recompute", c) for c in core)
                pending = False
            order.append(("bwd", op))
        return order, replayed
    return [("bwd", op) for op in bwd_ops], set()


def shard_block(block: Block, policy: ShardingPolicy) -> ShardedBlock:
    """The per-rank forward and backward programs of ``block`` under ``policy``."""
    backward = differentiate(block)
    block, bwd_ops, weight_grads, fp8_modules = apply_precision(
        block, backward.ops, backward.weight_grads, policy.precision, sp=policy.sp, zero3=policy.zero == 3)
    backward = replace(backward, ops=bwd_ops, weight_grads=weight_grads)
    placements: dict[Tensor, Placements] = {t: input_placement(t, policy) for t in block.inputs}

    fwd = _Pass(policy, "fwd", placements, block.weights)
    for op in block.ops:
        fwd.run(op, "fwd")
    fwd_exit = _hand_on(fwd, block, policy)

    # The backward pass starts from the gradients of the block's outputs, placed like the outputs.
    for out, g in backward.output_grads.items():
        placements[g] = tuple(REPLICATE if isinstance(p, Partial) else p for p in placements[out])
    bwd = _Pass(policy, "bwd", placements, block.weights)
    order, recomputed = _backward_order(block, backward.ops, policy.recompute)
    bwd.reuse(fwd.kept(recomputed), fwd.gathered)
    for phase, op in order:
        bwd.run(op, phase)
    bwd_exit = tuple(sorted({i for g in backward.input_grads.values() for i in bwd.producers.get(g, ())}))

    # Activations the backward reads that it did not recompute: held from forward to backward.
    forward_tensors = {id(t): t for t in block.inputs}
    forward_tensors.update({id(t): t for op in block.ops for t in op.outputs})
    # a tensor re-read on the other mesh is the same memory as its (local) source
    alias = fwd.aliases
    saved: dict[int, Tensor] = {}
    for _phase, op in order:
        for t in op.inputs:
            if id(t) in forward_tensors and id(t) not in recomputed and t.kind != "weight":
                # what is held is what the backward starts from: the tensor, or the copy the
                # forward redistributed and kept
                for origin in bwd.reads.get(id(t), {id(t): t}).values():
                    while id(origin) in alias:
                        origin = alias[id(origin)]
                    saved[id(origin)] = origin
    saved_bytes = sp.Add(*(local_bytes(t, placements[t]) for t in saved.values()))
    workspace = sp.Integer(0)
    if policy.recompute == "full":
        workspace = sp.Add(*(local_bytes(forward_tensors[i], placements[forward_tensors[i]])
                             for i in recomputed))
    # An all-to-all's send buffer (the permuted tokens before the dispatch, the experts' output
    # before the combine) lives only while it runs; its receive buffer is the next op's input.
    buffers = [st.comm_bytes for st in (*fwd.steps, *bwd.steps) if st.collective is Collective.ALL_TO_ALL]
    if buffers:
        workspace += sp.Max(*buffers)

    weight_syncs = _weight_syncs(block, backward.weight_grads, placements, policy, bwd)
    boundary = sp.Add(*(local_bytes(t, placements[t]) for t in block.outputs))
    cached = sp.Add(*(local_bytes(t, placements[t]) for op in block.ops if op.cached for t in op.outputs
                      if t.kind == "weight"))
    exchange = sp.Max(fwd.transient, bwd.transient, fwd.gathered_bytes, bwd.gathered_bytes)
    return ShardedBlock(block, policy, fwd.steps, bwd.steps, fwd_exit, bwd_exit, saved_bytes,
                        workspace, weight_syncs, boundary, cached, fp8_modules, exchange_bytes=exchange)


def _hand_on(fwd: _Pass, block: Block, policy: ShardingPolicy) -> tuple[int, ...]:
    """The steps that hand the block's outputs on, in the layout the next block reads its
    inputs in (the residual stream): an output still partial over tp (the vocabulary-parallel
    embedding's) is reduced first, as Megatron's embedding all-reduces (or, with sequence
    parallelism, reduce-scatters) its output."""
    exits: set[int] = set()
    for t in block.outputs:
        # the hidden states go on in the residual layout (a loss or sampled tokens stay put)
        want = input_placement(replace(t, residual=True), policy) if "h" in t.labels else fwd.placement(t)
        if fwd.placement(t) != want:
            lt = fwd.redistribute(t, want, "fwd")
            fwd.placements[t] = want
            fwd.producers[t] = fwd.producers.get(lt, ())
        exits.update(fwd.producers.get(t, ()))
    return tuple(sorted(exits))


def shard_forward(block: Block, policy: ShardingPolicy) -> ShardedBlock:
    """The per-rank program of ``block``'s forward alone, as an inference step runs it: no
    backward, no gradients, no activations held for later. Its KV cache (the block's state)
    is placed like the attention that reads it. ``workspace_bytes`` is the largest kernel's
    working set of activations beside the block's input (what a forward pass holds at once)."""
    # the precision's GEMMs, casts and stored weights (a forward-only policy: see graph.precision)
    block = apply_precision(block, [], {}, policy.precision, sp=policy.sp, zero3=False)[0]
    placements: dict[Tensor, Placements] = {t: input_placement(t, policy) for t in [*block.inputs, *block.caches]}
    fwd = _Pass(policy, "fwd", placements, block.weights)
    for op in block.ops:
        fwd.run(op, "fwd")
    fwd_exit = _hand_on(fwd, block, policy)
    syncs = [WeightSync(w, local_numel(w, compute_placement(w)), (), weight_replicas(w), float(DTYPE_BYTES[w.dtype]))
             for w in block.weights]
    boundary = sp.Add(*(local_bytes(t, placements[t]) for t in block.outputs))
    inputs = sp.Add(*(local_bytes(t, placements[t]) for t in block.inputs))
    working = [sp.Add(*(local_bytes(t, placements[t]) for t in [*op.inputs, *op.outputs]
                        if t.kind == "activation" and t in placements))
               for op in block.ops]
    workspace = inputs + (sp.Max(*working) if working else sp.Integer(0))
    caches = sp.Add(*(local_bytes(c, placements[c]) for c in block.caches))
    exchange = sp.Max(fwd.transient, fwd.gathered_bytes)
    return ShardedBlock(block, policy, fwd.steps, [], fwd_exit, (), sp.Integer(0), workspace, syncs, boundary,
                        cache_bytes=caches, exchange_bytes=exchange)


def _weight_syncs(block: Block, weight_grads: dict[Tensor, Tensor], placements: dict[Tensor, Placements],
                  policy: ShardingPolicy, bwd: _Pass) -> list[WeightSync]:
    """Weight-gradient reductions, derived from placements like every other collective.

    The optimizer wants each gradient where the weight is computed over the model-parallel
    axes, and replicated (ZeRO 0) or sharded (ZeRO 1-3) over the weight's data-parallel axes,
    which change together: one collective over their group. ZeRO-3 reduce-scatters every
    micro-batch, at the end of the block's backward; everything else accumulates locally and
    is reduced once per step.
    """
    syncs: list[WeightSync] = []
    per_microbatch: dict[tuple[str, ...], sp.Expr] = {}
    for w in block.weights:
        replicas = weight_replicas(w)
        compute = compute_placement(w)
        optimizer = tuple((Shard(w.labels[0]) if policy.zero >= 1 else REPLICATE) if dpar and p is not None else p
                          for p, dpar in zip(compute, _DATA_PARALLEL))
        params = local_numel(w, compute)
        g = weight_grads.get(w)
        colls: list[tuple[tuple[str, ...], Collective, sp.Expr]] = []
        if g is not None:
            g32 = Tensor(g.name, g.labels, policy.grad_reduce_dtype, g.kind)
            cur = placements[g]
            # Model-parallel axes one by one (a norm weight's gradient under sequence
            # parallelism: an all-reduce over tp) ...
            for i, axis in enumerate(BLOCK_AXES):
                if _DATA_PARALLEL[i] or optimizer[i] is None:
                    continue
                coll = collective_for(cur[i], optimizer[i])
                if coll is not None:
                    colls.append(((axis,), coll, local_bytes(g32, cur)))
                cur = cur[:i] + (optimizer[i],) + cur[i + 1:]
            # ... then the data-parallel axes together, over their group.
            moving = [i for i, dpar in enumerate(_DATA_PARALLEL)
                      if dpar and optimizer[i] is not None and cur[i] != optimizer[i]]
            if moving:
                kinds = {collective_for(cur[i], optimizer[i]) for i in moving}
                assert len(kinds) == 1, f"{w.name}: data-parallel axes change placement differently"
                (coll,) = kinds
                axes = tuple(BLOCK_AXES[i] for i in moving)
                if coll is not None:
                    if policy.zero == 3:
                        per_microbatch[axes] = per_microbatch.get(axes, sp.Integer(0)) + local_bytes(g32, cur)
                    else:
                        colls.append((axes, coll, local_bytes(g32, cur)))
        syncs.append(WeightSync(w, params, tuple(colls), replicas, float(DTYPE_BYTES[w.dtype])))
    for axes, nbytes in per_microbatch.items():
        deps = tuple(sorted({i for g in weight_grads.values() for i in bwd.producers.get(g, ())}))
        bwd._collective(f"{block.name}.grad_rs_{group_name(axes)}", Collective.REDUCE_SCATTER, axes,
                        nbytes, deps, "bwd")
    return syncs


def iter_steps(sb: ShardedBlock) -> Iterable[Step]:
    yield from sb.fwd
    yield from sb.bwd
