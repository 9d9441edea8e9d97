"""Step times of a serving instance: the simulator on each step's batch shape.

A serving engine's step is one forward over whatever it batched: decode tokens of running
requests and chunks of prompts. What its time depends on is the step's
:class:`~stage_cosim.inference.config.BatchShape` — sequences, new tokens, and per attention
kind the cached tokens read and the (query, key) pairs scored — and that is exactly what
:func:`~stage_cosim.workload.synthesize_step` binds the inference graph to. So a step time is
the simulator's step time of that shape: the number ``simulate --phase …`` prints for a
uniform prefill or decode.

A serving run asks for tens of thousands of shapes, nearly all different (every decode step
adds a token to every cache). Simulating each costs milliseconds, so the timer splits the
step the way its kernels depend on the shape:

* the kernels whose costs depend on the cached tokens or the pairs (the attention core, and
  whatever else reads the cache) are found symbolically — their cost expressions hold the
  symbols ``t`` or ``w`` — and timed exactly for every step, by the same GPU model, from their
  compiled expressions;
* everything else depends on the new tokens (GEMMs, norms, the MoE dispatch, tensor-parallel
  collectives) or on the sequences (the head: last-token logits and sampling), so its time is
  ``f(tokens) + g(sequences)``. Both are read off simulations of one prompt of n tokens and of
  s sequences of one token (two of s + 1 tokens for steps that also prefill), on a grid of n
  and s — 0 … 1/r in steps of one, then geometric with ratio 1 + r — and interpolated linearly
  between grid points.

This holds exactly when those kernels follow each other on the step's critical path (a
single pipeline stage, as serving deployments mostly are), which the timer checks against the
simulator on shapes off the grid's assumptions before it trusts it. Where it does not hold
(pipeline parallelism: the step is the slowest stage's), and with ``resolution=0``, every
shape is simulated — snapped to the grid in each of its totals when r > 0.
``benchmarks/serving_speed.py`` measures the grid's cost in accuracy.

With pipeline parallelism the step's requests are split into up to ``pp`` micro-batches that
follow each other through the stages; the step is simulated as that many micro-batches of the
largest one's shape.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import partial
from typing import Callable

import sympy as sp

from stage_cosim.errors import require
from stage_cosim.graph.dims import B, S, T, W
from stage_cosim.inference.config import BatchShape, InferenceConfig, Sequence
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel.config import ParallelConfig
from stage_cosim.gc_pause import gc_paused
from stage_cosim.schedule.nodes import ceil_int

DEFAULT_RESOLUTION = 1 / 32
_ATTENTION_INPUTS = frozenset((T, W))
_CHECK_TOLERANCE = 1e-6      # relative: the split is exact or it is not used


class Grid:
    """0, 1, …, ⌊1/r⌋, then geometric with ratio 1 + r (rounded to integers, distinct)."""

    def __init__(self, r: float) -> None:
        self.r = r
        self.points: list[int] = list(range(int(1 / r) + 1))

    def _extend(self, v: float) -> None:
        pts = self.points
        while pts[-1] < v:
            pts.append(max(pts[-1] + 1, round(pts[-1] * (1 + self.r))))

    def bracket(self, v: float) -> tuple[tuple[int, float], ...]:
        """The grid points around ``v`` with their interpolation weights (one if on the grid)."""
        self._extend(v)
        pts = self.points
        i = bisect.bisect_left(pts, v)
        if pts[i] == v:
            return ((pts[i], 1.0),)
        lo, hi = pts[i - 1], pts[i]
        f = (v - lo) / (hi - lo)
        return ((lo, 1.0 - f), (hi, f))

    def snap(self, v: float) -> int:
        """The grid point nearest ``v`` (in ratio)."""
        self._extend(v)
        pts = self.points
        i = bisect.bisect_left(pts, v)
        if pts[i] == v or i == 0:
            return pts[i]
        lo, hi = pts[i - 1], pts[i]
        return lo if v * v < lo * hi else hi


@dataclass
class StepTimerStats:
    shapes: int = 0          # steps asked for
    simulations: int = 0     # shapes simulated
    mode: str = "exact"      # "split" (see the module docstring), "exact" or "snapped"
    reason: str = ""         # why the split is not used


@dataclass(frozen=True)
class _AttentionKernel:
    """A kernel whose costs depend on the cached tokens or the pairs, in one kind of layer."""

    layers: int                           # layers of its kind on the stage
    window: int | None
    slot: int                             # the window's place in a BatchShape's per-kind tuples
    cost: Callable[[float, float, float, float], tuple[float, float, float]]   # (b, s, t, w) -> flops, bytes, groups
    price: Callable[[float, float, float, float], float]                        # (flops, bytes, groups, w) -> seconds


def _bind(exprs: list[sp.Expr], symbols: list[sp.Symbol], values: dict) -> Callable[..., list[float]]:
    """``exprs`` as a function of (b, s, t, w), every other symbol bound to ``values``."""
    # the other symbols lead and are bound once (a C-level partial: this runs every step); the
    # generated code is the expressions' whatever the order of its arguments
    rest = [x for x in symbols if x not in (B, S, T, W)]
    fn = sp.lambdify(rest + [B, S, T, W], exprs, modules="math")
    return partial(fn, *(values.get(x, 1) for x in rest))


def _pricer(compute, matmul: str, attention: bool, key_share: float  # noqa: ANN001 (a ComputeModel)
            ) -> Callable[[float, float, float, float], float]:
    """Seconds of one kernel from its cost expressions' values (flops, bytes, groups) and the
    pairs per token ``w``: ``compute.duration_s`` of them as the simulator rounds them.

    A fused attention kernel (the one every step prices) is ComputeModel's attention roofline
    with its per-GPU constants taken out of the step's loop; the same operations in the same
    order, so the same bits (a test holds it to ``duration_s``)."""
    from stage_cosim.adapters.roofline.compute import ATTENTION_FLAVOURS, ComputeModel, matmul_format
    from stage_cosim.adapters.roofline.kernels import InferenceComputeModel

    duration = compute.duration_s
    # (the serving model prices fused attention as the training model does; a flavour with a
    # kernel rate of its own, FlashMLA's, through the model itself)
    if (not attention or type(compute) not in (ComputeModel, InferenceComputeModel)
            or matmul_format(matmul) in ATTENTION_FLAVOURS):
        def price(flops: float, nbytes: float, groups: float, w: float) -> float:
            return duration(ceil_int(flops), ceil_int(nbytes), matmul, attention, max(1, round(groups)),
                            ceil_int(w * key_share))
        return price

    g = compute.gpu
    base = g.peak_tflops(matmul_format(matmul) or "bf16") * 1e12 * g.attention_efficiency
    half_keys, block_rows, sms = g.attention_half_keys, g.attention_block_rows, g.sm_count
    bandwidth = compute.memory_bandwidth
    overhead = g.kernel_overhead_us * 1e-6
    ceil = math.ceil

    def price_attention(flops: float, nbytes: float, groups: float, w: float) -> float:
        f, n = int(ceil(flops - 1e-9)), int(ceil(nbytes - 1e-9))
        rows, keys = round(groups), int(ceil(w * key_share - 1e-9))   # (rows < 1 count as 1: no term either way)
        t_mem = n / bandwidth
        if f > 0:
            rate = base
            if keys > 0:
                rate *= keys / (keys + half_keys)
            if rows > 1 and sms:
                rate *= min(1.0, ceil(rows / block_rows) / sms)
            t_flops = f / rate
            return (t_flops if t_flops >= t_mem else t_mem) + overhead
        return (0.0 if 0.0 >= t_mem else t_mem) + overhead

    return price_attention


class StepTimer:
    """Seconds per step of one serving instance (one model replica, or with attention data
    parallelism one replica per dp rank sharing the experts) for a batch shape."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, inference: InferenceConfig, cluster,  # noqa: ANN001
                 resolution: float = DEFAULT_RESOLUTION, network_model: str = "calibrated") -> None:
        from stage_cosim.adapters.roofline.routing import TokenRouting
        from stage_cosim.adapters.roofline.simulate import make_network
        from stage_cosim.adapters.roofline.kernels import step_compute_model

        require(0 <= resolution < 1, "step-resolution", f"must be in [0, 1), got {resolution!r}")
        self.model = model
        self.parallel = parallel            # the instance's: dp is its attention data-parallel ranks
        self.inference = inference
        self.cluster = cluster
        self.resolution = resolution
        self.windows = tuple(sorted(set(model.layer_windows()), key=lambda w: (w is not None, w or 0)))
        self.grid = Grid(resolution) if resolution > 0 else None
        # GEMMs from the measured microbenchmarks, not the training fit's small-GEMM knee: the
        # kernel model of every inference step (simulate --phase prices the same step the same)
        self._compute = step_compute_model(cluster.gpu, inference=True)
        # the routed tokens' deduplication as ``simulate --phase`` prices it (a flex dispatcher)
        # with its one-domain all-reduces at the GPU's measured nccl-tests sweep (reduce-scatters and
        # all-gathers at half of it), as simulate --phase
        self._network = make_network(network_model, cluster, TokenRouting.of(model, parallel), inference=True)
        self._simulated: dict[tuple, float] = {}
        self._pars: dict[int, ParallelConfig] = {}
        self._kernels: dict[bool, list[_AttentionKernel]] = {}    # by decode-only (latent attention absorbed)
        self._rest: dict[tuple[str, int], float] = {}             # the grid's f and g values
        self._interpolated: dict[tuple[str, int], float] = {}     # and between them
        self.stats = StepTimerStats()
        self._split: bool | None = None if (self.grid is not None and parallel.pp == 1) else False
        if self._split is False:
            self.stats.mode = "snapped" if self.grid is not None else "exact"
            if self.grid is not None:
                self.stats.reason = "pipeline parallelism: a step is its slowest stage's"

    # -- the simulator ------------------------------------------------------------------------

    def parallel_for(self, micro_batches: int) -> ParallelConfig:
        """The instance's configuration running ``micro_batches`` micro-batches per dp rank."""
        par = self._pars.get(micro_batches)
        if par is None:
            inf = replace(self.inference, phase="decode", batch=self.parallel.dp * micro_batches, micro_batch=1)
            par = self._pars[micro_batches] = inf.parallel(self.parallel, self.model)
        return par

    def workload(self, shape: BatchShape, micro_batches: int = 1):  # noqa: ANN201 (Workload)
        from stage_cosim.workload import synthesize_step

        return synthesize_step(self.model, self.parallel_for(micro_batches), shape,
                               self.inference.kv_cache_dtype, self.inference)

    def simulate(self, shape: BatchShape, micro_batches: int = 1) -> float:
        """The simulator's step time for ``micro_batches`` micro-batches of ``shape`` (no cache)."""
        from stage_cosim.adapters.roofline.fast import simulate_fast

        w = self.workload(shape, micro_batches)
        with gc_paused():
            finishes, _ = simulate_fast(w, self._network, self._compute)
        return max(finishes)

    def _simulated_at(self, shape: BatchShape, m: int = 1) -> float:
        key = (m, shape.sequences, shape.tokens, shape.kv_tokens, shape.pairs)
        t = self._simulated.get(key)
        if t is None:
            t = self._simulated[key] = self.simulate(shape, m)
            self.stats.simulations += 1
        return t

    def split(self, shape: BatchShape) -> tuple[int, BatchShape]:
        """(micro-batches, the largest micro-batch's shape) of a step over the pipeline."""
        m = min(self.parallel.pp, shape.sequences)
        if m <= 1:
            return 1, shape
        return m, BatchShape(-(-shape.sequences // m), -(-shape.tokens // m),
                             tuple((w, -(-kv // m)) for w, kv in shape.kv_tokens),
                             tuple((w, Fraction(p) / m) for w, p in shape.pairs))

    # -- a step -------------------------------------------------------------------------------

    def __call__(self, shape: BatchShape) -> float:
        """Seconds of one step whose requests (on every dp rank alike) have ``shape``."""
        self.stats.shapes += 1
        if self._split is None:
            self._split = self._check_split()
        if self._split:
            # _split_time inlined for a decode step (most steps of a run): the same sums
            s = shape.sequences
            if shape.tokens == s:
                rest = self._interpolated.get(("y", s))
                if rest is None:
                    rest = self._interp("y", s)
                return rest + self._attention(shape)
            return self._split_time(shape)
        m, one = self.split(shape)
        if self.grid is not None:
            g = self.grid.snap
            seqs = g(one.sequences)
            one = BatchShape(seqs, max(seqs, g(one.tokens)), tuple((w, g(kv)) for w, kv in one.kv_tokens),
                             tuple((w, Fraction(g(float(p)))) for w, p in one.pairs))
        return self._simulated_at(one, m)

    def _split_time(self, shape: BatchShape) -> float:
        s, n = shape.sequences, shape.tokens
        if n == s:          # decode only
            rest = self._interp("y", s)
        else:
            rest = self._interp("x", n) + self._interp("z", s) - self._interp("x", s + 1)
        return rest + self._attention(shape)

    def _interp(self, which: str, v: int) -> float:
        key = (which, v)
        out = self._interpolated.get(key)
        if out is None:
            out = self._interpolated[key] = sum(wt * self._rest_at(which, p) for p, wt in self.grid.bracket(v))
        return out

    def _rest_at(self, which: str, p: int) -> float:
        """The grid's values: x(n), one prompt of n tokens; y(s), s sequences of one token; z(s),
        s sequences of s + 1 tokens; each the simulated step less its attention kernels."""
        key = (which, p)
        v = self._rest.get(key)
        if v is None:
            shape = self._reference(which, p)
            v = self._rest[key] = self._simulated_at(shape) - self._attention(shape) if p > 0 else 0.0
        return v

    def _reference(self, which: str, p: int) -> BatchShape:
        ws = frozenset(self.windows)
        if which == "x":
            return BatchShape.uniform(1, p, 0, ws)
        if which == "y":
            return BatchShape.uniform(p, 1, 0, ws)
        return BatchShape.of([Sequence(2)] + [Sequence(1)] * (p - 1), ws)

    # -- the kernels that read the cache ------------------------------------------------------

    def _attention(self, shape: BatchShape) -> float:
        b, n = shape.sequences, shape.tokens
        decode = n == b
        kernels = self._kernels.get(decode)
        if kernels is None:
            kernels = self._kernels[decode] = self._attention_kernels(shape)
        kv_tokens, pairs = shape.kv_tokens, shape.pairs
        s = n / b
        total = 0.0
        for k in kernels:
            # the graph's symbols, as BatchShape.symbols binds them (per-kind tuples in window
            # order: a lookup by position, not a dict per step)
            kv, p = kv_tokens[k.slot], pairs[k.slot]
            if kv[0] != k.window or p[0] != k.window:
                kv, p = (k.window, dict(kv_tokens)[k.window]), (k.window, dict(pairs)[k.window])
            t, w = kv[1] / b, float(p[1]) / n
            flops, nbytes, groups = k.cost(b, s, t, w)
            total += k.layers * k.price(flops, nbytes, groups, w)
        return total

    def _attention_kernels(self, shape: BatchShape) -> list[_AttentionKernel]:
        """The kernels whose costs depend on ``t`` or ``w``, per kind of layer, with their cost
        expressions compiled over (b, s, t, w) for this instance's numbers."""
        from stage_cosim.graph.ir import ATTENTION_KINDS
        from stage_cosim.workload import step_symbol_values

        w = self.workload(shape)
        par = self.parallel_for(1)
        counts: dict[tuple[int, int | None], int] = {}
        compiled_of: dict[int, object] = {}
        for i, (block, _) in enumerate(w._role_args["blocks"].layers):   # noqa: SLF001
            key = (id(block), self.model.layer_window(i))
            counts[key] = counts.get(key, 0) + 1
            compiled_of[id(block)] = block
        out = []
        for (bid, window), layers in counts.items():
            values = step_symbol_values(self.model, par, window)
            symbols = sorted(set(values) | {B, S, T, W}, key=str)
            for st in compiled_of[bid].sharded.fwd:
                exprs = [sp.sympify(e) for e in (st.flops, st.mem_bytes, st.groups)]
                if st.kind != "compute" or not (st.key_share or any(e.free_symbols & _ATTENTION_INPUTS for e in exprs)):
                    continue
                out.append(_AttentionKernel(layers, window, self.windows.index(window), _bind(exprs, symbols, values),
                                            _pricer(self._compute, st.matmul, st.category in ATTENTION_KINDS,
                                                    st.key_share)))
        return out

    def _check_split(self) -> bool:
        """Whether the split reproduces the simulator on shapes of every kind (a mixed step,
        decode steps, one with sliding windows full): it is exact or it is not used."""
        ws = frozenset(self.windows)
        probes = [BatchShape.uniform(3, 1, 700, ws),
                  BatchShape.of([Sequence(1, 900), Sequence(5, 40), Sequence(1, 3)], ws),
                  BatchShape.of([Sequence(7, 0), Sequence(1, 2000)], ws)]
        for shape in probes:
            want = self._simulated_at(shape)
            got = self._split_time(shape)
            if abs(got - want) > _CHECK_TOLERANCE * want:
                self.stats.mode = "snapped"
                self.stats.reason = (f"the split is {100 * (got - want) / want:+.3g} % off the simulator on a "
                                     f"probe step: kernels overlap on the critical path")
                self._rest.clear()
                self._interpolated.clear()
                return False
        self.stats.mode = "split"
        return True
