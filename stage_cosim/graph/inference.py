"""Inference graphs: the training forward graph, with a KV cache in place of the backward.

An inference step runs the forward of every block and nothing else. What differs from a
training forward is derived here from the forward graph itself, whatever built it:

* **the layer** reads its keys and values from the KV cache: every tensor the attention core
  reads as keys or values (``bsgd``: this step's new tokens) is written into a cache tensor
  first (one memory-bound kernel, as vLLM's ``reshape_and_cache`` is), and the attention reads
  the cache (``btgd``: ``t`` cached tokens per sequence, the new ones included) instead. The
  caches are the block's state (:attr:`Block.caches`); their tensor-parallel label is the
  heads', so they are sharded exactly as the attention that reads them;
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
from stage_cosim.graph.transformer import ModelGraph, _norm, build_blocks
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


def with_kv_cache(layer: Block, kv_cache_dtype: str) -> Block:
    """``layer``'s forward with its attention reading a KV cache (see the module docstring)."""
    fresh: list[Tensor] = []
    for op in layer.ops:
        fresh += [t for t in _key_value_inputs(op) if t not in fresh]
    if not fresh:
        return layer
    caches = {id(t): Tensor(f"{t.name}_cache", t.labels.replace("s", "t"), kv_cache_dtype, "kv_cache",
                            tp_shard="g" if "g" in t.labels else None) for t in fresh}
    slots = [Tensor(f"{t.name}.cached", t.labels, kv_cache_dtype, "activation") for t in fresh]
    write = Op("kv_cache_write", "pointwise", list(fresh), slots, flops_per_element=0)
    ops: list[Op] = []
    for op in layer.ops:
        reads = [caches.get(id(t), t) if t in _key_value_inputs(op) else t for t in op.inputs]
        if any(r is not t for r, t in zip(reads, op.inputs)):
            if write not in ops:
                ops.append(write)
            # causal work is bound through the shape (keys per query), not halved again
            op = replace(op, inputs=reads, after=[*op.after, *slots], causal=False, saves=[])
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


def inference_blocks(arch: ArchSwitches, kv_cache_dtype: str = "bf16") -> ModelGraph:
    """The embedding, the layer kinds (reading their KV cache) and the sampling head of an
    inference step."""
    return _inference_blocks(arch, kv_cache_dtype)


@lru_cache(maxsize=64)
def _inference_blocks(arch: ArchSwitches, kv_cache_dtype: str) -> ModelGraph:
    a = replace(arch, hidden_dropout=False, attention_dropout=False)
    g = build_blocks(a)
    moe = with_kv_cache(g.moe_layer, kv_cache_dtype) if g.moe_layer is not None else None
    return ModelGraph(g.embedding, with_kv_cache(g.layer, kv_cache_dtype), inference_head(a, g.embedding), moe)
