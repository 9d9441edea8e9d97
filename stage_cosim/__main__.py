"""``python -m stage_cosim`` is the ``stage-cosim`` command."""

from stage_cosim.cli import run

run()
