"""mkdocs hook: let mkdocstrings read the package as it installs.

``stage_cosim`` is assembled from four folders (``setup.py``'s ``FOLDERS``): ``adapters/``,
``hardware/`` and ``search/`` install as ``stage_cosim.adapters``, ``stage_cosim.hardware`` and
``stage_cosim.search``. mkdocstrings reads source files where they lie, so this hook lays the
package out once per build in a temporary folder (copies of the four folders, nothing written
into the checkout) and points the Python handler there.
"""

from __future__ import annotations

import ast
import atexit
import re
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
# A Sphinx role in a rendered docstring: ":class:`~a.b.C`" arrives as ":class:<code>~a.b.C</code>".
SPHINX_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def folders() -> dict[str, str]:
    """``setup.py``'s ``FOLDERS`` (import package prefix -> folder), read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        names = [getattr(t, "id", None) for t in getattr(node, "targets", ())]
        if isinstance(node, ast.Assign) and "FOLDERS" in names:
            return ast.literal_eval(node.value)
    raise RuntimeError("setup.py defines no FOLDERS")


def lay_out(dest: Path) -> Path:
    """Copy every folder of the package to where it installs, under ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # outer packages first, so that a subpackage's folder lands inside its parent's copy
    for prefix, folder in sorted(folders().items(), key=lambda item: item[0].count(".")):
        shutil.copytree(ROOT / folder, dest.joinpath(*prefix.split(".")), ignore=ignore)
    return dest


_laid_out: list[Path] = []


def _remove_layouts() -> None:
    while _laid_out:
        shutil.rmtree(_laid_out.pop(), ignore_errors=True)


atexit.register(_remove_layouts)   # a build that fails before on_post_build


@event_priority(100)  # before mkdocstrings sets up its handlers
def on_config(config):  # noqa: ANN001, ANN201 (mkdocs' MkDocsConfig)
    dest = Path(tempfile.mkdtemp(prefix="stage-cosim-docs-"))
    _laid_out.append(dest)
    lay_out(dest)
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(dest)]
    return config


def on_post_build(config):  # noqa: ANN001, ANN201
    """Every page is rendered: the copy is no longer read (``mkdocs serve`` lays out a new one
    for each rebuild)."""
    _remove_layouts()


def _role(match: re.Match) -> str:
    name = match.group(2).rsplit(".", 1)[-1] if match.group(1) else match.group(2)
    return f"<code>{name}</code>"


def on_page_content(html, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """Docstrings use Sphinx roles; show them as the code they name (``~`` keeps the last part)."""
    return SPHINX_ROLE.sub(_role, html)
