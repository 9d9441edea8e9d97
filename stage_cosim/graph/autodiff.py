"""Derive a block's backward ops from its forward ops: one gradient rule per op kind.

The rules produce ordinary ops in the same IR, so the backward pass is costed and sharded by
exactly the same code as the forward pass: collectives in the backward (Megatron's conjugate
all-reduces, sequence-parallel reduce-scatters and re-gathers, ZeRO-3 re-gathers) are not
written down here but fall out of sharding propagation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from stage_cosim.graph.dims import LABEL_SIZE
from stage_cosim.graph.ir import UNFUSED_CROSS_ENTROPY_PASSES, Block, Op, Tensor

GRAD_DTYPE = "bf16"
WEIGHT_GRAD_DTYPE = "fp32"  # gradients accumulate into fp32 main-grad buffers, as in Megatron


@dataclass
class Backward:
    """The backward ops of a block in program order, and where its gradients end up."""

    ops: list[Op]
    input_grads: dict[Tensor, Tensor]    # block input -> its gradient (handed to the previous block)
    weight_grads: dict[Tensor, Tensor]   # weight -> its gradient
    output_grads: dict[Tensor, Tensor]   # block output -> the gradient that arrives for it

    def split(self) -> tuple[list[Op], list[Op]]:
        """(B, W): the ops the input gradients need, in program order, and the rest, which
        compute weight gradients only (:func:`weight_grad_rows`)."""
        index = {id(op): i for i, op in enumerate(self.ops)}
        producer = {id(t): index[id(op)] for op in self.ops for t in op.outputs}
        deps = [[producer[id(t)] for t in op.inputs if id(t) in producer] for op in self.ops]
        exits = [producer[id(g)] for g in self.input_grads.values() if id(g) in producer]
        weight = weight_grad_rows(deps, exits)
        return ([op for op, w in zip(self.ops, weight) if not w], [op for op, w in zip(self.ops, weight) if w])


@dataclass
class _State:
    ops: list[Op] = field(default_factory=list)
    contributions: dict[Tensor, list[Tensor]] = field(default_factory=dict)

    def contribute(self, t: Tensor, g: Tensor) -> None:
        self.contributions.setdefault(t, []).append(g)

    def grad(self, t: Tensor) -> Tensor | None:
        """The gradient of ``t``, summing several contributions with one add op."""
        parts = self.contributions.get(t)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        out = _grad_tensor(t)
        out.name += ".sum"
        self.ops.append(Op(f"{t.name}.grad_sum", "pointwise", list(parts), [out],
                           flops_per_element=len(parts) - 1, residual=t.residual, passthrough=True))
        self.contributions[t] = [out]
        return out


def _grad_tensor(t: Tensor) -> Tensor:
    if t.kind == "weight":
        return Tensor(f"d({t.name})", t.labels, WEIGHT_GRAD_DTYPE, "weight_grad",
                      tp_shard=t.tp_shard, grad_of=t, mesh=t.mesh)
    return Tensor(f"d({t.name})", t.labels, GRAD_DTYPE, "grad", residual=t.residual, grad_of=t, mesh=t.mesh)


def _needs_grad(t: Tensor) -> bool:
    return t.kind not in ("input", "index")


# -- rules ----------------------------------------------------------------------------------

def _einsum(op: Op, douts: list[Tensor | None], st: _State) -> None:
    (dout,) = douts
    letters, out_letters = op.einsum_operands()
    for i, x in enumerate(op.inputs):
        if not _needs_grad(x):
            continue
        others = [j for j in range(len(op.inputs)) if j != i]
        spec = ",".join([letters[j] for j in others] + [out_letters]) + "->" + letters[i]
        dx = _grad_tensor(x)
        st.ops.append(Op(f"{op.name}.grad[{x.name}]", "einsum", [op.inputs[j] for j in others] + [dout],
                         [dx], spec=spec, grad_of=op, attention_core=op.attention_core))
        st.contribute(x, dx)


def _pointwise(op: Op, douts: list[Tensor | None], st: _State) -> None:
    dout = douts[0]
    if dout is None:
        return
    if op.passthrough:
        for x in op.inputs:
            if not _needs_grad(x):
                continue
            if x.labels == dout.labels:
                st.contribute(x, dout)
            else:  # broadcast input (a bias): its gradient sums over the missing labels
                dx = _grad_tensor(x)
                st.ops.append(Op(f"{op.name}.grad[{x.name}]", "reduce", [dout], [dx],
                                 flops_per_element=1, grad_of=op))
                st.contribute(x, dx)
        return
    x = op.inputs[0]
    dx = _grad_tensor(x)
    st.ops.append(Op(f"{op.name}.grad", "pointwise", [dout, *op.saves], [dx],
                     flops_per_element=op.flops_per_element, residual=op.residual, grad_of=op,
                     attention_core=op.attention_core))
    st.contribute(x, dx)


def _norm(op: Op, douts: list[Tensor | None], st: _State) -> None:
    dout = douts[0]
    if dout is None:
        return
    x, weights = op.inputs[0], op.inputs[1:]
    dx = _grad_tensor(x)
    dws = [_grad_tensor(w) for w in weights]
    st.ops.append(Op(f"{op.name}.grad", "norm_grad", [dout, *op.saves, *weights], [dx, *dws],
                     flops_per_element=2 * op.flops_per_element, residual=op.residual,
                     unsharded=op.unsharded, grad_of=op))
    st.contribute(x, dx)
    for w, dw in zip(weights, dws):
        st.contribute(w, dw)


def _softmax(op: Op, douts: list[Tensor | None], st: _State) -> None:
    dx = _grad_tensor(op.inputs[0])
    st.ops.append(Op(f"{op.name}.grad", "softmax_grad", [douts[0], *op.saves], [dx],
                     flops_per_element=4, unsharded=op.unsharded, grad_of=op,
                     attention_core=op.attention_core))
    st.contribute(op.inputs[0], dx)


def _attention(op: Op, douts: list[Tensor | None], st: _State) -> None:
    grads = [_grad_tensor(t) for t in op.inputs]      # q, k (and a shared rotary key), v
    st.ops.append(Op(f"{op.name}.grad", "attention_grad", [douts[0], *op.saves], grads, spec=op.spec,
                     key_inputs=tuple(i + 1 for i in op.key_inputs), key_outputs=op.key_inputs,
                     unsharded=op.unsharded, grad_of=op, attention_core=True, causal=op.causal,
                     softcap=op.softcap, alibi=op.alibi))
    for t, g in zip(op.inputs, grads):
        st.contribute(t, g)


def _lookup(op: Op, douts: list[Tensor | None], st: _State) -> None:
    table, ids = op.inputs
    dtable = _grad_tensor(table)
    st.ops.append(Op(f"{op.name}.grad", "lookup_grad", [douts[0], ids], [dtable], spec=op.spec,
                     grad_of=op))
    st.contribute(table, dtable)


def _cross_entropy(op: Op, douts: list[Tensor | None], st: _State) -> None:
    logits = op.inputs[0]
    dlogits = _grad_tensor(logits)
    passes = 1 if op.memory_passes == 1 else UNFUSED_CROSS_ENTROPY_PASSES[1]
    st.ops.append(Op(f"{op.name}.grad", "cross_entropy_grad", [douts[0], *op.saves], [dlogits],
                     flops_per_element=3, grad_of=op, memory_passes=passes))
    st.contribute(logits, dlogits)


def _view(op: Op, douts: list[Tensor | None], st: _State) -> None:
    ins, outs = op.spec.split("->")
    grads = [_grad_tensor(t) for t in op.inputs]
    st.ops.append(Op(f"{op.name}.grad", "view", [d for d in douts if d is not None], grads,
                     spec=f"{outs}->{ins}", grad_of=op))
    for t, g in zip(op.inputs, grads):
        st.contribute(t, g)


def _mesh_change(op: Op, douts: list[Tensor | None], st: _State) -> None:
    """Gradients go back to the mesh their tensors came from (no data moves either way)."""
    pairs = [(x, d) for x, d in zip(op.inputs, douts) if d is not None and _needs_grad(x)]
    grads = [_grad_tensor(x) for x, _ in pairs]
    if grads:
        st.ops.append(Op(f"{op.name}.grad", "mesh_change", [d for _, d in pairs], grads, grad_of=op))
    for (x, _), g in zip(pairs, grads):
        st.contribute(x, g)


def _permute(op: Op, douts: list[Tensor | None], st: _State) -> None:
    """Dispatch: each token's gradient is the sum of its copies' (an unpermutation)."""
    tokens, routing = op.inputs
    dx = _grad_tensor(tokens)
    st.ops.append(Op(f"{op.name}.grad", "unpermute", [douts[0], routing], [dx],
                     flops_per_element=LABEL_SIZE["k"], grad_of=op))
    st.contribute(tokens, dx)


def _unpermute(op: Op, douts: list[Tensor | None], st: _State) -> None:
    """Combine: the copies' gradient is the token's, weighted (a permutation); the routing
    weights' gradient is each copy's dot product with the token's gradient."""
    slots, probs = op.inputs
    dslots, dprobs = _grad_tensor(slots), _grad_tensor(probs)
    st.ops.append(Op(f"{op.name}.grad[{slots.name}]", "permute", [douts[0], probs], [dslots],
                     flops_per_element=1, grad_of=op))
    st.ops.append(Op(f"{op.name}.grad[{probs.name}]", "unpermute", [douts[0], slots], [dprobs],
                     flops_per_element=2 * LABEL_SIZE["h"], grad_of=op))
    st.contribute(slots, dslots)
    st.contribute(probs, dprobs)


