"""The network model against ASTRA-sim's congestion-aware analytical backend.

    ASTRA_SIM_CONGESTION_AWARE_BIN=/path/to/AstraSim_Analytical_Congestion_Aware \\
        python benchmarks/validate_network.py [--quick]

Runs the same collectives three ways on the one-dimensional topologies that backend accepts
(Switch, Ring, FullyConnected): the congestion-aware binary; ASTRA-sim's congestion-unaware
backend (our exact reproduction of it, no binary needed); and the calibrated model, with its
contention model, on the equivalent cluster (``cluster_doc`` in
``adapters/astra_sim/congestion_aware.py``: one NPU per domain, the link's bandwidth and a
neighbour message's latency, efficiencies of 1). Then groups running collectives at the same
time, alone and together, and what max-min sharing on the binary's own links predicts.

Prints one line per case: the three times and the ratios to the binary. Without the binary it
says so and exits 0.

    python benchmarks/validate_network.py --rail-only

needs no binary: rail-only against the rail-optimized SuperPOD (the presets dgx-h100-rail-only
and dgx-h100-superpod), the comparison of Wang et al., "How to Build Low-cost Networks for Large
Language Models (without Sacrificing Performance)": each design's switches and links, an
all-to-all's busbw, and the step time of a GPT-1T-class model (Megatron's 1T configuration:
128 layers, hidden 25,600, 160 heads, tp 8, pp 64 on 3,072 GPUs) and of an MoE model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from stage_cosim.adapters.astra_sim.congestion_aware import (BINARY_ENV, Case, aware_time_s, cluster,
                                                              max_min_slowdown, max_min_time_s, ours_time_s,
                                                              unaware_time_s)
from stage_cosim.adapters.roofline import collectives as co
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.hardware.cluster import resolve_cluster
from stage_cosim.hardware.fabric import count

TOPOLOGIES = ("Switch", "Ring", "FullyConnected")
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
SIZES = (1 << 20, 1 << 26, 1 << 30)
NPUS = (8, 16, 64)


def _size(b: int) -> str:
    return f"{b >> 30} GiB" if b >= 1 << 30 else f"{b >> 20} MiB"


def single_cases(quick: bool) -> list[Case]:
    npus, sizes = ((8, 64), (1 << 20, 1 << 30)) if quick else (NPUS, SIZES)
    return [Case(t, n, op, s) for t in TOPOLOGIES for n in npus for op in OPS for s in sizes]


def concurrent_cases() -> list[tuple[str, Case, Case]]:
    """(what, the groups together, the first group alone) for two all-reduces of 64 MiB."""
    out = []
    for topology in ("Switch", "Ring"):
        for n in (16, 64):
            for name, groups in (("interleaved", (tuple(range(0, n, 2)), tuple(range(1, n, 2)))),
                                 ("halves", (tuple(range(n // 2)), tuple(range(n // 2, n))))):
                together = Case(topology, n, "all-reduce", 1 << 26, groups)
                alone = Case(topology, n, "all-reduce", 1 << 26, groups[:1])
                out.append((f"{topology} {n}, two {name} groups", together, alone))
    return out


RAIL_OPTIMIZED, RAIL_ONLY = "dgx-h100-superpod", "dgx-h100-rail-only"
# simulate's flags for the step-time comparison, each run on both presets
STEPS = {
    "GPT-1T-class, tp 8 pp 64, 3,072 GPUs": (3072, [
        "--model", "gpt3-175b", "--layers", "128", "--hidden", "25600", "--heads", "160", "--kv-heads", "160",
        "--ffn", "102400", "--tp", "8", "--pp", "64", "--global-batch", "3072", "--seq-len", "2048",
        "--recompute", "full"]),
    "qwen3-30b-a3b, ep 64, 256 GPUs": (256, [
        "--model", "qwen3-30b-a3b", "--ep", "64", "--global-batch", "512", "--seq-len", "4096",
        "--use-distributed-optimizer"]),
}


def _tiers(counts: tuple[int, ...]) -> str:
    return " + ".join(f"{c:,}" for c in counts)


def rail_only() -> None:
    print("Switches and links per tier, leaf first, of each scale-out network (DGX H100 nodes, one NIC per GPU; "
          "counted by hardware/fabric.py)")
    print(f"{'radix':>5}{'GPUs':>7}  {'switches: rail-optimized':>25}{'rail-only':>20}  {'links: rail-optimized':>26}"
          f"{'rail-only':>26}  {'fewer switches':>14}{'fewer links':>12}")
    for radix in (64, 128):
        for n in (1024, 3072, 4096, 16384, 32768):
            a, b = (resolve_cluster(name, n) for name in (RAIL_OPTIMIZED, RAIL_ONLY))
            a, b = (count(replace(c, scale_out=replace(c.scale_out, switch_radix=radix))) for c in (a, b))
            print(f"{radix:>5}{n:>7}  {_tiers(a.switches):>25}{_tiers(b.switches):>20}  {_tiers(a.links):>26}"
                  f"{_tiers(b.links):>26}  {1 - sum(b.switches) / sum(a.switches):>14.0%}"
                  f"{1 - sum(b.links) / sum(a.links):>12.0%}")
    print()
    print("All-to-all busbw (GB/s), stage-cosim collective --op all-to-all")
    print(f"{'GPUs':>6}{'size':>8}{'rail-optimized':>16}{'rail-only':>11}{'ratio':>7}")
    for n in (64, 256, 1024, 4096):
        for size in (1 << 20, 1 << 30):
            a, b = (co.nccl_tests(co.cluster_for(f"{name}:{n}", n), "all-to-all", n, [size])["results"][0]["busbw_GBps"]
                    for name in (RAIL_OPTIMIZED, RAIL_ONLY))
            print(f"{n:>6}{_size(size):>8}{a:>16.2f}{b:>11.2f}{b / a:>7.3f}")
    print()
    print("Training step (s), stage-cosim simulate")
    print(f"{'model':<40}{'rail-optimized':>16}{'rail-only':>11}{'ratio':>7}")
    for what, (n, flags) in STEPS.items():
        times = []
        for name in (RAIL_OPTIMIZED, RAIL_ONLY):
            out = subprocess.run([sys.executable, "-m", "stage_cosim", "simulate", *flags, "--cluster", f"{name}:{n}",
                                  "--json"], check=True, capture_output=True, text=True).stdout
            times.append(json.loads(out)["step_time_s"])
        print(f"{what:<40}{times[0]:>16.3f}{times[1]:>11.3f}{times[1] / times[0]:>7.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 NPUs, 1 MiB and 1 GiB only")
    parser.add_argument("--rail-only", action="store_true",
                        help="instead: rail-only against rail-optimized (no binary needed)")
    args = parser.parse_args()
    if args.rail_only:
        rail_only()
        return 0
    binary = os.environ.get(BINARY_ENV)
    if not binary:
        print(f"{BINARY_ENV} is not set: point it at ASTRA-sim's AstraSim_Analytical_Congestion_Aware binary "
              f"to run this comparison (nothing to compare without it)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("One collective on every NPU; times in ms; ratio = time / the congestion-aware binary's; max-min = ours "
              "at its bandwidth times the max-min slowdown on the binary's links")
        print(f"{'topology':<15}{'npus':>5}  {'op':<15}{'size':>8}  {'aware':>10}{'unaware':>10}{'ours':>10}"
              f"{'max-min':>10}  {'unaware/aware':>13}{'ours/aware':>11}{'max-min/aware':>14}")
        for i, case in enumerate(single_cases(args.quick)):
            aware = aware_time_s(binary, case, root / f"single{i}")
            unaware, ours, fluid = unaware_time_s(case), ours_time_s(case), max_min_time_s(case)
            print(f"{case.topology:<15}{case.npus:>5}  {case.op:<15}{_size(case.size):>8}  {aware * 1e3:>10.4f}"
                  f"{unaware * 1e3:>10.4f}{ours * 1e3:>10.4f}{fluid * 1e3:>10.4f}  {unaware / aware:>13.3f}"
                  f"{ours / aware:>11.3f}{fluid / aware:>14.3f}")
        print()
        print("Two groups' 64 MiB ring all-reduces at once: times in ms; max-min = ours at the slowest flow's "
              "max-min rate on the binary's links")
        print(f"{'case':<34}{'aware alone':>12}{'aware':>8}{'unaware':>9}{'ours':>8}{'max-min':>9}{'slow':>6}"
              f"  {'ours/aware':>10}{'max-min/aware':>14}")
        for i, (what, together, alone) in enumerate(concurrent_cases()):
            solo = aware_time_s(binary, alone, root / f"a{i}")
            aware = aware_time_s(binary, together, root / f"t{i}")
            ours, fluid = ours_time_s(together), max_min_time_s(together)
            print(f"{what:<34}{solo * 1e3:>12.3f}{aware * 1e3:>8.3f}{unaware_time_s(together) * 1e3:>9.3f}"
                  f"{ours * 1e3:>8.3f}{fluid * 1e3:>9.3f}{max_min_slowdown(together):>6.2f}  {ours / aware:>10.3f}"
                  f"{fluid / aware:>14.3f}")
        # the same switch as a one-leaf fat-tree: what the flow-level contention model says of it
        together = concurrent_cases()[0][1]
        network = CalibratedNetwork(cluster(together, "fat-tree"), concurrent=True)
        print(f"\nOne-leaf fat-tree of {together.npus}, the two interleaved groups' rings at once: contention slowdown "
              f"{network.contention.slowdown('ring', together.groups[0]):.3f} (1: only the NICs limit them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
