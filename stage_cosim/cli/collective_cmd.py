"""``stage-cosim collective``: what nccl-tests would print for one collective on a cluster, by
the calibrated network model; ``--validate`` checks it against the shared nccl-tests rows."""

from __future__ import annotations

import json

import click

from stage_cosim.errors import UserError


@click.command()
@click.option("--cluster", default=None,
              help="Cluster preset, NAME:GPUS or a YAML file; the collective runs on its first --gpus ranks, "
                   "filling scale-up domains in order (a bare preset name is as many of its domains as they need).")
@click.option("--op", default=None,
              help="all-reduce, all-gather, reduce-scatter, all-to-all or broadcast (nccl-tests' all_reduce … too).")
@click.option("--gpus", type=int, default=None,
              help="Ranks in the collective (at least 2; inside one scale-up domain or whole domains). "
                   "Default: every GPU of the cluster.")
@click.option("--bytes", "sizes", default=None,
              help="Sizes, comma-separated: integers or with K, M, G (powers of 2, as nccl-tests' -b/-e), e.g. "
                   "8,1M,1G. nccl-tests' size: all-gather's whole output, reduce-scatter's whole input, every other "
                   "collective's buffer per rank.")
@click.option("--algorithm", default=None,
              help="auto (default: the fastest that can run of ring, tree, nvls and collnet, the rule simulate uses), "
                   "ring, tree "
                   "(double binary tree, all-reduce only), nvls (NVLink SHARP: all-reduce inside one NVSwitch domain "
                   "of Hopper or Blackwell GPUs) or collnet (all-reduce reduced in the scale-out switches, where the "
                   "cluster's scale_out.in_network_reduction is true).")
@click.option("--validate", is_flag=True,
              help="Instead: run every row of the shared nccl-tests file (stage_cosim/validation/data/nccl_busbw.csv) "
                   "the command can express on its preset, and print measured against predicted busbw, the error "
                   "per row and per system, and the rows it cannot express with the reason.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def collective(cluster: str | None, op: str | None, gpus: int | None, sizes: str | None, algorithm: str | None,
               validate: bool, as_json: bool) -> None:
    """What nccl-tests would print: time, algbw and busbw of one collective for each size, on
    the cluster's first --gpus ranks, by the calibrated network model (nccl-tests' definitions:
    algbw = size / time; busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
    reduce-scatter and all-to-all, 1 for broadcast)."""
    from stage_cosim.adapters.roofline import collectives as co

    if validate:
        given = [name for name, v in (("cluster", cluster), ("op", op), ("gpus", gpus), ("bytes", sizes),
                                      ("algorithm", algorithm)) if v is not None]
        if given:
            raise UserError("validate", f"runs the shared file's rows on their own presets; give it without --{given[0]}")
        from stage_cosim.validation.components import busbw_report, format_busbw_report

        report = busbw_report()
        click.echo(json.dumps(report, indent=1) if as_json else format_busbw_report(report))
        return
    for name, value in (("cluster", cluster), ("op", op), ("bytes", sizes)):
        if value is None:
            raise UserError(name, "is required (or give --validate)")
    name = co.parse_op(op)
    points = co.parse_sizes(sizes)
    algo = (algorithm or "auto").strip().lower()
    if algo not in co.ALGORITHMS:
        raise UserError("algorithm", f"unknown algorithm {algorithm!r} (known: {', '.join(co.ALGORITHMS)})")
    report = co.nccl_tests(co.cluster_for(cluster, gpus), name, gpus, points, algo)
    click.echo(json.dumps(report, indent=1) if as_json else co.format_table(report))