RULES: dict[str, Callable[[Op, list[Tensor | None], _State], None]] = {
    "einsum": _einsum, "pointwise": _pointwise, "norm": _norm, "softmax": _softmax,
    "attention": _attention, "lookup": _lookup, "cross_entropy": _cross_entropy, "view": _view,
    "mesh_change": _mesh_change, "permute": _permute, "unpermute": _unpermute,
}


def weight_grad_rows(deps: Sequence[Iterable[int]], exits: Iterable[int]) -> list[bool]:
    """Which nodes of a backward program only compute weight gradients (Qi et al.'s W), given
    each node's dependencies (indices, in program order; negative ones ignored) and the nodes
    that produce the block's input gradients: W is every node the input gradients do not
    depend on. For an op that consumes a weight the rules above emit dX (which the input
    gradient chains through) and dW (which nothing downstream reads) as separate ops, so dX
    falls in B and dW in W, with what only dW reads (its gradient sums, its reductions, an
    activation recomputed for it alone); an op that computes both at once (a norm's fused
    backward) stays in B."""
    deps = [list(d) for d in deps]
    needed = [False] * len(deps)
    stack = [e for e in exits if e >= 0]
    while stack:
        i = stack.pop()
        if needed[i]:
            continue
        needed[i] = True
        stack.extend(d for d in deps[i] if d >= 0 and not needed[d])
    return [not n for n in needed]


def differentiate(block: Block) -> Backward:
    """Backward ops of ``block``, given a gradient for each of its outputs."""
    st = _State()
    output_grads: dict[Tensor, Tensor] = {}
    for out in block.outputs:
        g = Tensor(f"d({out.name})", out.labels, "fp32" if block.kind == "head" else GRAD_DTYPE,
                   "grad", residual=out.residual, grad_of=out)
        output_grads[out] = g
        st.contribute(out, g)
    for op in reversed(block.ops):
        douts = [st.grad(t) for t in op.outputs]
        if all(d is None for d in douts):
            continue
        RULES[op.kind](op, douts, st)
    input_grads = {t: g for t in block.inputs if (g := st.grad(t)) is not None}
    weight_grads = {w: g for w in block.weights if (g := st.grad(w)) is not None}
    return Backward(st.ops, input_grads, weight_grads, output_grads)
