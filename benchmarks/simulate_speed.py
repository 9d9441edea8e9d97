"""Simulator speed: model to result, and simulations per second with the graph already built.

    python benchmarks/simulate_speed.py [--model deepseek-v3] [--repeats 5]

"Model to result" is what ``stage-cosim simulate`` does: synthesize (the symbolic blocks, bound
to the configuration's numbers) and simulate (the stages' graphs, the replay, the result). The
first synthesis of an architecture in a process also compiles its blocks ("cold"); the warm
figures repeat it with the blocks compiled, ``--repeats`` times (fastest and median: the
machine may be shared).

    python benchmarks/simulate_speed.py --candidates 30 [--seed 0]

times the search's evaluations instead: about that many candidates of ``optimize --model
llama3-70b --cluster dgx-h100:1024 --global-batch 1024 --seq-len 8192`` (random layouts near its
optimum, each with its variants of schedule, ZeRO stage and recomputation that fit in memory,
one after the other, as branch and bound meets them). Their blocks are compiled first, as the search's
bounds compile them. It prints evaluations per second
of CPU as the search runs them (``evaluate``: pass templates, their runs and step timings kept
from one candidate to the next) and with nothing kept (a fresh synthesis and simulation each),
and checks that both give the same results.
"""

from __future__ import annotations

import statistics
import time

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.workload import synthesize

# DeepSeek-V3's training recipe: FP8 GEMMs with 1x128 activation tiles and 128x128 weight
# blocks, tokens dispatched in FP8 (combined in BF16)
DEEPSEEK_FP8 = dict(dtype="fp8", fp8_recipe="blockwise", fp8_dispatch=True)

CASES = [  # (model, dp, tp, pp, ep, global batch, seq, cluster, cp, other ParallelConfig fields)
    ("llama3-70b", 32, 8, 4, 1, 32, 4096, "dgx-h100", 1, {}),      # one micro-batch per rank
    ("llama3-70b", 32, 8, 4, 1, 1024, 4096, "dgx-h100", 1, {}),    # 32 micro-batches per rank
    # the same on tiered scale-out networks: every collective's flows placed on the links and
    # shared with the concurrent groups' (the contention model), against the one-number network
    ("llama3-70b", 32, 8, 4, 1, 1024, 4096, "dgx-h100-superpod", 1, {}),
    ("llama3-70b", 32, 8, 4, 1, 1024, 4096, "dgx-h100-rail-only", 1, {}),
    ("llama3.1-405b", 1024, 8, 16, 1, 1024, 8192, "dgx-h100", 1, {}),
    ("llama3.1-405b", 1024, 8, 16, 1, 16384, 8192, "dgx-h100", 1, {}),
    # the published DeepSeek-V3 mapping: 120 micro-batches per rank, 58 MoE layers of 256 experts;
    # in BF16, and with the FP8 recipe DeepSeek trained with
    ("deepseek-v3", 128, 1, 16, 64, 15360, 4096, "dgx-h800", 1, {}),
    ("deepseek-v3", 128, 1, 16, 64, 15360, 4096, "dgx-h800", 1, DEEPSEEK_FP8),
    # the Llama 3 paper's long-context stage: 131K tokens, cp 16 on 16,384 GPUs, K and V
    # all-gathered over cp as Llama 3 did; and with the ring (Megatron's default), whose sends,
    # receives and partial kernels make every layer's graph four times larger
    ("llama3.1-405b", 8, 8, 16, 1, 8, 131072, "dgx-h100", 16, dict(cp_comm="all-gather")),
    ("llama3.1-405b", 8, 8, 16, 1, 128, 131072, "dgx-h100", 16, dict(cp_comm="all-gather")),
    ("llama3.1-405b", 8, 8, 16, 1, 128, 131072, "dgx-h100", 16, dict(cp_comm="p2p")),
]


