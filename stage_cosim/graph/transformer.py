"""Forward graphs of the three block kinds of a decoder-only transformer.

Weights carry the label that Megatron-style tensor parallelism shards (``tp_shard``): the QKV
and first MLP projections are column-parallel (sharded on their output heads / ffn), the
attention output and second MLP projections are row-parallel (sharded on their input), the
vocabulary is sharded for the embedding and the output layer. Everything else about sharding
(which collectives, where) is derived later from these placements.
"""

from __future__ import annotations

from functools import lru_cache

import sympy as sp

from stage_cosim.graph.cost import SOFTCAP_FLOPS_PER_SCORE as SOFTCAP_FLOPS
from stage_cosim.graph.ir import Block, BlockBuilder, Tensor
from stage_cosim.model.config import ArchSwitches, ModelConfig


# Work per element of the activations (rough: these kernels are memory-bound).
ROPE_FLOPS = 6            # two multiplies and an add per rotated pair, both halves
SWIGLU_FLOPS = 6          # SiLU (exp, add, divide, multiply) times the up projection
GEGLU_FLOPS = 9           # tanh-approximated GELU times the up projection
GELU_FLOPS = 8


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


def _attention(b: BlockBuilder, x: Tensor, a: ArchSwitches) -> Tensor:
    """Norm, QKV, (QK-norm, RoPE), the attention core and the output projection, up to the
    row-parallel GEMM's output (not yet reduced over tp)."""
    y = _norm(b, "input_norm", x, a)
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
        ctx = b.attention("attention", q, k, v, causal=a.causal_flops, softcap=a.attn_softcap)
    else:
        # Materialized scores: the whole s x s matrix, masked (a sliding window saves nothing here).
        scores = b.einsum("scores", "bsgqd,btgd->bgqst", q, k, attention_core=True)
        if a.attn_softcap:
            scores = b.pointwise("score_softcap", [scores], scores.labels, flops_per_element=SOFTCAP_FLOPS,
                                 attention_core=True, saves_output=True)
        probs = b.softmax("softmax", scores, over="t", attention_core=True)
        if a.attention_dropout:
            probs = b.dropout("attention_dropout", probs, attention_core=True)
        ctx = b.einsum("context", "bgqst,btgd->bsgqd", probs, v, attention_core=True)
    return b.einsum("proj", "bsgqd,gqdh->bsh", ctx, b.weight("proj.weight", "gqdh", tp_shard="g"))


def _mlp(b: BlockBuilder, y: Tensor, a: ArchSwitches) -> Tensor:
    """The MLP from its (normalized) input up to the row-parallel GEMM's output."""
    if a.gated:
        up = b.einsum("fc1", "bsh,huf->bsuf", y, b.weight("fc1.weight", "huf", tp_shard="f"))
        if a.mlp_bias:
            up = _bias(b, "fc1.bias", up, "uf", "f")
        flops = SWIGLU_FLOPS if a.mlp == "swiglu" else GEGLU_FLOPS
        act = b.pointwise(a.mlp, [up], "bsf", flops_per_element=flops, saves=[up])
    else:
        up = b.einsum("fc1", "bsh,hf->bsf", y, b.weight("fc1.weight", "hf", tp_shard="f"))
        if a.mlp_bias:
            up = _bias(b, "fc1.bias", up, "f", "f")
        act = b.pointwise("gelu", [up], "bsf", flops_per_element=GELU_FLOPS, saves=[up])
    return b.einsum("fc2", "bsf,fh->bsh", act, b.weight("fc2.weight", "fh", tp_shard="f"))


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


