"""What one inference step runs: a prefill of prompts or a decode step, and the batch's shape.

An inference step is the forward of every block over a batch of requests, with each
request's keys and values kept in a KV cache from step to step:

* a **prefill** of ``batch`` prompts of ``input_len`` tokens each: attention over the prompt
  (causal), its keys and values written to the cache, the first output token sampled;
* a **decode** step of ``batch`` requests: one new token each, whose attention reads the
  ``context_len`` tokens of its cache (the new one included), GEMMs with one row per request.

A serving engine mixes both in one step (continuous batching with chunked prefill). What the
graph's costs depend on is the :class:`BatchShape` of a micro-batch: how many sequences, how
many new tokens, and per layer kind how many cached tokens the attention reads and how many
(query, key) pairs it scores. A uniform prefill or decode is one such shape; so is any mix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from stage_cosim.errors import positive_int, require
from stage_cosim.model.architecture import ChunkSpan

PHASES = ("prefill", "decode")
TRAIN = "train"
KV_CACHE_DTYPES = ("bf16", "fp8")
# How the layers' GEMM weights are stored and computed with (see
# :func:`~stage_cosim.graph.precision.inference_precision`): BF16; FP8 weights and activations
# (W8A8, FP8 GEMMs); 4-bit weights with a scale per group of 128, BF16 GEMMs (W4A16).
WEIGHT_DTYPES = ("bf16", "fp8", "int4")
# How FP8 weights' GEMMs scale their input activations, in the vocabulary of vLLM's FP8 checkpoints
# (``activation_scheme``): a per-tensor scale calibrated offline and stored with the checkpoint
# (what NVIDIA ModelOpt's FP8 checkpoints ship), so the kernel that produces a GEMM's input may
# write it in FP8; or one computed from each tensor as it comes (an amax pass, then the cast).
FP8_ACTIVATION_SCALES = ("static", "dynamic")
# Training options that mean nothing in an inference step, with the value that leaves them off.
TRAINING_ONLY = {"vp": 1, "sp": False, "tp_comm_overlap": False, "zero": 0, "recompute": "none", "dtype": "bf16"}


def attention_pairs(new: int, past: int, window: int | None) -> int:
    """(query, key) pairs ``new`` tokens appended after ``past`` cached ones score: token i of
    the sequence, counting from 1, sees min(i, window) keys (in a chunked layer, the i - k*c
    keys of its own chunk [k*c + 1, i]). An integer, so a serving step sums them without
    fractions."""
    if isinstance(window, ChunkSpan):
        return _chunked_pairs(past + new, int(window)) - _chunked_pairs(past, int(window))
    w = window if window is not None else past + new
    lo, hi = past + 1, past + new                 # positions of the new tokens
    if hi <= w:
        return (lo + hi) * new // 2
    if lo > w:
        return new * w
    return (lo + w) * (w - lo + 1) // 2 + (hi - w) * w    # below the window, then capped by it


def _chunked_pairs(n: int, c: int) -> int:
    """Pairs the first ``n`` tokens of a sequence score in a layer of ``c``-token chunks: each
    full chunk c(c+1)/2, the last partial one of r tokens r(r+1)/2."""
    full, rest = divmod(n, c)
    return full * c * (c + 1) // 2 + rest * (rest + 1) // 2


def attention_span(new: int, past: int, window: int | None) -> Fraction:
    """Keys a causal query attends to, on average over ``new`` tokens appended after ``past``
    cached ones (token i of the sequence, counting from 1, sees min(i, window) keys)."""
    return Fraction(attention_pairs(new, past, window), new)


def held(new: int, past: int, window: int | None) -> int:
    """Tokens of one sequence the cache of a layer holds after the step (the last ``window``).

    A chunked layer holds the tokens of the current chunk only, from its start to the last
    token: no later query reads an earlier chunk's keys, so its blocks are freed, as vLLM's
    hybrid KV-cache manager and llama.cpp's chunked cache do (vLLM without the hybrid manager
    keeps every token's keys in these layers too: more memory, the same reads)."""
    ctx = past + new
    if isinstance(window, ChunkSpan):
        return (ctx - 1) % int(window) + 1 if ctx else 0
    return ctx if window is None else min(ctx, window)


