"""``simulate --full`` on the quick-start configuration: time and peak memory.

    python benchmarks/full_replay.py [--per-rank]

Llama-3 70B on 1,024 H100s (tp 8, pp 4, dp 32, sp, ZeRO-1, global batch 1,024, sequence 4,096:
32 micro-batches per rank, ~25,000 nodes per rank). ``--full`` replays one rank per pipeline
stage once every rank is proven a copy of its stage's (the proof looks at every rank's groups
and messages); ``--per-rank`` times the replay of all 1,024 ranks instead (what ``--full``
does when the proof fails, and what it did for every configuration before). Peak memory is
the process's maximum resident set, read at the end (run one mode per process).
"""

from __future__ import annotations

import argparse
import resource
import time

from stage_cosim.adapters.roofline.simulate import simulate, simulate_every_rank
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.workload import synthesize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-rank", action="store_true", help="replay every rank (no rank stands for its stage)")
    args = ap.parse_args()
    par = ParallelConfig(tp=8, pp=4, dp=32, sp=True, zero=1, global_batch=1024, seq_len=4096)
    cluster = resolve_cluster("dgx-h100", par.world_size)
    wall, cpu = time.perf_counter(), time.process_time()
    w = synthesize(get_preset("llama3-70b"), par, cluster.gpu)
    if args.per_rank:
        result, _, programs = simulate(w, cluster, symmetric=False)
    else:
        result, _, programs = simulate_every_rank(w, cluster)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20      # KiB -> GiB
    print(f"{'per-rank replay' if args.per_rank else 'simulate --full'}: {len(programs)} of {w.world_size} ranks "
          f"replayed, step {result.step_time_s:.6f} s; {wall:.1f} s wall, {cpu:.1f} s CPU, peak RSS {peak:.2f} GiB")


if __name__ == "__main__":
    main()
