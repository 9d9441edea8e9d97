"""Hybrid state-space models: layer kinds as data (Mamba-1, Mamba-2, gated DeltaNet, MLP-only
and mixer-only layers), their Hugging Face readers, parameter counts against the published
figures, the Mamba-2 layer's FLOPs against a hand-worked closed form, the SSM state in
inference and serving, and their traces."""

from __future__ import annotations

import os

import pytest

from stage_cosim.adapters.simulate import simulate
from stage_cosim.errors import UserError
from stage_cosim.graph.dims import T, degree_symbol, model_values
from stage_cosim.graph.ssm import state_bytes_per_sequence
from stage_cosim.graph.transformer import symbolic_param_count
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference.config import InferenceConfig
from stage_cosim.model import get_preset
from stage_cosim.model.config import ModelConfig
from stage_cosim.model.hf import model_from_hf_dict
from stage_cosim.model.hf_hybrid import PUBLISHED
from stage_cosim.model.params import parameter_counts
from stage_cosim.parallel import ParallelConfig
from stage_cosim.sharding.numeric import compiled_blocks, compiled_inference_blocks
from stage_cosim.sharding.steps import ShardingPolicy
from stage_cosim.trace.validate import load_trace_set, validate_trace_set
from stage_cosim.trace.writer import atomic_directory, write_traces
from stage_cosim.workload import synthesize

HYBRID_PRESETS = sorted(PUBLISHED)


# -- published parameter counts, from the published config.json values ------------------------

def test_jamba_published_counts() -> None:
    """AI21: Jamba-v0.1 has 52B parameters, 12B active (51.6 B by Hugging Face's count)."""
    c = parameter_counts(model_from_hf_dict(PUBLISHED["jamba-v0.1"]))
    assert c.total == pytest.approx(51.6e9, rel=0.03)
    assert c.active == pytest.approx(12.0e9, rel=0.03)


def test_mamba2_published_counts() -> None:
    """Mistral's Mamba-Codestral-7B-v0.1: 7,285,403,648 parameters; state-spaces' mamba2-2.7b: 2.7 B."""
    assert parameter_counts(model_from_hf_dict(PUBLISHED["mamba-codestral-7b"])).total == 7_285_403_648
    assert parameter_counts(get_preset("mamba2-2.7b")).total == pytest.approx(2.7e9, rel=0.03)


def test_nemotron_h_published_counts() -> None:
    """NVIDIA's Nemotron-H-8B: 8 B parameters; its pattern has 24 Mamba-2, 4 attention and 24
    MLP layers (the paper's table 1)."""
    m = model_from_hf_dict(PUBLISHED["nemotron-h-8b"])
    assert parameter_counts(m).total == pytest.approx(8.0e9, rel=0.03)
    assert [m.layer_kinds().count(k) for k in (("mamba2", "none"), ("attention", "none"), ("none", "dense"))] \
        == [24, 4, 24]


def test_qwen3_next_published_counts() -> None:
    """Qwen3-Next-80B-A3B: 80 B parameters. Active: everything but the 502 routed experts of
    each layer a token does not reach (3 x 2048 x 512 parameters each), hand-worked."""
    c = parameter_counts(model_from_hf_dict(PUBLISHED["qwen3-next-80b-a3b"]))
    assert c.total == pytest.approx(80e9, rel=0.03)
    assert c.total - c.active == 48 * (512 - 10) * 3 * 2048 * 512
    assert model_from_hf_dict(PUBLISHED["qwen3-next-80b-a3b"]).attention_layers() == tuple(range(3, 48, 4))


def test_falcon_h1_published_counts() -> None:
    """TII's Falcon-H1-0.5B: 521 M parameters (its Hugging Face checkpoint's count); every layer
    attention and a Mamba-2 mixer side by side, then a SwiGLU MLP."""
    m = model_from_hf_dict(PUBLISHED["falcon-h1-0.5b"])
    assert parameter_counts(m).total == pytest.approx(521e6, rel=2e-3)
    assert set(m.layer_kinds()) == {("attention_mamba2", "dense")}
    assert m.attention_layers() == tuple(range(36))


