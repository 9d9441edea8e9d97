"""Serving predictions against published serving measurements (checks, never fitted).

    python benchmarks/validate_serving.py [--rows N] [--max-requests N]

* TensorRT-LLM's offline throughput benchmark (trtllm-bench: every request queued at once,
  fixed input and output lengths, FP8 checkpoints, FP8 KV cache, max batch 2048, 8192 tokens per
  step, KV cache at 95 % of memory) on H100-SXM: ``serve-sim`` with the same settings, output
  tokens per second against the published figure. NVIDIA ModelOpt's FP8 checkpoints carry
  static activation scales (``--fp8-activation-scale static``, the default).
* DeepSeek's online service on H800 (decode units of EP144/DP144, prefill units of EP32/DP32):
  the decode step of a rank at the service's average KV length and the batch its published
  per-user speed and per-node throughput imply, and a prefill step with the service's cache-hit
  share; per-GPU throughput against the published per-node figures over 8. DeepSeek's units
  split each batch into two micro-batches that overlap one's all-to-alls with the other's
  compute (``two_batch_overlap``), and DeepSeek-V3's FP8 checkpoint scales activations
  dynamically (its ``activation_scheme``).

Prints measured against predicted per row, and the mean and worst absolute error.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stage_cosim import api  # noqa: E402

CLUSTERS = {"H100-SXM": "dgx-h100", "H800-SXM": "dgx-h800"}
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


def rows() -> list[dict[str, str]]:
    with resources.files("stage_cosim.validation").joinpath("data", "serving_published.csv").open() as f:
        return list(csv.DictReader(f))


def trtllm(row: dict[str, str], max_requests: int) -> float:
    n = min(int(row["num_requests"]), max_requests)
    isl, osl = int(row["input_len"]), int(row["output_len"])
    req = dict(model=row["model"], cluster=f"{CLUSTERS[row['gpu']]}:{row['gpus']}", tp=int(row["tp"]),
               weight_dtype=row["weight_dtype"], kv_cache_dtype=row["kv_cache_dtype"], rate=1e9, num_requests=n,
               input_len=isl, output_len=osl, lengths="fixed", max_num_seqs=2048, chunk_tokens=8192,
               hbm_utilization=0.95, max_seq=max(8192, isl + osl))
    if row["attention_dp"] == "true":
        req.update(dp=int(row["gpus"]) // int(row["tp"]) if int(row["tp"]) < int(row["gpus"]) else int(row["gpus"]),
                   tp=1 if int(row["tp"]) == int(row["gpus"]) else int(row["tp"]), attention_dp=True,
                   ep=int(row["ep"]), expert_tp=1)
    return api.serve_sim(req)["throughput"]["output_tokens_per_s"]


def deepseek_decode(row: dict[str, str]) -> float:
    """Output tokens/s per GPU of a decode step whose time is the service's per-user token gap."""
    per_gpu = float(row["value"])
    batch = round(per_gpu * DEEPSEEK_TPOT_S)          # requests per attention rank
    g = DEEPSEEK_DECODE_GPUS
    r = api.simulate(dict(model="deepseek-v3", cluster=f"dgx-h800:{g}", phase="decode", batch=batch * g,
                          context_len=int(row["input_len"]), dp=g, ep=g, attention_dp=True,
                          kv_cache_dtype=row["kv_cache_dtype"], **DEEPSEEK_RUN))
    return batch / r["step_time_s"]


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="Only the first N rows.")
    ap.add_argument("--max-requests", type=int, default=3000,
                    help="Requests per benchmark row at most (the published runs used up to 30,000).")
    args = ap.parse_args()
    errs = []
    print(f"{'source':<28} {'model':<16} {'GPUs':>4} {'ISL/OSL':>10} {'metric':<34} {'measured':>10} "
          f"{'predicted':>10} {'error':>8} {'time s':>7}")
    for row in rows()[:args.rows]:
        t0 = time.perf_counter()
        if row["source"] == "trtllm_perf_overview":
            pred = trtllm(row, args.max_requests)
        elif row["metric"].startswith("decode"):
            pred = deepseek_decode(row)
        else:
            pred = deepseek_prefill(row)
        meas = float(row["value"])
        err = (pred - meas) / meas
        errs.append(abs(err))
        lengths = f"{row['input_len']}/{row['output_len']}"
        print(f"{row['source']:<28} {row['model']:<16} {row['gpus']:>4} {lengths:>10} {row['metric']:<34} "
              f"{meas:>10,.0f} {pred:>10,.0f} {100 * err:>+7.1f}% {time.perf_counter() - t0:>7.1f}", flush=True)
    print(f"\nmean |error| {100 * sum(errs) / len(errs):.1f} %, worst {100 * max(errs):.1f} % over {len(errs)} rows")


if __name__ == "__main__":
    main()
