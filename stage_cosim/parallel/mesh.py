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
    consecutive ranks, inside one scale-up domain).

    ``splits`` names sub-axes: ``(sub, parent, size)`` makes ``sub`` the inner factor of
    ``parent`` (its coordinate is the parent's modulo ``size``), so groups along ``sub`` are
    blocks of ``size`` consecutive parent coordinates (hierarchical context parallelism)."""

    degrees: tuple[tuple[str, int], ...]   # (axis, degree), in ``order``
    order: tuple[str, ...]
    splits: tuple[tuple[str, str, int], ...] = ()

    @classmethod
    def build(cls, degrees: dict[str, int], order: tuple[str, ...],
              splits: tuple[tuple[str, str, int], ...] = ()) -> "DeviceMesh":
        require(set(order) == set(degrees), "axis-order", f"must name the axes {sorted(degrees)}")
        for sub, parent, size in splits:
            require(degrees[parent] % size == 0, parent, f"{sub} of size {size} must divide {parent} = {degrees[parent]}")
        return cls(tuple((a, degrees[a]) for a in order), tuple(order), tuple(splits))

    @cached_property
    def _fine(self) -> tuple[tuple[str, int, int], ...]:
        """(name, size, stride) of the independent factors, innermost first: the axes, a split
        axis replaced by its inner sub-axis and the rest of it (named ``parent~``)."""
        out, s = [], 1
        split = {parent: (sub, size) for sub, parent, size in self.splits}
        for axis, n in self.degrees:
            if axis in split:
                sub, size = split[axis]
                out += [(sub, size, s), (axis + "~", n // size, s * size)]
            else:
                out.append((axis, n, s))
            s *= n
        return tuple(out)

    def _parts(self, axes: str | tuple[str, ...]) -> set[str]:
        """The factors ``axes`` consist of."""
        axes = (axes,) if isinstance(axes, str) else axes
        split = {parent: sub for sub, parent, _ in self.splits}
        out: set[str] = set()
        for a in axes:
            out |= {split[a], a + "~"} if a in split else {a}
        return out

    @cached_property
    def size(self) -> dict[str, int]:
        out = dict(self.degrees)
        out.update({sub: size for sub, _, size in self.splits})
        return out

    @cached_property
    def stride(self) -> dict[str, int]:
        out, s = {}, 1
        for axis, n in self.degrees:
            out[axis] = s
            s *= n
        out.update({sub: out[parent] for sub, parent, _ in self.splits})
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
        parts = self._parts(axes)
        index, scale = 0, 1
        for name, n, stride in self._fine:
            if name not in parts:
                index += (rank // stride) % n * scale
                scale *= n
        return index

    def group_members(self, rank: int, axes: str | tuple[str, ...]) -> list[int]:
        """The ranks that share every coordinate of ``rank`` but those on ``axes`` (the
        first of ``axes`` varying fastest)."""
        axes = (axes,) if isinstance(axes, str) else axes
        fine = {name: (n, stride) for name, n, stride in self._fine}
        steps = [fine[p] for a in axes for p in sorted(self._parts(a), key=lambda p: fine[p][1])]
        members = [rank - sum((rank // stride) % n * stride for n, stride in steps)]
        for n, stride in steps:
            members = [m + i * stride for i in range(n) for m in members]
        return members

    def groups(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """Every group along ``axes``, in group-index order."""
        parts = self._parts(axes)
        others = [(n, stride) for name, n, stride in self._fine if name not in parts]
        out = []
        for g in range(self.world_size // prod(n for name, n, _ in self._fine if name in parts)):
            base = 0
            for n, stride in others:
                base += (g % n) * stride
                g //= n
            out.append(self.group_members(base, axes))
        return out
