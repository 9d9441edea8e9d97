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
from stage_cosim.schedule.nodes import COLL, COMP, RECV, SEND
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
    parallelism splits the heads, the pipeline the layers.

    The cache write is one kernel with the RoPE of the queries and keys (TensorRT-LLM's attention
    preprocessing): per request it reads this step's query, key and value in bf16, (heads/tp +
    2 kv_heads/tp) * head_dim * 2 bytes, and writes the rotated query back in bf16, heads/tp *
    head_dim * 2, and the key and value into the cache in its precision, 2 kv_heads/tp * head_dim
    * nbytes: B * (2 (kv_heads/tp) d (2 + nbytes) + (heads/tp) d (2 + 2))."""
    m = llama_small
    B, C = 4, 640
    w = synthesize(m, ParallelConfig(tp=tp, pp=pp),
                   inference=InferenceConfig("decode", batch=B, context_len=C, kv_cache_dtype=dtype, micro_batch=B))
    per_token = 2 * (m.layers // pp) * (m.kv_heads // tp) * m.head_dim * nbytes
    for s in range(pp):
        assert w.memory(s).kv_cache == B * C * per_token
        assert w.kv_cache_bytes_per_token(s) == per_token
    # the cache write is this step's one token per request, in the cache's precision, with RoPE
    writes = [n for n in w.role(0).nodes if n.name.endswith("kv_cache_write")]
    assert len(writes) == m.layers // pp
    assert writes[0].mem_bytes == B * (2 * (m.kv_heads // tp) * m.head_dim * (2 + nbytes)
                                       + (m.heads // tp) * m.head_dim * (2 + 2))
    assert not any("rope" in n.name for n in w.role(0).nodes)


def test_decode_collectives(llama_small) -> None:
    """Per layer the two tensor-parallel all-reduces of the B x h activation (the embedding's
    once), the logits all-gathered for sampling; down the pipeline go the residual stream and
    its normalized copy (the next layer's input norm is fused into the last add of the layer
    before, as serving engines run it), 2 * B x h bf16; no gradient, no optimizer."""
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
    assert [n.comm_bytes for n in first.nodes if n.type == SEND] == [2 * act, 2 * act]
    assert [n.comm_bytes for n in last.nodes if n.type == RECV] == [2 * act, 2 * act]
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


# -- multi-latent attention: the latent cache ---------------------------------------------------------

def _deepseek_v3_like():
    """DeepSeek-V3's attention (128 heads, kv_lora_rank 512, qk_rope_head_dim 64, q_lora_rank
    1536), three dense layers and one with its 256 experts."""
    from stage_cosim.model import get_preset

    return get_preset("deepseek-v3").with_overrides(layers=4)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("dtype,nbytes", [("bf16", 2), ("fp8", 1)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (8, 2)])
def test_mla_kv_cache_bytes_per_token(phase, dtype, nbytes, tp, pp) -> None:
    """Multi-latent attention caches the normalized key/value latent and the rotary key of every
    token, kv_lora_rank + qk_pos_emb_head_dim values per layer, shared by all heads: what tensor
    parallelism does not split (each tp rank holds the whole latent); the pipeline splits the
    layers."""
    m = _deepseek_v3_like()
    B, C = 2, 512
    inf = InferenceConfig(phase, batch=B, context_len=C, input_len=C, kv_cache_dtype=dtype, micro_batch=B)
    w = synthesize(m, ParallelConfig(tp=tp, pp=pp), inference=inf)
    per_token = (m.layers // pp) * (m.kv_lora_rank + m.qk_pos_emb_head_dim) * nbytes
    for s in range(pp):
        assert w.kv_cache_bytes_per_token(s) == per_token
        assert w.memory(s).kv_cache == B * C * per_token


def _mla_layer_params(m, i: int) -> int:
    """GEMM weights a token multiplies in layer ``i`` of a DeepSeek-like model: the latent
    attention's projections (the key/value up-projection whole, absorbed or not), the dense MLP
    or the router, top-k routed experts and the shared expert."""
    h, g = m.hidden, m.heads
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    attention = (h * m.q_lora_rank + m.q_lora_rank * g * qk + h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
                 + m.kv_lora_rank * g * (m.qk_head_dim + m.v_head_dim) + g * m.v_head_dim * h)
    if not m.is_moe_layer(i):
        return attention + 3 * h * m.ffn
    return (attention + h * m.num_experts + m.moe_router_topk * 3 * h * m.expert_ffn
            + 3 * h * m.moe_shared_expert_intermediate_size)


def test_mla_decode_and_prefill_flops() -> None:
    """Decode runs latent attention absorbed: each head scores its query against the latent and
    rotary key of every cached token (kv_lora_rank + qk_pos_emb_head_dim) and sums the latents
    (kv_lora_rank), 2 * heads * (2 * kv_lora_rank + qk_pos_emb_head_dim) FLOPs per cached token;
    a prefill expands the latents (the up-projection over every cached token, here the prompt)
    and attends with the heads' own dimensions. The GEMMs are 2 * params per token either way."""
    from test_moe import TINY_MLA as m

    B, C, S = 4, 1000, 300
    gemms = sum(_mla_layer_params(m, i) for i in range(m.layers))
    heads, lkv, rope = m.heads, m.kv_lora_rank, m.qk_pos_emb_head_dim
    logits = 2 * m.vocab * m.hidden
    w = synthesize(m, ParallelConfig(), inference=InferenceConfig("decode", batch=B, context_len=C))
    attention = 2 * heads * (2 * lkv + rope) * C * m.layers
    assert w.total_model_flops() == w.total_matmul_flops() == B * (2 * gemms + logits + attention)
    w = synthesize(m, ParallelConfig(), inference=InferenceConfig("prefill", batch=B, input_len=S))
    pairs = S * (S + 1) // 2
    attention = 2 * heads * (m.qk_head_dim + rope + m.v_head_dim) * pairs * m.layers
    assert w.total_model_flops() == w.total_matmul_flops() == B * (2 * gemms * S + logits + attention)


