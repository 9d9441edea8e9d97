"""A search for a framework's launch (``optimize --emit``) searches exactly what that framework
launches: the space given to the search, against the emitters' own refusals point by point; the
search's answer as a launch; and what no point of the search changes, refused before it."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache

import pytest

from stage_cosim.cli.emit import launch_for, launch_of
from stage_cosim.cli.optimize_cmd import launchable_space, refuse_before_search
from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.launch import TARGETS
from stage_cosim.model import get_preset
from stage_cosim.search.space import Constraint, Dimension, SearchSpace, canonical, check, default_space

# (model, GPUs, sequence length, dimensions held at one value to keep the enumeration short:
# none that an emitter refuses by). Llama 3 8B at 16K tokens searches cp up to 4 and a2a+p2p
# with groups of 2 (NeMo's refusal); Mixtral 8x7B searches ep and expert-tp (torchtitan's).
CASES = {
    "llama3-8b": ("llama3-8b", 8, 16384, {"micro_batch": 1}),
    "mixtral-8x7b": ("mixtral-8x7b", 8, 4096, {"micro_batch": 1, "cp_comm": "p2p"}),
}


def _space(case: str) -> tuple[SearchSpace, object]:
    name, gpus, seq_len, held = CASES[case]
    cluster = resolve_cluster(f"dgx-h100:{gpus}")
    space = default_space(get_preset(name), cluster, 8, seq_len, precision={"dtype": "auto"})
    for dim, value in held.items():
        space = space.restricted(dim, value)
    return space, cluster


def _feasible(space: SearchSpace, cluster) -> dict[tuple, object]:  # noqa: ANN001
    """Each distinct feasible configuration of ``space``: canonical key -> ParallelConfig."""
    points = {}
    for p in space.points():
        c = canonical(space, p)
        points.setdefault(tuple(sorted(c.items())), c)
    return {k: par for k, p in points.items() if (par := check(space, p, cluster)[0]) is not None}


@cache
def _unrestricted(case: str) -> tuple[SearchSpace, object, dict[tuple, object]]:
    space, cluster = _space(case)
    return space, cluster, _feasible(space, cluster)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_space_searched_for_a_launch_is_what_the_framework_launches(case: str, target: str) -> None:
    """The feasible configurations of the space a search for ``target``'s launch is given are
    exactly those of the whole space that ``target``'s emitter writes (the emitter run on each,
    with the FP8 recipe the GPU resolves): none it would refuse, and none it writes left out.
    The whole space holds some it refuses, so the narrowing is what makes them equal."""
    space, cluster, every = _unrestricted(case)
    model = space.model
    launched = set()
    for key, par in every.items():
        try:
            launch_for(target, model, par, cluster.gpu)
        except UserError as exc:
            assert exc.parameter == "emit", exc
        else:
            launched.add(key)
    assert launched < set(every), f"{target} writes every configuration here: the test shows nothing"
    searched = set(_feasible(launchable_space(target, space), cluster))
    assert searched == launched, (f"searched, refused: {sorted(searched - launched)[:3]}; "
                                  f"launched, not searched: {sorted(launched - searched)[:3]}")


SEARCH = ("optimize", "--model", "llama3-8b", "--layers", "4", "--cluster", "dgx-h100:16", "--global-batch", "16",
          "--seq-len", "4096", "--budget", "12", "--quiet", "--json", "--top", "20")
MODEL = replace(get_preset("llama3-8b"), layers=4)


def _refused(target: str, entry: dict) -> bool:
    try:
        launch_of(target, MODEL, entry)
    except UserError:
        return True
    return False


@pytest.mark.parametrize("target", TARGETS)
def test_optimize_for_a_launch_answers_with_one(run_cli, target: str) -> None:
    code, out, err = run_cli(*SEARCH, "--emit", target)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["launch"] == launch_of(target, MODEL, doc["best"]).to_dict()
    assert doc["top"] and not [e for e in doc["top"] if _refused(target, e)]


def test_without_the_narrowing_the_same_search_answers_what_torchtitan_refuses(run_cli) -> None:
    """The search above with no launch to write ranks configurations torchtitan refuses (ZeRO 1,
    tp without sp ...): what --emit torchtitan's narrowing keeps out."""
    code, out, err = run_cli(*SEARCH)
    assert code == 0, err
    assert any(_refused("torchtitan", e) for e in json.loads(out)["top"])


