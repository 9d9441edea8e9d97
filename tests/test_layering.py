"""The layers import downwards only: the bridge's server side never imports the command line
(a server must not depend on its client's flags)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_bridge_never_imports_the_command_line() -> None:
    offenders = {p.name: sorted(m for m in _imports(p) if m.startswith("stage_cosim.cli"))
                 for p in (ROOT / "stage_cosim" / "bridge").rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}
