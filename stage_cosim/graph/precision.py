"""Precision as a policy over a block's graph, the way Transformer Engine runs FP8 training:
what a step computes and stores in.

A :class:`Precision` says which GEMMs compute in FP8 and how their operands are quantized:
:func:`resolve_precision` gives a training step's (from its parallel configuration and GPU),
:func:`inference_precision` an inference step's (a forward-only policy: FP8 weights and GEMMs,
W8A8, or weights stored in a packed 4-bit format, W4A16).
:func:`~stage_cosim.graph.precision_rewrite.apply_precision` rewrites a block's ops to match;
its module says how.

Delayed scaling's per-step pieces that belong to a whole pass (one amax all-reduce over the
tensor- and data-parallel group at the end of each forward and backward pass, the history
update) are placed by the schedule; the amax history's memory is counted there too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stage_cosim.errors import UserError, require
from stage_cosim.inference.config import FP8_ACTIVATION_SCALES

# Transformer Engine keeps, per FP8 module with delayed scaling, an amax history and a scale and
# inverse scale for three forward tensors (input, weight, output) and two backward ones (output
# gradient, input gradient), fp32 each.
AMAX_TENSORS_FWD, AMAX_TENSORS_BWD = 3, 2


@dataclass(frozen=True)
class Precision:
    """How a step computes and stores: BF16, or an FP8 recipe of Transformer Engine."""

    dtype: str = "bf16"
    recipe: str = ""                  # delayed | tensorwise | mxfp8 | blockwise | rowwise (fp8 only)
    format: str = "hybrid"            # e4m3 | hybrid (e5m2 gradients): same bytes, same rate
    transposes: bool = True           # FP8 GEMMs take K-major operands only (Hopper)
    attention: bool = False           # FP8 fused attention
    param_gather: bool = False        # parameters stored (and gathered) in FP8
    dispatch: bool = False            # MoE token dispatch in FP8
    amax_history_len: int = 1024
    te_layernorm_mlp: bool = False    # the MLP is Transformer Engine's LayerNormMLP
    # Weight-only quantization (inference): the GEMM weights stored in this packed format, the
    # GEMMs computing in BF16 and dequantizing the weights as they load them ("": none).
    weights: str = ""
    # A forward pass alone (an inference step, as serving engines run it): no column-wise
    # copies or transposes (there is no backward); casts fused into the producing kernels only
    # with static activation scales.
    forward_only: bool = False
    # An inference step's FP8 activation scales (vLLM's activation_scheme): "static", one
    # calibrated scale per GEMM input stored with the checkpoint, or "dynamic", computed per
    # tensor as it comes ("": training, where the recipe says).
    activation_scale: str = ""

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def quantized(self) -> bool:
        """Some GEMM runs in FP8 or reads weights stored in another format than BF16."""
        return self.fp8 or bool(self.weights)

    @property
    def stored_weight_dtype(self) -> str:
        """What the GEMM weights are stored in when they are not BF16 (FP8 parameters, or the
        packed format of weight-only quantization)."""
        return self.weights or self.weight_dtype

    @property
    def matmul(self) -> str:
        """The tensor-core format of the FP8 GEMMs (the peak they run at)."""
        return "mxfp8" if self.recipe == "mxfp8" else "fp8"

    @property
    def per_tensor(self) -> bool:
        return self.recipe in ("delayed", "tensorwise")

    @property
    def delayed(self) -> bool:
        return self.fp8 and self.recipe == "delayed"

    @property
    def current_scaling(self) -> bool:
        return self.recipe == "tensorwise" and self.activation_scale != "static"

    @property
    def static_scales(self) -> bool:
        """FP8 activations scaled by scales calibrated offline: no amax at run time, and the
        quantization fused into the kernel that produces the GEMM input where engines fuse it."""
        return self.fp8 and self.activation_scale == "static"

    @property
    def activation_dtype(self) -> str:
        """Quantized activations and gradients (data and scales per element; rowwise's one fp32
        scale per row of thousands of elements is left out, as per-tensor scales are)."""
        return {"mxfp8": "mxfp8", "blockwise": "fp8_1x128"}.get(self.recipe, "fp8")

    @property
    def weight_dtype(self) -> str:
        return {"mxfp8": "mxfp8", "blockwise": "fp8_128x128"}.get(self.recipe, "fp8")

    def activation_columnwise(self) -> str:
        """How an activation's or gradient's column-wise copy is made: "transpose" (of the FP8
        data), "quantize" (separately, from the high-precision tensor) or "same" (none: the
        GEMM reads the row-wise copy in either layout; a forward pass needs none)."""
        if self.forward_only:
            return "same"
        if self.per_tensor:
            return "transpose" if self.transposes else "same"
        return "quantize"

    def weight_columnwise(self) -> str:
        if self.forward_only:
            return "same"
        if self.recipe in ("mxfp8", "rowwise"):
            # 32-element blocks, and one scale per output row, run along the other axis in the
            # transposed GEMM: the copy is quantized again from the high-precision weight
            return "quantize"
        # per-tensor scales and 128x128 blocks are the same for the transposed weight
        return "transpose" if self.transposes else "same"

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("weights", "forward_only", "activation_scale") or v}
        if not self.fp8:
            return {k: d[k] for k in ("dtype", "weights", "forward_only") if k in d}
        return d


BF16 = Precision()
# Weight-only 4-bit quantization (GPTQ, AWQ): 4 bits per weight and an fp16 scale per group of
# 128 (DTYPE_BYTES["int4_g128"]); the kernels dequantize in the GEMM (Marlin, ...).
INT4_WEIGHTS = "int4_g128"


def inference_precision(weight_dtype: str, gpu: Any = None, activation_scale: str = "static") -> Precision:
    """How an inference step with ``weight_dtype`` (bf16 | fp8 | int4) weights computes, as
    serving engines run such checkpoints (checked against ``gpu``, if given):

    * ``fp8`` (W8A8): the layers' GEMMs in FP8 at the FP8 peak, their weights stored in FP8
      (one byte per parameter, a per-tensor scale), each input activation quantized per tensor:
      ``activation_scale`` "static", with the checkpoint's calibrated scale, by the kernel that
      produces it where engines fuse that (an RMSNorm writes FP8, as vLLM's
      ``rms_norm_static_fp8_quant`` and ``fused_add_rms_norm_static_fp8_quant`` do, and so
      does SiLU-and-mul, vLLM's ``silu_and_mul_quant``), by a cast of its own otherwise;
      "dynamic", as it comes (an amax pass, then the cast: Transformer Engine's current
      scaling, vLLM's dynamic per-tensor quantization);
    * ``int4`` (W4A16): weights stored as 4 bits plus an fp16 scale per group of 128, the GEMMs
      in BF16 dequantizing them on the fly (no kernel of its own).

    Embedding, output layer, norms, the router and attention stay BF16 (the KV cache has its own
    precision)."""
    if weight_dtype == "bf16":
        return BF16
    if weight_dtype == "int4":
        return Precision(weights=INT4_WEIGHTS, forward_only=True)
    require(weight_dtype == "fp8", "weight-dtype", f"must be bf16, fp8 or int4, got {weight_dtype!r}")
    if gpu is not None:
        require(gpu.fp8_tflops is not None, "weight-dtype",
                f"fp8 needs FP8 tensor cores; {gpu.name} has none (its gpu.fp8_tflops is not set)")
    require(activation_scale in FP8_ACTIVATION_SCALES, "fp8-activation-scale",
            f"must be {' or '.join(FP8_ACTIVATION_SCALES)}, got {activation_scale!r}")
    return Precision("fp8", "tensorwise", "e4m3", transposes=False, param_gather=True, forward_only=True,
                     activation_scale=activation_scale)


def resolve_precision(parallel: Any, gpu: Any) -> Precision:
    """The precision of ``parallel`` (a ParallelConfig) on ``gpu``: the recipe defaults to
    Transformer Engine's for the GPU (MXFP8 where the GPU has block-scaled tensor cores, delayed
    scaling otherwise), and what the GPU cannot run is refused."""
    if parallel.dtype != "fp8":
        return BF16
    require(gpu.fp8_tflops is not None, "dtype",
            f"fp8 needs FP8 tensor cores; {gpu.name} has none (its gpu.fp8_tflops is not set)")
    recipe = parallel.fp8_recipe or ("mxfp8" if gpu.mxfp8_tflops else "delayed")
    if recipe == "mxfp8" and not gpu.mxfp8_tflops:
        raise UserError("fp8-recipe", f"mxfp8 needs block-scaled (MXFP8) tensor cores, which {gpu.name} "
                                      "does not have (Blackwell does; gpu.mxfp8_tflops is not set)")
    if parallel.fp8_param_gather and recipe == "mxfp8":
        raise UserError("fp8-param-gather", "with mxfp8 Megatron gathers parameters in BF16 and quantizes "
                                            "them after the gather; use it with delayed, tensorwise or blockwise")
    return Precision("fp8", recipe, parallel.fp8_format, gpu.fp8_transposes, parallel.fp8_attention,
                     parallel.fp8_param_gather, parallel.fp8_dispatch, parallel.fp8_amax_history_len,
                     parallel.te_layernorm_mlp)
