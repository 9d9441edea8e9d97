"""Long context: synthesis and simulation time against the sequence length.

llama3-8b (32 layers) with tp 8 and sequence parallelism, context parallelism cp 8 to 64 (the
ring, Megatron's default exchange), one sequence per step, from 8K to 1M tokens. The sequence
length is a number bound into the symbolic graphs, never their size: every length of one cp
degree has the same nodes, so synthesis and simulation take the same time.

    python benchmarks/long_context.py [--cp 8 16 32 64] [--seq 8192 ... 1048576] [--repeats 3]

Each cp degree first synthesizes once untimed (the first synthesis of a sharding policy compiles
its blocks; the ring's length is part of the policy). Then, per length, the fastest of
``--repeats`` runs: wall and CPU seconds of synthesis (blocks bound to the configuration, the
stages' graphs built) and of the simulation, the nodes of a rank's graph, the step time and the
peak memory per GPU (against the H100's 80 GiB).
"""

from __future__ import annotations

import argparse
import time

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.workload import synthesize

SEQ = (8192, 32768, 131072, 524288, 1048576)
CP = (8, 16, 32, 64)
TP = 8


def timed(fn):  # noqa: ANN001, ANN201
    """(result, wall s, CPU s) of ``fn()``."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def run(model, cp: int, seq: int):  # noqa: ANN001, ANN201
    par = ParallelConfig(tp=TP, cp=cp, sp=True, seq_len=seq, micro_batch=1, global_batch=1)
    cluster = resolve_cluster("dgx-h100", par.world_size)

    def build():  # noqa: ANN202
        w = synthesize(model, par)
        _ = w.roles                  # the stages' graphs
        return w

    w, synth_wall, synth_cpu = timed(build)
    (result, _, _), sim_wall, sim_cpu = timed(lambda: simulate(w, cluster))
    return dict(nodes=w.role(0).num_nodes, synth_wall=synth_wall, synth_cpu=synth_cpu, sim_wall=sim_wall,
                sim_cpu=sim_cpu, step=result.step_time_s, mem_gib=result.peak_memory_bytes / 2**30,
                fits=result.fits_in_memory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, nargs="+", default=list(CP))
    ap.add_argument("--seq", type=int, nargs="+", default=list(SEQ))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = get_preset("llama3-8b")
    print(f"llama3-8b, tp {TP} with sp, one sequence per step, dgx-h100; fastest of {args.repeats} "
          "(wall / CPU seconds)")
    print(f"{'cp':>3} {'GPUs':>5} {'seq':>9} {'nodes/rank':>10} {'synth wall':>10} {'synth CPU':>9} "
          f"{'sim wall':>8} {'sim CPU':>7} {'step s':>9} {'peak GiB':>9}")
    for cp in args.cp:
        run(model, cp, args.seq[0])                  # compiles the policy's blocks
        for seq in args.seq:
            runs = [run(model, cp, seq) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["synth_cpu"] + r["sim_cpu"])
            print(f"{cp:>3} {TP * cp:>5} {seq:>9,} {best['nodes']:>10,} {best['synth_wall']:>10.3f} "
                  f"{best['synth_cpu']:>9.3f} {best['sim_wall']:>8.3f} {best['sim_cpu']:>7.3f} {best['step']:>9.3f} "
                  f"{best['mem_gib']:>8.1f}{'' if best['fits'] else '!'}", flush=True)
    print("! : does not fit in 80 GiB")


if __name__ == "__main__":
    main()
