"""Parallelization search: branch and bound (the proven optimum), its bounds' speed, and the
scipy-driven search.

    python benchmarks/search_speed.py [--case llama3-70b|mixtral-8x7b|deepseek-v3|serve-llama3-70b|all]
                                      [--workers N] [--skip-bound] [--skip-old] [--exhaustive] [--seeds N]
                                      [--budget N] [--serve-unpruned] [--time-limit S]

* llama3-70b on 1,024 dgx-h100 GPUs, global batch 1,024, sequence 8,192: the default space
  (what ``stage-cosim optimize --model llama3-70b --cluster dgx-h100:1024 --global-batch 1024
  --seq-len 8192`` searches).
* mixtral-8x7b on 64 dgx-h100 GPUs, global batch 256, sequence 4,096 (the published mapping's
  setting), with ep and expert_tp in the space: tp 1/2/4, cp 1/2 (ring), pp 1/2/4/8, vp 1/2,
  micro-batch 1/2, recomputation none/full, ep 1/2/4/8, expert_tp 1/2 (sp on, ZeRO-1). The expert
  layers re-factor the tp*cp*dp ranks, so cp 2 opens layouts with ep*expert_tp up to twice tp*dp.

* deepseek-v3 on 2,048 dgx-h800 GPUs, global batch 4,096, sequence 4,096: the default space
  (what ``stage-cosim optimize --model deepseek-v3 --cluster dgx-h800:2048 --global-batch 4096
  --seq-len 4096`` searches), ep and expert_tp in it: some 157,000 feasible configurations in
  some 37,000 groups of shared blocks. Not in ``all`` (its branch and bound runs for hours);
  ``--time-limit`` stops the branch and bound and prints its counts so far.

* serve-llama3-70b: the serving search on one DGX H100 (8 GPUs), TTFT <= 2 s and TPOT <= 50 ms
  for 90 % of requests (what ``stage-cosim optimize --phase serve --model llama3-70b --cluster
  dgx-h100:8 --slo-ttft 2 --slo-tpot 0.05`` searches): its wall and CPU time, layouts simulated
  and ruled out, the proof and the best. ``--serve-unpruned`` also searches every layout to its
  edge (keeping every layout in the top list rules none out: about 22 minutes of CPU) and checks the
  answer is the same.

For each training case: how long the structural rules take over the space, how many configurations a
second the lower bounds cover when all are bounded at once (search/compiled.py), first with
every sharding policy still to compile and then with them compiled, how long binding every
configuration's training blocks takes (policies compiled; the first step of each group's bounds),
and one configuration at a time (search/bound.py's StepBound, what the search ran before; ``--skip-old`` leaves it out)
with the largest difference between the two, how many a second the memory check from the bounds' blocks
settles (search/memory.py), and the branch and bound (what ``optimize`` runs without a
budget on a space over ``exhaustive_limit``; here on mixtral's smaller space too): its wall time,
simulations against feasible configurations, and what it ruled out by memory and by bound. ``--exhaustive`` also simulates
every feasible configuration (the ground truth; hours for llama3-70b), ``--seeds N`` runs the
budgeted scipy search (differential evolution plus the local polish) with seeds 0 … N-1.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.search.bound import StepBound
from stage_cosim.search.compiled import CompiledBound
from stage_cosim.search.memory import fits
from stage_cosim.search.optimize import OptimizeSettings, _feasible, _Search, optimize
from stage_cosim.search.runner import SerialRunner
from stage_cosim.search.space import default_space
from stage_cosim.workload import precision_for

CASES = {  # name -> (model, cluster, global batch, seq, space overrides)
    "llama3-70b": ("llama3-70b", "dgx-h100:1024", 1024, 8192, {}),
    "mixtral-8x7b": ("mixtral-8x7b", "dgx-h100:64", 256, 4096,
                     dict(tp=(1, 2, 4), cp=(1, 2), cp_comm=("p2p",), pp=(1, 2, 4, 8), vp=(1, 2), micro_batch=(1, 2),
                          sp=(True,), zero=(1,), recompute=("none", "full"), ep=(1, 2, 4, 8), expert_tp=(1, 2))),
    "deepseek-v3": ("deepseek-v3", "dgx-h800:2048", 4096, 4096, {}),
}
# the cases ``--case all`` runs
ALL = ("llama3-70b", "mixtral-8x7b")


def peak_rss() -> str:
    """This process's peak resident memory so far."""
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20):.2f} GiB peak resident"


