"""Each vocabulary has exactly one definition: a tuple of choices (recompute modes, token
dispatchers, trace formats ...) is defined once and imported everywhere else, so a new choice
cannot be added in one place and missed in another."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import textwrap
import typing
from collections import defaultdict
from pathlib import Path
from typing import Iterator

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
    # torchtitan's activation-checkpointing modes (its names: its "selective" is our per-op mode)
    # and the recompute modes the search plans (Megatron's names)
    ("none", "selective", "full"): {"TORCHTITAN_AC_MODES", "RECOMPUTE_SEARCHED"},
}

# Choices written out in place that are deliberately part of a vocabulary: (module, choices) ->
# why. A stale entry fails the test.
DELIBERATE_SUBSETS: dict[tuple[str, frozenset[str]], str] = {
    # the flag sets one algorithm for every network dimension; ASTRA-sim's one* implementations
    # are one logical ring over every rank instead (a system file may still name them)
    ("stage_cosim.cli.astra_cmd", frozenset({"ring", "direct", "halvingDoubling", "doubleBinaryTree"})):
        "per-dimension implementations only",
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


def _vocabularies() -> dict[frozenset[str], str]:
    """Every defined vocabulary (a module-level tuple of two or more strings, or a Literal type)
    -> a name it is defined under."""
    out: dict[frozenset[str], str] = {}
    for module in _modules():
        for name, value in vars(module).items():
            if typing.get_origin(value) is typing.Literal:
                value = typing.get_args(value)
            if isinstance(value, tuple) and len(value) >= 2 and all(isinstance(v, str) for v in value):
                out.setdefault(frozenset(value), f"{module.__name__}.{name}")
    return out


def _strings(node: ast.AST) -> frozenset[str] | None:
    """The strings of a list, tuple or set written out of two or more string constants."""
    if (isinstance(node, (ast.List, ast.Tuple, ast.Set)) and len(node.elts) >= 2
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)):
        return frozenset(e.value for e in node.elts)
    return None


def inline_choices(source: str) -> Iterator[tuple[int, frozenset[str], bool]]:
    """``(line, choices, offered)`` for each list of choices written out in place: the choices of
    a ``click.Choice`` (offered: True), and the right side of an ``in`` / ``not in`` test (a
    ``require(x in (...), ...)`` too)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) == "Choice":
                for arg in node.args[:1]:
                    if (choices := _strings(arg)) is not None:
                        yield node.lineno, choices, True
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and (choices := _strings(right)) is not None:
                    yield node.lineno, choices, False


def copies(source: str, vocabularies: dict[frozenset[str], str]) -> list[tuple[int, frozenset[str], str]]:
    """``(line, choices, vocabulary)`` for each list of choices in ``source`` that is a copy of a
    defined vocabulary: all of its choices (in any order), or, offered as a flag's choices, part
    of them. A membership test of part of a vocabulary is a property of a few of its members (the
    gated MLPs, the schedules with one chunk per stage), not a copy of it."""
    out = []
    for line, choices, offered in inline_choices(source):
        for vocabulary, name in vocabularies.items():
            if choices == vocabulary or (offered and choices < vocabulary):
                out.append((line, choices, name))
    return out


def test_no_vocabulary_is_written_out_again() -> None:
    """A list of choices written out in place (a flag's click.Choice, an ``x in ("a", "b")`` test)
    that equals, or as a flag's choices is part of, a defined vocabulary imports it instead."""
    vocabularies = _vocabularies()
    found, allowed = [], set()
    seen = set()
    for module in _modules():
        if module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for line, choices, name in copies(Path(module.__file__).read_text(), vocabularies):
            key = (module.__name__, choices)
            if key in DELIBERATE_SUBSETS:
                allowed.add(key)
            else:
                found.append(f"{module.__name__}:{line} {sorted(choices)} (import {name})")
    assert not found, "vocabularies written out again:\n" + "\n".join(found)
    stale = set(DELIBERATE_SUBSETS) - allowed
    assert not stale, f"allowed copies that are gone (remove their entries): {stale}"


def test_the_detector_finds_a_planted_copy() -> None:
    """The detector on a hand-written snippet: the copies it must find, and what it must pass."""
    vocabularies = {frozenset({"gpt", "llama"}): "Arch", frozenset({"chakra", "json"}): "FORMATS",
                    frozenset({"static", "dynamic"}): "FP8_ACTIVATION_SCALES",
                    frozenset({"ring", "tree", "nvls"}): "ALGORITHMS",
                    frozenset({"gelu", "swiglu", "geglu"}): "MLPS"}
    snippet = textwrap.dedent("""\
        import click
        arch = click.option("--arch", type=click.Choice(["llama", "gpt"]))
        def f(fmt, scale, mlp, algo):
            if fmt not in ("chakra", "json"):
                raise ValueError(fmt)
            require(scale in {"static", "dynamic"}, "scale", "bad")
            algo_flag = click.Choice(("ring", "tree"))
            gated = mlp in ("swiglu", "geglu")
            named = fmt in FORMATS
            other = fmt in ("csv", "json")
            return click.Choice(["gpt", "llama", "mamba"])
        """)
    found = {(line, name) for line, _, name in copies(snippet, vocabularies)}
    assert found == {(2, "Arch"), (4, "FORMATS"), (6, "FP8_ACTIVATION_SCALES"), (7, "ALGORITHMS")}


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


