"""The logical (unsharded) tensor graph: tensors with named dimensions, ops of a few kinds.

A block (the embedding, one transformer layer, the output head) is a list of forward ops in
program order. Every op kind knows its FLOPs and bytes as sympy expressions of its tensors'
sizes (:mod:`stage_cosim.graph.cost`), how to differentiate itself
(:mod:`stage_cosim.graph.autodiff`) and how sharding flows through it
(:mod:`stage_cosim.sharding.rules`). Nothing here knows about ranks or meshes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import sympy as sp

from stage_cosim.graph.dims import DTYPE_BYTES, LABEL_SIZE

# Passes over the logits of Megatron's unfused vocabulary-parallel cross-entropy, (forward,
# backward). Forward: cast to fp32, max, subtract, exp, sum, divide (bytes of one pass = bf16
# logits in + fp32 probabilities out, so six passes ~ the 38 bytes per logit those kernels move).
# Backward: scale the saved probabilities in place, cast the gradient to bf16.
UNFUSED_CROSS_ENTROPY_PASSES = (6, 2)

# "index": integer activations (the routing map of a Mixture-of-Experts router): no gradient.
# "kv_cache": the keys and values an inference step's attention reads, held across steps.
TensorKind = Literal["input", "activation", "weight", "grad", "weight_grad", "index", "kv_cache"]

# The meshes a tensor can live on (see :mod:`stage_cosim.parallel.axes`).
DENSE, EXPERT = "dense", "expert"

# Op kinds. "einsum" and "attention" are the matmul-class ops the FLOP conventions count.
OpKind = Literal[
    "einsum", "pointwise", "reduce", "norm", "norm_grad", "softmax", "softmax_grad",
    "attention", "attention_grad", "lookup", "lookup_grad", "cross_entropy",
    "cross_entropy_grad", "view", "optimizer",
    # inserted by a precision policy (stage_cosim.graph.precision): FP8 quantization (cast,
    # optionally with the transposed copy), a transpose of quantized data, the absolute-maximum
    # reduction a current-scaling cast needs first, a cast back to bf16
    "quantize", "transpose", "amax", "dequantize",
    # Mixture of Experts: a tensor's tokens re-read on the other mesh (no data moves), and the
    # token permutation into expert order and back (memory-bound kernels; the collectives
    # around them follow from placements).
    "mesh_change", "permute", "unpermute",
    # State-space and linear-attention mixers (stage_cosim.graph.ssm): the fused chunked scan
    # and its backward, and an elementwise product whose every input is differentiated (a gate).
    "ssm_scan", "ssm_scan_grad", "product",
]
# Fused (flash) attention and its backward: kernels with their own rate and, under context
# parallelism, operands that arrive in pieces.
ATTENTION_KINDS = ("attention", "attention_grad")


@dataclass(eq=False)
class Tensor:
    """A logical tensor. ``labels`` is one letter per dimension (see :mod:`dims`)."""

    name: str
    labels: str
    dtype: str
    kind: TensorKind
    # Weights only: the label that Megatron-style tensor parallelism shards (None: replicated).
    tp_shard: str | None = None
    # Produced in the residual-stream layout (replicated over tp, or sequence-sharded with sp).
    residual: bool = False
    # For gradients: the forward tensor this is the gradient of.
    grad_of: "Tensor | None" = None
    # The mesh it lives on: the dense mesh, or (expert weights and routed tokens) the expert mesh.
    mesh: str = DENSE

    def numel(self) -> sp.Expr:
        return sp.Mul(*(LABEL_SIZE[label] for label in self.labels))

    def nbytes(self) -> sp.Expr:
        return self.numel() * DTYPE_BYTES[self.dtype]

    def __repr__(self) -> str:
        return f"Tensor({self.name}:{self.labels}:{self.dtype})"


@dataclass(eq=False)
class Op:
    """One operation. Its meaning is fixed by ``kind`` plus the attributes below."""

    name: str
    kind: OpKind
    inputs: list[Tensor]
    outputs: list[Tensor]
    # einsum: "bsh,hf->bsf", one operand letter string per input, positionally matching each
    # tensor's labels (a tensor "bsgd" may appear as "btgd": same data, keys renamed).
    # view: "in1,in2->out1,out2" label mapping for splits and joins.
    spec: str = ""
    # Pointwise and normalization work per output element (memory-bound ops; rough is fine).
    # A fraction where only part of the element is touched (partial rotary embeddings).
    flops_per_element: int | sp.Expr = 0
    # Runs in the residual-stream layout.
    residual: bool = False
    # Labels that this op cannot have sharded (a normalization over h, a softmax over t …).
    unsharded: str = ""
    # Forward tensors that this op's backward reads (kept alive until then, or recomputed).
    saves: list[Tensor] = field(default_factory=list)
    # Part of the attention core (what selective recomputation replays).
    attention_core: bool = False
    # Linear in its inputs (grad passes straight through, as for a residual add).
    passthrough: bool = False
    # For backward ops: the forward op they differentiate.
    grad_of: "Op | None" = None
    # Causal attention FLOPs (half the score matrix).
    causal: bool = False
    # Fused attention with soft-capped scores (elementwise work inside the kernel).
    softcap: bool = False
    # Fused attention adding ALiBi's linear position bias to every score inside the kernel (BLOOM).
    alibi: bool = False
    # Times the op streams its inputs and outputs through HBM (an unfused implementation runs
    # several kernels over the same data).
    memory_passes: int = 1
    # Matmul-class ops: the number format the tensor cores compute in ("" = bf16; "fp8",
    # "mxfp8" for the GEMMs an FP8 recipe quantizes).
    precision: str = ""
    # Its outputs are kept across the micro-batches of a step (Transformer Engine's FP8 weight
    # cache): it runs in the first micro-batch's forward only, and recomputation skips it.
    cached: bool = False
    # Mesh axes the op's last output (an fp32 amax) is max-reduced over before it is used:
    # current scaling of a tensor that is all-gathered over tensor parallelism shares one
    # scale across the group.
    amax_group: tuple[str, ...] = ()
    # Mesh axes the op runs replicated over, whatever its inputs are sharded on there (the
    # transpose of an all-gathered FP8 tensor runs on the gathered tensor).
    replicated_over: tuple[str, ...] = ()

    # Control dependencies: tensors whose producers must finish before this op starts, though
    # it does not read them (a shared expert run after the routed ones; attention reading the KV cache after
    # this step's keys are written).
    after: list[Tensor] = field(default_factory=list)
    # Fused attention: the inputs and outputs that run over the key sequence (keys, values and
    # their gradients), by position.
    key_inputs: tuple[int, ...] = ()
    key_outputs: tuple[int, ...] = ()

    def einsum_operands(self) -> tuple[list[str], str]:
        lhs, out = self.spec.split("->")
        return lhs.split(","), out

    @property
    def mesh(self) -> str:
        """The mesh the op runs on: where its results live."""
        return self.outputs[0].mesh

    def letters(self) -> tuple[list[str], list[str]]:
        """The letters the op calls the dimensions of each input and each output: an einsum's
        spec; for a fused attention its tensors' labels with the keys' and values' sequence
        renamed ``t`` (the key sequence, not the queries' ``s``); else the tensors' labels."""
        if self.kind == "einsum":
            lhs, out = self.spec.split("->")
            return lhs.split(","), [out]
        ins = [t.labels.replace("s", "t") if i in self.key_inputs else t.labels for i, t in enumerate(self.inputs)]
        outs = [t.labels.replace("s", "t") if i in self.key_outputs else t.labels for i, t in enumerate(self.outputs)]
        return ins, outs

    def __repr__(self) -> str:
        return f"Op({self.kind}:{self.name})"


@dataclass
class Block:
    """One schedulable unit of the model: the forward ops of an embedding, a layer or the head."""

    name: str
    kind: Literal["embedding", "layer", "head"]
    ops: list[Op]
    inputs: list[Tensor]       # activations that arrive from the previous block
    outputs: list[Tensor]      # activations handed to the next block (or the loss)
    weights: list[Tensor]
    # State held from step to step (the KV cache of an inference layer), read by the ops.
    caches: list[Tensor] = field(default_factory=list)

    def param_count(self) -> sp.Expr:
        return sp.Add(*(w.numel() for w in self.weights))


class BlockBuilder:
    """Records forward ops in program order; helpers name tensors after their op."""

    def __init__(self, name: str, kind: Literal["embedding", "layer", "head"], dtype: str = "bf16") -> None:
        self.name = name
        self.kind = kind
        self.dtype = dtype
        self.ops: list[Op] = []
        self.weights: list[Tensor] = []
        self.inputs: list[Tensor] = []
        self.mesh = DENSE           # where new weights and activations live
        self.prefix = ""            # names of new ops, activations and weights start with it

    # -- tensors --------------------------------------------------------------------------

    def input(self, name: str, labels: str, dtype: str | None = None, *, residual: bool = True) -> Tensor:
        t = Tensor(name, labels, dtype or self.dtype, "input" if dtype == "i64" else "activation",
                   residual=residual)
        self.inputs.append(t)
        return t

    def weight(self, name: str, labels: str, tp_shard: str | None = None) -> Tensor:
        w = Tensor(self.prefix + name, labels, self.dtype, "weight", tp_shard=tp_shard, mesh=self.mesh)
        self.weights.append(w)
        return w

    def shared_weight(self, w: Tensor) -> Tensor:
        """Use a weight that another block owns (tied embeddings)."""
        self.weights.append(w)
        return w

    def _act(self, name: str, labels: str, dtype: str | None = None, residual: bool = False) -> Tensor:
        return Tensor(name, labels, dtype or self.dtype, "activation", residual=residual, mesh=self.mesh)

    def _add(self, op: Op) -> Op:
        if self.prefix:
            op.name = self.prefix + op.name
            for t in op.outputs:
                t.name = self.prefix + t.name
        self.ops.append(op)
        return op

    # -- ops --------------------------------------------------------------------------------

    def einsum(self, name: str, spec: str, *inputs: Tensor, attention_core: bool = False,
               dtype: str | None = None) -> Tensor:
        out = self._act(name, spec.split("->")[1], dtype)
        # The backward reads every operand; only the activations count as saved memory.
        self._add(Op(name, "einsum", list(inputs), [out], spec=spec, saves=list(inputs),
                     attention_core=attention_core))
        return out

    def pointwise(self, name: str, inputs: list[Tensor], out_labels: str, *, flops_per_element: int,
                  saves: list[Tensor] | None = None, residual: bool = False,
                  passthrough: bool = False, attention_core: bool = False,
                  dtype: str | None = None, saves_output: bool = False) -> Tensor:
        """An elementwise op; its backward reads ``saves`` (and its own output if ``saves_output``,
        as the derivative of tanh does)."""
        out = self._act(name, out_labels, dtype, residual=residual)
        self._add(Op(name, "pointwise", list(inputs), [out], flops_per_element=flops_per_element,
                     saves=list(saves or []) + ([out] if saves_output else []), residual=residual,
                     passthrough=passthrough, attention_core=attention_core))
        return out

    def add(self, name: str, x: Tensor, y: Tensor, *, residual: bool = True) -> Tensor:
        """Elementwise sum (a residual connection or a bias); gradients pass straight through."""
        return self.pointwise(name, [x, y], x.labels, flops_per_element=1, residual=residual,
                              passthrough=True)

    def dropout(self, name: str, x: Tensor, *, residual: bool = False,
                attention_core: bool = False) -> Tensor:
        out = self._act(name, x.labels, residual=residual)
        mask = Tensor(name + ".mask", x.labels, "u8", "activation")
        self._add(Op(name, "pointwise", [x], [out, mask], flops_per_element=2, saves=[mask],
                     residual=residual, attention_core=attention_core))
        return out

    def norm(self, name: str, x: Tensor, weights: list[Tensor], *, rms: bool, over: str = "h",
             residual: bool = True) -> Tensor:
        """LayerNorm or RMSNorm over label ``over`` (the hidden size, or a head's dimension for
        QK-norm, which runs where the heads are rather than in the residual stream)."""
        out = self._act(name, x.labels, residual=residual)
        stat_labels = x.labels.replace(over, "")
        stats = [Tensor(f"{name}.{s}", stat_labels, "fp32", "activation")
                 for s in (("rstd",) if rms else ("mean", "rstd"))]
        self._add(Op(name, "norm", [x, *weights], [out, *stats], flops_per_element=4 if rms else 5,
                     residual=residual, unsharded=over, saves=[x, *stats]))
        return out

    def softmax(self, name: str, x: Tensor, over: str, *, attention_core: bool = False) -> Tensor:
        out = self._act(name, x.labels)
        self._add(Op(name, "softmax", [x], [out], flops_per_element=5, unsharded=over,
                     saves=[out], attention_core=attention_core))
        return out

    def view(self, name: str, inputs: list[Tensor], out_labels: list[str],
             out_names: list[str]) -> list[Tensor]:
        """Split or join without moving data (QKV split, SwiGLU halves)."""
        outs = [self._act(n, labels) for n, labels in zip(out_names, out_labels)]
        spec = ",".join(t.labels for t in inputs) + "->" + ",".join(out_labels)
        self._add(Op(name, "view", list(inputs), outs, spec=spec))
        return outs

    def attention(self, name: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                  softcap: bool = False, rotary_key: Tensor | None = None, sinks: Tensor | None = None,
                  alibi: bool = False) -> Tensor:
        """Fused (flash) attention: never materializes the score matrix. The last label of q
        and of v is the head dimension of the scores and of the values (they may differ:
        multi-latent attention). ``rotary_key``: a rotary key part shared by every head, read
        alongside ``k`` (multi-latent attention); ``sinks``: a learned logit per head that joins
        every softmax (GPT-OSS)."""
        qk, vd = q.labels[-1], v.labels[-1]
        out = self._act(name, q.labels[:-1] + vd)
        lse = Tensor(name + ".lse", q.labels[:-1], "fp32", "activation")
        keys = [k] if rotary_key is None else [k, rotary_key]
        extra = [sinks] if sinks is not None else []
        # keys and values run over the key sequence: sharding the queries' sequence (cp) leaves
        # them to be gathered, as the rules say, or exchanged (sharding.context_parallel)
        self._add(Op(name, "attention", [q, *keys, v, *extra], [out, lse], spec=f"{qk},{vd}",
                     unsharded="".join(sorted({qk, vd})), key_inputs=tuple(range(1, len(keys) + 2)),
                     saves=[q, *keys, v, out, lse], attention_core=True, causal=causal, softcap=softcap,
                     alibi=alibi))
        return out

    def lookup(self, name: str, table: Tensor, ids: Tensor) -> Tensor:
        """Embedding lookup: rows of ``table`` (labels ``<index><feature>``) picked by ``ids``."""
        out = self._act(name, ids.labels + table.labels[1:])
        self._add(Op(name, "lookup", [table, ids], [out], spec=table.labels[0], saves=[ids]))
        return out

    def cross_entropy(self, name: str, logits: Tensor, labels_in: Tensor, *, fused: bool = True) -> Tensor:
        loss = self._act(name, logits.labels.replace("v", ""), "fp32", residual=False)
        probs = Tensor(name + ".probs", logits.labels, "fp32", "activation")
        self._add(Op(name, "cross_entropy", [logits, labels_in], [loss, probs], spec="v", flops_per_element=5,
                     saves=[probs, labels_in],
                     memory_passes=1 if fused else UNFUSED_CROSS_ENTROPY_PASSES[0]))
        return loss

    # -- Mixture of Experts -----------------------------------------------------------------

    def mesh_change(self, name: str, tensors: list[Tensor], labels: list[str], mesh: str) -> list[Tensor]:
        """The same tokens read on ``mesh`` (``labels``: each tensor's labels there, b x s <-> n)."""
        outs = [Tensor(f"{t.name}@{mesh}", l, t.dtype, "index" if t.kind == "index" else "activation", mesh=mesh)
                for t, l in zip(tensors, labels)]
        self._add(Op(name, "mesh_change", list(tensors), outs))
        return outs

    def router(self, name: str, logits: Tensor, *, topk_flops: sp.Expr) -> tuple[Tensor, Tensor]:
        """Scores and top-k of the router logits (fp32): the routing weights and the routing map
        (``topk_flops`` per routing weight)."""
        probs = self._act(f"{name}.probs", logits.labels.replace("e", "k"), "fp32")
        routing = Tensor(f"{name}.map", logits.labels.replace("e", "k"), "i32", "index", mesh=self.mesh)
        self._add(Op(name, "pointwise", [logits], [probs, routing], flops_per_element=topk_flops,
                     unsharded="e", saves=[probs]))
        return probs, routing

    def permute(self, name: str, tokens: Tensor, routing: Tensor, out_labels: str) -> Tensor:
        """Tokens copied into expert order, one copy per expert each goes to (dispatch)."""
        out = self._act(name, out_labels)
        self._add(Op(name, "permute", [tokens, routing], [out], saves=[routing]))
        return out

    def unpermute(self, name: str, slots: Tensor, probs: Tensor, out_labels: str) -> Tensor:
        """Expert outputs back in token order, each token's copies summed with its routing
        weights (combine)."""
        out = self._act(name, out_labels)
        self._add(Op(name, "unpermute", [slots, probs], [out], flops_per_element=2 * LABEL_SIZE["k"],
                     saves=[slots, probs]))
        return out

    def build(self, outputs: list[Tensor]) -> Block:
        return Block(self.name, self.kind, self.ops, self.inputs, outputs, self.weights)
