"""ModelConfig: the dimensions and architecture choices of a transformer, nothing about parallelism.

What each choice may be (the layer kinds and their names) is :mod:`architecture`'s vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal, get_args

from stage_cosim.errors import UserError, positive_int, require
from stage_cosim.model.architecture import (
    ATTENDING_MIXERS, ATTENTION, ATTENTION_MAMBA2, DENSE_MLP, GATED_DELTANET, LAYER_TYPES, MAMBA, MAMBA2, MAMBA2_LIKE,
    CHUNKED_ATTENTION, MIXERS, MLP_KINDS, MLPS, MOE_MLP, NO_MIXER, NO_MLP, NORMS, POSITIONS, SLIDING_ATTENTION,
    ArchSwitches, ChunkSpan, Mlp, Norm, Position,
)

Arch = Literal["gpt", "llama"]
AttentionImpl = Literal["fused", "unfused"]
CrossEntropyImpl = Literal["fused", "unfused"]
# Implementation switches a user sets one by one (command-line flags and request fields alike).
MODEL_SWITCHES = ("attention", "causal_flops", "cross_entropy", "moe_shared_expert_overlap")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, in the spirit of Megatron-Core's ``TransformerConfig`` (field
    names follow Megatron-Core where it has the concept, Hugging Face where only it has).

    ``arch`` picks the family defaults (GPT: LayerNorm, GELU MLP, learned positions, biases,
    dropout; Llama: RMSNorm, SwiGLU, RoPE, no biases, no dropout); the individual switches can
    still be set one by one. Every field that changes a cost is here; the Hugging Face reader
    (:mod:`stage_cosim.model.hf`) fills them from a ``config.json`` or refuses what it cannot.
    The fields with a command-line flag are documented by an attribute docstring, which is that
    flag's help text.
    """

    name: str
    arch: Arch
    """The family whose defaults fill the switches not set one by one: gpt (LayerNorm, GELU MLP,
    learned positions, biases, dropout) or llama (RMSNorm, SwiGLU, RoPE, no biases, no dropout)."""
    layers: int
    """Transformer layers (Megatron-Core's num_layers)."""
    hidden: int
    """Hidden size: the width of the residual stream (Megatron-Core's hidden_size)."""
    ffn: int
    """The MLP's intermediate size (Megatron-Core's ffn_hidden_size)."""
    heads: int
    """Attention (query) heads (Megatron-Core's num_attention_heads)."""
    kv_heads: int
    """Key and value heads: fewer than heads is grouped-query attention (Megatron-Core's
    num_query_groups); it must divide heads."""
    head_dim: int
    """Each attention head's dimension (Megatron-Core's kv_channels)."""
    vocab: int
    """Vocabulary size, before Megatron pads it to a multiple of 128 x tp."""
    max_seq: int
    """Longest sequence (Hugging Face's max_position_embeddings): the rows of a learned position
    table, which a training sequence must not exceed."""
    tied_embeddings: bool
    norm: Norm
    mlp: Mlp
    position: Position
    # Biases: on the QKV and output projections of attention (Hugging Face's attention_bias),
    # on the MLP's projections (mlp_bias), on QKV alone (Megatron-Core's add_qkv_bias, Qwen2).
    attention_bias: bool = False
    mlp_bias: bool = False
    add_qkv_bias: bool = False
    # Dropout probabilities (Megatron-Core's names): hidden_dropout on the embedding and on each
    # sublayer's output, attention_dropout on the attention probabilities. Only whether they are
    # non-zero changes a cost (the masks are kernels and saved activations).
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention: AttentionImpl = "fused"
    """fused: one flash-attention kernel; unfused: the s x s score matrix materialized, softmax
    and dropout as separate ops (Megatron before flash attention)."""
    causal_flops: bool = True
    """A fused (flash) attention kernel skips the masked blocks of a causal score matrix, as every
    one does (FlashAttention-2/3, cuDNN, Transformer Engine): it executes and is timed for the
    unmasked part only. Off: the kernel runs the full s x s (a what-if). Model FLOPs, and so MFU,
    always count the full matrix, as the published formulas do; materialized (unfused) attention
    computes the full matrix either way."""
    cross_entropy: CrossEntropyImpl = "unfused"
    """unfused: Megatron's default vocabulary-parallel cross-entropy, the logits cast to fp32 and
    streamed by separate max, subtract, exp, sum and divide kernels (about six passes forward, two
    backward); fused: one kernel each way (Megatron's --cross-entropy-loss-fusion). On small
    models with large vocabularies this is several percent of the step."""
    # RMSNorm (or LayerNorm) of each query and key head over head_dim before RoPE (Qwen3,
    # Megatron-Core's qk_layernorm).
    qk_layernorm: bool = False
    # Fraction of each head's dimensions that RoPE rotates (Megatron-Core's rotary_percent;
    # GPT-NeoX's rotary_pct, Phi's partial_rotary_factor).
    rotary_percent: float = 1.0
    # Attention and MLP read the same input and their outputs are summed into the residual
    # (GPT-NeoX, GPT-J): with tensor parallelism the two row-parallel outputs share one reduction.
    parallel_residual: bool = False
    # With parallel_residual: attention and MLP read the same norm's output (GPT-J's ln_1), one
    # norm per layer instead of two.
    shared_input_norm: bool = False
    # A norm on the embedding output before the first layer (BLOOM's word_embeddings_layernorm).
    embedding_norm: bool = False
    # A second norm on each sublayer's output before the residual add (Gemma-2's
    # post_attention_layernorm / post_feedforward_layernorm): four norms per layer.
    sandwich_norm: bool = False
    # The embedding output multiplied by sqrt(hidden) (Gemma).
    scale_embeddings: bool = False
    # Soft-capping, cap * tanh(x / cap), of the attention scores and of the final logits (Gemma-2).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Sliding-window attention: each query attends to the last ``sliding_window`` keys in the
    # layers whose type is "sliding_attention". ``layer_types`` is a pattern repeated over the
    # layers (layer i has type layer_types[i % len]); empty means every layer has a window when
    # sliding_window is set, and none when it is not.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Chunked attention (Llama 4): in the layers whose type is "chunked_attention" a query attends
    # causally to the keys of its own attention_chunk_size-token chunk only (positions
    # [k*chunk, (k+1)*chunk)). With empty layer_types every layer is chunked when it is set.
    attention_chunk_size: int | None = None
    # A learned per-head logit that joins every softmax of the attention scores ("attention
    # sinks", GPT-OSS): one parameter per head and layer.
    attention_sinks: bool = False
    # -- Mixture of Experts (Megatron-Core's names) ---------------------------------------------
    # Routed experts per MoE layer (None: every MLP is dense); each token goes to the
    # moe_router_topk experts its router scores highest.
    num_experts: int | None = None
    moe_router_topk: int = 2
    # Each routed expert's intermediate size (default: ffn, as Mixtral's experts are full MLPs).
    moe_ffn_hidden_size: int | None = None
    # The shared experts' intermediate size, all of them together (DeepSeek: n_shared_experts x
    # moe_intermediate_size; Qwen2-MoE: shared_expert_intermediate_size); None: no shared expert.
    moe_shared_expert_intermediate_size: int | None = None
    # A sigmoid gate on the shared experts' output (Qwen2-MoE).
    moe_shared_expert_gate: bool = False
    # A bias on the router's logits (GPT-OSS).
    moe_router_bias: bool = False
    # Group-limited (node-limited) routing, Megatron-Core's --moe-router-num-groups and
    # --moe-router-group-topk (DeepSeek-V3's n_group and topk_group): the experts form
    # moe_router_num_groups equal groups, and each token's experts come from the
    # moe_router_group_topk groups its router scores highest. With experts placed group by
    # group on the expert-parallel ranks (DeepSeek-V3: one group per node), a token reaches at
    # most that many nodes. None: routing is not limited.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_shared_expert_overlap: bool = False
    """The shared experts compute while the routed tokens are dispatched, instead of after the
    routed experts (Megatron-Core's --moe-shared-expert-overlap)."""
    # Which layers are MoE layers: every k-th (an integer: layer i when i % k == 0) or a 0/1
    # pattern with one entry per layer (DeepSeek's first dense layers, Qwen's mlp_only_layers).
    # Dense layers keep an MLP of size ffn.
    moe_layer_freq: int | tuple[int, ...] = 1
    # -- Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLATransformerConfig) ----------
    # Queries and keys/values go through low-rank latents (q_lora_rank; None: a direct query
    # projection) and kv_lora_rank; each head's query/key has qk_head_dim dimensions without
    # position plus qk_pos_emb_head_dim rotated ones (the rotated key is shared by all heads),
    # its value v_head_dim.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # -- Multi-token prediction (DeepSeek-V3): modules after the last layer, each predicting one
    # more token with one more layer (of the last layer's kind), sharing embedding and head.
    mtp_num_layers: int = 0
    # -- Hybrid layers (data, not branches) -------------------------------------------------------
    # One mixer kind per layer (empty: every layer attends), one MLP kind per layer (empty: from
    # moe_layer_freq, dense or MoE). Where layer_mlps is given it decides which layers are MoE.
    layer_mixers: tuple[str, ...] = ()
    layer_mlps: tuple[str, ...] = ()
    # Mamba-2 (Megatron-Core's mamba_* names) and gated DeltaNet share one description: groups
    # of heads (Mamba-2 n_groups, each group's B and C shared by its heads; gated DeltaNet's key
    # heads, each shared by num_heads / num_groups value heads), a head's dimension (Mamba-2
    # head_dim; the value head's), the state per head is mamba_state_dim x mamba_head_dim
    # (Mamba-2 d_state; gated DeltaNet's key head dimension), the depthwise causal convolution's
    # kernel, the chunk length of the chunked scan.
    mamba_num_heads: int | None = None
    mamba_num_groups: int = 1
    mamba_head_dim: int = 64
    mamba_state_dim: int = 128
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    # Mamba-1 (Jamba): the inner width (expand x hidden), the rank of the step-size projection,
    # and RMSNorms on the step size, B and C (Jamba's dt/b/c_layernorm).
    mamba_inner: int | None = None
    mamba_dt_rank: int = 1
    mamba_inner_norms: bool = False
    # Biases: the depthwise convolution's and the input/output projections' (Hugging Face's
    # use_conv_bias / use_bias, Jamba's mamba_conv_bias / mamba_proj_bias).
    ssm_conv_bias: bool = True
    ssm_proj_bias: bool = False
    # A sigmoid gate on each attention head's output, from a second half of the query
    # projection (Qwen3-Next's attn_output_gate).
    attention_output_gate: bool = False
    # Mamba-2's RMSNorm of the gated scan output (Falcon-H1's mamba_rms_norm: without it the
    # output is only gated, y * silu(z)).
    mamba_gated_norm: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "max_seq"):
            positive_int(getattr(self, name), name.replace("_", "-"))
        require(self.arch in get_args(Arch), "arch", f"must be {' or '.join(get_args(Arch))}, got {self.arch!r}")
        require(self.heads % self.kv_heads == 0, "kv-heads",
                f"must divide heads ({self.heads}), got {self.kv_heads}")
        _choice(self.norm, "norm", NORMS)
        _choice(self.mlp, "mlp", MLPS)
        _choice(self.position, "position", POSITIONS)
        _choice(self.attention, "attention", get_args(AttentionImpl))
        _choice(self.cross_entropy, "cross-entropy", get_args(CrossEntropyImpl))
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            require(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1,
                    name.replace("_", "-"), f"must be a probability in [0, 1), got {p!r}")
        require(isinstance(self.rotary_percent, (int, float)) and 0 < self.rotary_percent <= 1,
                "rotary-percent", f"must be in (0, 1], got {self.rotary_percent!r}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            require(cap is None or (isinstance(cap, (int, float)) and cap > 0), name.replace("_", "-"),
                    f"must be positive or unset, got {cap!r}")
        if self.sliding_window is not None:
            positive_int(self.sliding_window, "sliding-window")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for t in self.layer_types:
            _choice(t, "layer-types", LAYER_TYPES)
        require(self.sliding_window is not None or SLIDING_ATTENTION not in self.layer_types, "layer-types",
                "has sliding_attention layers but sliding-window is not set")
        if self.attention_chunk_size is not None:
            positive_int(self.attention_chunk_size, "attention-chunk-size")
        require(self.attention_chunk_size is not None or CHUNKED_ATTENTION not in self.layer_types, "layer-types",
                "has chunked_attention layers but attention-chunk-size is not set")
        require(self.layer_types or self.sliding_window is None or self.attention_chunk_size is None, "layer-types",
                "must say which layers slide and which are chunked when both sliding-window and "
                "attention-chunk-size are set")
        require(not self.shared_input_norm or self.parallel_residual, "shared-input-norm",
                "shares the norm of a parallel residual: set parallel-residual too")
        self._check_moe()
        if self.multi_latent_attention:
            if self.q_lora_rank is not None:
                positive_int(self.q_lora_rank, "q-lora-rank")
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                positive_int(getattr(self, name), name.replace("_", "-"))
        require(isinstance(self.mtp_num_layers, int) and not isinstance(self.mtp_num_layers, bool)
                and self.mtp_num_layers >= 0, "mtp-num-layers",
                f"must be a non-negative integer, got {self.mtp_num_layers!r}")
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        for name, allowed in (("layer_mixers", MIXERS), ("layer_mlps", MLP_KINDS)):
            kinds = tuple(getattr(self, name))
            object.__setattr__(self, name, kinds)
            require(not kinds or len(kinds) == self.layers, name.replace("_", "-"),
                    f"needs one entry per layer ({self.layers}), got {len(kinds)}")
            for k in kinds:
                _choice(k, name.replace("_", "-"), allowed)
        require(MOE_MLP not in self.layer_mlps or self.num_experts is not None, "layer-mlps",
                "has moe layers but num-experts is not set")
        mixers = set(self.layer_mixers)
        for i in range(self.layers):
            require(self.layer_kind(i) != (NO_MIXER, NO_MLP), "layer-mixers", f"layer {i} has neither mixer nor MLP")
        if mixers & {MAMBA2, GATED_DELTANET, ATTENTION_MAMBA2}:
            require(not (GATED_DELTANET in mixers and mixers & MAMBA2_LIKE), "layer-mixers",
                    "mamba2 and gated_deltanet layers share the SSM dimensions: one kind per model")
            positive_int(self.mamba_num_heads, "mamba-num-heads")
            for name in ("mamba_num_groups", "mamba_head_dim", "mamba_state_dim", "mamba_d_conv", "mamba_chunk_size"):
                positive_int(getattr(self, name), name.replace("_", "-"))
            require(self.mamba_num_heads % self.mamba_num_groups == 0, "mamba-num-groups",
                    f"must divide mamba-num-heads ({self.mamba_num_heads}), got {self.mamba_num_groups}")
        if MAMBA in mixers:
            positive_int(self.mamba_inner, "mamba-inner")
            for name in ("mamba_dt_rank", "mamba_state_dim", "mamba_d_conv"):
                positive_int(getattr(self, name), name.replace("_", "-"))

    def _check_moe(self) -> None:
        if self.num_experts is None:
            return
        positive_int(self.num_experts, "num-experts")
        positive_int(self.moe_router_topk, "moe-router-topk")
        require(self.moe_router_topk <= self.num_experts, "moe-router-topk",
                f"must not exceed num-experts ({self.num_experts}), got {self.moe_router_topk}")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None:
                positive_int(getattr(self, name), name.replace("_", "-"))
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        require((groups is None) == (group_topk is None), "moe-router-group-topk",
                "limits routing together with moe-router-num-groups: give both or neither")
        if groups is not None:
            positive_int(groups, "moe-router-num-groups")
            positive_int(group_topk, "moe-router-group-topk")
            require(self.num_experts % groups == 0, "moe-router-num-groups",
                    f"must divide num-experts ({self.num_experts}), got {groups}")
            require(group_topk <= groups, "moe-router-group-topk",
                    f"must not exceed moe-router-num-groups ({groups}), got {group_topk}")
            require(self.moe_router_topk <= group_topk * (self.num_experts // groups), "moe-router-topk",
                    f"must not exceed the experts of {group_topk} groups "
                    f"({group_topk * (self.num_experts // groups)}), got {self.moe_router_topk}")
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            object.__setattr__(self, "moe_layer_freq", tuple(freq))
            require(len(freq) == self.layers, "moe-layer-freq",
                    f"a pattern needs one entry per layer ({self.layers}), got {len(freq)}")
            require(all(x in (0, 1) and not isinstance(x, bool) for x in freq), "moe-layer-freq",
                    "pattern entries must be 0 (dense) or 1 (MoE)")
        else:
            positive_int(freq, "moe-layer-freq")

    # -- derived quantities -------------------------------------------------------------------

    @property
    def query_groups(self) -> int:
        """Query heads per key/value head (1 for multi-head attention)."""
        return self.heads // self.kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, or its chunk (a :class:`ChunkSpan`) in a
        chunked-attention layer (None: it attends to the whole sequence)."""
        if not self.layer_types:
            if self.attention_chunk_size is not None:
                return ChunkSpan(self.attention_chunk_size)
            return self.sliding_window
        kind = self.layer_types[layer % len(self.layer_types)]
        if kind == SLIDING_ATTENTION:
            return self.sliding_window
        return ChunkSpan(self.attention_chunk_size) if kind == CHUNKED_ATTENTION else None

    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.layers))

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def layer_mixer(self, layer: int) -> str:
        """The token mixer of layer ``layer`` (attention unless ``layer_mixers`` says otherwise)."""
        return self.layer_mixers[layer] if self.layer_mixers else ATTENTION

    def layer_mlp(self, layer: int) -> str:
        """The MLP kind of layer ``layer``: dense, moe or none."""
        if self.layer_mlps:
            return self.layer_mlps[layer]
        return MOE_MLP if self.is_moe_layer(layer) else DENSE_MLP

    def layer_kind(self, layer: int) -> tuple[str, str]:
        return self.layer_mixer(layer), self.layer_mlp(layer)

    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.layer_kind(i) for i in range(self.layers))

    def ssm_tp_dims(self) -> tuple[tuple[str, int], ...]:
        """What tensor parallelism splits in this model's SSM mixers (it must divide them):
        Mamba-2's groups / gated DeltaNet's key heads, Mamba-1's inner width."""
        mixers = set(self.layer_mixers)
        out = []
        if mixers & {MAMBA2, GATED_DELTANET, ATTENTION_MAMBA2}:
            out.append(("mamba-num-groups", self.mamba_num_groups))
        if MAMBA in mixers:
            out.append(("mamba-inner", self.mamba_inner))
        return tuple(out)

    @property
    def is_hybrid(self) -> bool:
        return any(k not in ((ATTENTION, DENSE_MLP), (ATTENTION, MOE_MLP)) for k in self.layer_kinds())

    def attention_layers(self) -> tuple[int, ...]:
        """The layers with softmax attention (the only ones holding a KV cache)."""
        return tuple(i for i in range(self.layers) if self.layer_mixer(i) in ATTENDING_MIXERS)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` has routed experts (Megatron's moe_layer_freq, or layer_mlps)."""
        if self.num_experts is None:
            return False
        if self.layer_mlps:
            return self.layer_mlps[layer] == MOE_MLP
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return bool(freq[layer])
        return layer % freq == 0

    def moe_layers(self) -> tuple[bool, ...]:
        return tuple(self.is_moe_layer(i) for i in range(self.layers))

    @property
    def shares_embedding(self) -> bool:
        """Whether the last pipeline stage reads the embedding table too (tied output layer,
        or multi-token prediction embedding the next tokens)."""
        return self.tied_embeddings or self.mtp_num_layers > 0

    @property
    def expert_ffn(self) -> int:
        """Each routed expert's intermediate size."""
        return self.moe_ffn_hidden_size or self.ffn

    def param_count(self) -> int:
        """Exact parameter count, in closed form (checked against the symbolic graph's weights).
        Multi-token-prediction modules are not counted (as published totals do not count them;
        see :meth:`mtp_param_count`)."""
        return _parameters(self, False)

    def active_param_count(self) -> int:
        """Parameters a token uses: everything but the routed experts it is not sent to
        (the embedding table and the output layer included)."""
        return _parameters(self, True)

    def mtp_param_count(self) -> int:
        """Parameters of the multi-token-prediction modules (embedding and head shared)."""
        h = self.hidden
        per_norm = 2 if self.norm == "layernorm" else 1
        last = self.layers - 1
        module = 2 * h * per_norm + 2 * h * h + self._layer_params(last, active=False) + h * per_norm
        return self.mtp_num_layers * module

    def _count(self, *, active: bool) -> int:
        h = self.hidden
        per_norm = 2 if self.norm == "layernorm" else 1
        layers = sum(self._layer_params(i, active=active) for i in range(self.layers))
        return layers + self.embedding_param_count() + h * per_norm

    def _attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        sw = self.switches()
        per_norm = 2 if self.norm == "layernorm" else 1
        sinks = self.heads if self.attention_sinks else 0
        if self.multi_latent_attention:
            qk = self.qk_head_dim + self.qk_pos_emb_head_dim
            if self.q_lora_rank is None:
                q = h * self.heads * qk
            else:
                q = h * self.q_lora_rank + self.q_lora_rank * per_norm + self.q_lora_rank * self.heads * qk
            kv = (h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank * per_norm
                  + self.kv_lora_rank * self.heads * (self.qk_head_dim + self.v_head_dim))
            out = self.heads * self.v_head_dim * h + h * self.attention_bias
            return q + kv + out + sinks
        qkv_width = (self.heads + 2 * self.kv_heads) * d
        qkv = h * qkv_width + qkv_width * sw.qkv_bias
        out = self.heads * d * h + h * self.attention_bias
        qk_norms = 2 * d * per_norm if self.qk_layernorm else 0
        return qkv + out + qk_norms + sinks

    def _mlp_params(self, ffn: int) -> int:
        h = self.hidden
        width = 2 * ffn if self.mlp in ("swiglu", "geglu") else ffn
        return h * width + ffn * h + (width + h) * self.mlp_bias

    def _mixer_params(self, mixer: str) -> int:
        if mixer == ATTENTION:
            gate = self.heads * self.head_dim * self.hidden if self.attention_output_gate else 0
            return self._attention_params() + gate
        if mixer == ATTENTION_MAMBA2:
            return self._mixer_params(ATTENTION) + self._mixer_params(MAMBA2)
        if mixer == NO_MIXER:
            return 0
        h, conv, cbias, pbias = self.hidden, self.mamba_d_conv, self.ssm_conv_bias, self.ssm_proj_bias
        if mixer == MAMBA:
            di, n, r = self.mamba_inner, self.mamba_state_dim, self.mamba_dt_rank
            norms = (r + 2 * n) if self.mamba_inner_norms else 0
            return (h * 2 * di + 2 * di * pbias + di * conv + di * cbias + di * (r + 2 * n) + r * di + di
                    + di * n + di + di * h + h * pbias + norms)
        heads, groups, p, n = self.mamba_num_heads, self.mamba_num_groups, self.mamba_head_dim, self.mamba_state_dim
        inner = heads * p
        if mixer == MAMBA2:
            # in_proj to z, x, B, C and dt; the convolution over x, B and C; dt_bias, A_log, D;
            # the gated RMSNorm's weight; out_proj
            proj = 2 * inner + 2 * groups * n + heads
            channels = inner + 2 * groups * n
            return (h * proj + proj * pbias + channels * (conv + cbias) + 3 * heads + inner * self.mamba_gated_norm
                    + inner * h + h * pbias)
        # gated DeltaNet: q, k (per key head), v, z (per value head), beta and the decay's gate a
        # (per value head); the convolution over q, k, v; dt_bias, A_log; the gated RMSNorm's
        # weight (one head's); out_proj
        proj = 2 * groups * n + 2 * inner + 2 * heads
        channels = 2 * groups * n + inner
        return h * proj + proj * pbias + channels * (conv + cbias) + 2 * heads + p + inner * h + h * pbias

    def _layer_params(self, layer: int, *, active: bool) -> int:
        h = self.hidden
        per_norm = 2 if self.norm == "layernorm" else 1
        mixer, mlp = self.layer_kind(layer)
        sublayers = (mixer != NO_MIXER) + (mlp != NO_MLP)
        norms = h * per_norm * (sublayers * (2 if self.sandwich_norm else 1) - self.shared_input_norm)
        if mlp == NO_MLP:
            return self._mixer_params(mixer) + norms
        if mlp == DENSE_MLP:
            return self._mixer_params(mixer) + self._mlp_params(self.ffn) + norms
        e = self.num_experts
        experts = (self.moe_router_topk if active else e) * self._mlp_params(self.expert_ffn)
        router = h * e + e * self.moe_router_bias
        shared = 0
        if self.moe_shared_expert_intermediate_size is not None:
            shared = self._mlp_params(self.moe_shared_expert_intermediate_size) + h * self.moe_shared_expert_gate
        return self._mixer_params(mixer) + router + experts + shared + norms

    def embedding_param_count(self) -> int:
        """Parameters of the embedding tables and the untied output layer."""
        embed = self.vocab * self.hidden + (self.max_seq * self.hidden if self.position == "learned" else 0)
        embed += self.hidden * (2 if self.norm == "layernorm" else 1) * self.embedding_norm
        return embed + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def switches(self) -> ArchSwitches:
        return ArchSwitches(
            norm=self.norm, mlp=self.mlp, position=self.position, attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias, add_qkv_bias=self.add_qkv_bias, hidden_dropout=self.hidden_dropout > 0,
            attention_dropout=self.attention_dropout > 0, attention=self.attention,
            causal_flops=self.causal_flops, tied_embeddings=self.tied_embeddings,
            cross_entropy=self.cross_entropy, qk_layernorm=self.qk_layernorm,
            rotary_percent=Fraction(str(self.rotary_percent)) if self.position == "rope" else Fraction(1),
            parallel_residual=self.parallel_residual, shared_input_norm=self.shared_input_norm,
            embedding_norm=self.embedding_norm, sandwich_norm=self.sandwich_norm,
            scale_embeddings=self.scale_embeddings, attn_softcap=self.attn_logit_softcapping is not None,
            final_softcap=self.final_logit_softcapping is not None, moe=self.is_moe,
            moe_shared_expert=self.is_moe and self.moe_shared_expert_intermediate_size is not None,
            moe_shared_expert_gate=self.is_moe and self.moe_shared_expert_gate,
            moe_router_bias=self.is_moe and self.moe_router_bias,
            moe_shared_expert_overlap=self.is_moe and self.moe_shared_expert_overlap,
            mtp_layers=self.mtp_num_layers, mtp_moe=self.mtp_num_layers > 0 and self.is_moe_layer(self.layers - 1),
            multi_latent_attention=self.multi_latent_attention,
            q_lora=self.multi_latent_attention and self.q_lora_rank is not None,
            attention_sinks=self.attention_sinks,
            hybrid_kinds=tuple(sorted(k for k in set(self.layer_kinds())
                                      if k not in ((ATTENTION, DENSE_MLP), (ATTENTION, MOE_MLP)))),
            ssm_conv_bias=self.ssm_conv_bias, ssm_proj_bias=self.ssm_proj_bias,
            attention_output_gate=self.attention_output_gate,
            mamba_inner_norms=self.mamba_inner_norms, mamba_gated_norm=self.mamba_gated_norm)

    def with_overrides(self, **overrides: Any) -> "ModelConfig":
        """A copy with the given fields replaced (None values are ignored)."""
        known = {f.name for f in fields(self)}
        for key in overrides:
            if key not in known:
                raise UserError(key.replace("_", "-"), "is not a model field")
        values = {k: v for k, v in overrides.items() if v is not None}
        layers = values.get("layers")
        freq = values.get("moe_layer_freq", self.moe_layer_freq)
        if layers is not None and isinstance(freq, tuple) and len(freq) != layers:
            # a layer-count override keeps the pattern's first layers (DeepSeek's dense ones) and
            # repeats its last entry
            values["moe_layer_freq"] = (tuple(freq) + (freq[-1],) * layers)[:layers]
        if layers is not None:
            # a hybrid pattern is repeated (or cut) to the new depth
            for name in ("layer_mixers", "layer_mlps"):
                pattern = values.get(name, getattr(self, name))
                if pattern and len(pattern) != layers:
                    values[name] = tuple(pattern[i % len(pattern)] for i in range(layers))
        return replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["layer_mixers"] = list(self.layer_mixers)
        d["layer_mlps"] = list(self.layer_mlps)
        if isinstance(self.moe_layer_freq, tuple):
            d["moe_layer_freq"] = list(self.moe_layer_freq)
        return d

    @staticmethod
    def family(arch: Arch) -> dict[str, Any]:
        """The architecture switches that a family implies."""
        if arch == "gpt":
            return dict(norm="layernorm", mlp="gelu", position="learned", attention_bias=True, mlp_bias=True,
                        hidden_dropout=0.1, attention_dropout=0.1)
        if arch == "llama":
            return dict(norm="rmsnorm", mlp="swiglu", position="rope")
        raise UserError("arch", f"must be gpt or llama, got {arch!r}")

    @classmethod
    def build(cls, name: str, arch: Arch, *, layers: int, hidden: int, heads: int,
              vocab: int, max_seq: int, ffn: int | None = None, kv_heads: int | None = None,
              head_dim: int | None = None, tied_embeddings: bool | None = None,
              **switches: Any) -> "ModelConfig":
        """Fill in family defaults: ffn 4h (GPT), kv_heads = heads, head_dim = hidden/heads."""
        require(isinstance(heads, int) and heads > 0, "heads", f"must be a positive integer, got {heads!r}")
        require(isinstance(hidden, int) and hidden > 0, "hidden", f"must be a positive integer, got {hidden!r}")
        if head_dim is None:
            require(hidden % heads == 0, "heads", f"must divide hidden ({hidden}) when head-dim is not given")
            head_dim = hidden // heads
        if ffn is None:
            require(arch == "gpt", "ffn", "is required for llama models")
            ffn = 4 * hidden
        family = cls.family(arch)
        family.update(switches)
        return cls(name=name, arch=arch, layers=layers, hidden=hidden, ffn=ffn, heads=heads,
                   kv_heads=kv_heads if kv_heads is not None else heads, head_dim=head_dim,
                   vocab=vocab, max_seq=max_seq,
                   tied_embeddings=(arch == "gpt") if tied_embeddings is None else tied_embeddings,
                   **family)


def _choice(value: object, parameter: str, allowed: tuple[str, ...]) -> None:
    require(value in allowed, parameter, f"must be one of {', '.join(allowed)}, got {value!r}")


@lru_cache(maxsize=64)
def _parameters(model: ModelConfig, active: bool) -> int:
    """A model's parameter count, counted once per model: counting walks every layer's kinds
    (tens of milliseconds for a large model), and a search asks at every configuration."""
    return model._count(active=active)
