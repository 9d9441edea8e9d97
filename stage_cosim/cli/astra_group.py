"""``stage-cosim astra-sim``: work with a user's ASTRA-sim build (export a run directory, or
replay one as the binary would). Subcommands load lazily: ``replay`` needs no synthesis."""

from __future__ import annotations

import click

from stage_cosim.cli.lazy import LazyGroup


@click.group("astra-sim", cls=LazyGroup, lazy={"export": "stage_cosim.cli.astra_cmd.export_cmd",
                                               "replay": "stage_cosim.cli.astra_replay_cmd.replay_cmd"})
def astra_sim() -> None:
    """Work with a user's ASTRA-sim build."""
