"""Synthesis speed and memory at scale: llama3-70b (80 layers, seq 4096, micro-batch 1), tp8 pp16;
deepseek-v3 (61 layers, 58 with 256 experts, seq 4096, micro-batch 1), pp16 ep64; llama3.1-405b
at 131,072 tokens with context parallelism (tp8 cp16 pp16 on 16,384 GPUs, the Llama 3 paper's
long-context configuration: K and V all-gathered over cp, as Llama 3 did; and with the ring,
Megatron's default, whose sends, receives and partial kernels make each layer four times the
nodes).

Each case runs in its own process (so peak RSS is that case's) and writes real Chakra files
into a temporary directory, which is deleted afterwards. Writing is timed on the wall clock and in
CPU seconds (user and system: serializing, and the kernel's side of creating and writing the
files), which a shared machine or a busy disk inflates less.

    python benchmarks/synth_scale.py            # all cases
    python benchmarks/synth_scale.py --ranks 8192
    python benchmarks/synth_scale.py --model deepseek-v3
    python benchmarks/synth_scale.py --model llama3.1-405b
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [  # (model, ranks, global batch[, cp exchange]): one micro-batch per data-parallel rank unless stated
    ("llama3-70b", 1024, None),
    ("llama3-70b", 8192, None),
    ("llama3-70b", 131072, None),
    ("llama3-70b", 8192, 2048),
    ("deepseek-v3", 2048, None),
    ("deepseek-v3", 16384, None),
    ("llama3.1-405b", 16384, None, "all-gather"),
    ("llama3.1-405b", 16384, None, "p2p"),
]
LAYOUT = {"llama3-70b": dict(tp=8, pp=16, ep=1), "deepseek-v3": dict(tp=1, pp=16, ep=64),
          "llama3.1-405b": dict(tp=8, cp=16, pp=16, ep=1)}
SEQ = {"llama3.1-405b": 131072}          # the others: 4096


def run_case(model: str, ranks: int, global_batch: int | None, workdir: Path, cp_comm: str = "p2p") -> dict:
    from stage_cosim.model import get_preset
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.trace.writer import atomic_directory, write_traces
    from stage_cosim.workload import synthesize

    layout = LAYOUT[model]
    dp = ranks // (layout["tp"] * layout.get("cp", 1) * layout["pp"])
    par = ParallelConfig(dp=dp, **layout, micro_batch=1, global_batch=global_batch or dp,
                         seq_len=SEQ.get(model, 4096), cp_comm=cp_comm)
    t0 = time.perf_counter()
    w = synthesize(get_preset(model), par)
    roles = w.roles
    t1, c1 = time.perf_counter(), time.process_time()
    with atomic_directory(workdir / "out", force=True) as d:
        stats = write_traces(w, d)
    t2, c2 = time.perf_counter(), time.process_time()
    return {"model": model + (f" ({cp_comm})" if par.cp > 1 else ""), "ranks": ranks, "global_batch": par.global_batch, "micro_batches": par.num_microbatches,
            "nodes_per_rank": sum(len(r.nodes) for r in roles) // len(roles),
            "synthesis_s": t1 - t0, "write_s": t2 - t1, "total_s": t2 - t0, "write_cpu_s": c2 - c1,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "bytes_written": stats.bytes_written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=None, help="run only cases with this many ranks")
    ap.add_argument("--model", choices=sorted(LAYOUT), default=None, help="run only this model's cases")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, ranks, gb, cp_comm = args.child[0], int(args.child[1]), int(args.child[2]), args.child[3]
        with tempfile.TemporaryDirectory(prefix="synth-scale-") as tmp:
            print(json.dumps(run_case(model, ranks, gb or None, Path(tmp), cp_comm)))
        return
    print("llama3-70b tp8 pp16; deepseek-v3 tp1 pp16 ep64; seq 4096; llama3.1-405b tp8 cp16 pp16, seq 131072; "
          "micro-batch 1; Chakra files written to a temporary directory")
    print(f"{'model':<26} {'ranks':>7} {'global batch':>12} {'mb/rank':>7} {'nodes/rank':>10} {'synth s':>8} {'write s':>8} "
          f"{'total s':>8} {'ranks/s':>9} {'µs/rank':>8} {'write µs/rank':>13} {'write CPU µs/rank':>17} {'peak RSS MB':>11} "
          f"{'GB written':>10}")
    for model, ranks, gb, *exchange in CASES:
        if (args.ranks and ranks != args.ranks) or (args.model and model != args.model):
            continue
        out = subprocess.run([sys.executable, __file__, "--child", model, str(ranks), str(gb or 0),
                              (exchange or ["p2p"])[0]], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['model']:<26} {r['ranks']:>7} {r['global_batch']:>12} {r['micro_batches']:>7} {r['nodes_per_rank']:>10} "
              f"{r['synthesis_s']:>8.2f} {r['write_s']:>8.2f} {r['total_s']:>8.2f} {r['ranks'] / r['total_s']:>9.0f} "
              f"{1e6 * r['total_s'] / r['ranks']:>8.1f} {1e6 * r['write_s'] / r['ranks']:>13.1f} "
              f"{1e6 * r['write_cpu_s'] / r['ranks']:>17.1f} "
              f"{r['peak_rss_mb']:>11.0f} {r['bytes_written'] / 1e9:>10.2f}",
              flush=True)
    shutil.rmtree(Path(tempfile.gettempdir()) / "synth-scale-none", ignore_errors=True)


if __name__ == "__main__":
    main()
