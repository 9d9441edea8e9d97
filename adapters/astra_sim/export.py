"""Export a self-contained ASTRA-sim run directory.

    DIR/traces/workload.<rank>.et   Chakra traces (duration_micros filled in replay mode)
    DIR/comm_groups.json            communicator groups (pg_name -> ranks)
    DIR/system.json                 collectives per network dimension, splits, scheduling, roofline
    DIR/network.yml                 one entry per network dimension of the cluster
    DIR/memory.json                 no remote memory
    DIR/run.sh                      runs $ASTRA_SIM_BIN (or the binary given) with the right flags
    DIR/manifest.json               what was exported and how

Compute time has two modes. ``replay``: each compute node's ``duration_micros`` comes from our
GPU model. The simulator counts whole microseconds, so durations are rounded with the error
carried from node to node in each rank's compute order: a chain of short kernels keeps its
total to within 1 µs instead of losing up to 1 µs per kernel (a 3 µs norm would otherwise be off
by up to 17 %, and 0 would become 1 ns). ``roofline``: the simulator computes each node from
``num_ops`` and ``tensor_size`` with ``peak-perf`` and ``local-mem-bw`` from the GPU (peak times
the calibrated efficiencies).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stage_cosim.adapters.astra_sim.config_files import write_memory_json, write_network_yml, write_system_json
from stage_cosim.adapters.astra_sim.durations import replay_durations
from stage_cosim.adapters.astra_sim.layout import (  # noqa: F401 (part of this module's interface)
    BINARY_ENV, COMPUTE_MODES, DEFAULT_BINARY, RUN_SH, TRACE_DIR, TRACE_PREFIX, command,
)
from stage_cosim.adapters.astra_sim.astra_system import COLLECTIVES, AstraSystem
from stage_cosim.adapters.roofline.kernels import step_compute_model
from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster, check_fits
from stage_cosim.schedule.nodes import COMP
from stage_cosim.trace.writer import GROUPS_FILE, atomic_directory, write_traces
from stage_cosim.workload import Workload

@dataclass(frozen=True)
class AstraSettings:
    """The system.json choices (ASTRA-sim's own defaults where it has them)."""

    implementation: str = "ring"          # per network dimension, for every collective
    preferred_dataset_splits: int = 4
    active_chunks_per_dimension: int = 1
    collective_optimization: str = "baseline"
    scheduling_policy: str = "LIFO"
    endpoint_delay_ns: int = 10
    # the fields a user set explicitly (command-line flags given), which override a run
    # directory's own system.json when its traces are simulated; "compute" for --compute
    given: frozenset[str] = field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        if self.endpoint_delay_ns < 1:
            raise UserError("endpoint-delay", "must be at least 1 ns (0 trips an assertion in the simulator)")


def apply_settings(system: AstraSystem, cluster: Cluster, mode: str, settings: AstraSettings,
                   n_dims: int) -> AstraSystem:
    """A system file's configuration with the explicitly given settings (``settings.given``) put
    over it: what ``simulate --traces RUN --network-model astra`` runs when flags are given."""
    given = settings.given
    base = system_for(cluster, mode, settings)
    changes: dict[str, Any] = {f: getattr(settings, f) for f in ("preferred_dataset_splits",
                                                                  "active_chunks_per_dimension",
                                                                  "collective_optimization") if f in given}
    if "implementation" in given:
        changes["implementations"] = {c: (settings.implementation,) * n_dims for c in COLLECTIVES}
    if "compute" in given:
        changes["roofline_enabled"] = mode == "roofline"
        if mode == "roofline":
            changes["peak_perf_TFLOPS"] = system.peak_perf_TFLOPS or base.peak_perf_TFLOPS
            changes["local_mem_bw_GBps"] = system.local_mem_bw_GBps or base.local_mem_bw_GBps
    return replace(system, **changes) if changes else system


def system_for(cluster: Cluster, mode: str, settings: AstraSettings) -> AstraSystem:
    dims = len(cluster.network_dims())
    gpu = cluster.gpu
    # every collective gets its list (one entry per dimension): the simulator never completes a
    # collective without one, and unused entries cost nothing
    impl = {c: (settings.implementation,) * dims for c in COLLECTIVES}
    roofline = mode == "roofline"
    return AstraSystem(
        scheduling_policy=settings.scheduling_policy, collective_optimization=settings.collective_optimization,
        endpoint_delay_ns=settings.endpoint_delay_ns,
        active_chunks_per_dimension=settings.active_chunks_per_dimension,
        preferred_dataset_splits=settings.preferred_dataset_splits, implementations=impl,
        # local-mem-bw is also the cost of reductions (so it is written in both modes)
        local_mem_bw_GBps=round(gpu.hbm_GBps * gpu.memory_efficiency, 3),
        peak_perf_TFLOPS=round(gpu.bf16_tflops * gpu.matmul_efficiency, 3) if roofline else None,
        roofline_enabled=roofline)


def check_compute_mode(w: Workload, mode: str) -> None:
    """The simulator's own roofline has one peak (BF16's): it cannot time FP8 GEMMs."""
    if mode == "roofline" and w.precision.fp8:
        raise UserError("compute", "roofline mode gives the simulator one peak (BF16); FP8 GEMMs run at "
                                   "another: use --compute replay")


def export(w: Workload, cluster: Cluster, out: Path, *, mode: str = "replay",
           settings: AstraSettings | None = None, force: bool = False) -> dict[str, Any]:
    """Write the run directory (atomically); returns its manifest."""
    if mode not in COMPUTE_MODES:
        raise UserError("compute", f"must be one of {', '.join(COMPUTE_MODES)}, got {mode!r}")
    settings = settings or AstraSettings()
    check_fits(cluster, w.mesh, w.meshes.get("expert"))
    w.check_gpu(cluster.gpu)
    check_compute_mode(w, mode)
    dims = cluster.network_dims()
    system = system_for(cluster, mode, settings)
    warnings = check_runs(w, cluster, system)
    compute = step_compute_model(cluster.gpu, w.inference is not None, w.parallel.software)   # an inference step: the measured GEMMs
    with atomic_directory(out, force) as d:
        (d / TRACE_DIR).mkdir()
        stats = write_traces(w, d / TRACE_DIR, "chakra", durations=replay_durations(compute) if mode == "replay" else None,
                             prefix=TRACE_PREFIX)
        os.replace(d / TRACE_DIR / GROUPS_FILE, d / GROUPS_FILE)
        write_system_json(system, d / "system.json")
        write_network_yml(dims, d / "network.yml")
        write_memory_json(d / "memory.json")
        run_sh = d / "run.sh"
        run_sh.write_text(RUN_SH.format(default=DEFAULT_BINARY, env=BINARY_ENV, traces=TRACE_DIR,
                                        prefix=TRACE_PREFIX, groups=GROUPS_FILE, ranks=w.world_size))
        run_sh.chmod(run_sh.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        manifest = {
            "generator": "stage-cosim astra-sim export",
            "compute": mode,
            "ranks": w.world_size,
            "trace_bytes": stats.bytes_written,
            "network_dims": [d_.__dict__ for d_ in dims],
            "model": w.model.to_dict(),
            "parallel": w.parallel.to_dict(),
            "mesh": {"order": list(w.mesh.order), "degrees": dict(w.mesh.degrees)},
            "communicator_groups": w.group_counts(),
            "cluster": cluster.to_dict(),
            "stages": [{"stage": s, "peak_memory_bytes": w.memory(s, cluster).to_dict()} for s in range(w.parallel.pp)],
            "model_flops_per_step": w.total_model_flops(),
            "executed_flops_per_step": w.total_executed_flops(),
        }
        if warnings:
            manifest["warnings"] = warnings
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_runs(w: Workload, cluster: Cluster, system: AstraSystem) -> list[str]:
    """Refuse what the simulator would hang or abort on (astra-sim-cost-model.md §9) — messages
    of zero bytes, an all-gather smaller than the split count, implementations that cannot run
    a collective — and the deadlocks of its one-communication-operation-at-a-time rule, by
    replaying the export (one rank per pipeline stage where exact) before writing it. Returns
    warnings: what the binary runs to the end but then trips on (its double free on exit)."""
    from stage_cosim.adapters.astra_sim.analytical import deadlock_message, exit_warnings, replay_workload, workload_uses
    from stage_cosim.adapters.astra_sim.astra_replay import Deadlock

    for role in w.roles:
        for n in role.nodes:
            if n.type != COMP and n.comm_bytes <= 0:
                raise UserError("traces", f"{n.name} moves 0 bytes: the simulator asserts on empty messages")
    try:
        replay_workload(w, cluster, system)
    except Deadlock as d:
        raise UserError("traces", f"ASTRA-sim would never finish this export: {deadlock_message(d)}") from None
    return exit_warnings(workload_uses(w), system)
