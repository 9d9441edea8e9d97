"""Inference steps' tensor-parallel all-reduces at the measured nccl-tests curve of their GPU.

The calibrated network prices an all-reduce inside one NVSwitch domain by the link rate its fit
found for large buffers (hundreds of MB to GB: a training step's gradient buckets) and a latency
of a few microseconds. A decode step's all-reduces are its activations: tokens x hidden x 2
bytes, 4-70 MB for a 405B model at tp8 and a few hundred requests. In that range NCCL runs far
below its large-buffer rate — nccl-tests on an 8-GPU H100 node measure a bus bandwidth of
129 GB/s at 4 MiB, 172 at 8 MiB, 234 at 16 MiB and 362 at 64 MiB, where the fit reaches about
470 — so a 16 MiB all-reduce takes 125 us, not the 63 us the fit gives. A serving step pays
that 252 times for a 126-layer model.

So where ``nccl_busbw.csv`` has a size sweep of the all-reduce over the same number of GPUs of
the same part on one node, an inference step's all-reduce over one scale-up domain takes at
least the measured time at its size (interpolated in log size and log time between measured
sizes; the fastest algorithm measured at each size, as NCCL picks), and never less than the
network model's. Training steps keep the calibrated network: its fit is of their buckets.

A reduce-scatter or all-gather over the same GPUs takes at least half the measured all-reduce of
the same whole buffer (a reduce-scatter's input, an all-gather's output). NCCL runs an
all-reduce as those two halves over one buffer — ring: n-1 reduce-scatter steps, then n-1
all-gather steps; NVLS: a multicast load-reduce of each rank's slice, then a multicast store of
it — and where both are measured on one node at one size their bus bandwidths match the
all-reduce's (nccl-tests on 8 H200 at 16 GiB, ring: all-reduce 367, all-gather 361,
reduce-scatter 363 GB/s, ``nccl_busbw.csv``). No sweep of either is published at the sizes a
step moves; this is where an attention-data-parallel MoE step meets them: TensorRT-LLM's MoE
with attention DP on Hopper gathers every rank's tokens and reduce-scatters the experts'
output for all of them (a 16 MiB BF16 buffer per rank for 2,048 tokens of hidden 4,096), each
layer. Everything else is the network model's.
"""

from __future__ import annotations

import bisect
import csv
import math
from functools import lru_cache
from importlib import resources
from typing import Any, Sequence

MIN_SIZES = 4        # a sweep: at least this many sizes (single-size rows pin no curve)


@lru_cache(maxsize=None)
def measured_allreduce(part: str, gpus: int) -> tuple[tuple[float, float], ...]:
    """(bytes per rank, seconds) of nccl-tests' all-reduce over ``gpus`` GPUs of ``part`` on
    one node, by size (the fastest measurement at each size), or () without a size sweep.
    nccl-tests' bus bandwidth is algbw * 2(n-1)/n, algbw = bytes / time."""
    best: dict[int, float] = {}
    with resources.files("stage_cosim.validation").joinpath("data", "nccl_busbw.csv").open() as f:
        for r in csv.DictReader(f):
            if (r["gpu"] != part or r["collective"] != "all_reduce" or r["nodes"] != "1" or int(r["gpus"]) != gpus
                    or r["latest_in_source"] != "true" or not r["busbw_gbps"] or float(r["busbw_gbps"]) <= 0):
                continue
            nbytes = int(r["bytes"])
            algbw = float(r["busbw_gbps"]) * 1e9 * gpus / (2 * (gpus - 1))
            t = nbytes / algbw
            best[nbytes] = min(best.get(nbytes, math.inf), t)
    if len(best) < MIN_SIZES:
        return ()
    return tuple(sorted(best.items()))


def measured_time(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """The measured time at ``nbytes``: log-log between measured sizes; below the smallest, its
    time (a latency floor); above the largest, its bandwidth."""
    sizes = [p[0] for p in points]
    if nbytes <= sizes[0]:
        return points[0][1]
    if nbytes >= sizes[-1]:
        return points[-1][1] * nbytes / sizes[-1]
    i = bisect.bisect_left(sizes, nbytes)
    (s0, t0), (s1, t1) = points[i - 1], points[i]
    x = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return math.exp(math.log(t0) + x * (math.log(t1) - math.log(t0)))


#: the collectives the sweep bounds, and the share of an all-reduce of the same whole buffer each is
#: (see the module)
_SHARE = {"ALL_REDUCE": 1.0, "REDUCE_SCATTER": 0.5, "ALL_GATHER": 0.5}


class MeasuredAllReduce:
    """The network model with its one-domain all-reduces (and reduce-scatters and all-gathers,
    at their half of one) no faster than the measured sweep (see the module); every other call
    is the model's."""

    def __init__(self, network: Any, part: str) -> None:
        self._net = network
        self._part = part
        self._cache: dict[tuple[int, int], float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._net, name)

    def _floor(self, nbytes: int, members: Sequence[int]) -> float:
        n = len(members)
        key = (nbytes, n)
        t = self._cache.get(key)
        if t is None:
            points = measured_allreduce(self._part, n) if n > 1 else ()
            one_domain = n > 1 and self._net._shape(members)[0] == 1      # noqa: SLF001
            t = self._cache[key] = measured_time(points, nbytes) if points and one_domain else 0.0
        return t

    def floor(self, coll: str, nbytes: int, members: Sequence[int]) -> float:
        """The measured lower bound of ``coll`` (0: none). ``nbytes`` as the network takes it:
        an all-reduce's and a reduce-scatter's each rank's whole buffer, an all-gather's each
        rank's shard (its whole output is n of them)."""
        share = _SHARE.get(coll)
        if share is None:
            return 0.0
        whole = nbytes * len(members) if coll == "ALL_GATHER" else nbytes
        return share * self._floor(whole, members)

    def timed(self, coll: str, nbytes: int, members: Sequence[int], algorithm: str | None = None) -> tuple[float, str]:
        t, name = self._net.timed(coll, nbytes, members, algorithm)
        return max(t, self.floor(coll, nbytes, members)), name

    def duration(self, coll: str, nbytes: int, members: Sequence[int], algorithm: str | None = None) -> float:
        return self.timed(coll, nbytes, members, algorithm)[0]

    def span(self, coll: str, nbytes: int, members: Sequence[int], kind: str = "") -> float:
        """From the last member's issue to every member's finish (the engines' fast replay)."""
        return max(self._net.span(coll, nbytes, members, kind), self.floor(coll, nbytes, members))

    def collective(self, coll: str, nbytes: int, members: Sequence[int], starts: Sequence[float],
                   kind: str = "", **_: Any) -> list[float]:
        ends = self._net.collective(coll, nbytes, members, starts, kind=kind)
        floor = self.floor(coll, nbytes, members)
        if floor <= 0.0:
            return ends
        # no member finishes before the last one's issue plus the measured time
        earliest = max(starts) + floor
        return [e if e >= earliest else earliest for e in ends]

    @property
    def identity(self) -> Any:
        """The model's identity and the sweep's part (runs kept for the bare model are not
        this network's); None where the model says none (nothing is kept)."""
        inner = getattr(self._net, "identity", None)
        return None if inner is None else (type(self).__name__, self._part, inner)


def step_network(network: Any, cluster: Any, inference: bool) -> Any:
    """The network an inference step runs on: ``network`` with measured all-reduces where the
    GPU's part has a sweep; a training step's ``network`` as it is."""
    from stage_cosim.adapters.roofline.kernels import part_of

    part = part_of(cluster.gpu) if inference else None
    return MeasuredAllReduce(network, part) if part else network
