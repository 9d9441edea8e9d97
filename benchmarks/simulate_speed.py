"""Simulator speed: model to result, and simulations per second with the graph already built.

    python benchmarks/simulate_speed.py [--model deepseek-v3]
"""

from __future__ import annotations

import time

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.workload import synthesize

CASES = [  # (model, dp, tp, pp, ep, global batch, seq, cluster, cp)
    ("llama3-70b", 32, 8, 4, 1, 32, 4096, "dgx-h100", 1),      # one micro-batch per rank
    ("llama3-70b", 32, 8, 4, 1, 1024, 4096, "dgx-h100", 1),    # 32 micro-batches per rank
    ("llama3.1-405b", 1024, 8, 16, 1, 1024, 8192, "dgx-h100", 1),
    ("llama3.1-405b", 1024, 8, 16, 1, 16384, 8192, "dgx-h100", 1),
    # the published DeepSeek-V3 mapping: 120 micro-batches per rank, 58 MoE layers of 256 experts
    ("deepseek-v3", 128, 1, 16, 64, 15360, 4096, "dgx-h800", 1),
    # the Llama 3 paper's long-context stage: 131K tokens, cp 16 (ring), 16,384 GPUs
    ("llama3.1-405b", 8, 8, 16, 1, 8, 131072, "dgx-h100", 16),
    ("llama3.1-405b", 8, 8, 16, 1, 128, 131072, "dgx-h100", 16),
]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="only this model's cases")
    args = ap.parse_args()
    print("synth s: model to role graphs in a fresh process (the first synthesis of an architecture compiles "
          "its blocks: 'cold'), then again with the blocks compiled ('warm')")
    print(f"{'model':<14} {'GPUs':>7} {'dp':>5} {'tp':>3} {'cp':>3} {'pp':>3} {'ep':>3} {'seq':>7} {'mb/rank':>7} {'synth s':>8} "
          f"{'simulate s':>10} {'total s':>8} {'warm total s':>12} {'sims/s (graph built)':>21} {'step s':>8} {'MFU':>6}")
    for name, dp, tp, pp, ep, gb, seq, cluster_name, cp in CASES:
        if args.model and name != args.model:
            continue
        par = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, global_batch=gb, seq_len=seq, sp=tp > 1, zero=1)
        cluster = resolve_cluster(cluster_name, par.world_size)
        t0 = time.perf_counter()
        w = synthesize(get_preset(name), par)
        w.roles
        t1 = time.perf_counter()
        result, _, _ = simulate(w, cluster)
        t2 = time.perf_counter()
        w2 = synthesize(get_preset(name), par)       # the blocks are compiled now
        w2.roles
        simulate(w2, cluster)
        warm = time.perf_counter() - t2
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 2.0:
            simulate(w, cluster)
            n += 1
        rate = n / (time.perf_counter() - t)
        print(f"{name:<14} {par.world_size:>7} {dp:>5} {tp:>3} {cp:>3} {pp:>3} {ep:>3} {seq:>7} {par.num_microbatches:>7} {t1 - t0:>8.3f} "
              f"{t2 - t1:>10.3f} {t2 - t0:>8.3f} {warm:>12.3f} {rate:>21.1f} {result.step_time_s:>8.3f} "
              f"{100 * result.mfu:>5.1f}%", flush=True)


if __name__ == "__main__":
    main()
