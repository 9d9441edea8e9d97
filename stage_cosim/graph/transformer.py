"""Forward graphs of the block kinds of a decoder-only transformer: the embedding, a layer
(dense, or with a Mixture-of-Experts MLP), the head (with multi-token prediction modules).

Weights carry the label that Megatron-style tensor parallelism shards (``tp_shard``): the QKV
and first MLP projections are column-parallel (sharded on their output heads / ffn), the
attention output and second MLP projections are row-parallel (sharded on their input), the
vocabulary is sharded for the embedding and the output layer. Everything else about sharding
(which collectives, where) is derived later from these placements.
"""

from __future__ import annotations

from functools import lru_cache

import sympy as sp

from typing import NamedTuple

from stage_cosim.graph.cost import ALIBI_FLOPS_PER_SCORE as ALIBI_FLOPS
from stage_cosim.graph.cost import SOFTCAP_FLOPS_PER_SCORE as SOFTCAP_FLOPS
from stage_cosim.graph.dims import LABEL_SIZE, NOPE, ROPE
from stage_cosim.graph.ir import DENSE, EXPERT, Block, BlockBuilder, Tensor
from stage_cosim.graph.ssm import product
from stage_cosim.model.architecture import ATTENTION, ATTENTION_MAMBA2, MOE_MLP, NO_MIXER, NO_MLP, ArchSwitches
from stage_cosim.model.config import ModelConfig


# Work per element of the activations (rough: these kernels are memory-bound).
ROPE_FLOPS = 6            # two multiplies and an add per rotated pair, both halves
SWIGLU_FLOPS = 6          # SiLU (exp, add, divide, multiply) times the up projection
GEGLU_FLOPS = 9           # tanh-approximated GELU times the up projection
GELU_FLOPS = 8
SQUARED_RELU_FLOPS = 2    # a max and a multiply
RELU_FLOPS = 1            # a max (OPT)
# The ungated MLPs' activation, by its work per element.
_ACTIVATION_FLOPS = {"gelu": GELU_FLOPS, "squared_relu": SQUARED_RELU_FLOPS, "relu": RELU_FLOPS}
# The router's score function and top-k selection, per expert score of a token.
ROUTER_FLOPS_PER_SCORE = 6


def _norm(b: BlockBuilder, name: str, x: Tensor, model: ModelConfig | ArchSwitches, *, over: str = "h",
          residual: bool = True) -> Tensor:
    rms = model.norm == "rmsnorm"
    weights = [b.weight(f"{name}.weight", over)]
    if not rms:
        weights.append(b.weight(f"{name}.bias", over))
    return b.norm(name, x, weights, rms=rms, over=over, residual=residual)


def _bias(b: BlockBuilder, name: str, x: Tensor, labels: str, tp_shard: str | None,
          *, residual: bool = False) -> Tensor:
    return b.add(name + "_add", x, b.weight(name, labels, tp_shard), residual=residual)


