"""Prefill and decode steps as Chakra traces: they validate, read back, and (with
``ASTRA_SIM_BIN``) run to the end on every rank of the real ASTRA-sim, which prints what our
``astra`` model predicts."""

from __future__ import annotations

import os

import pytest

from stage_cosim.adapters.astra_sim.export import export
from stage_cosim.adapters.astra_sim.run import run
from stage_cosim.adapters.astra_sim.analytical import simulate_run_dir
from stage_cosim.adapters.simulate import simulate, simulate_traces
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.model import ModelConfig, get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.trace.validate import load_trace_set, validate_trace_set
from stage_cosim.trace.writer import write_traces
from stage_cosim.workload import synthesize
from test_moe import TINY_MLA

CASES = {
    "decode tp2 pp2 dp2": (dict(dp=2, tp=2, pp=2), InferenceConfig("decode", batch=8, context_len=2048)),
    "prefill tp2 pp2 dp2": (dict(dp=2, tp=2, pp=2), InferenceConfig("prefill", batch=8, input_len=1024)),
    "decode tp8": (dict(tp=8), InferenceConfig("decode", batch=32, context_len=8192, kv_cache_dtype="fp8")),
    "prefill pp4 dp2": (dict(dp=2, pp=4), InferenceConfig("prefill", batch=8, input_len=512)),
    # weights in FP8 (W8A8) and int4 (W4A16)
    "decode fp8 weights tp2 pp2 dp2": (dict(dp=2, tp=2, pp=2),
                                       InferenceConfig("decode", batch=8, context_len=2048, weight_dtype="fp8")),
    "prefill fp8 weights tp4 dp2": (dict(dp=2, tp=4), InferenceConfig("prefill", batch=4, input_len=1024,
                                                                      weight_dtype="fp8")),
    "decode int4 weights tp4 pp2": (dict(tp=4, pp=2), InferenceConfig("decode", batch=16, context_len=4096,
                                                                      weight_dtype="int4")),
    # context parallelism for long prompts: the ring, the all-gather, the all-to-alls within a ring
    "prefill cp4 tp2 p2p": (dict(tp=2, cp=4), InferenceConfig("prefill", batch=2, input_len=16384)),
    "prefill cp2 dp2 pp2 all-gather fp8 weights": (dict(cp=2, dp=2, pp=2, cp_comm="all-gather"),
                                                   InferenceConfig("prefill", batch=4, input_len=8192,
                                                                   weight_dtype="fp8")),
    "prefill cp4 tp2 a2a+p2p": (dict(tp=2, cp=4, cp_comm="a2a+p2p", cp_a2a_size=2),
                                InferenceConfig("prefill", batch=1, input_len=16384)),
    # experts: independent replicas (experts inside tp), attention data parallelism (over dp)
    "decode mixtral tp8 ep8": (dict(tp=8, ep=8, expert_tp=1), InferenceConfig("decode", batch=16, context_len=2048),
                               "mixtral-8x7b"),
    "decode mixtral attention-dp dp8 ep8": (dict(dp=8, ep=8),
                                            InferenceConfig("decode", batch=64, context_len=2048, attention_dp=True),
                                            "mixtral-8x7b"),
    # latent attention: absorbed decode, expanded prefill, the latent cache
    "decode deepseek attention-dp dp4 tp2 ep8 fp8": (dict(dp=4, tp=2, ep=8, expert_tp=1),
                                                     InferenceConfig("decode", batch=32, context_len=4096,
                                                                     attention_dp=True, weight_dtype="fp8"),
                                                     "deepseek-v3"),
    "prefill deepseek tp8 int4": (dict(tp=8), InferenceConfig("prefill", batch=2, input_len=2048, weight_dtype="int4"),
                                  "deepseek-v3"),
    # two-batch overlap: two micro-batches per pass, their collectives in turn (the all-to-alls
    # of attention data parallelism, tensor-parallel all-reduces, the pipeline between stages)
    "decode mixtral attention-dp dp8 ep8 two-batch overlap": (
        dict(dp=8, ep=8), InferenceConfig("decode", batch=64, context_len=2048, attention_dp=True,
                                          two_batch_overlap=True), "mixtral-8x7b"),
    "prefill mixtral attention-dp dp8 ep8 two-batch overlap": (
        dict(dp=8, ep=8), InferenceConfig("prefill", batch=24, input_len=1024, attention_dp=True,
                                          two_batch_overlap=True), "mixtral-8x7b"),
    # (latent attention absorbed, a dense first layer, one expert per rank)
    "decode tiny-mla attention-dp dp4 tp2 ep8 fp8 two-batch overlap": (
        dict(dp=4, tp=2, ep=8, expert_tp=1), InferenceConfig("decode", batch=40, context_len=4096, attention_dp=True,
                                                             weight_dtype="fp8", two_batch_overlap=True), TINY_MLA),
    "decode tp2 pp2 dp2 two-batch overlap": (dict(dp=2, tp=2, pp=2),
                                             InferenceConfig("decode", batch=12, context_len=2048,
                                                             two_batch_overlap=True)),
    # state-space and hybrid models: the scan state per sequence instead of (or beside) a KV cache
    "decode mamba2 tp2 dp4": (dict(dp=4, tp=2), InferenceConfig("decode", batch=16, context_len=4096), "mamba-codestral-7b"),
    "prefill jamba dp4 tp2 ep2": (dict(dp=4, tp=2, ep=2, expert_tp=1), InferenceConfig("prefill", batch=4, input_len=1024),
                              "jamba-v0.1"),
    "decode qwen3-next dp4 tp2 ep2": (dict(dp=4, tp=2, ep=2, expert_tp=1), InferenceConfig("decode", batch=8, context_len=2048),
                                  "qwen3-next-80b-a3b"),
}


