"""Architecture features in the graph against closed forms: sliding windows, parallel residual,
QK-norm, partial rotary, soft-capping, sandwich norms, scaled embeddings, gated GELU."""

from __future__ import annotations

from collections import Counter

import pytest

from stage_cosim.model import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.nodes import COLL, COMP
from stage_cosim.workload import synthesize


def _node(w, name: str, mb: int = 0):
    return next(n for n in w.roles[0].nodes if n.name == name and n.micro_batch in (mb, -1))


def _windowed(**kw) -> ModelConfig:
    return ModelConfig.build("windowed", "llama", layers=4, hidden=1024, ffn=2816, heads=16, kv_heads=4,
                             vocab=32000, max_seq=8192, sliding_window=1024,
                             layer_types=("sliding_attention", "full_attention"), **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window_attention_flops(causal: bool) -> None:
    """A window of w keys: 4 b s w a d FLOPs (s w - w^2/2 pairs under a causal mask) against
    4 b s^2 a d (s^2/2) in a global layer; model FLOPs count the window's full s x w matrix."""
    m = _windowed(causal_flops=causal)
    b, s, wdw = 2, 4096, 1024
    w = synthesize(m, ParallelConfig(micro_batch=b, seq_len=s))
    per_pair = 4 * b * m.heads * m.head_dim
    local, full = _node(w, "layer0.attention"), _node(w, "layer1.attention")
    assert local.flops == (per_pair * (s * wdw - wdw * wdw // 2) if causal else per_pair * s * wdw)
    assert full.flops == (per_pair * s * s // 2 if causal else per_pair * s * s)
    assert (local.model_flops, full.model_flops) == (per_pair * s * wdw, per_pair * s * s)
    # the pattern repeats over the layers
    assert _node(w, "layer2.attention").flops == local.flops and _node(w, "layer3.attention").flops == full.flops


def test_window_longer_than_the_sequence_is_global() -> None:
    w = synthesize(_windowed(), ParallelConfig(seq_len=512))
    assert _node(w, "layer0.attention").flops == _node(w, "layer1.attention").flops


def test_gemma2_step_model_flops_closed_form() -> None:
    """Whole-step model FLOPs of a Gemma-2-shaped model (GeGLU, head_dim 256, alternating 4096
    windows, tied embeddings): 3 x forward matmuls, layer by layer."""
    m = ModelConfig.build("gemma2-like", "llama", layers=6, hidden=2304, ffn=9216, heads=8, kv_heads=4,
                          head_dim=256, vocab=256000, max_seq=8192, tied_embeddings=True, mlp="geglu",
                          sandwich_norm=True, scale_embeddings=True, attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0, sliding_window=4096,
                          layer_types=("sliding_attention", "full_attention"))
    B, s = 4, 8192
    par = ParallelConfig(dp=2, tp=2, global_batch=B, seq_len=s)
    w = synthesize(m, par)
    h, f, a, g, d, V = m.hidden, m.ffn, m.heads, m.kv_heads, m.head_dim, par.padded_vocab(m.vocab)
    dense = 2 * B * s * (h * (a + 2 * g) * d + a * d * h + 3 * h * f)
    attention = [4 * B * s * min(s, win or s) * a * d for win in m.layer_windows()]
    expected = 3 * (m.layers * dense + sum(attention) + 2 * B * s * h * V)
    assert w.total_model_flops() == pytest.approx(expected, rel=1e-9)


def _tp_collectives(w, phase: str) -> Counter:
    return Counter(n.coll.short for n in w.roles[0].nodes
                   if n.block == "layer1" and n.micro_batch == 0 and n.type == COLL and n.group == "tp"
                   and n.phase == phase)


def _neox(**kw) -> ModelConfig:
    return ModelConfig.build("neox-like", "gpt", layers=4, hidden=1024, heads=16, vocab=50432, max_seq=2048,
                             position="rope", rotary_percent=0.25, hidden_dropout=0.0, attention_dropout=0.0,
                             **kw)


def test_parallel_residual_reduces_once() -> None:
    """GPT-NeoX's parallel residual: attention and MLP outputs are summed while partial, so the
    forward has one tensor-parallel all-reduce per layer instead of two; the backward still
    all-reduces the gradient of each column-parallel GEMM's input (two). (Without sequence
    parallelism, which the software profile would turn on with tp > 1.)"""
    par = ParallelConfig(tp=4, sp=False, micro_batch=2, seq_len=1024)
    assert _tp_collectives(synthesize(_neox(), par), "fwd") == Counter({"AR": 2})
    w = synthesize(_neox(parallel_residual=True), par)
    assert _tp_collectives(w, "fwd") == Counter({"AR": 1})
    assert _tp_collectives(w, "bwd") == Counter({"AR": 2})
    # with sequence parallelism: two gathers (one per norm output) and one reduce-scatter forward
    w = synthesize(_neox(parallel_residual=True),
                   ParallelConfig(tp=4, sp=True, tp_comm_overlap=False, micro_batch=2, seq_len=1024))
    assert _tp_collectives(w, "fwd") == Counter({"AG": 2, "RS": 1})


def test_parallel_residual_mlp_does_not_wait_for_attention() -> None:
    w = synthesize(_neox(parallel_residual=True), ParallelConfig(seq_len=1024))
    role = w.roles[0]
    by_id = {n.id: n for n in role.nodes}
    fc1 = next(n for n in role.nodes if n.name == "layer1.fc1" and n.micro_batch == 0)

    def ancestors(n):
        seen, todo = set(), list(n.deps)
        while todo:
            i = todo.pop()
            if i not in seen:
                seen.add(i)
                todo.extend(by_id[i].deps)
        return {by_id[i].name for i in seen}

    assert "layer1.attention" not in ancestors(fc1) and "layer0.attention" in ancestors(fc1)


def test_partial_rotary_flops() -> None:
    b, s = 1, 1024
    m = _neox()
    w = synthesize(m, ParallelConfig(micro_batch=b, seq_len=s))
    assert _node(w, "layer0.rope_q").flops == 6 * b * s * m.heads * m.head_dim // 4


def test_qk_layernorm_weights_and_their_tp_reduction() -> None:
    """Qwen3's QK-norm: one head_dim weight for queries and one for keys per layer, replicated
    over tp; each tp rank normalizes its own heads, so the gradients are all-reduced over tp
    once per step (2 d fp32 values per layer). Without sequence parallelism: with it, the two
    norms of the sequence-sharded hidden states are reduced over tp as well (below)."""
    base = ModelConfig.build("q", "llama", layers=2, hidden=1024, ffn=2816, heads=16, kv_heads=4, head_dim=128,
                             vocab=32000, max_seq=4096)
    m = base.with_overrides(qk_layernorm=True)
    assert m.param_count() - base.param_count() == 2 * 2 * 128
    w = synthesize(m, ParallelConfig(tp=2, sp=False, seq_len=1024))
    step = [n for n in w.roles[0].nodes if n.phase == "step" and n.group == "tp" and n.block == "layer0"]
    assert [(n.coll.short, n.comm_bytes) for n in step] == [("AR", 2 * 128 * 4)]
    assert not [n for n in synthesize(base, ParallelConfig(tp=2, sp=False, seq_len=1024)).roles[0].nodes
                if n.phase == "step" and n.group == "tp"]
    # sequence parallelism (the default with tp > 1): each tp rank also normalizes its own slice of
    # the sequence with the replicated input and post-attention RMSNorm weights (hidden each), so
    # their gradients join the same once-per-step tp all-reduce: (2 d + 2 h) fp32 values per layer
    w = synthesize(m, ParallelConfig(tp=2, seq_len=1024))
    assert w.parallel.sp
    step = [n for n in w.roles[0].nodes if n.phase == "step" and n.group == "tp" and n.block == "layer0"]
    assert [(n.coll.short, n.comm_bytes) for n in step] == [("AR", (2 * 128 + 2 * 1024) * 4)]


def test_final_logit_softcap_keeps_its_output() -> None:
    """cap * tanh(logits / cap) costs a pass over the (vocabulary-sharded) logits each way and
    keeps its bf16 output for the backward."""
    b, s, tp = 2, 1024, 2
    base = _windowed()
    par = ParallelConfig(tp=tp, micro_batch=b, seq_len=s)
    plain, capped = synthesize(base, par), synthesize(base.with_overrides(final_logit_softcapping=30.0), par)
    V = par.padded_vocab(base.vocab)
    last = par.pp - 1
    extra = capped.memory(last).activations - plain.memory(last).activations
    assert extra == b * s * V // tp * 2
    node = _node(capped, "head.logit_softcap")
    assert node.flops == 3 * b * s * V // tp and node.mem_bytes == 2 * b * s * V // tp * 2


def test_sandwich_norm_scaled_embedding_and_geglu() -> None:
    b, s = 1, 512
    m = _windowed(sandwich_norm=True, scale_embeddings=True, mlp="geglu")
    w = synthesize(m, ParallelConfig(micro_batch=b, seq_len=s))
    fwd = [n for n in w.roles[0].nodes if n.block == "layer0" and n.phase == "fwd" and n.type == COMP]
    assert sum(1 for n in fwd if n.name.endswith("_norm")) == 4
    assert _node(w, "embedding.embedding_scale").flops == b * s * m.hidden
    assert _node(w, "layer0.geglu").flops == 9 * b * s * m.ffn
    assert m.param_count() == _windowed().param_count() + m.layers * 2 * m.hidden


def test_qkv_bias_alone() -> None:
    base = _windowed()
    m = base.with_overrides(add_qkv_bias=True)
    assert m.param_count() - base.param_count() == m.layers * (m.heads + 2 * m.kv_heads) * m.head_dim
    w = synthesize(m, ParallelConfig(tp=2, seq_len=512))
    names = {n.name for n in w.roles[0].nodes if n.block == "layer0"}
    assert "layer0.qkv.bias_add" in names and "layer0.proj.bias_add" not in names
