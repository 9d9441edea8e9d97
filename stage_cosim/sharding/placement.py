"""Placements of a tensor on one mesh axis, after PyTorch DTensor: Shard, Replicate, Partial.

``Shard`` names the dimension by its label (``Shard("s")``) rather than its index, so the
same placement means the same thing on every tensor that has that dimension.
A change of placement implies a collective (:func:`collective_for`); nothing else in the
project decides where collectives go.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Placement:
    """Base class of the three placements."""

    def is_shard(self, label: str | None = None) -> bool:
        return isinstance(self, Shard) and (label is None or self.label == label)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)


@dataclass(frozen=True)
class Shard(Placement):
    label: str

    def __repr__(self) -> str:
        return f"Shard({self.label})"


@dataclass(frozen=True)
class Replicate(Placement):
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a summand; the tensor is the sum over the axis."""

    def __repr__(self) -> str:
        return "Partial()"


REPLICATE = Replicate()
PARTIAL = Partial()


class Collective(str, Enum):
    """Collectives, named as Chakra names them (values are Chakra's CollectiveCommType)."""

    ALL_REDUCE = "ALL_REDUCE"
    ALL_GATHER = "ALL_GATHER"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    ALL_TO_ALL = "ALL_TO_ALL"

    @property
    def short(self) -> str:
        return {"ALL_REDUCE": "AR", "ALL_GATHER": "AG", "REDUCE_SCATTER": "RS", "ALL_TO_ALL": "A2A"}[self.value]


def collective_for(src: Placement, dst: Placement) -> Collective | None:
    """The collective that turns ``src`` into ``dst`` on one axis (None: local or nothing).

    partial -> replicate: all-reduce; partial -> shard: reduce-scatter;
    shard -> replicate: all-gather; shard on one label -> shard on another: all-to-all.
    replicate -> shard is a local slice and replicate -> partial keeps the data as it is.
    """
    if src == dst:
        return None
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return Collective.ALL_REDUCE
        if isinstance(dst, Shard):
            return Collective.REDUCE_SCATTER
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return Collective.ALL_GATHER
        if isinstance(dst, Shard):
            return Collective.ALL_TO_ALL
    if isinstance(src, Replicate) and isinstance(dst, (Shard, Partial)):
        return None
    raise ValueError(f"no collective turns {src} into {dst}")
