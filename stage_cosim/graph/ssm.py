"""State-space and linear-attention mixers as graph ops: Mamba-1 (Jamba), Mamba-2 (SSD) and gated
DeltaNet (Qwen3-Next's linear attention).

Everything but the scan is an ordinary op: the input projections are column-parallel GEMMs
over the head groups (``G``, what tp shards, as Megatron-Core's Mamba mixer shards n_groups),
the depthwise causal convolution is a GEMM over its kernel ``X`` (2 * X FLOPs per output
element, its weight's gradient falling out of autodiff), SiLU, softplus and the gate are
pointwise, the gated RMSNorm normalizes each group's heads, the output projection is
row-parallel. The scan itself is one fused kernel (``ssm_scan``, like
``mamba_chunk_scan_combined`` and FLA's ``chunk_gated_delta_rule``) whose work and traffic are
closed forms of its chunk length (:func:`scan_flops`); its rule
(:mod:`stage_cosim.sharding.ssm`) shards it over heads and hands the state between cp ranks.
"""

from __future__ import annotations

import sympy as sp

from stage_cosim.graph import autodiff
from stage_cosim.graph.dims import LABEL_SIZE
from stage_cosim.graph.ir import Block, BlockBuilder, Op, Tensor
from stage_cosim.model.architecture import ATTENTION_MAMBA2, GATED_DELTANET, MAMBA, MAMBA2, ArchSwitches

SILU_FLOPS = 4
SOFTPLUS_FLOPS = 4
GATE_FLOPS = 5              # y * silu(z)
# The Mamba-1 selective scan: discretize (exp(dt A), dt B x), update the state, read it with C,
# per state element of every channel and position (the Mamba paper's 9 B L D N).
SELECTIVE_SCAN_FLOPS = 9
# The scan's kinds: the chunked SSD (Mamba-2), the chunked delta rule (gated DeltaNet), the
# selective scan (Mamba-1).
SSD, DELTA, SELECTIVE = "ssd", "delta", "selective"
SCAN_OF = {MAMBA2: SSD, ATTENTION_MAMBA2: SSD, GATED_DELTANET: DELTA, MAMBA: SELECTIVE}


def scan_flops(kind: str, local) -> tuple[sp.Expr, sp.Expr]:  # noqa: ANN001 (label -> size)
    """(matmul-class FLOPs, elementwise FLOPs) of one forward scan on one rank.

    SSD with chunks of Q = ``K`` positions (Dao and Gu, "Transformers are SSMs", section 6):
    within a chunk C B^T per group (2 s Q N) and its decay-masked product with x per head
    (2 s Q P); each chunk's final state B^T x (2 s N P per head); the states passed from chunk
    to chunk (2 (s/Q) N P per head); the output read from the entering state C h (2 s N P per
    head); the decay mask exp(segsum) per head (s Q, elementwise).

    Chunked gated delta rule (Yang et al., "Gated Delta Networks"; FLA's chunk kernel), per
    value head with key dimension N and value dimension P: within a chunk K K^T (2 s Q N), the
    triangular solve of the WY form (s Q^2 / 3), W = A (beta K) and U = A (beta V) (2 s Q N +
    2 s Q P), Q K^T (2 s Q N) and its masked product with U - W S (2 s Q P); across chunks
    W S, the state update K^T (U - W S) and the output Q S (2 s N P each).

    Selective scan (Mamba-1): elementwise, 9 s I N."""
    b, s = local("b"), local("s")
    if kind == SELECTIVE:
        return sp.Integer(0), SELECTIVE_SCAN_FLOPS * b * s * local("I") * local("N")
    g, r, p, n, q = local("G"), local("R"), local("P"), local("N"), local("K")
    heads = g * r
    if kind == SSD:
        mm = b * (2 * s * q * n * g + heads * (2 * s * q * p + 2 * s * n * p + 2 * (s / q) * n * p + 2 * s * n * p))
        return mm, b * heads * s * q
    mm = b * heads * (6 * s * q * n + 4 * s * q * p + 6 * s * n * p)
    return mm, b * heads * s * q ** 2 / 3


def scan_state(kind: str) -> str:
    """Labels of the state one sequence carries from token to token (per layer)."""
    return "bIN" if kind == SELECTIVE else "bGRPN"


