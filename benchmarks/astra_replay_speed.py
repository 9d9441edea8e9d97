"""Speed of the exact ASTRA-sim replay against the real binary, on the same export.

    python benchmarks/astra_replay_speed.py [--model llama3-8b] [--gpus 64] [--tp 4] [--pp 4]
                                            [--global-batch 64] [--seq-len 4096] [--repeat 3]

Exports the workload (a 64-rank, 32-layer Llama-3-8B step by default: tp 4, pp 4, dp 4, 16
micro-batches per rank), then times, best of ``--repeat``:

* ``stage-cosim astra-sim replay`` on the export, as a process from the shell (what a user's
  script would run instead of the binary: start-up, reading and checking every rank's file,
  the replay, the output);
* the same inside Python (reading, checking, replaying), with one rank per class of equal
  traces, and with every rank replayed (``--full``);
* the symmetric path: ``simulate --network-model astra`` from the synthesized workload (one rank
  per pipeline stage; the workload already built, as in a search loop), and with synthesis;
* the binary on the same files, when ``ASTRA_SIM_BIN`` is set (its figures are checked equal to
  the replay's, rank by rank).

    python benchmarks/astra_replay_speed.py --splits 1024,4096 [--splits-ranks 4]

instead times one 1 MiB all-reduce over a Switch of ``--splits-ranks`` ranks at each
preferred-dataset-splits value, in the replay (CPU µs per split and rank, and the peak memory
Python allocated) and in the binary when ``ASTRA_SIM_BIN`` is set: what the bound on the
splits (``MAX_DATASET_SPLITS``) rests on.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")


def _cpu() -> float:
    """CPU seconds of this process and its finished children (less sensitive than wall time to
    other work on a shared machine)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def best(fn, repeat: int) -> tuple[tuple[float, float], object]:  # noqa: ANN001
    """(best wall seconds, best CPU seconds) over ``repeat`` runs, and the last result."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), _cpu()
        out = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(_cpu() - c)
    return (min(walls), min(cpus)), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--splits", default=None, help="comma-separated preferred-dataset-splits values to time")
    ap.add_argument("--splits-ranks", type=int, default=4)
    args = ap.parse_args()
    if args.splits:
        splits_cost([int(x) for x in args.splits.split(",")], args.splits_ranks)
        return

    from stage_cosim.adapters.astra_sim.export import export
    from stage_cosim.adapters.astra_sim.analytical import replay_files, replay_workload
    from stage_cosim.adapters.astra_sim.simulate import astra_system
    from stage_cosim.adapters.simulate import simulate
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.model import resolve_model
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.workload import synthesize

    dp = args.gpus // (args.tp * args.pp)
    model = resolve_model(args.model)
    par = ParallelConfig(tp=args.tp, pp=args.pp, dp=dp, global_batch=args.global_batch, seq_len=args.seq_len)
    cluster = resolve_cluster(f"dgx-h100:{args.gpus}")
    w = synthesize(model, par)
    tmp = Path(tempfile.mkdtemp(prefix="astra-speed-"))
    run = tmp / "run"
    export(w, cluster, run)
    nodes = sum(w.role(w.role_of(r)).num_nodes for r in range(w.world_size))
    print(f"{model.name}: {w.world_size} ranks (tp{args.tp} pp{args.pp} dp{dp}), {model.layers} layers, "
          f"{par.num_microbatches} micro-batches per rank, {nodes:,} nodes in all; export in {run}")

    flags = [f"--workload-configuration={run}/traces/workload", f"--system-configuration={run}/system.json",
             f"--network-configuration={run}/network.yml", f"--remote-memory-configuration={run}/memory.json",
             f"--comm-group-configuration={run}/comm_groups.json"]
    exe = [sys.executable, "-m", "stage_cosim", "astra-sim", "replay", *flags]

    def cli() -> str:
        return subprocess.run(exe, check=True, capture_output=True, text=True).stdout

    def in_process(symmetric: bool):  # noqa: ANN202
        def go():  # noqa: ANN202
            done, _ = replay_files(f"{run}/traces/workload", run / "system.json", run / "network.yml",
                                   run / "memory.json", run / "comm_groups.json", symmetric=symmetric)
            return done
        return go

    system = astra_system(cluster)
    rows = []
    t_cli, text = best(cli, args.repeat)
    ours = {int(m[1]): (int(m[2]), int(m[3])) for m in FINISHED.finditer(text)}
    rows.append(("astra-sim replay, from the shell", t_cli))
    t_sym, done = best(in_process(True), args.repeat)
    rows.append((f"in Python, one rank per class ({len(done.agents)} replayed)", t_sym))
    t_full, full = best(in_process(False), 1)
    rows.append((f"in Python, every rank ({len(full.agents)} replayed)", t_full))
    assert full.result().finished_ns == done.result().finished_ns
    t_wl, rep = best(lambda: replay_workload(w, cluster, system), args.repeat)
    rows.append(("symmetric path: the workload's replay (built workload)", t_wl))
    assert rep.result().finished_ns == done.result().finished_ns
    t_sim, _ = best(lambda: simulate(synthesize(model, par), cluster, "astra"), args.repeat)
    rows.append(("symmetric path: simulate --network-model astra (with synthesis)", t_sim))

    binary = os.environ.get("ASTRA_SIM_BIN")
    t_bin = None
    if binary:
        def real() -> str:
            return subprocess.run([binary, *flags, f"--logging-folder={tmp}/log"], check=True, capture_output=True,
                                  text=True, cwd=tmp).stdout
        t_bin, text = best(real, max(1, min(args.repeat, 2)))
        theirs = {int(m[1]): (int(m[2]), int(m[3])) for m in FINISHED.finditer(text)}
        same = theirs == ours
        rows.append((f"ASTRA-sim binary ({'same figures, every rank' if same else 'FIGURES DIFFER'})", t_bin))
        if not same:
            print("the binary and the replay disagree", file=sys.stderr)

    print(f"step: {max(t for t, _ in ours.values()):,} cycles; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'':66} {'wall s':>8} {'x binary':>9} {'CPU s':>8} {'x binary':>9}")
    for name, (wall, cpu) in rows:
        rw = f"{t_bin[0] / wall:.1f}x" if t_bin else "-"
        rc = f"{t_bin[1] / cpu:.1f}x" if t_bin else "-"
        print(f"{name:66} {wall:>8.3f} {rw:>9} {cpu:>8.3f} {rc:>9}")


def splits_cost(values: list[int], n: int) -> None:
    """One 1 MiB all-reduce on n ranks at each split count: the replay's cost per split and rank."""
    import json
    import tracemalloc

    from stage_cosim.adapters.astra_sim.config_files import write_memory_json, write_network_yml, write_system_json
    from stage_cosim.adapters.astra_sim import astra_collectives, astra_system
    from stage_cosim.adapters.astra_sim.astra_collectives import CollectiveModel
    from stage_cosim.adapters.astra_sim.astra_network import Network
    from stage_cosim.adapters.astra_sim.astra_system import COLLECTIVES, AstraSystem

    from stage_cosim.hardware.network import NetworkDim
    from stage_cosim.trace.chakra import TraceNode, write_trace_file

    bounds = astra_system.MAX_DATASET_SPLITS, astra_system.MAX_CHUNK_COPIES
    # time values beyond the bounds too (each bound where it is read: AstraSystem checks the
    # splits, CollectiveModel the chunk copies)
    astra_system.MAX_DATASET_SPLITS = max(values + [bounds[0]])
    astra_collectives.MAX_CHUNK_COPIES = max(bounds[1], max(values) * n)
    dims = [NetworkDim("Switch", n, 50, 500)]
    binary = os.environ.get("ASTRA_SIM_BIN")
    print(f"one 1 MiB ALL_REDUCE on {n} ranks (bounds: {bounds[0]} splits, {bounds[1]:,} chunk copies); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'splits':>8} {'replay CPU s':>13} {'us/split/rank':>14} {'peak MiB':>9} {'binary CPU s':>13}")
    for splits in values:
        system = AstraSystem(preferred_dataset_splits=splits, implementations={c: ("ring",) for c in COLLECTIVES},
                             local_mem_bw_GBps=1600.0)
        c = _cpu()
        CollectiveModel(Network(dims), system).finish_times("ALL_REDUCE", 1 << 20, None, [0] * n)
        cpu = _cpu() - c
        tracemalloc.start()
        CollectiveModel(Network(dims), system).finish_times("ALL_REDUCE", 1 << 20, None, [0] * n)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        t_bin = "-"
        if binary:
            d = Path(tempfile.mkdtemp(prefix="astra-splits-"))
            (d / "traces").mkdir()
            for r in range(n):
                write_trace_file(d / "traces" / f"workload.{r}.et", [TraceNode(
                    0, "ar", 7, [], [], 0, {"is_cpu_op": False, "comm_type": 0, "comm_size": 1 << 20},
                    {"is_cpu_op": "bool_val", "comm_type": "uint64_val", "comm_size": "uint64_val"})])
            write_system_json(system, d / "system.json")
            write_network_yml(dims, d / "network.yml")
            write_memory_json(d / "memory.json")
            (d / "groups.json").write_text(json.dumps({}))
            c = _cpu()
            subprocess.run([binary, f"--workload-configuration={d}/traces/workload",
                            f"--system-configuration={d}/system.json", f"--network-configuration={d}/network.yml",
                            f"--remote-memory-configuration={d}/memory.json",
                            f"--comm-group-configuration={d}/groups.json"], check=True, capture_output=True, cwd=d)
            t_bin = f"{_cpu() - c:.2f}"
        print(f"{splits:>8} {cpu:>13.2f} {cpu / (splits * n) * 1e6:>14.1f} {peak:>9.1f} {t_bin:>13}")


if __name__ == "__main__":
    main()
