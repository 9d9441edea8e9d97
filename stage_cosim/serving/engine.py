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
   cache allow (a request that could never fit the cache alone is rejected).

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

from stage_cosim.inference.config import BatchShape, attention_span, held
from stage_cosim.serving.config import ServingConfig
from stage_cosim.serving.instance import InstanceKind, KVLayout, kv_transfer_s
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
        # while decoding on a rank: cached tokens and rank step count when it joined, tokens
        # still to emit then, and a stamp that invalidates its heap entries when it leaves
        self.c0 = [0] * n
        self.g0 = [0] * n
        self.left0 = [0] * n
        self.stamp = [0] * n
        # gaps between consecutive output tokens: (gap, how many tokens had it)
        self.itl: list[tuple[float, int]] = []


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

    @property
    def in_system(self) -> int:
        return len(self.waiting) + len(self.arrived) + len(self.prefilling) + self.n

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
        return sum(w.block_bytes * w.res[k] for w in self.windows)

    # -- planning a step --------------------------------------------------------------------

    def _preempt_one(self, log: RequestLog) -> bool:
        """Free the most recently scheduled request's cache; it is recomputed later."""
        if self.prefilling:
            r = self.prefilling.pop()
            self.used -= self.kv.usage_of(log.computed[r])
        else:
            while self.order and self.order[-1] not in self.decoding:
                self.order.pop()
            if not self.order:
                return False
            r = self.order.pop()
            self.used -= self.kv.usage_of(self._leave(r, log))
        log.prompt[r] = log.input_len[r] + log.generated[r]
        log.computed[r] = 0
        log.preemptions[r] += 1
        self.waiting.appendleft(r)
        return True

    def schedule(self, log: RequestLog, now: float) -> _Plan | None:
        cfg, kv = self.cfg, self.kv
        cap = kv.capacity_bytes
        usage = kv.usage_of
        # 0. requests handed over with their cache join the decoding ones
        while self.arrived and len(self.prefilling) + self.n < cfg.max_num_seqs:
            r = self.arrived[0]
            extra = usage(log.computed[r])
            if self.used + extra > cap:
                break
            self.arrived.popleft()
            self.used += extra
            self._join(r, log)
            self.fresh.append(r)
        # 1. one token for every decoding request; preempt until the cache holds them
        need = self._growth()
        while self.used + need > cap and self._preempt_one(log):
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
            if self.used + extra > cap:
                break
            self.used += extra
            chunks.append((r, c))
            budget -= c
        # 3. new requests, first come first served
        while self.waiting and budget > 0 and len(self.prefilling) + self.n < cfg.max_num_seqs:
            r = self.waiting[0]
            if usage(log.input_len[r] + log.output_len[r]) > cap:
                self.waiting.popleft()          # could never fit, even alone
                log.rejected[r] = True
                log.finish[r] = now
                continue
            done = log.computed[r]
            c = min(log.prompt[r] - done, budget)
            extra = usage(done + c) - usage(done)
            if self.used + extra > cap:
                break
            self.waiting.popleft()
            self.used += extra
            self.prefilling.append(r)
            chunks.append((r, c))
            budget -= c
        if not decodes and not chunks:
            self.plan = None
            return None
        self.plan = _Plan(decodes, chunks, self._shape(decodes, chunks, log))
        return self.plan

    def _shape(self, decodes: int, chunks: list[tuple[int, int]], log: RequestLog) -> BatchShape:
        kv: list[tuple[int | None, int]] = []
        pairs: list[tuple[int | None, int | Fraction]] = []
        g = self.g
        for w in self.windows:
            # a decoding token sees its whole cache (itself included), or the window of it
            short_n, short_sum = w.short_n, w.short_base + w.short_n * (g + 1)
            long_n = decodes - short_n
            seen = short_sum + (long_n * w.window if long_n else 0)
            k, p = seen, seen
            for r, c in chunks:
                past = log.computed[r]
                k += held(c, past, w.window)
                p += attention_span(c, past, w.window) * c
            kv.append((w.window, k))
            pairs.append((w.window, p))
        return BatchShape(decodes + len(chunks), decodes + sum(c for _, c in chunks), tuple(kv), tuple(pairs))

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
            fresh = [r for r in self.fresh if log.stamp[r]]
            for r in fresh:
                log.itl.append((now - log.last_token[r], 1))
            self.fresh = []
            if plan.decodes > len(fresh):
                log.itl.append((dt, plan.decodes - len(fresh)))
            self.g += 1
            self.last_decode = now
            for w in self.windows:
                w.advance(self.g, log, self.kv.block_size)
            heap = self.finish_heap
            while heap and heap[0][0] <= self.g:
                _, stamp, r = heapq.heappop(heap)
                if log.stamp[r] != stamp:
                    continue
                c = self._leave(r, log)
                log.finish[r] = log.last_token[r] = now
                self.used -= self.kv.usage_of(c)
        for r, c in plan.chunks:
            log.computed[r] += c
            if log.computed[r] < log.prompt[r]:
                continue
            self.prefilling.remove(r)
            # the prompt is in: its last chunk's step samples the next token
            if np.isnan(log.first_token[r]):
                log.first_token[r] = now
            else:
                log.itl.append((now - log.last_token[r], 1))
            log.last_token[r] = now
            log.generated[r] += 1
            if log.generated[r] >= log.output_len[r]:
                log.finish[r] = now
                self.used -= self.kv.usage_of(log.computed[r])
            elif self.role == PREFILL:
                self.used -= self.kv.usage_of(log.computed[r])
                handoff.append(r)
            else:
                self._join(r, log)
        return handoff


