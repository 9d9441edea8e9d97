"""Load the published measurements (see data/SOURCES.md) as typed rows."""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from stage_cosim.model.config import ModelConfig


def _rows(name: str) -> list[dict[str, str]]:
    with resources.files("stage_cosim.validation").joinpath("data", name).open() as f:
        return list(csv.DictReader(f))


def megatron_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one iteration as both training tables count them (no recompute term)."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


@dataclass(frozen=True)
class TrainingRun:
    """One published training configuration and its measured step time."""

    source: str
    name: str
    model: ModelConfig
    gpu: str
    gpus: int
    tp: int
    pp: int
    dp: int
    vp: int
    global_batch: int
    micro_batch: int
    seq_len: int
    recompute: str
    # sequence parallelism where the source states it (None: the software profile's default)
    sp: bool | None
    measured_step_s: float
    zero: int = 0
    # the framework release the run used: its defaults are the switches the source leaves unstated
    software: str | None = None
    # Mixture of Experts and precision
    ep: int = 1
    expert_tp: int | None = None
    moe_token_dispatcher: str = "alltoall"
    dtype: str = "bf16"
    fp8_recipe: str | None = None
    fp8_dispatch: bool = False
    cluster: str = ""                    # the cluster preset the run's machine matches
    # Context parallelism and the rest of a recipe's settings (Megatron's names)
    cp: int = 1
    cp_comm: str = "p2p"
    fp8_format: str = "hybrid"
    pp_layers: tuple[int, ...] | None = None
    axis_order: tuple[str, ...] | None = None
    # switches the source states (None: the software profile's default)
    tp_comm_overlap: bool | None = None
    fp8_param_gather: bool = False
    # the pipeline schedule the source states (None: 1F1B, interleaved where vp > 1)
    schedule: str | None = None

    def parallel(self) -> "ParallelConfig":  # noqa: F821
        from stage_cosim.parallel import ParallelConfig

        return ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, cp_comm=self.cp_comm, vp=self.vp,
                              micro_batch=self.micro_batch, global_batch=self.global_batch, seq_len=self.seq_len,
                              sp=self.sp, recompute=self.recompute, zero=self.zero,
                              **({"software": self.software} if self.software else {}),
                              tp_comm_overlap=self.tp_comm_overlap,
                              **({"fp8_param_gather": True} if self.fp8_param_gather else {}),
                              ep=self.ep, expert_tp=self.expert_tp, moe_token_dispatcher=self.moe_token_dispatcher,
                              dtype=self.dtype, fp8_recipe=self.fp8_recipe, fp8_dispatch=self.fp8_dispatch,
                              pp_layers=self.pp_layers,
                              **({"schedule": self.schedule} if self.schedule else {}),
                              **({"axis_order": self.axis_order} if self.axis_order else {}),
                              **({"fp8_format": self.fp8_format}
                                 if self.dtype == "fp8" else {}))


def korthikanti_table5() -> list[TrainingRun]:
    runs = []
    for r in _rows("korthikanti2022_table5.csv"):
        model = ModelConfig.build(f"gpt-{r['model']}", "gpt", layers=int(r["layers"]), hidden=int(r["hidden"]),
                                  heads=int(r["heads"]), ffn=int(r["ffn"]), vocab=int(r["vocab"]),
                                  max_seq=int(r["seq"]), attention="unfused")
        runs.append(TrainingRun("korthikanti2022", f"{r['model']} {r['recompute']}", model, r["gpu"],
                                int(r["gpus"]), int(r["tp"]), int(r["pp"]), int(r["dp"]), int(r["virtual_stages"]),
                                int(r["global_batch"]), int(r["micro_batch"]), int(r["seq"]), r["recompute"],
                                r["sequence_parallel"] == "true", float(r["measured_iter_s"]),
                                software="megatron-lm-2022"))
    return runs


def korthikanti_memory() -> dict[str, dict[str, float]]:
    """Per model: GiB of weights+grads+optimizer, activations without / with selective+sp."""
    return {r["model"]: {k: float(v) for k, v in r.items() if k != "model"}
            for r in _rows("korthikanti2022_memory.csv")}


