"""NeMo 2 recipe overrides (``nemo llm pretrain --factory RECIPE key=value ...``).

The keys are the fields of the objects a NeMo 2 pretraining recipe builds: the trainer's
``MegatronStrategy`` (``trainer.strategy.*``, its ``DistributedDataParallelConfig`` under
``trainer.strategy.ddp``), the precision plugin ``MegatronMixedPrecision`` (``trainer.plugins.*``),
the optimizer's ``OptimizerConfig`` (``optim.config.*``), the model's ``TransformerConfig``
(``model.config.*``) and the data module (``data.*``). The recipe names the model, so only how
it is trained is overridden; every setting a recipe may preset is written, so the recipe's own
choice (Llama 3 70B's recipe interleaves five virtual stages) does not survive. ZeRO 2 and 3 are
Megatron-FSDP (``trainer.strategy.fsdp=megatron``), as in the Megatron-LM emitter.
"""

from __future__ import annotations

from typing import Any

from stage_cosim.launch.frameworks import refuse
from stage_cosim.launch.megatron import (
    CP_COMM_TYPES, DEFAULT_ORDER, pipeline_layout, refuse_what_megatron_core_lacks,
)
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig


def _literal(value: Any) -> str:
    """A value as NeMo-Run's command line reads it (Python literals; strings bare)."""
    return str(value)


def nemo_overrides(model: ModelConfig, par: ParallelConfig, fp8_recipe: str | None = None) -> list[str]:
    refuse_what_megatron_core_lacks("nemo", par)
    if par.cp > 1 and par.cp_comm == "a2a+p2p":
        raise refuse("nemo", "recipes cannot set hierarchical context parallelism (--cp-comm a2a+p2p)")
    if tuple(par.axis_order) != DEFAULT_ORDER:
        raise refuse("nemo", f"maps ranks as tp, cp, dp, pp, not {', '.join(par.axis_order)} (--axis-order)")
    s, o = "trainer.strategy", {}
    o[f"{s}.tensor_model_parallel_size"] = par.tp
    o[f"{s}.pipeline_model_parallel_size"] = par.pp
    o[f"{s}.virtual_pipeline_model_parallel_size"] = par.vp if par.vp > 1 else None
    first = last = layout = None
    if par.pp > 1:
        layers = par.layers_per_stage(model.layers)
        middle = layers[1:-1]
        if len(set(layers)) > 1:
            if par.vp == 1 and len(set(middle)) <= 1 and not model.mtp_num_layers:
                first = layers[0] if not middle or layers[0] != middle[0] else None
                last = layers[-1] if not middle or layers[-1] != middle[0] else None
            else:
                layout = pipeline_layout(layers, model.mtp_num_layers)
    if par.pp > 1:
        # the split exactly as here, whatever the recipe presets (DeepSeek-V3's first stage,
        # Llama 3.1 405B's embedding counted as a layer)
        o[f"{s}.num_layers_in_first_pipeline_stage"] = first
        o[f"{s}.num_layers_in_last_pipeline_stage"] = last
        o[f"{s}.pipeline_model_parallel_layout"] = layout
        o[f"{s}.account_for_embedding_in_pipeline_split"] = False
        o[f"{s}.account_for_loss_in_pipeline_split"] = False
    o[f"{s}.context_parallel_size"] = par.cp
    o[f"{s}.sequence_parallel"] = par.sp
    # (Userbuffers also need the recipe's MegatronCommOverlapCallback, which its performance
    # mode adds: the emitted header says so)
    o["model.config.tp_comm_overlap"] = par.tp_comm_overlap
    if model.is_moe:
        o[f"{s}.expert_model_parallel_size"] = par.ep
        o[f"{s}.expert_tensor_parallel_size"] = par.expert_tp
        o["model.config.moe_token_dispatcher_type"] = par.moe_token_dispatcher
        o["model.config.moe_enable_deepep"] = par.moe_token_dispatcher == "flex"
        o["model.config.moe_expert_capacity_factor"] = par.moe_capacity_factor
        o["model.config.moe_pad_expert_input_to_capacity"] = par.moe_pad_to_capacity
    if par.cp > 1:
        o["model.config.cp_comm_type"] = CP_COMM_TYPES[par.cp_comm]
    o["data.micro_batch_size"] = par.micro_batch
    o["data.global_batch_size"] = par.global_batch
    o["data.seq_length"] = par.seq_len
    o["model.config.seq_length"] = par.seq_len
    o["model.config.recompute_granularity"] = par.recompute if par.recompute != "none" else None
    o["model.config.recompute_method"] = "uniform" if par.recompute == "full" else None
    o["model.config.recompute_num_layers"] = 1 if par.recompute == "full" else None
    data_parallel = par.dp * par.cp > 1
    o["optim.config.use_distributed_optimizer"] = par.zero >= 1 and data_parallel
    if par.zero >= 2 and data_parallel:
        o[f"{s}.fsdp"] = "megatron"
        o[f"{s}.ddp.data_parallel_sharding_strategy"] = "optim_grads" if par.zero == 2 else "optim_grads_params"
        o[f"{s}.save_ckpt_format"] = "fsdp_dtensor"
        o[f"{s}.ddp.average_in_collective"] = False       # not with Megatron-FSDP (NeMo's recipes say)
    o[f"{s}.ddp.overlap_grad_reduce"] = data_parallel and par.overlap_grad_reduce
    o[f"{s}.ddp.overlap_param_gather"] = par.zero == 1 and data_parallel and par.overlap_param_gather
    o[f"{s}.ddp.grad_reduce_in_fp32"] = par.grad_reduce_dtype == "fp32"
    if par.dtype == "fp8":
        p = "trainer.plugins"
        o[f"{p}.fp8"] = par.fp8_format
        o[f"{p}.fp8_recipe"] = fp8_recipe
        if fp8_recipe == "delayed":
            o[f"{p}.fp8_amax_history_len"] = par.fp8_amax_history_len
        o[f"{p}.fp8_param_gather"] = par.fp8_param_gather
        o[f"{p}.fp8_dot_product_attention"] = par.fp8_attention
    else:
        o["trainer.plugins.fp8"] = None
    return [f"{k}={_literal(v)}" for k, v in o.items()]