def ssm_scan(b: BlockBuilder, name: str, kind: str, inputs: list[Tensor]) -> Tensor:
    """The fused scan: ``inputs`` are x, dt, B, C (gated DeltaNet: v, the decay, k, q, beta)
    and the weights it reads (A, D); its
    output ``y`` (x's labels) and the final state (fp32, kept for an inference step)."""
    x = inputs[0]
    y = b._act(name, x.labels)
    state = Tensor(name + ".state", scan_state(kind), "fp32", "activation", mesh=b.mesh)
    b._add(Op(name, "ssm_scan", list(inputs), [y, state], spec=kind, saves=list(inputs), unsharded="NPK"))
    return y


def _ssm_scan_grad(op: Op, douts: list[Tensor | None], st: autodiff._State) -> None:
    """The scan's backward: one fused kernel (the chunked kernels' backward recomputes the
    chunk states) that yields every input's gradient, the weights' (A, D, dt bias) included."""
    if douts[0] is None:
        return
    grads = [autodiff._grad_tensor(t) for t in op.inputs]
    st.ops.append(Op(f"{op.name}.grad", "ssm_scan_grad", [douts[0], *op.saves], grads, spec=op.spec,
                     grad_of=op, unsharded=op.unsharded))
    for t, g in zip(op.inputs, grads):
        st.contribute(t, g)


def _product_grad(op: Op, douts: list[Tensor | None], st: autodiff._State) -> None:
    """An elementwise product's backward: every input's gradient (the generic pointwise rule
    differentiates the first input only), each a pass over the saved inputs."""
    if douts[0] is None:
        return
    for x in op.inputs:
        if x.kind in ("input", "index"):
            continue
        dx = autodiff._grad_tensor(x)
        st.ops.append(Op(f"{op.name}.grad[{x.name}]", "pointwise", [douts[0], *op.saves], [dx],
                         flops_per_element=op.flops_per_element, grad_of=op))
        st.contribute(x, dx)


autodiff.RULES.setdefault("ssm_scan", _ssm_scan_grad)
autodiff.RULES.setdefault("product", _product_grad)


def product(b: BlockBuilder, name: str, x: Tensor, y: Tensor, *, flops_per_element: int) -> Tensor:
    """x * f(y) elementwise (a gate), with both inputs differentiated (op kind ``product``;
    the generic rule shards it like any elementwise op)."""
    out = b._act(name, x.labels)
    b._add(Op(name, "product", [x, y], [out], flops_per_element=flops_per_element, saves=[x, y]))
    return out


# -- the mixers --------------------------------------------------------------------------------

def _proj(b: BlockBuilder, name: str, y: Tensor, out: str, a: ArchSwitches, shard: str = "G") -> Tensor:
    t = b.einsum(name, f"bsh,h{out}->bs{out}", y, b.weight(f"{name}.weight", "h" + out, tp_shard=shard))
    if a.ssm_proj_bias:
        t = b.add(name + ".bias_add", t, b.weight(f"{name}.bias", out, tp_shard=shard), residual=False)
    return t


def _conv(b: BlockBuilder, name: str, x: Tensor, a: ArchSwitches, shard: str = "G") -> Tensor:
    """Depthwise causal convolution over the sequence, then SiLU."""
    ch = x.labels[2:]
    out = b.einsum(name, f"bs{ch},{ch}X->bs{ch}", x, b.weight(f"{name}.weight", ch + "X", tp_shard=shard))
    if a.ssm_conv_bias:
        out = b.add(name + ".bias_add", out, b.weight(f"{name}.bias", ch, tp_shard=shard), residual=False)
    return b.pointwise(name + ".silu", [out], out.labels, flops_per_element=SILU_FLOPS, saves=[out])


def _gated_norm(b: BlockBuilder, y: Tensor, z: Tensor, weight_labels: str, over: str) -> Tensor:
    """y * silu(z), then RMSNorm over each group's heads (Mamba-2) or each head (gated
    DeltaNet): the norm runs where the heads are, its weight's gradient partial over tp."""
    gated = product(b, "gate", y, z, flops_per_element=GATE_FLOPS)
    return b.norm("gated_norm", gated, [b.weight("gated_norm.weight", weight_labels,
                                                 tp_shard="G" if "G" in weight_labels else None)],
                  rms=True, over=over, residual=False)


