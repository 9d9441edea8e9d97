"""Load the published measurements (see data/SOURCES.md) as typed rows."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources

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
    sp: bool
    measured_step_s: float
    zero: int = 0
    tp_comm_overlap: bool = False
    # Mixture of Experts and precision
    ep: int = 1
    expert_tp: int | None = None
    moe_token_dispatcher: str = "alltoall"
    dtype: str = "bf16"
    fp8_recipe: str | None = None
    fp8_dispatch: bool = False
    cluster: str = ""                    # the cluster preset the run's machine matches

    def parallel(self) -> "ParallelConfig":  # noqa: F821
        from stage_cosim.parallel import ParallelConfig

        return ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, vp=self.vp, micro_batch=self.micro_batch,
                              global_batch=self.global_batch, seq_len=self.seq_len, sp=self.sp,
                              recompute=self.recompute, zero=self.zero, tp_comm_overlap=self.tp_comm_overlap,
                              ep=self.ep, expert_tp=self.expert_tp, moe_token_dispatcher=self.moe_token_dispatcher,
                              dtype=self.dtype, fp8_recipe=self.fp8_recipe, fp8_dispatch=self.fp8_dispatch)


def korthikanti_table5() -> list[TrainingRun]:
    runs = []
    for r in _rows("korthikanti2022_table5.csv"):
        model = ModelConfig.build(f"gpt-{r['model']}", "gpt", layers=int(r["layers"]), hidden=int(r["hidden"]),
                                  heads=int(r["heads"]), ffn=int(r["ffn"]), vocab=int(r["vocab"]),
                                  max_seq=int(r["seq"]), attention="unfused")
        runs.append(TrainingRun("korthikanti2022", f"{r['model']} {r['recompute']}", model, r["gpu"],
                                int(r["gpus"]), int(r["tp"]), int(r["pp"]), int(r["dp"]), int(r["virtual_stages"]),
                                int(r["global_batch"]), int(r["micro_batch"]), int(r["seq"]), r["recompute"],
                                r["sequence_parallel"] == "true", float(r["measured_iter_s"])))
    return runs


def korthikanti_memory() -> dict[str, dict[str, float]]:
    """Per model: GiB of weights+grads+optimizer, activations without / with selective+sp."""
    return {r["model"]: {k: float(v) for k, v in r.items() if k != "model"}
            for r in _rows("korthikanti2022_memory.csv")}


def megatron_core_weak_scaling() -> list[TrainingRun]:
    """Rows of the Megatron-Core H100 table; the step time is derived from the measured TFLOP/s
    with the table's own FLOP formula. The models are GPT (4h MLP, untied embeddings, flash
    attention); the runs used sequence parallelism, the distributed optimizer (ZeRO-1) and
    tensor-, data- and pipeline-parallel communication overlap."""
    runs = []
    for r in _rows("megatron_core_h100_weak_scaling.csv"):
        h, l, s, v = int(r["hidden"]), int(r["layers"]), int(r["seq"]), int(r["vocab"])
        gpus, gb = int(r["gpus"]), int(r["global_batch"])
        step = megatron_model_flops(gb, s, l, h, v) / (float(r["measured_tflops_per_gpu"]) * 1e12 * gpus)
        model = ModelConfig.build(f"gpt-{r['params_B']}b", "gpt", layers=l, hidden=h, heads=int(r["heads"]),
                                  vocab=v, max_seq=s, tied_embeddings=False, hidden_dropout=0.0,
                                  attention_dropout=0.0, causal_flops=True)
        runs.append(TrainingRun("megatron-core-0.8", f"{r['params_B']}B", model, r["gpu"], gpus, int(r["tp"]),
                                int(r["pp"]), int(r["dp"]), 1, gb, 1, s, "none", True, step, zero=1,
                                tp_comm_overlap=True))
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


def moe_published() -> list[TrainingRun]:
    """The Mixture-of-Experts rows, with their published mappings (tp, ep, expert_tp, pp, vp, dp,
    micro-batch, global batch). Mixtral's step time is derived from its TFLOP/s with
    Megatron-Core v0.9's formula; DeepSeek-V3's from its GPU-hours per trillion tokens. DeepSeek's
    FP8 recipe is the report's: 1x128 activation tiles and 128x128 weight blocks (``blockwise``),
    tokens dispatched in FP8 and combined in BF16. Not published, and taken as Megatron-Core's
    recommended MoE settings: the distributed optimizer (ZeRO-1), no recomputation, sequence
    parallelism where tp > 1."""
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
                                int(r["vp"]), gb, int(r["mbs"]), s, "none", tp > 1, step, zero=1,
                                ep=int(r["ep"]), expert_tp=int(r["etp"]), moe_token_dispatcher=r["dispatcher"],
                                dtype="fp8" if fp8 else "bf16",
                                fp8_recipe="blockwise" if r["dtype"] == "fp8-blockwise" else None, fp8_dispatch=fp8,
                                cluster=_MOE_CLUSTER[r["gpu"]]))
    return runs


def gpu_specs() -> list[dict[str, str]]:
    return _rows("gpu_specs.csv")
