"""Pipeline schedules: the order of forward and backward passes on one pipeline stage, and
where each model chunk lies.

A pass is ``(phase, micro_batch, chunk)``. ``chunk`` is the stage's model chunk: 0 for the
schedules with one chunk per stage; virtual stage ``chunk * pp + stage`` for the interleaved
schedule; the two legs of a V (virtual stages ``stage`` and ``2 * pp - 1 - stage``) for ZB-V
and DualPipeV; the two parameter copies for DualPipe (copy 0 runs from stage 0 to stage
pp - 1, copy 1 the other way, each fed half of the micro-batches).

The backward is one pass (``bwd``), or two (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism"): the input gradient (``bwd_input``, B), which the stage before waits for, and
the weight gradient (``bwd_weight``, W), which nothing downstream waits for and which the
zero-bubble schedules defer into what would be bubbles. A forward marked ``paired`` runs
together with the backward right after it, one micro-batch's communication overlapping the
other's compute (DualPipe's F&B).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from stage_cosim.parallel.config import V_SCHEDULES

Phase = Literal["fwd", "bwd", "bwd_input", "bwd_weight"]
BACKWARD = ("bwd", "bwd_input")          # the passes that hand a gradient on
# Schedules whose backward is split into B and W passes.
SPLIT_SCHEDULES = ("zb-h1", "zb-v", "dualpipe", "dualpipev")


@dataclass(frozen=True)
class Pass:
    phase: Phase
    micro_batch: int
    chunk: int
    paired: bool = False        # a forward overlapped with the backward after it (F&B)


@dataclass(frozen=True)
class Layout:
    """Where the model chunks of a schedule lie: ``lines`` pipelines (two parameter copies
    for DualPipe, one otherwise) of ``nv`` virtual stages each."""

    schedule: str
    pp: int
    vp: int = 1

    @property
    def lines(self) -> int:
        return 2 if self.schedule == "dualpipe" else 1

    @property
    def chunks(self) -> int:
        """Model chunks per stage."""
        return 2 if self.schedule in ("dualpipe", *V_SCHEDULES) else self.vp

    @property
    def nv(self) -> int:
        """Virtual stages of one pipeline (one model copy)."""
        return self.pp * (2 if self.schedule in V_SCHEDULES else self.vp if self.schedule == "interleaved" else 1)

    def place(self, stage: int, chunk: int) -> tuple[int, int]:
        """(line, virtual stage) of ``stage``'s ``chunk``."""
        if self.schedule == "dualpipe":
            return chunk, stage if chunk == 0 else self.pp - 1 - stage
        if self.schedule in V_SCHEDULES:
            return 0, stage if chunk == 0 else 2 * self.pp - 1 - stage
        return 0, chunk * self.pp + stage

    def holder(self, line: int, vs: int) -> tuple[int, int]:
        """(stage, chunk) holding virtual stage ``vs`` of pipeline ``line``."""
        if self.schedule == "dualpipe":
            return (vs if line == 0 else self.pp - 1 - vs), line
        if self.schedule in V_SCHEDULES:
            return (vs, 0) if vs < self.pp else (2 * self.pp - 1 - vs, 1)
        return vs % self.pp, vs // self.pp

    def direction(self, chunk: int) -> int:
        """Which way ``chunk``'s forward goes: to the next stage (+1), or back up (-1: the V's
        second leg, DualPipe's second copy)."""
        return -1 if chunk == 1 and self.schedule in ("dualpipe", *V_SCHEDULES) else +1


def gpipe(pp: int, stage: int, m: int) -> list[Pass]:
    """All forwards, then all backwards."""
    return [Pass("fwd", i, 0) for i in range(m)] + [Pass("bwd", i, 0) for i in range(m)]


