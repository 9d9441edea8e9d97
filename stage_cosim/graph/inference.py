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
* **dropout** is off (evaluation mode), and norms keep no statistics for a backward;
* **the head** keeps each sequence's last token, computes its logits and samples the next
  token from them (the vocabulary-parallel logits are gathered first, a placement change like
  any other): no loss, no labels.

The kernels are those inference engines run, where they fuse what Megatron's training forward
runs apart (:func:`fused_forms`):

* **residual add + RMSNorm** are one kernel that reads the residual stream and the sublayer's
  output and writes the new residual stream and its normalized copy (vLLM's
  ``fused_add_rms_norm`` in csrc/layernorm_kernels.cu; TensorRT-LLM's and SGLang's alike).
  The block boundary moves with it, as serving engines run it: a layer hands on the residual
  stream *and* the next layer's normalized input (its last kernel is the add with the next
  layer's input norm — the model's final norm after the last layer), the embedding normalizes
  the first layer's input (a plain RMSNorm: there is nothing to add yet), and the head starts
  from the final norm's output. Between pipeline stages both tensors travel, as vLLM's
  intermediate tensors (hidden states and residual) do. LayerNorm models are left unfused
  (the engines' fused kernels are RMSNorm's);
* **RoPE and the KV-cache write** are one kernel: it reads this step's queries, keys and
  values, rotates the queries and keys, writes the queries back and the keys and values into
  the cache (TensorRT-LLM's attention preprocessing, ``applyBiasRopeUpdateKVCache`` in
  kernels/unfusedAttentionKernels; vLLM runs ``rotary_embedding`` and then
  ``reshape_and_cache_flash``, csrc/cache_kernels.cu, as two). A latent cache (multi-latent
  attention) is replicated over tp while the queries are split by head, so there only the
  cached rotary key is rotated in the write (``concat_and_cache_mla`` writes the latent and
  the rotary key in one kernel); the queries' RoPE stays a kernel of its own.

The attention core is causal; its executed work is bound to numbers by the step's shape
(:mod:`stage_cosim.inference.config`): ``w`` keys per query on average, which counts exactly
the (query, key) pairs a causal kernel computes.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import sympy as sp

from stage_cosim.graph.dims import LABEL_SIZE
from stage_cosim.graph.ir import Block, BlockBuilder, Op, Tensor
from stage_cosim.graph.ssm import with_state_cache
from stage_cosim.graph.transformer import ModelGraph, _norm, build_blocks, build_layer
from stage_cosim.model.architecture import ArchSwitches

# Work per logit of sampling (softmax, top-k/top-p filtering, the draw), memory-bound anyway.
SAMPLE_FLOPS_PER_LOGIT = 5
# The rotary embeddings of the queries and keys, as transformer.py names them.
ROPE_OPS = ("rope_q", "rope_k")


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
    write, rotary = _cache_write(layer, points, slots, producer, consumers)
    over: dict[int, Tensor] = dict(caches)      # a forward tensor -> its version over the cached tokens
    ops: list[Op] = []
    for op in layer.ops:
        if op in expand or op in rotary:
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


def _cache_write(layer: Block, points: list[Tensor], slots: list[Tensor], producer: dict[int, Op],
                 consumers: dict[int, list[Op]]) -> tuple[Op, list[Op]]:
    """The kernel that appends this step's keys and values to the cache, and the RoPE kernels
    it absorbs: a cached tensor rotated just before (its RoPE's input read by nothing else) is
    read unrotated and rotated in the write; where the cache is split by head like the queries,
    the queries' RoPE joins too, the write handing the rotated queries to the attention
    (TensorRT-LLM's attention preprocessing; see the module docstring)."""
    inputs, outputs = list(points), list(slots)
    rotary: list[Op] = []
    flops: sp.Expr = sp.Integer(0)

    def rope_of(t: Tensor) -> Op | None:
        op = producer.get(id(t))
        if op is None or op.kind != "pointwise" or op.name not in ROPE_OPS or len(op.inputs) != 1:
            return None
        return op if consumers.get(id(op.inputs[0])) == [op] else None

    for i, t in enumerate(points):
        r = rope_of(t)
        if r is not None:
            inputs[i] = r.inputs[0]
            rotary.append(r)
            flops += r.flops_per_element * t.numel()
    if rotary and all("g" in t.labels for t in points):
        attention = next(op for op in layer.ops if op.kind == "attention" or op.attention_core)
        r = rope_of(attention.inputs[0])
        if r is not None:
            inputs.append(r.inputs[0])
            outputs.append(r.outputs[0])
            rotary.append(r)
            flops += r.flops_per_element * r.outputs[0].numel()
    # (the work of the rotations, per element of the first slot, as an op's FLOPs are counted)
    write = Op("kv_cache_write", "pointwise", inputs, outputs, flops_per_element=sp.simplify(flops / slots[0].numel()))
    return write, rotary


def _is_rms_norm(op: Op) -> bool:
    """An RMSNorm over the hidden size (one weight, no bias): what the engines' fused norm
    kernels compute."""
    return op.kind == "norm" and op.unsharded == "h" and sum(t.kind == "weight" for t in op.inputs) == 1


def _is_residual_add(op: Op) -> bool:
    """A residual connection: the sum of two activations in the residual stream (not a bias)."""
    return (op.kind == "pointwise" and op.passthrough and op.residual and len(op.inputs) == 2
            and all(t.kind == "activation" for t in op.inputs))


def _without_statistics(op: Op) -> Op:
    """A norm as an inference step runs it: no statistics kept for a backward."""
    return replace(op, outputs=op.outputs[:1], saves=[]) if op.kind == "norm" else op