def megatron_core_weak_scaling() -> list[TrainingRun]:
    """Rows of the Megatron-Core H100 table; the step time is derived from the measured TFLOP/s
    with the table's own FLOP formula. The models are GPT (4h MLP, untied embeddings, flash
    attention). The table states the distributed optimizer (ZeRO-1); its sequence parallelism
    and tensor-, data- and pipeline-parallel communication overlap are the megatron-core-0.8
    profile's defaults, not set here."""
    runs = []
    for r in _rows("megatron_core_h100_weak_scaling.csv"):
        h, l, s, v = int(r["hidden"]), int(r["layers"]), int(r["seq"]), int(r["vocab"])
        gpus, gb = int(r["gpus"]), int(r["global_batch"])
        step = megatron_model_flops(gb, s, l, h, v) / (float(r["measured_tflops_per_gpu"]) * 1e12 * gpus)
        model = ModelConfig.build(f"gpt-{r['params_B']}b", "gpt", layers=l, hidden=h, heads=int(r["heads"]),
                                  vocab=v, max_seq=s, tied_embeddings=False, hidden_dropout=0.0,
                                  attention_dropout=0.0)
        runs.append(TrainingRun("megatron-core-0.8", f"{r['params_B']}B", model, r["gpu"], gpus, int(r["tp"]),
                                int(r["pp"]), int(r["dp"]), 1, gb, 1, s, "none", None, step, zero=1,
                                software="megatron-core-0.8"))
    return runs


def megatron_v09_model_flops(m: ModelConfig, batch: int, seq: int, padded_vocab: int) -> float:
    """Megatron-Core v0.9's ``num_floating_point_operations`` for one iteration: 12 B s L h^2
    times attention ((1 + G/A + s/h) x the query projection over h), the MLP (ffn/h, top-k routed
    experts, x 3/2 for SwiGLU) and the logits (V / 2 L h). The router and the shared experts
    are not counted (v0.9's formula predates them)."""
    h, layers = m.hidden, m.layers
    query = m.head_dim * m.heads / h
    attention = (1 + m.kv_heads / m.heads + seq / h) * query
    routed = m.moe_router_topk if m.is_moe else 1
    mlp = (m.expert_ffn if m.is_moe else m.ffn) / h * routed * (1.5 if m.mlp in ("swiglu", "geglu") else 1)
    return 12 * batch * seq * layers * h * h * (attention + mlp + padded_vocab / (2 * layers * h))


# The machines of the MoE rows, as cluster presets.
_MOE_CLUSTER = {"H100-SXM5-80GB": "dgx-h100", "H800-SXM": "dgx-h800"}


# The dispatch a source describes, where the file's column names only the all-to-all family:
# DeepSeek-V3's report (section 3.2.2) sends each token over InfiniBand once per node it
# reaches (at most 4: node-limited routing) and forwards it over NVLink there, which is the
# flex (DeepEP) dispatcher
_DISPATCHER = {"deepseek_v3_tech_report": "flex"}
# The pipeline schedule a source names in its text: DeepSeek-V3's report (section 3.2.1) runs
# its 16 stages with DualPipe (each rank holds stage i and stage pp-1-i, micro-batches fed from
# both ends).
_SCHEDULE = {"deepseek_v3_tech_report": "dualpipe"}


