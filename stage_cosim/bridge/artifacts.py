"""A job's artifact index, read once and kept sorted: listings and downloads page from it.

The worker writes ``artifacts.json`` (path, size and SHA-256 of every file) when a job ends; a
large synthesis leaves hundreds of thousands of files, and a 17 MB index parsed again for every
ListArtifacts or Download would hold the server's loop for a third of a second each time. The
manager loads an index once, in a thread, and keeps the most recently used ones
(:class:`IndexCache`, bounded by their number of entries); a prefix is a contiguous range of the
sorted paths, found by bisection.
"""

from __future__ import annotations

import bisect
import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Iterable

# the highest code point: every path that starts with a prefix sorts before prefix + this
_TOP = "\U0010ffff"


@dataclass(frozen=True)
class ArtifactIndex:
    paths: tuple[str, ...]                  # sorted
    sizes: tuple[int, ...]
    digests: tuple[str, ...]

    @classmethod
    def of(cls, files: Iterable[dict[str, Any]]) -> "ArtifactIndex":
        rows = sorted((str(f["path"]), int(f["size"]), str(f["sha256"])) for f in files)
        return cls(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))

    @classmethod
    def load(cls, path: Path) -> "ArtifactIndex | None":
        """The index in ``path`` (a JSON list of {path, size, sha256}); None when there is none."""
        try:
            return cls.of(json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def span(self, prefix: str) -> tuple[int, int]:
        """The positions [lo, hi) of the paths that start with ``prefix``."""
        lo = bisect.bisect_left(self.paths, prefix)
        hi = bisect.bisect_left(self.paths, prefix + _TOP, lo)
        while hi < len(self.paths) and self.paths[hi].startswith(prefix):     # paths holding _TOP itself
            hi += 1
        return lo, hi

    def spec(self, i: int) -> dict[str, Any]:
        return {"path": self.paths[i], "size": self.sizes[i], "sha256": self.digests[i]}

    def find(self, path: str) -> dict[str, Any] | None:
        i = bisect.bisect_left(self.paths, path)
        return self.spec(i) if i < len(self.paths) and self.paths[i] == path else None


class IndexCache:
    """The most recently used indexes, at most ``max_entries`` file entries in all."""

    def __init__(self, max_entries: int = 2_000_000) -> None:
        self.max_entries = max_entries
        self._items: collections.OrderedDict[str, ArtifactIndex] = collections.OrderedDict()
        self._entries = 0

    def get(self, key: str) -> ArtifactIndex | None:
        index = self._items.get(key)
        if index is not None:
            self._items.move_to_end(key)
        return index

    def put(self, key: str, index: ArtifactIndex) -> None:
        self.drop(key)
        self._items[key] = index
        self._entries += len(index)
        while self._entries > self.max_entries and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._entries -= len(old)

    def drop(self, key: str) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._entries -= len(old)


class PageCache:
    """Listing pages already built, most recently used kept, at most ``max_bytes`` of messages.

    Building a page of 1,000 files takes milliseconds of the event loop; a client that lists the
    same page in a loop gets the one built before. A page is kept with the index it came from:
    once that index is dropped (its job's artifacts evicted) the page is never answered again."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[Hashable, tuple[ArtifactIndex, Any, int]] = collections.OrderedDict()
        self._bytes = 0

    def get(self, key: Hashable, index: ArtifactIndex) -> Any | None:
        item = self._items.get(key)
        if item is None or item[0] is not index:
            return None
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: Hashable, index: ArtifactIndex, page: Any, size: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old[2]
        if size > self.max_bytes:
            return
        self._items[key] = (index, page, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, _, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped
