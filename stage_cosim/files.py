"""Reading users' files and writing ours, with the project's error and atomicity rules."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from stage_cosim.errors import UserError


def read_yaml(path: Path, parameter: str) -> Any:
    """A YAML file's content; a missing or malformed file is a one-line error naming ``parameter``."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(parameter, f"{path}: no such file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(parameter, f"{path}: not valid YAML ({exc.__class__.__name__})") from None


def save_figure(fig: Any, path: Path) -> None:
    """Save a matplotlib figure to a temporary file and rename it into place (and close it)."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
