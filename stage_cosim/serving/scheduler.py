"""One attention rank of a serving instance: its queue, the batch it plans for each step, and
its KV cache (the engine, :mod:`stage_cosim.serving.engine`, steps the instances).

At the start of a step each attention rank of an instance plans its batch, as vLLM's
scheduler does:

1. every decoding request gets one token; the KV-cache blocks they need are allocated, and
   when the cache is full the most recently scheduled requests are preempted (their cache is
   freed and they are recomputed later: prompt and generated tokens prefilled again);
2. prompts being prefilled continue, a chunk each, while the step's token budget
   (``chunk_tokens``) and the cache allow;
3. waiting requests are admitted in arrival order while the budget, ``max_num_seqs`` and the
   cache allow (a request that could never fit the cache alone is rejected; with
   ``guaranteed_no_evict``, while the cache could hold every admitted request's prompt and
   whole output at once, TensorRT-LLM's default, so step 1 never preempts). With prefix
   caching, a prompt's leading blocks already in the cache are referenced, not prefilled: only
   its uncached tokens take budget and compute, and its full blocks join the cache as they are
   computed (:mod:`stage_cosim.serving.prefix`); unreferenced cached blocks are evicted, least
   recently released first, when an allocation needs their room.

When the step ends, decoding requests emit a token, a prompt whose last chunk ran emits its
first token, and finished requests free their cache.

A rank keeps its decoding requests as sums, not lists: every decoding request gains one
cached token per step, so with ``g`` the rank's decode steps so far, a request that joined at
``g0`` with ``c0`` cached tokens has ``c0 + g - g0``. The batch's cached tokens, the blocks the
step allocates (requests whose count sits on a block boundary: one residue class modulo the
block size) and the requests that finish (a heap by the step they end at) are then O(1) or
O(log n) per step, whatever the batch size.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from stage_cosim.inference.config import BatchShape, attention_pairs, held
from stage_cosim.model.architecture import ChunkSpan
from stage_cosim.serving.chunked import ChunkReads
from stage_cosim.serving.config import ServingConfig
from stage_cosim.serving.instance import KVLayout
from stage_cosim.serving.prefix import HostTier, PrefixCache, block_keys
from stage_cosim.serving.requests import Requests

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"
_NEVER = float("inf")


class RequestLog:
    """Per-request state and timestamps (index = request id)."""

    def __init__(self, reqs: Requests) -> None:
        n = len(reqs)
        self.arrival = reqs.arrival_s.tolist()
        self.input_len = reqs.input_len.tolist()
        self.output_len = reqs.output_len.tolist()
        self.prompt = list(self.input_len)          # tokens to prefill (grows on recompute)
        self.computed = [0] * n                     # of them, in the cache
        self.generated = [0] * n                    # output tokens emitted (up to date unless decoding)
        self.first_token = [np.nan] * n
        self.last_token = [np.nan] * n
        self.finish = [np.nan] * n
        self.preemptions = [0] * n
        self.rejected = [False] * n
        self.dropped = [False] * n                  # the client gave up (its timeout passed)
        self.drop_time = [np.nan] * n
        self.cached_tokens = [0] * n                # prompt tokens served from the prefix cache (first admission)
        # prefix caching: the prompt's block identities (computed when first needed), how many
        # leading ones the request references in its rank's cache, and the rank it is on
        self._hash_ids = reqs.hash_ids
        self._hash_block = reqs.hash_block
        self.keys: list[list[int] | None] = [None] * n
        self.owned = [0] * n
        self.rank: list["Rank | None"] = [None] * n
        # while decoding on a rank: cached tokens and rank step count when it joined, tokens
        # still to emit then, and a stamp that invalidates its heap entries when it leaves
        self.c0 = [0] * n
        self.g0 = [0] * n
        self.left0 = [0] * n
        self.stamp = [0] * n
        # gaps between consecutive output tokens: (gap, how many tokens had it)
        self.itl: list[tuple[float, int]] = []

    def keys_of(self, r: int, block_size: int) -> list[int]:
        keys = self.keys[r]
        if keys is None:
            ids = self._hash_ids[r] if self._hash_ids is not None else ()
            keys = self.keys[r] = block_keys(ids, self._hash_block, self.input_len[r], block_size) if ids else []
        return keys


class _Window:
    """A rank's decoding requests as seen by the layers of one attention window (None: global):
    what the batch's tokens read, and which requests grow that window's cache."""

    def __init__(self, window: int | None, kv: KVLayout) -> None:
        self.window = window
        bs = kv.block_size
        per_token = dict(kv.bytes_per_token).get(window, 0.0)
        self.block_bytes = per_token * bs
        cap = None if window is None else -(-window // bs) + 1
        # (a chunked layer is held at its peak, one chunk's blocks: a sequence's blocks are freed
        # when it ends; its reads are the sawtooth of its chunks, kept apart)
        self.mem_limit = _NEVER if cap is None else cap * bs     # cached tokens from which it stops growing
        self.chunks = ChunkReads(int(window)) if isinstance(window, ChunkSpan) else None
        self.read_limit = _NEVER if window is None or self.chunks else window   # from which a read is capped
        self.res = [0] * bs           # growing requests by (c0 - g0) mod block size
        self.grow_heap: list[tuple[int, int, int]] = []
        self.short_n = 0              # requests whose read is not capped yet, and the sum of their c0 - g0
        self.short_base = 0
        self.short_heap: list[tuple[int, int, int]] = []

    def join(self, r: int, c0: int, g0: int, stamp: int, bs: int) -> None:
        if self.chunks is not None:
            self.chunks.join(c0, g0)
        if c0 < self.mem_limit:
            self.res[(c0 - g0) % bs] += 1
            if self.mem_limit != _NEVER:
                heapq.heappush(self.grow_heap, (g0 + int(self.mem_limit) - c0, stamp, r))
        if c0 + 1 <= self.read_limit:
            self.short_n += 1
            self.short_base += c0 - g0
            if self.read_limit != _NEVER:
                heapq.heappush(self.short_heap, (g0 + int(self.read_limit) - c0, stamp, r))

    def leave(self, c: int, c0: int, g0: int, bs: int) -> None:
        """Remove a request that now holds ``c`` cached tokens."""
        if self.chunks is not None:
            self.chunks.leave(c0, g0)
        if c < self.mem_limit:
            self.res[(c0 - g0) % bs] -= 1
        if c + 1 <= self.read_limit:
            self.short_n -= 1
            self.short_base -= c0 - g0

    def advance(self, g: int, log: RequestLog, bs: int) -> None:
        """Move the requests that crossed a limit by step ``g`` (their entries are due)."""
        while self.grow_heap and self.grow_heap[0][0] <= g:
            _, stamp, r = heapq.heappop(self.grow_heap)
            if log.stamp[r] == stamp:
                self.res[(log.c0[r] - log.g0[r]) % bs] -= 1
        while self.short_heap and self.short_heap[0][0] <= g:
            _, stamp, r = heapq.heappop(self.short_heap)
            if log.stamp[r] == stamp:
                self.short_n -= 1
                self.short_base -= log.c0[r] - log.g0[r]


@dataclass
class _Plan:
    decodes: int
    chunks: list[tuple[int, int]]        # (request, tokens)
    shape: BatchShape


class Rank:
    """One attention rank of an instance: its queue, running requests and KV cache."""

    def __init__(self, kv: KVLayout, cfg: ServingConfig, windows: tuple[int | None, ...], role: str) -> None:
        self.kv = kv
        self.cfg = cfg
        self.role = role
        # prefix caching reuses whole blocks of every layer: models with sliding-window layers
        # (which free blocks out of their window) run without it, as vLLM 0.5-0.6 did, and so
        # do models with SSM layers (a block of tokens does not hold their state)
        self.prefix = (PrefixCache(kv.usage_of(kv.block_size))
                       if cfg.enable_prefix_caching and windows == (None,) and not kv.state_bytes
                       and role != DECODE else None)
        # KV offload: the prefix cache's second tier, in host memory; blocks loaded back in a
        # step lengthen it by their copy time (load_s), the whole batch waiting for them
        blocks = int(kv.host_bytes // self.prefix.block_bytes) if self.prefix is not None and kv.host_bytes else 0
        self.host = HostTier(blocks) if blocks else None
        self.load_s = 0.0                          # host-to-device copies of the step being planned
        self._loaded = 0                           # tokens the last prefix lookup loaded
        self.waiting: deque[int] = deque()         # to prefill: new, or preempted (in front)
        self.arrived: deque[int] = deque()         # handed over with their cache (a decode instance)
        self.prefilling: list[int] = []
        self.g = 0                                 # decode steps so far
        self.n = 0                                 # decoding requests
        self.order: list[int] = []                 # decoding requests as they joined (stale entries skipped)
        self.decoding: set[int] = set()
        self.finish_heap: list[tuple[int, int, int]] = []
        self.windows = [_Window(w, kv) for w in windows]
        self.fresh: list[int] = []                 # handed over, decoding their first token this step
        self.last_decode = 0.0                     # when the decoding requests' last tokens came out
        self.used = 0.0                            # KV-cache bytes per GPU
        self.reserved = 0.0                        # guaranteed_no_evict: bytes the admitted requests will hold
        self._held: dict[int, float] = {}          # and each one's share of them
        self.plan: _Plan | None = None
        self._stamp = 0
        self.pending_drops: list[int] = []         # dropped while in the running step

    @property
    def in_system(self) -> int:
        return len(self.waiting) + len(self.arrived) + len(self.prefilling) + self.n

    # -- the cache ----------------------------------------------------------------------------

    def _room(self, extra: float) -> bool:
        """Whether ``extra`` bytes fit, evicting unreferenced cached blocks if they must."""
        cap = self.kv.capacity_bytes
        if self.used + extra <= cap - (self.prefix.free_bytes if self.prefix else 0.0):
            return True
        if self.prefix is None or self.used + extra > cap:
            return False
        self.prefix.evict(self.used + self.prefix.free_bytes + extra - cap, self.host)
        return True

    def _free(self, r: int, cached: int, log: RequestLog) -> None:
        """Free the cache of ``r``, which holds ``cached`` tokens: its own blocks, and its
        references to shared ones (a block nobody references stays cached, as free room)."""
        owned = log.owned[r]
        self.used -= self.kv.usage_of(cached)
        self.reserved -= self._held.pop(r, 0.0)
        if owned:
            bb = self.prefix.block_bytes
            self.used += owned * bb
            # tail blocks first, so a prefix outlives its continuations under eviction (vLLM's order)
            self.used -= self.prefix.release(log.keys[r][owned - 1::-1]) * bb
            log.owned[r] = 0

    def _hit(self, r: int, log: RequestLog) -> int:
        """Reference the cached leading blocks of ``r``'s prompt (at least its last token is
        computed, as vLLM does); returns the tokens they hold."""
        pc = self.prefix
        keys = log.keys_of(r, self.kv.block_size)
        if not keys:
            return 0
        limit = min(len(keys), (log.prompt[r] - 1) // self.kv.block_size)
        h = pc.match(keys, limit)
        if h:
            self.used += pc.acquire(keys[:h]) * pc.block_bytes
            log.owned[r] = h
        if self.host is not None:
            h += self._load(keys, h, limit, log, r)
        return h * self.kv.block_size

    def _load(self, keys: list[int], h: int, limit: int, log: RequestLog, r: int) -> int:
        """Copy the blocks after ``r``'s first ``h`` hits that sit in host memory back to the
        GPU (as many as its free room holds), referenced by ``r``; returns how many."""
        pc, host = self.prefix, self.host
        bb = pc.block_bytes
        m = host.match(keys, h, limit, pc.refs)
        if m:
            m = min(m, int((self.kv.capacity_bytes - self.used) // bb))
        if m <= 0:
            return 0
        self._loaded = m * self.kv.block_size
        loaded = keys[h:h + m]
        host.take(loaded)
        self._room(m * bb)                 # fits: free cached blocks are evicted (into the host tier)
        for k in loaded:
            pc.refs[k] = 1
        self.used += m * bb
        log.owned[r] = h + m
        self.load_s += m * bb / (self.kv.host_to_device_GBps * 1e9)
        return m

    def _register(self, r: int, log: RequestLog) -> None:
        """Blocks of ``r``'s prompt computed in full join the cache, in order."""
        keys = log.keys[r]
        if not keys:
            return
        pc = self.prefix
        full = min(len(keys), log.computed[r] // self.kv.block_size)
        while log.owned[r] < full and pc.insert(keys[log.owned[r]]):
            log.owned[r] += 1

    def _reserve(self, r: int, log: RequestLog) -> bool:
        """guaranteed_no_evict: hold room for ``r``'s prompt and whole output (a prefill
        instance's prompt only: it hands the request over), if the cache has it; True otherwise."""
        if not self.cfg.guaranteed_no_evict:
            return True
        full = self.kv.usage_of(log.input_len[r] + (log.output_len[r] if self.role != PREFILL else 0))
        if self.reserved + full > self.kv.capacity_bytes:
            return False
        self.reserved += full
        self._held[r] = full
        return True

    def abort(self, r: int, log: RequestLog) -> bool:
        """Take dropped ``r`` out of this rank and free its cache; False if it is in the step
        running now (the caller retries when the step ends)."""
        if r in self.decoding or r in self.prefilling:
            if self.plan is not None:
                return False
            if r in self.decoding:
                self._free(r, self._leave(r, log), log)
            else:
                self.prefilling.remove(r)
                self._free(r, log.computed[r], log)
            return True
        for q in (self.waiting, self.arrived):
            try:
                q.remove(r)
                return True
            except ValueError:
                pass
        return True

    # -- decoding requests ----------------------------------------------------------------------

    def _join(self, r: int, log: RequestLog) -> None:
        """``r`` decodes from the next step on, with its prompt (and output so far) cached."""
        c0, left = log.computed[r], log.output_len[r] - log.generated[r]
        self._stamp += 1
        log.c0[r], log.g0[r], log.left0[r], log.stamp[r] = c0, self.g, left, self._stamp
        self.n += 1
        self.order.append(r)
        self.decoding.add(r)
        heapq.heappush(self.finish_heap, (self.g + left, self._stamp, r))
        for w in self.windows:
            w.join(r, c0, self.g, self._stamp, self.kv.block_size)

    def _leave(self, r: int, log: RequestLog) -> int:
        """Take ``r`` out of the decoding requests; returns its cached tokens."""
        steps = self.g - log.g0[r]
        c = log.c0[r] + steps
        log.generated[r] += steps
        log.computed[r] = c
        if steps:
            log.last_token[r] = self.last_decode
        log.stamp[r] = 0
        self.n -= 1
        self.decoding.discard(r)
        for w in self.windows:
            w.leave(c, log.c0[r], log.g0[r], self.kv.block_size)
        return c

    def _growth(self) -> float:
        """KV-cache bytes the decoding requests' next tokens allocate."""
        k = (-self.g) % self.kv.block_size
        total = 0
        for w in self.windows:
            total += w.block_bytes * w.res[k]
        return total

    # -- planning a step --------------------------------------------------------------------

    def _preempt_one(self, log: RequestLog) -> bool:
        """Free the most recently scheduled request's cache; it is recomputed later."""
        if self.prefilling:
            r = self.prefilling.pop()
            self._free(r, log.computed[r], log)
        else:
            while self.order and self.order[-1] not in self.decoding:
                self.order.pop()
            if not self.order:
                return False
            r = self.order.pop()
            self._free(r, self._leave(r, log), log)
        log.prompt[r] = log.input_len[r] + log.generated[r]
        log.computed[r] = 0
        log.preemptions[r] += 1
        self.waiting.appendleft(r)
        return True

    def schedule(self, log: RequestLog, now: float) -> _Plan | None:
        cfg, kv = self.cfg, self.kv
        self.load_s = 0.0
        usage = kv.usage_of
        room = self._room
        # 0. requests handed over with their cache join the decoding ones
        while self.arrived and len(self.prefilling) + self.n < cfg.max_num_seqs:
            r = self.arrived[0]
            extra = usage(log.computed[r])
            if not room(extra) or not self._reserve(r, log):
                break
            self.arrived.popleft()
            self.used += extra
            self._join(r, log)
            self.fresh.append(r)
        if not cfg.enable_chunked_prefill:
            # vLLM V0's default: a step of whole prompts while any can be admitted, the decodes
            # waiting; else a step of decodes only
            chunks = self._admit(log, now, cfg.chunk_tokens, [], whole=True)
            if chunks:
                self.plan = _Plan(0, chunks, self._shape(0, chunks, log))
                return self.plan
        # 1. one token for every decoding request; preempt until the cache holds them
        need = self._growth()
        while not room(need) and self._preempt_one(log):
            need = self._growth()
        self.used += need
        decodes = self.n
        budget = cfg.chunk_tokens - decodes
        chunks: list[tuple[int, int]] = []
        # 2. prompts under way, a chunk each
        for r in self.prefilling:
            if budget <= 0:
                break
            done = log.computed[r]
            c = min(log.prompt[r] - done, budget)
            extra = usage(done + c) - usage(done)
            if not room(extra):
                break
            self.used += extra
            chunks.append((r, c))
            budget -= c
        # 3. new requests, first come first served
        if cfg.enable_chunked_prefill and self.waiting:
            chunks = self._admit(log, now, budget, chunks, whole=False)
        if not decodes and not chunks:
            self.plan = None
            return None
        self.plan = _Plan(decodes, chunks, self._shape(decodes, chunks, log))
        return self.plan

    def _admit(self, log: RequestLog, now: float, budget: int, chunks: list[tuple[int, int]],
               whole: bool) -> list[tuple[int, int]]:
        """Admit waiting requests into ``chunks`` while ``budget`` tokens, ``max_num_seqs`` and
        the cache allow; ``whole``: only whole prompts (the first one even past the budget)."""
        cfg, kv, pc = self.cfg, self.kv, self.prefix
        cap, usage, room = kv.capacity_bytes, kv.usage_of, self._room
        while self.waiting and budget > 0 and len(self.prefilling) + self.n < cfg.max_num_seqs:
            r = self.waiting[0]
            if usage(log.input_len[r] + log.output_len[r]) > cap:
                self.waiting.popleft()          # could never fit, even alone
                log.rejected[r] = True
                log.finish[r] = now
                continue
            if pc is not None and log.computed[r] == 0:
                self._loaded = 0
                hit = self._hit(r, log)
                log.computed[r] = hit
            done = log.computed[r]
            c = log.prompt[r] - done if whole else min(log.prompt[r] - done, budget)
            if whole and c > budget and chunks:
                if pc is not None and log.owned[r]:
                    self._free(r, done, log)
                    log.computed[r] = 0
                break
            extra = usage(done + c) - usage(done)
            if not room(extra) or not self._reserve(r, log):
                if pc is not None and log.owned[r]:     # not admitted: let its hits go again
                    self._free(r, done, log)
                    log.computed[r] = 0
                break
            if pc is not None:
                pc.queried_tokens += log.prompt[r]
                pc.hit_tokens += done
                if not log.preemptions[r]:
                    log.cached_tokens[r] = done
                if self.host is not None:
                    self.host.hit_tokens += self._loaded
            self.waiting.popleft()
            self.used += extra
            self.prefilling.append(r)
            chunks.append((r, c))
            budget -= c
        return chunks

    def _shape(self, decodes: int, chunks: list[tuple[int, int]], log: RequestLog) -> BatchShape:
        kv: list[tuple[int | None, int]] = []
        pairs: list[tuple[int | None, int | Fraction]] = []
        g = self.g
        computed = log.computed
        tokens = decodes
        for _, c in chunks:
            tokens += c
        for w in self.windows:
            # a decoding token sees its whole cache (itself included), or the window of it
            window = w.window
            short_n, short_sum = w.short_n, w.short_base + w.short_n * (g + 1)
            long_n = decodes - short_n
            seen = short_sum + (long_n * window if long_n else 0) if decodes else 0
            if w.chunks is not None:
                seen = w.chunks.reads(g)
            k, p = seen, seen
            for r, c in chunks:
                past = computed[r]
                k += held(c, past, window)
                p += attention_pairs(c, past, window)   # integers: the pairs of whole chunks
            kv.append((window, k))
            pairs.append((window, Fraction(p) if chunks else p))
        return BatchShape(decodes + len(chunks), tokens, tuple(kv), tuple(pairs))

    # -- finishing a step -------------------------------------------------------------------

    def finish(self, now: float, dt: float, log: RequestLog) -> list[int]:
        """Apply the planned step (of ``dt`` seconds) at its end; returns requests to hand over
        (a prefill instance's)."""
        plan, self.plan = self.plan, None
        if plan is None:
            return []
        handoff: list[int] = []
        if plan.decodes:
            # every planned decode emits a token, a step after its last; a request handed over
            # waited since its prefill instance's token
            fresh = 0
            if self.fresh:
                for r in self.fresh:
                    if log.stamp[r]:
                        log.itl.append((now - log.last_token[r], 1))
                        fresh += 1
                self.fresh = []
            if plan.decodes > fresh:
                log.itl.append((dt, plan.decodes - fresh))
            g = self.g = self.g + 1
            self.last_decode = now
            for w in self.windows:
                # (only windows whose limits someone crossed: a global one has none)
                if (w.grow_heap and w.grow_heap[0][0] <= g) or (w.short_heap and w.short_heap[0][0] <= g):
                    w.advance(g, log, self.kv.block_size)
            heap = self.finish_heap
            while heap and heap[0][0] <= g:
                _, stamp, r = heapq.heappop(heap)
                if log.stamp[r] != stamp:
                    continue
                c = self._leave(r, log)
                log.finish[r] = log.last_token[r] = now
                self._free(r, c, log)
        pc = self.prefix
        for r, c in plan.chunks:
            log.computed[r] += c
            if pc is not None:
                self._register(r, log)
            if log.computed[r] < log.prompt[r]:
                continue
            self.prefilling.remove(r)
            # the prompt is in: its last chunk's step samples the next token
            if log.first_token[r] != log.first_token[r]:     # NaN: the first time its prompt is in
                log.first_token[r] = now
            else:
                log.itl.append((now - log.last_token[r], 1))
            log.last_token[r] = now
            log.generated[r] += 1
            if log.generated[r] >= log.output_len[r]:
                log.finish[r] = now
                self._free(r, log.computed[r], log)
            elif self.role == PREFILL:
                self._free(r, log.computed[r], log)
                handoff.append(r)
            else:
                self._join(r, log)
        if self.pending_drops:
            for r in self.pending_drops:
                self.abort(r, log)
            self.pending_drops = []
        return handoff