def _attention(b: BlockBuilder, x: Tensor, a: ArchSwitches, normed: Tensor | None = None) -> Tensor:
    """Norm, QKV, (QK-norm, RoPE), the attention core and the output projection, up to the
    row-parallel GEMM's output (not yet reduced over tp). ``normed``: the norm's output, where
    the layer computes it for the MLP as well (GPT-J's one norm per layer)."""
    y = normed if normed is not None else _norm(b, "input_norm", x, a)
    qkv = b.einsum("qkv", "bsh,hgrd->bsgrd", y, b.weight("qkv.weight", "hgrd", tp_shard="g"))
    if a.qkv_bias:
        qkv = _bias(b, "qkv.bias", qkv, "grd", "g")
    q, k, v = b.view("split_qkv", [qkv], ["bsgqd", "bsgd", "bsgd"], ["q", "k", "v"])
    if a.qk_layernorm:
        # One norm weight of head_dim shared by every head, applied where the heads are (sharded
        # over tp): its gradient is a partial sum over tp, all-reduced like Megatron does.
        q = _norm(b, "q_norm", q, a, over="d", residual=False)
        k = _norm(b, "k_norm", k, a, over="d", residual=False)
    if a.position == "rope":
        rope = ROPE_FLOPS * sp.Rational(a.rotary_percent.numerator, a.rotary_percent.denominator)
        q = b.pointwise("rope_q", [q], q.labels, flops_per_element=rope)
        k = b.pointwise("rope_k", [k], k.labels, flops_per_element=rope)
    if a.attention == "fused":
        ctx = b.attention("attention", q, k, v, causal=a.causal_flops, softcap=a.attn_softcap,
                          sinks=b.weight("attention.sinks", "gq", tp_shard="g") if a.attention_sinks else None,
                          alibi=a.position == "alibi")
    else:
        # Materialized scores: the whole s x s matrix, masked (a sliding window saves nothing here).
        scores = b.einsum("scores", "bsgqd,btgd->bgqst", q, k, attention_core=True)
        if a.position == "alibi":
            scores = b.pointwise("alibi_bias", [scores], scores.labels, flops_per_element=ALIBI_FLOPS,
                                 attention_core=True)
        if a.attn_softcap:
            scores = b.pointwise("score_softcap", [scores], scores.labels, flops_per_element=SOFTCAP_FLOPS,
                                 attention_core=True, saves_output=True)
        probs = b.softmax("softmax", scores, over="t", attention_core=True)
        if a.attention_dropout:
            probs = b.dropout("attention_dropout", probs, attention_core=True)
        ctx = b.einsum("context", "bgqst,btgd->bsgqd", probs, v, attention_core=True)
    if a.attention_output_gate:
        # Qwen3-Next: the query projection's second half, through a sigmoid, gates each head's output
        gate = b.einsum("output_gate", "bsh,hgqd->bsgqd", y, b.weight("output_gate.weight", "hgqd", tp_shard="g"))
        ctx = product(b, "output_gated", ctx, gate, flops_per_element=5)
    return b.einsum("proj", "bsgqd,gqdh->bsh", ctx, b.weight("proj.weight", "gqdh", tp_shard="g"))


def _latent_attention(b: BlockBuilder, x: Tensor, a: ArchSwitches, absorb: bool = False) -> Tensor:
    """Multi-latent attention (DeepSeek-V2/V3, as Megatron-Core builds it): the down projections
    are replicated over tp (each rank projects its own tokens), the up projections
    column-parallel over heads; the rotary key part is shared by every head (gathered over tp
    with sequence parallelism, as Megatron does).

    ``absorb``: the key and value up-projection absorbed into the query and the output (what
    serving engines decode with: DeepSeek-V2's paper, FlashMLA): each head's query without its
    rotary part is projected into the latent space, the attention scores it against the latent
    and the rotary key (one ``kv_lora_rank + qk_rope_head_dim`` vector per token, shared by all
    heads) and sums the latents, which the value half of the up-projection turns into the head's
    output. The up-projection's weight is read as its key and value halves (a view)."""
    y = _norm(b, "input_norm", x, a)
    if a.q_lora:
        latent_q = b.einsum("q_down", "bsh,hl->bsl", y, b.weight("q_down.weight", "hl"))
        latent_q = _norm(b, "q_norm", latent_q, a, over="l", residual=False)
        q = b.einsum("q_up", "bsl,lga->bsga", latent_q, b.weight("q_up.weight", "lga", tp_shard="g"))
    else:
        q = b.einsum("q_proj", "bsh,hga->bsga", y, b.weight("q_proj.weight", "hga", tp_shard="g"))
    kv = b.einsum("kv_down", "bsh,hy->bsy", y, b.weight("kv_down.weight", "hy"))
    latent, k_rope = b.view("split_kv", [kv], ["bsm", "bso"], ["kv_latent", "k_rope"])
    latent = _norm(b, "kv_norm", latent, a, over="m", residual=False)
    up = b.weight("kv_up.weight", "mgz", tp_shard="g")
    if not absorb:
        kv = b.einsum("kv_up", "bsm,mgz->bsgz", latent, up)
        k, v = b.view("split_kv_up", [kv], ["bsgx", "bsgd"], ["k", "v"])
    # RoPE on the rotary part of each query head and on the shared rotary key.
    q = b.pointwise("rope_q", [q], q.labels, flops_per_element=ROPE_FLOPS * ROPE / (NOPE + ROPE))
    k_rope = b.pointwise("rope_k", [k_rope], k_rope.labels, flops_per_element=ROPE_FLOPS)
    if a.attention != "fused":
        raise ValueError("multi-latent attention is modelled with fused attention only")
    if absorb:
        up_k, up_v = b.view("split_kv_up_weight", [up], ["mgx", "mgd"], ["kv_up.k", "kv_up.v"])
        q_nope, q_rope = b.view("split_q", [q], ["bsgx", "bsgo"], ["q_nope", "q_rope"])
        q_latent = b.einsum("q_absorb", "bsgx,mgx->bsgm", q_nope, up_k)
        (q,) = b.view("join_q", [q_latent, q_rope], ["bsgy"], ["q_absorbed"])
        # the latent serves as the keys' non-rotary part and as the values
        ctx = b.attention("attention", q, k_rope, latent, causal=a.causal_flops)
        # its kernel is FlashMLA's, with rates of its own (adapters/roofline/compute.py's flavours)
        b.ops[-1].precision = "flashmla"
        ctx = b.einsum("v_absorb", "bsgm,mgd->bsgd", ctx, up_v)
    else:
        ctx = b.attention("attention", q, k, v, causal=a.causal_flops, rotary_key=k_rope)
    return b.einsum("proj", "bsgd,gdh->bsh", ctx, b.weight("proj.weight", "gdh", tp_shard="g"))


