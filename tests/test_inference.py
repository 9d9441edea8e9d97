"""Prefill and decode steps against closed forms derived independently of the code."""

from __future__ import annotations

from collections import Counter

import pytest

from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import attention_span
from stage_cosim.inference.summary import step_summary
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.program import COLL, COMP, RECV, SEND
from stage_cosim.workload import synthesize

LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 1)]     # (dp, tp, pp)


def _layer_params(m) -> int:
    """A Llama layer's GEMM weights: QKV, output, gate/up and down projections."""
    return m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden + 3 * m.hidden * m.ffn


def _sharded_params(m, V: int) -> tuple[int, int]:
    """(parameters tensor parallelism splits, parameters every tp rank holds) of a Llama:
    the layers' GEMM weights and the output layer; the norms."""
    return m.layers * _layer_params(m) + V * m.hidden, (2 * m.layers + 1) * m.hidden


def _bytes_per_rank(w) -> int:
    """Bytes the compute kernels of one tp rank move, summed over the pipeline stages."""
    return sum(n.mem_bytes for s in range(w.parallel.pp) for n in w.role(s).nodes if n.type == COMP)


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_decode_bytes_are_weights_plus_kv_reads(llama_small, dp, tp, pp) -> None:
    """A decode step moves every weight once per micro-batch and reads each request's cached
    keys and values once; everything else is activation traffic, proportional to the requests.

    So bytes(B, C) = weights + kv_per_token * B * C + a * B: the coefficient of B * C is the
    KV read per token (k and v, every layer, the rank's heads), and 2 bytes(1) - bytes(2) at
    one micro-batch is the weights alone: tp's shard of every GEMM weight and the output layer,
    plus the replicated norms (the embedding table is gathered from, not read whole)."""
    m = llama_small
    par = ParallelConfig(dp=dp, tp=tp, pp=pp)
    V = par.padded_vocab(m.vocab)

    def step(batch_per_replica: int, context: int) -> int:
        inf = InferenceConfig("decode", batch=dp * batch_per_replica, context_len=context,
                              micro_batch=batch_per_replica)
        return _bytes_per_rank(synthesize(m, par, inference=inf))

    kv_read = 2 * m.layers * (m.kv_heads // tp) * m.head_dim * 2          # bytes per cached token
    c1, c2 = 512, 1536
    for b in (1, 3):
        assert step(b, c2) - step(b, c1) == kv_read * b * (c2 - c1)
    sharded, replicated = _sharded_params(m, V)
    weights = 2 * (sharded // tp + replicated)
    assert 2 * step(1, c1) - step(2, c1) == weights


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_decode_step_reports_the_closed_form_reads(llama_small, dp, tp, pp) -> None:
    m = llama_small
    par = ParallelConfig(dp=dp, tp=tp, pp=pp)
    B, C = 8 * dp, 1000
    w = synthesize(m, par, inference=InferenceConfig("decode", batch=B, context_len=C))
    V = par.padded_vocab(m.vocab)
    sharded, replicated = _sharded_params(m, V)
    kv = B * C * 2 * m.layers * m.kv_heads * m.head_dim * 2
    # every stored weight (MBU's convention: the model's size, the embedding table included),
    # on every rank of every replica
    weights = 2 * (sharded + V * m.hidden + replicated * tp) * dp
    s = step_summary(w, resolve_cluster("dgx-h100", par.world_size), 1.0)
    assert s["bytes_read"] == weights * w.parallel.num_microbatches + kv


def _prefill_matmul_flops(m, V: int, B: int, S: int, window: int | None = None) -> int:
    """2 * parameters * tokens for the layers' GEMMs, 2 * V * h per sequence for the logits of
    its last token, and 4 * d per (query, key) pair and query head for the causal attention
    (token i attends to min(i, window) keys)."""
    layer = _layer_params(m)
    pairs = sum(min(i, window or i) for i in range(1, S + 1))
    return 2 * m.layers * layer * B * S + 2 * V * m.hidden * B + 4 * m.head_dim * m.heads * m.layers * B * pairs


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
def test_prefill_flops_closed_form(llama_small, dp, tp, pp) -> None:
    m = llama_small
    par = ParallelConfig(dp=dp, tp=tp, pp=pp)
    B, S = 4 * dp, 777
    w = synthesize(m, par, inference=InferenceConfig("prefill", batch=B, input_len=S))
    expected = _prefill_matmul_flops(m, par.padded_vocab(m.vocab), B, S)
    assert w.total_matmul_flops() == expected
    assert w.total_model_flops() == expected


def test_prefill_flops_with_a_sliding_window(llama_small) -> None:
    m = llama_small.with_overrides(sliding_window=300)
    par = ParallelConfig(tp=2)
    w = synthesize(m, par, inference=InferenceConfig("prefill", batch=2, input_len=1000))
    assert w.total_matmul_flops() == _prefill_matmul_flops(m, par.padded_vocab(m.vocab), 2, 1000, window=300)
    # the cache of a windowed layer holds the last 300 tokens only
    per_rank = 2 * m.layers * (m.kv_heads // 2) * m.head_dim * 2
    assert w.memory(0).kv_cache == 2 * 300 * per_rank


def test_decode_flops_closed_form(llama_small) -> None:
    m = llama_small
    par = ParallelConfig(tp=2, pp=2)
    B, C = 6, 3000
    w = synthesize(m, par, inference=InferenceConfig("decode", batch=B, context_len=C))
    V = par.padded_vocab(m.vocab)
    layer = _layer_params(m)
    assert w.total_matmul_flops() == 2 * m.layers * layer * B + 2 * V * m.hidden * B + 4 * m.head_dim * m.heads * m.layers * B * C


@pytest.mark.parametrize("dtype,nbytes", [("bf16", 2), ("fp8", 1)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2)])
def test_gqa_kv_cache_bytes_per_token(llama_small, tp, pp, dtype, nbytes) -> None:
    """GQA: every layer caches a key and a value of head_dim for each of its kv heads; tensor
    parallelism splits the heads, the pipeline the layers."""
    m = llama_small
    B, C = 4, 640
    w = synthesize(m, ParallelConfig(tp=tp, pp=pp),
                   inference=InferenceConfig("decode", batch=B, context_len=C, kv_cache_dtype=dtype, micro_batch=B))
    per_token = 2 * (m.layers // pp) * (m.kv_heads // tp) * m.head_dim * nbytes
    for s in range(pp):
        assert w.memory(s).kv_cache == B * C * per_token
        assert w.kv_cache_bytes_per_token(s) == per_token
    # the cache write is this step's one token per request, in the cache's precision
    writes = [n for n in w.role(0).nodes if n.name.endswith("kv_cache_write")]
    assert len(writes) == m.layers // pp
    assert writes[0].mem_bytes == B * 2 * (m.kv_heads // tp) * m.head_dim * (2 + nbytes)


def test_decode_collectives(llama_small) -> None:
    """Per layer the two tensor-parallel all-reduces of the B x h activation (the embedding's
    once), the logits all-gathered for sampling, the activation sent down the pipeline; no
    gradient, no optimizer."""
    m, B, tp = llama_small, 6, 2
    par = ParallelConfig(tp=tp, pp=2)
    w = synthesize(m, par, inference=InferenceConfig("decode", batch=B, context_len=100, micro_batch=3))
    act = 2 * 3 * m.hidden
    first, last = w.role(0), w.role(1)
    colls = Counter((n.coll.short, n.comm_bytes) for n in first.nodes if n.type == COLL)
    assert colls == Counter({("AR", act): 2 * (m.layers // 2) * 2 + 2})
    V = par.padded_vocab(m.vocab)
    colls = Counter((n.coll.short, n.comm_bytes) for n in last.nodes if n.type == COLL)
    assert colls == Counter({("AR", act): 2 * (m.layers // 2) * 2, ("AG", 3 * V // tp * 2): 2})
    assert [n.comm_bytes for n in first.nodes if n.type == SEND] == [act, act]
    assert [n.comm_bytes for n in last.nodes if n.type == RECV] == [act, act]
    assert not any(n.phase in ("bwd", "step") for r in (first, last) for n in r.nodes)


def test_decode_memory(llama_small) -> None:
    m = llama_small
    par = ParallelConfig(tp=2)
    w = synthesize(m, par, inference=InferenceConfig("decode", batch=8, context_len=1024))
    mem = w.memory(0)
    sharded, replicated = _sharded_params(m, par.padded_vocab(m.vocab))
    # untied: the embedding table is held too (sharded over tp)
    assert mem.weights == 2 * ((sharded + par.padded_vocab(m.vocab) * m.hidden) // 2 + replicated)
    assert mem.gradients == mem.optimizer == mem.activations == 0
    assert mem.kv_cache == 8 * 1024 * 2 * m.layers * (m.kv_heads // 2) * m.head_dim * 2
    assert 0 < mem.workspace < mem.kv_cache


def test_attention_span() -> None:
    """Keys per causal query, on average: brute force over positions."""
    for new, past, window in [(1, 0, None), (7, 0, None), (1, 99, None), (5, 10, None), (10, 0, 4),
                              (3, 10, 4), (6, 2, 5), (1, 1000, 128)]:
        keys = [min(i, window or i) for i in range(past + 1, past + new + 1)]
        assert attention_span(new, past, window) * new == sum(keys)


@pytest.mark.parametrize("kw,param", [
    (dict(zero=1, dp=2), "zero"),
    (dict(recompute="full"), "recompute"),
    (dict(sp=True, tp=2), "sp"),
    (dict(dp=3), "batch"),
])
def test_training_options_refused(llama_small, kw, param) -> None:
    with pytest.raises(UserError) as exc:
        synthesize(llama_small, ParallelConfig(**kw), inference=InferenceConfig("decode", batch=4))
    assert exc.value.parameter == param


@pytest.mark.parametrize("kw,param", [
    (dict(phase="serve"), "phase"), (dict(phase="decode", batch=0), "batch"),
    (dict(phase="prefill", input_len=-3), "input-len"), (dict(phase="decode", kv_cache_dtype="int4"), "kv-cache-dtype"),
    (dict(phase="decode", micro_batch=0), "micro-batch"),
])
def test_bad_inference_config(kw, param) -> None:
    with pytest.raises(UserError) as exc:
        InferenceConfig(**kw)
    assert exc.value.parameter == param


def test_micro_batch_must_divide_the_replica(llama_small) -> None:
    with pytest.raises(UserError) as exc:
        synthesize(llama_small, ParallelConfig(pp=2), inference=InferenceConfig("decode", batch=6, micro_batch=4))
    assert exc.value.parameter == "micro-batch"


def test_learned_positions_bound_the_context(gpt_small) -> None:
    with pytest.raises(UserError) as exc:
        synthesize(gpt_small, ParallelConfig(), inference=InferenceConfig("decode", batch=1, context_len=4096))
    assert exc.value.parameter == "context-len"


@pytest.mark.parametrize("attention", ["fused", "unfused"])
def test_gpt_prefill_and_decode(gpt_small, attention) -> None:
    """Tied embeddings, learned positions, biases, unfused attention: the graph still reads
    the cache (the score matrix is s x t) and samples from the tied table's logits."""
    m = gpt_small.with_overrides(attention=attention)
    par = ParallelConfig(tp=2, pp=2)
    for inf in (InferenceConfig("prefill", batch=2, input_len=256), InferenceConfig("decode", batch=2, context_len=300)):
        w = synthesize(m, par, inference=inf)
        assert w.memory(0).kv_cache == 2 * inf.context * 2 * (m.layers // 2) * (m.kv_heads // 2) * m.head_dim * 2
        names = {n.name.split(".", 1)[1] for n in w.role(1).nodes if n.type == COMP}
        assert {"kv_cache_write", "sample", "logits"} <= names
        assert not any("dropout" in n for n in names)
        assert "embedding" not in w.group_kinds      # no tied gradient to reduce


def test_cli_decode_and_prefill(run_cli, tmp_path) -> None:
    import json

    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--tp", "2", "--phase", "decode", "--batch", "16",
                             "--context-len", "1000", "--json")
    assert code == 0, err
    r = json.loads(out)
    inf = r["inference"]
    assert inf["phase"] == "decode" and inf["new_tokens"] == 16
    assert r["tokens_per_s"] == pytest.approx(16 / r["step_time_s"])
    assert inf["latency_s"] == r["step_time_s"] and 0 < inf["mbu"] < 1
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--pp", "2", "--phase", "prefill", "--batch", "4",
                             "--input-len", "512")
    assert code == 0, err
    assert "time to first token" in out and "2 micro-batches of 2 per replica" in out
    code, out, err = run_cli("synth", "--model", "llama3-8b", "--tp", "2", "--phase", "decode", "--batch", "4",
                             "--out", str(tmp_path / "t"), "--quiet")
    assert code == 0, err
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["inference"]["phase"] == "decode" and manifest["parallel"]["seq_len"] == 1


@pytest.mark.parametrize("args,message", [
    (("--phase", "decode", "--seq-len", "100"), "error: seq-len: is a training option"),
    (("--phase", "decode", "--global-batch", "8"), "error: global-batch: is a training option"),
    (("--batch", "8"), "error: batch: is an inference option"),
    (("--phase", "prefill", "--input-len", "0"), "error: input-len: must be a positive integer"),
    (("--phase", "decode", "--zero", "1", "--dp", "2", "--batch", "2"), "error: zero: is a training option"),
    (("--phase", "decode", "--batch", "3", "--dp", "2"), "error: batch: must be divisible by dp"),
])
def test_cli_inference_errors(run_cli, args, message) -> None:
    code, out, err = run_cli("simulate", "--model", "llama3-8b", *args)
    assert code == 2 and err.startswith(message), err
