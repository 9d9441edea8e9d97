"""Step times of representative PyTorch-FSDP configurations (``--zero 3``: FULL_SHARD, ``--zero 2``:
SHARD_GRAD_OP), Llama 2 7B / 13B / 70B on 128-512 H100 (dgx-h100), data parallelism only, with
and without full activation recomputation, one and two micro-batches per rank.

    python benchmarks/fsdp_configs.py [--json FILE]

Prints step time, MFU, exposed data-parallel time and peak memory per configuration; with
``--json`` also writes them, so that two versions of the simulator can be compared row by row.
"""

from __future__ import annotations

import json
import time

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.workload import synthesize

GiB = 1 << 30
# (model, GPUs, micro-batch, micro-batches per rank)
CASES = [
    ("llama2-7b", 128, 2, 1), ("llama2-7b", 128, 2, 2), ("llama2-7b", 512, 2, 1),
    ("llama2-13b", 128, 2, 1), ("llama2-13b", 256, 2, 2),
    ("llama2-70b", 256, 1, 1), ("llama2-70b", 512, 1, 2),
]
SEQ = 4096
# Llama 2 13B (its published config.json: 40 layers, hidden 5120, FFN 13824, 40 heads)
LLAMA2_13B = ModelConfig.build("llama2-13b", "llama", layers=40, hidden=5120, ffn=13824, heads=40, vocab=32000,
                               max_seq=4096)


def model(name: str) -> ModelConfig:
    return LLAMA2_13B if name == "llama2-13b" else get_preset(name)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    rows = []
    print(f"{'model':<11} {'GPUs':>5} {'mb':>3} {'m/rank':>6} {'zero':>4} {'recompute':>9} {'step s':>8} {'MFU':>6} "
          f"{'exp dp s':>8} {'mem GiB':>8} {'sim s':>6}")
    for name, gpus, mb, m in CASES:
        for zero in (3, 2):
            for recompute in ("none", "full"):
                par = ParallelConfig(dp=gpus, micro_batch=mb, global_batch=gpus * mb * m, seq_len=SEQ, zero=zero,
                                     recompute=recompute)
                cluster = resolve_cluster("dgx-h100", gpus)
                t0 = time.perf_counter()
                r, _, _ = simulate(synthesize(model(name), par), cluster)
                dt = time.perf_counter() - t0
                row = dict(model=name, gpus=gpus, micro_batch=mb, microbatches=m, zero=zero, recompute=recompute,
                           step_time_s=r.step_time_s, mfu=r.mfu, exposed_dp_s=r.breakdown.get("exposed_dp", 0.0),
                           peak_memory_gib=r.peak_memory_bytes / GiB)
                rows.append(row)
                print(f"{name:<11} {gpus:>5} {mb:>3} {m:>6} {zero:>4} {recompute:>9} {r.step_time_s:>8.4f} "
                      f"{100 * r.mfu:>5.1f}% {row['exposed_dp_s']:>8.4f} {row['peak_memory_gib']:>8.1f} {dt:>6.1f}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
