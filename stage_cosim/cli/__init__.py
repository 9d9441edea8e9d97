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
    "compare": "stage_cosim.cli.compare_cmd.compare",
    "optimize": "stage_cosim.cli.optimize_cmd.optimize",
    "explore": "stage_cosim.cli.explore_cmd.explore",
    "astra-sim": "stage_cosim.cli.astra_group.astra_sim",
    "validate": "stage_cosim.cli.validate_cmd.validate",
    "models": "stage_cosim.cli.models_cmd.models",
    "clusters": "stage_cosim.cli.clusters_cmd.clusters",
    "collective": "stage_cosim.cli.collective_cmd.collective",
    "serve-sim": "stage_cosim.cli.serve_sim_cmd.serve_sim",
    "serve": "stage_cosim.cli.serve_cmd.serve",
    "remote": "stage_cosim.cli.remote_cmd.remote",
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
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.UsageError as exc:
        click.echo(f"error: {usage_error(exc)}", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    return rv if isinstance(rv, int) else 0


def _param_name(param: click.Parameter | None, fallback: str | None = None) -> str:
    """A parameter as the project names it: the flag without its dashes (``seq-len``), an
    argument by its name (``spec``)."""
    if param is not None:
        if isinstance(param, click.Option) and param.opts:
            return max(param.opts, key=len).lstrip("-")
        return (param.name or "argument").replace("_", "-")
    return (fallback or "arguments").lstrip("-")


def usage_error(exc: click.UsageError) -> str:
    """click's usage errors as ``<parameter>: <rule>`` (one line; no usage text, no pointer to
    --help), the form every other bad input takes."""
    if isinstance(exc, click.MissingParameter):
        return f"{_param_name(exc.param)}: is required"
    if isinstance(exc, click.BadParameter):
        rule = exc.message.rstrip(".")
        return f"{_param_name(exc.param, exc.param_hint if isinstance(exc.param_hint, str) else None)}: {rule}"
    if isinstance(exc, click.NoSuchOption):
        near = f" (did you mean {', '.join(exc.possibilities)}?)" if exc.possibilities else ""
        where = f" of '{exc.ctx.command_path}'" if exc.ctx is not None else ""
        return f"{exc.option_name}: no such option{where}{near}"
    if isinstance(exc, click.BadOptionUsage):
        rule = exc.message.rstrip(".")
        if rule.endswith("requires an argument"):
            rule = "needs a value"
        return f"{exc.option_name.lstrip('-')}: {rule}"
    msg = exc.format_message().rstrip(".")
    if msg.startswith("No such command"):
        names = ", ".join(cli.list_commands(exc.ctx)) if exc.ctx is not None else ""
        return f"command: {msg[0].lower()}{msg[1:]}" + (f" (commands: {names})" if names else "")
    if msg.startswith("Got unexpected extra argument"):
        return f"arguments: {msg[4].lower()}{msg[5:]}"
    return f"arguments: {msg[0].lower()}{msg[1:]}"


def run() -> None:
    sys.exit(main())
