"""A discrete-event simulation of serving engines on a cluster.

Each instance runs steps back to back while it has work, as continuous-batching engines do
(vLLM's scheduler is the model here); what each of its attention ranks puts in a step, and its
KV cache, is :mod:`stage_cosim.serving.scheduler`'s.

With a client timeout, a request not finished ``request_timeout_s`` after it arrived is
dropped: the engine aborts it (at once if it waits, at the end of the running step if it is in
it) and frees its cache, so a saturated engine's queue stays bounded by rate x timeout.

The step's time is the simulator's for the batch's shape (the largest over the ranks: they
step together). With disaggregated pools a prompt's instance hands the request over to a
decode instance once its first token is out; the KV cache arrives after the transfer time.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass, field

from stage_cosim.inference.config import BatchShape
from stage_cosim.serving.config import ServingConfig
from stage_cosim.serving.instance import InstanceKind, kv_transfer_s
from stage_cosim.serving.requests import Requests
from stage_cosim.serving.scheduler import DECODE, MIXED, PREFILL, Rank, RequestLog

_NEVER = float("inf")
STOP_EVERY = 128     # events between a caller's stop checks (a check reads every request once)


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
        self.graph_sizes = cfg.cuda_graph_sizes

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
            if p is None:
                return None
            return p.shape if self.graph_sizes is None or p.chunks else _padded(p.shape, self.graph_sizes)
        plans = [p for p in (r.schedule(log, now) for r in self.ranks) if p is not None]
        if not plans:
            return None
        shapes = [p.shape for p in plans]
        if len(shapes) == 1:
            shape = shapes[0]
        else:
            # the ranks step together: the step takes as long as the largest batch
            shape = BatchShape(max(s.sequences for s in shapes), max(s.tokens for s in shapes),
                               tuple((w, max(dict(s.kv_tokens)[w] for s in shapes)) for w, _ in shapes[0].kv_tokens),
                               tuple((w, max(dict(s.pairs)[w] for s in shapes)) for w, _ in shapes[0].pairs))
        if self.graph_sizes is not None and not any(p.chunks for p in plans):
            shape = _padded(shape, self.graph_sizes)     # every rank replays the one graph size
        return shape


def _padded(shape: BatchShape, sizes: tuple[int, ...]) -> BatchShape:
    """A step of decodes only, padded up to the next captured CUDA-graph batch size: each dummy
    request decodes one token over one cached token (its own)."""
    i = bisect_left(sizes, shape.sequences)
    if i == len(sizes) or sizes[i] == shape.sequences:
        return shape
    p = sizes[i] - shape.sequences
    return BatchShape(shape.sequences + p, shape.tokens + p, tuple((w, k + p) for w, k in shape.kv_tokens),
                      tuple((w, q + p) for w, q in shape.pairs))


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
    offload_stored_blocks: int = 0    # KV offload: blocks the GPU caches evicted into host memory,
    offload_loaded_blocks: int = 0    # copied back instead of prefilled,
    offload_hit_tokens: int = 0       # the prompt tokens of admitted requests those held,
    offload_load_s: float = 0.0       # and the steps' time spent waiting for the copies


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
        offload = any(r.host is not None for i in instances for r in i.ranks)

        def start(inst: Instance, now: float) -> None:
            nonlocal seq
            if inst.busy:
                return
            shape = inst.plan(log, now)
            if shape is None:
                return
            dt = inst.kind.timer(shape) + step_overhead
            if offload:
                # blocks loaded back from host memory this step: the step's attention reads
                # them, so it waits for the copy (the slowest rank's, ranks stepping together)
                load = inst.single.load_s if inst.single is not None else max(r.load_s for r in inst.ranks)
                dt += load
                trace.offload_load_s += load
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
                if rank.host is not None:
                    trace.offload_stored_blocks += rank.host.stored
                    trace.offload_loaded_blocks += rank.host.loaded
                    trace.offload_hit_tokens += rank.host.hit_tokens
        if progress is not None:
            progress(n, n)
        return log, trace
