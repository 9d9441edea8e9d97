"""``--config run.yaml``: a command's flags kept in a file, by their names.

A run file is a YAML mapping of a command's flags to values, written as the flags are named
(``micro-batch``; ``micro_batch`` too, and the parameter name where it differs, as ``as_json``
for ``--json``). The values become the command's defaults (click's ``default_map``), so a flag
on the command line overrides the file. A key that is not a flag of the command, or bad YAML, is
one line naming it. Relative paths in the file are read from the working directory, as on the
command line.

Every command gets the option (:func:`with_run_file`); the lazily loaded groups add it as they
load each command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from stage_cosim.errors import UserError

NAME = "config"


def flag_names(command: click.Command) -> dict[str, tuple[click.Parameter, bool]]:
    """Each name a run file may use for a parameter of ``command``: (the parameter, whether
    the name negates it: ``no-sp`` for ``--sp/--no-sp``)."""
    keys: dict[str, tuple[click.Parameter, bool]] = {}
    for param in command.params:
        if param.name in (None, NAME, "help") or not param.expose_value:
            continue
        names = [(param.name, False)]
        if isinstance(param, click.Option):
            names += [(o.lstrip("-"), False) for o in param.opts if o.startswith("--")]
            names += [(o.lstrip("-"), True) for o in param.secondary_opts if o.startswith("--")]
        for name, negates in names:
            for spelling in (name, name.replace("-", "_"), name.replace("_", "-")):
                keys.setdefault(spelling, (param, negates))
    return keys


def _value(param: click.Parameter, key: str, value: Any, negates: bool) -> Any:
    """A file value as click takes a default: a list for a parameter of several values; a list
    for a single one joined by commas (``pp-layers: [10, 10, 12]``)."""
    if negates:
        if not isinstance(value, bool):
            raise UserError(NAME, f"{key}: takes true or false, got {value!r}")
        return not value
    several = getattr(param, "multiple", False) or param.nargs != 1
    if several:
        return list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (list, tuple, dict)) for v in value):
            raise UserError(NAME, f"{key}: takes one value, got {value!r}")
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        raise UserError(NAME, f"{key}: takes one value, not a mapping")
    return value


def load(ctx: click.Context, path: Path) -> dict[str, Any]:
    """The file's values by parameter name, for ``ctx.default_map``."""
    from stage_cosim.files import read_yaml

    doc = read_yaml(path, NAME)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise UserError(NAME, f"{path}: must be a mapping of flag names to values, got a {type(doc).__name__}")
    keys = flag_names(ctx.command)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in doc.items():
        name = str(key)
        if name not in keys:
            hint = " (a run file cannot name another)" if name == NAME else ""
            raise UserError(NAME, f"{path}: {name!r} is not a flag of '{ctx.command_path}'{hint}")
        param, negates = keys[name]
        if param.name in given:
            raise UserError(NAME, f"{path}: {name!r} sets what {given[param.name]!r} sets")
        given[param.name] = name
        if value is not None:
            out[param.name] = _value(param, name, value, negates)
    return out


def _apply(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    ctx.default_map = {**(ctx.default_map or {}), **load(ctx, value)}


def run_file_option() -> click.Option:
    return click.Option(
        [f"--{NAME}"], type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="RUN.yaml",
        is_eager=True, expose_value=False, callback=_apply,
        help="Read flags from a YAML mapping of flag names to values (micro-batch: 4); flags given on the "
             "command line override it.")


def with_run_file(command: click.Command) -> click.Command:
    """``command`` with --config (and, for a group, each of its commands: the lazily loaded
    ones get it as they load)."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            with_run_file(sub)
        return command
    if not any(p.name == NAME for p in command.params):
        command.params.insert(0, run_file_option())
    return command