def moe_published() -> list[TrainingRun]:
    """The Mixture-of-Experts rows, with their published mappings (tp, ep, expert_tp, pp, vp, dp,
    micro-batch, global batch). Mixtral's step time is derived from its TFLOP/s with
    Megatron-Core v0.9's formula; DeepSeek-V3's from its GPU-hours per trillion tokens. DeepSeek's
    FP8 recipe is the report's: 1x128 activation tiles and 128x128 weight blocks (``blockwise``),
    tokens dispatched in FP8 and combined in BF16. Not published, and taken as Megatron-Core's
    recommended MoE settings: the distributed optimizer (ZeRO-1), no recomputation; sequence
    parallelism is the software profile's default."""
    from stage_cosim.model import get_preset

    runs = []
    for r in _rows("moe_published.csv"):
        model = get_preset(r["model"])
        gpus, gb, s = int(r["gpus"]), int(r["gbs"]), int(r["seq"])
        tp = int(r["tp"])
        if r["measured_unit"] == "model_tflops_per_gpu":
            padded = -(-model.vocab // (128 * tp)) * 128 * tp
            step = megatron_v09_model_flops(model, gb, s, padded) / (float(r["measured"]) * 1e12 * gpus)
        elif r["measured_unit"] == "gpu_hours_per_trillion_tokens":
            per_gpu = 1e12 / (float(r["measured"]) * 3600)
            step = gb * s / (per_gpu * gpus)
        else:
            raise ValueError(f"moe_published.csv: unknown unit {r['measured_unit']!r}")
        fp8 = r["dtype"].startswith("fp8")
        runs.append(TrainingRun(r["source"], r["model"], model, r["gpu"], gpus, tp, int(r["pp"]), int(r["dp"]),
                                int(r["vp"]), gb, int(r["mbs"]), s, "none", None, step, zero=1,
                                ep=int(r["ep"]), expert_tp=int(r["etp"]),
                                moe_token_dispatcher=_DISPATCHER.get(r["source"], r["dispatcher"]),
                                dtype="fp8" if fp8 else "bf16",
                                fp8_recipe="blockwise" if r["dtype"] == "fp8-blockwise" else None, fp8_dispatch=fp8,
                                cluster=_MOE_CLUSTER[r["gpu"]], schedule=_SCHEDULE.get(r["source"])))
    return runs


def _nemo_model(r: dict[str, str], seq: int) -> ModelConfig:
    """A model of NeMo Framework 24.07's recipe (see data/SOURCES.md): its dimensions and the
    loss kernel it uses. Attention is Transformer Engine's fused (flash) kernel."""
    bias = r["bias"] == "true"
    dropout = float(r["dropout"])
    return ModelConfig.build(
        r["model"].lower(), r["arch"], layers=int(r["layers"]), hidden=int(r["hidden"]), ffn=int(r["ffn"]),
        heads=int(r["heads"]), kv_heads=int(r["kv_heads"]), vocab=int(r["vocab"]), max_seq=seq,
        tied_embeddings=r["tied_embeddings"] == "true", mlp=r["mlp"], norm=r["norm"], position=r["position"],
        rotary_percent=float(r["rotary_percent"]), attention_bias=bias, mlp_bias=bias, hidden_dropout=dropout,
        attention_dropout=dropout, cross_entropy=r["cross_entropy"], attention="fused")


def nemo2407_fp8_h100() -> list[TrainingRun]:
    """NeMo Framework 24.07's FP8 pre-training benchmarks on DGX H100: the performance table's
    mapping (GPUs, global and micro-batch, sequence, tp, pp, cp, vp) and tokens/s per GPU, from
    which the step time is gbs * seq / (tokens/s/GPU * GPUs). The model dimensions come from the
    same release's launcher recipes (nemo2407_recipes.csv). Everything else is the published
    layout, FP8 and the distributed optimizer (Apex's distributed Adam: sharded optimizer states,
    bucketed gradient reduce-scatter and parameter all-gather over dp*cp, i.e. ZeRO-1); the
    recipes' switches (sequence parallelism, Userbuffers overlap, the gradient reduction's
    precision) are left to the nemo-24.07 software profile, and recomputation and the amax
    history to the tool's defaults, as a user typing the table would. (Where a recipe differs
    from its profile -- GPT-3 175B and Nemotron 340B without Userbuffers overlap, Nemotron 340B's
    selective recomputation, Llama 2 13B/70B's amax history of 1 -- the difference is the tool's
    error.) Transformer Engine's delayed scaling, hybrid format; the context-parallel attention
    of this release is the ring (p2p)."""
    recipes = {r["model"]: r for r in _rows("nemo2407_recipes.csv")}
    runs = []
    for r in _rows("nemo2407_fp8_h100.csv"):
        rec = recipes[r["model"]]
        gpus, gb, s = int(r["gpus"]), int(r["gbs"]), int(r["seq"])
        tp, pp, cp = int(r["tp"]), int(r["pp"]), int(r["cp"])
        step = gb * s / (float(r["tokens_per_s_per_gpu"]) * gpus)
        runs.append(TrainingRun(
            r["source"], f"{r['model']} ({gpus})", _nemo_model(rec, s), "H100-SXM5-80GB", gpus, tp, pp,
            gpus // (tp * pp * cp), int(r["vp"]), gb, int(r["mbs"]), s, "none", None,
            step, zero=1, software="nemo-24.07", dtype="fp8", fp8_recipe="delayed",
            cluster="dgx-h100", cp=cp, cp_comm="p2p", fp8_format="hybrid"))
    return runs


def palm_model_flops(model: ModelConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one iteration as PaLM counts them (Chowdhery et al. 2022, Appendix B),
    the MFU Llama 3's paper reports: 6 N + 12 L H Q T per token, N the parameters that
    multiply (every weight but an untied input embedding table, a lookup), L H Q T layers, heads,
    head size and sequence (the full T x T score matrix, as our model FLOPs count it)."""
    n = model.param_count() - (0 if model.tied_embeddings else model.vocab * model.hidden)
    attention = 12 * model.layers * model.heads * model.head_dim * seq
    return batch * seq * (6 * n + attention)


def llama3_herd_table4() -> list[TrainingRun]:
    """Llama 3 405B's pre-training configurations (Grattafiori et al., "The Llama 3 Herd of
    Models", arXiv 2407.21783, Table 4) on 8,192 and 16,384 H100 (700 W, 80 GB, 400 Gb/s RoCE per
    GPU, eight GPUs a server on NVLink): BF16, tp8 pp16, dp64 / dp128 at 8K tokens and tp8 cp16
    pp16 dp8 at 131K; the step time is the batch's PaLM model FLOPs over TFLOP/s x GPUs. Checks,
    never fitted. From the paper's text (section 3.3.2): ranks ordered [TP, CP, PP, DP]; FSDP that
    shards optimizer states and gradients but keeps the gathered weights through the backward
    (ZeRO-2), gradients reduce-scattered in fp32; context parallelism by all-gathering K and V
    (2*cp load-balanced chunks); an interleaved schedule whose first chunk holds only the
    embedding and last chunk only the output layer and loss, with one layer fewer on the first
    and last pipeline ranks: 126 layers = 16 x 8 - 2 chunks of one layer, so V = 8 chunks per
    rank. Not stated, and taken as Megatron's defaults: sequence parallelism with tp, micro-batch
    1, no recomputation (the paper trains 8K without activation checkpointing; ours fits 131K
    without it too); sequence parallelism is the software profile's default."""
    from stage_cosim.model import get_preset

    runs = []
    for r in _rows("llama3_herd_table4.csv"):
        model = get_preset(r["model"])
        gpus, tp, cp, pp, dp, s = (int(r[k]) for k in ("gpus", "tp", "cp", "pp", "dp", "seq"))
        gb = int(r["batch_per_dp"]) * dp
        vp = 8
        step = palm_model_flops(model, gb, s) / (float(r["tflops_per_gpu"]) * 1e12 * gpus)
        runs.append(TrainingRun(
            r["source"], f"405B {gpus} GPUs, {s // 1024}K" + (f", cp{cp}" if cp > 1 else ""), model, "H100-SXM5-80GB",
            gpus, tp, pp, dp, vp, gb, 1, s, "none", None, step, zero=2, cluster="dgx-h100", cp=cp,
            cp_comm="all-gather", pp_layers=(0,) + (1,) * model.layers + (0,), axis_order=("tp", "cp", "pp", "dp")))
    return runs


# torchtitan's model names -> presets
_TORCHTITAN_MODELS = {"llama3.1-8b": "llama3.1-8b", "llama3-8b": "llama3-8b", "llama3.1-70b": "llama3.1-70b",
                      "llama3.1-405b": "llama3.1-405b", "llama4-scout (17B active, 16 experts)": "llama4-scout",
                      "llama4-17bx16e reduced to 2 layers": "llama4-scout"}
# rows that run a preset cut to fewer layers (torchao's MoE benchmark fits Scout on one node so)
_TORCHTITAN_LAYERS = {"llama4-17bx16e reduced to 2 layers": 2}
_TORCHTITAN_CLUSTERS = {"H100": "dgx-h100", "H200": "dgx-h200", "B200": "dgx-b200", "MI300X": "mi300x-8",
                        "GB200": "gb200-nvl72"}
# the hosts torchtitan's own H100 benchmarks ran on (rows whose gpu_note names them): H100s with
# 96 GB of HBM2e at 2.4 TB/s at a 500 W power limit, as the documents state, their GEMM rates
# scaled by what an H100 at 500 W measured (the file's header says how)
GRAND_TETON_H100 = str(Path(__file__).resolve().parent / "data" / "grand_teton_h100.yaml")
# torchtitan's activation_checkpointing modes (its own names: its "selective" runs here as our "op")
TORCHTITAN_AC_MODES = ("none", "selective", "full")


# torchao's float8 recipes (the first word of the file's column) in this tool's words: cuBLAS's
# MXFP8 GEMMs are the mxfp8 recipe (rceil only rounds the scales differently) ...
_TORCHAO_RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "mxfp8": "mxfp8", "mxfp8_cublas": "mxfp8",
                    "mxfp8_cublas_rceil": "mxfp8"}
