"""The rewrite of a block's graph under a precision policy
(:class:`~stage_cosim.graph.precision.Precision`), the way Transformer Engine runs FP8 training.

:func:`apply_precision` rewrites a block's forward and (already derived) backward ops to match
the policy:

* The linear layers of a transformer layer (QKV, attention output, MLP projections) become FP8
  GEMMs at the FP8 (or MXFP8) peak. Attention, softmax, norms, the embedding, the output layer
  and the loss stay in BF16 (fp32 where they were), unless ``attention`` makes the fused
  attention kernel FP8 (Transformer Engine's ``fp8_dpa``: Q, K, V cast in, the output cast back).
* Every FP8 GEMM operand is quantized by a real, memory-bound kernel: the input activation, the
  weight, and the output gradient in the backward. A GEMM reads the row-wise copy of its
  operands in the forward; the backward's dgrad reads the weight's column-wise copy and the
  gradient's row-wise one, the wgrad the column-wise copies of the input and the gradient.
  Per-tensor scaling (``delayed``, ``tensorwise``) gets column-wise copies by transposing the
  FP8 data, in the cast kernel itself (``cast_transpose``) or, where the row-wise copy was made
  elsewhere, by a separate transpose; Blackwell's FP8 GEMMs read either layout, so there are
  none there. Block scaling (``mxfp8``: 32-element blocks; ``blockwise``: 1x128 tiles) and
  torchao's ``rowwise`` scaling (a scale per row, computed as the row is cast: no amax pass, no
  reduction across ranks) quantize the column-wise copy separately from the high-precision
  tensor, in the same kernel; ``mxfp8`` and ``rowwise`` quantize the weight's column-wise copy
  the same way (their scales run along one axis only).
* Fusions follow Transformer Engine: the norm before QKV and FC1 (``LayerNormLinear``) writes
  FP8 directly under delayed scaling (under current scaling it computes the amax, the cast is a
  second kernel; block scaling normalizes in BF16 and quantizes after); Transformer Engine's
  ``LayerNormMLP`` (``te_layernorm_mlp``) also writes the activation in FP8 and fuses the
  activation's backward with the cast of FC1's output gradient (delayed and MXFP8 scaling).
  Megatron-Core's default layer runs its own activation in BF16, and FC2's cast is a kernel.
* Current scaling (``tensorwise``) needs the tensor's amax before it casts: one more pass over
  the tensor, and, for a tensor all-gathered over tensor parallelism (sequence parallelism), a
  max all-reduce over the group so that every rank scales alike.
* Sequence parallelism all-gathers the FP8 row-wise copy (Transformer Engine gathers quantized
  data: half the bytes of BF16); per-tensor scaling then transposes the gathered tensor in the
  backward, block scaling gathers its column-wise copy there. Reductions of GEMM outputs
  (all-reduce, reduce-scatter) stay BF16: the GEMMs write BF16.
* Weights are cast once per step, in the first micro-batch's forward, and the FP8 copies are
  kept for the others (``is_first_microbatch``); under ZeRO-3 each gathered weight is cast
  anew. With ``param_gather`` the parameters are stored in FP8: there is no cast, the ZeRO
  gathers move FP8, and per-tensor scaling on Hopper keeps only the transposed copy.

An inference step uses the same rewrite with a forward-only policy
(:func:`~stage_cosim.graph.precision.inference_precision`):
FP8 weights and GEMMs (W8A8), or weights stored in a packed 4-bit format that BF16 GEMMs
dequantize as they load them (W4A16). W8A8 scales each GEMM input per tensor, with a scale
calibrated offline and stored in the checkpoint (``static``: what FP8 serving checkpoints ship),
so the kernel that produces the input writes it in FP8 — an RMSNorm (plain or fused with the
residual add) and SiLU-and-mul — and only other inputs get a cast of their own, with no amax;
or (``dynamic``) with a scale computed from the tensor as it comes: an amax pass, then a cast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from stage_cosim.graph.ir import DENSE, Block, Op, Tensor
from stage_cosim.graph.precision import Precision

# Work per element of a cast (absolute value, scale, convert); all of these kernels are
# memory-bound, so this only matters against the vector rate.
QUANTIZE_FLOPS = 3
AMAX_FLOPS = 1


# -- the rewrite ------------------------------------------------------------------------------

# GEMMs with a weight matrix that Megatron does not run through Transformer Engine: the MoE
# router (its own linear, in the router's precision).
NOT_TE_LINEAR = ("router",)
# Activations whose kernels write an FP8 GEMM input themselves under static scaling (vLLM's
# silu_and_mul_quant; the FP8 MoE kernels' fused SiLU-and-mul quantization): SwiGLU's.
QUANTIZING_ACTIVATIONS = ("swiglu",)


def _writes_fp8_input(op: Op) -> bool:
    """A kernel that serving engines let write its output in FP8 with a static scale: an
    RMSNorm over the hidden size (plain, or fused with the residual add) or SiLU-and-mul."""
    if op.kind == "norm":
        return op.unsharded == "h" and sum(t.kind == "weight" for t in op.inputs) == 1
    return op.kind == "pointwise" and op.name.rsplit(".", 1)[-1] in QUANTIZING_ACTIVATIONS


def _linear_weight(op: Op) -> int | None:
    """Index of the weight operand of a linear layer's GEMM (a weight matrix), else None."""
    if op.kind != "einsum" or len(op.inputs) != 2 or op.name.rsplit(".", 1)[-1] in NOT_TE_LINEAR:
        return None
    idx = [i for i, t in enumerate(op.inputs) if t.kind == "weight" and len(t.labels) >= 2]
    return idx[0] if len(idx) == 1 else None


