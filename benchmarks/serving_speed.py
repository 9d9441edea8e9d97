"""Speed and accuracy of the inference and serving paths.

    python benchmarks/serving_speed.py [--requests 10000] [--skip-accuracy]

1. One decode step of DeepSeek-V3 on 64 H100 (attention data parallelism over 64 ranks, ep 64,
   64 requests per rank at 4K context, what fits in HBM in BF16): model to result, first call (the graphs compiled) and
   then per step (the issue's target: under 50 ms).
2. A serving run of N requests (default 10,000; Llama 3 70B, tp8 instances on 16 H100, Poisson
   arrivals near capacity): wall time, steps per second, step shapes simulated (target: under 10 s).
3. The serving step-time split (the cache-reading kernels timed exactly, the rest interpolated)
   against simulating every step, on random mixed batches of several layouts: mean and worst
   relative error, and the time per step of each.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stage_cosim import api  # noqa: E402


def decode_step() -> None:
    req = dict(model="deepseek-v3", cluster="dgx-h100:64", phase="decode", batch=64 * 64, context_len=4096,
               dp=64, ep=64, attention_dp=True)
    t0 = time.perf_counter()
    r = api.simulate(req)
    first = time.perf_counter() - t0
    times = []
    for c in range(4000, 4010):
        req["context_len"] = c
        t0 = time.perf_counter()
        api.simulate(req)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"DeepSeek-V3 decode step, 64 H100 (adp64 ep64, 64 requests per rank at 4K): step {1e3 * r['step_time_s']:.2f} ms "
          f"simulated; model -> result {first:.2f} s first call (compiles the graphs), then "
          f"{1e3 * times[len(times) // 2]:.0f} ms median, {1e3 * times[0]:.0f}-{1e3 * times[-1]:.0f} ms over 10 steps")


def serving_run(n: int) -> None:
    req = dict(model="llama3-70b", cluster="dgx-h100:16", tp=8, rate=9.0, num_requests=n, input_len=1024,
               output_len=256, slo_ttft=1.0, slo_tpot=0.05)
    t0 = time.perf_counter()
    r = api.serve_sim(req)
    wall = time.perf_counter() - t0
    st = r["step_times"]
    print(f"serving run: {n:,} requests (Llama 3 70B, 2 x tp8 on 16 H100, Poisson 9/s, 1024 in / 256 out): "
          f"{wall:.2f} s wall ({r['steps']['count']:,} steps, {r['steps']['count'] / wall:,.0f} steps/s, "
          f"{st['cached_shapes']} shapes simulated, step times {st['mode']}); "
          f"TTFT p99 {1e3 * r['latency_s']['ttft']['p99']:.0f} ms, TPOT p50 {1e3 * r['latency_s']['tpot']['p50']:.1f} ms, "
          f"{r['throughput']['output_tokens_per_s']:,.0f} output tokens/s")


LAYOUTS = [("llama3-8b", dict(tp=1), {}), ("llama3-70b", dict(tp=8), {}),
           ("mixtral-8x7b", dict(tp=2, ep=2, expert_tp=1), {}),
           ("gpt-oss-120b", dict(tp=4, ep=4, expert_tp=1), {}),
           ("deepseek-v3", dict(dp=8, ep=8), {"attention_dp": True})]


def accuracy(shapes: int) -> None:
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.inference import InferenceConfig
    from stage_cosim.inference.config import BatchShape, Sequence
    from stage_cosim.model import resolve_model
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.serving.steptime import StepTimer

    print(f"\n{'model':<14} {'layout':<26} {'mode':<6} {'mean |err|':>10} {'worst':>9} {'split ms':>9} {'exact ms':>9}"
          "   (ms per step: the split once its grid exists; simulating the step)")
    for name, par_kw, inf_kw in LAYOUTS:
        model = resolve_model(name)
        par = ParallelConfig(**par_kw)
        timer = StepTimer(model, par, InferenceConfig("decode", **inf_kw), resolve_cluster("dgx-h100", par.world_size))
        rnd = random.Random(1)
        ws = frozenset(model.layer_windows())
        errs, split_t, exact_t = [], 0.0, 0.0
        batches = []
        for _ in range(shapes):
            seqs = [Sequence(1, rnd.randint(10, 8000)) for _ in range(rnd.randint(1, 200))]
            if rnd.random() < 0.5:
                seqs.append(Sequence(rnd.randint(2, 4000), rnd.choice([0, 0, 1000])))
            batches.append(BatchShape.of(seqs, ws))
        for shape in batches:                   # the grid's points around them, and the split's check
            timer(shape)
        for shape in batches:
            t0 = time.perf_counter()
            a = timer(shape)                    # a step once the grid around it exists
            t1 = time.perf_counter()
            b = timer.simulate(shape)
            t2 = time.perf_counter()
            split_t += t1 - t0
            exact_t += t2 - t1
            errs.append(abs(a - b) / b)
        layout = " ".join(f"{k}{v}" for k, v in {**par_kw, **inf_kw}.items())
        print(f"{name:<14} {layout:<26} {timer.stats.mode:<6} {100 * sum(errs) / len(errs):>9.4f}% "
              f"{100 * max(errs):>8.4f}% {1e3 * split_t / shapes:>9.2f} {1e3 * exact_t / shapes:>9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--shapes", type=int, default=20, help="Random batches per layout for the accuracy check.")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    decode_step()
    serving_run(args.requests)
    if not args.skip_accuracy:
        accuracy(args.shapes)


if __name__ == "__main__":
    main()