# ... and those it cannot express, by the column's whole text or its first word, with why
_PARTIAL_MXFP8 = "MXFP8 on part of the GEMMs is not modelled (the recipe quantizes the linear layers and the " \
                 "experts' grouped GEMMs together)"
_TORCHAO_UNEXPRESSED = {"rowwise_with_gw_hp": "a weight-gradient GEMM kept in BF16 is not modelled",
                        "mxfp8 linears only": _PARTIAL_MXFP8, "mxfp8 grouped GEMMs only": _PARTIAL_MXFP8}


def _torchtitan_recipe(recipe: str) -> tuple[str | None, str]:
    """This tool's FP8 recipe for a torchao float8 recipe, and why there is none ("" if there is)."""
    name = recipe.split(" ")[0]
    why = _TORCHAO_UNEXPRESSED.get(recipe) or _TORCHAO_UNEXPRESSED.get(name)
    if why or name not in _TORCHAO_RECIPES:
        shown = recipe if recipe in _TORCHAO_UNEXPRESSED else name
        return None, f"float8 recipe {shown!r}: {why or 'not modelled'}"
    return _TORCHAO_RECIPES[name], ""


@dataclass(frozen=True)
class Unexpressed:
    """A published row the tool cannot express, and why (reported, never dropped silently)."""

    source: str
    name: str
    reason: str


