"""Command-line flags -> a request in the api vocabulary, for the ``remote`` commands.

``remote simulate`` takes the very flags of ``simulate`` (the same click parameters), so the
values arrive exactly as the local command sees them. They are checked here with the local
resolvers first — the same one-line errors, before anything is sent — then turned into the
request the server resolves to the same model, parallel configuration and cluster.

A model described by ``--arch`` and dimensions alone has no name in the api vocabulary; it
travels as the equivalent Hugging Face config (named "custom", as the local command names it).
"""

from __future__ import annotations

from typing import Any

from stage_cosim.cli.options import (
    MEGATRON_SWITCH_FLAGS, MODEL_DIMENSIONS, MOE_PARALLEL, PRECISION_FLAGS, megatron_switches,
    resolve_model_options, resolve_parallel_options,
)
from stage_cosim.errors import UserError
from stage_cosim.model.config import MODEL_SWITCHES

MODEL_FLAGS = ("model", "arch", *MODEL_DIMENSIONS, *MODEL_SWITCHES, "cross_entropy_loss_fusion")
PARALLEL_FLAGS = ("dp", "tp", "pp", "cp", "cp_comm", "cp_a2a_size", "cp_load_balance", "vp", "sp", "micro_batch",
                  "global_batch", "seq_len", "zero", "recompute", "schedule", "pp_layers", "axis_order", *PRECISION_FLAGS,
                  *MOE_PARALLEL, *MEGATRON_SWITCH_FLAGS)


def check_locally(kw: dict[str, Any], parallel: bool = True) -> tuple[Any, Any]:
    """(ModelConfig, ParallelConfig | None) as the local command resolves them (errors alike)."""
    # copies of everything: the resolvers pop the flags they know, whatever those are by now
    model = resolve_model_options(dict(kw))
    par = resolve_parallel_options(dict(kw), kw.get("cluster")) if parallel else None
    if par is not None and kw.get("dp") is None:
        kw["dp"] = par.dp       # derived from the cluster here: the request says it
    return model, par


def model_request(kw: dict[str, Any]) -> dict[str, Any]:
    """The model part of a request, from the model flags (already checked)."""
    req: dict[str, Any] = {}
    dims = {d: kw.get(d) for d in MODEL_DIMENSIONS}
    if kw.get("model") is None and kw.get("arch") is not None:
        req["model_config"] = _arch_config(kw["arch"], dims)
        if kw["arch"] == "gpt":      # GPT-2 configs have no head or kv-head counts of their own
            req.update({k: dims[k] for k in ("kv_heads", "head_dim") if dims[k] is not None})
    else:
        if kw.get("model") is not None:
            req["model"] = kw["model"]
        req.update({d: v for d, v in dims.items() if v is not None})
    for switch in MODEL_SWITCHES:
        if kw.get(switch) is not None:
            req[switch] = kw[switch]
    if kw.get("cross_entropy_loss_fusion"):
        req["cross_entropy"] = "fused"
    return req


def _arch_config(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    max_seq = d["max_seq"] or 4096
    if arch == "gpt":
        cfg = {"_name_or_path": "custom", "model_type": "gpt2", "n_layer": d["layers"], "n_embd": d["hidden"],
               "n_head": d["heads"], "vocab_size": d["vocab"], "n_positions": max_seq, "tie_word_embeddings": True}
        if d["ffn"] is not None:
            cfg["n_inner"] = d["ffn"]
        return cfg
    cfg = {"_name_or_path": "custom", "model_type": "llama", "num_hidden_layers": d["layers"],
           "hidden_size": d["hidden"], "num_attention_heads": d["heads"], "intermediate_size": d["ffn"],
           "vocab_size": d["vocab"], "max_position_embeddings": max_seq, "tie_word_embeddings": False}
    if d["kv_heads"] is not None:
        cfg["num_key_value_heads"] = d["kv_heads"]
    if d["head_dim"] is not None:
        cfg["head_dim"] = d["head_dim"]
    return cfg


def parallel_request(kw: dict[str, Any]) -> dict[str, Any]:
    req = {k: kw[k] for k in PARALLEL_FLAGS
           if kw.get(k) is not None and k not in ("pp_layers", "axis_order", *MEGATRON_SWITCH_FLAGS)}
    req.update(megatron_switches({k: kw.get(k) for k in (*MEGATRON_SWITCH_FLAGS, "zero", "tp", "sp")}))
    if kw.get("pp_layers"):
        req["pp_layers"] = [int(x) for x in kw["pp_layers"].split(",")]
    if kw.get("axis_order"):
        req["axis_order"] = [a.strip() for a in kw["axis_order"].split(",")]
    return req


def param_default(param: Any) -> Any:
    """A click parameter's default as the command would see it.

    Newer click keeps an unset-sentinel in ``param.default`` for flags, so ask the parameter itself.
    """
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return param.default
    # the parameter's own default, not a run file's value (--config sets ctx.default_map): a
    # flag the run file sets is a flag the user set
    saved, ctx.default_map = ctx.default_map, None
    try:
        return param.get_default(ctx)
    finally:
        ctx.default_map = saved


def passthrough(kw: dict[str, Any], used: set[str], params: list[Any]) -> dict[str, Any]:
    """Flags not handled by name: design fields travel; any other flag that is set is refused.

    ``params`` are the local command's click parameters: a flag left at its default is not sent,
    and a refused flag is named as the user typed it (``--astra-sim``, not ``astra_bin``).
    """
    from stage_cosim.bridge.codec import DESIGN_FIELDS

    out = {}
    for param in params:
        key = param.name
        value = kw.get(key)
        if key in used or value is None or value == param_default(param):
            continue
        if key in DESIGN_FIELDS:
            out[key] = value
        else:
            flag = max(param.opts, key=len).lstrip("-")
            raise UserError(flag, "is not supported by the remote command (the server has its own settings)")
    return out
