"""Path safety: every path a client names resolves inside one directory the server owns.

Clients name files when they upload a trace set and when they download artifacts. A name is a
relative, '/'-separated path; it may not be absolute, contain '..', '.', empty parts, a
backslash, control characters or a part over 255 bytes, and its resolved location — symlinks followed — must stay
inside the root. Checking the text first gives a clear error; checking the resolved path too
catches a symlink planted inside the root that points out of it.
"""

from __future__ import annotations

import os
from pathlib import Path

from stage_cosim.errors import UserError

MAX_PATH_CHARS = 1024
MAX_DEPTH = 16
MAX_PART_BYTES = 255               # a file name's limit on common file systems (NAME_MAX)


def check_relative(name: str, field: str = "path") -> str:
    """``name`` if it is a safe relative path, else a UserError naming ``field``."""
    if not isinstance(name, str) or not name:
        raise UserError(field, "must be a non-empty relative path")
    if len(name) > MAX_PATH_CHARS:
        raise UserError(field, f"is longer than {MAX_PATH_CHARS} characters")
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        raise UserError(field, "contains control characters")
    if "\\" in name or ":" in name.split("/", 1)[0]:
        raise UserError(field, f"must use '/' separators and no drive, got {name!r}")
    if name.startswith("/"):
        raise UserError(field, f"must be relative, got {name!r}")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UserError(field, f"may not contain '.', '..' or empty parts, got {name!r}")
    if len(parts) > MAX_DEPTH:
        raise UserError(field, f"is nested deeper than {MAX_DEPTH} levels")
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES for p in parts):
        raise UserError(field, f"has a file or folder name longer than {MAX_PART_BYTES} bytes")
    return name


def resolve_inside(root: Path, name: str, field: str = "path") -> Path:
    """The path ``root/name``, refusing anything that lands outside ``root`` (symlinks included)."""
    check_relative(name, field)
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / name))
    if target != base and base not in target.parents:
        raise UserError(field, f"{name!r} leads outside its directory")
    return target


def walk_files(root: Path) -> list[str]:
    """Every regular file under ``root`` as a sorted relative '/' path; symlinks are skipped."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) / d).is_symlink())
        for f in filenames:
            p = Path(dirpath) / f
            if p.is_file() and not p.is_symlink():
                out.append((rel / f).as_posix())
    return sorted(out)


def disk_usage(root: Path) -> int:
    """Bytes of the regular files under ``root`` (their sizes; symlinks not followed, 0 when
    ``root`` is gone). Iterative, with os.scandir: one stat per entry it already has."""
    total = 0
    stack = [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:          # removed while we looked: nothing to count
                continue
    return total