def _fused_add_norm(add: Op, norm: Op, out: Tensor) -> Op:
    """One kernel for ``add`` and the RMSNorm of its sum: it reads the residual stream and the
    sublayer's output (and the norm's weight) and writes the new residual stream and ``out``,
    its normalized copy (vLLM's fused_add_rms_norm)."""
    weights = [t for t in norm.inputs if t.kind == "weight"]
    return Op(f"{add.name}+{norm.name}", "norm", [*add.inputs, *weights], [add.outputs[0], out],
              flops_per_element=add.flops_per_element + norm.flops_per_element, residual=True, unsharded="h")


def _fused_layer(layer: Block, shift: bool) -> Block:
    """``layer`` with each residual add and the RMSNorm of its sum as one kernel; ``shift``: the
    layer's input norm moves to the end of the layer before (the block takes the residual
    stream and its normalized copy, and hands on the same pair, its last add fused with the
    next layer's input norm, whose weight the block holds in its place)."""
    ops = [_without_statistics(op) for op in layer.ops]
    consumers: dict[int, list[Op]] = {}
    for op in ops:
        for t in op.inputs:
            consumers.setdefault(id(t), []).append(op)
    producer = {id(t): op for op in ops for t in op.outputs}
    out: list[Op] = []
    fused: set[int] = set()
    for op in ops:
        if id(op) in fused:
            continue
        if _is_residual_add(op):
            norm = next((c for c in consumers.get(id(op.outputs[0]), []) if _is_rms_norm(c)), None)
            if norm is not None:
                out.append(_fused_add_norm(op, norm, norm.outputs[0]))
                fused.add(id(norm))
                continue
        out.append(op)
    if not shift:
        return Block(layer.name, layer.kind, out, layer.inputs, layer.outputs, layer.weights, caches=layer.caches)
    x, (o,) = layer.inputs[0], layer.outputs
    first = next(c for c in consumers[id(x)] if _is_rms_norm(c))
    last = producer[id(o)]
    y_next = Tensor("next_input_norm", o.labels, o.dtype, "activation", residual=True)
    out = [_fused_add_norm(last, replace(first, name="next_input_norm"), y_next) if op is last else op
           for op in out if op is not first]
    return Block(layer.name, layer.kind, out, [x, first.outputs[0]], [o, y_next], layer.weights,
                 caches=layer.caches)


def _shiftable(layer: Block) -> bool:
    """The layer's input is read by one RMSNorm (and the residual add), and its output is a
    residual add: the input norm can move to the end of the layer before."""
    x, outs = layer.inputs[0], layer.outputs
    readers = [op for op in layer.ops if x in op.inputs]
    norms = [op for op in readers if op.kind == "norm"]
    last = next((op for op in layer.ops if outs and outs[0] in op.outputs), None)
    return (len(outs) == 1 and len(norms) == 1 and _is_rms_norm(norms[0])
            and last is not None and _is_residual_add(last))


def _normalized_embedding(embedding: Block, layer: Block) -> Block:
    """The embedding followed by the first layer's input norm (a plain RMSNorm, weight and
    all): it hands on the residual stream and its normalized copy."""
    x = embedding.outputs[0]
    norm = next(op for op in layer.ops if op.kind == "norm" and layer.inputs[0] in op.inputs)
    w = Tensor(norm.inputs[1].name, norm.inputs[1].labels, norm.inputs[1].dtype, "weight")
    y = Tensor(norm.outputs[0].name, x.labels, x.dtype, "activation", residual=True)
    op = replace(norm, inputs=[x, w], outputs=[y], saves=[])
    return Block(embedding.name, embedding.kind, [*embedding.ops, op], embedding.inputs, [x, y],
                 [*embedding.weights, w])


def inference_head(arch: ArchSwitches, embedding: Block, normalized: bool = False) -> Block:
    """The last token of every sequence: final norm, logits, sampling (``normalized``: the
    block before wrote the final norm's output, fused with its last residual add)."""
    b = BlockBuilder("head", "head")
    x = b.input("final_norm" if normalized else "x", "bsh")
    last = b.input("last_positions", "b", "i64", residual=False)
    # a gather of one row per sequence (the positions where each sequence's new tokens end)
    y = Tensor("last_token", "bh", b.dtype, "activation")
    b.ops.append(Op("last_token", "lookup", [x, last], [y], spec="s"))
    if not normalized:
        y = _norm(b, "final_norm", y, arch, residual=False)
        b.ops[-1] = _without_statistics(b.ops[-1])
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
    layer = with_kv_cache(layer, kv_cache_dtype)
    moe = with_kv_cache(moe, kv_cache_dtype) if moe is not None else None
    # hybrid layers: attention reads its KV cache, an SSM mixer its state (graph.ssm)
    hybrid = tuple(with_state_cache(with_kv_cache(h, kv_cache_dtype)) for h in g.hybrid)
    return fused_forms(ModelGraph(g.embedding, layer, None, moe, hybrid), a)


def fused_forms(g: ModelGraph, arch: ArchSwitches) -> ModelGraph:
    """The blocks in the form inference engines run them (see the module docstring): residual
    adds fused with the RMSNorm of their sum, the boundary between blocks moved to the layers'
    input norms where every layer kind allows it; the sampling head after them."""
    kinds = [b for b in (g.layer, g.moe_layer, *g.hybrid) if b is not None]
    shift = all(_shiftable(b) for b in kinds)
    layer = _fused_layer(g.layer, shift)
    moe = _fused_layer(g.moe_layer, shift) if g.moe_layer is not None else None
    hybrid = tuple(_fused_layer(h, shift) for h in g.hybrid)
    embedding = _normalized_embedding(g.embedding, g.layer) if shift else g.embedding
    return ModelGraph(embedding, layer, inference_head(arch, g.embedding, normalized=shift), moe, hybrid)
