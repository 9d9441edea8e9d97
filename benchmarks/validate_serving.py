"""Serving predictions against published serving measurements, and the fit of the engine
profiles' per-step overheads with its errors held out by source.

    python benchmarks/validate_serving.py [--rows N] [--max-requests N] [--skip-throughput]
                                          [--azure-profile-defaults]

* TensorRT-LLM's offline throughput benchmark (trtllm-bench: every request queued at once,
  fixed input and output lengths, FP8 checkpoints, FP8 KV cache, max batch 2048, 8192 tokens per
  step, KV cache at 95 % of memory, a step of decodes only padded up to the next CUDA-graph batch
  size its ``llm_options.yml`` captures, admission reserving each request's whole output: its
  GUARANTEED_NO_EVICT policy, the trtllm profile's) on H100-SXM: ``serve-sim`` with the same settings
  (``--cuda-graph-sizes``; with attention DP, its MoE's exchange: the ranks' tokens all-gathered
  and the experts' output reduce-scattered, ``--moe-token-dispatcher allgather``), output tokens
  per second against the published figure. NVIDIA ModelOpt's FP8 checkpoints carry
  static activation scales (``--fp8-activation-scale static``, the default).
* DeepSeek's online service on H800 (decode units of EP144/DP144, prefill units of EP32/DP32):
  the decode step of a rank at the service's average KV length and the batch its published
  per-user speed and per-node throughput imply, and a prefill step with the service's cache-hit
  share; per-GPU throughput against the published per-node figures over 8. DeepSeek's units
  split each batch into two micro-batches that overlap one's all-to-alls with the other's
  compute (``two_batch_overlap``), and DeepSeek-V3's FP8 checkpoint scales activations
  dynamically (its ``activation_scheme``). Both steps are priced as ``serve-sim`` prices them
  (its step timer: GEMMs by the measured microbenchmarks, the absorbed latent attention at
  FlashMLA's measured rates; every row's tensor-parallel all-reduces no faster than its GPU's
  measured nccl-tests sweep, its reduce-scatters and all-gathers than half of it).
* The Azure guide's offline throughput runs (``inference_throughput.csv``: trtllm-bench on
  H100, H200 and GB200; vLLM's benchmark_throughput on MI300X; 1000 requests of fixed lengths,
  FP8 weights and KV cache): ``serve-sim`` with the engine's profile (``trtllm``, ``vllm-0.6``)
  and the settings the guide's scripts ran with: TensorRT-LLM's batch limits from trtllm-bench's
  heuristic for the engine each model was built with (from its 2048/2048 dataset), KV cache at
  0.83 of the memory the weights leave; vLLM's 131,072 tokens per step with whole prompts,
  3,000 sequences, 90 % of memory and its V0 CUDA graphs (``--azure-profile-defaults``: the
  profiles' limits instead).

Every throughput row is simulated once without host overhead; all its requests are queued at
once, so the schedule does not depend on time and a per-step overhead ``o`` adds ``steps · o``
to its duration exactly. The overhead ``o(tp) = step_s + step_per_tp_worker_s · (tp − 1)`` of
each engine is fitted to the rows of that engine (least mean absolute relative error, both
terms non-negative); the report gives each source's error with the profile's shipped values,
and leave-one-source-out: each source predicted by a fit to the other sources only.

Prints measured against predicted per row, the mean and worst absolute error (over all rows and
per table), per source. The fit is reported, not shipped: the profiles' overheads are what their
files say.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stage_cosim import api  # noqa: E402

AZURE_AS_RUN = True          # False (--azure-profile-defaults): the engine profiles' limits, as before
CLUSTERS = {"H100-SXM": "dgx-h100", "H800-SXM": "dgx-h800", "H100-SXM5-80GB": "dgx-h100",
            "H200-SXM-141GB": "dgx-h200", "MI300X": "mi300x-8", "GB200-NVL72": "gb200-nvl72"}
AZURE_MODELS = {"LLAMA 3.1 (8B)": "llama3-8b", "LLAMA 3.1 (70B)": "llama3-70b", "LLAMA 3 (70B)": "llama3-70b",
                "LLAMA 3 (405B)": "llama3.1-405b"}
# trtllm-bench's settings (max batch 2048, 8192 tokens per step, the trtllm profile's) and KV
# cache at 95 % of memory; vLLM's benchmark_throughput runs the LLM class at its defaults
# DeepSeek's decode units hold 2 routed experts per GPU (256 + 32 redundant over 144); 128 GPUs
# with ep 128 hold the same 2 (ep must divide the 256 experts here).
DEEPSEEK_DECODE_GPUS = 128
DEEPSEEK_TPOT_S = 1 / 21           # "average output speed 20-22 tokens per second"
DEEPSEEK_CACHE_HIT = 0.563         # share of input tokens served from the on-disk KV cache
DEEPSEEK_PROMPT = 4096             # assumed prompt length (not published)
DEEPSEEK_PREFILL_TOKENS = 16384    # assumed new tokens per rank per prefill step (not published)
# How DeepSeek's units run (the published overview): dual-batch overlap; FP8 GEMMs whose
# activations are scaled as they come (DeepSeek-V3's checkpoint: activation_scheme dynamic).
DEEPSEEK_RUN = dict(two_batch_overlap=True, weight_dtype="fp8", fp8_activation_scale="dynamic")
# TensorRT-LLM's MoE with attention DP on Hopper (its CUTLASS fused MoE, which FP8 per-tensor
# checkpoints run; no all-to-all there without multi-node NVLink or DeepEP): every rank's FP8
# tokens and routing are all-gathered to every rank, each runs its experts over all of them, and
# the BF16 output is reduce-scattered back (tensorrt_llm/_torch/modules/fused_moe/
# fused_moe_cutlass.py: allgather before the fused op, reducescatter after): Megatron's
# allgather dispatcher
TRTLLM_ATTENTION_DP_DISPATCHER = "allgather"
# The CUDA-graph batch sizes NVIDIA's perf-overview runs captured, with padding on (the
# `llm_options.yml` its "Reproducing Benchmarked Results" section gives for dense and MoE models):
# a step of decodes only runs at the next of these sizes. Azure's runs do not publish theirs.
TRTLLM_PERF_OVERVIEW_GRAPHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)
# How the Azure guide ran (its Benchmarks/NVIDIA and Benchmarks/AMD LLMBenchmark.py). TensorRT-LLM:
# one engine per model, built by `trtllm-bench build --tp_size N --quantization FP8 --dataset D`
# with D the model's run of the largest ISL + OSL (2048/2048), so trtllm-bench's heuristic sets
# every run's batch limits from that dataset; then `trtllm-bench throughput
# --kv_cache_free_gpu_mem_fraction 0.83` with every other option at its default (scheduler policy
# GUARANTEED_NO_EVICT: the trtllm profile's; no CUDA-graph options: the engine backend captures
# graphs per batch size, no padding). The fraction is of the memory free once the engine is loaded.
AZURE_TRTLLM_KV_FRACTION = 0.83
# vLLM (rocm/vllm-dev:20241121-tuned): benchmark_throughput.py --quantization fp8 --kv-cache-dtype fp8
# --dtype half --gpu-memory-utilization 0.90 --num-scheduler-steps 10 --enable-chunked-prefill false
# --max-seq-len-to-capture 131072 --max-num-batched-tokens 131072 --max-model-len 8192
# --max-num-seqs N (3000: the row's note). Multi-step scheduling (10 decode steps per scheduler
# call) is not modelled: host overheads are zero here, and fixed lengths finish together.
AZURE_VLLM = dict(hbm_utilization=0.90, chunk_tokens=131072, enable_chunked_prefill=False)
# vLLM's V0 engine captures CUDA graphs for decode batches of 1, 2, 4 and multiples of 8 up to
# 256 (its _BATCH_SIZES_TO_CAPTURE), padding a batch up to the next; a larger batch runs eagerly
VLLM_V0_GRAPHS = (1, 2, 4) + tuple(range(8, 257, 8))


def _csv(name: str) -> list[dict[str, str]]:
    with resources.files("stage_cosim.validation").joinpath("data", name).open() as f:
        return list(csv.DictReader(f))


def rows() -> list[dict[str, str]]:
    return _csv("serving_published.csv")


def azure_rows() -> list[dict[str, str]]:
    """inference_throughput.csv in serving_published.csv's columns (one source per results file
    and commit: a GPU generation measured once)."""
    out = []
    for r in _csv("inference_throughput.csv"):
        engine = "vllm-0.6" if r["engine"].startswith("vLLM") else "trtllm"
        # the run's own scheduler settings where its note gives them (vLLM's --max-num-seqs)
        seqs = re.search(r"max-num-seqs (\d+)", r["note"])
        out.append(dict(source=r["source"].split(":")[0].split("@")[0].split("/")[0] + " " +
                        r["source"].split("@")[1][:7] + " " + r["gpu"].split("-")[0], engine=engine,
                        model=AZURE_MODELS[r["model"]], gpu=r["gpu"], gpus=r["tp"], tp=r["tp"], ep="1",
                        attention_dp="false", weight_dtype="fp8", kv_cache_dtype="fp8", input_len=r["input_len"],
                        output_len=r["output_len"], num_requests=r["num_requests"], metric="output_tokens_per_s",
                        value=r["output_tokens_per_s"], max_num_seqs=seqs.group(1) if seqs else ""))
    # the engine each TensorRT-LLM run used: built from the model's longest dataset in that source
    for row in out:
        longest = max((o for o in out if o["source"] == row["source"] and o["model"] == row["model"]
                       and o["tp"] == row["tp"]), key=lambda o: int(o["input_len"]) + int(o["output_len"]))
        row.update(build_input_len=longest["input_len"], build_output_len=longest["output_len"])
    return out


def azure_settings(row: dict[str, str]) -> dict[str, object]:
    """serve-sim settings of an Azure row as its guide's scripts ran it (see AZURE_TRTLLM_KV_FRACTION
    and AZURE_VLLM)."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.model import resolve_model

    gpu = resolve_cluster(CLUSTERS[row["gpu"]], 1).gpu
    if row["engine"] != "trtllm":
        seqs = int(row["max_num_seqs"] or 256)
        return dict(AZURE_VLLM, max_num_seqs=seqs, cuda_graph_sizes=tuple(g for g in VLLM_V0_GRAPHS if g <= seqs))
    built = dict(row, input_len=row["build_input_len"], output_len=row["build_output_len"])
    bs, tokens = trtllm_bench_settings(built, gpu.hbm_GiB)
    # KV cache = fraction x (HBM - weights); serve-sim's is hbm_utilization x HBM - weights
    weights = resolve_model(row["model"]).param_count() * (1.0 if row["weight_dtype"] == "fp8" else 2.0) / int(row["tp"])
    f = AZURE_TRTLLM_KV_FRACTION
    return dict(max_num_seqs=bs, chunk_tokens=tokens, hbm_utilization=f + (1 - f) * weights / gpu.memory_bytes)


