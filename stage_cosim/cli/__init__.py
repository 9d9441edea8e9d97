"""The ``stage-cosim`` command: thin shells over the library functions.

User mistakes (a :class:`~stage_cosim.errors.UserError` or a bad flag) print one line,
``error: <parameter>: <rule>``, and exit with status 2 — never a traceback.
"""

from __future__ import annotations

import sys

import click

from stage_cosim import __version__
from stage_cosim.cli.lazy import LazyGroup
from stage_cosim.errors import UserError
from stage_cosim.adapters.astra_sim.run import AstraSimError
from stage_cosim.trace.chakra import TraceFormatError


COMMANDS = {
    "synth": "stage_cosim.cli.synth_cmd.synth",
    "simulate": "stage_cosim.cli.simulate_cmd.simulate",
    "optimize": "stage_cosim.cli.optimize_cmd.optimize",
    "explore": "stage_cosim.cli.explore_cmd.explore",
    "astra-sim": "stage_cosim.cli.astra_group.astra_sim",
    "validate": "stage_cosim.cli.validate_cmd.validate",
    "models": "stage_cosim.cli.models_cmd.models",
    "clusters": "stage_cosim.cli.clusters_cmd.clusters",
    "serve-sim": "stage_cosim.cli.serve_sim_cmd.serve_sim",
    "serve": "stage_cosim.cli.bridge_cmd.serve",
    "remote": "stage_cosim.cli.bridge_cmd.remote",
}


@click.group(cls=LazyGroup, lazy=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="stage-cosim")
def cli() -> None:
    """Synthesize, simulate and optimize distributed LLM training workloads."""


def main(argv: list[str] | None = None) -> int:
    try:
        rv = cli.main(args=argv, prog_name="stage-cosim", standalone_mode=False)
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except AstraSimError as exc:
        click.echo(f"error: astra-sim: {exc}", err=True)
        # a missing or unusable binary is the user's to fix; anything else is the simulator's failure
        return 2 if exc.kind in ("missing", "not-executable") else 1
    except TraceFormatError as exc:
        click.echo(f"error: traces: {exc}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        return 130
    except click.ClickException as exc:
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see '{exc.ctx.command_path} --help')"
        click.echo(f"error: {exc.format_message()}{hint}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    return rv if isinstance(rv, int) else 0


def run() -> None:
    sys.exit(main())
