"""``stage-cosim validate PATH``: check a trace set for what would hang or abort ASTRA-sim."""

from __future__ import annotations

import math
from pathlib import Path

import click


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--comm-groups", type=click.Path(path_type=Path), default=None,
              help="The communicator-group file (default: comm_groups.json beside the traces or above).")
@click.option("--system-configuration", "system_file", type=click.Path(path_type=Path), default=None,
              help="ASTRA-sim's system.json to check against (default: the run directory's).")
@click.option("--network-configuration", "network_file", type=click.Path(path_type=Path), default=None,
              help="ASTRA-sim's network.yml to check against (default: the run directory's).")
@click.option("--limit", type=int, default=1000, show_default=True, help="Stop after this many problems.")
def validate(path: Path, comm_groups: Path | None, system_file: Path | None, network_file: Path | None,
             limit: int) -> int:
    """Check every rank's trace: ids, dependencies, cycles, types, attributes, collective order
    per communicator group, and send/receive matching; then, under ASTRA-sim's system and
    network files (an export's own, or the ones given; else a nominal network), every
    collective's phases and a replay for deadlocks of its one-operation-at-a-time rule.
    PATH is a trace directory or an exported run directory. Exit status 1 if anything is
    wrong."""
    from stage_cosim.adapters.astra_sim.config_files import read_network_yml, read_system_json
    from stage_cosim.adapters.astra_sim.analytical import check
    from stage_cosim.errors import UserError
    from stage_cosim.trace.location import locate, manifest_ranks, missing_files, read

    located = locate(path, comm_groups)
    if (system_file is None) != (network_file is None) and located.run_dir is None:
        raise UserError("system-configuration" if system_file is None else "network-configuration",
                        "give both the system and the network file (or neither)")
    run_dir = located.run_dir
    system_file = system_file or (run_dir / "system.json" if run_dir else None)
    network_file = network_file or (run_dir / "network.yml" if run_dir and (run_dir / "network.yml").exists() else None)
    system = read_system_json(system_file) if system_file and network_file else None
    dims = read_network_yml(network_file) if network_file else None
    # the world size is the run's (its network file, else its manifest), not the files present
    world, source = (math.prod(d.npus for d in dims), network_file) if dims is not None else \
        (manifest_ranks(located) or (None, None))
    missing = missing_files(located, world if world is not None else max(located.files) + 1)
    if missing:
        has = f"the run has {world:,} ranks, from {source}" if world is not None else \
            f"ranks up to {max(located.files)} are present"
        for path in missing[:limit]:
            click.echo(f"{path}: missing ({has}: one trace per network rank)")
        click.echo(f"{len(missing)} trace file{'s' if len(missing) > 1 else ''} missing", err=True)
        return 1
    dims = dims if system is not None else None
    ts = read(located)
    found = check(ts, system, dims, limit)
    problems = found.problems
    for p in problems:
        click.echo(str(p))
    if problems:
        click.echo(f"{len(problems)}{'+' if len(problems) >= limit else ''} problem(s) in {len(ts.class_of)} ranks",
                   err=True)
        return 1
    for w in found.warnings:
        click.echo(f"warning: {w}", err=True)
    against = f"{system_file} and {network_file}" if system is not None else \
        ("a nominal network (ring collectives, one split; give --system-configuration and "
         "--network-configuration to check split counts, implementations and endpoint delay against yours)")
    click.echo(f"ok: {len(ts.class_of)} ranks ({len(ts.classes)} distinct traces), {ts.node_count()} nodes, "
               f"{len(ts.groups or {})} communicator groups; no deadlock under {against}")
    return 0