def _mlp(b: BlockBuilder, y: Tensor, a: ArchSwitches, ffn: str = "f", name: str = "") -> Tensor:
    """The MLP from its (normalized) input up to the row-parallel GEMM's output (``ffn``: the
    label of its intermediate size; ``name``: a prefix for its ops and weights)."""
    if a.gated:
        up = b.einsum(f"{name}fc1", f"bsh,hu{ffn}->bsu{ffn}", y,
                      b.weight(f"{name}fc1.weight", f"hu{ffn}", tp_shard=ffn))
        if a.mlp_bias:
            up = _bias(b, f"{name}fc1.bias", up, f"u{ffn}", ffn)
        flops = SWIGLU_FLOPS if a.mlp == "swiglu" else GEGLU_FLOPS
        act = b.pointwise(f"{name}{a.mlp}", [up], f"bs{ffn}", flops_per_element=flops, saves=[up])
    else:
        up = b.einsum(f"{name}fc1", f"bsh,h{ffn}->bs{ffn}", y, b.weight(f"{name}fc1.weight", f"h{ffn}", tp_shard=ffn))
        if a.mlp_bias:
            up = _bias(b, f"{name}fc1.bias", up, ffn, ffn)
        flops = _ACTIVATION_FLOPS[a.mlp]
        act = b.pointwise(f"{name}{a.mlp}", [up], f"bs{ffn}", flops_per_element=flops, saves=[up])
    return b.einsum(f"{name}fc2", f"bs{ffn},{ffn}h->bsh", act, b.weight(f"{name}fc2.weight", f"{ffn}h", tp_shard=ffn))


def _experts(b: BlockBuilder, slots: Tensor, a: ArchSwitches) -> Tensor:
    """The routed experts on their tokens: grouped GEMMs over the local experts (``e``, sharded
    over ep), each column- then row-parallel over expert_tp (``i``)."""
    gated = a.gated
    u = "u" if gated else ""
    up = b.einsum("experts.fc1", f"ech,eh{u}i->ec{u}i", slots, b.weight("experts.fc1.weight", f"eh{u}i", tp_shard="i"))
    if a.mlp_bias:
        up = _bias(b, "experts.fc1.bias", up, f"e{u}i", "i")
    flops = ((SWIGLU_FLOPS if a.mlp == "swiglu" else GEGLU_FLOPS) if gated
             else _ACTIVATION_FLOPS[a.mlp])
    act = b.pointwise(f"experts.{a.mlp}", [up], "eci", flops_per_element=flops, saves=[up])
    down = b.einsum("experts.fc2", "eci,eih->ech", act, b.weight("experts.fc2.weight", "eih", tp_shard="i"))
    if a.mlp_bias:
        down = _bias(b, "experts.fc2.bias", down, "eh", None)
    return down


