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



def test_the_simulator_never_imports_the_astra_sim_package() -> None:
    """The native simulator (adapters/roofline) is what the ASTRA-sim package builds on: none of
    its modules imports that package, not even inside a function (stage_cosim.adapters.simulate,
    which knows both, picks the astra network model)."""
    package = "stage_cosim.adapters.roofline"
    modules = sorted((ROOT / "adapters" / "roofline").rglob("*.py"))
    assert len(modules) > 5
    offenders = {}
    for path in modules:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:      # relative: from the package's own position
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}".rstrip(".")
                names.update(f"{base}.{a.name}" for a in node.names)    # a module imported by name too
        bad = sorted(n for n in names if (n + ".").startswith("stage_cosim.adapters.astra_sim."))
        if bad:
            offenders[path.name] = bad
    assert not offenders
