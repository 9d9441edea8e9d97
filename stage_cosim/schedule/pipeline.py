"""Pipeline schedules: the order of forward and backward passes on one pipeline stage.

A pass is ``(phase, micro_batch, chunk)``; ``chunk`` is the model chunk (virtual stage index
``chunk * pp + stage``) for the interleaved schedule and 0 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["fwd", "bwd"]


@dataclass(frozen=True)
class Pass:
    phase: Phase
    micro_batch: int
    chunk: int


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


def schedule_order(schedule: str, pp: int, stage: int, m: int, vp: int = 1) -> list[Pass]:
    if schedule == "gpipe":
        return gpipe(pp, stage, m)
    if schedule == "1f1b":
        return one_f_one_b(pp, stage, m)
    if schedule == "interleaved":
        return interleaved(pp, stage, m, vp)
    raise ValueError(f"unknown schedule {schedule!r}")


def peak_in_flight(order: list[Pass], weight: dict[int, float] | None = None) -> float:
    """Most forward passes held (awaiting their backward) at once, each chunk weighted."""
    live = peak = 0.0
    for p in order:
        w = weight.get(p.chunk, 1.0) if weight else 1.0
        if p.phase == "fwd":
            live += w
            peak = max(peak, live)
        else:
            live -= w
    return peak
