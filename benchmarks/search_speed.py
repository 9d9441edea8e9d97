"""Parallelization search: exhaustive ground truth against the scipy-driven search.

    python benchmarks/search_speed.py [--workers N] [--skip-exhaustive]

llama3-70b on 1,024 dgx-h100 GPUs, global batch 1,024, sequence 8,192. The exhaustive pass
simulates every structurally feasible configuration (the proven optimum); the search pass runs
differential evolution plus the local polish with a budget, from a cold start (no shared cache).
"""

from __future__ import annotations

import argparse
import time

from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.search.optimize import OptimizeSettings, optimize
from stage_cosim.search.space import default_space


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--budget", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3, help="search runs with seeds 0 .. N-1")
    ap.add_argument("--skip-exhaustive", action="store_true",
                    help="only the seeded searches (the ground truth takes ~5 minutes)")
    args = ap.parse_args()
    model = get_preset("llama3-70b")
    cluster = resolve_cluster("dgx-h100:1024")
    space = default_space(model, cluster, 1024, 8192)
    print(f"llama3-70b on 1,024 H100, global batch 1,024, seq 8,192: {space.size} points in the space")

    best = None
    if not args.skip_exhaustive:
        t = time.perf_counter()
        truth = optimize(space, cluster, OptimizeSettings(exhaustive_limit=10**9, workers=args.workers))
        t_truth = time.perf_counter() - t
        best = truth.best
        print(f"exhaustive: {len(truth.evaluated)} configurations in {t_truth:.1f} s "
              f"({len(truth.evaluated) / t_truth:.1f} evaluations/s); optimum {best.point} at {best.score:.4f} s/step")

    for seed in range(args.seeds):
        t = time.perf_counter()
        found = optimize(space, cluster, OptimizeSettings(exhaustive_limit=0, budget=args.budget, seed=seed,
                                                          workers=args.workers))
        dt = time.perf_counter() - t
        if best is None:
            verdict = f"{found.best.point}"
        elif found.best.point == best.point:
            verdict = "the proven optimum"
        else:
            verdict = f"{found.best.score / best.score - 1:+.2%} from the optimum"
        print(f"search seed {seed}: {len(found.evaluated)} evaluations in {dt:.1f} s "
              f"({len(found.evaluated) / dt:.1f} evaluations/s); best {found.best.score:.4f} s/step ({verdict})",
              flush=True)


if __name__ == "__main__":
    main()