def torchtitan_benchmarks() -> tuple[list[TrainingRun], list[Unexpressed]]:
    """PyTorch-native runs (torchtitan and torchao, 2024-12 to 2025-06): FSDP2 with tensor,
    pipeline and context parallelism, Float8 linears and async TP, as published, and the rows
    this tool cannot express with the reason. The step time is global batch * sequence /
    (tokens/s per GPU * GPUs).

    The mapping, torchtitan's semantics in this tool's words: FSDP over ``fsdp`` ranks is ZeRO 3
    (ZeRO 2 with pipelining, where torchtitan does not reshard after the forward); the tp plan
    shards norms over the sequence (sp) and async TP is the tp overlap; interleaved 1F1B has two
    stages per rank and torchtitan's default micro-batch count is pp; context parallelism
    all-gathers keys and values; Float8 tensorwise and rowwise are the ``tensorwise`` and
    ``rowwise`` recipes (tensorwise's FSDP float8 all-gather the FP8 parameter gather), cuBLAS's
    MXFP8 on B200 the ``mxfp8`` recipe; MI300X runs on the ``mi300x-8`` preset. Activation checkpointing: full as full; torchtitan's
    selective (per-op: matmul and attention outputs saved, every second matmul of a layer and
    every other op recomputed) as ``op``. Caveats the source states: torchtitan's own H100 rows ran
    on Meta's Grand Teton hosts, 96 GB of HBM2e at 2.4 TB/s per GPU at a 500 W power limit — they
    run on ``GRAND_TETON_H100`` (the H100 SXM record with that memory, its BF16 and FP8 GEMM
    efficiencies scaled by Meta's GEMM measurements at 500 W against the 700 W part's); torchao's
    H100 rows (variant not stated) on the DGX H100; sequence lengths marked not stated are
    torchtitan's default 8192."""
    runs, unexpressed = [], []
    for i, r in enumerate(_rows("torchtitan_benchmarks.csv")):
        name = f"{r['model']} {r['gpus']}x{r['gpu']} #{i}"
        source = f"torchtitan:{r['run_group']}" if r.get("run_group") else "torchtitan"
        run = _torchtitan_run(r, source, name)
        if isinstance(run, str):
            unexpressed.append(Unexpressed(source, name, run))
        else:
            runs.append(run)
    return runs, unexpressed


