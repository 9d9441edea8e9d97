"""A search point as a key: what the searches' caches and rankings name a point by."""

from __future__ import annotations

from typing import Any

# (name, type, value) -> (name, the value written out): one object per distinct pair
_PAIRS: dict[tuple, tuple[str, str]] = {}
PAIRS_LIMIT = 4096          # (a space has some tens of distinct pairs: past this, emptied)


def point_key(point: dict[str, Any]) -> tuple:
    """The point's (name, value written out) pairs in name order. Each pair is one shared
    object (:func:`_pair`): a search keeps the key of every distinct point of its space (a
    Mixture-of-Experts space has millions), and each key held its own strings before."""
    return tuple(sorted(map(_pair, point.items())))


def _pair(item: tuple[str, Any]) -> tuple[str, str]:
    k, v = item
    # (the type too: True == 1, and their strings differ)
    memo = (k, type(v), v)
    try:
        hit = _PAIRS.get(memo)
    except TypeError:           # (an unhashable value: written out each time)
        return k, str(v)
    if hit is None:
        if len(_PAIRS) >= PAIRS_LIMIT:
            _PAIRS.clear()
        hit = _PAIRS[memo] = (k, str(v))
    return hit
