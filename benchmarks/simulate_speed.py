"""Simulator speed: model to result, and simulations per second with the graph already built.

    python benchmarks/simulate_speed.py [--model deepseek-v3] [--repeats 5]

"Model to result" is what ``stage-cosim simulate`` does: synthesize (the symbolic blocks, bound
to the configuration's numbers) and simulate (the stages' graphs, the replay, the result). The
first synthesis of an architecture in a process also compiles its blocks ("cold"); the warm
figures repeat it with the blocks compiled, ``--repeats`` times (fastest and median: the
machine may be shared).
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
