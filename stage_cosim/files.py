"""Reading users' files and writing ours, with the project's error and atomicity rules.

A process that serves other people's requests (the gRPC bridge) must never open a file a request
names: there a name is a preset or nothing. :func:`without_local_files` (for a block of code) and
:func:`forbid_local_files` (for a whole process) switch the readers that take a user's path —
the model, cluster and YAML readers — to presets only; they then refuse a name before touching the
file system, so a request can neither read a file nor learn whether one exists.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import yaml

from stage_cosim.errors import UserError

_local_files = contextvars.ContextVar("stage_cosim_local_files", default=True)
_process_reads_local_files = True


def local_files_allowed() -> bool:
    """Whether a user's path may be opened here (False inside a server's request handling)."""
    return _process_reads_local_files and _local_files.get()


@contextlib.contextmanager
def without_local_files() -> Iterator[None]:
    """Within the block (this thread or task), names are presets only: no file is opened."""
    token = _local_files.set(False)
    try:
        yield
    finally:
        _local_files.reset(token)


def forbid_local_files() -> None:
    """For the rest of this process, names are presets only (a server's worker processes)."""
    global _process_reads_local_files
    _process_reads_local_files = False


def refuse_local_file(parameter: str, name: str, instead: str = "send the content instead") -> None:
    """Raise the one error for a name that is not a preset where files are not read."""
    raise UserError(parameter, f"{name!r} is not a preset, and no file a request names is read here: {instead}")


def read_yaml(path: Path, parameter: str) -> Any:
    """A YAML file's content; a missing or malformed file is a one-line error naming ``parameter``."""
    if not local_files_allowed():
        refuse_local_file(parameter, str(path))
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(parameter, f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise UserError(parameter, f"{path}: not a text file") from None
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


FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def _writable(folder: Path) -> bool:
    """Whether a file can be created in ``folder``: tried, since permission bits do not tell
    (a privileged user, a read-only or virtual file system)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_output(path: Path | None, parameter: str, suffixes: tuple[str, ...] | None = None) -> None:
    """Refuse an output path that cannot be written, before any work is done: its folder must
    exist and be writable, it must not be a folder, and (``suffixes``) its name must end in one."""
    if path is None:
        return
    path = Path(path)
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise UserError(parameter, f"{path}: the name must end in {', '.join(suffixes)}")
    if path.is_dir():
        raise UserError(parameter, f"{path} is a folder")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(parameter, f"{folder}: no such folder")
    if not _writable(folder):
        raise UserError(parameter, f"{folder}: not writable")


def check_output_folder(path: Path, parameter: str, force: bool = False) -> None:
    """Refuse an output folder that cannot be made, before any work is done: a file in its
    place, a non-empty folder (unless ``force``), or a nearest existing parent that is not a
    writable folder (missing parents are created)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(parameter, f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise UserError(parameter, f"{path} exists and is not empty (use --force to replace it)")
    parent = path.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(parameter, f"{parent} is not a folder")
    if not _writable(parent):
        raise UserError(parameter, f"{parent}: not writable")


@contextlib.contextmanager
def reported_write(parameter: str, path: Path) -> Iterator[None]:
    """Writing an output after the result has been shown: a failure (the disk filled, the
    folder went away) is the one-line error naming the output, never a traceback."""
    try:
        yield
    except OSError as exc:
        raise UserError(parameter, f"{path}: could not be written ({exc.strerror or exc})") from None
    except ValueError as exc:         # matplotlib: a format it cannot write
        raise UserError(parameter, f"{path}: could not be written ({exc})") from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
