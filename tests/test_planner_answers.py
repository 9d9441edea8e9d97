"""Answers a planner can act on: launch arguments (--emit), run files (--config), compare,
parameter counts as published, and ties in the search broken toward memory headroom."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from stage_cosim.errors import UserError
from stage_cosim.launch import emit
from stage_cosim.model import ModelConfig, resolve_model
from stage_cosim.parallel import ParallelConfig

HF = Path(__file__).parent / "data" / "hf"
TINY = ["--model", "llama3-8b", "--layers", "2", "--seq-len", "256"]


# -- parameter counts, as published ------------------------------------------------------------

# (total, its tolerance), and the active count in the publisher's own convention: Mistral and
# Qwen count the input embedding table in "active", DeepSeek and OpenAI leave it out.
# Mixtral 8x7B 46.7B / 12.9B (its safetensors hold 46,702,792,704), Qwen3-30B-A3B 30.5B / 3.3B,
# DeepSeek-V3 671B / 37B (the 685B it released hold the 14B MTP module), gpt-oss-120b
# 116.83B / 5.13B.
PUBLISHED_ACTIVE = {
    "Mixtral-8x7B-v0.1": ((46_702_792_704, 0), "active", (12.9e9, 0.05e9)),
    "Qwen3-30B-A3B": ((30.5e9, 0.05e9), "active", (3.3e9, 0.06e9)),
    "DeepSeek-V3": ((671e9, 0.5e9), "active_without_embedding", (37e9, 0.5e9)),
    "gpt-oss-120b": ((116.83e9, 0.005e9), "active_without_embedding", (5.13e9, 0.005e9)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_models_reads_a_config_json_and_counts_as_published(run_cli, name: str) -> None:
    (total, tol), field, (active, atol) = PUBLISHED_ACTIVE[name]
    code, out, err = run_cli("models", "--model", str(HF / name / "config.json"), "--json")
    assert code == 0, err
    p = json.loads(out)["parameters"]
    assert p["total"] == pytest.approx(total, abs=tol)
    assert p[field] == pytest.approx(active, abs=atol)
    assert p["active_counts_embedding"] is True and p["active_counts_mtp"] is False
    assert p["active"] - p["active_without_embedding"] == p["embedding"]


def test_simulate_json_carries_deepseek_v3_counts_without_its_mtp_module(run_cli) -> None:
    """671B total and 37B active (without the input table, DeepSeek's convention), the MTP
    module in neither: 671B + MTP + its own copies of the embedding and output tables (129,280
    x 7,168 each) make the 685B released."""
    code, out, err = run_cli("simulate", "--model", str(HF / "DeepSeek-V3" / "config.json"), "--seq-len", "256",
                             "--json")
    assert code == 0, err
    p = json.loads(out)["parameters"]
    assert p["total"] == pytest.approx(671e9, abs=0.5e9)
    assert p["active_without_embedding"] == pytest.approx(37e9, abs=0.5e9)
    assert p["embedding"] == 129280 * 7168
    assert p["total"] + p["mtp"] + 2 * 129280 * 7168 == pytest.approx(685e9, abs=1e9)
    assert "multi-token-prediction" in p["convention"]


def test_simulate_json_parameters_of_a_hand_counted_model(run_cli) -> None:
    """A llama of 2 layers, hidden 64 (4 heads of 16, 2 KV heads), ffn 128, vocabulary 1,000:
    per layer QKV 64*(4+2*2)*16 = 8,192, output 64*64 = 4,096, SwiGLU 64*256 + 128*64 = 24,576,
    two RMSNorms 128: 36,992; two layers 73,984, embedding and untied output 2*64,000, final
    norm 64: 202,048, all active (no experts); less the input table, 138,048."""
    code, out, err = run_cli("simulate", "--arch", "llama", "--layers", "2", "--hidden", "64", "--ffn", "128",
                             "--heads", "4", "--kv-heads", "2", "--vocab", "1000", "--seq-len", "128", "--json")
    assert code == 0, err
    p = json.loads(out)["parameters"]
    assert (p["total"], p["active"], p["active_without_embedding"], p["mtp"]) == (202_048, 202_048, 138_048, 0)
    code, out, _ = run_cli("simulate", "--arch", "llama", "--layers", "2", "--hidden", "64", "--ffn", "128",
                           "--heads", "4", "--kv-heads", "2", "--vocab", "1000", "--seq-len", "128")
    assert "202,048" not in out and "0.00 B parameters" in out      # the report's line, in billions


def test_models_describes_one_model_with_what_active_counts(run_cli) -> None:
    code, out, err = run_cli("models", "--model", str(HF / "Mixtral-8x7B-v0.1" / "config.json"))
    assert code == 0, err
    assert "46,702,792,704 total" in out and "input embedding table" in out
    code, _, err = run_cli("models", "--model", str(HF / "nope" / "config.json"))
    assert code == 2 and err.startswith("error: model:") and len(err.strip().splitlines()) == 1


# -- ties in the search -------------------------------------------------------------------------

def _evaluation(point: dict, step: float, peak_gib: float):
    from stage_cosim.search.evaluate import Evaluation

    result = {"step_time_s": step, "peak_memory_bytes": int(peak_gib * 2**30), "memory_capacity_bytes": 80 * 2**30}
    return Evaluation(point, {}, True, None, step, result)


def test_tied_step_times_rank_the_one_with_more_headroom_first() -> None:
    """Equal step times (to rounding): the configuration at 40 GiB of 80 ranks before the one
    at 70 GiB, though its point sorts after it; a real difference in time still decides."""
    from stage_cosim.search.evaluate import Objective
    from stage_cosim.search.optimize import OptimizeResult, rank

    full = _evaluation({"tp": 2, "zero": 0}, 1.0, 70.0)
    roomy = _evaluation({"tp": 2, "zero": 1}, 1.0 * (1 + 1e-15), 40.0)
    faster = _evaluation({"tp": 4, "zero": 0}, 0.99, 79.0)
    assert [e.point for e in rank([full, roomy])] == [roomy.point, full.point]
    assert [e.point for e in rank([full, roomy, faster])] == [faster.point, roomy.point, full.point]
    doc = OptimizeResult(Objective(), [full, roomy], True, {}, 2, "exhaustive").to_dict()
    assert doc["best"]["point"] == roomy.point
    # 1 % slower is no tie, whatever the memory
    slower = _evaluation({"tp": 8, "zero": 3}, 1.01, 10.0)
    assert rank([full, slower])[0].point == full.point


# -- run files ----------------------------------------------------------------------------------

def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_run_file_values_are_used_and_flags_override_them(run_cli, tmp_path) -> None:
    run = _write(tmp_path, "run.yaml", "model: llama3-8b\nlayers: 2\nseq-len: 256\ntp: 2\nmicro_batch: 2\n"
                                       "json: true\nno-cp-load-balance: false\n")
    code, out, err = run_cli("simulate", "--config", run)
    assert code == 0, err
    par = json.loads(out)["config"]["parallel"]
    assert (par["tp"], par["micro_batch"], par["seq_len"], par["cp_load_balance"]) == (2, 2, 256, True)
    code, out, err = run_cli("simulate", "--tp", "1", "--config", run)
    assert code == 0, err
    assert json.loads(out)["config"]["parallel"]["tp"] == 1


@pytest.mark.parametrize("text, says", [
    ("tp: 2\nbogus: 1\n", "'bogus' is not a flag of 'stage-cosim simulate'"),
    ("tp: [1\n", "not valid YAML"),
    ("- tp\n", "must be a mapping"),
    ("tp: 2\ntp_size: 1\n", "'tp_size' is not a flag"),
    ("micro-batch: 2\nmicro_batch: 2\n", "sets what"),
])
def test_run_file_mistakes_are_one_line(run_cli, tmp_path, text: str, says: str) -> None:
    out_dir = tmp_path / "t"
    code, out, err = run_cli("synth", "--config", _write(tmp_path, "run.yaml", text), *TINY, "--out", str(out_dir))
    assert code == 2 and out == "" and not out_dir.exists()
    assert err.startswith("error: config: ") and says.replace("simulate", "synth") in err
    assert len(err.strip().splitlines()) == 1


def test_run_file_reaches_lazily_loaded_and_nested_commands(run_cli, tmp_path) -> None:
    code, out, err = run_cli("models", "--config", _write(tmp_path, "m.yaml", "json: true\n"))
    assert code == 0 and "llama3-8b" in json.loads(out), err
    out_dir = tmp_path / "run"
    run = _write(tmp_path, "x.yaml", f"model: llama3-8b\nlayers: 2\nseq-len: 128\ndp: 2\nout: {out_dir}\n")
    code, _, err = run_cli("astra-sim", "export", "--config", run)
    assert code == 0, err
    assert (out_dir / "run.sh").exists()
    code, _, err = run_cli("astra-sim", "export", "--config", _write(tmp_path, "y.yaml", "json: true\n"))
    assert code == 2 and "is not a flag of 'stage-cosim astra-sim export'" in err


# -- compare ------------------------------------------------------------------------------------

def test_compare_columns_are_the_runs_simulated_alone(run_cli, tmp_path) -> None:
    shared = ["--model", "llama3-8b", "--layers", "4", "--seq-len", "512", "--global-batch", "8",
              "--cluster", "dgx-h100:4"]
    runs = {"tp=4 dp=1 sp": ["--tp", "4", "--dp", "1", "--sp"],
            "tp=2 dp=2 zero=1": ["--tp", "2", "--dp", "2", "--zero", "1"]}
    third = _write(tmp_path, "pp.yaml", "tp: 1\npp: 2\ndp: 2\nrecompute: full\n")
    runs[third] = ["--tp", "1", "--pp", "2", "--dp", "2", "--recompute", "full"]
    # the run list from a run file (a multi-value option), the shared flags on the command line
    lists = _write(tmp_path, "cmp.yaml", "run:\n" + "".join(f"  - {json.dumps(r)}\n" for r in runs))
    code, out, err = run_cli("compare", *shared, "--config", lists, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [r["run"] for r in doc["runs"]] == list(runs)
    alone = []
    for flags in runs.values():
        code, out, err = run_cli("simulate", *shared, *flags, "--json")
        assert code == 0, err
        alone.append(json.loads(out))
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes"):
        assert doc["figures"][key] == [a[key] for a in alone]
        assert doc["difference"]["figures"][key] == [a[key] - alone[0][key] for a in alone]
    for category, values in doc["breakdown"].items():
        assert values == [a["breakdown"][category] for a in alone]
    peak = [max(a["roles"], key=lambda r: (r["peak_memory_bytes"], -r["stage"]))["memory"] for a in alone]
    for category in ("weights", "gradients", "optimizer", "activations", "runtime"):
        assert doc["memory"][category] == [m[category] for m in peak]
    code, out, err = run_cli("compare", *shared, "--config", lists)
    assert code == 0 and "#3-#1" in out and "step time s" in out, err


@pytest.mark.parametrize("runs, says", [
    (["tp=2"], "two or more"),
    (["tp=2", "bogus=1"], "run 2: 'bogus' is not a flag"),
    (["tp=2", "recompute=most"], "run 2: recompute:"),
    (["tp=2", "tp=3"], "run 2: must divide heads"),
])
def test_compare_mistakes_are_one_line(run_cli, runs, says: str) -> None:
    args = [a for r in runs for a in ("--run", r)]
    code, out, err = run_cli("compare", *TINY, *args)
    assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1


# -- launch arguments ---------------------------------------------------------------------------

def _llama70b_run(**kw) -> tuple[ModelConfig, ParallelConfig]:
    return resolve_model("llama3-70b"), ParallelConfig(dp=32, tp=8, pp=4, vp=2, sp=True, zero=1,
                                                       recompute="selective", global_batch=1024, seq_len=4096, **kw)


def test_megatron_flags_of_a_hand_worked_configuration() -> None:
    """Llama 3 70B (80 layers, hidden 8192, ffn 28672, 64 heads in 8 KV groups, RMSNorm, SwiGLU,
    RoPE, no biases, untied, no dropout) on tp8 pp4 with two virtual stages each (80 / (4*2) = 10
    layers per virtual stage), sp, the distributed optimizer with overlapped gathers and, left unset,
    the default software profile's (megatron-core-0.8) tensor-parallel communication overlap,
    on with tp 8 > 1 and sp: Megatron-LM's own default is off, so the launch must set it."""
    model, par = _llama70b_run()
    assert "tp_comm_overlap" in par.assumed
    expected = """--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --max-position-embeddings 8192 --position-embedding-type rope
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0 --attention-dropout 0
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 10
    --context-parallel-size 1 --sequence-parallel --micro-batch-size 1 --global-batch-size 1024 --seq-length 4096
    --recompute-granularity selective --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --tp-comm-overlap --bf16""".split()
    assert list(emit("megatron", model, par).arguments) == expected
    # set off, the flag is not written
    assert "--tp-comm-overlap" not in emit("megatron", *_llama70b_run(tp_comm_overlap=False)).arguments


def _megatron_parser() -> argparse.ArgumentParser:
    """The flags pretrain_gpt.py takes for what --emit writes (Megatron-LM's names)."""
    p = argparse.ArgumentParser()
    for name in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups",
                 "kv-channels", "max-position-embeddings", "tensor-model-parallel-size",
                 "pipeline-model-parallel-size", "num-layers-per-virtual-pipeline-stage", "context-parallel-size",
                 "expert-model-parallel-size", "expert-tensor-parallel-size", "micro-batch-size",
                 "global-batch-size", "seq-length", "recompute-num-layers", "decoder-first-pipeline-num-layers",
                 "decoder-last-pipeline-num-layers", "fp8-amax-history-len", "num-experts", "moe-router-topk",
                 "moe-ffn-hidden-size", "moe-shared-expert-intermediate-size", "q-lora-rank", "kv-lora-rank",
                 "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim", "mtp-num-layers", "moe-router-num-groups",
                 "moe-router-group-topk"):
        p.add_argument(f"--{name}", type=int)
    for name in ("position-embedding-type", "normalization", "recompute-granularity", "recompute-method",
                 "cp-comm-type", "moe-token-dispatcher-type", "fp8-format", "fp8-recipe",
                 "data-parallel-sharding-strategy", "ckpt-format", "pipeline-model-parallel-layout",
                 "moe-layer-freq", "attention-backend"):
        p.add_argument(f"--{name}")
    for name in ("hidden-dropout", "attention-dropout", "rotary-percent", "moe-expert-capacity-factor"):
        p.add_argument(f"--{name}", type=float)
    p.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+")
    for name in ("group-query-attention", "swiglu", "squared-relu", "untie-embeddings-and-output-weights",
                 "disable-bias-linear", "add-qkv-bias", "qk-layernorm", "sequence-parallel",
                 "use-distributed-optimizer", "use-megatron-fsdp", "overlap-grad-reduce", "overlap-param-gather",
                 "bf16", "fp8-param-gather", "multi-latent-attention", "moe-pad-expert-input-to-capacity",
                 "cross-entropy-loss-fusion", "use-tp-pp-dp-mapping", "grad-reduce-in-bf16", "tp-comm-overlap",
                 "moe-shared-expert-overlap", "moe-shared-expert-gate", "moe-enable-deepep"):
        p.add_argument(f"--{name}", action="store_true")
    return p