def test_falcon_h1_layer_is_the_sum_of_its_parts() -> None:
    """A Falcon-H1 layer's forward FLOPs are those of an attention layer and a Mamba-2-only
    layer with the same dimensions (each with the same MLP), less one MLP (norms and
    elementwise work aside: matmul FLOPs only)."""
    m = get_preset("falcon-h1-0.5b").with_overrides(layers=1)
    attention = m.with_overrides(layer_mixers=("attention",))
    mamba = m.with_overrides(layer_mixers=("mamba2",), mamba_gated_norm=False)
    mlp_only = m.with_overrides(layer_mixers=("none",))

    def matmul_flops(model: ModelConfig) -> float:
        kind = model.layer_kind(0)
        block = compiled_blocks(model.switches(), ShardingPolicy()).block(kind, model.switches().hybrid_kinds)
        return sum(block.evaluate(model_values(model, 1, 1024)).fwd.model_flops)

    assert matmul_flops(m) == pytest.approx(matmul_flops(attention) + matmul_flops(mamba) - matmul_flops(mlp_only),
                                            rel=1e-12)


@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_graph_weights_match_closed_form(name: str) -> None:
    """The symbolic graph's weight tensors and the closed-form count are derived separately."""
    m = get_preset(name)
    assert symbolic_param_count(m) == m.param_count()


@pytest.mark.parametrize("name,biases", [
    ("nemotron-h-8b", dict(attention_bias=True, mlp_bias=True, ssm_proj_bias=True)),
    ("jamba-v0.1", dict(ssm_proj_bias=True, ssm_conv_bias=False)),
    ("qwen3-next-80b-a3b", dict(ssm_proj_bias=True, ssm_conv_bias=True)),
    ("falcon-h1-0.5b", dict(attention_bias=True, ssm_proj_bias=True, mamba_gated_norm=True)),
])
def test_graph_weights_match_closed_form_with_biases(name: str, biases: dict) -> None:
    """Each bias and norm switch adds the same weights to the graph as to the closed form."""
    m = get_preset(name).with_overrides(layers=10, **biases)          # attention layers included
    assert symbolic_param_count(m) == m.param_count()
    assert m.param_count() != get_preset(name).with_overrides(layers=10).param_count()


# -- FLOPs of a Mamba-2 layer -------------------------------------------------------------------

def _mamba2_model(**kw) -> ModelConfig:
    base = dict(layers=2, hidden=512, ffn=1024, heads=8, kv_heads=8, vocab=1000, max_seq=4096,
                layer_mixers=("mamba2", "mamba2"), layer_mlps=("none", "none"), mamba_num_heads=16,
                mamba_num_groups=2, mamba_head_dim=64, mamba_state_dim=32, mamba_d_conv=4, mamba_chunk_size=128)
    base.update(kw)
    return ModelConfig.build("m2", "llama", **base)


