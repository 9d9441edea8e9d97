"""Megatron-LM ``pretrain_gpt.py`` arguments for a model and its parallel configuration.

Flag names are Megatron-LM's (``megatron/training/arguments.py`` and the config dataclasses its
flags are generated from). How this project's settings map:

* ZeRO 1 is Megatron's distributed optimizer; ZeRO 2 and 3 are Megatron-FSDP with the
  ``optim_grads`` and ``optim_grads_params`` sharding strategies (this project models their
  communication as PyTorch FSDP's SHARD_GRAD_OP and FULL_SHARD);
* gradients are reduced in buckets behind the backward (``--overlap-grad-reduce``, unless the
  configuration turns it off), and with ZeRO 1 parameters gathered behind the next forward
  (``--overlap-param-gather``);
* full recomputation recomputes every layer (uniform, one layer per checkpoint); selective is
  Megatron's selective granularity (the core attention);
* an uneven split of the layers over the pipeline stages is written with the first and last
  stage's layer counts where the middle stages are even, else as a pipeline layout.
"""

from __future__ import annotations

from stage_cosim.launch.frameworks import refuse
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig

# The project's --cp-comm values as Megatron-LM's --cp-comm-type (Transformer Engine's names).
CP_COMM_TYPES = {"p2p": "p2p", "all-gather": "all_gather", "a2a": "a2a", "a2a+p2p": "a2a+p2p"}
# Megatron-LM's rank orders (innermost first): its default, and --use-tp-pp-dp-mapping.
DEFAULT_ORDER = ("tp", "cp", "dp", "pp")
TP_PP_DP_ORDER = ("tp", "cp", "pp", "dp")
GRANULARITY = {"selective": "selective", "full": "full"}


def _unsupported_model(model: ModelConfig) -> str | None:
    """A model feature pretrain_gpt.py has no flag for (None: every feature has one)."""
    features = (
        (model.mlp == "geglu", "a GeGLU MLP"),
        (model.sandwich_norm, "sandwich norms"),
        (model.scale_embeddings, "embeddings scaled by sqrt(hidden)"),
        (model.attn_logit_softcapping is not None or model.final_logit_softcapping is not None, "logit soft-capping"),
        (model.sliding_window is not None, "sliding-window attention"),
        (model.attention_chunk_size is not None, "chunked attention"),
        (model.attention_sinks, "attention sinks"),
        (model.parallel_residual, "a parallel residual"),
        (model.moe_router_bias, "a bias on the router"),
        (model.attention_bias != model.mlp_bias, "biases on attention but not on the MLP (or the other way)"),
    )
    return next((what for cond, what in features if cond), None)


def layer_pattern(pattern: tuple[int, ...]) -> str:
    """A 0/1 layer pattern as Megatron's Python list expression, run-length encoded:
    (0, 0, 0, 1, 1) -> "([0]*3+[1]*2)"."""
    runs: list[list[int]] = []
    for bit in pattern:
        if runs and runs[-1][0] == bit:
            runs[-1][1] += 1
        else:
            runs.append([bit, 1])
    return "(" + "+".join(f"[{bit}]*{n}" for bit, n in runs) + ")"


def pipeline_layout(layers: tuple[int, ...], mtp: int) -> str:
    """Megatron's --pipeline-model-parallel-layout: virtual stages in layer order, split by "|",
    the embedding (E) on the first, the MTP modules (m) and the loss (L) on the last."""
    stages = [f"t*{n}" if n else "" for n in layers]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp + "L"
    return "|".join(stages)


def pipeline_split(model: ModelConfig, par: ParallelConfig) -> list[str]:
    """The flags that give each (virtual) pipeline stage its layers as this configuration does."""
    if par.pp == 1:
        return []
    layers = par.layers_per_stage(model.layers)
    if len(set(layers)) == 1:
        return [] if par.vp == 1 else ["--num-layers-per-virtual-pipeline-stage", str(layers[0])]
    middle = layers[1:-1]
    if par.vp == 1 and len(set(middle)) <= 1 and not model.mtp_num_layers:
        # Megatron splits the layers the first and last stage leave evenly over the others
        out = []
        if not middle or layers[0] != middle[0]:
            out += ["--decoder-first-pipeline-num-layers", str(layers[0])]
        if not middle or layers[-1] != middle[0]:
            out += ["--decoder-last-pipeline-num-layers", str(layers[-1])]
        return out
    return ["--pipeline-model-parallel-layout", pipeline_layout(layers, model.mtp_num_layers)]


