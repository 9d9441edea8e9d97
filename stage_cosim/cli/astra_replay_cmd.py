"""``stage-cosim astra-sim replay``: what ASTRA-sim's analytical binary prints, from its own flags."""

from __future__ import annotations

from pathlib import Path

import click

# The binary's other flags, at the only values this replay reproduces (its defaults).
_BINARY_DEFAULTS = {"num_queues_per_dim": ("num-queues-per-dim", 1), "comm_scale": ("comm-scale", 1.0),
                    "injection_scale": ("injection-scale", 1.0)}


@click.command("replay", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--workload-configuration", "workload", required=True, metavar="PREFIX",
              help="Traces PREFIX.<rank>.et, one per rank of the network.")
@click.option("--system-configuration", "system_file", required=True, type=click.Path(path_type=Path),
              help="system.json")
@click.option("--network-configuration", "network_file", required=True, type=click.Path(path_type=Path),
              help="The analytical network.yml")
@click.option("--remote-memory-configuration", "memory_file", required=True, type=click.Path(path_type=Path),
              help="memory.json (required, as by the binary)")
@click.option("--comm-group-configuration", "groups_file", default=None, metavar="FILE",
              help="Communicator groups (absent or 'empty': none).")
@click.option("--logging-folder", type=click.Path(path_type=Path), default=None,
              help="Also write the output lines to FOLDER/log.log, as the binary does.")
@click.option("--logging-configuration", default=None, hidden=True)
@click.option("--num-queues-per-dim", type=int, default=1, hidden=True)
@click.option("--comm-scale", type=float, default=1.0, hidden=True)
@click.option("--injection-scale", type=float, default=1.0, hidden=True)
@click.option("--rendezvous-protocol", default="false", hidden=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the binary's lines.")
@click.option("--full", is_flag=True, help="Replay every rank (no rank stands for its class).")
@click.pass_context
def replay_cmd(ctx: click.Context, workload: str, system_file: Path, network_file: Path, memory_file: Path,
               groups_file: str | None, logging_folder: Path | None, logging_configuration: str | None,
               rendezvous_protocol: str, as_json: bool, full: bool, **kw) -> None:
    """What ASTRA-sim's congestion-unaware analytical binary prints for these inputs, from the
    binary's own flags (--flag=value or --flag value); inputs the binary would abort or hang
    on are a one-line error."""
    import json
    import sys

    from stage_cosim.adapters.astra_sim.analytical import replay_files
    from stage_cosim.errors import UserError

    for key, (flag, default) in _BINARY_DEFAULTS.items():
        if kw[key] != default:
            raise UserError(flag, f"only the default {default:g} is reproduced, got {kw[key]:g}")
    if str(rendezvous_protocol).lower() not in ("false", "0"):
        raise UserError("rendezvous-protocol", "only the default (false) is reproduced")
    for extra in ctx.args:
        if extra.startswith("--"):
            click.echo(f"warning: ignoring {extra.split('=')[0]} (the binary ignores flags it does not know)", err=True)
    groups = None if groups_file in (None, "", "empty") else Path(groups_file)
    for flag, path in (("system-configuration", system_file), ("network-configuration", network_file),
                       ("remote-memory-configuration", memory_file), ("comm-group-configuration", groups)):
        if path is not None and not path.is_file():
            raise UserError(flag, f"{path}: no such file")
    if logging_folder is not None:                  # checked before the replay, written after it
        from stage_cosim.files import check_output, check_output_folder

        check_output_folder(logging_folder, "logging-folder", force=True)
        if logging_folder.is_dir():
            check_output(logging_folder / "log.log", "logging-folder")
    done, n = replay_files(workload, system_file, network_file, memory_file, groups, symmetric=not full)
    for warning in done.warnings:           # the binary prints the same results, then may abort
        click.echo(f"warning: {warning}", err=True)
    r = done.result()
    if as_json:
        click.echo(json.dumps({
            "finished_cycles": [r.finished_ns[k] for k in range(n)],
            "exposed_communication_cycles": [r.exposed_comm_ns[k] for k in range(n)],
            "compute_cycles": [r.gpu_time_ns[k] for k in range(n)],
            "communication_cycles": [r.comm_time_ns[k] for k in range(n)],
            "max_finished_cycles": r.step_time_ns,
        }))
        return
    lines = result_lines(done)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if logging_folder is not None:
        from stage_cosim.files import write_text_atomic

        from stage_cosim.files import reported_write

        with reported_write("logging-folder", logging_folder):     # the result is out already
            logging_folder.mkdir(parents=True, exist_ok=True)
            write_text_atomic(logging_folder / "log.log", text)


def result_lines(done) -> list[str]:  # noqa: ANN001
    """The binary's result lines (``sys[r] finished, …`` and its Wall / GPU / Comm time
    statistics), ranks in the order they finish."""
    import datetime

    r = done.result()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    has_compute = [any(k == 0 for k in ag.prog.kind) for ag in done.agents]
    has_comm = [any(k != 0 for k in ag.prog.kind) for ag in done.agents]
    out = []
    for k in sorted(r.finished_ns, key=lambda x: (r.finished_ns[x], x)):
        a = done.agent_of_rank(k)
        out.append(f"[{stamp}] [workload] [info] sys[{k}] finished, {r.finished_ns[k]} cycles, "
                   f"exposed communication {r.exposed_comm_ns[k]} cycles.")
        out.append(f"[{stamp}] [statistics] [info] sys[{k}], Wall time: {r.finished_ns[k]}")
        if has_compute[a]:
            out.append(f"[{stamp}] [statistics] [info] sys[{k}], GPU time: {r.gpu_time_ns[k]}")
        if has_comm[a]:
            out.append(f"[{stamp}] [statistics] [info] sys[{k}], Comm time: {r.comm_time_ns[k]}")
    return out