def _layout_stages(layout: str) -> list[int]:
    """Decoder layers per virtual stage of a --pipeline-model-parallel-layout ("Et*2|t*3|t*2L")."""
    expanded = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout.replace(",", ""))
    return [stage.count("t") for stage in expanded.split("|")]


def _from_megatron(tokens: list[str], world: int) -> tuple[dict, tuple[int, ...]]:
    """The parallel configuration Megatron-LM would run from these arguments on ``world`` GPUs,
    and its layers per virtual stage, as Megatron reads them."""
    a = _megatron_parser().parse_args(tokens)
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    layers = a.num_layers
    if a.pipeline_model_parallel_layout:
        stages = _layout_stages(a.pipeline_model_parallel_layout)
    elif a.decoder_first_pipeline_num_layers is not None or a.decoder_last_pipeline_num_layers is not None:
        first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
        rest = layers - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        each = rest // middle if middle else 0
        stages = [first if first is not None else each] + [each] * (pp - 2) + [last if last is not None else each]
    elif a.num_layers_per_virtual_pipeline_stage:
        stages = [a.num_layers_per_virtual_pipeline_stage] * (layers // a.num_layers_per_virtual_pipeline_stage)
    else:
        stages = [layers // pp] * pp
    vp = len(stages) // pp
    cp_comm = {"all_gather": "all-gather"}.get(a.cp_comm_type, a.cp_comm_type or "p2p")
    zero = 0
    if a.use_distributed_optimizer:
        zero = {"optim_grads": 2, "optim_grads_params": 3}.get(a.data_parallel_sharding_strategy, 1) \
            if a.use_megatron_fsdp else 1
    config = dict(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp, vp=vp, sp=a.sequence_parallel,
                  micro_batch=a.micro_batch_size, global_batch=a.global_batch_size, seq_len=a.seq_length,
                  zero=zero, recompute={None: "none"}.get(a.recompute_granularity, a.recompute_granularity),
                  dtype="fp8" if a.fp8_format else "bf16", fp8_format=a.fp8_format or "hybrid",
                  fp8_param_gather=a.fp8_param_gather, ep=a.expert_model_parallel_size or 1,
                  expert_tp=a.expert_tensor_parallel_size or tp,
                  moe_token_dispatcher=a.moe_token_dispatcher_type or "alltoall",
                  moe_capacity_factor=a.moe_expert_capacity_factor,
                  moe_pad_to_capacity=a.moe_pad_expert_input_to_capacity)
    if cp > 1:
        config["cp_comm"] = cp_comm
        if cp_comm == "a2a+p2p":
            config["cp_a2a_size"] = a.hierarchical_context_parallel_sizes[0]
    if a.recompute_granularity == "full":
        assert (a.recompute_method, a.recompute_num_layers) == ("uniform", 1)
    return config, tuple(stages)


ROUND_TRIPS = [
    ("llama3-70b", dict(dp=32, tp=8, pp=4, vp=2, sp=True, zero=1, recompute="selective", global_batch=1024,
                        seq_len=4096)),
    # 10 layers over 4 stages: the ends lighter (2, 3, 3, 2), as first/last stage counts
    ("llama3-8b", dict(layers=10, dp=2, tp=2, pp=4, global_batch=8, seq_len=2048, recompute="full", zero=2)),
    # 10 layers over 2 x 2 virtual stages (3, 2, 2, 3 after the ends give up one each): a layout
    ("llama3-8b", dict(layers=10, dp=2, pp=2, vp=2, global_batch=8, micro_batch=2, seq_len=1024, zero=3)),
    ("llama3-8b", dict(dp=2, tp=2, cp=4, cp_comm="a2a+p2p", cp_a2a_size=2, sp=True, seq_len=16384,
                       global_batch=4)),
    ("llama3-8b", dict(dp=4, cp=2, cp_comm="all-gather", dtype="fp8", fp8_recipe="delayed", fp8_format="e4m3",
                       fp8_param_gather=True, zero=1, seq_len=8192, global_batch=8)),
    ("mixtral-8x7b", dict(dp=8, tp=2, pp=2, ep=8, expert_tp=1, sp=True, zero=1, global_batch=64, seq_len=4096,
                          moe_capacity_factor=1.25, moe_pad_to_capacity=True, moe_token_dispatcher="allgather")),
]


@pytest.mark.parametrize("name, settings", ROUND_TRIPS)
def test_megatron_flags_parse_back_to_the_configuration(name: str, settings: dict) -> None:
    settings = dict(settings)
    model = resolve_model(name).with_overrides(layers=settings.pop("layers", None))
    par = ParallelConfig(**settings)
    tokens = list(emit("megatron", model, par).arguments)
    config, stages = _from_megatron(tokens, par.world_size)
    expected = {k: getattr(par, k) for k in config}
    assert config == expected
    assert stages == par.layers_per_stage(model.layers)
    a = _megatron_parser().parse_args(tokens)
    assert (a.num_layers, a.hidden_size, a.num_attention_heads) == (model.layers, model.hidden, model.heads)


def test_megatron_flags_of_deepseek_v3_model() -> None:
    """DeepSeek-V3's layers: three dense then 58 MoE ("([0]*3+[1]*58)"), 256 experts top-8 of
    ffn 2048, one shared expert of 2048, multi-latent attention (q 1536, kv 512, heads 128+64,
    values 128), one MTP layer, which the pipeline layout puts on the last stage."""
    model = resolve_model(str(HF / "DeepSeek-V3" / "config.json"))
    par = ParallelConfig(dp=64, pp=16, ep=64, global_batch=1024, seq_len=4096, zero=1)
    a = _megatron_parser().parse_args(list(emit("megatron", model, par).arguments))
    assert a.moe_layer_freq == "([0]*3+[1]*58)" and eval(a.moe_layer_freq) == [0] * 3 + [1] * 58  # noqa: S307
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size) == \
        (256, 8, 2048, 2048)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert a.mtp_num_layers == 1 and a.pipeline_model_parallel_layout.endswith("mL")
    assert (a.moe_router_num_groups, a.moe_router_group_topk) == (8, 4)     # node-limited routing
    assert sum(_layout_stages(a.pipeline_model_parallel_layout)) == 61


def test_nemo_overrides_of_a_hand_worked_configuration() -> None:
    # (tp_comm_overlap off: NeMo sets it with a callback, which the emitter refuses to stand in
    # for; see test_nemo_emits_the_default_profiles_tp_comm_overlap)
    model, par = _llama70b_run(tp_comm_overlap=False)
    overrides = dict(o.split("=", 1) for o in emit("nemo", model, par).arguments)
    assert {k: overrides[k] for k in (
        "trainer.strategy.tensor_model_parallel_size", "trainer.strategy.pipeline_model_parallel_size",
        "trainer.strategy.virtual_pipeline_model_parallel_size", "trainer.strategy.context_parallel_size",
        "trainer.strategy.sequence_parallel", "data.micro_batch_size", "data.global_batch_size", "data.seq_length",
        "model.config.recompute_granularity", "optim.config.use_distributed_optimizer",
        "trainer.strategy.ddp.overlap_param_gather")} == {
        "trainer.strategy.tensor_model_parallel_size": "8", "trainer.strategy.pipeline_model_parallel_size": "4",
        "trainer.strategy.virtual_pipeline_model_parallel_size": "2", "trainer.strategy.context_parallel_size": "1",
        "trainer.strategy.sequence_parallel": "True", "data.micro_batch_size": "1", "data.global_batch_size": "1024",
        "data.seq_length": "4096", "model.config.recompute_granularity": "selective",
        "optim.config.use_distributed_optimizer": "True", "trainer.strategy.ddp.overlap_param_gather": "True"}


def test_nemo_emits_the_default_profiles_tp_comm_overlap() -> None:
    model, par = _llama70b_run(software="nemo-24.07")
    assert par.tp_comm_overlap and "tp_comm_overlap" in par.assumed
    launch = emit("nemo", model, par)
    assert "model.config.tp_comm_overlap=True" in launch.arguments
    # Userbuffers need the recipe's comm-overlap callback, which its performance mode adds
    assert "performance_mode=True" in launch.header


def test_megatron_flags_follow_overlap_grad_reduce() -> None:
    model, par = _llama70b_run(overlap_grad_reduce=False)
    assert "--overlap-grad-reduce" not in emit("megatron", model, par).arguments


def test_nemo_overrides_follow_overlap_grad_reduce() -> None:
    model, par = _llama70b_run(overlap_grad_reduce=False, tp_comm_overlap=False)
    assert "trainer.strategy.ddp.overlap_grad_reduce=False" in emit("nemo", model, par).arguments


def test_torchtitan_toml_of_a_hand_worked_fsdp_layout() -> None:
    """ZeRO 3 on 64 data-parallel ranks (FSDP2 resharding after the forward), tp8 with sp, two
    pipeline stages of 40 layers; 1,024 sequences of micro-batch 2: each data-parallel rank
    takes 1,024 / 64 = 16 sequences, cut into micro-batches of 2."""
    tomllib = pytest.importorskip("tomllib")         # Python 3.11's TOML reader
    model = resolve_model("llama3-70b")
    par = ParallelConfig(dp=64, tp=8, pp=2, sp=True, zero=3, recompute="full", micro_batch=2, global_batch=1024,
                         seq_len=8192)
    doc = tomllib.loads(emit("torchtitan", model, par).text())
    p = doc["parallelism"]
    assert (p["data_parallel_shard_degree"], p["data_parallel_replicate_degree"], p["fsdp_reshard_after_forward"],
            p["tensor_parallel_degree"], p["pipeline_parallel_degree"], p["pipeline_parallel_microbatch_size"],
            p["pipeline_parallel_schedule"]) == (64, 1, "always", 8, 2, 2, "1F1B")
    parts = p["module_fqns_per_model_part"]
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[1][-3:] == ["layers.79", "norm", "output"]
    assert [len([m for m in part if m.startswith("layers.")]) for part in parts] == [40, 40]
    assert doc["training"] == {"local_batch_size": 16, "global_batch_size": 1024, "seq_len": 8192}
    assert doc["activation_checkpoint"] == {"mode": "full"}
    per_op = tomllib.loads(emit("torchtitan", model, replace(par, recompute="op")).text())
    assert per_op["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}


@pytest.mark.parametrize("target, settings, says", [
    ("torchtitan", dict(dp=2, zero=1), "torchtitan shards data parallelism with FSDP"),
    ("torchtitan", dict(dp=2, tp=2, zero=3, sp=False), "(--sp)"),     # (sp is on by default with tp > 1)
    ("megatron", dict(pp=2, dp=2, global_batch=4, schedule="gpipe"), "Megatron-LM has no GPipe schedule"),
    ("nemo", dict(cp=4, cp_comm="a2a+p2p", cp_a2a_size=2, seq_len=8192), "hierarchical context parallelism"),
    ("megatron", dict(dp=2, axis_order=("dp", "tp", "cp", "pp")), "maps ranks as tp, cp, dp, pp"),
    ("megatron", dict(recompute="op"), "Megatron-LM has no per-op selective checkpointing"),
    ("nemo", dict(recompute="op"), "has no per-op selective checkpointing"),
])
def test_what_a_framework_cannot_express_is_refused(target: str, settings: dict, says: str) -> None:
    with pytest.raises(UserError, match=re.escape(says)) as exc:
        emit(target, resolve_model("llama3-8b"), ParallelConfig(**settings))
    assert exc.value.parameter == "emit"


def test_simulate_emit_refusal_writes_nothing(run_cli) -> None:
    code, out, err = run_cli("simulate", *TINY, "--dp", "2", "--zero", "1", "--emit", "torchtitan")
    assert code == 2 and out == "" and err.startswith("error: emit: torchtitan")
    assert len(err.strip().splitlines()) == 1


def test_optimize_emits_the_winner_as_megatron_flags(run_cli) -> None:
    code, out, err = run_cli("optimize", "--model", "llama3-8b", "--layers", "4", "--cluster", "dgx-h100:4",
                             "--global-batch", "8", "--seq-len", "1024", "--budget", "12", "--quiet", "--json",
                             "--emit", "megatron")
    assert code == 0, err
    doc = json.loads(out)
    best = doc["best"]["config"]["parallel"]
    config, stages = _from_megatron(doc["launch"]["arguments"], 4)
    assert config == {k: best[k] for k in config}


def test_optimize_emits_the_winner_as_nemo_overrides(run_cli) -> None:
    code, out, err = run_cli("optimize", "--model", "llama3-8b", "--layers", "4", "--cluster", "dgx-h100:4",
                             "--global-batch", "8", "--seq-len", "1024", "--budget", "12", "--quiet",
                             "--emit", "nemo")
    assert code == 0, err
    text = out.split("# NeMo 2 overrides", 1)[1]
    assert "trainer.strategy.tensor_model_parallel_size=" in text
    assert all(shlex.split(line.rstrip("\\"))[0].count("=") >= 1 for line in text.splitlines()[1:] if line)


def test_optimize_for_a_launch_searches_only_the_schedules_its_framework_runs(run_cli) -> None:
    # Megatron-Core runs 1F1B and interleaved 1F1B only: a search for its launch must not answer
    # with a DualPipe or zero-bubble winner it then refuses to write
    args = ("optimize", "--model", "llama3-8b", "--layers", "8", "--cluster", "dgx-h100:8", "--global-batch", "32",
            "--seq-len", "1024", "--quiet", "--json", "--top", "200")
    code, out, err = run_cli(*args)
    assert code == 0, err
    free = json.loads(out)
    assert {t["config"]["parallel"]["schedule"] for t in free["top"]} - {"1f1b", "interleaved"}, \
        "the unrestricted search should rank some other schedule here (else this test shows nothing)"
    code, out, err = run_cli(*args, "--emit", "megatron")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["space_size"] * 3 == free["space_size"]      # 1f1b of (1f1b, zb-h1, dualpipe)
    assert {t["config"]["parallel"]["schedule"] for t in doc["top"]} <= {"1f1b", "interleaved"}
    assert "launch" in doc
