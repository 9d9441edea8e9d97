"""The architecture vocabulary: what a layer of a model can be made of (norms, MLPs, position
encodings, attention layer types, token mixers, MLP kinds), and :class:`ArchSwitches`, the
architecture choices that shape a graph. The model description (:mod:`config`) checks its
fields against these; the graph builders read the switches.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

# Each choice is typed once, as a Literal (a field's type); its tuple is derived from it.
Norm = Literal["layernorm", "rmsnorm"]
NORMS: tuple[str, ...] = get_args(Norm)
# "gelu": one up-projection and a GELU; "squared_relu": the same with relu(x)^2 (Nemotron-4,
# Megatron-Core's squared_relu); "swiglu" / "geglu": gated (gate and up projections, SiLU or
# GELU on the gate, times the up projection), as Llama and Gemma do; "relu": one up-projection
# and a ReLU (OPT).
Mlp = Literal["gelu", "squared_relu", "swiglu", "geglu", "relu"]
MLPS: tuple[str, ...] = get_args(Mlp)
# "alibi": no position embedding; each attention score gets a per-head linear bias in the
# query-key distance (Press et al. 2022; BLOOM).
Position = Literal["learned", "rope", "alibi"]
POSITIONS: tuple[str, ...] = get_args(Position)
# Hugging Face's names for the attention of one layer (``layer_types``): every earlier key, the
# last ``sliding_window`` keys, or the keys of the query's own ``attention_chunk_size``-token
# chunk (Llama 4's chunked local attention).
FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION = "full_attention", "sliding_attention", "chunked_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION)


class ChunkSpan(int):
    """The attention span of a chunked-attention layer: the chunk length. It travels where a
    sliding window's length does (a layer's window, None for global attention), so code that
    only needs a bound on the keys a query sees treats it as a window of that length; code
    that is exact for chunks asks ``isinstance(window, ChunkSpan)``. It never equals a sliding
    window of the same length, so the two kinds of layer stay apart as dictionary keys."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkSpan) and int(self) == int(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((CHUNKED_ATTENTION, int(self)))

    def __repr__(self) -> str:
        return f"ChunkSpan({int(self)})"
# The token mixer of one layer: softmax attention, a Mamba-1 selective scan (Jamba), a Mamba-2
# (SSD) mixer, a gated DeltaNet linear attention (Qwen3-Next's linear_attention), or none (an
# MLP-only layer: Nemotron-H's "-"). And its MLP: dense, Mixture of Experts, or none (a
# mixer-only layer: Nemotron-H's "M" and "*"). ``attention_mamba2``: attention and a Mamba-2
# mixer side by side on one norm's output, their outputs summed (Falcon-H1's parallel hybrid).
ATTENTION, MAMBA, MAMBA2, GATED_DELTANET, NO_MIXER = "attention", "mamba", "mamba2", "gated_deltanet", "none"
ATTENTION_MAMBA2 = "attention_mamba2"
MIXERS = (ATTENTION, MAMBA, MAMBA2, GATED_DELTANET, ATTENTION_MAMBA2, NO_MIXER)
SSM_MIXERS = (MAMBA, MAMBA2, GATED_DELTANET, ATTENTION_MAMBA2)
# The mixers with softmax attention (a KV cache per token), and those with Mamba-2's dimensions.
ATTENDING_MIXERS = (ATTENTION, ATTENTION_MAMBA2)
MAMBA2_LIKE = frozenset({MAMBA2, ATTENTION_MAMBA2})
DENSE_MLP, MOE_MLP, NO_MLP = "dense", "moe", "none"
MLP_KINDS = (DENSE_MLP, MOE_MLP, NO_MLP)


@dataclass(frozen=True)
class ArchSwitches:
    """The architecture choices that shape the graph (sizes aside): one graph serves every size.

    Numbers that only scale costs (the sliding-window length) are not here: they are bound to
    the graph's symbols per layer, so a windowed layer and a global one share one graph.
    """

    norm: str
    mlp: str
    position: str
    attention_bias: bool
    mlp_bias: bool
    add_qkv_bias: bool
    hidden_dropout: bool
    attention_dropout: bool
    attention: str
    causal_flops: bool
    tied_embeddings: bool
    cross_entropy: str = "unfused"
    qk_layernorm: bool = False
    rotary_percent: Fraction = Fraction(1)
    parallel_residual: bool = False
    shared_input_norm: bool = False
    embedding_norm: bool = False
    sandwich_norm: bool = False
    scale_embeddings: bool = False
    attn_softcap: bool = False
    final_softcap: bool = False
    # Mixture of Experts: which parts the MoE layer has (sizes are symbols).
    moe: bool = False
    moe_shared_expert: bool = False
    moe_shared_expert_gate: bool = False
    moe_router_bias: bool = False
    moe_shared_expert_overlap: bool = False
    # Multi-latent attention, with or without the low-rank query path.
    multi_latent_attention: bool = False
    q_lora: bool = False
    attention_sinks: bool = False
    # Multi-token prediction modules in the head, and whether their layer has experts.
    mtp_layers: int = 0
    mtp_moe: bool = False
    # Hybrid models: the distinct (mixer, MLP) kinds of the layers that are not a transformer
    # layer (attention with a dense or MoE MLP), each one more block; biases of the SSM mixers;
    # a sigmoid gate on the attention output (Qwen3-Next).
    hybrid_kinds: tuple[tuple[str, str], ...] = ()
    ssm_conv_bias: bool = True
    ssm_proj_bias: bool = False
    attention_output_gate: bool = False
    mamba_inner_norms: bool = False
    mamba_gated_norm: bool = True

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.add_qkv_bias

    @property
    def gated(self) -> bool:
        return self.mlp in ("swiglu", "geglu")