def build_layer(model: ModelConfig | ArchSwitches) -> Block:
    a = model.switches() if isinstance(model, ModelConfig) else model
    b = BlockBuilder("layer", "layer")
    x = b.input("x", "bsh")
    drop = a.hidden_dropout
    if a.parallel_residual:
        # x + attention(norm1(x)) + mlp(norm2(x)): the two row-parallel outputs are summed while
        # still partial over tp (a sum of partial sums), so one reduction serves both.
        attn = _attention(b, x, a)
        down = _mlp(b, _norm(b, "mlp_norm", x, a), a)
        both = b.add("branch_sum", attn, down, residual=False)
        if a.attention_bias:
            both = _bias(b, "proj.bias", both, "h", None, residual=True)
        both = _sublayer_out(b, both, "fc2.bias" if a.mlp_bias else None, None,
                             "residual_dropout" if drop else None, a)
        return b.build([b.add("residual", x, both)])
    attn = _sublayer_out(b, _attention(b, x, a), "proj.bias" if a.attention_bias else None,
                         "post_attention_norm" if a.sandwich_norm else None, "proj_dropout" if drop else None, a)
    x = b.add("attention_residual", x, attn)
    down = _mlp(b, _norm(b, "mlp_norm", x, a), a)
    down = _sublayer_out(b, down, "fc2.bias" if a.mlp_bias else None,
                         "post_mlp_norm" if a.sandwich_norm else None, "mlp_dropout" if drop else None, a)
    return b.build([b.add("mlp_residual", x, down)])


def build_embedding(model: ModelConfig | ArchSwitches) -> Block:
    a = model.switches() if isinstance(model, ModelConfig) else model
    b = BlockBuilder("embedding", "embedding")
    ids = b.input("tokens", "bs", "i64", residual=False)
    x = b.lookup("word_embedding", b.weight("word_embedding", "vh", tp_shard="v"), ids)
    if a.position == "learned":
        pos = b.lookup("position_embedding", b.weight("position_embedding", "ph"), ids)
        x = b.add("embedding_sum", x, pos)
    if a.scale_embeddings:
        # Gemma multiplies the embeddings by sqrt(hidden): one more pass in the residual stream.
        x = b.pointwise("embedding_scale", [x], x.labels, flops_per_element=1, residual=True)
    if a.hidden_dropout:
        x = b.dropout("embedding_dropout", x, residual=True)
    return b.build([x])


def build_head(model: ModelConfig | ArchSwitches, embedding: Block | None = None) -> Block:
    """Final norm, output projection and vocabulary-parallel cross-entropy.

    With tied embeddings the output projection reuses the embedding block's table; pass that
    block so both blocks hold the same weight object.
    """
    a = model.switches() if isinstance(model, ModelConfig) else model
    b = BlockBuilder("head", "head")
    x = b.input("x", "bsh")
    labels = b.input("labels", "bs", "i64", residual=False)
    y = _norm(b, "final_norm", x, a)
    if a.tied_embeddings:
        table = embedding.weights[0] if embedding is not None else build_embedding(a).weights[0]
        w = b.shared_weight(table)
    else:
        w = b.weight("output.weight", "vh", tp_shard="v")
    logits = b.einsum("logits", "bsh,vh->bsv", y, w)
    if a.final_softcap:
        # cap * tanh(logits / cap) over the (vocabulary-sharded) logits; the backward reads its output.
        logits = b.pointwise("logit_softcap", [logits], logits.labels, flops_per_element=SOFTCAP_FLOPS,
                             saves_output=True)
    loss = b.cross_entropy("cross_entropy", logits, labels, fused=a.cross_entropy == "fused")
    return b.build([loss])


def build_blocks(model: ModelConfig | ArchSwitches) -> tuple[Block, Block, Block]:
    """The embedding, the (repeated) layer and the head of ``model``.

    Sizes live in the symbols, so the graph depends only on the architecture switches and is
    built once per family of models.
    """
    return _build_blocks(model.switches() if isinstance(model, ModelConfig) else model)


@lru_cache(maxsize=64)
def _build_blocks(arch: ArchSwitches) -> tuple[Block, Block, Block]:
    embedding = build_embedding(arch)
    return embedding, build_layer(arch), build_head(arch, embedding)


def symbolic_param_count(model: ModelConfig) -> int:
    """Parameters summed over the graph's weight tensors (tied tables counted once)."""
    from stage_cosim.graph.dims import model_values

    embedding, layer, head = build_blocks(model)
    values = model_values(model, 1, 1)
    seen: set[int] = set()
    total = 0
    for block, repeat in ((embedding, 1), (layer, model.layers), (head, 1)):
        for w in block.weights:
            if id(w) in seen:
                continue
            seen.add(id(w))
            total += int(w.numel().subs(values)) * repeat
    return total
