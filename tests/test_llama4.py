"""Llama 4 (Scout, Maverick) and chunked attention, against totals and pairs worked by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stage_cosim import api
from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import BatchShape, attention_pairs, held
from stage_cosim.model import ModelConfig, resolve_model
from stage_cosim.model.architecture import ChunkSpan
from stage_cosim.model.hf import model_from_hf_dict
from stage_cosim.parallel import ParallelConfig
from stage_cosim.serving.chunked import ChunkReads
from stage_cosim.serving.config import SLO, ServingConfig
from stage_cosim.serving.requests import Requests
from stage_cosim.serving.run import deploy, simulate_serving
from stage_cosim.serving.steptime import StepTimer
from stage_cosim.workload import synthesize

# Per layer, by hand from the published dimensions (hidden 5120, 40 query heads and 8 KV heads of
# 128, SwiGLU MLPs of three 5120 x f matrices, two RMSNorms):
#   attention   q 5120*5120 + k, v 2*5120*1024 + o 5120*5120      = 62,914,560
#   one expert (or the shared expert), f = 8192: 3*5120*8192      = 125,829,120
#   dense MLP, f = 16384: 3*5120*16384                            = 251,658,240
#   norms 2*5120                                                   = 10,240
# plus the untied embedding and output layer, 2*202048*5120 = 2,068,971,520, and the final norm.
ATTN, EXPERT, DENSE, NORMS, EMBED = 62_914_560, 125_829_120, 251_658_240, 10_240, 2_068_971_520


def test_scout_parameters_by_hand() -> None:
    """16 experts and a router of 5120*16 in every one of 48 layers: 2,202,101,760 per layer,
    107,769,861,120 in all; a token uses one expert and the shared one: 17,172,894,720. Meta
    publishes 109B total (the vision encoder included) and 17B active."""
    m = resolve_model("llama4-scout")
    layer = ATTN + 5120 * 16 + 16 * EXPERT + EXPERT + NORMS
    assert layer == 2_202_101_760
    assert m.param_count() == 48 * layer + EMBED + 5120 == 107_769_861_120
    assert m.active_param_count() == 48 * (ATTN + 5120 * 16 + 2 * EXPERT + NORMS) + EMBED + 5120 == 17_172_894_720
    assert m.param_count() == pytest.approx(109e9, rel=0.02)
    assert m.active_param_count() == pytest.approx(17e9, rel=0.02)


def test_maverick_parameters_by_hand() -> None:
    """128 experts in the 24 odd layers (16,295,536,640 each), a dense MLP of 16,384 in the 24
    even ones (314,583,040 each): 400,711,848,960; active 17,184,691,200. Meta: 400B, 17B."""
    m = resolve_model("llama4-maverick")
    moe = ATTN + 5120 * 128 + 128 * EXPERT + EXPERT + NORMS
    dense = ATTN + DENSE + NORMS
    assert (moe, dense) == (16_295_536_640, 314_583_040)
    assert m.param_count() == 24 * (moe + dense) + EMBED + 5120 == 400_711_848_960
    assert m.active_param_count() == 24 * (ATTN + 5120 * 128 + 2 * EXPERT + NORMS + dense) + EMBED + 5120
    assert m.active_param_count() == 17_184_691_200
    assert m.param_count() == pytest.approx(400e9, rel=0.01)
    assert m.active_param_count() == pytest.approx(17e9, rel=0.02)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_every_fourth_layer_is_global() -> None:
    m = resolve_model("llama4-scout")
    windows = m.layer_windows()
    assert windows[3] is None and windows[47] is None and windows[0] == ChunkSpan(8192)
    assert sum(w is None for w in windows) == 12
    # a chunk is never mistaken for a sliding window of the same length
    assert ChunkSpan(8192) != 8192 and 8192 != ChunkSpan(8192) and len({ChunkSpan(8192), 8192}) == 2


# -- chunked attention: pairs and the cache ------------------------------------------------------

def test_chunked_pairs_hand_worked() -> None:
    """A 20,000-token prompt in 8,192-token chunks: two full chunks and one of 3,616; a chunk of
    L tokens scores L(L+1)/2 pairs: 2 * 33,558,528 + 6,539,728 = 73,656,592. The cache holds the
    last chunk's 3,616 tokens."""
    c = ChunkSpan(8192)
    assert attention_pairs(20000, 0, c) == 73_656_592
    assert held(20000, 0, c) == 3616
    # decoding: the 8,192nd token sees its whole chunk, the next starts a new one
    assert attention_pairs(1, 8191, c) == 8192 and held(1, 8191, c) == 8192
    assert attention_pairs(1, 8192, c) == 1 and held(1, 8192, c) == 1
    # a prompt continued across a boundary: 192 tokens ending chunk 1 (8001..8192 of it), then
    # 4,808 tokens of chunk 2
    assert attention_pairs(5000, 8000, c) == sum(range(8001, 8193)) + 4808 * 4809 // 2