def one_f_one_b(pp: int, stage: int, m: int) -> list[Pass]:
    """PipeDream-flush / Megatron 1F1B: ``pp - stage - 1`` warm-up forwards, then alternate."""
    warmup = min(pp - stage - 1, m)
    order = [Pass("fwd", i, 0) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order.append(Pass("fwd", f, 0))
        f += 1
        order.append(Pass("bwd", b, 0))
        b += 1
    order.extend(Pass("bwd", i, 0) for i in range(b, m))
    return order


def interleaved(pp: int, stage: int, m: int, vp: int) -> list[Pass]:
    """Megatron's interleaved 1F1B over ``vp`` model chunks per device (m a multiple of pp)."""
    total = m * vp

    def chunk(k: int, forward: bool) -> int:
        c = (k // pp) % vp
        return c if forward else vp - 1 - c

    def micro_batch(k: int) -> int:
        return (k // (pp * vp)) * pp + k % pp

    warmup = min((pp - stage - 1) * 2 + (vp - 1) * pp, total)
    order = [Pass("fwd", micro_batch(k), chunk(k, True)) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        order.append(Pass("fwd", micro_batch(f), chunk(f, True)))
        f += 1
        order.append(Pass("bwd", micro_batch(b), chunk(b, False)))
        b += 1
    order.extend(Pass("bwd", micro_batch(k), chunk(k, False)) for k in range(b, total))
    return order


def zb_h1(pp: int, stage: int, m: int) -> list[Pass]:
    """ZB-H1 (Qi et al. 2023): 1F1B's forwards and input gradients, each weight gradient
    deferred by ``stage`` backward passes (a later stage's W fills the wait for the next
    forward, the earlier stages' the drain), so that a stage holds what 1F1B's first stage
    holds (``pp`` micro-batches until their W) and the bubble shrinks to (pp-1)(F+B-2W)."""
    lag = min(stage, m)
    order: list[Pass] = []
    b = 0
    for p in one_f_one_b(pp, stage, m):
        if p.phase == "fwd":
            order.append(p)
            continue
        order.append(Pass("bwd_input", p.micro_batch, 0))
        b += 1
        if b > lag:
            order.append(Pass("bwd_weight", b - 1 - lag, 0))
    order.extend(Pass("bwd_weight", i, 0) for i in range(m - lag, m))
    return order


class _Program:
    """A stage's passes written the way DualPipe's reference schedule is: per chunk, the next
    micro-batch's forward or backward, and deferred weight gradients taken first-in first-out."""

    def __init__(self, chunk_of: dict[int, int], micro_batches: dict[int, list[int]]) -> None:
        self.order: list[Pass] = []
        self.chunk_of = chunk_of          # schedule phase (0: the near end's inputs) -> chunk
        self.mbs = micro_batches          # chunk -> its micro-batches in order
        self.next = {(c, k): 0 for c in micro_batches for k in ("f", "b")}
        self.weights: deque[Pass] = deque()

    def _take(self, phase: int, kind: str) -> tuple[int, int]:
        c = self.chunk_of[phase]
        i = self.next[(c, kind)]
        self.next[(c, kind)] = i + 1
        return self.mbs[c][i], c

    def f(self, phase: int, paired: bool = False) -> None:
        mb, c = self._take(phase, "f")
        self.order.append(Pass("fwd", mb, c, paired))

    def b(self, phase: int, split: bool = False) -> None:
        mb, c = self._take(phase, "b")
        if split:
            self.order.append(Pass("bwd_input", mb, c))
            self.weights.append(Pass("bwd_weight", mb, c))
        else:
            self.order.append(Pass("bwd", mb, c))

    def w(self) -> None:
        self.order.append(self.weights.popleft())

    def fb(self, f_phase: int, b_phase: int) -> None:
        """F&B: a forward overlapped with another micro-batch's (whole) backward."""
        self.f(f_phase, paired=True)
        self.b(b_phase)


def _dualpipe_steps(prog: _Program, ranks: int, rank: int, chunks: int, turn: bool) -> list[Pass]:
    """DualPipe's eight steps (DeepSeek-V3 technical report, Fig. 5) for ``rank`` of ``ranks``
    with ``chunks`` micro-batches entering from its end of the pipeline; ``turn``: the rank
    where both legs meet (the middle of DualPipe, the bottom of DualPipeV's V), which runs its
    first F&B as a forward then a backward."""
    for _ in range((ranks - rank - 1) * 2):                  # 1: forwards of the near leg
        prog.f(0)
    for _ in range(rank + 1):                                # 2: forwards of both legs
        prog.f(0)
        prog.f(1)
    for _ in range(ranks - rank - 1):                        # 3: B, W, F of the far leg
        prog.b(1, split=True)
        prog.w()
        prog.f(1)
    for i in range(chunks - 2 * ranks + rank + 1):           # 4: the steady state, all F&B
        if i == 0 and turn:
            prog.f(0)
            prog.b(1)
        else:
            prog.fb(0, 1)
        prog.fb(1, 0)
    for _ in range(ranks - rank - 1):                        # 5: B, then F&B
        prog.b(1)
        prog.fb(1, 0)
    split = False                                            # 6: backwards of both legs,
    for i in range(rank + 1):                                #    the second half split
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        prog.b(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        prog.b(0, split)
    for _ in range(ranks - rank - 1):                        # 7: W, then B of the near leg
        prog.w()
        prog.b(0, split=True)
    while prog.weights:                                      # 8: the remaining weight gradients
        prog.w()
    return prog.order


def dualpipe(pp: int, stage: int, m: int) -> list[Pass]:
    """DualPipe (DeepSeek-V3): two copies of the model run in opposite directions, half of
    the micro-batches each; stage ``s`` holds stage ``s`` of copy 0 and stage ``pp-1-s`` of
    copy 1. Each half of the stages runs the schedule from its own end (pp even, m even and
    at least 2 * pp)."""
    half = pp // 2
    second = stage >= half
    mbs = {0: list(range(m // 2)), 1: list(range(m // 2, m))}
    prog = _Program({0: int(second), 1: int(not second)}, mbs)
    rank = min(stage, pp - 1 - stage)
    return _dualpipe_steps(prog, half, rank, m // 2, rank == half - 1)


def dualpipev(pp: int, stage: int, m: int) -> list[Pass]:
    """DualPipeV: DualPipe folded into a V on one copy of the model, stage ``s`` holding
    virtual stages ``s`` and ``2*pp-1-s``, every micro-batch entering at stage 0 (m >= 2 * pp)."""
    prog = _Program({0: 0, 1: 1}, {0: list(range(m)), 1: list(range(m))})
    return _dualpipe_steps(prog, pp, stage, m, stage == pp - 1)


def zb_v(pp: int, stage: int, m: int) -> list[Pass]:
    """ZB-V (Qi et al.): the V placement of two chunks per stage, scheduled greedily on unit
    pass times as the paper builds it: a ready input gradient first, then a forward while the
    stage holds fewer than ``2 * pp`` chunk activations (1F1B's peak: ``pp`` micro-batches of
    half the layers each), else a deferred weight gradient."""
    return _zb_v_orders(pp, m)[stage]


_ZBV_CACHE: dict[tuple[int, int], list[list[Pass]]] = {}


def _zb_v_orders(pp: int, m: int) -> list[list[Pass]]:
    key = (pp, m)
    if key in _ZBV_CACHE:
        return _ZBV_CACHE[key]
    layout = Layout("zb-v", pp, 2)
    nv = layout.nv
    done: dict[tuple[str, int, int], int] = {}          # (kind, mb, vs) -> finish time
    orders: list[list[Pass]] = [[] for _ in range(pp)]
    held = [0] * pp
    pending: list[deque[Pass]] = [deque() for _ in range(pp)]
    next_f = [[0, 0] for _ in range(pp)]                 # per stage, per chunk: next forward
    next_b = [[0, 0] for _ in range(pp)]
    free = [0] * pp
    total = 3 * m * 2 * pp
    t = 0
    while sum(len(o) for o in orders) < total:
        for s in range(pp):
            if free[s] > t:
                continue
            choice: Pass | None = None
            # input gradients, the later virtual stage (chunk 1 feeds chunk 0) first
            for c in (1, 0):
                i = next_b[s][c]
                if i < m:
                    vs = layout.place(s, c)[1]
                    need = ("f", i, vs) if vs == nv - 1 else ("b", i, vs + 1)
                    if ("f", i, vs) in done and done[("f", i, vs)] <= t and need in done and done[need] <= t:
                        choice = Pass("bwd_input", i, c)
                        break
            if choice is None and held[s] < 2 * pp:
                for c in (1, 0):
                    i = next_f[s][c]
                    vs = layout.place(s, c)[1]
                    if i < m and (vs == 0 or done.get(("f", i, vs - 1), t + 1) <= t):
                        choice = Pass("fwd", i, c)
                        break
            if choice is None and pending[s]:
                choice = pending[s].popleft()
            if choice is None:
                continue
            vs = layout.place(s, choice.chunk)[1]
            if choice.phase == "fwd":
                next_f[s][choice.chunk] += 1
                held[s] += 1
                done[("f", choice.micro_batch, vs)] = t + 1
            elif choice.phase == "bwd_input":
                next_b[s][choice.chunk] += 1
                pending[s].append(Pass("bwd_weight", choice.micro_batch, choice.chunk))
                done[("b", choice.micro_batch, vs)] = t + 1
            else:
                held[s] -= 1
            orders[s].append(choice)
            free[s] = t + 1
        t += 1
    _ZBV_CACHE[key] = orders
    return orders


def schedule_order(schedule: str, pp: int, stage: int, m: int, vp: int = 1) -> list[Pass]:
    if schedule == "gpipe":
        return gpipe(pp, stage, m)
    if schedule == "1f1b":
        return one_f_one_b(pp, stage, m)
    if schedule == "interleaved":
        return interleaved(pp, stage, m, vp)
    if schedule == "zb-h1":
        return zb_h1(pp, stage, m)
    if schedule == "zb-v":
        return zb_v(pp, stage, m)
    if schedule == "dualpipe":
        return dualpipe(pp, stage, m)
    if schedule == "dualpipev":
        return dualpipev(pp, stage, m)
    raise ValueError(f"unknown schedule {schedule!r}")


def peak_in_flight(order: list[Pass], weight: dict[int, float] | None = None) -> float:
    """Most forward passes held at once, each chunk weighted: a forward's activations are held
    until its backward, or (a split backward) until its weight gradient, which reads them."""
    live = peak = 0.0
    for p in order:
        w = weight.get(p.chunk, 1.0) if weight else 1.0
        if p.phase == "fwd":
            live += w
            peak = max(peak, live)
        elif p.phase in ("bwd", "bwd_weight"):
            live -= w
    return peak


def timeline(layout: Layout, orders: list[list[Pass]], cost: dict[str, float]
             ) -> list[list[tuple[float, float]]]:
    """(start, end) of every pass of every stage when each stage runs its passes in order, a
    pass starting once the stage is free and its input is there (communication free), with
    ``cost`` the time of each phase ("fwd", "bwd", "bwd_input", "bwd_weight", and "fb" for an
    F&B pair, charged to its forward; its backward then costs nothing). Raises ValueError
    where the orders deadlock."""
    nv = layout.nv
    end: dict[tuple[str, int, int, int], float] = {}    # (f|b, line, vs, mb) -> when it is done
    out: list[list[tuple[float, float]]] = [[] for _ in orders]
    nxt = [0] * len(orders)
    free = [0.0] * len(orders)
    pair_end = [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s, order in enumerate(orders):
            while nxt[s] < len(order):
                p = order[nxt[s]]
                line, vs = layout.place(s, p.chunk)
                if p.phase == "fwd":
                    need = [("f", line, vs - 1, p.micro_batch)] if vs > 0 else []
                elif p.phase in BACKWARD:
                    need = [("f", line, vs, p.micro_batch)]
                    need += [("b", line, vs + 1, p.micro_batch)] if vs < nv - 1 else []
                else:
                    need = [("b", line, vs, p.micro_batch)]
                if p.paired:
                    q = order[nxt[s] + 1]
                    ql, qv = layout.place(s, q.chunk)
                    need += [("f", ql, qv, q.micro_batch)] + ([("b", ql, qv + 1, q.micro_batch)] if qv < nv - 1 else [])
                if any(k not in end for k in need):
                    break
                start = max([free[s], *(end[k] for k in need)])
                if nxt[s] > 0 and order[nxt[s] - 1].paired:
                    start, finish = pair_end[s], pair_end[s]
                else:
                    finish = start + cost["fb" if p.paired else p.phase]
                    pair_end[s] = finish
                if p.phase == "fwd":
                    end[("f", line, vs, p.micro_batch)] = finish
                elif p.phase in BACKWARD:
                    end[("b", line, vs, p.micro_batch)] = finish
                out[s].append((start, finish))
                free[s] = finish
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the pass orders deadlock: every stage waits on a pass that never runs")
    return out
