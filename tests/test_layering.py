"""The layers import downwards only, and nothing imports in a circle.

Every module of the installed package (``stage_cosim/`` and the folders ``adapters/``,
``hardware/``, ``search/`` that install under it) is parsed, and each import becomes an edge of
a module graph: module-level and function-level imports, ``if TYPE_CHECKING:`` ones, relative
imports resolved against the importing package, ``from package import name`` resolved to the
submodule where ``name`` is one (else to the package: its ``__init__`` and what it re-exports),
and what a module loads by name (``importlib.import_module``, a package ``__init__`` loading its
submodules on first use, a lazy command's ``"module.attribute"``). Then:

* no cycle among the imports that run (``if TYPE_CHECKING:`` ones never do: they let a data
  model name, in annotations only, the modules built on it);
* no module imports one of a layer above its own (:data:`LAYERS`), not even for annotations;
  e.g. the bridge's server never imports the command line (a server must not depend on its
  client's flags), and the native simulator never imports the ASTRA-sim package, which builds
  on it.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "stage_cosim"

# The layers, bottom to top: a module may import modules of its own layer or of a layer below,
# never above. An entry is a module, or a package with everything under it (the top-level
# package stands only for its own __init__, the version); a module belongs to its longest entry.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("utilities", (PACKAGE, "stage_cosim.errors", "stage_cosim.limits", "stage_cosim.files",
                   "stage_cosim.fielddocs", "stage_cosim.gc_pause")),
    ("hardware: GPUs, clusters, the process's memory figures", ("stage_cosim.hardware",)),
    ("model", ("stage_cosim.model",)),
    ("graph, parallel configuration, inference step", ("stage_cosim.graph", "stage_cosim.parallel",
                                                      "stage_cosim.inference")),
    ("sharding", ("stage_cosim.sharding",)),
    ("schedule: role graphs, memory accounting", ("stage_cosim.schedule",)),
    ("workload", ("stage_cosim.workload", "stage_cosim.process_memory")),
    ("what a workload is written as: traces, manifest, launch arguments",
     ("stage_cosim.trace", "stage_cosim.manifest", "stage_cosim.launch")),
    ("the native simulator", ("stage_cosim.adapters.roofline", "stage_cosim.result")),
    ("ASTRA-sim", ("stage_cosim.adapters.astra_sim",)),
    ("the simulator, either network model", ("stage_cosim.adapters",)),
    ("serving simulation, validation", ("stage_cosim.serving", "stage_cosim.validation")),
    ("search", ("stage_cosim.search",)),
    ("library interface", ("stage_cosim.api",)),
    ("gRPC bridge", ("stage_cosim.bridge",)),
    ("command line", ("stage_cosim.cli", "stage_cosim.__main__")),
)

# Imports of a layer above, each with why it is left. A stale entry fails the test.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    line: int
    name: str               # what was imported, as an absolute dotted name
    typing_only: bool       # inside ``if TYPE_CHECKING:``


def _folders() -> dict[str, str]:
    """Import package prefix -> folder, as setup.py maps them."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no FOLDERS")


@cache
def modules() -> dict[str, Path]:
    """Every module of the installed package -> its file."""
    out: dict[str, Path] = {}
    for prefix, folder in _folders().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((prefix, *parts))] = path
    return out


def _module_of(name: str) -> str | None:
    """The module that a dotted name is, or is an attribute of (None: not ours)."""
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _lazy_name(node: ast.Constant) -> str | None:
    """A string that names an attribute of one of our modules, as lazy loaders take it
    (``"stage_cosim.cli.synth_cmd.synth"``, ``"module:function"``); a bare module name (a logger's,
    ``python -m``'s, a data package's) is not loaded as code here."""
    if not isinstance(node.value, str) or not node.value.startswith(PACKAGE + "."):
        return None
    name = node.value.replace(":", ".")
    if not all(part.isidentifier() for part in name.split(".")):
        return None
    module = _module_of(name)
    return name if module is not None and module != name and name.rpartition(".")[0] == module else None


def imports_of(module: str) -> list[Import]:
    """Every import ``module`` makes, wherever it is in the file."""
    path = modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: list[Import] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # a submodule imported by name is that module; anything else comes from the package
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base for a in node.names]
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) and \
                (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.FormattedValue) \
                    and isinstance(arg.values[0].value, ast.Name) and arg.values[0].value.id == "__name__":
                # f"{__name__}.{name}": a package loading its own submodules on first use
                names = [m for m in modules() if m.rpartition(".")[0] == module]
        elif isinstance(node, ast.Constant):
            lazy = _lazy_name(node)
            names = [lazy] if lazy else []
        out += [Import(getattr(node, "lineno", 0), n, id(node) in typing_only) for n in names]
    return out


