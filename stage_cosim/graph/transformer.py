"""Forward graphs of the three block kinds of a decoder-only transformer.

Weights carry the label that Megatron-style tensor parallelism shards (``tp_shard``): the QKV
and first MLP projections are column-parallel (sharded on their output heads / ffn), the
attention output and second MLP projections are row-parallel (sharded on their input), the
vocabulary is sharded for the embedding and the output layer. Everything else about sharding
(which collectives, where) is derived later from these placements.
"""

from __future__ import annotations

from functools import lru_cache

from stage_cosim.graph.ir import Block, BlockBuilder, Tensor
from stage_cosim.model.config import ArchSwitches, ModelConfig


def _norm(b: BlockBuilder, name: str, x: Tensor, model: ModelConfig | ArchSwitches) -> Tensor:
    rms = model.norm == "rmsnorm"
    weights = [b.weight(f"{name}.weight", "h")]
    if not rms:
        weights.append(b.weight(f"{name}.bias", "h"))
    return b.norm(name, x, weights, rms=rms)


def _bias(b: BlockBuilder, name: str, x: Tensor, labels: str, tp_shard: str | None,
          *, residual: bool = False) -> Tensor:
    return b.add(name + "_add", x, b.weight(name, labels, tp_shard), residual=residual)


def build_layer(model: ModelConfig | ArchSwitches) -> Block:
    b = BlockBuilder("layer", "layer")
    x = b.input("x", "bsh")

    # --- attention -------------------------------------------------------------------------
    y = _norm(b, "input_norm", x, model)
    qkv = b.einsum("qkv", "bsh,hgrd->bsgrd", y, b.weight("qkv.weight", "hgrd", tp_shard="g"))
    if model.bias:
        qkv = _bias(b, "qkv.bias", qkv, "grd", "g")
    q, k, v = b.view("split_qkv", [qkv], ["bsgqd", "bsgd", "bsgd"], ["q", "k", "v"])
    if model.position == "rope":
        q = b.pointwise("rope_q", [q], q.labels, flops_per_element=6)
        k = b.pointwise("rope_k", [k], k.labels, flops_per_element=6)
    if model.attention == "fused":
        ctx = b.attention("attention", q, k, v, causal=model.causal_flops)
    else:
        scores = b.einsum("scores", "bsgqd,btgd->bgqst", q, k, attention_core=True)
        probs = b.softmax("softmax", scores, over="t", attention_core=True)
        if model.dropout:
            probs = b.dropout("attention_dropout", probs, attention_core=True)
        ctx = b.einsum("context", "bgqst,btgd->bsgqd", probs, v, attention_core=True)
    proj = b.einsum("proj", "bsgqd,gqdh->bsh", ctx, b.weight("proj.weight", "gqdh", tp_shard="g"))
    if model.bias:
        proj = _bias(b, "proj.bias", proj, "h", None, residual=True)
    if model.dropout:
        proj = b.dropout("proj_dropout", proj, residual=True)
    x = b.add("attention_residual", x, proj)

    # --- MLP -------------------------------------------------------------------------------
    y = _norm(b, "mlp_norm", x, model)
    if model.mlp == "swiglu":
        up = b.einsum("fc1", "bsh,huf->bsuf", y, b.weight("fc1.weight", "huf", tp_shard="f"))
        if model.bias:
            up = _bias(b, "fc1.bias", up, "uf", "f")
        act = b.pointwise("swiglu", [up], "bsf", flops_per_element=6, saves=[up])
    else:
        up = b.einsum("fc1", "bsh,hf->bsf", y, b.weight("fc1.weight", "hf", tp_shard="f"))
        if model.bias:
            up = _bias(b, "fc1.bias", up, "f", "f")
        act = b.pointwise("gelu", [up], "bsf", flops_per_element=8, saves=[up])
    down = b.einsum("fc2", "bsf,fh->bsh", act, b.weight("fc2.weight", "fh", tp_shard="f"))
    if model.bias:
        down = _bias(b, "fc2.bias", down, "h", None, residual=True)
    if model.dropout:
        down = b.dropout("mlp_dropout", down, residual=True)
    out = b.add("mlp_residual", x, down)
    return b.build([out])


def build_embedding(model: ModelConfig | ArchSwitches) -> Block:
    b = BlockBuilder("embedding", "embedding")
    ids = b.input("tokens", "bs", "i64", residual=False)
    x = b.lookup("word_embedding", b.weight("word_embedding", "vh", tp_shard="v"), ids)
    if model.position == "learned":
        pos = b.lookup("position_embedding", b.weight("position_embedding", "ph"), ids)
        x = b.add("embedding_sum", x, pos)
    if model.dropout:
        x = b.dropout("embedding_dropout", x, residual=True)
    return b.build([x])


def build_head(model: ModelConfig | ArchSwitches, embedding: Block | None = None) -> Block:
    """Final norm, output projection and vocabulary-parallel cross-entropy.

    With tied embeddings the output projection reuses the embedding block's table; pass that
    block so both blocks hold the same weight object.
    """
    b = BlockBuilder("head", "head")
    x = b.input("x", "bsh")
    labels = b.input("labels", "bs", "i64", residual=False)
    y = _norm(b, "final_norm", x, model)
    if model.tied_embeddings:
        table = embedding.weights[0] if embedding is not None else build_embedding(model).weights[0]
        w = b.shared_weight(table)
    else:
        w = b.weight("output.weight", "vh", tp_shard="v")
    logits = b.einsum("logits", "bsh,vh->bsv", y, w)
    loss = b.cross_entropy("cross_entropy", logits, labels, fused=model.cross_entropy == "fused")
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