@dataclass(frozen=True)
class Offline:
    """An offline run simulated without host overhead: what any per-step overhead changes."""

    tokens: int          # output tokens
    duration_s: float
    steps: int
    tp: int

    def throughput(self, overhead_s: float) -> float:
        return self.tokens / (self.duration_s + self.steps * overhead_s)


def trtllm_bench_settings(row: dict[str, str], gpu_GiB: float) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) as trtllm-bench chooses them for a run that gives
    neither (its ``calc_engine_setting`` and ``finetune_setting``, tensorrt_llm/bench/build/
    tuning.py): the requests of ISL + OSL tokens that fit in 95 % of the memory the weights
    leave over all GPUs, counting at least one KV head per tensor-parallel rank, capped at 4096
    and rounded up; tokens per step the batch times 1 + ISL/OSL, at least 2048."""
    from stage_cosim.model import resolve_model

    m = resolve_model(row["model"])
    tp = int(row["tp"])
    isl, osl = int(row["input_len"]), int(row["output_len"])
    byte = 1.0 if row["weight_dtype"] == "fp8" else 2.0
    kv_byte = 1.0 if row["kv_cache_dtype"] == "fp8" else 2.0
    per_token = 2 * m.layers * max(tp, m.kv_heads) * m.head_dim * kv_byte / 2**30
    available = gpu_GiB * tp - m.param_count() * byte / 2**30
    requests = 0.95 * available / (per_token * (isl + osl))
    raw_bs = min(requests, 4096)
    raw_token = min(raw_bs * (1 + isl / osl), 32768)
    bs = _round_up(raw_bs, ((256, 32), (1024, 128), (math.inf, 256)), floor=64)
    tokens = _round_up(raw_token, ((4096, 256), (8192, 512), (math.inf, 1024)), floor=2048)
    return bs, max(tokens, bs)


def _round_up(x: float, rungs: tuple[tuple[float, int], ...], floor: int) -> int:
    """``x`` rounded up to the step of the first rung whose limit it is under, at least
    ``floor`` (trtllm-bench's rounding of its batch and token limits)."""
    step = next(step for limit, step in rungs if x < limit)
    return max(floor, step * math.ceil(x / step))


def offline_run(row: dict[str, str], max_requests: int, engine: str = "trtllm") -> Offline:
    """Every request queued at once through ``serve-sim`` with ``engine``'s scheduler and no
    host overhead (added afterwards: see :class:`Offline`)."""
    n = min(int(row["num_requests"]), max_requests)
    isl, osl = int(row["input_len"]), int(row["output_len"])
    req = dict(model=row["model"], cluster=f"{CLUSTERS[row['gpu']]}:{row['gpus']}", tp=int(row["tp"]),
               weight_dtype=row["weight_dtype"], kv_cache_dtype=row["kv_cache_dtype"], rate=1e9, num_requests=n,
               input_len=isl, output_len=osl, lengths="fixed", engine=engine, step_overhead=0.0,
               request_overhead=0.0, request_timeout=0, max_seq=max(8192, isl + osl))
    if engine == "trtllm":
        req.update(hbm_utilization=0.95)
    if row.get("max_num_seqs"):
        req.update(max_num_seqs=int(row["max_num_seqs"]))
    if row["source"].startswith("Azure") and AZURE_AS_RUN:
        req.update(azure_settings(row))
    if row["source"] == "trtllm_perf_overview":
        # NVIDIA's runs give trtllm-bench no batch limits (its heuristic sets them) and pad
        # decode steps to the CUDA graphs their options capture
        from stage_cosim.hardware import resolve_cluster

        bs, tokens = trtllm_bench_settings(row, resolve_cluster(CLUSTERS[row["gpu"]], 1).gpu.hbm_GiB)
        req.update(max_num_seqs=bs, chunk_tokens=tokens, cuda_graph_sizes=TRTLLM_PERF_OVERVIEW_GRAPHS)
    if row["attention_dp"] == "true":
        req.update(dp=int(row["gpus"]) // int(row["tp"]) if int(row["tp"]) < int(row["gpus"]) else int(row["gpus"]),
                   tp=1 if int(row["tp"]) == int(row["gpus"]) else int(row["tp"]), attention_dp=True,
                   ep=int(row["ep"]), expert_tp=1)
        if engine == "trtllm":
            req.update(moe_token_dispatcher=TRTLLM_ATTENTION_DP_DISPATCHER)
    r = api.serve_sim(req)
    return Offline(r["requests"]["output_tokens"], r["duration_s"], r["steps"]["count"], int(req["tp"]))


def _overhead(params: np.ndarray, tp: int) -> float:
    return abs(params[0]) + abs(params[1]) * (tp - 1)


def fit_overhead(runs: list[tuple[Offline, float]]) -> tuple[float, float]:
    """(step_s, step_per_tp_worker_s) minimizing the mean |relative error| of ``runs``
    ((simulation, measured tokens/s) pairs): a grid, then Nelder-Mead from its best point."""
    def loss(p: np.ndarray) -> float:
        return float(np.mean([abs(sim.throughput(_overhead(p, sim.tp)) / meas - 1) for sim, meas in runs]))

    grid = [(a, b) for a in np.linspace(0, 0.02, 41) for b in np.linspace(0, 0.004, 21)]
    start = min(grid, key=lambda p: loss(np.asarray(p)))
    best = minimize(loss, np.asarray(start) + 1e-5, method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-6})
    return abs(float(best.x[0])), abs(float(best.x[1]))


