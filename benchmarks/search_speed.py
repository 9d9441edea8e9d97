"""Parallelization search: exhaustive ground truth against the scipy-driven search.

    python benchmarks/search_speed.py [--case llama3-70b|mixtral-8x7b|all] [--workers N] [--skip-exhaustive]

* llama3-70b on 1,024 dgx-h100 GPUs, global batch 1,024, sequence 8,192: the default space.
* mixtral-8x7b on 64 dgx-h100 GPUs, global batch 256, sequence 4,096 (the published mapping's
  setting), with ep and expert_tp in the space: tp 1/2/4, cp 1/2 (ring), pp 1/2/4/8, vp 1/2,
  micro-batch 1/2, recomputation none/full, ep 1/2/4/8, expert_tp 1/2 (sp on, ZeRO-1). The expert
  layers re-factor the tp*cp*dp ranks, so cp 2 opens layouts with ep*expert_tp up to twice tp*dp.

The exhaustive pass simulates every structurally feasible configuration (the proven optimum);
the search pass runs differential evolution plus the local polish with a budget, from a cold
start (no shared cache).
"""

from __future__ import annotations

import argparse
import time

from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.search.optimize import OptimizeSettings, optimize
from stage_cosim.search.space import default_space

CASES = {  # name -> (model, cluster, global batch, seq, space overrides)
    "llama3-70b": ("llama3-70b", "dgx-h100:1024", 1024, 8192, {}),
    "mixtral-8x7b": ("mixtral-8x7b", "dgx-h100:64", 256, 4096,
                     dict(tp=(1, 2, 4), cp=(1, 2), cp_comm=("p2p",), pp=(1, 2, 4, 8), vp=(1, 2), micro_batch=(1, 2),
                          sp=(True,), zero=(1,), recompute=("none", "full"), ep=(1, 2, 4, 8), expert_tp=(1, 2))),
}


def run_case(name: str, args: argparse.Namespace) -> None:
    model_name, cluster_spec, gb, seq, overrides = CASES[name]
    model = get_preset(model_name)
    cluster = resolve_cluster(cluster_spec)
    space = default_space(model, cluster, gb, seq, overrides=overrides)
    print(f"\n{model_name} on {cluster.num_gpus:,} {cluster.gpu.name}, global batch {gb:,}, seq {seq:,}: "
          f"{space.size} points in the space ({', '.join(space.names())})")

    best = None
    if not args.skip_exhaustive:
        t = time.perf_counter()
        truth = optimize(space, cluster, OptimizeSettings(exhaustive_limit=10**9, workers=args.workers))
        t_truth = time.perf_counter() - t
        best = truth.best
        print(f"exhaustive: {len(truth.evaluated)} configurations in {t_truth:.1f} s "
              f"({len(truth.evaluated) / t_truth:.1f} evaluations/s, "
              f"{truth.infeasible.get('does not fit in memory', 0)} of them over the memory); "
              f"optimum {best.point} at {best.score:.4f} s/step")

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--budget", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3, help="search runs with seeds 0 .. N-1")
    ap.add_argument("--skip-exhaustive", action="store_true",
                    help="only the seeded searches (the llama ground truth takes ~5 minutes)")
    args = ap.parse_args()
    for name in CASES if args.case == "all" else [args.case]:
        run_case(name, args)


if __name__ == "__main__":
    main()
