"""Inference graphs: the training forward graph, with a KV cache in place of the backward.

An inference step runs the forward of every block and nothing else. What differs from a
training forward is derived here from the forward graph itself, whatever built it:

* **the layer** reads its keys and values from the KV cache: every tensor the attention core
  reads as keys or values (``bsgd``: this step's new tokens) is written into a cache tensor
  first (one memory-bound kernel, as vLLM's ``reshape_and_cache`` is), and the attention reads
  the cache (``btgd``: ``t`` cached tokens per sequence, the new ones included) instead. The
  caches are the block's state (:attr:`Block.caches`); their tensor-parallel label is the
  heads', so they are sharded exactly as the attention that reads them. Keys and values
  up-projected from a per-token latent (multi-latent attention) are cached as the latent, the
  up-projection then running over the cached tokens; a decode step runs latent attention in
  its absorbed form instead (:func:`~stage_cosim.graph.transformer.build_layer`), whose
  attention reads the latent and the rotary key directly;
* **dropout** is off (evaluation mode);
* **the head** keeps each sequence's last token, computes its logits and samples the next
  token from them (the vocabulary-parallel logits are gathered first, a placement change like
  any other): no loss, no labels.

The attention core is causal; its executed work is bound to numbers by the step's shape
(:mod:`stage_cosim.inference.config`): ``w`` keys per query on average, which counts exactly
the (query, key) pairs a causal kernel computes.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from stage_cosim.graph.dims import LABEL_SIZE
from stage_cosim.graph.ir import Block, BlockBuilder, Op, Tensor
from stage_cosim.graph.transformer import ModelGraph, _norm, build_blocks, build_layer
from stage_cosim.model.config import ArchSwitches

# Work per logit of sampling (softmax, top-k/top-p filtering, the draw), memory-bound anyway.
SAMPLE_FLOPS_PER_LOGIT = 5


def _key_value_inputs(op: Op) -> list[Tensor]:
    """The tensors an attention-core op reads as keys or values: every input but the queries
    of a fused kernel; the operands an unfused einsum indexes by the key sequence ``t``."""
    if op.kind == "attention":
        return [t for t in op.inputs[1:] if t.kind != "weight"]
    if op.kind == "einsum" and op.attention_core:
        letters, _ = op.einsum_operands()
        return [t for t, l in zip(op.inputs, letters) if "t" in l and "s" not in l and t.kind == "activation"
                and "s" in t.labels]
    return []


def _expansion(t: Tensor, producer: dict[int, Op], consumers: dict[int, list[Op]],
               kv: list[Tensor]) -> tuple[Tensor, list[Op]] | None:
    """Keys and values computed from a per-token latent by an up-projection (multi-latent
    attention): (the latent, [the up-projection GEMM, the view that splits its output]) when
    ``t`` is split from the output of a GEMM with a weight, whose other operand nothing else
    reads, and every part of the split is read as keys or values. None otherwise: the keys
    and values themselves are what is cached."""
    split = producer.get(id(t))
    if split is None or split.kind != "view" or len(split.inputs) != 1 or not all(o in kv for o in split.outputs):
        return None
    up = producer.get(id(split.inputs[0]))
    if up is None or up.kind != "einsum":
        return None
    latent = [x for x in up.inputs if x.kind != "weight"]
    if len(latent) != 1 or len(up.inputs) != 2 or consumers.get(id(latent[0])) != [up]:
        return None
    return latent[0], [up, split]


def _over_cache(op: Op, over: dict[int, Tensor], slots: list[Tensor]) -> Op:
    """An op that computes keys or values from this step's tokens, run instead over every
    cached token (``s`` becomes ``t``), after the cache is written."""
    outs = [Tensor(t.name, t.labels.replace("s", "t"), t.dtype, t.kind, t.tp_shard, mesh=t.mesh) for t in op.outputs]
    over.update({id(t): o for t, o in zip(op.outputs, outs)})
    return replace(op, inputs=[over.get(id(t), t) for t in op.inputs], outputs=outs, spec=op.spec.replace("s", "t"),
                   after=[*op.after, *slots], saves=[])


def with_kv_cache(layer: Block, kv_cache_dtype: str) -> Block:
    """``layer``'s forward with its attention reading a KV cache (see the module docstring).

    The cache holds the keys and values the attention reads, or, where they are up-projected
    from a latent (multi-latent attention), the latent: the up-projection then runs over every
    cached token (as serving engines expand the cached latents for a prefill)."""
    fresh: list[Tensor] = []
    for op in layer.ops:
        fresh += [t for t in _key_value_inputs(op) if t not in fresh]
    if not fresh:
        return layer
    producer = {id(t): op for op in layer.ops for t in op.outputs}
    consumers: dict[int, list[Op]] = {}
    for op in layer.ops:
        for t in op.inputs:
            consumers.setdefault(id(t), []).append(op)
    points: list[Tensor] = []          # what the cache holds
    expand: list[Op] = []              # ops re-run over the cached tokens
    for t in fresh:
        found = _expansion(t, producer, consumers, fresh)
        point, ops = found if found is not None else (t, [])
        points += [point] if point not in points else []
        expand += [op for op in ops if op not in expand]
    caches = {id(t): Tensor(f"{t.name}_cache", t.labels.replace("s", "t"), kv_cache_dtype, "kv_cache",
                            tp_shard="g" if "g" in t.labels else None) for t in points}
    slots = [Tensor(f"{t.name}.cached", t.labels, kv_cache_dtype, "activation") for t in points]
    write = Op("kv_cache_write", "pointwise", list(points), slots, flops_per_element=0)
    over: dict[int, Tensor] = dict(caches)      # a forward tensor -> its version over the cached tokens
    ops: list[Op] = []
    for op in layer.ops:
        if op in expand:
            continue
        kv = _key_value_inputs(op)
        if kv:
            if write not in ops:
                ops.append(write)
                ops += [_over_cache(e, over, slots) for e in expand]
            # causal work is bound through the shape (keys per query), not halved again
            op = replace(op, inputs=[over[id(t)] if t in kv else t for t in op.inputs], after=[*op.after, *slots],
                         causal=False, saves=[])
        ops.append(op)
    return Block(layer.name, layer.kind, ops, layer.inputs, layer.outputs, layer.weights,
                 caches=list(caches.values()))


def inference_head(arch: ArchSwitches, embedding: Block) -> Block:
    """The last token of every sequence: final norm, logits, sampling."""
    b = BlockBuilder("head", "head")
    x = b.input("x", "bsh")
    last = b.input("last_positions", "b", "i64", residual=False)
    # a gather of one row per sequence (the positions where each sequence's new tokens end)
    y = Tensor("last_token", "bh", b.dtype, "activation")
    b.ops.append(Op("last_token", "lookup", [x, last], [y], spec="s"))
    y = _norm(b, "final_norm", y, arch, residual=False)
    if arch.tied_embeddings:
        w = b.shared_weight(embedding.weights[0])
    else:
        w = b.weight("output.weight", "vh", tp_shard="v")
    logits = b.einsum("logits", "bh,vh->bv", y, w)
    if arch.final_softcap:
        from stage_cosim.graph.cost import SOFTCAP_FLOPS_PER_SCORE

        logits = b.pointwise("logit_softcap", [logits], logits.labels, flops_per_element=SOFTCAP_FLOPS_PER_SCORE)
    tokens = Tensor("next_tokens", "b", "i64", "activation")
    # sampling needs each sequence's whole vocabulary: the logits are gathered over tp first
    b.ops.append(Op("sample", "softmax", [logits], [tokens], unsharded="v",
                    flops_per_element=SAMPLE_FLOPS_PER_LOGIT * LABEL_SIZE["v"]))
    return b.build([tokens])


def inference_blocks(arch: ArchSwitches, kv_cache_dtype: str = "bf16", absorb: bool = False) -> ModelGraph:
    """The embedding, the layer kinds (reading their KV cache) and the sampling head of an
    inference step; ``absorb``: latent attention in its absorbed form (a decode step)."""
    return _inference_blocks(arch, kv_cache_dtype, absorb and arch.multi_latent_attention)


@lru_cache(maxsize=64)
def _inference_blocks(arch: ArchSwitches, kv_cache_dtype: str, absorb: bool) -> ModelGraph:
    a = replace(arch, hidden_dropout=False, attention_dropout=False)
    g = build_blocks(a)
    layer, moe = g.layer, g.moe_layer
    if absorb:
        layer, moe = build_layer(a, absorb=True), build_layer(a, moe=True, absorb=True) if a.moe else None
    moe = with_kv_cache(moe, kv_cache_dtype) if moe is not None else None
    return ModelGraph(g.embedding, with_kv_cache(layer, kv_cache_dtype), inference_head(a, g.embedding), moe)
