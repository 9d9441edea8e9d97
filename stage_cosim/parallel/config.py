"""ParallelConfig: everything about *how* a model is trained that is not the model or the machine."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, get_args

from stage_cosim.errors import positive_int, require
from stage_cosim.limits import MAX_RANKS, MAX_RANKS_TEXT
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel.axes import DENSE, EXPERT, MESHES, expert_order
from stage_cosim.parallel.software import DEFAULT_SOFTWARE, PROFILE_SWITCHES, get_software

MESH_AXES = MESHES[DENSE]                 # the axes a rank's position is given on
DEFAULT_AXIS_ORDER = MESHES[DENSE]        # innermost first: tp groups fall inside a node

# Each vocabulary once, as the type of its field; the tuple of choices is derived from it.
# zb-h1 / zb-v: Qi et al.'s zero-bubble schedules (the backward split into input and weight
# gradients); dualpipe / dualpipev: DeepSeek-V3's bidirectional schedule and its V variant.
Schedule = Literal["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "dualpipe", "dualpipev"]
TokenDispatcher = Literal["alltoall", "allgather", "flex"]
# How attention exchanges keys and values over cp (Megatron's --cp-comm-type): a ring of
# send/recv steps, an all-gather of K and V, DeepSpeed-Ulysses all-to-alls, or all-to-alls
# inside groups of --cp-a2a-size ranks with a ring across them.
CpComm = Literal["p2p", "all-gather", "a2a", "a2a+p2p"]
Recompute = Literal["none", "selective", "op", "full"]
Dtype = Literal["bf16", "fp8"]
# Megatron-LM's --fp8-recipe choices (Transformer Engine recipes): per-tensor delayed scaling
# (amax history), per-tensor current scaling, MXFP8 (32-element blocks, Blackwell) and
# DeepSeek-V3's blockwise scaling (1x128 activation tiles, 128x128 weight blocks); and torchao's
# rowwise scaling (one scale per row of each GEMM operand, a PyTorch-native recipe that
# Transformer Engine does not have).
Fp8Recipe = Literal["delayed", "tensorwise", "mxfp8", "blockwise", "rowwise"]
Fp8Format = Literal["e4m3", "hybrid"]
GradReduceDtype = Literal["fp32", "bf16"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
# Schedules that place two chunks per stage in a V (the second leg comes back up the stages).
V_SCHEDULES = ("zb-v", "dualpipev")
TOKEN_DISPATCHERS: tuple[str, ...] = get_args(TokenDispatcher)
CP_COMMS: tuple[str, ...] = get_args(CpComm)
RECOMPUTE: tuple[str, ...] = get_args(Recompute)
DTYPES: tuple[str, ...] = get_args(Dtype)
FP8_RECIPES: tuple[str, ...] = get_args(Fp8Recipe)
FP8_FORMATS: tuple[str, ...] = get_args(Fp8Format)
GRAD_REDUCE_DTYPES: tuple[str, ...] = get_args(GradReduceDtype)
# The ParallelConfig fields that only FP8 training reads.
FP8_OPTIONS = ("fp8_recipe", "fp8_format", "fp8_attention", "fp8_param_gather", "fp8_dispatch",
               "fp8_amax_history_len", "te_layernorm_mlp")
# The precision fields: the number format and the FP8 options.
PRECISION_FIELDS = ("dtype", *FP8_OPTIONS)
VOCAB_PAD = 128                           # Megatron pads the vocabulary to a multiple of 128 * tp


def _finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees per mesh axis plus the execution choices that go with them. Each field's
    docstring is its flag's help text (``--micro-batch`` is ``micro_batch``)."""

    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    cp: int = 1
    """Context-parallel degree (the sequence split over cp ranks)."""
    cp_comm: CpComm = "p2p"
    """How attention exchanges keys and values over cp: a ring (p2p), an all-gather, Ulysses
    all-to-alls (a2a), or all-to-alls inside groups of --cp-a2a-size with a ring across."""
    cp_a2a_size: int | None = None
    """With --cp-comm a2a+p2p: cp ranks of each all-to-all group (the ring runs across them)."""
    cp_load_balance: bool = True
    """Cut the sequence into 2*cp chunks, rank i holding chunks i and 2*cp-1-i, so causal
    attention costs every cp rank the same (default); off: cp contiguous chunks (the last rank
    works the most)."""
    vp: int = 1
    """Virtual pipeline stages (model chunks) per device (interleaved 1F1B)."""
    sp: bool | None = None
    """Megatron sequence parallelism over the tp axis (default: the software profile's, on
    whenever tp > 1 in every current recipe; an inference step runs without)."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    global_batch: int | None = None
    """Sequences per step (default: one micro-batch per data-parallel rank)."""
    seq_len: int = 2048
    """Sequence length."""
    zero: int = 0
    """ZeRO stage 0-3 (1: Megatron's distributed optimizer; 2, 3: FSDP sharding gradients, then
    parameters too)."""
    recompute: Recompute = "none"
    """Activation recomputation: none, Megatron's selective (the attention core), torchtitan's
    per-op selective ``op`` (matmul and attention outputs kept, every second matmul of a layer
    and every other op recomputed) or full."""
    schedule: Schedule | None = None
    """Pipeline schedule (default 1f1b, interleaved when vp > 1): gpipe, 1f1b, interleaved, the
    zero-bubble zb-h1 and zb-v (vp 2), DeepSeek-V3's dualpipe (two parameter copies) and
    dualpipev (vp 2)."""
    pp_layers: tuple[int, ...] | None = None
    """Layers per virtual pipeline stage, in pipeline order (pp*vp entries), instead of an even
    split."""
    axis_order: tuple[str, ...] = DEFAULT_AXIS_ORDER
    """Mesh axes innermost first (the rank mapping)."""
    dtype: Dtype = "bf16"
    """Training precision: bf16, or fp8 (Transformer Engine FP8 GEMMs in the layers)."""
    software: str = DEFAULT_SOFTWARE
    """The framework release that runs the step (a software profile): its defaults fill every
    switch left unset (sp, tp-comm-overlap, overlap-grad-reduce, overlap-param-gather, the
    gradient reduction's precision), and the report marks them as assumed."""
    overlap_param_gather: bool | None = None
    """ZeRO 1/2: all-gather the updated parameters ahead of each block's next forward instead of
    right after the optimizer step (Megatron's --overlap-param-gather; default: the profile's)."""
    overlap_grad_reduce: bool | None = None
    """Reduce the data-parallel gradients in buckets behind the backward, or all after the
    stage's last backward (Megatron's --overlap-grad-reduce; default: the profile's)."""
    tp_comm_overlap: bool | None = None
    """Pipeline the tensor-parallel collectives with their GEMMs (Megatron-Core's
    --tp-comm-overlap, Transformer Engine's userbuffers; needs sp; default: the profile's, on
    with tp > 1 in Megatron and NeMo)."""
    grad_reduce_dtype: GradReduceDtype | None = None
    """Precision of the data-parallel gradient reduction (default: the profile's)."""
    assumed: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The switches this configuration took from its software profile (not given)."""
    fp8_recipe: Fp8Recipe | None = None
    """FP8 scaling recipe (default: the GPU's, delayed on Hopper, mxfp8 on Blackwell)."""
    fp8_format: Fp8Format = "hybrid"
    """e4m3 everywhere, or hybrid (e5m2 gradients)."""
    fp8_attention: bool = False
    """Fused attention in FP8 too (Transformer Engine's FP8 dot-product attention)."""
    fp8_param_gather: bool = False
    """Keep parameters in FP8 and all-gather them in FP8 (needs ZeRO 1-3)."""
    fp8_dispatch: bool = False
    """Send the MoE token dispatch in FP8."""
    fp8_amax_history_len: int = 1024
    """Amax history length of delayed scaling."""
    te_layernorm_mlp: bool = False
    """The MLP is Transformer Engine's LayerNormMLP (its activation writes FP8 itself), as in
    NeMo's GPT recipes; default: Megatron-Core's MLP."""
    # -- Mixture of Experts (Megatron-Core's MoE parallel folding) -------------------------------
    ep: int = 1
    """Expert-parallel degree: expert layers re-factor the tp*cp*dp ranks of a stage as
    expert-tp x ep x edp (ep shares out the experts, edp is what is left)."""
    expert_tp: int | None = None
    """Tensor-parallel degree inside each expert (default: tp)."""
    moe_token_dispatcher: TokenDispatcher = "alltoall"
    """How routed tokens reach their experts: all-to-all over ep (then all-gather over
    expert-tp), all-gather over ep and expert-tp (and reduce-scatter back), or ``flex``:
    Megatron-Core's DeepEP dispatcher, an all-to-all that sends each token across the scale-out
    network once per node it goes to and forwards it over NVLink to that node's experts."""
    moe_capacity_factor: float | None = None
    """Drop tokens beyond this multiple of an expert's balanced share (default: dropless)."""
    moe_pad_to_capacity: bool = False
    """Pad every expert's tokens to its capacity (needs --moe-capacity-factor)."""
    moe_imbalance: float = 1.0
    """Tokens on the busiest expert rank over the mean (1: balanced routing, the steady state of
    aux-loss or bias balancing); every rank waits for that one at each exchange."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "vp", "micro_batch", "seq_len"):
            positive_int(getattr(self, name), name.replace("_", "-"))
        self._take_profile_defaults()
        world = self.dp * self.tp * self.cp * self.pp
        # checked before anything is built for the ranks (the flag to blame: the largest degree)
        require(world <= MAX_RANKS, max(("dp", "tp", "pp", "cp"), key=lambda a: getattr(self, a)),
                f"dp*tp*cp*pp = {self.dp}*{self.tp}*{self.cp}*{self.pp} = {world:,} ranks, more than the "
                f"{MAX_RANKS_TEXT}")
        if self.expert_tp is None:
            object.__setattr__(self, "expert_tp", self.tp)
        for name in ("ep", "expert_tp"):
            positive_int(getattr(self, name), name.replace("_", "-"))
        # (cp folds into the expert mesh's data parallelism, as Megatron-Core's MoE folding does)
        stage = self.tp * self.cp * self.dp
        # the flag to blame: expert-tp where it alone cannot divide the ranks, else ep
        culprit = "expert-tp" if stage % self.expert_tp and not stage % self.ep else "ep"
        require(stage % (self.ep * self.expert_tp) == 0,
                culprit, f"expert-tp*ep = {self.expert_tp}*{self.ep} must divide tp*cp*dp = "
                         f"{self.tp}*{self.cp}*{self.dp} (expert layers re-factor the same ranks)")
        require(self.moe_token_dispatcher in TOKEN_DISPATCHERS, "moe-token-dispatcher",
                f"must be one of {', '.join(TOKEN_DISPATCHERS)}, got {self.moe_token_dispatcher!r}")
        cf = self.moe_capacity_factor
        require(cf is None or (_finite_number(cf) and cf > 0),
                "moe-capacity-factor", f"must be a finite positive number, got {cf!r}")
        require(not self.moe_pad_to_capacity or cf is not None, "moe-pad-to-capacity",
                "needs --moe-capacity-factor")
        imb = self.moe_imbalance
        require(_finite_number(imb) and imb >= 1, "moe-imbalance",
                f"must be a finite number >= 1 (the busiest expert rank's tokens over the mean), got {imb!r}")
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.dp * self.micro_batch)
        positive_int(self.global_batch, "global-batch")
        require(self.zero in (0, 1, 2, 3), "zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")
        require(self.recompute in RECOMPUTE, "recompute", f"must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        self._check_precision()
        require(self.grad_reduce_dtype in GRAD_REDUCE_DTYPES, "grad-reduce-dtype",
                f"must be one of {', '.join(GRAD_REDUCE_DTYPES)}, got {self.grad_reduce_dtype!r}")
        require(self.global_batch % (self.dp * self.micro_batch) == 0, "global-batch",
                f"must be divisible by dp*micro-batch = {self.dp}*{self.micro_batch}, got {self.global_batch}")
        schedule = self.schedule or ("interleaved" if self.vp > 1 else "1f1b")
        object.__setattr__(self, "schedule", schedule)
        require(schedule in SCHEDULES, "schedule", f"must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        require(self.vp == 1 or schedule in ("interleaved", *V_SCHEDULES), "vp",
                f"virtual stages need the interleaved, zb-v or dualpipev schedule, got schedule {schedule}")
        require(schedule in ("1f1b", "gpipe") or self.pp > 1, "schedule", f"{schedule} needs pp > 1")
        require(schedule not in V_SCHEDULES or self.vp == 2, "vp",
                f"{schedule} places 2 model chunks per stage in a V: needs vp 2, got {self.vp}")
        require(schedule != "dualpipe" or self.pp % 2 == 0, "pp",
                f"dualpipe runs half the stages from each end: needs an even pp, got {self.pp}")
        require(schedule != "dualpipe" or (self.num_microbatches % 2 == 0 and self.num_microbatches >= 2 * self.pp),
                "global-batch", f"dualpipe feeds half the micro-batches from each end: needs an even number of "
                f"micro-batches >= 2*pp = {2 * self.pp}, got {self.num_microbatches}")
        require(schedule != "dualpipev" or self.num_microbatches >= 2 * self.pp, "global-batch",
                f"dualpipev needs micro-batches >= 2*pp = {2 * self.pp}, got {self.num_microbatches}")
        require(schedule != "zb-v" or self.num_microbatches >= self.pp, "global-batch",
                f"zb-v needs micro-batches >= pp = {self.pp}, got {self.num_microbatches}")
        if schedule == "interleaved":
            require(self.num_microbatches % self.pp == 0, "global-batch",
                    f"the interleaved schedule needs the number of micro-batches ({self.num_microbatches}) "
                    f"to be a multiple of pp ({self.pp})")
        require(self.cp_comm in CP_COMMS, "cp-comm", f"must be one of {', '.join(CP_COMMS)}, got {self.cp_comm!r}")
        if self.cp_comm == "a2a+p2p":
            require(self.cp_a2a_size is not None, "cp-a2a-size", "is required with --cp-comm a2a+p2p")
            positive_int(self.cp_a2a_size, "cp-a2a-size")
            require(self.cp % self.cp_a2a_size == 0, "cp-a2a-size",
                    f"must divide cp ({self.cp}), got {self.cp_a2a_size}")
        else:
            require(self.cp_a2a_size is None, "cp-a2a-size", f"only applies to --cp-comm a2a+p2p, not {self.cp_comm}")
        order = tuple(self.axis_order)
        if "cp" not in order and "tp" in order:
            # orders written before context parallelism existed: cp right outside tp, where
            # Megatron puts it (and where it changes nothing while cp = 1)
            order = order[:order.index("tp") + 1] + ("cp",) + order[order.index("tp") + 1:]
        object.__setattr__(self, "axis_order", order)
        require(sorted(order) == sorted(MESH_AXES), "axis-order",
                f"must list each of {', '.join(MESH_AXES)} once, got {','.join(order)}")
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
            require(len(self.pp_layers) == self.pp * self.vp, "pp-layers",
                    f"needs pp*vp = {self.pp * self.vp} entries, got {len(self.pp_layers)}")
            require(all(isinstance(n, int) and n >= 0 for n in self.pp_layers), "pp-layers",
                    "entries must be non-negative integers")
            require(all(n > 0 for n in self.pp_layers[1:-1]), "pp-layers",
                    "only the first and last stage (which hold the embedding and the loss) may have 0 layers")

    def _take_profile_defaults(self) -> None:
        """Fill the switches left unset from the software profile, and note which."""
        profile = get_software(self.software)
        assumed = list(self.assumed)
        for name in PROFILE_SWITCHES:                  # (sp first: tp_comm_overlap's default needs it)
            if getattr(self, name) is None:
                object.__setattr__(self, name, profile.default(name, tp=self.tp, sp=bool(self.sp)))
                if name not in assumed:
                    assumed.append(name)
        object.__setattr__(self, "assumed", tuple(assumed))
        for name in ("sp", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather"):
            require(isinstance(getattr(self, name), bool), name.replace("_", "-"),
                    f"must be true or false, got {getattr(self, name)!r}")
        require(not self.tp_comm_overlap or self.tp == 1 or self.sp, "tp-comm-overlap",
                "needs sequence parallelism (--sp): it overlaps sp's all-gathers and reduce-scatters with their GEMMs")

    def _check_precision(self) -> None:
        """The precision choices that need no GPU to check (see stage_cosim.graph.precision for
        the ones that do)."""
        require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.fp8_recipe is None or self.fp8_recipe in FP8_RECIPES, "fp8-recipe",
                f"must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        require(self.fp8_format in FP8_FORMATS, "fp8-format",
                f"must be one of {', '.join(FP8_FORMATS)}, got {self.fp8_format!r}")
        positive_int(self.fp8_amax_history_len, "fp8-amax-history-len")
        for flag in ("fp8_attention", "fp8_param_gather", "fp8_dispatch", "te_layernorm_mlp"):
            require(isinstance(getattr(self, flag), bool), flag.replace("_", "-"),
                    f"must be true or false, got {getattr(self, flag)!r}")
        if self.dtype != "fp8":
            for flag in ("fp8_recipe", "fp8_attention", "fp8_param_gather", "fp8_dispatch", "te_layernorm_mlp"):
                require(not getattr(self, flag), flag.replace("_", "-"), "needs --dtype fp8")
            return
        require(not (self.fp8_attention and self.fp8_recipe in ("blockwise", "rowwise")), "fp8-attention",
                f"Transformer Engine has no FP8 attention with {self.fp8_recipe} scaling")
        require(not (self.fp8_param_gather and self.fp8_recipe == "rowwise"), "fp8-param-gather",
                "torchao gathers FP8 parameters with tensorwise scaling only, not rowwise")
        # Megatron: parameters live in FP8 only where something else holds the fp32 master
        # copy and gathers them: the distributed optimizer or FSDP (ZeRO 1-3 here).
        require(not self.fp8_param_gather or self.zero >= 1, "fp8-param-gather",
                "needs the distributed optimizer or FSDP (--zero 1, 2 or 3)")
        require(not (self.fp8_param_gather and self.fp8_recipe == "mxfp8"), "fp8-param-gather",
                "with mxfp8 Megatron gathers parameters in BF16 and quantizes them after the gather, "
                "which is what --dtype fp8 already models; use it with delayed, tensorwise or blockwise")

    # -- derived ------------------------------------------------------------------------------

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, axis) for axis in MESH_AXES)

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vp

    @property
    def edp(self) -> int:
        """The expert-data-parallel degree: the ranks of a stage (tp x cp x dp) over expert_tp x ep."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def degrees(self) -> dict[str, int]:
        """The degree of every axis of every mesh (dense axes are fields of this config, edp
        is derived)."""
        return {axis: getattr(self, axis) for mesh in (DENSE, EXPERT) for axis in MESHES[mesh]}

    def mesh_orders(self) -> dict[str, tuple[str, ...]]:
        """Each mesh's axes, innermost first: the dense mesh in ``axis_order``, the expert mesh
        over the same ranks (see :func:`~stage_cosim.parallel.axes.expert_order`)."""
        try:
            experts = expert_order(self.axis_order)
        except ValueError:
            experts = None
        return {DENSE: self.axis_order, EXPERT: experts}

    @property
    def moe_load(self) -> float:
        """Token slots on the busiest expert rank over the balanced mean, as computed: the
        imbalance, capped at the capacity factor (tokens beyond it are dropped), or exactly
        the capacity factor when padding to it."""
        if self.moe_capacity_factor is None:
            return float(self.moe_imbalance)
        if self.moe_pad_to_capacity:
            return float(self.moe_capacity_factor)
        return float(min(self.moe_imbalance, self.moe_capacity_factor))

    @property
    def moe_dropped_fraction(self) -> float:
        """The share of the busiest expert rank's routed tokens dropped at capacity."""
        if self.moe_capacity_factor is None or self.moe_imbalance <= self.moe_capacity_factor:
            return 0.0
        return 1.0 - self.moe_capacity_factor / self.moe_imbalance

    @property
    def cp_a2a(self) -> int:
        """Ranks that exchange attention heads by all-to-all (1: none)."""
        if self.cp == 1:
            return 1
        return {"a2a": self.cp, "a2a+p2p": self.cp_a2a_size or 1}.get(self.cp_comm, 1)

    @property
    def cp_ring(self) -> int:
        """Ranks that pass keys and values round a ring (1: none)."""
        if self.cp == 1 or self.cp_comm in ("a2a", "all-gather"):
            return 1
        return self.cp // self.cp_a2a

    def mesh_splits(self) -> tuple[tuple[str, str, int], ...]:
        """Sub-axes of the rank mesh: the all-to-all groups of hierarchical cp."""
        return (("cp_a2a", "cp", self.cp_a2a),) if self.cp_comm == "a2a+p2p" and self.cp > 1 else ()

    def padded_vocab(self, vocab: int) -> int:
        multiple = VOCAB_PAD * self.tp
        return int(math.ceil(vocab / multiple) * multiple)

    def layers_per_stage(self, layers: int) -> tuple[int, ...]:
        """Layers of each virtual stage, in pipeline order (virtual stage = chunk * pp + stage)."""
        n = self.virtual_stages
        if self.pp_layers is not None:
            require(sum(self.pp_layers) == layers, "pp-layers",
                    f"must add up to the model's {layers} layers, got {sum(self.pp_layers)}")
            return self.pp_layers
        require(n <= layers, "pp", f"pp*vp = {n} pipeline stages exceed the model's {layers} layers")
        base = -(-layers // n)
        counts = [base] * n
        deficit = base * n - layers
        # The first stage also holds the embedding and the last the output layer and loss, so
        # they give up layers first, alternately, from the ends inward.
        lo, hi, take_lo = 0, n - 1, True
        while deficit:
            i = lo if take_lo else hi
            if counts[i] > 1:
                counts[i] -= 1
                deficit -= 1
            elif take_lo:
                lo += 1
            else:
                hi -= 1
            take_lo = not take_lo
        return tuple(counts)

    def check_against(self, model: ModelConfig, *, training: bool = True) -> None:
        """The divisibility rules that tie this configuration to a model (``training``: also
        Megatron-Core's training-only rules)."""
        require(model.heads % self.tp == 0, "tp", f"must divide heads ({model.heads}), got {self.tp}")
        require(model.kv_heads % self.tp == 0, "tp", f"must divide kv-heads ({model.kv_heads}), got {self.tp}")
        require(model.ffn % self.tp == 0, "tp", f"must divide ffn ({model.ffn}), got {self.tp}")
        for what, size in model.ssm_tp_dims():      # SSM mixers shard their head groups
            require(size % self.tp == 0, "tp", f"must divide {what} ({size}), got {self.tp}")
        # (an explicit --pp-layers may leave the first and last stage with the embedding or the
        # loss alone, as Llama 3's 405B run did; layers_per_stage checks its sum)
        require(self.virtual_stages <= model.layers or self.pp_layers is not None, "pp",
                f"pp*vp = {self.virtual_stages} pipeline stages exceed the model's {model.layers} layers")
        self.layers_per_stage(model.layers)
        if model.position == "learned":
            require(self.seq_len <= model.max_seq, "seq-len",
                    f"must not exceed the model's learned positions ({model.max_seq}), got {self.seq_len}")
        if self.cp > 1:
            self._check_context_parallel(model)
        if self.sp:
            require(self.seq_len % (self.tp * self.cp) == 0, "seq-len",
                    f"must be divisible by tp*cp ({self.tp}*{self.cp}) with sequence parallelism, got {self.seq_len}")
        require(not self.fp8_attention or model.attention == "fused", "fp8-attention",
                "FP8 attention is a fused attention kernel (cuDNN); the model uses --attention unfused")
        require(not self.fp8_dispatch or getattr(model, "num_experts", None), "fp8-dispatch",
                f"sends the token dispatch of MoE layers in FP8; {model.name} has no experts")
        self._check_experts(model, training)

    def _check_experts(self, model: ModelConfig, training: bool = True) -> None:
        if not model.is_moe:
            for flag, default in (("ep", 1), ("expert_tp", self.tp), ("moe_imbalance", 1)):
                require(getattr(self, flag) == default, flag.replace("_", "-"),
                        f"needs a Mixture-of-Experts model ({model.name} has no experts)")
            return
        require(model.num_experts % self.ep == 0, "ep", f"must divide num-experts ({model.num_experts}), got {self.ep}")
        self._check_imbalance(model)
        require(model.expert_ffn % self.expert_tp == 0, "expert-tp",
                f"must divide the experts' ffn ({model.expert_ffn}), got {self.expert_tp}")
        shared = model.moe_shared_expert_intermediate_size
        require(shared is None or shared % self.tp == 0, "tp",
                f"must divide the shared experts' ffn ({shared}), got {self.tp}")
        # (an inference step runs without sequence parallelism: tokens replicated over tp are
        # split over the expert ranks on their way to the experts and gathered back after)
        require(not training or not (self.ep > 1 and self.tp > 1) or self.sp, "sp",
                "sequence parallelism is required when ep and tp are both > 1 (as in Megatron-Core)")
        require(self.mesh_orders()[EXPERT] is not None, "axis-order",
                f"the dense axes must be contiguous in the rank order for expert layers (pp first or last), "
                f"got {','.join(self.axis_order)}")

    def max_moe_imbalance(self, model: ModelConfig) -> float:
        """The most tokens an expert rank can hold over the mean: ep * min(topk, E/ep) / topk.

        Each token sends its top-k copies to k distinct experts, E/ep of which live on a
        rank, so a rank gets at most min(k, E/ep) copies of each token: T * min(k, E/ep) of
        the T * k / ep it gets on average. With ep = 1 that is 1: the one expert rank holds
        every routed token, it cannot be imbalanced."""
        k, e = model.moe_router_topk, model.num_experts
        return self.ep * min(k, e // self.ep) / k

    def _check_imbalance(self, model: ModelConfig) -> None:
        k, e, ep = model.moe_router_topk, model.num_experts, self.ep
        bound = self.max_moe_imbalance(model)
        require(self.moe_imbalance <= bound, "moe-imbalance",
                f"must be at most ep*min(topk, num-experts/ep)/topk = {ep}*min({k}, {e // ep})/{k} = {bound:g} "
                f"(a token sends at most min(topk, num-experts/ep) of its topk copies to one expert rank"
                f"{'; with ep 1 the one expert rank holds every routed token' if ep == 1 else ''}), "
                f"got {self.moe_imbalance:g}")

    def _check_context_parallel(self, model: ModelConfig) -> None:
        """Megatron-Core's and Transformer Engine's rules for context parallelism."""
        chunks = 2 * self.cp if self.cp_load_balance else self.cp
        require(self.seq_len % chunks == 0, "seq-len",
                f"must be divisible by {'2*cp' if self.cp_load_balance else 'cp'} = {chunks} "
                f"(the sequence is cut into that many chunks), got {self.seq_len}")
        a2a = self.cp_a2a
        if a2a > 1:
            require(model.heads % (self.tp * a2a) == 0 and model.kv_heads % (self.tp * a2a) == 0, "cp-comm",
                    f"{self.cp_comm} shards attention heads over tp*{'cp' if a2a == self.cp else 'cp-a2a-size'} = "
                    f"{self.tp * a2a}: it must divide heads ({model.heads}) and kv-heads ({model.kv_heads})")
        if self.cp_ring > 1:
            windowed = [w for w in model.layer_windows() if w is not None and w < self.seq_len]
            require(not windowed, "cp-comm", f"{self.cp_comm} does not support sliding-window or chunked "
                                             "attention (Transformer Engine); use all-gather or a2a")
        if model.attention != "fused":
            require(self.cp_comm == "all-gather", "cp-comm",
                    f"{self.cp_comm} needs fused (flash) attention; with --attention unfused use all-gather")

    def with_overrides(self, **kw: Any) -> "ParallelConfig":
        """This configuration with the fields ``kw`` sets (None: unchanged). The switches its
        software profile filled are filled again for the new configuration (``tp`` 1 -> 2 turns
        the assumed sp on); a switch ``kw`` sets is no longer assumed. (``dataclasses.replace``
        copies the filled values as they are.)"""
        given = {k: v for k, v in kw.items() if v is not None}
        refill = {name: None for name in self.assumed if name not in given}
        return replace(self, **refill, **given, assumed=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["assumed"] = list(self.assumed)
        d["axis_order"] = list(self.axis_order)
        d["pp_layers"] = list(self.pp_layers) if self.pp_layers is not None else None
        d["num_microbatches"] = self.num_microbatches
        d["world_size"] = self.world_size
        d["edp"] = self.edp
        d["moe_load"] = self.moe_load
        d["moe_dropped_fraction"] = self.moe_dropped_fraction
        return d