def _stored_view(op: Op) -> bool:
    """A view that splits a weight matrix into the operands of GEMMs (latent attention's
    absorbed key and value up-projections): the halves are the weight as stored."""
    w = op.inputs[0]
    return w.kind == "weight" and len(w.labels) >= 2 and all(len(t.labels) >= 2 for t in op.outputs)


def _column_parallel(op: Op, wi: int) -> bool | None:
    """The weight's tensor-parallel label survives into the output (column-parallel), or is
    summed away (row-parallel: the output is a partial sum); None: a replicated weight."""
    letters, out = op.einsum_operands()
    w = op.inputs[wi]
    if not w.tp_shard:
        return None
    return letters[wi][w.labels.index(w.tp_shard)] in out


@dataclass
class _Gemm:
    """What the rewrite decided for one FP8 GEMM."""

    op: Op
    xi: int
    wi: int
    gathered_x: bool           # its input is all-gathered over tp in the forward (sp, column-parallel)
    gathered_dy: bool          # its output gradient is all-gathered over tp in the backward (sp, row-parallel)
    xq: Tensor | None = None
    xc: Tensor | None = None   # the input's column-wise copy (None: transposed in the backward)
    wq: Tensor | None = None
    wc: Tensor | None = None   # the weight's column-wise copy (None: made in the backward, ZeRO-3)
    dq: Tensor | None = None   # the output gradient's copies, when a fused kernel wrote them
    dc: Tensor | None = None