def test_chunked_pairs_brute_force() -> None:
    """Against the mask itself: key j is seen by query i (1-based) when j <= i and both lie in
    the same chunk."""
    rnd = random.Random(3)
    for _ in range(30):
        c, past, new = rnd.randint(1, 40), rnd.randint(0, 120), rnd.randint(1, 90)
        mask = sum(1 for i in range(past + 1, past + new + 1) for j in range(1, i + 1) if (i - 1) // c == (j - 1) // c)
        assert attention_pairs(new, past, ChunkSpan(c)) == mask
        ctx = past + new
        assert held(new, past, ChunkSpan(c)) == ctx - (ctx - 1) // c * c


def _chunked(chunk: int = 1024, **kw) -> ModelConfig:
    return ModelConfig.build("chunked", "llama", layers=4, hidden=1024, ffn=2816, heads=16, kv_heads=4,
                             vocab=32000, max_seq=32768, attention_chunk_size=chunk,
                             layer_types=("chunked_attention", "full_attention"), **kw)


def _node(w, name: str):
    return next(n for n in w.roles[0].nodes if n.name == name and n.micro_batch in (0, -1))


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_training_attention_flops(causal: bool) -> None:
    """2,500 tokens in 1,024-token chunks: squares of 1024, 1024 and 452, sum L^2 = 2,301,456
    scores (model FLOPs count them all), half of them under the causal mask (a flash kernel skips
    the blocks outside a query's chunk); the global layer s^2 = 6,250,000 and half."""
    m = _chunked(causal_flops=causal)
    b, s = 2, 2500
    w = synthesize(m, ParallelConfig(micro_batch=b, seq_len=s))
    per_pair = 4 * b * m.heads * m.head_dim
    chunked, full = _node(w, "layer0.attention"), _node(w, "layer1.attention")
    assert chunked.model_flops == pytest.approx(per_pair * 2_301_456, rel=1e-12)
    assert chunked.flops == pytest.approx(per_pair * (1_150_728 if causal else 2_301_456), rel=1e-12)
    assert full.flops == pytest.approx(per_pair * (3_125_000 if causal else 6_250_000), rel=1e-12)
    assert _node(w, "layer2.attention").flops == chunked.flops


def test_chunked_prefill_and_decode_flops_and_cache() -> None:
    """Inference, exactly: a prefill of 2 prompts of 2,500 tokens scores 2 * (2 * 524,800 +
    102,378) pairs per chunked layer (L(L+1)/2 per chunk) against 2 * 3,126,250 per global one;
    a decode at context 2,500 reads 452 keys in a chunked layer, 2,500 in a global one."""
    m = _chunked()
    layer = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden + 3 * m.hidden * m.ffn
    par = ParallelConfig(tp=2)
    V = par.padded_vocab(m.vocab)
    per_pair = 4 * m.head_dim * m.heads
    w = synthesize(m, par, inference=InferenceConfig("prefill", batch=2, input_len=2500))
    pairs = 2 * (2 * (2 * 524_800 + 102_378) + 2 * 3_126_250)
    assert w.total_matmul_flops() == 2 * m.layers * layer * 2 * 2500 + 2 * V * m.hidden * 2 + per_pair * pairs
    # the cache: a chunked layer holds the last chunk's 452 tokens, a global one all 2,500
    per_token_layer = 2 * (m.kv_heads // 2) * m.head_dim * 2
    assert w.memory(0).kv_cache == 2 * per_token_layer * (2 * 452 + 2 * 2500)
    d = synthesize(m, par, inference=InferenceConfig("decode", batch=3, context_len=2500))
    assert d.total_matmul_flops() == (2 * m.layers * layer * 3 + 2 * V * m.hidden * 3
                                      + per_pair * 3 * (2 * 452 + 2 * 2500))


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [0, -8192])
def test_chunk_size_must_be_positive(chunk: int) -> None:
    with pytest.raises(UserError) as e:
        ModelConfig.build("x", "llama", layers=2, hidden=64, ffn=128, heads=4, vocab=100, max_seq=64,
                          attention_chunk_size=chunk)
    assert e.value.parameter == "attention-chunk-size" and "positive integer" in e.value.rule
    assert "\n" not in str(e.value)


def test_chunked_layers_need_a_chunk_size() -> None:
    with pytest.raises(UserError, match="attention-chunk-size is not set"):
        ModelConfig.build("x", "llama", layers=2, hidden=64, ffn=128, heads=4, vocab=100, max_seq=64,
                          layer_types=("chunked_attention", "full_attention"))


# -- the Hugging Face reader ---------------------------------------------------------------------

SCOUT_TEXT = {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
              "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048, "hidden_act": "silu",
              "max_position_embeddings": 10485760, "num_local_experts": 16, "num_experts_per_tok": 1,
              "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layers": [],
              "attention_chunk_size": 8192, "tie_word_embeddings": False}


def _same(read: ModelConfig, preset: str) -> None:
    expected = resolve_model(preset).to_dict()
    got = read.to_dict()
    expected.pop("name"), got.pop("name")
    assert got == expected


def test_multimodal_config_reads_its_text_config() -> None:
    cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
           "text_config": dict(SCOUT_TEXT, model_type="llama4_text"), "vision_config": {"hidden_size": 1408}}
    _same(model_from_hf_dict(cfg), "llama4-scout")