def test_the_model_flags_help_is_the_model_config_docstrings() -> None:
    """Every ModelConfig field with a flag is documented once, in its attribute docstring, and
    that flag shows the text as its help (the flag and the field share the name)."""
    from dataclasses import fields

    from stage_cosim.cli.options import MODEL_DIMENSIONS
    from stage_cosim.cli.simulate_cmd import simulate
    from stage_cosim.fielddocs import field_docs
    from stage_cosim.model import ModelConfig

    docs = field_docs(ModelConfig)
    flags = {p.name: p for p in simulate.params}
    with_flags = {f.name for f in fields(ModelConfig)} & set(flags)
    # the dimensions, the family and the four implementation switches, by hand
    assert with_flags == {*MODEL_DIMENSIONS, "arch", "attention", "cross_entropy", "causal_flops",
                          "moe_shared_expert_overlap"}
    assert with_flags <= set(docs)
    for name in with_flags:
        assert docs[name] and docs[name] in (flags[name].help or ""), name


def test_the_inference_flags_help_is_the_inference_config_docstrings() -> None:
    """Every InferenceConfig field with a flag (the step's phase, batch, lengths, precisions,
    attention dp, two-batch overlap: micro_batch shares ParallelConfig's flag) is documented in
    its attribute docstring, and that flag's help is the text."""
    from dataclasses import fields

    from stage_cosim.cli.simulate_cmd import simulate
    from stage_cosim.fielddocs import field_docs
    from stage_cosim.inference.config import InferenceConfig

    docs = field_docs(InferenceConfig)
    flags = {p.name: p for p in simulate.params}
    with_flags = {f.name for f in fields(InferenceConfig)} & set(flags) - {"micro_batch"}
    assert with_flags == {"phase", "batch", "input_len", "context_len", "kv_cache_dtype", "weight_dtype",
                          "fp8_activation_scale", "attention_dp", "two_batch_overlap"}
    for name in with_flags:
        assert docs[name] and flags[name].help == docs[name], name


def test_the_serve_sim_flags_help_is_the_serving_config_docstrings() -> None:
    """Every field of the serving dataclasses (the engine's settings, the latency targets, the
    generated request stream) is documented in its attribute docstring, and each serve-sim flag
    that sets one shows that text as its help, as do its parallel and inference flags."""
    from dataclasses import fields

    from stage_cosim.cli.serve_sim_cmd import serve_sim
    from stage_cosim.fielddocs import field_docs
    from stage_cosim.inference.config import InferenceConfig
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.serving.config import SLO, ServingConfig
    from stage_cosim.serving.requests import RequestStream

    for cls in (ServingConfig, SLO, RequestStream):
        docs = field_docs(cls)
        assert {f.name for f in fields(cls)} == set(docs), cls.__name__
        assert all(docs.values()), cls.__name__
    # flag (its parameter name) -> the field it sets, written out by hand: the request keys
    # stage_cosim.api maps them through (step_overhead -> step_overhead_s, slo_ttft -> ttft_s ...)
    serving = {"max_num_seqs": "max_num_seqs", "chunk_tokens": "chunk_tokens",
               "enable_chunked_prefill": "enable_chunked_prefill", "guaranteed_no_evict": "guaranteed_no_evict",
               "kv_block_size": "kv_block_size",
               "hbm_utilization": "hbm_utilization", "step_overhead": "step_overhead_s",
               "step_resolution": "step_resolution", "prefill_gpus": "prefill_gpus", "decode_gpus": "decode_gpus",
               "routing": "routing", "enable_prefix_caching": "enable_prefix_caching",
               "request_timeout": "request_timeout_s", "request_overhead": "request_overhead_s",
               "kv_offloading_size": "kv_offloading_size", "cuda_graph_sizes": "cuda_graph_sizes"}
    stream = {"rate": "rate", "num_requests": "num_requests", "input_len": "input_len", "output_len": "output_len",
              "lengths": "lengths", "length_spread": "spread", "seed": "seed", "prefix_len": "prefix_len",
              "prefix_groups": "prefix_groups"}
    slo = {"slo_ttft": "ttft_s", "slo_tpot": "tpot_s"}
    parallel = {name: name for name in ("tp", "pp", "dp", "ep", "expert_tp", "moe_token_dispatcher", "axis_order")}
    inference = {name: name for name in ("attention_dp", "weight_dtype", "kv_cache_dtype", "fp8_activation_scale",
                                         "two_batch_overlap")}
    # every ServingConfig field has a flag; every RequestStream field but none
    assert set(serving.values()) == {f.name for f in fields(ServingConfig)}
    assert set(stream.values()) == {f.name for f in fields(RequestStream)}
    assert set(slo.values()) == {f.name for f in fields(SLO)}
    flags = {p.name: p for p in serve_sim.params}
    for cls, mapping in ((ServingConfig, serving), (RequestStream, stream), (SLO, slo), (ParallelConfig, parallel),
                         (InferenceConfig, inference)):
        docs = field_docs(cls)
        for flag, name in mapping.items():
            help_text = " ".join((flags[flag].help or "").split())
            # the docstring's closing period may give way to what the flag adds (ParallelConfig's
            # "Tensor-parallel degree" is one instance's in a serving run)
            assert docs[name].rstrip(".") in help_text, (flag, name)
    # a hand-worked case: the flag adds what only the command says, the default it fills in
    assert flags["request_timeout"].help.endswith("Default 300; 0: no timeout.")
    assert flags["max_num_seqs"].help.endswith("Default: the engine's; 256 without --engine.")
    assert flags["step_resolution"].help.endswith("Default 1/32.")
