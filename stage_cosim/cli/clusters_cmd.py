"""``stage-cosim clusters``: the built-in cluster presets."""

from __future__ import annotations

import json

import click

from stage_cosim.hardware import CLUSTER_PRESETS, get_gpu


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def clusters(as_json: bool) -> None:
    """List cluster presets (use as --cluster NAME:GPUS)."""
    if as_json:
        click.echo(json.dumps(CLUSTER_PRESETS, indent=1))
        return
    click.echo(f"{'name':<12} {'gpu':<10} {'TFLOP/s':>8} {'HBM GiB':>8} {'HBM GB/s':>9} {'domain':>6} "
               f"{'scale-up GB/s':>13} {'scale-out GB/s':>14}")
    for name, p in CLUSTER_PRESETS.items():
        g = get_gpu(p["gpu"])
        click.echo(f"{name:<12} {g.name:<10} {g.bf16_tflops:>8.0f} {g.hbm_GiB:>8.0f} {g.hbm_GBps:>9.0f} "
                   f"{p['scale_up']['gpus_per_domain']:>6} {p['scale_up']['bandwidth_GBps']:>13.0f} "
                   f"{p['scale_out']['bandwidth_GBps']:>14.0f}")
    click.echo("\nbandwidths per GPU per direction in 10^9 B/s; --cluster NAME:GPUS or a YAML file with every field")