def _moe(b: BlockBuilder, y: Tensor, a: ArchSwitches) -> Tensor:
    """A Mixture-of-Experts MLP (Megatron-Core's MoELayer): the router's GEMM and top-k, the
    tokens read on the expert mesh and permuted into expert order (dispatch), the experts, the
    weighted unpermutation (combine) back to token order on the dense mesh; the shared experts
    (a dense MLP) beside them. Dispatch and combine move no data themselves: the all-to-all
    (or all-gather / reduce-scatter) between them and the experts are placement changes of the
    routed tokens, derived like every other collective."""
    logits = b.einsum("router", "bsh,he->bse", y, b.weight("router.weight", "he"))
    if a.moe_router_bias:
        logits = _bias(b, "router.bias", logits, "e", None)
    probs, routing = b.router("router.topk", logits,
                              topk_flops=ROUTER_FLOPS_PER_SCORE * LABEL_SIZE["e"] / LABEL_SIZE["k"])
    tokens, probs, routing = b.mesh_change("to_experts", [y, probs, routing], ["nh", "nk", "nk"], EXPERT)
    b.mesh = EXPERT
    slots = b.permute("dispatch", tokens, routing, "ech")
    out = b.unpermute("combine", _experts(b, slots, a), probs, "nh")
    b.mesh = DENSE
    (routed,) = b.mesh_change("from_experts", [out], ["bsh"], DENSE)
    if not a.moe_shared_expert:
        return routed
    first = len(b.ops)
    shared = _mlp(b, y, a, ffn="j", name="shared_experts.")
    if not a.moe_shared_expert_overlap:
        b.ops[first].after.append(routed)     # Megatron runs them after the routed experts
    if a.moe_shared_expert_gate:
        gate = b.einsum("shared_experts.gate", "bsh,h->bs", y, b.weight("shared_experts.gate.weight", "h"))
        shared = b.pointwise("shared_experts.gated", [shared, gate], "bsh", flops_per_element=5, saves=[gate])
    return b.add("moe_sum", routed, shared, residual=False)


def _ffn(b: BlockBuilder, y: Tensor, a: ArchSwitches, moe: bool) -> Tensor:
    return _moe(b, y, a) if moe else _mlp(b, y, a)


def _sublayer_out(b: BlockBuilder, out: Tensor, bias: str | None, post_norm: str | None,
                  dropout: str | None, a: ArchSwitches) -> Tensor:
    """What happens to a sublayer's output in the residual stream before it is added: the bias
    of the row-parallel GEMM, the sandwich norm, dropout."""
    if bias is not None:
        out = _bias(b, bias, out, "h", None, residual=True)
    if post_norm is not None:
        out = _norm(b, post_norm, out, a)
    if dropout is not None:
        out = b.dropout(dropout, out, residual=True)
    return out


def _hybrid_layer(b: BlockBuilder, x: Tensor, a: ArchSwitches, mixer: str, mlp: str) -> Tensor:
    """A layer of a hybrid model: its mixer sublayer (none, attention, an SSM mixer, or attention
    and a Mamba-2 mixer side by side) and its MLP sublayer (none, dense or MoE), each pre-normed
    with a residual add. Row-parallel biases are added after the tp reduction, as in _layer."""
    from stage_cosim.graph.ssm import MIXER_BUILDERS, mamba2_mixer

    drop = a.hidden_dropout
    if mixer != NO_MIXER:
        bias = None
        if mixer == ATTENTION:
            out = _attention(b, x, a)
            bias = "proj.bias" if a.attention_bias else None
        elif mixer == ATTENTION_MAMBA2:
            # Falcon-H1: both read one norm's output; their row-parallel outputs are summed while
            # still partial over tp, so one reduction serves both (as a parallel residual's)
            y = _norm(b, "input_norm", x, a)
            out = b.add("mixer_sum", _attention(b, x, a, normed=y), mamba2_mixer(b, y, a), residual=False)
            if a.attention_bias:
                out = _bias(b, "proj.bias", out, "h", None, residual=True)
            bias = "out_proj.bias" if a.ssm_proj_bias else None
        else:
            out = MIXER_BUILDERS[mixer](b, _norm(b, "input_norm", x, a), a)
            bias = "out_proj.bias" if a.ssm_proj_bias else None
        out = _sublayer_out(b, out, bias, "post_attention_norm" if a.sandwich_norm else None,
                            "proj_dropout" if drop else None, a)
        x = b.add("attention_residual", x, out)
    if mlp == NO_MLP:
        return x
    moe = mlp == MOE_MLP
    down = _ffn(b, _norm(b, "mlp_norm", x, a), a, moe)
    down = _sublayer_out(b, down, "fc2.bias" if a.mlp_bias and not moe else None,
                         "post_mlp_norm" if a.sandwich_norm else None, "mlp_dropout" if drop else None, a)
    return b.add("mlp_residual", x, down)