@dataclass(frozen=True)
class Sequence:
    """One request's part of a step: ``new`` tokens appended after ``past`` cached ones."""

    new: int
    past: int = 0


@dataclass(frozen=True)
class BatchShape:
    """One micro-batch of one model replica, as far as costs go.

    ``kv_tokens`` and ``pairs`` are per layer kind (a sliding window, or None for global
    attention): the cached tokens the attention reads, summed over the sequences (what its
    cache holds after the step's append), and the (query, key) pairs it scores.
    """

    sequences: int
    tokens: int
    kv_tokens: tuple[tuple[int | None, int], ...]
    pairs: tuple[tuple[int | None, Fraction], ...]

    @classmethod
    def of(cls, seqs: list[Sequence] | tuple[Sequence, ...], windows: set[int | None] | frozenset) -> "BatchShape":
        kv = tuple((w, sum(held(s.new, s.past, w) for s in seqs)) for w in sorted(windows, key=_order))
        pairs = tuple((w, sum((attention_span(s.new, s.past, w) * s.new for s in seqs), Fraction(0)))
                      for w in sorted(windows, key=_order))
        return cls(len(seqs), sum(s.new for s in seqs), kv, pairs)

    @classmethod
    def uniform(cls, sequences: int, new: int, past: int, windows: set[int | None] | frozenset) -> "BatchShape":
        """``sequences`` alike: the shape of a plain prefill or decode step."""
        kv = tuple((w, sequences * held(new, past, w)) for w in sorted(windows, key=_order))
        pairs = tuple((w, sequences * new * attention_span(new, past, w)) for w in sorted(windows, key=_order))
        return cls(sequences, sequences * new, kv, pairs)

    def halves(self) -> tuple["BatchShape", "BatchShape"]:
        """The shape split into two micro-batches (two-batch overlap): ceil(b/2) and floor(b/2)
        sequences, each with the share of the new tokens, cached tokens and pairs its sequences
        hold (exact for a uniform shape; for a mix, the totals are split in proportion)."""
        require(self.sequences >= 2, "two-batch-overlap",
                f"splits a micro-batch's requests in two; needs at least 2, got {self.sequences}")
        a = -(-self.sequences // 2)

        def part(total: int, floor: int) -> int:
            return max(floor, min(total - floor, round(total * a / self.sequences)))

        tokens = part(self.tokens, a)
        kv = [(w, part(n, 0)) for w, n in self.kv_tokens]
        pairs = [(w, p * a / self.sequences) for w, p in self.pairs]
        first = BatchShape(a, tokens, tuple(kv), tuple(pairs))
        second = BatchShape(self.sequences - a, self.tokens - tokens,
                            tuple((w, n - m) for (w, n), (_, m) in zip(self.kv_tokens, kv)),
                            tuple((w, p - q) for (w, p), (_, q) in zip(self.pairs, pairs)))
        return first, second

    def symbols(self, window: int | None) -> tuple[float, float, float, float]:
        """(sequences b, new tokens per sequence s, cached tokens per sequence t, keys per
        query w) for a layer with ``window``: the graph's symbols, whose products are exactly
        the shape's totals (b*s tokens, b*t cached tokens, b*s*w pairs)."""
        kv = dict(self.kv_tokens)[window]
        pairs = dict(self.pairs)[window]
        b = self.sequences
        return b, self.tokens / b, kv / b, float(pairs) / self.tokens


def _order(w: int | None) -> tuple[int, int, bool]:
    return (0, 0, False) if w is None else (1, w, isinstance(w, ChunkSpan))


@dataclass(frozen=True)
class InferenceConfig:
    """A uniform inference step: a prefill or a decode step of ``batch`` requests.

    ``batch`` counts the requests of the whole step over every data-parallel replica (each runs
    ``batch / dp``), split into the pipeline's micro-batches; ``context_len`` is what each
    decoding request's new token attends to (its prompt and every token generated so far, the
    new one included).
    """

    phase: str
    """The inference step: a prefill of prompts or one decode step (the command line's --phase
    also takes train, a training step, its default)."""
    batch: int = 1
    """Inference: requests in the step, over all dp replicas (default 1)."""
    input_len: int = 2048
    """Prefill: prompt tokens per request (default 2048)."""
    context_len: int = 2048
    """Decode: tokens each request's new token attends to, itself included (default 2048)."""
    kv_cache_dtype: str = "bf16"
    """Inference: precision of the KV cache (default bf16)."""
    micro_batch: int | None = None
    """Requests per pipeline micro-batch on one replica (default: the replica's requests split
    into pp micro-batches when they divide, so that every stage has work; else one)."""
    attention_dp: bool = False
    """Inference with experts: DeepSeek-style attention data parallelism (each dp rank runs the
    attention on its own requests and the ranks share the experts, sharded over every rank of
    the expert mesh: expert-tp*ep may span dp). Without it the dp replicas are independent model
    instances, each holding every expert (expert-tp*ep divides tp)."""
    weight_dtype: str = "bf16"
    """Inference: the layers' GEMM weights: bf16 (default), fp8 (W8A8: FP8 GEMMs, activations
    quantized per tensor) or int4 (W4A16: 4-bit weights, a scale per 128, BF16 GEMMs)."""
    fp8_activation_scale: str = "static"
    """Inference with fp8 weights: activation scales calibrated offline and stored with the
    checkpoint (static, default: the producing kernel writes FP8) or computed per tensor as it
    comes (dynamic: an amax pass and a cast)."""
    two_batch_overlap: bool = False
    """Inference: DeepSeek's dual-batch overlap (SGLang's --enable-two-batch-overlap): each
    micro-batch as two run at once on the rank, one's communication (the experts' all-to-alls)
    behind the other's compute."""

    def __post_init__(self) -> None:
        require(self.phase in PHASES, "phase", f"must be one of {', '.join((TRAIN,) + PHASES)}, got {self.phase!r}")
        for name in ("batch", "input_len", "context_len"):
            positive_int(getattr(self, name), name.replace("_", "-"))
        if self.micro_batch is not None:
            positive_int(self.micro_batch, "micro-batch")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv-cache-dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        require(self.weight_dtype in WEIGHT_DTYPES, "weight-dtype",
                f"must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        require(isinstance(self.attention_dp, bool), "attention-dp", f"must be true or false, got {self.attention_dp!r}")
        require(self.fp8_activation_scale in FP8_ACTIVATION_SCALES, "fp8-activation-scale",
                f"must be one of {', '.join(FP8_ACTIVATION_SCALES)}, got {self.fp8_activation_scale!r}")
        require(self.fp8_activation_scale == "static" or self.weight_dtype == "fp8", "fp8-activation-scale",
                f"scales the activations of FP8 GEMMs: it needs --weight-dtype fp8, got {self.weight_dtype}")
        require(isinstance(self.two_batch_overlap, bool), "two-batch-overlap",
                f"must be true or false, got {self.two_batch_overlap!r}")

    @property
    def new_tokens(self) -> int:
        """New tokens per request in the step."""
        return self.input_len if self.phase == "prefill" else 1

    @property
    def past_tokens(self) -> int:
        """Tokens already in each request's cache before the step."""
        return 0 if self.phase == "prefill" else self.context_len - 1

    @property
    def context(self) -> int:
        """Each request's context after the step (what its cache holds)."""
        return self.past_tokens + self.new_tokens

    def parallel(self, parallel: "ParallelConfig", model: "ModelConfig | None" = None) -> "ParallelConfig":  # noqa: F821
        """``parallel`` as this step runs it: ``batch / dp`` requests per replica in
        micro-batches of ``micro_batch``, ``new_tokens`` per request, forward passes in order.
        With ``model``, the rules that tie the inference layout to the model are checked too
        (attention data parallelism needs experts)."""
        from dataclasses import replace

        # (sequence parallelism and its tp overlap are training switches: a profile's default
        # for them does not apply to an inference step, a request that sets them is refused)
        for key, off in TRAINING_ONLY.items():
            if key not in parallel.assumed:
                require(getattr(parallel, key) == off, key.replace("_", "-"),
                        f"is a training option (an inference step has no backward), got {getattr(parallel, key)!r}")
        assumed = {k: off for k, off in TRAINING_ONLY.items() if k in parallel.assumed}
        if assumed:
            parallel = replace(parallel, **assumed)
        require(parallel.cp == 1 or self.phase == "prefill", "cp",
                f"context parallelism shards a prefill's prompts; a decode step (one new token per request) "
                f"runs with cp = 1, got {parallel.cp}")
        if parallel.cp > 1:
            chunks = 2 * parallel.cp if parallel.cp_load_balance else parallel.cp
            require(self.input_len % chunks == 0, "input-len",
                    f"must be divisible by {'2*cp' if parallel.cp_load_balance else 'cp'} = {chunks} (the prompts are "
                    f"cut into that many chunks over cp), got {self.input_len}")
        self._check_experts(parallel, model)
        dp = parallel.dp
        require(self.batch % dp == 0, "batch", f"must be divisible by dp ({dp}), got {self.batch}")
        per = self.batch // dp
        mb = self.micro_batch or (per // parallel.pp if per % parallel.pp == 0 else per)
        require(per % mb == 0, "micro-batch",
                f"must divide the {per} requests of each data-parallel replica, got {mb}")
        if self.two_batch_overlap:
            self._check_two_batch_overlap(parallel)
        return replace(parallel, micro_batch=mb, global_batch=self.batch, seq_len=self.new_tokens, schedule="gpipe",
                       vp=1, pp_layers=parallel.pp_layers)

    @staticmethod
    def _check_two_batch_overlap(parallel: "ParallelConfig") -> None:  # noqa: F821
        """Two-batch overlap hides one micro-batch's collectives behind the other's compute: it
        needs layers that communicate. (A micro-batch of one request cannot be split: it runs
        whole, as SGLang runs it.)"""
        require(parallel.tp > 1 or parallel.ep > 1 or parallel.expert_tp > 1, "two-batch-overlap",
                "overlaps one micro-batch's communication with the other's compute; with tp = ep = expert-tp = 1 "
                "the layers communicate nothing")
        require(parallel.cp == 1, "two-batch-overlap",
                f"is not modelled with context parallelism (its ring would interleave two passes), "
                f"got cp = {parallel.cp}")

    def _check_experts(self, parallel: "ParallelConfig", model: "ModelConfig | None") -> None:  # noqa: F821
        """Independent replicas keep the expert mesh inside one replica's tensor-parallel ranks;
        attention data parallelism shares it over every rank of a stage (and needs experts)."""
        if model is not None:
            require(not self.attention_dp or model.is_moe, "attention-dp",
                    f"shares the experts between the dp ranks' attention; {model.name} has no experts")
        if self.attention_dp:
            return
        replica = parallel.tp * parallel.cp
        ranks = f"tp*cp = {parallel.tp}*{parallel.cp}" if parallel.cp > 1 else f"tp = {parallel.tp}"
        require(replica % (parallel.expert_tp * parallel.ep) == 0, "ep",
                f"expert-tp*ep = {parallel.expert_tp}*{parallel.ep} must divide {ranks}: without --attention-dp the "
                f"dp replicas are independent model instances, each holding every expert (--attention-dp shares "
                f"the experts over the dp ranks)")
        # the expert mesh takes the stage's ranks innermost first: a replica's are those only if
        # dp is the outermost of its axes
        inner = [a for a in parallel.axis_order if a in ("tp", "cp", "dp")]
        require(parallel.dp == 1 or parallel.expert_tp * parallel.ep == 1 or inner[-1] == "dp", "axis-order",
                f"without --attention-dp each dp replica's expert ranks must be its own: dp must come after tp and "
                f"cp, got {','.join(parallel.axis_order)}")

    def shape(self, sequences: int, windows: set[int | None] | frozenset) -> BatchShape:
        return BatchShape.uniform(sequences, self.new_tokens, self.past_tokens, windows)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
