"""Flags shared by the commands that take a model and a parallel configuration.

Flag names are the configuration field names (``--tp`` is ``ParallelConfig.tp``, ``--kv-heads``
is ``ModelConfig.kv_heads``), so the command line, config files and JSON use one vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable, get_args

import click

from stage_cosim.adapters.roofline.network import NETWORK_MODELS
from stage_cosim.errors import UserError
from stage_cosim.fielddocs import field_docs
from stage_cosim.inference.config import (
    FP8_ACTIVATION_SCALES, KV_CACHE_DTYPES, PHASES, TRAIN, WEIGHT_DTYPES, InferenceConfig,
)
from stage_cosim.model import ModelConfig, resolve_model
from stage_cosim.model.config import MODEL_SWITCHES, Arch, AttentionImpl, CrossEntropyImpl
from stage_cosim.model.presets import DEFAULT_MODEL
from stage_cosim.parallel.software import DEFAULT_SOFTWARE, get_software, software_names
from stage_cosim.parallel.config import (
    CP_COMMS, DEFAULT_AXIS_ORDER, DTYPES, FP8_FORMATS, FP8_RECIPES, PRECISION_FIELDS, RECOMPUTE, SCHEDULES,
    TOKEN_DISPATCHERS,
    ParallelConfig,
)

# The Mixture-of-Experts fields of a parallel configuration (flags of the same names).
MOE_PARALLEL = ("ep", "expert_tp", "moe_token_dispatcher", "moe_capacity_factor", "moe_pad_to_capacity",
                "moe_imbalance")

MODEL_DIMENSIONS = ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "max_seq")


def _compose(*decorators: Callable) -> Callable:
    def apply(f: Callable) -> Callable:
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


def _model_doc(name: str) -> str:
    """The help of the flag of ModelConfig field ``name``: the field's docstring."""
    return field_docs(ModelConfig)[name]


# Each flag overrides the field of the same name of the model --model names.
_OVERRIDE = " Overrides the model's."

model_options = _compose(
    click.option("--model", "model", default=None, metavar="NAME|config.json",
                 help=f"Preset name or Hugging Face config.json (default {DEFAULT_MODEL}; see 'stage-cosim models')."),
    click.option("--arch", type=click.Choice(get_args(Arch)), default=None,
                 help=_model_doc("arch") + " Only for a model given by dimension flags alone."),
    *(click.option(f"--{d.replace('_', '-')}", d, type=int, default=None, help=_model_doc(d) + _OVERRIDE
                   + (" Default with --arch: 4096." if d == "max_seq" else ""))
      for d in MODEL_DIMENSIONS),
    click.option("--attention", type=click.Choice(get_args(AttentionImpl)), default=None,
                 help=_model_doc("attention") + _OVERRIDE),
    click.option("--cross-entropy", "cross_entropy", type=click.Choice(get_args(CrossEntropyImpl)), default=None,
                 help=_model_doc("cross_entropy") + _OVERRIDE),
    click.option("--cross-entropy-loss-fusion", "cross_entropy_loss_fusion", is_flag=True, default=None,
                 help="Megatron-LM's name for --cross-entropy fused."),
    click.option("--causal-flops/--full-attention-flops", "causal_flops", default=None,
                 help=_model_doc("causal_flops") + " --full-attention-flops turns it off." + _OVERRIDE),
    click.option("--moe-shared-expert-overlap/--no-moe-shared-expert-overlap", "moe_shared_expert_overlap",
                 default=None, help=_model_doc("moe_shared_expert_overlap") + _OVERRIDE),
)

# The precision flags (ParallelConfig fields of the same names).
PRECISION_FLAGS = PRECISION_FIELDS


def _doc(name: str) -> str:
    """The help of the flag of ParallelConfig field ``name``: the field's docstring."""
    return field_docs(ParallelConfig)[name]


