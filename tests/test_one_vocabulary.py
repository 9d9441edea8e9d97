"""Each vocabulary has exactly one definition: a tuple of choices (recompute modes, token
dispatchers, trace formats ...) is defined once and imported everywhere else, so a new choice
cannot be added in one place and missed in another."""

from __future__ import annotations

import importlib
import pkgutil
from collections import defaultdict

import stage_cosim
import stage_cosim.adapters
import stage_cosim.hardware
import stage_cosim.search

# Equal tuples that are different vocabularies, and why they stay apart.
DIFFERENT_VOCABULARIES = {
    # the training precision and the KV cache's precision: both bf16 or fp8 today, chosen apart
    ("bf16", "fp8"): {"DTYPES", "KV_CACHE_DTYPES"},
    # Megatron-Core's fixed rank order (a fact about that framework, which its emitters check
    # against) and this tool's mesh axes and default order (chosen to equal it)
    ("tp", "cp", "dp", "pp"): {"DEFAULT_ORDER", "MESH_AXES", "DEFAULT_AXIS_ORDER"},
}


def _modules():
    for package in (stage_cosim, stage_cosim.adapters, stage_cosim.hardware, stage_cosim.search):
        yield package
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):
                yield importlib.import_module(info.name)


def test_every_choice_tuple_is_defined_once() -> None:
    definitions: dict[tuple[str, ...], dict[int, list[str]]] = defaultdict(dict)
    for module in _modules():
        for name, value in vars(module).items():
            if isinstance(value, tuple) and len(value) >= 2 and all(isinstance(v, str) for v in value):
                definitions[value].setdefault(id(value), []).append(f"{module.__name__}.{name}")
    duplicates = {}
    for value, objects in definitions.items():
        if len(objects) < 2:
            continue
        names = {where.rsplit(".", 1)[1] for places in objects.values() for where in places}
        if value in DIFFERENT_VOCABULARIES and names <= DIFFERENT_VOCABULARIES[value]:
            continue
        duplicates[value] = [places[0] for places in objects.values()]
    assert not duplicates, f"defined more than once (import one definition instead): {duplicates}"


def test_the_cli_help_is_the_config_docstrings() -> None:
    """Every ParallelConfig field is documented once, in its attribute docstring, and the flag
    of the same name shows that text as its help (flags, config files, JSON and docs share it)."""
    from dataclasses import fields

    from stage_cosim.cli.simulate_cmd import simulate
    from stage_cosim.fielddocs import field_docs
    from stage_cosim.parallel import ParallelConfig

    docs = field_docs(ParallelConfig)
    assert {f.name for f in fields(ParallelConfig)} == set(docs)
    flags = {p.name: p for p in simulate.params}
    shown = [name for name in docs if name in flags]
    assert len(shown) >= 30
    for name in shown:
        assert docs[name] in (flags[name].help or ""), name


def test_choice_tuples_are_their_literal_types() -> None:
    """A field typed with a Literal offers exactly its choices (the tuple is derived, not typed
    twice)."""
    from typing import get_args

    from stage_cosim.parallel import config

    assert config.CP_COMMS == get_args(config.CpComm) == ("p2p", "all-gather", "a2a", "a2a+p2p")
    assert config.RECOMPUTE == get_args(config.Recompute)
    assert config.FP8_RECIPES == get_args(config.Fp8Recipe)
