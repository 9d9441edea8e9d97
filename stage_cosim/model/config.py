"""ModelConfig: the dimensions and architecture choices of a transformer, nothing about parallelism."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from stage_cosim.errors import UserError, positive_int, require

Arch = Literal["gpt", "llama"]
AttentionImpl = Literal["fused", "unfused"]
CrossEntropyImpl = Literal["fused", "unfused"]
# Implementation switches a user sets one by one (command-line flags and request fields alike).
MODEL_SWITCHES = ("attention", "causal_flops", "cross_entropy")


@dataclass(frozen=True)
class ArchSwitches:
    """The architecture choices that shape the graph (sizes aside): one graph serves every size."""

    norm: str
    mlp: str
    position: str
    bias: bool
    dropout: bool
    attention: str
    causal_flops: bool
    tied_embeddings: bool
    cross_entropy: str = "unfused"


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, in the spirit of Megatron-Core's ``TransformerConfig``.

    ``arch`` picks the family defaults (GPT: LayerNorm, GELU MLP, learned positions, biases,
    dropout; Llama: RMSNorm, SwiGLU, RoPE, no biases, no dropout); the individual switches can
    still be set one by one.
    """

    name: str
    arch: Arch
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_seq: int
    tied_embeddings: bool
    norm: Literal["layernorm", "rmsnorm"]
    mlp: Literal["gelu", "swiglu"]
    position: Literal["learned", "rope"]
    bias: bool
    dropout: bool
    # "unfused" materializes the s x s score matrix (softmax and dropout as separate ops, as in
    # Megatron before flash attention); "fused" is one flash-attention kernel.
    attention: AttentionImpl = "fused"
    # A causal attention kernel computes only the unmasked half of the score matrix (off: the
    # full s x s, as the published closed forms count). Model FLOPs always count the full matrix.
    causal_flops: bool = False
    # "unfused" is Megatron's default vocabulary-parallel cross-entropy: the logits are cast to
    # fp32 and streamed by separate max, subtract, exp, sum and divide kernels (about six passes
    # forward, two backward); "fused" is one kernel each way (Megatron's
    # --cross-entropy-loss-fusion). On small models with large vocabularies this is several
    # percent of the step.
    cross_entropy: CrossEntropyImpl = "unfused"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "max_seq"):
            positive_int(getattr(self, name), name.replace("_", "-"))
        require(self.arch in ("gpt", "llama"), "arch", f"must be gpt or llama, got {self.arch!r}")
        require(self.heads % self.kv_heads == 0, "kv-heads",
                f"must divide heads ({self.heads}), got {self.kv_heads}")
        require(self.norm in ("layernorm", "rmsnorm"), "norm", f"must be layernorm or rmsnorm, got {self.norm!r}")
        require(self.mlp in ("gelu", "swiglu"), "mlp", f"must be gelu or swiglu, got {self.mlp!r}")
        require(self.position in ("learned", "rope"), "position", f"must be learned or rope, got {self.position!r}")
        require(self.attention in ("fused", "unfused"), "attention",
                f"must be fused or unfused, got {self.attention!r}")
        require(self.cross_entropy in ("fused", "unfused"), "cross-entropy",
                f"must be fused or unfused, got {self.cross_entropy!r}")

    # -- derived quantities -------------------------------------------------------------------

    @property
    def query_groups(self) -> int:
        """Query heads per key/value head (1 for multi-head attention)."""
        return self.heads // self.kv_heads

    def param_count(self) -> int:
        """Exact parameter count, in closed form (checked against the symbolic graph's weights)."""
        h, f, d = self.hidden, self.ffn, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * d + (self.heads + 2 * self.kv_heads) * d * self.bias
        out = self.heads * d * h + h * self.bias
        mlp_in_width = 2 * f if self.mlp == "swiglu" else f
        mlp = h * mlp_in_width + mlp_in_width * self.bias + f * h + h * self.bias
        norm = h * (2 if self.norm == "layernorm" else 1)
        layer = qkv + out + mlp + 2 * norm
        embed = self.vocab * h + (self.max_seq * h if self.position == "learned" else 0)
        head = 0 if self.tied_embeddings else self.vocab * h
        return self.layers * layer + embed + head + norm

    def switches(self) -> ArchSwitches:
        return ArchSwitches(self.norm, self.mlp, self.position, self.bias, self.dropout,
                            self.attention, self.causal_flops, self.tied_embeddings, self.cross_entropy)

    def with_overrides(self, **overrides: Any) -> "ModelConfig":
        """A copy with the given fields replaced (None values are ignored)."""
        known = {f.name for f in fields(self)}
        for key in overrides:
            if key not in known:
                raise UserError(key.replace("_", "-"), "is not a model field")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def family(arch: Arch) -> dict[str, Any]:
        """The architecture switches that a family implies."""
        if arch == "gpt":
            return dict(norm="layernorm", mlp="gelu", position="learned", bias=True, dropout=True)
        if arch == "llama":
            return dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, dropout=False)
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