def precision_options(auto: bool = False) -> Callable:
    """--dtype and the FP8 options (``auto``: the search may pick bf16 or fp8 itself)."""
    dtypes = DTYPES + (("auto",) if auto else ())
    return _compose(
        click.option("--dtype", type=click.Choice(dtypes), default="bf16", show_default=True,
                     help=_doc("dtype") + (" auto: search both and report the best of each." if auto else "")),
        click.option("--fp8-recipe", type=click.Choice(FP8_RECIPES), default=None,
                     help=_doc("fp8_recipe")),
        click.option("--fp8-format", type=click.Choice(FP8_FORMATS), default="hybrid", show_default=True,
                     help=_doc("fp8_format")),
        click.option("--fp8-attention/--no-fp8-attention", default=False,
                     help=_doc("fp8_attention")),
        click.option("--fp8-param-gather/--no-fp8-param-gather", default=False,
                     help=_doc("fp8_param_gather")),
        click.option("--fp8-dispatch/--no-fp8-dispatch", default=False,
                     help=_doc("fp8_dispatch")),
        click.option("--fp8-amax-history-len", type=int, default=1024, show_default=True,
                     help=_doc("fp8_amax_history_len")),
        click.option("--te-layernorm-mlp/--no-te-layernorm-mlp", default=False,
                     help=_doc("te_layernorm_mlp")),
    )


software_option = click.option(
    "--software", "software", default=None, metavar="PROFILE",
    help=_doc("software") + f" Profiles: {', '.join(software_names())} (default {DEFAULT_SOFTWARE}).")


# Megatron-Core's performance switches, under Megatron-LM's flag names. Unset, each takes the
# software profile's value (--software; the report's "switches" line says which were assumed).
def megatron_switch_options() -> Callable:
    return _compose(
    software_option,
    click.option("--tp-comm-overlap/--no-tp-comm-overlap", "tp_comm_overlap", default=None,
                 help=_doc("tp_comm_overlap")),
    click.option("--overlap-grad-reduce/--no-overlap-grad-reduce", "overlap_grad_reduce", default=None,
                 help=_doc("overlap_grad_reduce")),
    click.option("--overlap-param-gather/--no-overlap-param-gather", "overlap_param_gather", default=None,
                 help=_doc("overlap_param_gather")),
    click.option("--grad-reduce-in-bf16/--grad-reduce-in-fp32", "grad_reduce_in_bf16", default=None,
                 help=_doc("grad_reduce_dtype") + " (The request and JSON field is grad_reduce_dtype.)"),
    click.option("--use-distributed-optimizer", "use_distributed_optimizer", is_flag=True, default=None,
                 help="Megatron's distributed optimizer: the same as --zero 1."),
    )


MEGATRON_SWITCH_FLAGS = ("software", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
                         "grad_reduce_in_bf16", "use_distributed_optimizer")