def _torchtitan_run(r: dict[str, str], source: str, name: str) -> "TrainingRun | str":
    """One torchtitan row as a run, or why it cannot be one."""
    from stage_cosim.model import get_preset

    if r["model"] not in _TORCHTITAN_MODELS:
        return f"model {r['model']!r} has no preset here"
    if r["gpu"] not in _TORCHTITAN_CLUSTERS:
        return f"no {r['gpu']} preset"
    if r["torch_compile"] != "true":
        return "eager PyTorch (no torch.compile): its unfused elementwise kernels are not modelled"
    fp8 = r["compute_dtype"] != "bf16"
    recipe, why = _torchtitan_recipe(r["float8_recipe"]) if fp8 else (None, "")
    if why:
        return why
    ac = r["activation_checkpointing"].split(" ")[0]
    if ac not in TORCHTITAN_AC_MODES:
        return f"activation checkpointing {r['activation_checkpointing']!r}"
    # torchtitan's selective mode is per-op in every source here (the llama3 tomls' default,
    # selective_ac_option = "op")
    ac = "op" if ac == "selective" else ac
    if int(r["dp_replicate"]) > 1:
        return "HSDP (replicated FSDP groups) is not modelled"
    gpus, tp, pp, cp = int(r["gpus"]), int(r["tp"]), int(r["pp"]), int(r["cp"])
    dp = int(r["fsdp"])
    local = int(r["local_batch"])
    gb = int(r["global_batch"]) if r["global_batch"] else local * dp
    s = int(r["seq_len"])
    microbatches = pp if pp > 1 else 1        # torchtitan's default: pp micro-batches
    model = get_preset(_TORCHTITAN_MODELS[r["model"]])
    if r["model"] in _TORCHTITAN_LAYERS:
        model = replace(model, name=f"{model.name}-{_TORCHTITAN_LAYERS[r['model']]}l",
                        layers=_TORCHTITAN_LAYERS[r["model"]])
    return TrainingRun(
        source, name, model, r["gpu"], gpus, tp, pp, dp,
        2 if r["pp_schedule"].startswith("Interleaved") else 1, gb, local // microbatches, s, ac, tp > 1,
        gb * s / (float(r["tokens_per_s_per_gpu"]) * gpus), zero=3 if pp == 1 else 2, software="torchtitan-2024.12",
        dtype="fp8" if fp8 else "bf16", fp8_recipe=recipe,
        cluster=GRAND_TETON_H100 if "Grand Teton" in r["gpu_note"] else _TORCHTITAN_CLUSTERS[r["gpu"]],
        cp=cp, cp_comm="all-gather", ep=int(r["ep"] or 1),
        tp_comm_overlap=(r["async_tp"] == "true") if tp > 1 else None,
        fp8_param_gather=recipe == "tensorwise" and r["fsdp_float8_allgather"] == "true")
