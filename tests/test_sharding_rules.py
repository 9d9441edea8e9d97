"""Sharding flows through each op kind by the rule registered for it (stage_cosim.sharding.rules):
a new op kind is a rule, and the pass engine has no branches on op kinds."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

import stage_cosim.sharding.propagate as propagate
from stage_cosim.graph.ir import OpKind
from stage_cosim.sharding.rules import GENERIC, RULES, Rule, register, rule_for


def test_every_rule_is_for_an_op_kind() -> None:
    assert RULES and set(RULES) <= set(typing.get_args(OpKind))
    assert rule_for("pointwise") is GENERIC     # no rule of its own: the generic one


def test_an_op_kind_has_one_rule() -> None:
    before = dict(RULES)
    with pytest.raises(ValueError, match="already has a rule"):
        register("einsum")(Rule)
    assert RULES == before


def test_the_engine_does_not_branch_on_op_kinds() -> None:
    """The pass engine tests no op kind: the rules do (registered per kind), and so do the
    recomputation policies (registered per mode, one for every mode ParallelConfig accepts)."""
    from stage_cosim.parallel.config import RECOMPUTE
    from stage_cosim.sharding import recompute

    assert set(recompute._POLICIES) == set(RECOMPUTE)
    tree = ast.parse(Path(propagate.__file__).read_text())
    where = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                        and node.left.attr == "kind" and isinstance(node.left.value, ast.Name)
                        and node.left.value.id == "op"):
                    where.append(fn.name)
    assert where == []