def megatron_switches(kw: dict[str, Any]) -> dict[str, Any]:
    """The ParallelConfig fields the Megatron switch flags set (popping them from ``kw``): only
    those given. ``--use-distributed-optimizer`` is ZeRO 1, so it refuses another ``--zero``; a
    switch the software profile's framework lacks is refused."""
    software = kw.pop("software", None)
    profile = get_software(software)
    given = {name: kw.pop(name, None) for name in ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")}
    bf16 = kw.pop("grad_reduce_in_bf16", None)
    distributed = kw.pop("use_distributed_optimizer", None)
    profile.refuse_lacking({**given, "sp": kw.get("sp"), "grad_reduce_dtype": bf16,
                            "use_distributed_optimizer": distributed})
    out: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
    if software is not None:
        out["software"] = software
    if bf16 is not None:
        out["grad_reduce_dtype"] = "bf16" if bf16 else "fp32"
    if distributed:
        zero = kw.get("zero")
        if zero not in (None, 0, 1):
            raise UserError("use-distributed-optimizer", f"is ZeRO stage 1 (--zero 1), not --zero {zero}")
        out["zero"] = 1
    return out


parallel_options = _compose(
    click.option("--dp", type=int, default=None,
                 help=_doc("dp") + " Default: the cluster's GPUs over tp*cp*pp where --cluster gives a count "
                 "(PRESET:COUNT, a file's num_gpus), else 1."),
    click.option("--tp", type=int, default=1, show_default=True, help=_doc("tp")),
    click.option("--pp", type=int, default=1, show_default=True, help=_doc("pp")),
    click.option("--cp", type=int, default=1, show_default=True, help=_doc("cp")),
    click.option("--cp-comm", "cp_comm", type=click.Choice(CP_COMMS), default="p2p", show_default=True,
                 help=_doc("cp_comm")),
    click.option("--cp-a2a-size", "cp_a2a_size", type=int, default=None,
                 help=_doc("cp_a2a_size")),
    click.option("--cp-load-balance/--no-cp-load-balance", "cp_load_balance", default=True,
                 help=_doc("cp_load_balance")),
    click.option("--vp", type=int, default=1, show_default=True, help=_doc("vp")),
    click.option("--sp/--no-sp", "sp", default=None,
                 help=_doc("sp")),
    click.option("--micro-batch", type=int, default=None,
                 help=_doc("micro_batch") + " Default 1; inference: the replica's requests over pp."),
    click.option("--global-batch", type=int, default=None, help=_doc("global_batch")),
    click.option("--seq-len", type=int, default=2048, show_default=True, help=_doc("seq_len")),
    click.option("--zero", type=int, default=0, show_default=True, help=_doc("zero")),
    click.option("--recompute", type=click.Choice(RECOMPUTE), default="none", show_default=True,
                 help=_doc("recompute")),
    click.option("--schedule", type=click.Choice(SCHEDULES), default=None,
                 help=_doc("schedule")),
    click.option("--pp-layers", default=None, metavar="N,N,...",
                 help=_doc("pp_layers")),
    click.option("--axis-order", default=",".join(DEFAULT_AXIS_ORDER), show_default=True,
                 help=_doc("axis_order")),
    precision_options(),
    megatron_switch_options(),
    click.option("--ep", type=int, default=1, show_default=True,
                 help=_doc("ep")),
    click.option("--expert-tp", "expert_tp", type=int, default=None,
                 help=_doc("expert_tp")),
    click.option("--moe-token-dispatcher", "moe_token_dispatcher", type=click.Choice(TOKEN_DISPATCHERS),
                 default="alltoall", show_default=True, help=_doc("moe_token_dispatcher")),
    click.option("--moe-capacity-factor", "moe_capacity_factor", type=float, default=None,
                 help=_doc("moe_capacity_factor")),
    click.option("--moe-pad-to-capacity/--no-moe-pad-to-capacity", "moe_pad_to_capacity", default=False,
                 help=_doc("moe_pad_to_capacity")),
    click.option("--moe-imbalance", "moe_imbalance", type=float, default=1.0, show_default=True,
                 help=_doc("moe_imbalance")),
)


def resolve_model_options(kw: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from --model and the dimension overrides (popping them from ``kw``)."""
    spec = kw.pop("model")
    arch = kw.pop("arch")
    dims = {d: kw.pop(d) for d in MODEL_DIMENSIONS}
    switches = {k: kw.pop(k) for k in MODEL_SWITCHES}
    if kw.pop("cross_entropy_loss_fusion", None):
        if switches["cross_entropy"] == "unfused":
            raise UserError("cross-entropy-loss-fusion", "is --cross-entropy fused; it contradicts --cross-entropy unfused")
        switches["cross_entropy"] = "fused"
    for name, value in dims.items():
        if value is not None and value <= 0:
            raise UserError(name.replace("_", "-"), f"must be a positive integer, got {value}")
    if spec is None and arch is not None:
        required = ("layers", "hidden", "heads", "vocab")
        missing = [d for d in required if dims[d] is None]
        if missing:
            raise UserError(missing[0].replace("_", "-"), f"is required to describe a {arch} model by its dimensions")
        model = ModelConfig.build("custom", arch, layers=dims["layers"], hidden=dims["hidden"],
                                  heads=dims["heads"], vocab=dims["vocab"],
                                  max_seq=dims["max_seq"] or 4096, ffn=dims["ffn"],
                                  kv_heads=dims["kv_heads"], head_dim=dims["head_dim"])
        return model.with_overrides(**switches)
    model = resolve_model(spec or DEFAULT_MODEL)
    if arch is not None and arch != model.arch:
        raise UserError("arch", f"{model.name} is a {model.arch} model; --arch only describes models given by dimensions")
    return model.with_overrides(**dims, **switches)


def resolve_parallel_options(kw: dict[str, Any], cluster: str | None = None) -> ParallelConfig:
    """The ParallelConfig of the parallel flags (popping them from ``kw``); without --dp, the
    data-parallel degree ``cluster`` leaves (:func:`stage_cosim.api.derived_dp`)."""
    pp_layers = kw.pop("pp_layers")
    layers: tuple[int, ...] | None = None
    if pp_layers:
        try:
            layers = tuple(int(x) for x in pp_layers.split(","))
        except ValueError:
            raise UserError("pp-layers", f"must be comma-separated integers, got {pp_layers!r}") from None
    order = tuple(a.strip() for a in kw.pop("axis_order").split(","))
    names = ("dp", "tp", "pp", "cp", "cp_comm", "cp_a2a_size", "cp_load_balance", "vp", "sp", "global_batch",
             "seq_len", "zero", "recompute", "schedule", *PRECISION_FLAGS, *MOE_PARALLEL)
    micro_batch = kw.pop("micro_batch")         # 0 is refused by ParallelConfig, never run as 1
    switches = megatron_switches(kw)
    fields = {**{n: kw.pop(n) for n in names}, **switches}
    if fields["dp"] is None:
        from stage_cosim.api import derived_dp

        fields["dp"] = derived_dp(cluster, *(fields[a] for a in ("tp", "cp", "pp")))
    return ParallelConfig(**fields, micro_batch=1 if micro_batch is None else micro_batch,
                          pp_layers=layers, axis_order=order)


def _inference_doc(name: str) -> str:
    """An inference flag's help: the InferenceConfig field's docstring."""
    return field_docs(InferenceConfig)[name]


inference_options = _compose(
    click.option("--phase", type=click.Choice((TRAIN,) + PHASES), default=TRAIN, show_default=True,
                 help=_inference_doc("phase")),
    click.option("--batch", type=int, default=None, help=_inference_doc("batch")),
    click.option("--input-len", type=int, default=None, help=_inference_doc("input_len")),
    click.option("--context-len", type=int, default=None, help=_inference_doc("context_len")),
    click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default=None,
                 help=_inference_doc("kv_cache_dtype")),
    click.option("--weight-dtype", type=click.Choice(WEIGHT_DTYPES), default=None,
                 help=_inference_doc("weight_dtype")),
    click.option("--fp8-activation-scale", "fp8_activation_scale", type=click.Choice(FP8_ACTIVATION_SCALES),
                 default=None, help=_inference_doc("fp8_activation_scale")),
    click.option("--attention-dp", "attention_dp", is_flag=True, default=None, help=_inference_doc("attention_dp")),
    click.option("--two-batch-overlap", "two_batch_overlap", is_flag=True, default=None,
                 help=_inference_doc("two_batch_overlap")),
)
INFERENCE_FLAGS = ("batch", "input_len", "context_len", "kv_cache_dtype", "weight_dtype", "fp8_activation_scale",
                   "attention_dp", "two_batch_overlap")


def resolve_inference_options(kw: dict[str, Any]) -> InferenceConfig | None:
    """The InferenceConfig of --phase prefill|decode (popping its flags), or None for training.
    Training-only batch flags are refused with an inference phase, and the other way round."""
    phase = kw.pop("phase")
    given = {k: kw.pop(k) for k in INFERENCE_FLAGS}
    if phase == TRAIN:
        for k, v in given.items():
            if v is not None:
                raise UserError(k.replace("_", "-"), "is an inference option (with --phase prefill or decode)")
        return None
    ctx = click.get_current_context(silent=True)
    for k, instead in (("seq_len", "--input-len or --context-len"), ("global_batch", "--batch")):
        explicit = ctx is not None and ctx.get_parameter_source(k) not in (None, click.core.ParameterSource.DEFAULT)
        if kw.get(k) is not None and (explicit or k == "global_batch"):
            raise UserError(k.replace("_", "-"), f"is a training option; an inference step takes {instead}")
    return InferenceConfig(phase, **{k: v for k, v in given.items() if v is not None},
                           micro_batch=kw.get("micro_batch"))

cluster_option = click.option(
    "--cluster", default="dgx-h100", show_default=True, metavar="PRESET[:GPUS]|FILE.yaml",
    help="Cluster preset with GPU count (default count: dp*tp*cp*pp) or a YAML description ('stage-cosim clusters').")


# The network model of the built-in simulator (simulate, compare, optimize).
network_model_option = click.option(
    "--network-model", type=click.Choice(NETWORK_MODELS), default="calibrated", show_default=True,
    help="calibrated: NCCL-like real clusters; astra: ASTRA-sim's congestion-unaware analytical model.")


def warn_positions(model: ModelConfig, parallel: ParallelConfig, inference: InferenceConfig | None) -> None:
    """RoPE runs past the positions a model was trained for (its cost does not change), but the
    model was not trained there: said once, with the result (never before an error), by every
    command that takes a model. (Learned positions cannot: refused by the rules.)"""
    if model.position != "rope":
        return
    seq = inference.context if inference is not None else parallel.seq_len
    if seq > model.max_seq:
        what = "the context" if inference is not None else "seq-len"
        click.echo(f"warning: {what} {seq:,} exceeds {model.name}'s max_position_embeddings ({model.max_seq:,}): "
                   "its rotary positions go beyond what it was trained on (the cost is modelled, the quality is not)",
                   err=True)
