"""``stage-cosim models``: the built-in presets with their dimensions and parameter counts, or
one model (a preset or a Hugging Face config.json, with the dimension overrides)."""

from __future__ import annotations

from collections import Counter

import json

import click

from stage_cosim.cli.options import MODEL_DIMENSIONS, model_options, resolve_model_options
from stage_cosim.model import PRESETS
from stage_cosim.model.config import MODEL_SWITCHES


def _describe_one(model) -> None:  # noqa: ANN001 (ModelConfig)
    from stage_cosim.model.params import CONVENTION, parameter_counts

    counts = parameter_counts(model)
    dims = [f"layers {model.layers}", f"hidden {model.hidden}", f"ffn {model.ffn}", f"heads {model.heads}",
            f"kv-heads {model.kv_heads}", f"head-dim {model.head_dim}", f"vocab {model.vocab}",
            f"max-seq {model.max_seq}"]
    click.echo(f"model            {model.name} ({model.arch}, {model.norm}, {model.mlp}, {model.position} positions, "
               f"{'tied' if model.tied_embeddings else 'untied'} embeddings)")
    click.echo(f"dimensions       {', '.join(dims)}")
    if model.is_moe:
        shared = (f", shared experts' ffn {model.moe_shared_expert_intermediate_size}"
                  if model.moe_shared_expert_intermediate_size else "")
        click.echo(f"experts          {model.num_experts} routed, top-{model.moe_router_topk}, ffn {model.expert_ffn}"
                   f"{shared}; {sum(model.moe_layers())} of {model.layers} layers")
    if model.multi_latent_attention:
        click.echo(f"attention        multi-latent (q-lora {model.q_lora_rank}, kv-lora {model.kv_lora_rank})")
    click.echo(f"parameters       {counts.total:,} total")
    click.echo(f"active           {counts.active:,} per token with the input embedding, "
               f"{counts.active_without_embedding:,} without")
    click.echo(f"embedding        {counts.embedding:,} (input table)")
    if counts.mtp:
        click.echo(f"MTP modules      {counts.mtp:,} (in neither count)")
    click.echo(f"\n{CONVENTION}")


@click.command()
@model_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models(as_json: bool, **kw) -> None:
    """List model presets, or describe one model (--model NAME|config.json, with the dimension
    flags as overrides): its dimensions and its total and active parameters."""
    if any(kw.get(k) is not None for k in ("model", "arch", *MODEL_DIMENSIONS, *MODEL_SWITCHES)):
        from stage_cosim.model.params import parameter_counts

        model = resolve_model_options(kw)
        if as_json:
            click.echo(json.dumps({**model.to_dict(), "parameters": parameter_counts(model).to_dict()}, indent=1))
        else:
            _describe_one(model)
        return
    if as_json:
        click.echo(json.dumps({n: {**m.to_dict(), "params": m.param_count(), "active_params": m.active_param_count()}
                              for n, m in PRESETS.items()}, indent=1))
        return
    width = max(16, *(len(n) for n in PRESETS))
    click.echo(f"{'name':<{width}} {'arch':<6} {'layers':>6} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} "
               f"{'vocab':>7} {'params':>9} {'active':>8}  {'experts':<13} {'attention':<9} mixers")
    for name, m in PRESETS.items():
        experts = f"{m.num_experts} top-{m.moe_router_topk}" if m.is_moe else "-"
        attention = ("latent " if m.multi_latent_attention else "") + m.attention
        # the token mixers of a hybrid (or state-space) model, counted by kind
        kinds = Counter(m.layer_mixer(i) for i in range(m.layers))
        mixers = " + ".join(f"{'mlp-only' if k == 'none' else k} {c}" for k, c in kinds.items()) \
            if set(kinds) != {"attention"} else "attention"
        click.echo(f"{name:<{width}} {m.arch:<6} {m.layers:>6} {m.hidden:>6} {m.ffn:>6} {m.heads:>5} {m.kv_heads:>3} "
                   f"{m.vocab:>7} {m.param_count() / 1e9:>8.2f}B {m.active_param_count() / 1e9:>7.2f}B  "
                   f"{experts:<13} {attention:<9} {mixers}")