def test_mamba2_layer_flops_closed_form() -> None:
    """Model FLOPs of a Mamba-2 layer's forward, worked by hand: the input projection to z, x,
    B, C and dt, the depthwise convolution over x, B, C, the SSD scan with chunks of Q (C B^T
    per group, its masked product with x, chunk states, state passing, output from the
    states: Dao and Gu 2024, section 6), the output projection."""
    m = _mamba2_model()
    b, s, h = 2, 1024, 512
    heads, groups, p, n, q, conv = 16, 2, 64, 32, 128, 4
    inner = heads * p
    proj = 2 * b * s * h * (2 * inner + 2 * groups * n + heads)
    convolution = 2 * b * s * (inner + 2 * groups * n) * conv
    scan = b * (2 * s * q * n * groups + heads * (2 * s * q * p + 4 * s * n * p + 2 * (s // q) * n * p))
    out = 2 * b * s * inner * h
    block = compiled_blocks(m.switches(), ShardingPolicy()).block(("mamba2", "none"), m.switches().hybrid_kinds)
    values = model_values(m, b, s)
    costs = block.evaluate(values)
    assert sum(costs.fwd.model_flops) == pytest.approx(proj + convolution + scan + out, rel=1e-12)
    # the backward: twice the forward's GEMMs, and the scan's backward three times its forward
    assert sum(costs.bwd.model_flops) == pytest.approx(2 * (proj + convolution + out) + 3 * scan, rel=1e-12)


def test_scan_shards_over_tp_and_hands_the_state_over_cp() -> None:
    """tp splits the head groups (the scan's FLOPs halve); cp splits the sequence and
    all-gathers each rank's final state (b x heads x head_dim x d_state fp32)."""
    m = _mamba2_model()
    kind, hybrid = ("mamba2", "none"), m.switches().hybrid_kinds

    def scan_step(tp: int, cp: int):
        block = compiled_blocks(m.switches(), ShardingPolicy(sp=tp > 1)).block(kind, hybrid)
        values = model_values(m, 1, 2048)
        values.update({degree_symbol("tp"): tp, degree_symbol("cp"): cp})
        costs = block.evaluate(values)
        names = [st.name for st in block.sharded.fwd]
        return costs, names

    # (sequence parallelism adds steps: each run's own step names index its costs)
    one, names = scan_step(1, 1)
    two, names2 = scan_step(2, 1)
    assert two.fwd.flops[names2.index("scan")] == pytest.approx(one.fwd.flops[names.index("scan")] / 2)
    gathered, names = scan_step(1, 2)
    j = names.index("scan.state.ag_cp")
    assert gathered.fwd.comm_bytes[j] == 1 * 16 * 64 * 32 * 4
    assert one.fwd.comm_bytes[j] == 0                 # no hand-off without cp


def test_tp_must_divide_the_groups() -> None:
    m = get_preset("mamba2-2.7b")                     # n_groups 1
    with pytest.raises(UserError, match="must divide"):
        ParallelConfig(tp=2, global_batch=2, seq_len=1024).check_against(m)


# -- readers: what they refuse ------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["zamba2", "dbrx"])
def test_unmodelled_hybrids_are_refused_in_one_line(model_type: str) -> None:
    with pytest.raises(UserError) as exc:
        model_from_hf_dict({"model_type": model_type, "hidden_size": 1024}, "config.json")
    assert "\n" not in str(exc.value) and "not modelled" in str(exc.value)


def test_mamba2_heads_must_fill_the_inner_width() -> None:
    cfg = dict(PUBLISHED["mamba2-2.7b"], num_heads=64)
    with pytest.raises(UserError, match=r"num_heads = 64: times head_dim \(64\) must be expand x hidden_size \(5120\)"):
        model_from_hf_dict(cfg, "config.json")


def test_nemotron_h_refuses_unknown_layer_kinds() -> None:
    cfg = dict(PUBLISHED["nemotron-h-8b"], hybrid_override_pattern="E" * 52)
    with pytest.raises(UserError, match="hybrid_override_pattern.*'E' is not modelled"):
        model_from_hf_dict(cfg, "config.json")


# -- inference: the state beside the KV cache ------------------------------------------------------

def test_jamba_kv_cache_only_from_attention_layers_and_state_from_closed_form() -> None:
    """Jamba's KV cache per token: 4 attention layers x (K and V) x 8 KV heads x 128 x 2 bytes,
    over tp 2; its fixed state per sequence: 28 Mamba layers x (the scan state, 8192 x 16 in
    fp32, and the convolution window, 8192 x 4 in bf16), over tp 2."""
    m = get_preset("jamba-v0.1")
    inf = InferenceConfig(phase="decode", batch=8, context_len=2048)
    w = synthesize(m, ParallelConfig(tp=2, ep=1, global_batch=8, seq_len=2048), inference=inf)
    assert w.kv_cache_bytes_per_token(0) == pytest.approx(4 * 2 * 8 * 128 * 2 / 2)
    closed = 28 * (8192 * 16 * 4 + 8192 * 4 * 2)
    assert state_bytes_per_sequence(m) == closed
    assert w.state_bytes_per_sequence(0) == pytest.approx(closed / 2)


def test_falcon_h1_holds_both_a_kv_cache_and_a_state() -> None:
    """Every Falcon-H1 layer attends and scans: per token 36 layers x (K and V) x 2 KV heads x
    64 x 2 bytes; per sequence 36 x (the scan state, 24 heads x 64 x 128 in fp32, and the
    convolution window over x, B and C, (1536 + 2 x 128) x 4 in bf16)."""
    m = get_preset("falcon-h1-0.5b")
    w = synthesize(m, ParallelConfig(tp=1, global_batch=4, seq_len=1024),
                   inference=InferenceConfig(phase="decode", batch=4, context_len=1024))
    assert w.kv_cache_bytes_per_token(0) == pytest.approx(36 * 2 * 2 * 64 * 2)
    closed = 36 * (24 * 64 * 128 * 4 + (1536 + 2 * 128) * 4 * 2)
    assert state_bytes_per_sequence(m) == closed
    assert w.state_bytes_per_sequence(0) == pytest.approx(closed)


def test_decode_scan_reads_and_writes_the_state_once() -> None:
    """A decode step's scan (one new position per sequence) is the single-step state update:
    it reads each sequence's state (16 heads x 64 x 32 in fp32) and writes it back; its other
    operands (x, dt, B, C, A, D, y) are small beside it (under 5 %)."""
    m = _mamba2_model()
    block = compiled_inference_blocks(m.switches(), ShardingPolicy()).block(("mamba2", "none"),
                                                                           m.switches().hybrid_kinds)
    values = model_values(m, 8, 1)
    values[T] = 1024
    costs = block.evaluate(values)
    mem = costs.fwd.mem_bytes[[st.name for st in block.sharded.fwd].index("scan")]
    state = 8 * 16 * 64 * 32 * 4
    assert 2 * state <= mem <= 2.05 * state
    assert costs.state_bytes == pytest.approx(costs.cache_bytes)      # no KV cache in a Mamba layer


def test_mamba_has_no_kv_cache() -> None:
    m = get_preset("mamba-codestral-7b")
    w = synthesize(m, ParallelConfig(tp=1, global_batch=4, seq_len=1024),
                   inference=InferenceConfig(phase="decode", batch=4, context_len=1024))
    assert w.kv_cache_bytes_per_token(0) == 0
    assert w.state_bytes_per_sequence(0) == pytest.approx(state_bytes_per_sequence(m))


# -- every preset simulates, and its traces validate -----------------------------------------------

def _small(name: str) -> ModelConfig:
    """The preset cut to a few layers (its pattern repeated), so the tests stay quick."""
    m = get_preset(name)
    return m.with_overrides(layers=8) if name != "nemotron-h-8b" else m.with_overrides(layers=10)


@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_every_preset_simulates(name: str) -> None:
    m = get_preset(name)
    # (one Mamba-2 group in these two: tp must divide it)
    par = ParallelConfig(tp=1 if name in ("mamba2-2.7b", "falcon-h1-0.5b") else 2, pp=2, global_batch=8,
                         seq_len=2048)
    cluster = resolve_cluster(f"dgx-h100:{par.tp * par.pp}")
    r = simulate(synthesize(m, par), cluster).result
    assert r.step_time_s > 0


def _validates(w, tmp_path) -> None:
    out = tmp_path / "traces"
    with atomic_directory(out, force=True) as d:
        write_traces(w, d, "chakra")
    ranks, groups = load_trace_set(out)
    assert len(ranks) == w.world_size
    assert validate_trace_set(ranks, groups) == []


TRACE_CASES = [
    ("jamba-v0.1", dict(dp=1, tp=2, pp=2, ep=2, expert_tp=1, sp=True, global_batch=4, seq_len=512)),
    ("nemotron-h-8b", dict(dp=1, tp=2, pp=2, cp=2, sp=True, global_batch=4, seq_len=512)),
    ("qwen3-next-80b-a3b", dict(dp=2, tp=2, pp=1, ep=4, expert_tp=1, sp=True, recompute="full", global_batch=4, seq_len=512)),
    ("mamba2-2.7b", dict(dp=2, pp=2, cp=2, global_batch=4, seq_len=512)),
    ("falcon-h1-0.5b", dict(dp=2, pp=2, cp=2, global_batch=4, seq_len=512)),
]


@pytest.mark.parametrize("name,cfg", TRACE_CASES)
def test_training_traces_validate(name: str, cfg: dict, tmp_path) -> None:
    _validates(synthesize(_small(name), ParallelConfig(**cfg)), tmp_path)


@pytest.mark.parametrize("name", ["jamba-v0.1", "nemotron-h-8b", "qwen3-next-80b-a3b", "falcon-h1-0.5b"])
def test_decode_traces_validate(name: str, tmp_path) -> None:
    tp = 1 if name == "falcon-h1-0.5b" else 2
    w = synthesize(_small(name), ParallelConfig(tp=tp, pp=2, global_batch=4, seq_len=1024),
                   inference=InferenceConfig(phase="decode", batch=4, context_len=1024))
    _validates(w, tmp_path)


@pytest.mark.skipif(not os.environ.get("ASTRA_SIM_BIN"), reason="set ASTRA_SIM_BIN to run the real simulator")
@pytest.mark.parametrize("name,cfg", TRACE_CASES)
def test_hybrid_traces_run_on_real_astra_sim(name: str, cfg: dict, tmp_path) -> None:
    from stage_cosim.adapters.astra_sim.analytical import simulate_run_dir
    from stage_cosim.adapters.astra_sim.export import export
    from stage_cosim.adapters.astra_sim.run import run

    w = synthesize(_small(name), ParallelConfig(**cfg))
    export(w, resolve_cluster("dgx-h100", w.world_size), tmp_path / "run")
    real = run(os.environ["ASTRA_SIM_BIN"], tmp_path / "run", w.world_size)
    ours = simulate_run_dir(tmp_path / "run")
    assert real.output.step_time_ns == max(ours.finished_ns.values())      # to the nanosecond
