"""``stage-cosim models``: the built-in presets with their dimensions and parameter counts."""

from __future__ import annotations

import json

import click

from stage_cosim.model import PRESETS


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models(as_json: bool) -> None:
    """List model presets."""
    if as_json:
        click.echo(json.dumps({n: {**m.to_dict(), "params": m.param_count(), "active_params": m.active_param_count()}
                              for n, m in PRESETS.items()}, indent=1))
        return
    click.echo(f"{'name':<16} {'arch':<6} {'layers':>6} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} "
               f"{'vocab':>7} {'params':>9} {'active':>8}  {'experts':<13} attention")
    for name, m in PRESETS.items():
        experts = f"{m.num_experts} top-{m.moe_router_topk}" if m.is_moe else "-"
        attention = ("latent " if m.multi_latent_attention else "") + m.attention
        click.echo(f"{name:<16} {m.arch:<6} {m.layers:>6} {m.hidden:>6} {m.ffn:>6} {m.heads:>5} {m.kv_heads:>3} "
                   f"{m.vocab:>7} {m.param_count() / 1e9:>8.2f}B {m.active_param_count() / 1e9:>7.2f}B  "
                   f"{experts:<13} {attention}")
