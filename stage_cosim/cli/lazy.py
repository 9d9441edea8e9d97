"""Command groups whose subcommands are imported when used."""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """Subcommands imported when they are used (or listed), so that one command does not pay
    for importing every other (synthesis, the search, the bridge)."""

    def __init__(self, *args, lazy: dict[str, str], **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            from stage_cosim.cli.run_file import with_run_file

            module, attr = self.lazy[name].rsplit(".", 1)
            # every command takes a run file (--config), however it is reached
            self.add_command(with_run_file(getattr(importlib.import_module(module), attr)), name)
        return super().get_command(ctx, name)