def mamba2_mixer(b: BlockBuilder, y: Tensor, a: ArchSwitches) -> Tensor:
    """Mamba-2 (HF's Mamba2Mixer, Megatron-Core's MambaMixer) from its normalized input to
    the row-parallel output projection's output (its bias, with ``ssm_proj_bias``, is the
    layer's to add after the reduction)."""
    z = _proj(b, "in_proj.z", y, "GRP", a)
    x = _conv(b, "conv1d.x", _proj(b, "in_proj.x", y, "GRP", a), a)
    bm = _conv(b, "conv1d.B", _proj(b, "in_proj.B", y, "GN", a), a)
    cm = _conv(b, "conv1d.C", _proj(b, "in_proj.C", y, "GN", a), a)
    dt = _proj(b, "in_proj.dt", y, "GR", a)
    dt = b.add("dt_bias_add", dt, b.weight("dt_bias", "GR", tp_shard="G"), residual=False)
    dt = b.pointwise("dt_softplus", [dt], dt.labels, flops_per_element=SOFTPLUS_FLOPS, saves=[dt])
    out = ssm_scan(b, "scan", SSD, [x, dt, bm, cm, b.weight("A_log", "GR", tp_shard="G"),
                                    b.weight("D", "GR", tp_shard="G")])
    if a.mamba_gated_norm:
        out = _gated_norm(b, out, z, "GRP", "RP")
    else:
        out = product(b, "gate", out, z, flops_per_element=GATE_FLOPS)    # Falcon-H1: gated, not normed
    return b.einsum("out_proj", "bsGRP,GRPh->bsh", out, b.weight("out_proj.weight", "GRPh", tp_shard="G"))


def gated_deltanet_mixer(b: BlockBuilder, y: Tensor, a: ArchSwitches) -> Tensor:
    """Gated DeltaNet (HF's Qwen3NextGatedDeltaNet): q and k per key head (``G``), v, the
    output gate z, beta and the decay's input a per value head; the convolution over q, k,
    v; the chunked delta rule; a gated RMSNorm per value head; the output projection."""
    q = _conv(b, "conv1d.q", _proj(b, "in_proj.q", y, "GN", a), a)
    k = _conv(b, "conv1d.k", _proj(b, "in_proj.k", y, "GN", a), a)
    v = _conv(b, "conv1d.v", _proj(b, "in_proj.v", y, "GRP", a), a)
    z = _proj(b, "in_proj.z", y, "GRP", a)
    beta = b.pointwise("beta_sigmoid", [_proj(b, "in_proj.b", y, "GR", a)], "bsGR", flops_per_element=4)
    g = _proj(b, "in_proj.a", y, "GR", a)
    g = b.add("dt_bias_add", g, b.weight("dt_bias", "GR", tp_shard="G"), residual=False)
    # the decay's log, -exp(A_log) * softplus(a + dt_bias), per value head and position
    g = b.pointwise("decay", [g], "bsGR", flops_per_element=SOFTPLUS_FLOPS + 2, saves=[g])
    out = ssm_scan(b, "scan", DELTA, [v, g, k, q, beta, b.weight("A_log", "GR", tp_shard="G")])
    out = _gated_norm(b, out, z, "P", "P")
    return b.einsum("out_proj", "bsGRP,GRPh->bsh", out, b.weight("out_proj.weight", "GRPh", tp_shard="G"))