def model_to_result(name: str, par: ParallelConfig, cluster) -> tuple[float, float, object, object]:  # noqa: ANN001
    """(synthesize s, simulate s, workload, result)."""
    t0 = time.perf_counter()
    w = synthesize(get_preset(name), par)
    t1 = time.perf_counter()
    result, _, _ = simulate(w, cluster)
    return t1 - t0, time.perf_counter() - t1, w, result


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="only this model's cases")
    ap.add_argument("--cases", type=int, default=None, help="only the first N cases")
    ap.add_argument("--repeats", type=int, default=5, help="warm model-to-result runs per case")
    ap.add_argument("--candidates", type=int, default=0,
                    help="time about this many search candidates instead of the cases")
    ap.add_argument("--seed", type=int, default=0, help="which candidates (--candidates)")
    args = ap.parse_args()
    if args.candidates:
        search_candidates(args.candidates, args.seed)
        return
    print("cold: the first model-to-result of the architecture in this process (synthesis compiles its blocks); "
          "warm: again with the blocks compiled (fastest / median of the repeats)")
    print(f"{'model':<14} {'cluster':<18} {'dtype':<13} {'GPUs':>7} {'dp':>5} {'tp':>3} {'cp (exchange)':>15} {'pp':>3} {'ep':>3} {'seq':>7} "
          f"{'mb/rank':>7} {'cold synth':>10} {'cold sim':>8} {'cold total':>10} {'warm synth':>10} {'warm sim':>8} "
          f"{'warm total':>10} {'warm median':>11} {'sims/s (graph built)':>21} {'step s':>8} {'MFU':>6}")
    for name, dp, tp, pp, ep, gb, seq, cluster_name, cp, extra in CASES[:args.cases]:
        if args.model and name != args.model:
            continue
        par = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, global_batch=gb, seq_len=seq, sp=tp > 1, zero=1,
                             **extra)
        cluster = resolve_cluster(cluster_name, par.world_size)
        cold_synth, cold_sim, w, result = model_to_result(name, par, cluster)
        warm = [model_to_result(name, par, cluster)[:2] for _ in range(args.repeats)]
        fastest = min(warm, key=sum)
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 2.0:
            simulate(w, cluster)
            n += 1
        rate = n / (time.perf_counter() - t)
        dtype = par.dtype if par.dtype == "bf16" else f"{par.dtype}-{par.fp8_recipe}"
        cp_text = f"{cp} ({par.cp_comm})" if cp > 1 else "1"
        print(f"{name:<14} {cluster_name:<18} {dtype:<13} {par.world_size:>7} {dp:>5} {tp:>3} {cp_text:>15} {pp:>3} {ep:>3} {seq:>7} "
              f"{par.num_microbatches:>7} {cold_synth:>10.3f} {cold_sim:>8.3f} {cold_synth + cold_sim:>10.3f} "
              f"{fastest[0]:>10.3f} {fastest[1]:>8.3f} {sum(fastest):>10.3f} "
              f"{statistics.median(sum(x) for x in warm):>11.3f} {rate:>21.1f} {result.step_time_s:>8.3f} "
              f"{100 * result.mfu:>5.1f}%", flush=True)


def candidates(n: int, seed: int) -> tuple:
    """(model, cluster, about ``n`` configurations): random layouts near the optimum (tp 4 or 8,
    pp up to 4, cp up to 2, micro-batch up to 4, the rest of the default space's dimensions but
    the schedule, ZeRO and recomputation drawn at random), each followed by its variants
    (every schedule, ZeRO 1-3, recomputation off or selective) that fit in memory: branch and
    bound meets a layout's variants together, their bounds being close or equal."""
    import itertools
    import random

    from stage_cosim.search.memory import fits
    from stage_cosim.search.space import canonical, check, default_space
    from stage_cosim.workload import precision_for, training_blocks

    model, cluster = get_preset("llama3-70b"), resolve_cluster("dgx-h100", 1024)
    space = default_space(model, cluster, 1024, 8192)
    near = {"tp": (4, 8), "pp": (1, 2, 4), "cp": (1, 2), "micro_batch": (1, 2, 4)}
    dims = {d.name: near.get(d.name, d.choices) for d in space.dimensions}
    variants = [dict(zip(("schedule", "zero", "recompute"), v))
                for v in itertools.product(dims["schedule"], (1, 2, 3), ("none", "selective"))]
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        layout = {name: rng.choice(choices) for name, choices in dims.items()}
        for v in variants:
            par, _ = check(space, canonical(space, {**layout, **v}), cluster)
            if par is None or par in seen:
                continue
            seen.add(par)
            precision = precision_for(par, cluster.gpu)
            blocks = training_blocks(model, par, precision)        # (compiled here, as the bounds do)
            if fits(model, cluster, par, blocks, precision):
                out.append(par)
    return model, cluster, out


def search_candidates(n: int, seed: int) -> None:
    from stage_cosim.search import evaluate as evaluate_mod
    from stage_cosim.search.evaluate import Objective, evaluate
    from stage_cosim.workload import precision_for

    model, cluster, pars = candidates(n, seed)
    node_level = sum(p.zero >= 3 and p.pp > 1 for p in pars)
    print(f"{len(pars)} evaluations of llama3-70b on 1,024 H100 (gbs 1024, seq 8192): {node_level} replayed node by "
          f"node (ZeRO-3 with a pipeline), {len(pars) - node_level} on the pass-level fast path")

    def fresh(par):  # noqa: ANN001, ANN202
        w = synthesize(model, par, precision=precision_for(par, cluster.gpu))
        return simulate(w, cluster)[0].to_dict()

    results = {}
    for label, run in (("as the search runs them (kept from candidate to candidate)",
                        lambda p: evaluate(model, cluster, p, {}, Objective()).result),
                       ("with nothing kept (a fresh synthesis and simulation each)", fresh)):
        evaluate_mod._workload.cache_clear()
        t = time.process_time()
        results[label] = [run(p) for p in pars]
        cpu = time.process_time() - t
        print(f"  {label}: {cpu:.1f} s of CPU, {len(pars) / cpu:.2f} evaluations/s", flush=True)
    a, b = results.values()
    same = sum(x == y for x, y in zip(a, b))
    print(f"  results equal: {same} of {len(pars)}")


if __name__ == "__main__":
    main()