def test_maverick_text_config_interleaves_moe_layers() -> None:
    cfg = dict(SCOUT_TEXT, num_local_experts=128, interleave_moe_layer_step=2, max_position_embeddings=1048576)
    _same(model_from_hf_dict(cfg), "llama4-maverick")
    # the same layers named by moe_layers, and the attention by layer_types
    listed = dict(cfg, moe_layers=list(range(1, 48, 2)), interleave_moe_layer_step=7,
                  layer_types=["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"] * 12)
    _same(model_from_hf_dict(listed), "llama4-maverick")


def test_reader_without_chunks_is_global() -> None:
    m = model_from_hf_dict(dict(SCOUT_TEXT, attention_chunk_size=None))
    assert set(m.layer_windows()) == {None}


def test_reader_refusals_name_the_key() -> None:
    with pytest.raises(UserError, match=r"text_config\.attention_chunk_size = 0: must be a positive integer"):
        model_from_hf_dict({"model_type": "llama4", "text_config": dict(SCOUT_TEXT, attention_chunk_size=0)})
    with pytest.raises(UserError, match="key 'text_config' is missing"):
        model_from_hf_dict({"model_type": "llama4"})
    with pytest.raises(UserError, match="no_rope_layers"):
        model_from_hf_dict(dict(SCOUT_TEXT, no_rope_layers=[1, 0]))


# -- simulate smoke: training with expert parallelism, a decode step, serving --------------------