class _Rewrite:
    def __init__(self, block: Block, bwd_ops: list[Op], weight_grads: dict[Tensor, Tensor], p: Precision,
                 sp: bool, zero3: bool) -> None:
        self.block, self.bwd_ops, self.weight_grads = block, bwd_ops, weight_grads
        self.p, self.sp, self.zero3 = p, sp, zero3
        self.producer = {id(t): op for op in block.ops for t in op.outputs}
        self.consumers: dict[int, list[Op]] = {}
        for op in block.ops:
            for t in op.inputs:
                self.consumers.setdefault(id(t), []).append(op)
        self.gemms: dict[int, _Gemm] = {}
        for op in block.ops:
            wi = _linear_weight(op)
            if wi is None:
                continue
            column = _column_parallel(op, wi)
            x = op.inputs[1 - wi]
            # sequence parallelism gathers over tp: the dense mesh's tensor-parallel GEMMs
            dense = op.mesh == DENSE and sp
            self.gemms[id(op)] = _Gemm(op, 1 - wi, wi, gathered_x=bool(dense and column and x.residual),
                                       gathered_dy=bool(dense and column is False))
        # parameters stored in FP8 (or a weight-only format) replace the bf16 weights; so do
        # the views a GEMM reads a stored weight through (latent attention's absorbed products)
        self.stored: dict[int, Tensor] = {}
        if p.param_gather or p.weights:
            for g in self.gemms.values():
                w = g.op.inputs[g.wi]
                self.stored[id(w)] = replace(w, dtype=p.stored_weight_dtype)
            for op in block.ops:
                if op.kind == "view" and _stored_view(op):
                    self.stored[id(op.inputs[0])] = replace(op.inputs[0], dtype=p.stored_weight_dtype)
                    self.stored.update({id(t): replace(t, dtype=p.stored_weight_dtype) for t in op.outputs})
        self.fused: dict[int, _Gemm] = {}          # producer op -> the GEMM whose quantized input it writes
        # A forward pass as serving engines run it: with static scales the kernel producing a
        # tensor that only FP8 GEMMs read writes it in FP8 (where the engines' kernels do); every
        # other input is cast once, however many GEMMs read it (one quantized copy per tensor).
        self.writes_fp8: set[int] = set()          # tensors their producer writes in FP8
        self.shared: dict[int, Tensor] = {}        # a tensor -> its quantized copy (forward only)
        if p.forward_only and p.static_scales:
            for g in self.gemms.values():
                x = g.op.inputs[g.xi]
                prod = self.producer.get(id(x))
                readers = self.consumers.get(id(x), [])
                if prod is not None and _writes_fp8_input(prod) and all(id(r) in self.gemms for r in readers):
                    self.writes_fp8.add(id(x))
        for g in self.gemms.values() if not p.forward_only else ():
            x = g.op.inputs[g.xi]
            prod = self.producer.get(id(x))
            if prod is None or self.consumers.get(id(x)) != [g.op]:
                continue
            if prod.kind == "norm" and p.recipe in ("delayed", "tensorwise"):
                self.fused[id(prod)] = g
            elif (prod.kind == "pointwise" and not prod.passthrough and p.te_layernorm_mlp
                  and p.recipe in ("delayed", "mxfp8")):
                self.fused[id(prod)] = g
        # the activation whose backward writes FC1's quantized output gradient (LayerNormMLP)
        self.fused_dact: dict[int, _Gemm] = {}
        for prod_id in self.fused:
            act = next(op for op in block.ops if id(op) == prod_id)
            if act.kind != "pointwise":
                continue
            up = self.producer.get(id(act.inputs[0]))
            while up is not None and up.passthrough and up.kind == "pointwise":   # a bias add
                up = self.producer.get(id(up.inputs[0]))
            if up is not None and id(up) in self.gemms:
                self.fused_dact[id(act)] = self.gemms[id(up)]
        # FP8 dispatch (DeepSeek-V3's FP8 communication, Megatron's --fp8-dispatch): the tokens
        # are quantized before they are dispatched to the experts, so the all-to-all moves FP8
        # and the experts' first GEMM reads them as they arrive; the gradient of the experts'
        # output is quantized by the combine's backward before its all-to-all. The combine and
        # the dispatch's backward stay BF16.
        self.dispatch: dict[int, _Gemm] = {}       # the mesh change and the permute feeding an expert GEMM
        if p.dispatch:
            for g in self.gemms.values():
                if g.op.mesh == DENSE:
                    continue
                perm = self.producer.get(id(g.op.inputs[g.xi]))
                if perm is None or perm.kind != "permute":
                    continue
                change = self.producer.get(id(perm.inputs[0]))
                if change is not None and change.kind == "mesh_change":
                    self.dispatch[id(change)] = self.dispatch[id(perm)] = g
        self.fwd: list[Op] = []
        self.attn: dict[int, tuple[list[Tensor], Tensor]] = {}   # attention op -> (q8, k8, v8), o8

    # -- helpers --------------------------------------------------------------------------------

    def sub(self, t: Tensor) -> Tensor:
        return self.stored.get(id(t), t)

    def copy(self, op: Op, **kw: Any) -> Op:
        kw.setdefault("inputs", [self.sub(t) for t in op.inputs])
        kw.setdefault("outputs", [self.sub(t) for t in op.outputs])
        kw.setdefault("saves", [self.sub(t) for t in op.saves])
        return replace(op, **kw)

    def quantized(self, t: Tensor, suffix: str, dtype: str, kind: str | None = None) -> Tensor:
        k = kind or ("grad" if t.kind == "grad" else "activation")
        return Tensor(f"{t.name}.{suffix}", t.labels, dtype, k, tp_shard=t.tp_shard if k == "weight" else None,
                      residual=t.residual, grad_of=t.grad_of, mesh=t.mesh)

    def amax(self, out: list[Op], t: Tensor, group: tuple[str, ...], cached: bool = False) -> Tensor:
        """A current-scaling amax kernel over ``t`` (reduced over ``group``)."""
        a = Tensor(f"{t.name}.amax", "", "fp32", "amax", mesh=t.mesh)
        out.append(Op(f"{t.name}.amax", "amax", [t], [a], flops_per_element=AMAX_FLOPS, residual=t.residual,
                      amax_group=group, cached=cached))
        return a

    def quantize(self, out: list[Op], t: Tensor, columnwise: bool, *, dtype: str, kind: str | None = None,
                 gathered: bool = False, cached: bool = False) -> tuple[Tensor, Tensor | None]:
        """Cast ``t`` (and its column-wise copy, in the same kernel); current scaling first
        computes the amax, reduced over tp for a tensor that is then all-gathered."""
        ins = [t]
        if self.p.current_scaling:
            ins.append(self.amax(out, t, ("tp",) if gathered else (), cached))
        q = self.quantized(t, "fp8", dtype, kind)
        c = self.quantized(t, "fp8_t", dtype, kind) if columnwise else None
        out.append(Op(f"{t.name}.quantize", "quantize", ins, [q] + ([c] if c is not None else []),
                      flops_per_element=QUANTIZE_FLOPS, residual=t.residual, cached=cached))
        return q, c

    def transpose(self, out: list[Op], q: Tensor, *, gathered: bool = False, cached: bool = False) -> Tensor:
        c = Tensor(q.name + "_t", q.labels, q.dtype, q.kind, tp_shard=q.tp_shard, residual=q.residual,
                   grad_of=q.grad_of, mesh=q.mesh)
        out.append(Op(f"{q.name}.transpose", "transpose", [q], [c], residual=q.residual and not gathered,
                      cached=cached, replicated_over=("tp",) if gathered else ()))
        return c

    # -- forward --------------------------------------------------------------------------------

    def forward(self) -> None:
        for op in self.block.ops:
            if any(id(t) in self.writes_fp8 for t in op.outputs):
                self.writing_fp8(op)
            elif id(op) in self.dispatch:
                self.dispatched(op, self.dispatch[id(op)])
            elif id(op) in self.fused:
                self.fused_producer(op, self.fused[id(op)])
            elif id(op) in self.gemms:
                self.gemm(self.gemms[id(op)])
            elif op.kind == "attention" and self.p.attention:
                self.attention(op)
            else:
                self.fwd.append(self.copy(op))

    def writing_fp8(self, op: Op) -> None:
        """A kernel that writes (some of) its outputs in FP8 with their static scales, for the
        FP8 GEMMs that read them (one byte per element instead of two, no cast of their own)."""
        outs = list(op.outputs)
        for i, t in enumerate(outs):
            if id(t) in self.writes_fp8:
                outs[i] = self.shared[id(t)] = self.quantized(t, "fp8", self.p.activation_dtype)
        self.fwd.append(self.copy(op, outputs=outs))

    def fused_producer(self, op: Op, g: _Gemm) -> None:
        """A norm (LayerNormLinear) or activation (LayerNormMLP) that writes the GEMM's
        quantized input itself."""
        p, x = self.p, op.outputs[0]
        col = p.activation_columnwise()
        if p.current_scaling:
            # the norm computes the amax in its own pass; the cast is a second kernel
            a = Tensor(f"{x.name}.amax", "", "fp32", "amax", mesh=x.mesh)
            self.fwd.append(self.copy(op, outputs=[*op.outputs, a], amax_group=("tp",) if g.gathered_x else ()))
            q = self.quantized(x, "fp8", p.activation_dtype)
            c = self.quantized(x, "fp8_t", p.activation_dtype) if col == "transpose" and not g.gathered_x else None
            self.fwd.append(Op(f"{x.name}.quantize", "quantize", [x, a], [q] + ([c] if c else []),
                               flops_per_element=QUANTIZE_FLOPS, residual=x.residual))
            g.xq, g.xc = q, (c if c is not None else (q if col == "same" else None))
            return
        q = self.quantized(x, "fp8", p.activation_dtype)
        c = self.quantized(x, "fp8_t", p.activation_dtype) if col == "quantize" else None
        self.fwd.append(self.copy(op, outputs=[q, *([c] if c else []), *op.outputs[1:]]))
        if col == "transpose" and not g.gathered_x:
            c = self.transpose(self.fwd, q)
        g.xq, g.xc = q, (c if c is not None else (q if col == "same" else None))

    def dispatched(self, op: Op, g: _Gemm) -> None:
        """The tokens quantized on their way to the experts (before the mesh change), and
        carried in FP8 through the permutation into expert order."""
        p = self.p
        tokens = op.inputs[0]
        if op.kind == "mesh_change":
            q, _ = self.quantize(self.fwd, tokens, False, dtype=p.activation_dtype)
            moved = replace(op.outputs[0], name=op.outputs[0].name + ".fp8", dtype=q.dtype)
            self.fwd.append(self.copy(op, inputs=[q, *op.inputs[1:]], outputs=[moved, *op.outputs[1:]]))
            self.moved = moved
            return
        slots = replace(op.outputs[0], name=op.outputs[0].name + ".fp8", dtype=p.activation_dtype)
        self.fwd.append(self.copy(op, inputs=[self.moved, *op.inputs[1:]], outputs=[slots]))
        # the column-wise copy for wgrad is made from the FP8 tokens where they arrived
        g.xq = slots
        g.xc = slots if p.activation_columnwise() == "same" else self.transpose(self.fwd, slots)

    def gemm(self, g: _Gemm) -> None:
        p, op = self.p, g.op
        if not p.fp8:
            # weight-only quantization: a BF16 GEMM reading the packed weight, dequantized as it
            # is loaded (the cost is the GEMM's: graph.cost)
            self.fwd.append(self.copy(op))
            return
        w = op.inputs[g.wi]
        wcol = p.weight_columnwise()
        cached = not self.zero3
        if p.param_gather:
            g.wq = self.sub(w)
            if wcol == "same":
                g.wc = g.wq
            elif not self.zero3:   # the transposed copy, made once per step after the parameter gather
                g.wc = self.transpose(self.fwd, g.wq, cached=True)
        else:
            # under ZeRO-3 the backward casts the re-gathered weight itself
            columnwise = wcol != "same" and not self.zero3
            g.wq, c = self.quantize(self.fwd, w, columnwise, dtype=p.weight_dtype, kind="weight", cached=cached)
            g.wc = c if c is not None else (g.wq if wcol == "same" else None)
        if g.xq is None and p.forward_only:
            x = op.inputs[g.xi]
            if id(x) not in self.shared:
                self.shared[id(x)] = self.quantize(self.fwd, x, False, dtype=p.activation_dtype)[0]
            g.xq = g.xc = self.shared[id(x)]
        if g.xq is None:
            x = op.inputs[g.xi]
            col = p.activation_columnwise()
            g.xq, c = self.quantize(self.fwd, x, col == "quantize" or (col == "transpose" and not g.gathered_x),
                                    dtype=p.activation_dtype, gathered=g.gathered_x)
            g.xc = c if c is not None else (g.xq if col == "same" else None)
        inputs = list(op.inputs)
        inputs[g.xi], inputs[g.wi] = g.xq, g.wq
        self.fwd.append(replace(op, inputs=inputs, saves=inputs, precision=p.matmul))

    def attention(self, op: Op) -> None:
        p = self.p
        qkv8 = [self.quantize(self.fwd, t, False, dtype=p.activation_dtype)[0] for t in op.inputs]
        out, lse = op.outputs[0], op.outputs[1]
        o8 = self.quantized(out, "fp8", p.activation_dtype)
        self.fwd.append(replace(op, inputs=qkv8, outputs=[o8, lse], saves=[*qkv8, o8, lse], precision=p.matmul))
        self.fwd.append(Op(f"{out.name}.dequantize", "dequantize", [o8], [out], flops_per_element=1))
        self.attn[id(op)] = (qkv8, o8)

    # -- backward -------------------------------------------------------------------------------

    def backward(self) -> list[Op]:
        out: list[Op] = []
        # bias gradients a fused activation backward computes in its own kernel
        dact_outputs = {id(op.outputs[0]) for op in self.bwd_ops
                        if op.grad_of is not None and id(op.grad_of) in self.fused_dact}
        self.absorbed = {id(op): op for op in self.bwd_ops
                         if op.kind == "reduce" and len(op.inputs) == 1 and id(op.inputs[0]) in dact_outputs}
        # with FP8 dispatch, the combine's backward writes the experts' quantized output gradient
        consumers: dict[int, int] = {}
        for op in self.bwd_ops:
            for t in op.inputs:
                consumers[id(t)] = consumers.get(id(t), 0) + 1
        combine_grads: dict[int, _Gemm] = {}
        if self.p.dispatch:
            producer = {id(t): op for op in self.bwd_ops for t in op.outputs}
            for op in self.bwd_ops:
                g = self.gemms.get(id(op.grad_of)) if op.grad_of is not None else None
                if g is not None and g.op.mesh != DENSE and op.kind == "einsum":
                    src = producer.get(id(op.inputs[-1]))
                    if src is not None and src.grad_of is not None and src.grad_of.kind == "unpermute":
                        combine_grads[id(src)] = g
        for op in self.bwd_ops:
            if id(op) in self.absorbed:
                continue
            g = self.gemms.get(id(op.grad_of)) if op.grad_of is not None else None
            if g is not None and op.kind == "einsum":
                self.gemm_grad(out, g, op)
            elif op.grad_of is not None and id(op.grad_of) in self.fused_dact:
                self.fused_dact_grad(out, op, self.fused_dact[id(op.grad_of)])
            elif id(op) in combine_grads:
                self.combine_grad(out, op, combine_grads[id(op)], consumers)
            elif op.kind == "attention_grad" and op.grad_of is not None and id(op.grad_of) in self.attn:
                self.attention_grad(out, op)
            else:
                out.append(self.copy(op))
        return out

    def fused_dact_grad(self, out: list[Op], op: Op, g: _Gemm) -> None:
        """The activation's backward writes FC1's quantized output gradient (and its
        column-wise copy) in one kernel, as Transformer Engine's LayerNormMLP does."""
        p, d = self.p, op.outputs[0]
        col = p.activation_columnwise()
        q = self.quantized(d, "fp8", p.activation_dtype)
        c = self.quantized(d, "fp8_t", p.activation_dtype) if col != "same" else None
        bias_grads = [t for r in self.absorbed.values() if r.inputs[0] is d for t in r.outputs]
        out.append(self.copy(op, outputs=[q] + ([c] if c else []) + bias_grads))
        g.dq, g.dc = q, (c if c is not None else q)

    def combine_grad(self, out: list[Op], op: Op, g: _Gemm, consumers: dict[int, int]) -> None:
        d = op.outputs[0]
        q = self.quantized(d, "fp8", self.p.activation_dtype)
        # (the BF16 gradient is still written if something besides the expert GEMM reads it)
        keep = [d] if consumers.get(id(d), 0) > 2 else []
        out.append(self.copy(op, outputs=[q, *keep, *op.outputs[1:]]))
        g.dq = q
        g.dc = q if self.p.activation_columnwise() == "same" else None

    def grad_copies(self, out: list[Op], g: _Gemm, dout: Tensor) -> None:
        """Quantize the GEMM's output gradient: the row-wise copy for dgrad, the column-wise one
        for wgrad (a gathered per-tensor gradient is transposed after the gather, later)."""
        p = self.p
        col = p.activation_columnwise()
        fused_cols = col == "quantize" or (col == "transpose" and not g.gathered_dy)
        g.dq, c = self.quantize(out, dout, fused_cols, dtype=p.activation_dtype, gathered=g.gathered_dy)
        g.dc = c if c is not None else (g.dq if col == "same" else None)

    def gemm_grad(self, out: list[Op], g: _Gemm, op: Op) -> None:
        p = self.p
        dout = op.inputs[-1]
        if g.dq is None:
            self.grad_copies(out, g, dout)
        dgrad = op.outputs[0].kind != "weight_grad"
        if dgrad:
            w = self.sub(g.op.inputs[g.wi])
            wc = g.wc
            if wc is None:          # ZeRO-3: cast (or transpose) the weight gathered for the backward
                if p.param_gather:
                    wc = self.transpose(out, w)
                else:
                    wc, _ = self.quantize(out, w, False, dtype=p.weight_dtype, kind="weight")
            inputs = [wc, g.dq]
        else:
            xc = g.xc if g.xc is not None else self.transpose(out, g.xq, gathered=g.gathered_x)
            dc = g.dc if g.dc is not None else self.transpose(out, g.dq, gathered=g.gathered_dy)
            inputs = [xc, dc]
        out.append(replace(op, inputs=inputs, precision=p.matmul))

    def attention_grad(self, out: list[Op], op: Op) -> None:
        p = self.p
        qkv8, o8 = self.attn[id(op.grad_of)]
        do8, _ = self.quantize(out, op.inputs[0], False, dtype=p.activation_dtype)
        lse = op.inputs[-1]
        grads8 = [self.quantized(t, "fp8", p.activation_dtype) for t in op.outputs]
        out.append(replace(op, inputs=[do8, *qkv8, o8, lse], outputs=grads8, precision=p.matmul))
        for g8, g in zip(grads8, op.outputs):
            out.append(Op(f"{g.name}.dequantize", "dequantize", [g8], [g], flops_per_element=1))

    def run(self) -> tuple[Block, list[Op], dict[Tensor, Tensor], int]:
        self.forward()
        bwd = self.backward()
        weights = [self.sub(w) for w in self.block.weights]
        weight_grads = {self.sub(w): g for w, g in self.weight_grads.items()}
        block = Block(self.block.name, self.block.kind, self.fwd, self.block.inputs, self.block.outputs, weights,
                      caches=self.block.caches)
        return block, bwd, weight_grads, len(self.gemms) + len(self.attn) if self.p.fp8 else 0


def apply_precision(block: Block, bwd_ops: list[Op], weight_grads: dict[Tensor, Tensor], p: Precision, *,
                    sp: bool, zero3: bool) -> tuple[Block, list[Op], dict[Tensor, Tensor], int]:
    """``block``'s forward ops, its backward ops and weight gradients under precision ``p``, and
    the number of FP8 modules (GEMMs and FP8 attention kernels, each with its own scaling state).

    Only transformer layers change: the embedding and the output layer are not Transformer
    Engine linear layers in Megatron and stay BF16 (serving checkpoints keep them BF16 too)."""
    if not p.quantized or block.kind != "layer":
        return block, bwd_ops, weight_grads, 0
    return _Rewrite(block, bwd_ops, weight_grads, p, sp, zero3).run()
