"""DeviceMesh: named axes, their degrees, and the mapping from mesh coordinates to global ranks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod

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

    def group_index(self, rank: int, axes: str | tuple[str, ...]) -> int:
        """Which of the groups along ``axes`` holds ``rank`` (0 … world/group size − 1),
        numbering groups by the other coordinates in mesh order."""
        axes = (axes,) if isinstance(axes, str) else axes
        index, scale = 0, 1
        for axis, n in self.degrees:
            if axis not in axes:
                index += self.coord(rank, axis) * scale
                scale *= n
        return index

    def group_members(self, rank: int, axes: str | tuple[str, ...]) -> list[int]:
        """The ranks that share every coordinate of ``rank`` but those on ``axes`` (the
        first of ``axes`` varying fastest)."""
        axes = (axes,) if isinstance(axes, str) else axes
        members = [rank - sum(self.coord(rank, a) * self.stride[a] for a in axes)]
        for a in axes:
            step = self.stride[a]
            members = [m + i * step for i in range(self.size[a]) for m in members]
        return members

    def groups(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """Every group along ``axes``, in group-index order."""
        axes = (axes,) if isinstance(axes, str) else axes
        others = [(a, n) for a, n in self.degrees if a not in axes]
        out = []
        for g in range(self.world_size // prod(self.size[a] for a in axes)):
            base = 0
            for a, n in others:
                base += (g % n) * self.stride[a]
                g //= n
            out.append(self.group_members(base, axes))
        return out