def test_scout_training_with_expert_parallelism() -> None:
    """Model FLOPs of a step at 20,000 tokens: 6 x the matmul parameters a token uses (one
    routed expert, the shared one, the router; the output layer over the padded vocabulary)
    per token, plus 3 x 4 s W heads d per layer: W = s in the 12 global layers, sum L^2 / s
    over chunks of 8192, 8192 and 3616 in the 36 chunked ones."""
    req = dict(model="llama4-scout", cluster="dgx-h100", tp=4, pp=2, ep=8, dp=8, zero=1, global_batch=8,
               seq_len=20000)
    out = api.simulate(req)
    assert out["step_time_s"] > 0 and out["fits_in_memory"]
    par = api.parallel_of(req)
    w = synthesize(resolve_model("llama4-scout"), par)
    s, V = 20000, par.padded_vocab(202048)
    matmul = 48 * (ATTN + 5120 * 16 + 2 * EXPERT) + V * 5120
    attention = 4 * 40 * 128 * (12 * s * s + 36 * (2 * 8192 ** 2 + 3616 ** 2))
    assert w.total_model_flops() == pytest.approx(8 * 3 * (2 * matmul * s + attention), rel=1e-12)


def test_scout_decode_step() -> None:
    """KV cache at context 20,000 on tp8: 12 global layers hold 20,000 tokens, 36 chunked ones
    3,616, each 2 x 1 KV head x 128 x 2 bytes per GPU per token."""
    out = api.simulate(dict(model="llama4-scout", cluster="dgx-h100", tp=8, phase="decode", batch=4,
                            context_len=20000))
    assert out["step_time_s"] > 0
    w = synthesize(resolve_model("llama4-scout"), ParallelConfig(tp=8),
                   inference=InferenceConfig("decode", batch=4, context_len=20000))
    assert w.memory(0).kv_cache == 4 * 512 * (12 * 20000 + 36 * 3616)


def test_chunk_reads_of_decoding_requests() -> None:
    """The engine's running sum against each request's own read, n mod c + 1 keys."""
    rnd = random.Random(5)
    c = 37
    reads = ChunkReads(c)
    live: list[tuple[int, int]] = []
    for g in range(400):
        if rnd.random() < 0.3:
            live.append((rnd.randint(0, 200), g))
            reads.join(*live[-1])
        if live and rnd.random() < 0.2:
            reads.leave(*live.pop(rnd.randrange(len(live))))
        assert reads.reads(g) == sum((c0 + g - g0) % c + 1 for c0, g0 in live)


def test_serving_a_request_across_chunk_boundaries() -> None:
    """One request on one H100: TTFT is its prefill, every later token a decode at the context
    it has then (read in its own 64-token chunk), as the simulator times each step on its own."""
    model = _chunked(64)
    cluster = resolve_cluster("dgx-h100", 1)
    dep = deploy(model, ParallelConfig(), InferenceConfig("decode"), cluster, ServingConfig(step_resolution=0.0))
    S, n = 100, 40
    report = simulate_serving(dep, Requests(np.array([0.0]), np.array([S]), np.array([n])), SLO())
    timer = StepTimer(model, ParallelConfig(), InferenceConfig("decode"), cluster, 0.0)
    ws = frozenset(model.layer_windows())
    prefill = timer.simulate(BatchShape.uniform(1, S, 0, ws))
    decodes = [timer.simulate(BatchShape.uniform(1, 1, S + k - 1, ws)) for k in range(1, n)]
    assert report["latency_s"]["ttft"]["mean"] == pytest.approx(prefill, rel=1e-12)
    assert report["latency_s"]["e2e"]["mean"] == pytest.approx(prefill + sum(decodes), rel=1e-12)


def test_ring_context_parallelism_refuses_chunks_shorter_than_the_sequence() -> None:
    with pytest.raises(UserError) as e:
        synthesize(_chunked(), ParallelConfig(seq_len=4096, cp=2))
    assert e.value.parameter == "cp-comm" and "chunked" in e.value.rule
    synthesize(_chunked(), ParallelConfig(seq_len=4096, cp=2, cp_comm="all-gather"))
