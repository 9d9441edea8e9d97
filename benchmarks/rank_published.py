"""Where the published Megatron-Core H100 configurations rank among all configurations.

    python benchmarks/rank_published.py [--budget N]

For each row of the Megatron-Core 0.8 weak-scaling table, search the row's model, GPU count and
global batch (sequence 4096), then report the published configuration's rank among every
simulated configuration and how much faster (predicted) the best one is.
"""

from __future__ import annotations

import argparse
import time

from stage_cosim.hardware import resolve_cluster
from stage_cosim.search.evaluate import Objective, evaluate
from stage_cosim.search.optimize import OptimizeSettings, optimize
from stage_cosim.search.space import default_space
from stage_cosim.validation.published import megatron_core_weak_scaling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=120, help="simulations per row when the space is large")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    print(f"{'model':<6} {'GPUs':>5} {'published':<24} {'pred s':>8} {'rank':>11} {'best found':<42} {'best s':>8} "
          f"{'speedup':>8} {'search':>22}")
    for run in megatron_core_weak_scaling():
        cluster = resolve_cluster("dgx-h100", run.gpus)
        space = default_space(run.model, cluster, run.global_batch, run.seq_len,
                              fixed={"tp_comm_overlap": True})
        t = time.perf_counter()
        result = optimize(space, cluster, OptimizeSettings(budget=args.budget, workers=args.workers))
        dt = time.perf_counter() - t
        published = evaluate(run.model, cluster, run.parallel(), {"published": True}, Objective())
        ranked = result.ranked
        if published.feasible:
            rank = 1 + sum(1 for e in ranked if e.score < published.score)
            rank_s = f"{rank}/{len(ranked) + 1}"
            pred = f"{published.score:>8.3f}"
        else:
            rank_s, pred = "infeasible", f"{'-':>8}"
        best = ranked[0]
        p = best.parallel
        desc = (f"tp{p['tp']} pp{p['pp']} dp{p['dp']} vp{p['vp']} mb{p['micro_batch']} "
                f"{'sp ' if p['sp'] else ''}z{p['zero']} {p['recompute']}")
        speed = f"{published.score / best.score:>7.2f}x" if published.feasible else f"{'-':>8}"
        kind = "proven" if result.proven_optimal else f"DE {len(result.evaluated)} evals"
        print(f"{run.name:<6} {run.gpus:>5} {f'tp{run.tp} pp{run.pp} dp{run.dp}':<24} {pred} {rank_s:>11} {desc:<42} "
              f"{best.score:>8.3f} {speed} {kind + f', {dt:.0f} s':>22}", flush=True)


if __name__ == "__main__":
    main()