# -- attention data parallelism -------------------------------------------------------------------------

def _tiny_moe():
    from test_moe import TINY

    return TINY.with_overrides(layers=2)


def test_independent_replicas_keep_the_experts_inside_one(run_cli) -> None:
    """Without attention data parallelism every dp replica is a model instance of its own: its
    expert-parallel groups are inside its tensor-parallel ranks, and an expert mesh that would
    span replicas is refused, pointing at --attention-dp."""
    m = _tiny_moe()
    w = synthesize(m, ParallelConfig(dp=2, tp=2, ep=2, expert_tp=1), inference=InferenceConfig("decode", batch=8))
    assert w.meshes["expert"].groups(("ep",)) == [[0, 1], [2, 3]] == w.mesh.groups(("tp",))
    with pytest.raises(UserError) as exc:
        synthesize(m, ParallelConfig(dp=2, tp=2, ep=4, expert_tp=1), inference=InferenceConfig("decode", batch=8))
    assert exc.value.parameter == "ep" and "--attention-dp" in exc.value.rule
    # (the expert mesh takes a stage's ranks innermost first: dp innermost would mix replicas)
    with pytest.raises(UserError) as exc:
        synthesize(m, ParallelConfig(dp=2, tp=2, ep=2, expert_tp=1, axis_order=("dp", "tp", "cp", "pp")),
                   inference=InferenceConfig("decode", batch=8))
    assert exc.value.parameter == "axis-order"
    code, _, err = run_cli("simulate", "--model", "mixtral-8x7b", "--layers", "2", "--phase", "decode", "--batch", "8",
                           "--dp", "8", "--ep", "8", "--cluster", "dgx-h100:8")
    assert code == 2 and err.startswith("error: ep: expert-tp*ep = 1*8 must divide tp = 1") and "--attention-dp" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("dp,tp,ep", [(4, 1, 4), (8, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_attention_dp_shares_the_experts_over_every_rank(dp, tp, ep) -> None:
    """With attention data parallelism each dp rank decodes its own requests and the expert mesh
    spans the dp ranks: each rank holds num_experts / ep experts, and per MoE layer the dispatch
    and the combine each move the rank's tokens * top-k * hidden * 2 bytes (all-to-all over ep;
    tokens replicated over tp are split over its ranks first and gathered after)."""
    m = _tiny_moe()
    B = 4 * dp                                              # 4 requests per dp rank
    w = synthesize(m, ParallelConfig(dp=dp, tp=tp, ep=ep, expert_tp=1),
                   inference=InferenceConfig("decode", batch=B, context_len=300, attention_dp=True))
    groups = w.meshes["expert"].groups(("ep",))
    assert all(len(g) == ep for g in groups) and len(groups) == dp * tp // ep
    assert len({w.mesh.coord(r, "dp") for r in groups[0]}) == ep // tp      # the groups span dp ranks
    tokens = 4 // tp                                         # this rank's share of its replica's tokens
    a2a = [n for n in w.role(0).nodes if n.type == COLL and n.coll.value == "ALL_TO_ALL"]
    moe_layers = sum(m.moe_layers())
    assert len(a2a) == 2 * moe_layers and all(n.group == "ep" for n in a2a)
    assert all(n.comm_bytes == tokens * m.moe_router_topk * m.hidden * 2 for n in a2a)
    expert = 3 * m.hidden * m.expert_ffn * 2                 # one expert's bf16 weights
    dense = synthesize(m, ParallelConfig(dp=dp, tp=tp, expert_tp=1),
                       inference=InferenceConfig("decode", batch=B, context_len=300))
    assert dense.memory(0).weights - w.memory(0).weights == moe_layers * (m.num_experts - m.num_experts // ep) * expert


def test_attention_dp_errors(run_cli, llama_small) -> None:
    with pytest.raises(UserError) as exc:
        synthesize(llama_small, ParallelConfig(dp=2), inference=InferenceConfig("decode", batch=2, attention_dp=True))
    assert exc.value.parameter == "attention-dp"
    for args, message in [
        (("--model", "llama3-8b", "--phase", "decode", "--attention-dp", "--dp", "2", "--batch", "2"),
         "error: attention-dp: shares the experts between the dp ranks' attention; llama3-8b has no experts"),
        (("--model", "mixtral-8x7b", "--layers", "2", "--attention-dp", "--dp", "2", "--ep", "2"),
         "error: attention-dp: is an inference option"),
    ]:
        code, _, err = run_cli("simulate", *args, "--cluster", "dgx-h100:2")
        assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_cli_reports_attention_dp(run_cli) -> None:
    import json

    code, out, err = run_cli("simulate", "--model", "mixtral-8x7b", "--layers", "2", "--phase", "decode", "--batch",
                             "16", "--dp", "8", "--ep", "8", "--attention-dp", "--json", "--cluster", "dgx-h100:8")
    assert code == 0, err
    inf = json.loads(out)["inference"]
    assert inf["attention_dp"] is True and inf["requests_per_replica"] == 2


# -- weight precision -------------------------------------------------------------------------------------

def _decode(m, par, batch: int, context: int, weight_dtype: str, micro_batch: int | None = None):
    return synthesize(m, par, inference=InferenceConfig("decode", batch=batch, context_len=context,
                                                        weight_dtype=weight_dtype, micro_batch=micro_batch))


@pytest.mark.parametrize("weight_dtype,per_param", [("bf16", 2), ("fp8", 1), ("int4", 0.5 + 2 / 128)])
@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_decode_weights_as_stored(llama_small, weight_dtype, per_param, dp, tp, pp) -> None:
    """The layers' GEMM weights are stored (and read once per micro-batch) at 2 bytes per
    parameter in bf16, 1 in fp8, 1/2 + 2/128 in int4 (a 4-bit weight and an fp16 scale per
    group of 128); the norms, the embedding and the output layer stay bf16. A decode step reads
    each weight once and the KV cache once: bytes_read = GEMM params * per_param + the rest in
    bf16 + the KV cache, over every rank; and per rank 2 bytes(1) - bytes(2) is its weights.

    The first stage holds the embedding, its layers and the first layer's input norm (the
    embedding runs it; each layer holds its MLP norm and the next layer's input norm, which its
    last residual add is fused with — the final norm for the model's last layer): 2 * layers + 1
    norms of h. FP8's activation scales are the checkpoint's (static): no amax to write or read."""
    m = llama_small
    par = ParallelConfig(dp=dp, tp=tp, pp=pp)
    V = par.padded_vocab(m.vocab)
    gemms = m.layers * _layer_params(m)
    bf16 = 2 * (V * m.hidden + V * m.hidden + (2 * m.layers + 1) * m.hidden * tp)     # embedding, output, norms
    B, C = 8 * dp, 700
    w = _decode(m, par, B, C, weight_dtype)
    kv = B * C * 2 * m.layers * m.kv_heads * m.head_dim * 2
    s = step_summary(w, resolve_cluster("dgx-h100", par.world_size), 1.0)
    assert s["bytes_read"] == pytest.approx((gemms * per_param + bf16) * dp * w.parallel.num_microbatches + kv, rel=1e-12)
    assert s["weight_dtype"] == weight_dtype
    # the first stage: the embedding and its layers (and with pp = 1 the output layer)
    layers = m.layers // pp
    first = layers * _layer_params(m) // tp * per_param + 2 * (V * m.hidden // tp + (2 * layers + 1) * m.hidden)
    assert w.memory(0).weights == pytest.approx(first + (2 * V * m.hidden // tp if pp == 1 else 0), abs=1)

    def step(batch_per_replica: int) -> int:
        return _bytes_per_rank(_decode(m, par, dp * batch_per_replica, 512, weight_dtype, batch_per_replica))

    read = gemms // tp * per_param + 2 * (V * m.hidden // tp + (2 * m.layers + 1) * m.hidden)
    assert 2 * step(1) - step(2) == pytest.approx(read, abs=pp)


def test_fp8_weights_run_fp8_gemms_with_dynamic_activation_scales(llama_small) -> None:
    """W8A8 with dynamic scales: every GEMM of a layer runs in FP8 reading the FP8 weight as
    stored (no cast of its own, no transposed copy: there is no backward) and its input quantized
    per tensor as it comes, an amax pass and a cast (memory-bound kernels of their own);
    embedding, logits and attention stay BF16; FP8 GEMMs run at the FP8 peak and the result
    reports MFU against it."""
    m = llama_small
    w = synthesize(m, ParallelConfig(tp=2), inference=InferenceConfig("decode", batch=8, context_len=1000,
                                                                       weight_dtype="fp8", fp8_activation_scale="dynamic"))
    nodes = [n for n in w.role(0).nodes if n.type == COMP]
    layer0 = [n for n in nodes if n.block == "layer0"]
    gemms = [n for n in layer0 if n.category == "einsum"]
    assert [n.name.split(".", 1)[1] for n in gemms] == ["qkv", "proj", "fc1", "fc2"]
    assert all(n.matmul == "fp8" for n in gemms)
    assert [n.category for n in layer0].count("quantize") == 4 == [n.category for n in layer0].count("amax")
    assert not any(n.category == "transpose" for n in nodes)
    assert {n.matmul for n in nodes if n.block in ("embedding", "head") and n.matmul} <= {"bf16"}
    assert next(n for n in layer0 if n.category == "attention").matmul == "bf16"
    # an FP8 GEMM's input: its bf16 activation read, the fp8 copy written (a scale per tensor)
    x = 8 * m.hidden
    quantize = next(n for n in layer0 if n.category == "quantize")
    assert quantize.mem_bytes == x * 2 + x * 1 + 4
    from stage_cosim.adapters.roofline.simulate import simulate

    cluster = resolve_cluster("dgx-h100:2")
    r = simulate(w, cluster).result
    # H100 SXM dense peaks, NVIDIA's H100 datasheet: 989 TFLOP/s BF16, 1,979 FP8
    assert r.mfu_fp8 == pytest.approx(r.mfu * 989 / 1979)
    assert r.precision["dtype"] == "fp8" and r.precision["recipe"] == "tensorwise"
    assert r.precision["activation_scale"] == "dynamic"


def test_fp8_static_scales_fuse_the_casts(llama_small) -> None:
    """W8A8 with the checkpoint's static scales (the default): no amax kernel anywhere; the
    fused residual add + RMSNorm writes FC1's input in FP8 (vLLM's
    fused_add_rms_norm_static_fp8_quant) and SiLU-and-mul writes FC2's (silu_and_mul_quant);
    the QKV input (the norm of the layer before, which hands on bf16) and the attention output
    get a cast of their own, with no amax. Bytes per request, h hidden, f = ffn / tp:

    * fused add + norm: reads the residual and the all-reduced output, 2 + 2 bytes per element,
      and its weight (2 h); writes the residual (2) and the fp8 input (1): 7 h + 2 h;
    * SiLU-and-mul: reads gate and up, 2 * 2 f; writes f in fp8: 5 f;
    * a cast: reads bf16, writes fp8: 3 bytes per element (the static scale's 4 bytes are not
      counted)."""
    m = llama_small
    B, tp = 8, 2
    w = _decode(m, ParallelConfig(tp=tp), B, 1000, "fp8")
    layer0 = [n for n in w.role(0).nodes if n.type == COMP and n.block == "layer0"]
    kinds = [n.category for n in layer0]
    assert "amax" not in {n.category for n in w.role(0).nodes}
    assert all(n.matmul == "fp8" for n in layer0 if n.category == "einsum")
    casts = [n.name.split(".", 1)[1] for n in layer0 if n.category == "quantize"]
    assert casts == ["input_norm.quantize", "attention.quantize"]
    h, f = m.hidden, m.ffn // tp
    by = {n.name.split(".", 1)[1]: n.mem_bytes for n in layer0}
    assert by["attention_residual+mlp_norm"] == B * 7 * h + 2 * h
    assert by["swiglu"] == B * 5 * f
    assert by["input_norm.quantize"] == B * 3 * h
    assert by["attention.quantize"] == B * 3 * (m.heads // tp) * m.head_dim
    assert kinds.count("einsum") == 4
    # dynamic scales cost more kernels and bytes: an amax and a cast per GEMM input
    dynamic = synthesize(m, ParallelConfig(tp=tp), inference=InferenceConfig(
        "decode", batch=B, context_len=1000, weight_dtype="fp8", fp8_activation_scale="dynamic"))
    d0 = [n for n in dynamic.role(0).nodes if n.type == COMP and n.block == "layer0"]
    assert len(d0) - len(layer0) == 4 + 2 and sum(n.mem_bytes for n in d0) > sum(n.mem_bytes for n in layer0)


def test_decode_layer_bytes_closed_form(llama_small) -> None:
    """Every kernel of a decode layer, as serving engines fuse them, summed: per request (one
    new token), with H = heads/tp query heads, G = kv_heads/tp, d head_dim, h hidden, f = ffn/tp,
    bf16 (2 bytes) throughout:

    * QKV GEMM: reads the normalized input 2h, writes 2 (H + 2G) d;
    * cache write with RoPE: reads q, k, v, 2 (H + 2G) d; writes q back, 2 H d, and k, v, 4 G d;
    * attention: reads q, 2 H d, and the C cached tokens, 4 G d C; writes its output 2 H d and
      the log-sum-exp, 4 H (fp32 per head);
    * output projection: reads 2 H d, writes 2h (then all-reduced);
    * residual add + RMSNorm: reads 2h + 2h, writes 2h + 2h;
    * FC1: reads 2h, writes 2 * 2f; SiLU-and-mul: reads 4f, writes 2f; FC2: reads 2f, writes 2h;
    * residual add + the next layer's input norm: reads 2h + 2h, writes 2h + 2h;

    plus, once per step, the weights: the four GEMMs' and two norm weights of h, 2 bytes each.
    So bytes(B, C) = weights + B * a + B * C * 4 G d, with a the sum above."""
    m = llama_small
    for tp in (1, 2):
        H, G, d, h, f = m.heads // tp, m.kv_heads // tp, m.head_dim, m.hidden, m.ffn // tp
        a = (2 * h + 2 * (H + 2 * G) * d
             + 2 * (H + 2 * G) * d + 2 * H * d + 4 * G * d
             + 2 * H * d + 2 * H * d + 4 * H
             + 2 * H * d + 2 * h
             + 8 * h
             + 2 * h + 4 * f + 4 * f + 2 * f + 2 * f + 2 * h
             + 8 * h)
        weights = 2 * (_layer_params(m) // tp + 2 * h)
        for B, C in ((1, 100), (3, 1000)):
            w = synthesize(m, ParallelConfig(tp=tp),
                           inference=InferenceConfig("decode", batch=B, context_len=C, micro_batch=B))
            layer = sum(n.mem_bytes for n in w.role(0).nodes if n.type == COMP and n.block == "layer0")
            assert layer == weights + B * a + B * C * 4 * G * d, (tp, B, C)


def test_int4_dequantizes_in_the_gemm(llama_small) -> None:
    """W4A16: BF16 GEMMs read the packed weights and dequantize them in the kernel (3 FLOPs per
    weight, executed, not model FLOPs): no kernel of their own."""
    m = llama_small
    B = 4
    w = _decode(m, ParallelConfig(tp=2), B, 1000, "int4")
    bf16 = _decode(m, ParallelConfig(tp=2), B, 1000, "bf16")
    assert [n.category for n in w.role(0).nodes] == [n.category for n in bf16.role(0).nodes]
    assert w.total_model_flops() == bf16.total_model_flops()
    assert w.total_matmul_flops() - bf16.total_matmul_flops() == 3 * m.layers * _layer_params(m)


def test_weight_dtype_errors(run_cli) -> None:
    code, _, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--phase", "decode", "--weight-dtype",
                           "fp8", "--cluster", "dgx-a100:1")
    assert code == 2 and err.startswith("error: weight-dtype: fp8 needs FP8 tensor cores; A100") and \
        len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli("simulate", "--model", "llama3-8b", "--weight-dtype", "int4")
    assert code == 2 and err.startswith("error: weight-dtype: is an inference option")
    with pytest.raises(UserError) as exc:
        InferenceConfig("decode", weight_dtype="int8")
    assert exc.value.parameter == "weight-dtype"


def test_cli_reports_the_weight_dtype(run_cli) -> None:
    import json

    reads = {}
    for dtype in ("bf16", "fp8", "int4"):
        code, out, err = run_cli("simulate", "--model", "llama3-8b", "--tp", "2", "--phase", "decode", "--batch", "8",
                                 "--context-len", "1000", "--weight-dtype", dtype, "--json")
        assert code == 0, err
        r = json.loads(out)
        assert r["inference"]["weight_dtype"] == dtype
        reads[dtype] = {"bytes": r["inference"]["bytes_read"], "step_s": r["step_time_s"]}
    assert reads["int4"]["bytes"] < reads["fp8"]["bytes"] < reads["bf16"]["bytes"]
    assert reads["int4"]["step_s"] < reads["fp8"]["step_s"] < reads["bf16"]["step_s"]    # a decode step is memory-bound


# -- context parallelism for long prompts -------------------------------------------------------------

@pytest.mark.parametrize("cp_comm", ["p2p", "all-gather", "a2a"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_prefill_flops_sum_to_the_cp1_total(llama_small, cp, cp_comm) -> None:
    """The prompts are sharded over cp (load-balanced chunks): the model FLOPs summed over every
    rank are the cp = 1 closed form; executed, only the last tokens' logits repeat on each cp
    rank (the head samples after the sequence is gone)."""
    m = llama_small
    par = ParallelConfig(dp=2, cp=cp, cp_comm=cp_comm)
    B, S = 4, 1024
    w = synthesize(m, par, inference=InferenceConfig("prefill", batch=B, input_len=S))
    V = par.padded_vocab(m.vocab)
    expected = _prefill_matmul_flops(m, V, B, S)
    assert w.total_model_flops() == expected
    assert w.total_matmul_flops() == expected + (cp - 1) * 2 * V * m.hidden * B
    # each cp rank caches its own tokens
    per_token = 2 * m.layers * m.kv_heads * m.head_dim * 2
    assert w.memory(0).kv_cache == (B // 2) * S // cp * per_token


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2), (1, 4), (2, 4)])
def test_cp_prefill_ring_bytes(llama_small, tp, cp) -> None:
    """Ring attention in the forward only: per layer a rank sends cp - 1 chunks of its cached
    keys and values, (cp - 1) * 2 * b * (S / cp) * (kv_heads / tp) * head_dim * bytes, and
    receives as many; nothing else of the layer goes over cp."""
    from stage_cosim.schedule.nodes import RECV, SEND

    m = llama_small
    b, S = 2, 2048
    for dtype, nbytes in (("bf16", 2), ("fp8", 1)):
        w = synthesize(m, ParallelConfig(tp=tp, cp=cp),
                       inference=InferenceConfig("prefill", batch=b, input_len=S, kv_cache_dtype=dtype))
        layer = [n for n in w.role(0).nodes if n.block == "layer0"]
        ring = (cp - 1) * 2 * b * (S // cp) * (m.kv_heads // tp) * m.head_dim * nbytes
        assert sum(n.comm_bytes for n in layer if n.type == SEND) == ring
        assert sum(n.comm_bytes for n in layer if n.type == RECV) == ring
        assert not any(n.type == COLL and n.group == "cp" for n in layer)
        assert all(n.phase == "fwd" for n in w.role(0).nodes)


@pytest.mark.slow
def test_cp_prefill_with_latent_attention() -> None:
    """A DeepSeek-like prefill over cp: each rank caches the latents of its own tokens and
    expands them; the model FLOPs are those of cp = 1."""
    from test_moe import TINY_MLA as m

    B, S = 2, 512
    one = synthesize(m, ParallelConfig(), inference=InferenceConfig("prefill", batch=B, input_len=S))
    w = synthesize(m, ParallelConfig(cp=2), inference=InferenceConfig("prefill", batch=B, input_len=S))
    assert w.total_model_flops() == one.total_model_flops()
    assert w.memory(0).kv_cache == one.memory(0).kv_cache // 2 == B * S // 2 * m.layers * (m.kv_lora_rank + m.qk_pos_emb_head_dim) * 2


def test_cp_prefill_errors(run_cli) -> None:
    code, _, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--phase", "prefill", "--cp", "4",
                           "--input-len", "1020", "--cluster", "dgx-h100:4")
    assert code == 2 and err.startswith("error: input-len: must be divisible by 2*cp = 8"), err
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--phase", "prefill", "--cp", "4",
                             "--input-len", "32768", "--cluster", "dgx-h100:4")
    assert code == 0, err
    assert "cp4(p2p)" in out


# -- two-batch overlap --------------------------------------------------------------------------------------

def _synthetic_moe():
    """A small MoE whose expert GEMMs and attention each outlast an all-to-all across two nodes
    (16 experts of 8192, top-2, hidden 2048; 16 key-value heads: the attention side's GEMMs at
    the measured rates are 22 % longer than the all-to-all, 4 would leave them shorter)."""
    from stage_cosim.model.config import ModelConfig

    return ModelConfig.build("syn-moe", "llama", layers=4, hidden=2048, ffn=4096, heads=16, kv_heads=16, vocab=4096,
                             max_seq=8192, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=8192)


def _stages(w, cluster):
    """(compute time of each stage, time of each collective) of a pass that runs them one after
    another: the kernels between two collectives are a stage. From the GPU model's kernel
    times and the network model's collective times (the inputs of the closed form)."""
    from stage_cosim.adapters.roofline.network import CalibratedNetwork
    from stage_cosim.adapters.roofline.kernels import step_compute_model

    # an inference step's kernels: the serving kernel model, as the simulator prices them
    cm, net = step_compute_model(cluster.gpu, inference=True), CalibratedNetwork(cluster)
    stages, colls = [0.0], []
    for n in w.role(0).nodes:
        if n.type == COMP:
            stages[-1] += cm.node_duration_s(n)
        else:
            colls.append(net.duration(n.coll.value, n.comm_bytes, w.group_members(0, n.group)))
            stages.append(0.0)
    return stages, colls


def test_two_batch_overlap_closed_form() -> None:
    """Two micro-batches A and B of one shape, each a chain of compute stages S_0 … S_K split by
    K all-to-alls of time a (the dispatch and combine of each MoE layer). Overlapped, the stages
    take turns on the compute stream, A_0 B_0 A_1 B_1 …, and each all-to-all runs while the other
    micro-batch computes: A's k-th starts when A_k ends and is hidden behind B_k if a <= |B_k|;
    B's k-th starts when B_k ends and is hidden behind A_(k+1) if a <= |A_(k+1)|. With every
    stage but the last at least a long, the compute stream never waits until B's last stage,
    which waits for B's last all-to-all (started as A_K began): with W = sum |S_k|,

        T_overlap = 2 W + max(0, a - |S_K|)

    Run whole (no overlap), one micro-batch of twice the requests waits for every all-to-all:
    T = W_full + K a_full. Prefill of 2 prompts of 2048 tokens per rank, 16 ranks over two DGX
    H100 nodes (ep 16, attention data parallelism)."""
    from stage_cosim.adapters.roofline.simulate import simulate

    m = _synthetic_moe()
    cluster = resolve_cluster("dgx-h100:16")
    par = ParallelConfig(dp=16, ep=16)

    def step(per_rank: int, overlap: bool):
        return synthesize(m, par, inference=InferenceConfig("prefill", batch=16 * per_rank, input_len=2048,
                                                            attention_dp=True, two_batch_overlap=overlap))

    stages, colls = _stages(step(1, False), cluster)
    a = colls[0]
    assert len(colls) == 2 * m.layers and all(c == pytest.approx(a, rel=1e-12) for c in colls)
    assert min(stages[:-1]) >= a > stages[-1]                 # the regime of the closed form
    w = step(2, True)
    assert w.two_batch
    expected = 2 * sum(stages) + max(0.0, a - stages[-1])
    assert simulate(w, cluster).result.step_time_s == pytest.approx(expected, rel=1e-9)
    assert simulate(w, cluster, exact=True).result.step_time_s == pytest.approx(expected, rel=1e-9)
    full_stages, full_colls = _stages(step(2, False), cluster)
    whole = simulate(step(2, False), cluster).result.step_time_s
    assert whole == pytest.approx(sum(full_stages) + sum(full_colls), rel=1e-9)
    assert expected < whole


@pytest.mark.parametrize("phase,pp,micro_batch,tp", [("decode", 1, None, 1), ("prefill", 1, None, 1),
                                                       ("decode", 2, 4, 1), ("prefill", 2, 2, 2)])
def test_two_batch_overlap_fast_path_is_exact(phase, pp, micro_batch, tp) -> None:
    """The fast path replays a pass of both micro-batches as one template: the same step time as
    the node-level replay of every pass, with one pass and with several down a pipeline."""
    from stage_cosim.adapters.roofline.simulate import simulate

    m = _tiny_moe()
    kw = dict(context_len=700) if phase == "decode" else dict(input_len=256)
    w = synthesize(m, ParallelConfig(dp=4, tp=tp, pp=pp, ep=4, expert_tp=1),
                   inference=InferenceConfig(phase, batch=4 * 8, micro_batch=micro_batch, attention_dp=True,
                                             two_batch_overlap=True, **kw))
    assert w.two_batch and w.parallel.num_microbatches == 8 // (micro_batch or 8)
    cluster = resolve_cluster(f"dgx-h100:{w.world_size}")
    assert simulate(w, cluster).result.step_time_s == pytest.approx(simulate(w, cluster, exact=True).result.step_time_s,
                                                                rel=1e-12)


def test_two_batch_overlap_splits_the_requests() -> None:
    """Each micro-batch's requests run as two of half the requests: twice the kernels, each
    request's KV cache once, the model FLOPs unchanged, every weight read by both (bytes_read);
    a micro-batch of one request cannot be split and runs whole."""
    m = _tiny_moe()
    par = ParallelConfig(dp=4, ep=4)

    def step(batch: int, overlap: bool):
        return synthesize(m, par, inference=InferenceConfig("decode", batch=batch, context_len=700, attention_dp=True,
                                                            two_batch_overlap=overlap))

    one, two = step(4 * 6, False), step(4 * 6, True)
    assert two.memory(0).kv_cache == one.memory(0).kv_cache
    assert two.total_model_flops() == one.total_model_flops()
    comp = lambda w: [n for n in w.role(0).nodes if n.type == COMP]  # noqa: E731
    assert len(comp(two)) == 2 * len(comp(one))
    assert {n.name.rsplit(".", 1)[1] for n in comp(two)} == {"half0", "half1"}
    cluster = resolve_cluster("dgx-h100:4")
    s1, s2 = step_summary(one, cluster, 1.0), step_summary(two, cluster, 1.0)
    weights = sum(one.memory(s).weights for s in range(1)) * 4
    assert s2["bytes_read"] - s1["bytes_read"] == weights
    assert not step(4, True).two_batch                         # one request per rank


def test_two_batch_overlap_errors(run_cli, llama_small) -> None:
    """Refused where nothing communicates (tp = ep = expert-tp = 1) and with cp; the flag and
    dynamic FP8 scales need an inference step (and fp8 weights)."""
    with pytest.raises(UserError) as exc:
        synthesize(llama_small, ParallelConfig(dp=2),
                   inference=InferenceConfig("decode", batch=4, two_batch_overlap=True))
    assert exc.value.parameter == "two-batch-overlap" and "communicate nothing" in exc.value.rule
    with pytest.raises(UserError) as exc:
        synthesize(llama_small, ParallelConfig(tp=2, cp=2),
                   inference=InferenceConfig("prefill", batch=4, input_len=1024, two_batch_overlap=True))
    assert exc.value.parameter == "two-batch-overlap"
    with pytest.raises(UserError) as exc:
        InferenceConfig("decode", fp8_activation_scale="dynamic")
    assert exc.value.parameter == "fp8-activation-scale"
    for args, message in [
        (("--phase", "decode", "--batch", "4", "--two-batch-overlap"),
         "error: two-batch-overlap: overlaps one micro-batch's communication with the other's compute"),
        (("--two-batch-overlap",), "error: two-batch-overlap: is an inference option"),
        (("--phase", "decode", "--fp8-activation-scale", "dynamic"),
         "error: fp8-activation-scale: scales the activations of FP8 GEMMs: it needs --weight-dtype fp8"),
    ]:
        code, _, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", *args)
        assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_cli_two_batch_overlap(run_cli) -> None:
    import json

    code, out, err = run_cli("simulate", "--model", "mixtral-8x7b", "--layers", "2", "--phase", "prefill", "--batch",
                             "16", "--input-len", "512", "--dp", "8", "--ep", "8", "--attention-dp",
                             "--two-batch-overlap", "--weight-dtype", "fp8", "--fp8-activation-scale", "dynamic",
                             "--json", "--cluster", "dgx-h100:8")
    assert code == 0, err
    inf = json.loads(out)["inference"]
    assert inf["two_batch_overlap"] is True and inf["fp8_activation_scale"] == "dynamic"


def test_serving_timer_with_two_batch_overlap_falls_back_to_simulating() -> None:
    """Overlapped steps are not a sum of kernel times: the serving timer's split fails its check
    against the simulator and it simulates every (snapped) step instead, each the step time
    ``simulate`` gives for that shape."""
    from fractions import Fraction

    from stage_cosim.adapters.roofline.fast import simulate_fast
    from stage_cosim.adapters.roofline.simulate import make_network
    from stage_cosim.inference.config import BatchShape
    from stage_cosim.adapters.roofline.kernels import InferenceComputeModel
    from stage_cosim.serving.steptime import StepTimer
    from stage_cosim.workload import synthesize_step

    m = _tiny_moe()
    par = ParallelConfig(dp=4, ep=4)
    inf = InferenceConfig("decode", attention_dp=True, two_batch_overlap=True)
    cluster = resolve_cluster("dgx-h100:4")
    timer = StepTimer(m, par, inf, cluster)
    shape = BatchShape.uniform(6, 1, 299, frozenset(m.layer_windows()))
    t = timer(shape)
    assert timer.stats.mode == "snapped" and "off the simulator" in timer.stats.reason
    # (each total snapped to the timer's grid)
    g = timer.grid.snap
    snapped = BatchShape(6, 6, tuple((w, g(kv)) for w, kv in shape.kv_tokens),
                         tuple((w, Fraction(g(float(p)))) for w, p in shape.pairs))
    w = synthesize_step(m, timer.parallel_for(1), snapped, "bf16", inf)
    assert w.two_batch
    # the simulator's replay of that step with the serving kernel model (GEMMs by the measured
    # microbenchmarks, which serving steps are priced by)
    network = make_network("calibrated", cluster)
    assert t == pytest.approx(max(simulate_fast(w, network, InferenceComputeModel(cluster.gpu))[0]), rel=1e-12)