def mamba_mixer(b: BlockBuilder, y: Tensor, a: ArchSwitches) -> Tensor:
    """Mamba-1 (Jamba's JambaMambaMixer): the inner width ``I`` is what tp shards; the
    projection to dt, B and C is row-parallel (a reduction over tp), the step size's
    up-projection column-parallel again."""
    x = _conv(b, "conv1d", _proj(b, "in_proj.x", y, "I", a, shard="I"), a, shard="I")
    z = _proj(b, "in_proj.z", y, "I", a, shard="I")
    parts = []
    for part, labels in (("dt", "D"), ("B", "N"), ("C", "N")):
        t = b.einsum(f"x_proj.{part}", f"bsI,I{labels}->bs{labels}", x,
                     b.weight(f"x_proj.{part}.weight", "I" + labels, tp_shard="I"))
        if a.mamba_inner_norms:
            t = b.norm(f"{part}_norm", t, [b.weight(f"{part}_norm.weight", labels)], rms=True, over=labels,
                       residual=False)
        parts.append(t)
    dt = b.einsum("dt_proj", "bsD,DI->bsI", parts[0], b.weight("dt_proj.weight", "DI", tp_shard="I"))
    dt = b.add("dt_proj.bias_add", dt, b.weight("dt_proj.bias", "I", tp_shard="I"), residual=False)
    dt = b.pointwise("dt_softplus", [dt], dt.labels, flops_per_element=SOFTPLUS_FLOPS, saves=[dt])
    out = ssm_scan(b, "scan", SELECTIVE, [x, dt, parts[1], parts[2], b.weight("A_log", "IN", tp_shard="I"),
                                          b.weight("D", "I", tp_shard="I")])
    out = product(b, "gate", out, z, flops_per_element=GATE_FLOPS)
    return b.einsum("out_proj", "bsI,Ih->bsh", out, b.weight("out_proj.weight", "Ih", tp_shard="I"))


MIXER_BUILDERS = {MAMBA: mamba_mixer, MAMBA2: mamba2_mixer, GATED_DELTANET: gated_deltanet_mixer}


# -- inference: the state instead of the KV cache -------------------------------------------------

def with_state_cache(layer: Block) -> Block:
    """``layer``'s forward with each scan starting from the state its sequence carries and
    writing it back (the state cache: fixed bytes per sequence, whatever its length), and each
    depthwise convolution reading the window of its sequence's last inputs (the conv state)."""
    caches: list[Tensor] = []
    ops: list[Op] = []
    for op in layer.ops:
        if op.kind == "ssm_scan":
            state = Tensor(f"{op.name}.state_cache", op.outputs[1].labels, "fp32", "kv_cache",
                           tp_shard="I" if "I" in op.outputs[1].labels else "G", mesh=op.mesh)
            caches.append(state)
            # read at the start, written at the end: twice the state's bytes
            op = Op(op.name, op.kind, [*op.inputs, state], op.outputs, spec=op.spec, unsharded=op.unsharded)
        elif op.kind == "einsum" and op.name.startswith("conv1d"):
            ch = op.inputs[0].labels[2:]
            conv = Tensor(f"{op.name}.conv_state", "b" + ch + "X", "bf16", "kv_cache",
                          tp_shard="I" if "I" in ch else ("G" if "G" in ch else None), mesh=op.mesh)
            caches.append(conv)
            op = Op(op.name, op.kind, op.inputs, op.outputs, spec=op.spec, after=[conv], saves=[])
            ops.append(Op(f"{op.name}.state_update", "pointwise", [conv, op.inputs[0]],
                          [Tensor(f"{op.name}.conv_state_new", conv.labels, "bf16", "activation", mesh=op.mesh)],
                          flops_per_element=0))
        ops.append(op)
    if not caches:
        return layer
    return Block(layer.name, layer.kind, ops, layer.inputs, layer.outputs, layer.weights, [*layer.caches, *caches])


def state_bytes_per_sequence(model) -> float:  # noqa: ANN001 (ModelConfig)
    """Closed form of the fixed state one sequence holds over the whole model (unsharded): per
    SSM layer the scan's state in fp32 and the convolution's window of d_conv inputs in bf16
    (Hugging Face's cache keeps the whole window)."""
    total = 0.0
    for i in range(model.layers):
        mixer = model.layer_mixer(i)
        if mixer == MAMBA:
            di = model.mamba_inner
            total += 4 * di * model.mamba_state_dim + 2 * di * model.mamba_d_conv
        elif mixer in (MAMBA2, GATED_DELTANET, ATTENTION_MAMBA2):
            heads, groups = model.mamba_num_heads, model.mamba_num_groups
            inner, n = heads * model.mamba_head_dim, model.mamba_state_dim
            channels = inner + 2 * groups * n
            total += 4 * inner * n + 2 * channels * model.mamba_d_conv
    return total


__all__ = ["LABEL_SIZE", "MIXER_BUILDERS", "scan_flops", "ssm_scan", "with_state_cache", "state_bytes_per_sequence"]
