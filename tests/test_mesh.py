"""Rank mapping and communicator groups over one or several mesh axes, worked by hand."""

from __future__ import annotations

import pytest

from stage_cosim.parallel.axes import AXES, BLOCK_AXES, MESHES, group_size, resolve_group
from stage_cosim.parallel.mesh import DeviceMesh


@pytest.fixture
def mesh() -> DeviceMesh:
    # rank = tp + 2 * dp + 6 * pp
    return DeviceMesh.build({"tp": 2, "dp": 3, "pp": 2}, ("tp", "dp", "pp"))


def test_single_axis_groups(mesh: DeviceMesh) -> None:
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert mesh.groups("dp") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert mesh.groups("pp") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert [mesh.group_index(r, "dp") for r in range(12)] == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    assert mesh.group_members(9, "dp") == [7, 9, 11]


def test_groups_over_several_axes(mesh: DeviceMesh) -> None:
    # tp and dp together: every rank of a pipeline stage, tp fastest
    assert mesh.groups(("tp", "dp")) == [list(range(6)), list(range(6, 12))]
    assert mesh.group_members(9, ("dp", "tp")) == [6, 8, 10, 7, 9, 11]
    assert [mesh.group_index(r, ("tp", "dp")) for r in (0, 5, 6, 11)] == [0, 0, 1, 1]
    assert mesh.groups(("tp", "pp")) == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]


def test_groups_follow_the_axis_order() -> None:
    m = DeviceMesh.build({"tp": 2, "dp": 3, "pp": 2}, ("dp", "pp", "tp"))   # rank = dp + 3 pp + 6 tp
    assert m.groups("tp") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert m.groups("dp") == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    for axes in ("tp", "dp", "pp", ("tp", "dp")):
        groups = m.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(12))     # a partition
        for i, g in enumerate(groups):
            assert all(m.group_index(r, axes) == i and m.group_members(r, axes) == g for r in g)


def test_degree_one_axes_drop_out_of_a_group() -> None:
    assert resolve_group(("dp",), {"dp": 4}) == "dp"
    assert resolve_group(("dp",), {"dp": 1}) is None
    assert resolve_group(("tp", "dp"), {"tp": 1, "dp": 8}) == "dp"
    assert group_size("embedding", {"pp": 8}) == 2
    assert group_size("dp", {"dp": 8}) == 8


def test_every_block_axis_is_on_a_mesh() -> None:
    for axis in AXES:
        assert axis.name in MESHES[axis.mesh]
    assert "pp" not in BLOCK_AXES   # the pipeline splits layers, not tensors