class Instance:
    """One serving instance: its attention ranks step together."""

    def __init__(self, index: int, kind: InstanceKind, cfg: ServingConfig, role: str,
                 windows: tuple[int | None, ...]) -> None:
        self.index = index
        self.kind = kind
        self.role = role
        self.ranks = [Rank(kind.kv, cfg, windows, role) for _ in range(kind.ranks)]
        self.busy = False
        self.steps = 0
        self.busy_s = 0.0
        self.last_dt = 0.0
        self.counted = 0          # requests in it when last counted (the run's occupancy)
        self.kv_used = 0.0

    @property
    def in_system(self) -> int:
        return sum(r.in_system for r in self.ranks)

    def least_loaded_rank(self) -> Rank:
        return min(self.ranks, key=lambda r: r.in_system)

    def plan(self, log: RequestLog, now: float) -> BatchShape | None:
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

    def run(self, reqs: Requests, progress=None) -> tuple[RequestLog, Trace]:  # noqa: ANN001
        log = RequestLog(reqs)
        trace = Trace(kv_capacity=self.capacity)
        events: list[tuple[float, int, int, int]] = []    # (time, seq, kind, payload)
        STEP, KV = 0, 1
        seq = 0
        in_flight = 0                     # requests between a prefill and a decode instance
        n, nxt = len(reqs), 0
        arrivals = log.arrival
        finished = 0
        handled = 0
        cfg = self.cfg
        instances = self.instances

        def start(inst: Instance, now: float) -> None:
            nonlocal seq
            if inst.busy:
                return
            shape = inst.plan(log, now)
            if shape is None:
                return
            dt = inst.kind.timer(shape) + cfg.step_overhead_s
            inst.busy = True
            inst.steps += 1
            inst.busy_s += dt
            inst.last_dt = dt
            trace.step_time_s.append(dt)
            trace.step_decodes.append(sum(r.plan.decodes for r in inst.ranks if r.plan is not None))
            heapq.heappush(events, (now + dt, seq, STEP, inst.index))
            seq += 1

        count = 0                 # requests in the system, from the engines' queues
        flying = 0
        kv_used = 0.0
        while nxt < n or events:
            t_arr = arrivals[nxt] if nxt < n else _NEVER
            if events and events[0][0] < t_arr:
                now, _, kind, payload = heapq.heappop(events)
                if kind == STEP:
                    inst = instances[payload]
                    touched = inst
                    inst.busy = False
                    handoff = []
                    before = inst.kv_used
                    for rank in inst.ranks:
                        handoff += rank.finish(now, inst.last_dt, log)
                    inst.kv_used = sum(r.used for r in inst.ranks)
                    kv_used += inst.kv_used - before
                    trace.kv_time.append(now)
                    trace.kv_used.append(kv_used)
                    for r in handoff:
                        in_flight += 1
                        heapq.heappush(events, (now + kv_transfer_s(inst.kind, log.computed[r], self.hw),
                                                seq, KV, r))
                        seq += 1
                    start(inst, now)
                else:
                    r = payload
                    in_flight -= 1
                    dst, rank = self._route(self.back, "back")
                    rank.arrived.append(r)
                    touched = dst
                    start(dst, now)
                handled += 1
                if progress is not None and handled % 2048 == 0:
                    finished = sum(1 for f in log.finish if f == f)
                    progress(finished, n)
            else:
                now = t_arr
                inst, rank = self._route(self.front, "front")
                rank.waiting.append(nxt)
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
        if progress is not None:
            progress(n, n)
        return log, trace
