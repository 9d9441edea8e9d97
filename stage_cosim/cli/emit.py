"""``--emit megatron|nemo|torchtitan``: a configuration as launch arguments, after the report."""

from __future__ import annotations

from typing import Any

import click

from stage_cosim.errors import UserError
from stage_cosim.launch import TARGETS, Launch, emit

emit_option = click.option(
    "--emit", "emit", type=click.Choice(TARGETS), default=None,
    help="Also print the configuration as launch arguments: Megatron-LM pretrain_gpt.py flags, NeMo 2 recipe "
         "overrides, or torchtitan TOML keys (what a framework cannot express is refused in one line).")


def launch_of(target: str, model: Any, result: dict[str, Any]) -> Launch:
    """The launch arguments of a simulated configuration (a result's ``to_dict()``, or a search
    entry): its parallel configuration, and the FP8 recipe its GPU resolved."""
    from stage_cosim.api import parallel_of

    parallel = parallel_of(result["config"]["parallel"])
    return emit(target, model, parallel, fp8_recipe=(result.get("precision") or {}).get("recipe"))


def try_launch(target: str | None, model: Any, result: dict[str, Any] | None) -> tuple[Launch | None, UserError | None]:
    """(the launch, None), or (None, the refusal) to raise once the report is out: the
    search's answer is not lost because a framework cannot express it."""
    if target is None or result is None:
        return None, None
    try:
        return launch_of(target, model, result), None
    except UserError as exc:
        return None, exc


def print_launch(launch: Launch | None) -> None:
    if launch is not None:
        click.echo("")
        click.echo(launch.text())


def launch_for(target: str, model: Any, parallel: Any, gpu: Any) -> Launch:
    """The launch arguments of a configuration about to be simulated on ``gpu`` (which decides
    the FP8 recipe the configuration leaves to it)."""
    recipe = None
    if parallel.dtype == "fp8":
        from stage_cosim.graph.precision import resolve_precision

        recipe = resolve_precision(parallel, gpu).recipe
    return emit(target, model, parallel, fp8_recipe=recipe)