def describe(point: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items() if v is not None)


def run_case(name: str, args: argparse.Namespace) -> None:
    model_name, cluster_spec, gb, seq, overrides = CASES[name]
    model = get_preset(model_name)
    cluster = resolve_cluster(cluster_spec)
    space = default_space(model, cluster, gb, seq, overrides=overrides)
    print(f"\n{model_name} on {cluster.num_gpus:,} {cluster.gpu.name}, global batch {gb:,}, seq {seq:,}: "
          f"{space.size:,} points in the space ({', '.join(space.names())})", flush=True)

    best = None
    if not args.skip_bound:
        t = time.perf_counter()
        search = _Search(space, cluster, OptimizeSettings(), SerialRunner(), None, None)
        feasible = _feasible(search)
        configs = [search.structure(p)[0] for p in feasible]
        print(f"structural rules: {len(feasible):,} distinct feasible configurations in {time.perf_counter() - t:.1f} s")
        for label in ("policies to compile", "policies compiled"):
            compiled = CompiledBound(model, cluster)
            t, cpu = time.perf_counter(), time.process_time()
            fast = compiled(configs)
            dt, cpu = time.perf_counter() - t, time.process_time() - cpu
            print(f"compiled bounds ({label}): {len(configs):,} configurations in {dt:.1f} s ({cpu:.1f} s of CPU), "
                  f"{len(configs) / dt:,.0f} bounded per second; {peak_rss()}", flush=True)
        bound = compiled.bound
        # the training blocks alone (policies compiled): every configuration's, each group's
        # bound once (what a group's bounds start from)
        fresh = StepBound(model, cluster)
        t, cpu = time.perf_counter(), time.process_time()
        keys = set()
        for par in configs:
            fresh.blocks(par)
            # (the groups counted by what binds them: the bound keeps only the latest groups'
            # blocks, so one group may be bound again)
            keys.add(fresh.blocks_key(par, precision_for(par, cluster.gpu)))
        groups = len(keys)
        dt, cpu = time.perf_counter() - t, time.process_time() - cpu
        print(f"training blocks: {len(configs):,} configurations' ({groups:,} bound) in {dt:.1f} s ({cpu:.1f} s of "
              f"CPU), {groups / dt:,.0f} bound per second", flush=True)
        if not args.skip_old:
            # the bounds one configuration at a time (what the search ran before), policies compiled
            old = StepBound(model, cluster)
            t, cpu = time.perf_counter(), time.process_time()
            slow = np.array([old(par) for par in configs])
            dt, cpu = time.perf_counter() - t, time.process_time() - cpu
            print(f"bounds one at a time (StepBound, policies compiled): {len(configs):,} configurations in "
                  f"{dt:.1f} s ({cpu:.1f} s of CPU), {len(configs) / dt:,.0f} bounded per second; the compiled "
                  f"bounds differ by at most {np.max(np.abs(fast - slow) / slow):.1e} relative", flush=True)
        # the memory check from the bounds' blocks (no synthesis), on an even sample
        sample = configs[::max(1, len(configs) // 2000)]
        t = time.perf_counter()
        over = sum(not fits(model, cluster, par, *bound.blocks(par)) for par in sample)
        dt = time.perf_counter() - t
        print(f"memory checks (from the bounds' blocks): {len(sample):,} configurations in {dt:.1f} s, "
              f"{len(sample) / dt:,.0f} a second ({over:,} over the memory)", flush=True)
        t, cpu = time.perf_counter(), time.process_time()
        # (branch and bound even where the space is small enough to enumerate: mixtral's is)
        stop = None if args.time_limit is None else (lambda: time.perf_counter() - t > args.time_limit)
        r = optimize(space, cluster, OptimizeSettings(workers=args.workers, exhaustive_limit=0), should_stop=stop)
        dt, cpu = time.perf_counter() - t, time.process_time() - cpu
        bb = r.bounds or {}
        best = r.best
        sims = bb.get("simulated", 0)
        print(f"{r.method}: {dt:.1f} s, {cpu:.1f} s of CPU (policies compiled; {peak_rss()}), "
              f"{'proven optimal' if r.proven_optimal else 'NOT proven'}"
              f"{' (stopped at the time limit)' if r.interrupted else ''}; "
              f"{bb.get('simulated', len(r.evaluated)):,} simulations of {r.feasible:,} feasible configurations, "
              f"{bb.get('pruned_by_memory', 0):,} over the memory, {bb.get('pruned_by_bound', 0):,} ruled out by "
              f"their bound (lowest bound {bb.get('lowest_bound') or 0:.4f} s, stopped at {bb.get('stopped_at_bound') or 0:.4f} s)")
        if best is not None:
            print(f"{'optimum' if r.proven_optimal else 'best so far'} {describe(best.point)} at {best.score:.4f} s/step",
                  flush=True)
        if sims:
            print(f"event simulator: {sims:,} simulations, at most {sims / dt:.2f} configurations a second "
                  f"(the branch and bound's whole time over its simulations)", flush=True)

    if args.exhaustive:
        t = time.perf_counter()
        truth = optimize(space, cluster, OptimizeSettings(exhaustive_limit=10**9, workers=args.workers))
        t_truth = time.perf_counter() - t
        same = "" if best is None else (" (the branch and bound's)" if truth.best.point == best.point else
                                       " (NOT the branch and bound's)")
        best = truth.best
        print(f"exhaustive: {len(truth.evaluated)} configurations in {t_truth:.1f} s "
              f"({len(truth.evaluated) / t_truth:.1f} evaluations/s, "
              f"{truth.infeasible.get('does not fit in memory', 0)} of them over the memory); "
              f"optimum {describe(best.point)} at {best.score:.4f} s/step{same}", flush=True)

    for seed in range(args.seeds):
        t = time.perf_counter()
        found = optimize(space, cluster, OptimizeSettings(exhaustive_limit=0, budget=args.budget, seed=seed,
                                                          workers=args.workers))
        dt = time.perf_counter() - t
        if best is None:
            verdict = describe(found.best.point)
        elif found.best.point == best.point:
            verdict = "the proven optimum"
        else:
            verdict = f"{found.best.score / best.score - 1:+.2%} from the optimum"
        print(f"search seed {seed}: {len(found.evaluated)} evaluations in {dt:.1f} s "
              f"({len(found.evaluated) / dt:.1f} evaluations/s); best {found.best.score:.4f} s/step ({verdict})",
              flush=True)


SERVE_REQUEST = {"model": "llama3-70b", "cluster": "dgx-h100:8", "slo_ttft": 2, "slo_tpot": 0.05}


def run_serving(args: argparse.Namespace) -> None:
    from stage_cosim import api

    print(f"\nserving search: {SERVE_REQUEST}", flush=True)
    runs = [("pruned", {})] + ([("unpruned", {"top": 10**6})] if args.serve_unpruned else [])
    found = {}
    for label, extra in runs:
        wall, cpu = time.perf_counter(), time.process_time()
        doc = api.optimize_serving({**SERVE_REQUEST, "workers": args.workers, **extra})
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        best = doc["best"]
        found[label] = (best["point"], best["goodput_requests_per_s_per_gpu"])
        print(f"{label}: {wall:.1f} s wall, {cpu:.1f} s CPU (this process); {doc['method']}, "
              f"{'proven optimal' if doc['proven_optimal'] else 'NOT proven'}: {doc['evaluations']} layouts simulated, "
              f"{doc.get('ruled_out', 0)} ruled out, of {doc['feasible']} feasible; best {describe(best['point'])} at "
              f"{best['goodput_requests_per_s_per_gpu']:.4f} requests/s per GPU", flush=True)
    if len(found) == 2:
        print("same best layout and goodput" if found["pruned"] == found["unpruned"] else
              f"DIFFERENT answers: {found}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=[*CASES, "serve-llama3-70b", "all"], default="all")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop the branch and bound this many seconds after it starts, its bounds included "
                         "(its counts so far are printed)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--budget", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=0, help="budgeted scipy searches with seeds 0 .. N-1")
    ap.add_argument("--skip-bound", action="store_true", help="no bounds, no branch and bound")
    ap.add_argument("--skip-old", action="store_true",
                    help="no bounds one configuration at a time (StepBound) beside the compiled ones")
    ap.add_argument("--exhaustive", action="store_true",
                    help="also simulate every feasible configuration (hours for llama3-70b)")
    ap.add_argument("--serve-unpruned", action="store_true",
                    help="serving case: also search every layout to its edge (about 22 minutes of CPU)")
    args = ap.parse_args()
    for name in ALL if args.case == "all" else [args.case] if args.case in CASES else []:
        run_case(name, args)
    if args.case in ("serve-llama3-70b", "all"):
        run_serving(args)


if __name__ == "__main__":
    main()
