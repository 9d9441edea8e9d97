"""DeviceMesh: named axes, their degrees, and the mapping from mesh coordinates to global ranks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from stage_cosim.errors import require


@dataclass(frozen=True)
class DeviceMesh:
    """``order`` lists the axes innermost first: rank = sum(coord[a] * stride[a]), with the first
    axis varying fastest (so with the default order a tensor-parallel group is a run of
    consecutive ranks, inside one scale-up domain)."""

    degrees: tuple[tuple[str, int], ...]   # (axis, degree), in ``order``
    order: tuple[str, ...]

    @classmethod
    def build(cls, degrees: dict[str, int], order: tuple[str, ...]) -> "DeviceMesh":
        require(set(order) == set(degrees), "axis-order", f"must name the axes {sorted(degrees)}")
        return cls(tuple((a, degrees[a]) for a in order), tuple(order))

    @cached_property
    def size(self) -> dict[str, int]:
        return dict(self.degrees)

    @cached_property
    def stride(self) -> dict[str, int]:
        out, s = {}, 1
        for axis, n in self.degrees:
            out[axis] = s
            s *= n
        return out

    @property
    def world_size(self) -> int:
        n = 1
        for _, d in self.degrees:
            n *= d
        return n

    def coord(self, rank: int, axis: str) -> int:
        return (rank // self.stride[axis]) % self.size[axis]

    def coords(self, rank: int) -> dict[str, int]:
        return {a: self.coord(rank, a) for a in self.order}

    def rank(self, **coords: int) -> int:
        return sum(coords.get(a, 0) * self.stride[a] for a in self.order)

    def shift(self, rank: int, axis: str, delta: int) -> int:
        """The rank whose coordinate on ``axis`` is ``delta`` further (wrapping round)."""
        c = self.coord(rank, axis)
        return rank + (((c + delta) % self.size[axis]) - c) * self.stride[axis]

    def group_index(self, rank: int, axis: str) -> int:
        """Which of the groups along ``axis`` holds ``rank`` (0 … world/degree − 1), numbering
        groups by the other coordinates in mesh order."""
        below = rank % self.stride[axis]
        above = rank // (self.stride[axis] * self.size[axis])
        return below + above * self.stride[axis]

    def group_members(self, rank: int, axis: str) -> list[int]:
        base = rank - self.coord(rank, axis) * self.stride[axis]
        return [base + i * self.stride[axis] for i in range(self.size[axis])]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, in group-index order."""
        n = self.world_size // self.size[axis]
        stride, size = self.stride[axis], self.size[axis]
        out = []
        for g in range(n):
            below, above = g % stride, g // stride
            base = below + above * stride * size
            out.append([base + i * stride for i in range(size)])
        return out
