"""Automatic prefix caching, as vLLM does it: KV-cache blocks identified by their tokens.

A request's prompt is described by *hash ids*: id ``k`` names the tokens ``[k·H, (k+1)·H)`` of
the prompt (H: the stream's hash-block size, 512 in Mooncake traces; tokens past the last id
are the request's own). The engine's KV block ``j`` (``kv_block_size`` tokens) is identified by
the chain of everything before it and its own content — the ids it overlaps and where it starts
in the first of them — so two prompts share block ``j`` exactly when they share every token up
to its end, as vLLM's chained block hashes do. Only full blocks are cached.

A rank's cache keeps, per block identity, the number of running requests referencing it; a
block no request references stays cached (a later prompt may hit it) but is free memory: it is
evicted, least recently released first, when an allocation needs its room.

With KV offload (vLLM's ``--kv-offloading-size``, LMCache's CPU buffer) a second tier in host
memory, :class:`HostTier`, takes the blocks the GPU cache evicts, least recently used out first
when it is full; a prompt whose next blocks miss on the GPU but sit in host memory has them
copied back (host to device) instead of prefilled again. The tier is exclusive: a block loaded
back leaves it, and returns when the GPU evicts it again.
"""

from __future__ import annotations

from collections import OrderedDict

#: Tokens per hash id in Mooncake traces (and the default for ``hash_ids`` in trace files).
MOONCAKE_HASH_BLOCK = 512


def block_keys(hash_ids: tuple[int, ...], hash_block: int, input_len: int, block_size: int) -> list[int]:
    """Identities of the engine blocks a prompt fills entirely with tokens its hash ids name."""
    covered = min(input_len, len(hash_ids) * hash_block)
    keys: list[int] = []
    prev = 0
    for j in range(covered // block_size):
        start, end = j * block_size, (j + 1) * block_size - 1
        content = tuple(hash_ids[k] for k in range(start // hash_block, end // hash_block + 1))
        prev = hash((prev, content, start % hash_block))
        keys.append(prev)
    return keys


class PrefixCache:
    """One rank's cached blocks: reference counts, and the unreferenced ones in LRU order."""

    def __init__(self, block_bytes: float) -> None:
        self.block_bytes = block_bytes
        self.refs: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict()     # unreferenced, oldest release first
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.evicted = 0

    @property
    def free_bytes(self) -> float:
        return len(self.free) * self.block_bytes

    def match(self, keys: list[int], limit: int) -> int:
        """Leading blocks of ``keys`` (at most ``limit``) held in the cache."""
        n = 0
        refs = self.refs
        while n < limit and keys[n] in refs:
            n += 1
        return n

    def acquire(self, keys: list[int]) -> int:
        """Reference ``keys`` (all cached); returns how many were unreferenced (their bytes move
        from the cache's free room to the used memory)."""
        revived = 0
        for k in keys:
            if self.refs[k] == 0:
                del self.free[k]
                revived += 1
            self.refs[k] += 1
        return revived

    def release(self, keys: list[int]) -> int:
        """Drop a reference to each of ``keys``; returns how many no request references now."""
        freed = 0
        for k in keys:
            n = self.refs[k] - 1
            self.refs[k] = n
            if n == 0:
                self.free[k] = None
                freed += 1
        return freed

    def insert(self, key: int) -> bool:
        """Register a block a request just filled (referenced by it); False if the identity is
        already cached (the request's copy stays its own)."""
        if key in self.refs:
            return False
        self.refs[key] = 1
        return True

    def evict(self, nbytes: float, host: "HostTier | None" = None) -> float:
        """Evict least recently released blocks until ``nbytes`` are freed or none is left
        (into ``host``, the offload tier, where there is one); returns the bytes freed."""
        freed = 0.0
        while freed < nbytes and self.free:
            k, _ = self.free.popitem(last=False)
            del self.refs[k]
            freed += self.block_bytes
            self.evicted += 1
            if host is not None:
                host.put(k)
        return freed


class HostTier:
    """One rank's offloaded blocks in host memory: at most ``capacity`` of them, least recently
    used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()   # least recently used first
        self.stored = 0          # blocks copied in (device to host)
        self.loaded = 0          # blocks copied back (host to device)
        self.dropped = 0         # blocks pushed out of host memory too
        self.hit_tokens = 0      # prompt tokens of admitted requests served from here

    def put(self, key: int) -> None:
        """A block the GPU cache evicts, copied here (the oldest dropped if full)."""
        blocks = self.blocks
        if key in blocks:
            blocks.move_to_end(key)
            return
        if len(blocks) >= self.capacity:
            blocks.popitem(last=False)
            self.dropped += 1
        blocks[key] = None
        self.stored += 1

    def match(self, keys: list[int], start: int, limit: int, on_gpu: dict[int, int]) -> int:
        """Blocks ``keys[start:]`` (up to index ``limit``) held here, in a row, and not on the
        GPU as well (a block prefilled again while its old copy sat here)."""
        n = start
        blocks = self.blocks
        while n < limit and keys[n] in blocks and keys[n] not in on_gpu:
            n += 1
        return n - start

    def take(self, keys: list[int]) -> None:
        """``keys`` (all held) go back to the GPU: they leave this tier."""
        for k in keys:
            del self.blocks[k]
        self.loaded += len(keys)