def model_args(model: ModelConfig) -> list[str]:
    feature = _unsupported_model(model)
    if feature is not None:
        raise refuse("megatron", f"pretrain_gpt.py has no flag for {model.name}'s {feature}")
    a = ["--num-layers", str(model.layers), "--hidden-size", str(model.hidden),
         "--ffn-hidden-size", str(model.ffn), "--num-attention-heads", str(model.heads)]
    if model.kv_heads != model.heads and not model.multi_latent_attention:
        a += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    if model.head_dim * model.heads != model.hidden and not model.multi_latent_attention:
        a += ["--kv-channels", str(model.head_dim)]
    a += ["--max-position-embeddings", str(model.max_seq),
          "--position-embedding-type", "rope" if model.position == "rope" else "learned_absolute"]
    if model.position == "rope" and model.rotary_percent != 1:
        a += ["--rotary-percent", f"{model.rotary_percent:g}"]
    a += ["--normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"]
    if model.mlp == "swiglu":
        a.append("--swiglu")
    elif model.mlp == "squared_relu":
        a.append("--squared-relu")
    if not model.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if not model.attention_bias and not model.mlp_bias:
        a.append("--disable-bias-linear")
    if model.add_qkv_bias:
        a.append("--add-qkv-bias")
    if model.qk_layernorm:
        a.append("--qk-layernorm")
    a += ["--hidden-dropout", f"{model.hidden_dropout:g}", "--attention-dropout", f"{model.attention_dropout:g}"]
    if model.attention == "unfused":
        a += ["--attention-backend", "unfused"]
    if model.cross_entropy == "fused":
        a.append("--cross-entropy-loss-fusion")
    if model.multi_latent_attention:
        a.append("--multi-latent-attention")
        if model.q_lora_rank is not None:
            a += ["--q-lora-rank", str(model.q_lora_rank)]
        a += ["--kv-lora-rank", str(model.kv_lora_rank), "--qk-head-dim", str(model.qk_head_dim),
              "--qk-pos-emb-head-dim", str(model.qk_pos_emb_head_dim), "--v-head-dim", str(model.v_head_dim)]
    if model.is_moe:
        a += ["--num-experts", str(model.num_experts), "--moe-router-topk", str(model.moe_router_topk)]
        if model.moe_router_num_groups is not None:
            a += ["--moe-router-num-groups", str(model.moe_router_num_groups),
                  "--moe-router-group-topk", str(model.moe_router_group_topk)]
        if model.moe_ffn_hidden_size is not None:
            a += ["--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size)]
        if model.moe_shared_expert_intermediate_size is not None:
            a += ["--moe-shared-expert-intermediate-size", str(model.moe_shared_expert_intermediate_size)]
            if model.moe_shared_expert_gate:
                a.append("--moe-shared-expert-gate")
            if model.moe_shared_expert_overlap:
                a.append("--moe-shared-expert-overlap")
        freq = model.moe_layer_freq
        if isinstance(freq, tuple):
            a += ["--moe-layer-freq", layer_pattern(freq)]
        elif freq != 1:
            a += ["--moe-layer-freq", str(freq)]
    if model.mtp_num_layers:
        a += ["--mtp-num-layers", str(model.mtp_num_layers)]
    return a


def refuse_what_megatron_core_lacks(target: str, par: ParallelConfig) -> None:
    """What Megatron-Core, which both Megatron-LM and NeMo 2 run, cannot run or be told: the
    same refusals for either target (``knob``: a pretrain_gpt.py flag, a recipe override)."""
    knob = "flag" if target == "megatron" else "override"
    if par.schedule not in ("1f1b", "interleaved"):
        raise refuse(target, f"has no {'GPipe' if par.schedule == 'gpipe' else par.schedule} schedule (Megatron-Core runs 1F1B, interleaved with virtual stages)")
    if par.cp > 1 and not par.cp_load_balance:
        raise refuse(target, "always splits the sequence into 2*cp load-balanced chunks (--cp-load-balance)")
    if par.te_layernorm_mlp:
        raise refuse(target, f"has no {knob} for Transformer Engine's LayerNormMLP (--te-layernorm-mlp)")
    if par.fp8_dispatch:
        raise refuse(target, f"has no {knob} for an FP8 token dispatch (--fp8-dispatch)")
    if par.dtype == "fp8" and par.fp8_recipe == "rowwise":
        raise refuse(target, "has no rowwise FP8 recipe (torchao's; Transformer Engine scales per tensor or per block)")
    if par.recompute == "op":
        raise refuse(target, "has no per-op selective checkpointing (--recompute op is torchtitan's); its "
                             "selective granularity recomputes the attention core (--recompute selective)")


def parallel_args(model: ModelConfig, par: ParallelConfig, fp8_recipe: str | None) -> list[str]:
    refuse_what_megatron_core_lacks("megatron", par)
    if par.fp8_attention:
        raise refuse("megatron", "pretrain_gpt.py has no flag for FP8 attention (--fp8-attention)")
    order = tuple(par.axis_order)
    if order not in (DEFAULT_ORDER, TP_PP_DP_ORDER):
        raise refuse("megatron", f"maps ranks as tp, cp, dp, pp (or tp, cp, pp, dp), not {', '.join(order)} "
                                 "(--axis-order)")
    a = ["--tensor-model-parallel-size", str(par.tp), "--pipeline-model-parallel-size", str(par.pp)]
    a += pipeline_split(model, par)
    a += ["--context-parallel-size", str(par.cp)]
    if par.cp > 1:
        a += ["--cp-comm-type", CP_COMM_TYPES[par.cp_comm]]
        if par.cp_comm == "a2a+p2p":
            a += ["--hierarchical-context-parallel-sizes", str(par.cp_a2a_size), str(par.cp // par.cp_a2a_size)]
    if par.sp:
        a.append("--sequence-parallel")
    if order == TP_PP_DP_ORDER and par.pp > 1:
        a.append("--use-tp-pp-dp-mapping")
    if model.is_moe:
        a += ["--expert-model-parallel-size", str(par.ep), "--expert-tensor-parallel-size", str(par.expert_tp),
              "--moe-token-dispatcher-type", par.moe_token_dispatcher]
        if par.moe_token_dispatcher == "flex":
            a.append("--moe-enable-deepep")     # the flex dispatcher's DeepEP kernels
        if par.moe_capacity_factor is not None:
            a += ["--moe-expert-capacity-factor", f"{par.moe_capacity_factor:g}"]
            if par.moe_pad_to_capacity:
                a.append("--moe-pad-expert-input-to-capacity")
    a += ["--micro-batch-size", str(par.micro_batch), "--global-batch-size", str(par.global_batch),
          "--seq-length", str(par.seq_len)]
    if par.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
    elif par.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    data_parallel = par.dp * par.cp > 1
    if par.zero >= 1 and data_parallel:
        a.append("--use-distributed-optimizer")
    if par.zero >= 2 and data_parallel:
        a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
              "optim_grads" if par.zero == 2 else "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]
    if data_parallel:
        if par.overlap_grad_reduce:
            a.append("--overlap-grad-reduce")
        if par.zero == 1 and par.overlap_param_gather:
            a.append("--overlap-param-gather")
        if par.grad_reduce_dtype == "bf16":
            a.append("--grad-reduce-in-bf16")
    if par.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    a.append("--bf16")
    if par.dtype == "fp8":
        a += ["--fp8-format", par.fp8_format, "--fp8-recipe", fp8_recipe]
        if fp8_recipe == "delayed":
            a += ["--fp8-amax-history-len", str(par.fp8_amax_history_len)]
        if par.fp8_param_gather:
            a.append("--fp8-param-gather")
    return a


def megatron_args(model: ModelConfig, par: ParallelConfig, fp8_recipe: str | None = None) -> list[str]:
    """pretrain_gpt.py's arguments (argv tokens) for ``par`` training ``model``."""
    return model_args(model) + parallel_args(model, par, fp8_recipe)