@cache
def import_graph() -> nx.DiGraph:
    """Module -> module it imports; each edge carries its imports (``imports``: Import list)."""
    g = nx.DiGraph()
    for module in modules():
        g.add_node(module)
        for imp in imports_of(module):
            target = _module_of(imp.name)
            if target is None or target == module:
                continue
            if not g.has_edge(module, target):
                g.add_edge(module, target, imports=[])
            g.edges[module, target]["imports"].append(imp)
    return g


def _where(a: str, b: str) -> str:
    imp = min(import_graph().edges[a, b]["imports"], key=lambda i: i.line)
    return f"{modules()[a].relative_to(ROOT)}:{imp.line} imports {imp.name}"


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if module == entry or (entry != PACKAGE and module.startswith(entry + ".")):
                if best is None or len(entry) > best[1]:
                    best = (i, len(entry))
    return None if best is None else best[0]


def test_the_import_graph_sees_every_kind_of_import() -> None:
    """The walk itself: relative, function-level, typing-only and lazy imports all become edges."""
    g = import_graph()
    assert len(g) > 100
    # function-level: Workload.memory imports the process memory inside the method
    assert g.has_edge("stage_cosim.workload", "stage_cosim.process_memory")
    # typing-only: the process memory names the Workload in annotations
    assert all(i.typing_only for i in g.edges["stage_cosim.process_memory", "stage_cosim.workload"]["imports"])
    # `from package import submodule`
    assert g.has_edge("stage_cosim.cli.remote_cmd", "stage_cosim.cli.synth_cmd")
    # a package __init__ re-exporting (the hardware package loads its submodules on first use)
    assert g.has_edge("stage_cosim.hardware", "stage_cosim.hardware.cluster")
    assert g.has_edge("stage_cosim.model", "stage_cosim.model.config")
    # the command line's subcommands, loaded by name
    assert g.has_edge("stage_cosim.cli", "stage_cosim.cli.synth_cmd")


def test_no_import_cycles() -> None:
    running = nx.DiGraph((a, b) for a, b, imports in import_graph().edges(data="imports")
                         if not all(i.typing_only for i in imports))
    cycles = list(itertools.islice(nx.simple_cycles(running), 20))
    shown = ["\n  ".join(_where(a, b) for a, b in zip(c, c[1:] + c[:1])) for c in sorted(cycles, key=len)]
    assert not cycles, "import cycles:\n" + "\n".join(f"* {' -> '.join(c + c[:1])}:\n  {s}"
                                                       for c, s in zip(sorted(cycles, key=len), shown))


def test_every_module_is_in_a_layer() -> None:
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (add them to the table): {unplaced}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    g = import_graph()
    missing = sorted(e for e in ALLOWED_UPWARD if not g.has_edge(*e))
    assert not missing, f"stale entries in ALLOWED_UPWARD (the import is gone: delete them): {missing}"
    upward = [f"{_where(a, b)} (layer {LAYERS[layer_of(b)][0]!r} is above {LAYERS[layer_of(a)][0]!r})"
              for a, b in sorted(g.edges) if layer_of(a) is not None and layer_of(b) is not None
              and layer_of(b) > layer_of(a) and (a, b) not in ALLOWED_UPWARD]
    assert not upward, "imports of a layer above:\n" + "\n".join(upward)


def _imported_by(folder: str) -> dict[str, list[str]]:
    """Module under ``folder`` (a package name) -> every module it imports."""
    g = import_graph()
    return {m: sorted(g.successors(m)) for m in g if m == folder or m.startswith(folder + ".")}


def test_the_bridge_never_imports_the_command_line() -> None:
    """A server must not depend on its client's flags."""
    imported = _imported_by("stage_cosim.bridge")
    assert len(imported) > 5
    offenders = {m: [t for t in ts if t == "stage_cosim.cli" or t.startswith("stage_cosim.cli.")]
                 for m, ts in imported.items()}
    assert not {m: ts for m, ts in offenders.items() if ts}


def test_the_simulator_never_imports_the_astra_sim_package() -> None:
    """The native simulator (adapters/roofline) is what the ASTRA-sim package builds on: none of
    its modules imports that package, not even inside a function (stage_cosim.adapters.simulate,
    which knows both, picks the astra network model)."""
    imported = _imported_by("stage_cosim.adapters.roofline")
    assert len(imported) > 5
    offenders = {m: [t for t in ts if t.startswith("stage_cosim.adapters.astra_sim")] for m, ts in imported.items()}
    assert not {m: ts for m, ts in offenders.items() if ts}
