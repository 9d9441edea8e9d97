"""The keys a rank's decoding requests read in a chunked-attention layer, kept as counts.

A decoding request's token at cached count ``n`` (the new token is the ``n + 1``-th) reads the
``n mod c + 1`` keys of its own ``c``-token chunk: a sawtooth, not the capped line of a
sliding window. With ``g`` the rank's decode steps so far, a request that joined at ``g0``
with ``c0`` cached tokens reads ``(x + g) mod c + 1`` keys, ``x = (c0 - g0) mod c``. Summed
over the requests that is ``sum x + n (g mod c + 1) - c * #{x >= c - g mod c}``: a running
sum and a count of residues at or above a threshold, kept in a Fenwick tree over the
residues, so a step costs O(log c) whatever the batch size.
"""

from __future__ import annotations


class ChunkReads:
    """Residues ``x = (c0 - g0) mod c`` of the decoding requests of one rank, for one chunk
    length ``c``: what their tokens read at decode step ``g``."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.n = 0
        self.total = 0
        self._tree = [0] * (chunk + 1)

    def _add(self, x: int, k: int) -> None:
        self.n += k
        self.total += k * x
        i = x + 1
        while i <= self.chunk:
            self._tree[i] += k
            i += i & -i

    def _below(self, x: int) -> int:
        """Requests whose residue is below ``x``."""
        out, i = 0, x
        while i > 0:
            out += self._tree[i]
            i -= i & -i
        return out

    def join(self, c0: int, g0: int) -> None:
        self._add((c0 - g0) % self.chunk, 1)

    def leave(self, c0: int, g0: int) -> None:
        self._add((c0 - g0) % self.chunk, -1)

    def reads(self, g: int) -> int:
        """Keys the requests' tokens read at decode step ``g`` (each its own included)."""
        if not self.n:
            return 0
        shift = g % self.chunk
        wrapped = self.n - self._below(self.chunk - shift)
        return self.total + self.n * (shift + 1) - self.chunk * wrapped
