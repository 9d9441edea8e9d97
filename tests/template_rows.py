"""Test helper: a pass template's rows by field name.

Synthesis keeps a pass template's rows (``role.templates[key].rows``) as plain tuples, the hot
loop's layout; tests read them through :class:`Row`, whose fields are named after the
:class:`~stage_cosim.schedule.nodes.Node` attributes each one becomes when the pass is placed
(``test_template_rows_read_as_the_nodes_they_become`` in test_fp8_validation.py checks this).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Row(NamedTuple):
    name: str
    type: str
    deps: tuple[int, ...]          # relative to the pass start; negative values are markers
    flops: int
    model_flops: int
    mem_bytes: int
    matmul: Any
    coll: Any
    comm_bytes: int
    group: str
    category: str
    phase: str
    block: str
    groups: int
    peer: int
    tag: int
    keys: int


def template_rows(role: Any, key: tuple) -> list[Row]:
    """The rows of ``role``'s pass template ``key`` ((chunk, phase)); a row of another length
    than :class:`Row`'s is an error, not a silently shifted field."""
    return [Row._make(r) for r in role.templates[key].rows]