@pytest.mark.parametrize("target, flags, says", [
    ("megatron", ("--model", "gptj-6b"), "Megatron-LM pretrain_gpt.py has no flag for gptj-6b's a parallel residual"),
    ("torchtitan", ("--model", "deepseek-v3"), "torchtitan has no multi-token prediction (deepseek-v3)"),
    ("torchtitan", ("--model", "llama3-8b", "--dtype", "fp8"), "torchtitan emission covers BF16 training"),
    ("nemo", ("--model", "llama3-8b", "--dtype", "auto", "--fp8-recipe", "rowwise"), "NeMo 2 has no rowwise FP8 recipe"),
    ("megatron", ("--model", "llama3-8b", "--dtype", "fp8", "--fp8-attention"),
     "Megatron-LM pretrain_gpt.py has no flag for FP8 attention"),
])
def test_what_no_searched_choice_changes_is_refused_before_the_search(run_cli, target: str, flags: tuple,
                                                                      says: str) -> None:
    code, out, err = run_cli("optimize", *flags, "--cluster", "dgx-h100:16", "--global-batch", "16", "--seq-len",
                             "1024", "--emit", target)
    assert (code, out) == (2, "")            # no report: nothing was searched
    assert err.startswith(f"error: emit: {says}") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("target, precision", [
    ("megatron", {"dtype": "fp8"}),
    ("nemo", {"dtype": "auto", "fp8_recipe": "blockwise"}),
    # torchtitan's search keeps BF16 only, where the FP8 options apply to no point
    ("torchtitan", {"dtype": "auto", "fp8_attention": True}),
])
def test_what_a_framework_launches_is_not_refused_before_the_search(target: str, precision: dict) -> None:
    space = default_space(get_preset("llama3-8b"), resolve_cluster("dgx-h100:16"), 16, 1024, precision=precision)
    refuse_before_search(target, space.model, space)


def test_a_narrowed_space_keeps_the_choices_given_and_rules_out_what_its_constraints_do() -> None:
    """By hand: tp (1, 2, 4, 8) narrowed to (8, 2, 4) keeps its own order (2, 4, 8); the rule "sp
    where tp > 1" rules out tp 2 without sp, and not tp 1 without sp (its canonical form: sp off
    wherever tp is 1, so tp 1 with sp is the same configuration); a dimension with no choice
    left is refused in one line."""
    cluster = resolve_cluster("dgx-h100:8")
    space = SearchSpace(get_preset("llama3-8b"), 8, 8, 1024,
                        (Dimension("tp", (1, 2, 4, 8)), Dimension("sp", (False, True))))
    assert space.narrowed({"tp": (8, 2, 4)}).dimensions[0].choices == (2, 4, 8)
    rule = Constraint("sp where tp > 1", lambda p: p["tp"] == 1 or p["sp"])
    narrowed = space.narrowed({}, [rule])
    assert check(narrowed, {"tp": 2, "sp": False}, cluster) == (None, "sp where tp > 1")
    assert check(narrowed, {"tp": 2, "sp": True}, cluster)[0] is not None
    assert check(narrowed, {"tp": 1, "sp": True}, cluster)[0] is not None
    assert check(space, {"tp": 2, "sp": False}, cluster)[0] is not None        # (the rule is the narrowed space's)
    with pytest.raises(UserError, match="keeps none of its choices") as exc:
        space.narrowed({"tp": (16,)})
    assert exc.value.parameter == "tp"
