"""A discrete-event simulation of serving engines on a cluster.

Each instance runs steps back to back while it has work, as continuous-batching engines do
(vLLM's scheduler is the model here). At the start of a step each attention rank of the
instance plans its batch:

1. every decoding request gets one token; the KV-cache blocks they need are allocated, and
   when the cache is full the most recently scheduled requests are preempted (their cache is
   freed and they are recomputed later: prompt and generated tokens prefilled again);
2. prompts being prefilled continue, a chunk each, while the step's token budget
   (``chunk_tokens``) and the cache allow;
3. waiting requests are admitted in arrival order while the budget, ``max_num_seqs`` and the
   cache allow (a request that could never fit the cache alone is rejected). With prefix
   caching, a prompt's leading blocks already in the cache are referenced, not prefilled: only
   its uncached tokens take budget and compute, and its full blocks join the cache as they are
   computed (:mod:`stage_cosim.serving.prefix`); unreferenced cached blocks are evicted, least
   recently released first, when an allocation needs their room.

With a client timeout, a request not finished ``request_timeout_s`` after it arrived is
dropped: the engine aborts it (at once if it waits, at the end of the running step if it is in
it) and frees its cache, so a saturated engine's queue stays bounded by rate x timeout.

The step's time is the simulator's for the batch's shape (the largest over the ranks: they
step together). When it ends, decoding requests emit a token, a prompt whose last chunk ran
emits its first token, and finished requests free their cache. With disaggregated pools a
prompt's instance hands the request over to a decode instance once its first token is out;
the KV cache arrives after the transfer time.

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
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from stage_cosim.inference.config import BatchShape, attention_pairs, held
from stage_cosim.serving.config import ServingConfig
from stage_cosim.serving.instance import InstanceKind, KVLayout, kv_transfer_s
from stage_cosim.serving.prefix import PrefixCache, block_keys
from stage_cosim.serving.requests import Requests

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"
_NEVER = float("inf")
STOP_EVERY = 128     # events between a caller's stop checks (a check reads every request once)


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
        self.mem_limit = _NEVER if cap is None else cap * bs     # cached tokens from which it stops growing
        self.read_limit = _NEVER if window is None else window   # cached tokens from which a read is capped
        self.res = [0] * bs           # growing requests by (c0 - g0) mod block size
        self.grow_heap: list[tuple[int, int, int]] = []
        self.short_n = 0              # requests whose read is not capped yet, and the sum of their c0 - g0
        self.short_base = 0
        self.short_heap: list[tuple[int, int, int]] = []

    def join(self, r: int, c0: int, g0: int, stamp: int, bs: int) -> None:
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
        self.prefix.evict(self.used + self.prefix.free_bytes + extra - cap)
        return True

    def _free(self, r: int, cached: int, log: RequestLog) -> None:
        """Free the cache of ``r``, which holds ``cached`` tokens: its own blocks, and its
        references to shared ones (a block nobody references stays cached, as free room)."""
        owned = log.owned[r]
        self.used -= self.kv.usage_of(cached)
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
        h = pc.match(keys, min(len(keys), (log.prompt[r] - 1) // self.kv.block_size))
        if h:
            self.used += pc.acquire(keys[:h]) * pc.block_bytes
            log.owned[r] = h
        return h * self.kv.block_size

    def _register(self, r: int, log: RequestLog) -> None:
        """Blocks of ``r``'s prompt computed in full join the cache, in order."""
        keys = log.keys[r]
        if not keys:
            return
        pc = self.prefix
        full = min(len(keys), log.computed[r] // self.kv.block_size)
        while log.owned[r] < full and pc.insert(keys[log.owned[r]]):
            log.owned[r] += 1

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
        usage = kv.usage_of
        room = self._room
        # 0. requests handed over with their cache join the decoding ones
        while self.arrived and len(self.prefilling) + self.n < cfg.max_num_seqs:
            r = self.arrived[0]
            extra = usage(log.computed[r])
            if not room(extra):
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
            if not room(extra):
                if pc is not None and log.owned[r]:     # not admitted: let its hits go again
                    self._free(r, done, log)
                    log.computed[r] = 0
                break
            if pc is not None:
                pc.queried_tokens += log.prompt[r]
                pc.hit_tokens += done
                if not log.preemptions[r]:
                    log.cached_tokens[r] = done
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


class Instance:
    """One serving instance: its attention ranks step together."""

    def __init__(self, index: int, kind: InstanceKind, cfg: ServingConfig, role: str,
                 windows: tuple[int | None, ...]) -> None:
        self.index = index
        self.kind = kind
        self.role = role
        self.ranks = [Rank(kind.kv, cfg, windows, role) for _ in range(kind.ranks)]
        # one attention rank (no attention data parallelism): every step's hot path skips the
        # loops over ranks
        self.single: Rank | None = self.ranks[0] if len(self.ranks) == 1 else None
        self.busy = False
        self.steps = 0
        self.busy_s = 0.0
        self.last_dt = 0.0
        self.counted = 0          # requests in it when last counted (the run's occupancy)
        self.kv_used = 0.0

    @property
    def in_system(self) -> int:
        if self.single is not None:
            return self.single.in_system
        return sum(r.in_system for r in self.ranks)

    def least_loaded_rank(self) -> Rank:
        return min(self.ranks, key=lambda r: r.in_system)

    def plan(self, log: RequestLog, now: float) -> BatchShape | None:
        if self.single is not None:
            p = self.single.schedule(log, now)
            return None if p is None else p.shape
        shapes = [p.shape for p in (r.schedule(log, now) for r in self.ranks) if p is not None]
        if not shapes:
            return None
        if len(shapes) == 1:
            return shapes[0]
        # the ranks step together: the step takes as long as the largest batch
        return BatchShape(max(s.sequences for s in shapes), max(s.tokens for s in shapes),
                          tuple((w, max(dict(s.kv_tokens)[w] for s in shapes)) for w, _ in shapes[0].kv_tokens),
                          tuple((w, max(dict(s.pairs)[w] for s in shapes)) for w, _ in shapes[0].pairs))


@dataclass
class Trace:
    """What the engines did over time, for the metrics."""

    steps: int = 0
    step_time_s: list[float] = field(default_factory=list)   # every step of every instance
    step_decodes: list[int] = field(default_factory=list)
    kv_time: list[float] = field(default_factory=list)       # KV-cache occupancy samples
    kv_used: list[float] = field(default_factory=list)
    # requests in the engines' queues and batches (and in KV transfer), as a step function
    occupancy_t: list[float] = field(default_factory=list)
    occupancy_n: list[int] = field(default_factory=list)
    end_s: float = 0.0
    kv_capacity: float = 1.0          # KV-cache bytes of every rank, summed (per GPU of each)
    request_overhead_s: float = 0.0   # of every request's time, spent outside the engines
    prefix_hit_tokens: int = 0        # prompt tokens served from prefix caches, of
    prefix_queried_tokens: int = 0    # the prompt tokens admitted (recomputations included)
    prefix_evicted_blocks: int = 0


class Cluster:
    """Every instance of a serving deployment and the event loop that drives them."""

    def __init__(self, pools: list[tuple[str, InstanceKind, int]], cfg: ServingConfig, cluster,  # noqa: ANN001
                 windows: tuple[int | None, ...]) -> None:
        self.cfg = cfg
        self.hw = cluster
        self.instances: list[Instance] = []
        for role, kind, count in pools:
            for _ in range(count):
                self.instances.append(Instance(len(self.instances), kind, cfg, role, windows))
        self.front = [i for i in self.instances if i.role in (MIXED, PREFILL)]
        self.back = [i for i in self.instances if i.role == DECODE]
        self._rr = {"front": 0, "back": 0}
        self.capacity = sum(r.kv.capacity_bytes for i in self.instances for r in i.ranks)

    def _route(self, pool: list[Instance], which: str) -> tuple[Instance, Rank]:
        if self.cfg.routing == "round-robin":
            k = self._rr[which]
            self._rr[which] = k + 1
            ranks = [(i, r) for i in pool for r in i.ranks]
            return ranks[k % len(ranks)]
        inst = min(pool, key=lambda i: (i.in_system / len(i.ranks), i.index))
        return inst, inst.least_loaded_rank()

    def run(self, reqs: Requests, progress=None, stop=None) -> tuple[RequestLog, Trace | None]:  # noqa: ANN001
        """Run the requests through the engines; ``stop(log, now)``, asked every STOP_EVERY
        events, ends the run early (its trace None) when the caller has its answer."""
        log = RequestLog(reqs)
        cfg = self.cfg
        trace = Trace(kv_capacity=self.capacity, request_overhead_s=cfg.request_overhead_s)
        events: list[tuple[float, int, int, int]] = []    # (time, seq, kind, payload)
        STEP, KV, DROP = 0, 1, 2
        seq = 0
        # the API server's share before a request reaches the engine, and after its last token
        pre = post = cfg.request_overhead_s / 2
        timeout = cfg.request_timeout_s
        in_flight = 0                     # requests between a prefill and a decode instance
        n, nxt = len(reqs), 0
        arrivals = [a + pre for a in log.arrival] if pre else log.arrival
        finished = 0
        handled = 0
        instances = self.instances
        # bound once: the loop below runs a few times per engine step
        heappush, heappop = heapq.heappush, heapq.heappop
        step_times, step_decodes = trace.step_time_s.append, trace.step_decodes.append
        kv_times, kv_useds = trace.kv_time.append, trace.kv_used.append
        step_overhead = cfg.step_overhead_s

        def start(inst: Instance, now: float) -> None:
            nonlocal seq
            if inst.busy:
                return
            shape = inst.plan(log, now)
            if shape is None:
                return
            dt = inst.kind.timer(shape) + step_overhead
            inst.busy = True
            inst.steps += 1
            inst.busy_s += dt
            inst.last_dt = dt
            step_times(dt)
            one = inst.single
            step_decodes(one.plan.decodes if one is not None else
                         sum(r.plan.decodes for r in inst.ranks if r.plan is not None))
            heappush(events, (now + dt, seq, STEP, inst.index))
            seq += 1

        count = 0                 # requests in the system, from the engines' queues
        flying = 0
        kv_used = 0.0
        while nxt < n or events:
            t_arr = arrivals[nxt] if nxt < n else _NEVER
            if events and events[0][0] < t_arr:
                now, _, kind, payload = heappop(events)
                if kind == STEP:
                    inst = instances[payload]
                    touched = inst
                    inst.busy = False
                    before = inst.kv_used
                    one = inst.single
                    if one is not None:
                        handoff = one.finish(now, inst.last_dt, log)
                        inst.kv_used = 0 + one.used       # as the sum over ranks: -0.0 becomes 0.0
                    else:
                        handoff = []
                        for rank in inst.ranks:
                            handoff += rank.finish(now, inst.last_dt, log)
                        inst.kv_used = sum(r.used for r in inst.ranks)
                    kv_used += inst.kv_used - before
                    kv_times(now)
                    kv_useds(kv_used)
                    for r in handoff:
                        log.rank[r] = None
                        in_flight += 1
                        heapq.heappush(events, (now + kv_transfer_s(inst.kind, log.computed[r], self.hw),
                                                seq, KV, r))
                        seq += 1
                    start(inst, now)
                elif kind == KV:
                    r = payload
                    in_flight -= 1
                    if log.dropped[r]:
                        touched = instances[0]
                    else:
                        dst, rank = self._route(self.back, "back")
                        rank.arrived.append(r)
                        log.rank[r] = (dst, rank)
                        touched = dst
                        start(dst, now)
                else:
                    r = payload
                    if log.finish[r] == log.finish[r] or log.dropped[r]:
                        continue                  # done in time: nothing happens at its deadline
                    log.dropped[r] = True
                    log.drop_time[r] = now
                    where = log.rank[r]
                    touched = instances[0]
                    if where is not None:
                        inst, rank = where
                        if not rank.abort(r, log):
                            rank.pending_drops.append(r)
                        touched = inst
                        start(inst, now)
                handled += 1
                if stop is not None and handled % STOP_EVERY == 0 and stop(log, now):
                    return log, None
                if progress is not None and handled % 2048 == 0:
                    finished = sum(1 for f in log.finish if f == f)
                    progress(finished, n)
            else:
                now = t_arr
                inst, rank = self._route(self.front, "front")
                rank.waiting.append(nxt)
                log.rank[nxt] = (inst, rank)
                if timeout is not None:
                    heapq.heappush(events, (log.arrival[nxt] + timeout - post, seq, DROP, nxt))
                    seq += 1
                nxt += 1
                touched = inst
                start(inst, now)
            # (a step's end moves requests of its instance only, or hands them to the network;
            # a transfer's end or an arrival adds one to an instance)
            k = touched.in_system
            c = count + k - touched.counted + (in_flight - flying)
            touched.counted, flying = k, in_flight
            if c != count or not trace.occupancy_t:
                trace.occupancy_t.append(now)
                trace.occupancy_n.append(c)
                count = c
            trace.end_s = now
        trace.steps = len(trace.step_time_s)
        if post:
            for r in range(n):
                if log.finish[r] == log.finish[r] and not log.rejected[r]:
                    log.first_token[r] += post
                    log.last_token[r] += post
                    log.finish[r] += post
            trace.end_s += post
        for inst in instances:
            for rank in inst.ranks:
                if rank.prefix is not None:
                    trace.prefix_hit_tokens += rank.prefix.hit_tokens
                    trace.prefix_queried_tokens += rank.prefix.queried_tokens
                    trace.prefix_evicted_blocks += rank.prefix.evicted
        if progress is not None:
            progress(n, n)
        return log, trace