def _layer(b: BlockBuilder, x: Tensor, a: ArchSwitches, *, moe: bool, absorb: bool = False) -> Tensor:
    """One transformer layer from its input (the residual stream) to its output (``absorb``:
    latent attention in its absorbed form)."""
    drop = a.hidden_dropout

    def attention(b: BlockBuilder, x: Tensor, a: ArchSwitches) -> Tensor:
        return _latent_attention(b, x, a, absorb) if a.multi_latent_attention else _attention(b, x, a)

    if a.parallel_residual:
        # x + attention(norm1(x)) + mlp(norm2(x)): the two row-parallel outputs are summed while
        # still partial over tp (a sum of partial sums), so one reduction serves both.
        if a.shared_input_norm:
            # GPT-J: attention and MLP read one norm's output
            y = _norm(b, "input_norm", x, a)
            attn, down = _attention(b, x, a, normed=y), _ffn(b, y, a, moe)
        else:
            attn = attention(b, x, a)
            down = _ffn(b, _norm(b, "mlp_norm", x, a), a, moe)
        both = b.add("branch_sum", attn, down, residual=False)
        if a.attention_bias:
            both = _bias(b, "proj.bias", both, "h", None, residual=True)
        both = _sublayer_out(b, both, "fc2.bias" if a.mlp_bias and not moe else None, None,
                             "residual_dropout" if drop else None, a)
        return b.add("residual", x, both)
    attn = _sublayer_out(b, attention(b, x, a), "proj.bias" if a.attention_bias else None,
                         "post_attention_norm" if a.sandwich_norm else None, "proj_dropout" if drop else None, a)
    x = b.add("attention_residual", x, attn)
    down = _ffn(b, _norm(b, "mlp_norm", x, a), a, moe)
    down = _sublayer_out(b, down, "fc2.bias" if a.mlp_bias and not moe else None,
                         "post_mlp_norm" if a.sandwich_norm else None, "mlp_dropout" if drop else None, a)
    return b.add("mlp_residual", x, down)


def build_layer(model: ModelConfig | ArchSwitches, moe: bool = False, absorb: bool = False,
                kind: tuple[str, str] | None = None) -> Block:
    """A transformer layer; ``moe``: its MLP is a Mixture of Experts; ``absorb``: its latent
    attention (if any) in the absorbed form serving engines decode with; ``kind``: a hybrid
    model's (mixer, MLP) kind instead."""
    a = model.switches() if isinstance(model, ModelConfig) else model
    b = BlockBuilder("layer", "layer")
    x = b.input("x", "bsh")
    if kind is not None:
        return b.build([_hybrid_layer(b, x, a, *kind)])
    return b.build([_layer(b, x, a, moe=moe, absorb=absorb)])


def build_embedding(model: ModelConfig | ArchSwitches) -> Block:
    a = model.switches() if isinstance(model, ModelConfig) else model
    b = BlockBuilder("embedding", "embedding")
    ids = b.input("tokens", "bs", "i64", residual=False)
    x = b.lookup("word_embedding", b.weight("word_embedding", "vh", tp_shard="v"), ids)
    if a.position == "learned":
        pos = b.lookup("position_embedding", b.weight("position_embedding", "ph"), ids)
        x = b.add("embedding_sum", x, pos)
    if a.embedding_norm:
        x = _norm(b, "embedding_norm", x, a)      # BLOOM's word_embeddings_layernorm
    if a.scale_embeddings:
        # Gemma multiplies the embeddings by sqrt(hidden): one more pass in the residual stream.
        x = b.pointwise("embedding_scale", [x], x.labels, flops_per_element=1, residual=True)
    if a.hidden_dropout:
        x = b.dropout("embedding_dropout", x, residual=True)
    return b.build([x])


