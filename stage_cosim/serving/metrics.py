"""What a serving run measured: latency percentiles, throughput, goodput under SLOs, KV-cache
occupancy over time, and Little's law as a check of the run's own bookkeeping.

* TTFT: arrival to the first output token (the prefill's last chunk);
* TPOT: a request's mean time per output token after the first, (end − first token) / (n − 1);
* ITL: every gap between two consecutive output tokens of a request, over all requests;
* end-to-end latency: arrival to the last token;
* goodput: completed requests per second that met every SLO given (DistServe's definition of
  the rate that counts), with the attainment (the share of requests that met them); a request
  dropped at its client timeout never counts;
* prefix caching: the share of admitted prompt tokens served from cached blocks (vLLM's hit
  rate), and the blocks evicted; with KV offload, the tokens of those hits loaded back from host
  memory, the blocks stored there and loaded back, and the step time spent on the loads;
* Little's law: the time-averaged number of requests in the engines (read off their queues
  and batches) equals the arrival rate times the mean time in the system over a window where
  the system starts and ends empty; the report gives both sides.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stage_cosim.serving.config import SLO
from stage_cosim.serving.engine import Trace
from stage_cosim.serving.scheduler import RequestLog

PERCENTILES = (50, 90, 99)
KV_POINTS = 200            # KV-occupancy samples kept in the report


def _stats(x: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float | None]:
    if len(x) == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    if weights is None:
        pct = np.percentile(x, PERCENTILES)
        mean = float(np.mean(x))
    else:
        order = np.argsort(x)
        xs, cw = x[order], np.cumsum(weights[order])
        pct = [xs[min(len(xs) - 1, int(np.searchsorted(cw, p / 100 * cw[-1])))] for p in PERCENTILES]
        mean = float(np.average(x, weights=weights))
    return {"mean": mean, **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}, "max": float(np.max(x))}


def steady_rate(finish: np.ndarray) -> float:
    """Completions per second between the 20th and the 80th percentile of completion times: the
    rate of a run past its start and before its last requests drain (with every request queued
    at once, the engine's capacity)."""
    if len(finish) < 5:
        return 0.0
    t = np.sort(finish)
    i, j = int(0.2 * (len(t) - 1)), int(0.8 * (len(t) - 1))
    return (j - i) / (t[j] - t[i]) if t[j] > t[i] else 0.0


def occupancy_mean(trace: Trace, t0: float, t1: float) -> float:
    """Time-averaged number of requests in the engines over [t0, t1] (from their queues)."""
    t = np.asarray(trace.occupancy_t)
    n = np.asarray(trace.occupancy_n, dtype=np.float64)
    if t1 <= t0 or len(t) == 0:
        return 0.0
    edges = np.clip(np.append(t, t1), t0, t1)
    return float(np.sum(n * np.diff(edges)) / (t1 - t0))


class _Columns:
    """A run's request log as arrays."""

    def __init__(self, log: RequestLog) -> None:
        for name in ("arrival", "first_token", "finish", "drop_time"):
            setattr(self, name, np.asarray(getattr(log, name), dtype=np.float64))
        for name in ("input_len", "output_len", "preemptions"):
            setattr(self, name, np.asarray(getattr(log, name), dtype=np.int64))
        self.rejected = np.asarray(log.rejected, dtype=bool)
        self.dropped = np.asarray(log.dropped, dtype=bool)
        gaps = np.asarray(log.itl, dtype=np.float64).reshape(-1, 2)
        self.itl, self.itl_weight = gaps[:, 0], gaps[:, 1]


def summarize(log: RequestLog, trace: Trace, slo: SLO, gpus: int) -> dict[str, Any]:
    log = _Columns(log)  # type: ignore[assignment]
    done = ~np.isnan(log.finish) & ~log.rejected & ~log.dropped
    n_done = int(np.count_nonzero(done))
    start = float(log.arrival[0]) if len(log.arrival) else 0.0
    span = max(trace.end_s - start, 1e-12)
    ttft = (log.first_token - log.arrival)[done]
    e2e = (log.finish - log.arrival)[done]
    multi = done & (log.output_len > 1)
    tpot = ((log.finish - log.first_token) / np.maximum(1, log.output_len - 1))[multi]
    out_tokens = int(np.sum(log.output_len[done]))
    in_tokens = int(np.sum(log.input_len[done]))
    met = done.copy()
    if slo.ttft_s is not None:
        met &= (log.first_token - log.arrival) <= slo.ttft_s
    if slo.tpot_s is not None:
        met &= ~multi | (((log.finish - log.first_token) / np.maximum(1, log.output_len - 1)) <= slo.tpot_s)
    n_met = int(np.count_nonzero(met))
    # Little's law over the whole run (empty at both ends): rejected and dropped requests count
    # too, for the time they waited; the time is the engines' (less the API server's share)
    left_at = np.where(log.dropped, log.drop_time, log.finish)
    left = ~np.isnan(left_at)
    in_system = occupancy_mean(trace, start, trace.end_s)
    rate = len(log.arrival) / span
    in_engine = left_at - log.arrival - np.where(log.dropped | log.rejected, 0.0, trace.request_overhead_s)
    mean_time = float(np.mean(in_engine[left])) if left.any() else 0.0
    little = rate * mean_time * np.count_nonzero(left) / max(1, len(log.arrival))
    kv_t = np.asarray(trace.kv_time)
    kv_u = np.asarray(trace.kv_used)
    pick = np.unique(np.linspace(0, len(kv_t) - 1, min(KV_POINTS, len(kv_t))).astype(int)) if len(kv_t) else []
    steps = np.asarray(trace.step_time_s)
    return {
        "requests": {"total": len(log.arrival), "completed": n_done, "rejected": int(np.count_nonzero(log.rejected)),
                     "dropped": int(np.count_nonzero(log.dropped)),
                     "preempted": int(np.count_nonzero(log.preemptions)),
                     "preemptions": int(np.sum(log.preemptions)),
                     "input_tokens": in_tokens, "output_tokens": out_tokens},
        "duration_s": span,
        "latency_s": {"ttft": _stats(ttft), "tpot": _stats(tpot), "itl": _stats(log.itl, log.itl_weight), "e2e": _stats(e2e)},
        "throughput": {"requests_per_s": n_done / span, "steady_requests_per_s": steady_rate(log.finish[done]),
                       "output_tokens_per_s": out_tokens / span,
                       "total_tokens_per_s": (in_tokens + out_tokens) / span,
                       "output_tokens_per_s_per_gpu": out_tokens / span / gpus,
                       "total_tokens_per_s_per_gpu": (in_tokens + out_tokens) / span / gpus},
        "slo": {**slo.to_dict(), "attainment": n_met / max(1, len(log.arrival)), "goodput_requests_per_s": n_met / span,
                "goodput_requests_per_s_per_gpu": n_met / span / gpus},
        "prefix_cache": {"hit_rate": trace.prefix_hit_tokens / trace.prefix_queried_tokens
                         if trace.prefix_queried_tokens else 0.0,
                         "hit_tokens": trace.prefix_hit_tokens, "queried_tokens": trace.prefix_queried_tokens,
                         "evicted_blocks": trace.prefix_evicted_blocks},
        # the prefix cache's host tier: its hits are part of the prefix cache's
        "kv_offload": {"hit_tokens": trace.offload_hit_tokens, "stored_blocks": trace.offload_stored_blocks,
                       "loaded_blocks": trace.offload_loaded_blocks, "load_time_s": trace.offload_load_s},
        "steps": {"count": trace.steps, "time_s": _stats(steps),
                  "decodes_per_step": _stats(np.asarray(trace.step_decodes, dtype=np.float64))},
        "kv_cache": {"peak_occupancy": float(np.max(kv_u)) / trace.kv_capacity if len(kv_u) else 0.0,
                     "mean_occupancy": (float(np.sum(kv_u[:-1] * np.diff(kv_t))) / max(1e-12, float(kv_t[-1] - kv_t[0]))
                                        / trace.kv_capacity) if len(kv_u) > 1 else 0.0,
                     "time_s": [float(kv_t[i]) for i in pick],
                     "occupancy": [float(kv_u[i]) / trace.kv_capacity for i in pick]},
        "littles_law": {"in_system_mean": in_system, "arrival_rate": rate, "time_in_system_mean_s": mean_time,
                        "rate_times_time": little,
                        "relative_error": abs(in_system - little) / in_system if in_system else 0.0},
    }