def deepseek_decode(row: dict[str, str]) -> float:
    """Output tokens/s per GPU of a decode step whose time is the service's per-user token gap
    (the step as ``serve-sim`` prices it: GEMMs by the measured microbenchmarks)."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.inference.config import BatchShape, InferenceConfig
    from stage_cosim.model import resolve_model
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.serving.steptime import StepTimer

    per_gpu = float(row["value"])
    batch = round(per_gpu * DEEPSEEK_TPOT_S)          # requests per attention rank
    g = DEEPSEEK_DECODE_GPUS
    model = resolve_model("deepseek-v3")
    timer = StepTimer(model, ParallelConfig(dp=g, ep=g), InferenceConfig("decode", attention_dp=True,
                      kv_cache_dtype=row["kv_cache_dtype"], **DEEPSEEK_RUN), resolve_cluster(f"dgx-h800:{g}"), 0)
    # input_len is the service's average KV length: the cache each decoded token reads
    step = timer.simulate(BatchShape.uniform(batch, 1, int(row["input_len"]) - 1, frozenset(model.layer_windows())))
    return batch / step


def deepseek_prefill(row: dict[str, str]) -> float:
    """Input tokens/s per GPU (cache hits included) of a prefill step of DeepSeek's units."""
    from stage_cosim.inference.config import BatchShape, InferenceConfig
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.model import resolve_model
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.serving.steptime import StepTimer

    g = int(row["gpus"])
    model = resolve_model("deepseek-v3")
    cached = round(DEEPSEEK_PROMPT * DEEPSEEK_CACHE_HIT)
    new = DEEPSEEK_PROMPT - cached
    per_rank = max(1, DEEPSEEK_PREFILL_TOKENS // new)
    timer = StepTimer(model, ParallelConfig(dp=g, ep=g), InferenceConfig("prefill", attention_dp=True,
                      kv_cache_dtype=row["kv_cache_dtype"], **DEEPSEEK_RUN), resolve_cluster(f"dgx-h800:{g}"), 0)
    step = timer.simulate(BatchShape.uniform(per_rank, new, cached, frozenset(model.layer_windows())))
    return per_rank * DEEPSEEK_PROMPT / step


def main() -> None:
    from stage_cosim.serving.engines import engine_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="Only the first N rows of each table.")
    ap.add_argument("--max-requests", type=int, default=3000,
                    help="Requests per benchmark row at most (the published runs used up to 30,000).")
    ap.add_argument("--skip-throughput", action="store_true", help="Leave out inference_throughput.csv.")
    ap.add_argument("--azure-profile-defaults", action="store_true",
                    help="Run the Azure rows with the engine profiles' limits instead of the guide's own settings.")
    args = ap.parse_args()
    global AZURE_AS_RUN
    AZURE_AS_RUN = not args.azure_profile_defaults
    table = [dict(r, engine="trtllm") for r in rows()[:args.rows]]
    if not args.skip_throughput:
        table += azure_rows()[:args.rows]
    print(f"{'source':<34} {'engine':<8} {'model':<14} {'GPUs':>4} {'ISL/OSL':>10} {'metric':<22} {'measured':>10} "
          f"{'predicted':>10} {'error':>8} {'time s':>7}")
    results = []           # (row, predicted, Offline | None)
    for row in table:
        t0 = time.perf_counter()
        sim = None
        if row["metric"] == "output_tokens_per_s":
            sim = offline_run(row, args.max_requests, row["engine"])
            pred = sim.throughput(engine_profile(row["engine"]).step_overhead(sim.tp))
        elif row["metric"].startswith("decode"):
            pred = deepseek_decode(row)
        else:
            pred = deepseek_prefill(row)
        meas = float(row["value"])
        err = (pred - meas) / meas
        results.append((row, pred, sim))
        lengths = f"{row['input_len']}/{row['output_len']}"
        print(f"{row['source'][:34]:<34} {row['engine']:<8} {row['model']:<14} {row['gpus']:>4} {lengths:>10} "
              f"{row['metric'][:22]:<22} {meas:>10,.0f} {pred:>10,.0f} {100 * err:>+7.1f}% "
              f"{time.perf_counter() - t0:>7.1f}", flush=True)
    errs = [abs(p / float(r["value"]) - 1) for r, p, _ in results]
    print(f"\nmean |error| {100 * np.mean(errs):.1f} %, worst {100 * max(errs):.1f} % over {len(errs)} rows "
          f"(the engine profiles' shipped overheads)")
    # each table on its own: serving_published.csv alone is the set earlier reports quote
    n_pub = len(table) - (0 if args.skip_throughput else len(azure_rows()[:args.rows]))
    for name, part in (("serving_published.csv", errs[:n_pub]), ("inference_throughput.csv", errs[n_pub:])):
        if part:
            print(f"  {name:<25} mean |error| {100 * np.mean(part):.1f} %, worst {100 * max(part):.1f} % "
                  f"over {len(part)} rows")
    by_source: dict[str, list[float]] = defaultdict(list)
    for (row, _, _), e in zip(results, errs):
        by_source[row["source"]].append(e)
    # the overhead fit per engine, and each source predicted by a fit to the others
    fitted = [(r, sim) for r, _, sim in results if sim is not None]
    held: dict[str, list[float]] = defaultdict(list)
    print(f"\n{'engine':<9} {'fit on':<10} {'step_s (ms)':>11} {'per tp worker (ms)':>18}   shipped profile (ms)")
    for engine in sorted({r["engine"] for r, _ in fitted}):
        mine = [(r, sim) for r, sim in fitted if r["engine"] == engine]
        a, b = fit_overhead([(sim, float(r["value"])) for r, sim in mine])
        prof = engine_profile(engine)
        print(f"{engine:<9} {'all rows':<10} {1e3 * a:>11.3f} {1e3 * b:>18.3f}   "
              f"{1e3 * prof.step_overhead_s:.3f} + {1e3 * prof.step_overhead_per_tp_s:.3f} x (tp-1)")
        sources = sorted({r["source"] for r, _ in mine})
        for src in sources:
            rest = [(sim, float(r["value"])) for r, sim in mine if r["source"] != src]
            if not rest:
                continue
            a, b = fit_overhead(rest)
            print(f"{'':<9} {'w/o ' + src[:30]:<40} {1e3 * a:>7.3f} {1e3 * b:>8.3f}")
            for r, sim in mine:
                if r["source"] == src:
                    held[src].append(abs(sim.throughput(a + b * (sim.tp - 1)) / float(r["value"]) - 1))
    print(f"\n{'source':<40} {'rows':>4} {'mean |err|':>10} {'held out':>9}")
    for src, es in by_source.items():
        h = f"{100 * np.mean(held[src]):>8.1f}%" if held.get(src) else f"{'-':>9}"
        print(f"{src[:40]:<40} {len(es):>4} {100 * np.mean(es):>9.1f}% {h}")
    all_held = [e for es in held.values() for e in es]
    if all_held:
        print(f"\nleave-one-source-out mean |error| {100 * np.mean(all_held):.1f} % over {len(all_held)} rows "
              f"(each source predicted by the fit to the others)")


if __name__ == "__main__":
    main()
