"""``stage-cosim validate DIR``: check a trace set for what would hang or abort ASTRA-sim."""

from __future__ import annotations

from pathlib import Path

import click

from stage_cosim.trace.validate import load_trace_set, validate_trace_set


@click.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--limit", type=int, default=1000, show_default=True, help="Stop after this many problems.")
def validate(directory: Path, limit: int) -> int:
    """Check every rank's trace: ids, dependencies, cycles, types, attributes, collective order
    per communicator group, and send/receive matching. Exit status 1 if anything is wrong."""
    ranks, groups = load_trace_set(directory)
    problems = validate_trace_set(ranks, groups, limit=limit)
    nodes = sum(len(n) for n in ranks.values())
    for p in problems:
        click.echo(str(p))
    if problems:
        click.echo(f"{len(problems)}{'+' if len(problems) >= limit else ''} problem(s) in {len(ranks)} ranks", err=True)
        return 1
    click.echo(f"ok: {len(ranks)} ranks, {nodes} nodes, {len(groups or {})} communicator groups")
    return 0