def _workload(kw, inf, preset: "str | ModelConfig" = "llama3-8b"):
    model = preset if isinstance(preset, ModelConfig) else \
        get_preset(preset).with_overrides(layers=4 if preset == "deepseek-v3" else 8)
    return synthesize(model, ParallelConfig(**kw), inference=inf), resolve_cluster("dgx-h100:8")


# seconds each (latent attention over many ranks written, read back, exported): the slow tier's
SLOW_CASES = {"prefill deepseek tp8 int4", "decode deepseek attention-dp dp4 tp2 ep8 fp8",
              "decode tiny-mla attention-dp dp4 tp2 ep8 fp8 two-batch overlap"}
assert SLOW_CASES <= set(CASES)
PARAMS = [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]


@pytest.mark.parametrize("case", PARAMS)
def test_traces_validate_and_read_back(case, tmp_path) -> None:
    import json

    from stage_cosim.manifest import build_manifest
    from stage_cosim.trace.writer import GROUPS_FILE, MANIFEST_FILE, TRACE_PREFIX

    w, cluster = _workload(*CASES[case])
    stats = write_traces(w, tmp_path, "chakra")
    # the manifest, as synth writes it, says the traces are an inference step's (priced by the
    # serving kernel model)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(build_manifest(
        w, fmt="chakra", prefix=TRACE_PREFIX, groups_file=GROUPS_FILE, files=stats.files,
        bytes_written=stats.bytes_written, cluster=cluster)))
    ranks, groups = load_trace_set(tmp_path)
    assert validate_trace_set(ranks, groups) == []
    direct = simulate(w, cluster).result.step_time_s
    from_traces = simulate_traces(tmp_path, cluster).result.step_time_s
    assert from_traces == pytest.approx(direct, rel=1e-9)      # the same graphs, read back


@pytest.mark.parametrize("case", PARAMS)
def test_export_replays_as_the_astra_model_predicts(case, tmp_path) -> None:
    w, cluster = _workload(*CASES[case])
    export(w, cluster, tmp_path / "run")
    from_files = simulate_run_dir(tmp_path / "run")
    assert len(from_files.finished_ns) == w.world_size
    predicted = simulate(w, cluster, "astra").result.step_time_s
    assert max(from_files.finished_ns.values()) * 1e-9 == pytest.approx(predicted, abs=1e-9)


@pytest.mark.skipif(not os.environ.get("ASTRA_SIM_BIN"), reason="set ASTRA_SIM_BIN to run the real simulator")
@pytest.mark.parametrize("case", CASES)
def test_real_astra_sim_finishes_every_rank(case, tmp_path) -> None:
    w, cluster = _workload(*CASES[case])
    export(w, cluster, tmp_path / "run")
    real = run(os.environ["ASTRA_SIM_BIN"], tmp_path / "run", w.world_size).output
    assert sorted(real.finished_ns) == list(range(w.world_size))
    ours = simulate_run_dir(tmp_path / "run")
    assert real.finished_ns == ours.finished_ns
    assert real.step_time_ns * 1e-9 == pytest.approx(simulate(w, cluster, "astra").result.step_time_s, abs=1e-9)


def test_the_astra_model_prices_an_inference_step_as_simulate_does() -> None:
    """One GPU decoding: no collective, so both network models' step is the sum of the same
    kernels, priced by the inference kernel model (the measured GEMMs) in both; the ASTRA-sim
    export writes whole microseconds with the rounding error carried, a few µs at most apart."""
    w = synthesize(get_preset("llama3-8b").with_overrides(layers=8), ParallelConfig(),
                   inference=InferenceConfig("decode", batch=16, context_len=1000))
    cluster = resolve_cluster("dgx-h100:1")
    native = simulate(w, cluster).result.step_time_s
    astra = simulate(w, cluster, "astra").result.step_time_s
    assert astra == pytest.approx(native, abs=5e-6)
