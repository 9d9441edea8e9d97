"""``stage-cosim astra-sim export``: a self-contained ASTRA-sim run directory."""

from __future__ import annotations

from pathlib import Path

import click

from stage_cosim.adapters.astra_sim.astra_system import OPTIMIZATIONS
from stage_cosim.adapters.astra_sim.layout import COMPUTE_MODES
from stage_cosim.cli.options import (
    cluster_option, inference_options, model_options, parallel_options, resolve_inference_options,
    resolve_model_options, resolve_parallel_options, warn_positions,
)

astra_options = [
    click.option("--compute", "compute_mode", type=click.Choice(COMPUTE_MODES), default="replay",
                 show_default=True, help="replay: node durations from our GPU model; roofline: the simulator's roofline."),
    click.option("--collective-implementation", "implementation", default="ring", show_default=True,
                 type=click.Choice(["ring", "direct", "halvingDoubling", "doubleBinaryTree"]),
                 help="Collective algorithm on every network dimension."),
    click.option("--dataset-splits", type=int, default=4, show_default=True, help="preferred-dataset-splits."),
    click.option("--active-chunks", type=int, default=1, show_default=True, help="active-chunks-per-dimension."),
    click.option("--collective-optimization", type=click.Choice(OPTIMIZATIONS), default="baseline",
                 show_default=True),
]


def with_astra_options(f):  # noqa: ANN001, ANN201
    for opt in reversed(astra_options):
        f = opt(f)
    return f


def settings_from(kw: dict):  # noqa: ANN201
    from stage_cosim.adapters.astra_sim.export import AstraSettings
    from stage_cosim.adapters.astra_sim.astra_system import MAX_DATASET_SPLITS
    from stage_cosim.errors import UserError

    splits, chunks = kw.pop("dataset_splits"), kw.pop("active_chunks")
    if splits < 1:
        raise UserError("dataset-splits", f"must be at least 1, got {splits} (0 crashes the simulator)")
    if splits > MAX_DATASET_SPLITS:
        raise UserError("dataset-splits", f"must be at most {MAX_DATASET_SPLITS}, got {splits} (each split is a "
                                          "chunk that every group member carries through every phase: more cannot "
                                          "be simulated in reasonable time)")
    if chunks < 1:
        raise UserError("active-chunks", f"must be at least 1, got {chunks}")
    return AstraSettings(implementation=kw.pop("implementation"), preferred_dataset_splits=splits,
                         active_chunks_per_dimension=chunks,
                         collective_optimization=kw.pop("collective_optimization"), given=_given())


# option name -> the AstraSettings field it sets ("compute": the compute mode)
_FIELDS = {"implementation": "implementation", "dataset_splits": "preferred_dataset_splits",
           "active_chunks": "active_chunks_per_dimension", "collective_optimization": "collective_optimization",
           "compute_mode": "compute"}


def _given() -> frozenset[str]:
    """The settings given on the command line (not left at their defaults)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return frozenset()
    return frozenset(f for name, f in _FIELDS.items()
                     if name in ctx.params and ctx.get_parameter_source(name) not in
                     (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP, None))


@click.command("export")
@model_options
@parallel_options
@inference_options
@cluster_option
@with_astra_options
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Run directory to create.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
def export_cmd(cluster: str, compute_mode: str, out: Path, force: bool, **kw) -> None:
    """Write traces, system.json, network.yml, memory.json and run.sh for ASTRA-sim."""
    from stage_cosim.adapters.astra_sim.export import export
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.workload import synthesize

    from stage_cosim.files import check_output_folder, reported_write

    settings = settings_from(kw)
    model = resolve_model_options(kw)
    inference = resolve_inference_options(kw)
    parallel = resolve_parallel_options(kw, cluster)
    check_output_folder(out, "out", force)          # before the work, not after it
    machine = resolve_cluster(cluster, parallel.world_size)
    w = synthesize(model, parallel, machine.gpu, inference=inference)
    with reported_write("out", out):
        manifest = export(w, machine, out, mode=compute_mode, settings=settings, force=force)
    click.echo(f"wrote an ASTRA-sim run directory for {manifest['ranks']} ranks to {out} "
               f"({manifest['trace_bytes'] / 2**20:.1f} MiB of traces, compute: {compute_mode})")
    click.echo(f"run it with: {out}/run.sh /path/to/AstraSim_Analytical_Congestion_Unaware")
    for warning in manifest.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    warn_positions(model, parallel, inference)       # as simulate warns: with the result, once