def build_head(model: ModelConfig | ArchSwitches, embedding: Block | None = None) -> Block:
    """Final norm, output projection and vocabulary-parallel cross-entropy; then the
    multi-token-prediction modules, if any (DeepSeek-V3): each embeds the next tokens (with the
    embedding's table), joins them to the previous hidden states (two norms, a projection from
    2h to h), runs one more layer and a loss through the shared output layer.

    With tied embeddings (or multi-token prediction) the head reuses the embedding block's
    table; pass that block so both blocks hold the same weight object.
    """
    a = model.switches() if isinstance(model, ModelConfig) else model
    b = BlockBuilder("head", "head")
    x = b.input("x", "bsh")
    labels = b.input("labels", "bs", "i64", residual=False)
    table = None
    if a.tied_embeddings or a.mtp_layers:
        table = embedding.weights[0] if embedding is not None else build_embedding(a).weights[0]
    loss, w = _loss(b, x, None if not a.tied_embeddings else b.shared_weight(table), labels, a)
    losses = [loss]
    if a.mtp_layers:
        if not a.tied_embeddings:
            b.shared_weight(table)
        tokens = b.input("tokens", "bs", "i64", residual=False)
        hidden = x
        for k in range(a.mtp_layers):
            b.prefix = f"mtp{k}."
            emb = _norm(b, "enorm", b.lookup("embedding", table, tokens), a)
            joined = b.view("join", [emb, _norm(b, "hnorm", hidden, a)], ["bsuh"], ["joined"])[0]
            proj = b.einsum("eh_proj", "bsuh,uhw->bsw", joined, b.weight("eh_proj.weight", "uhw"))
            (h,) = b.view("as_hidden", [proj], ["bsh"], ["hidden"])
            hidden = _layer(b, h, a, moe=a.mtp_moe)
            losses.append(_loss(b, hidden, w, labels, a)[0])
        b.prefix = ""
    return b.build(losses)


def _loss(b: BlockBuilder, x: Tensor, w: Tensor | None, labels: Tensor, a: ArchSwitches) -> tuple[Tensor, Tensor]:
    """Final norm, logits through the output layer ``w`` (None: a new one), cross-entropy
    against ``labels``; the loss and the output layer."""
    y = _norm(b, "final_norm", x, a)
    if w is None:
        w = b.weight("output.weight", "vh", tp_shard="v")
    logits = b.einsum("logits", "bsh,vh->bsv", y, w)
    if a.final_softcap:
        # cap * tanh(logits / cap) over the (vocabulary-sharded) logits; the backward reads its output.
        logits = b.pointwise("logit_softcap", [logits], logits.labels, flops_per_element=SOFTCAP_FLOPS,
                             saves_output=True)
    return b.cross_entropy("cross_entropy", logits, labels, fused=a.cross_entropy == "fused"), w


class ModelGraph(NamedTuple):
    """The blocks of a model: the embedding, a dense layer, a Mixture-of-Experts layer (None
    without experts), the head; a hybrid model's other layer kinds, one block per entry of
    its switches' ``hybrid_kinds``."""

    embedding: Block
    layer: Block
    head: Block
    moe_layer: Block | None = None
    hybrid: tuple[Block, ...] = ()

    def block(self, kind: tuple[str, str], hybrid_kinds: tuple[tuple[str, str], ...]) -> Block:
        """The block of a layer of ``kind`` ((mixer, MLP), as ModelConfig.layer_kind says)."""
        if kind in hybrid_kinds:
            return self.hybrid[hybrid_kinds.index(kind)]
        return self.moe_layer if kind[1] == MOE_MLP else self.layer


def build_blocks(model: ModelConfig | ArchSwitches) -> ModelGraph:
    """The embedding, the (repeated) layer kinds and the head of ``model``.

    Sizes live in the symbols, so the graph depends only on the architecture switches and is
    built once per family of models.
    """
    return _build_blocks(model.switches() if isinstance(model, ModelConfig) else model)


@lru_cache(maxsize=64)
def _build_blocks(arch: ArchSwitches) -> ModelGraph:
    embedding = build_embedding(arch)
    return ModelGraph(embedding, build_layer(arch), build_head(arch, embedding),
                      build_layer(arch, moe=True) if arch.moe else None,
                      tuple(build_layer(arch, kind=k) for k in arch.hybrid_kinds))


def symbolic_param_count(model: ModelConfig) -> int:
    """Parameters summed over the graph's weight tensors (tied tables counted once), the
    multi-token-prediction modules included."""
    from stage_cosim.graph.dims import model_values

    g = build_blocks(model)
    values = model_values(model, 1, 1)
    seen: set[int] = set()
    total = 0
    kinds = model.layer_kinds()
    hybrid = model.switches().hybrid_kinds
    blocks = [(g.embedding, 1), (g.head, 1)]
    for kind in sorted(set(kinds)):
        blocks.append((g.block(kind, hybrid), kinds.count(kind)))
    for block, repeat in blocks:
        for w in block.weights:
            if id(w) in seen:
                continue
            seen.add(id(w))
            total += int(w.numel().subs(values)) * repeat
    return total
