"""The ASTRA-sim backend: export a run directory, run the user's binary, read back a SimResult
with exactly the keys of the roofline backend's.

Mapping: one simulator cycle is one nanosecond. ``step_time_s`` is the largest ``finished``
time over ranks. Per pipeline stage (its representative rank), ``compute`` is the simulator's
GPU time and ``exposed_other`` its exposed communication (finish minus compute: the simulator
does not split it by parallelism), ``idle`` the time to the step's end.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from stage_cosim.adapters.astra_sim.export import TRACE_DIR, AstraSettings, export
from stage_cosim.adapters.astra_sim.run import AstraSimError, run
from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.model.params import parameter_counts
from stage_cosim.result import BREAKDOWN_KEYS, RoleResult, SimResult, fp8_mfu
from stage_cosim.trace.validate import load_trace_set, validate_trace_set
from stage_cosim.trace.writer import GROUPS_FILE
from stage_cosim.workload import Workload


def simulate_astra_sim(w: Workload, cluster: Cluster, *, binary: str | None = None, mode: str = "replay",
                       settings: AstraSettings | None = None, keep: Path | None = None,
                       timeout_s: float = 3600.0) -> SimResult:
    """Simulate one step on ASTRA-sim. ``keep``: leave the run directory there (for debugging)."""
    from stage_cosim.adapters.astra_sim.run import find_binary

    find_binary(binary)   # fail before exporting anything
    tmp = None
    if keep is None:
        tmp = Path(tempfile.mkdtemp(prefix="stage-cosim-astra-"))
        run_dir = tmp / "run"
    else:
        run_dir = keep
    try:
        export(w, cluster, run_dir, mode=mode, settings=settings, force=keep is not None)
        ranks, groups = load_trace_set(run_dir / TRACE_DIR, run_dir / GROUPS_FILE)
        problems = validate_trace_set(ranks, groups, limit=5)
        if problems:
            raise UserError("traces", f"refusing to run ASTRA-sim on invalid traces: {problems[0]}")
        result = run(binary or "", run_dir, w.world_size, timeout_s)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = result.output
    step_ns = out.step_time_ns
    par = w.parallel
    roles = []
    for stage in range(par.pp):
        r = w.mesh.rank(pp=stage)
        bd = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
        gpu = out.gpu_ns.get(r, out.finished_ns[r] - out.exposed_comm_ns[r])
        bd["compute"] = gpu * 1e-9
        bd["exposed_other"] = out.exposed_comm_ns[r] * 1e-9
        bd["idle"] = (step_ns - out.finished_ns[r]) * 1e-9
        mem = w.memory(stage, cluster)
        roles.append(RoleResult(stage, out.finished_ns[r] * 1e-9, bd["compute"], bd, mem.total, mem.to_dict()))
    step = step_ns * 1e-9
    critical = max(roles, key=lambda x: (x.finish_s, -x.stage))
    peak = cluster.gpu.bf16_tflops * 1e12 * cluster.num_gpus
    peak_mem = max(r.peak_memory_bytes for r in roles)
    config = {"model": w.model.to_dict(), "parallel": par.to_dict(), "cluster": cluster.to_dict(),
              "num_gpus": cluster.num_gpus, "network_model": "astra-sim", "symmetric": False, "exact": True,
              "model_flops_per_step": w.total_model_flops(), "executed_flops_per_step": w.total_executed_flops(),
              "astra_sim": {"compute": mode, "per_rank_finished_ns": out.finished_ns,
                            "per_rank_exposed_comm_ns": out.exposed_comm_ns}}
    if result.warning:
        config["astra_sim"]["warning"] = result.warning
    result = SimResult(step_time_s=step, tokens_per_s=par.global_batch * par.seq_len / step,
                       mfu=w.total_model_flops() / (step * peak), hfu=w.total_executed_flops() / (step * peak),
                       peak_memory_bytes=peak_mem, memory_capacity_bytes=cluster.gpu.memory_bytes,
                       fits_in_memory=peak_mem <= cluster.gpu.memory_bytes, breakdown=critical.breakdown,
                       config=config, roles=roles, backend="astra-sim", precision=w.precision.to_dict(),
                       mfu_fp8=fp8_mfu(w.total_model_flops(), step, cluster.gpu, cluster.num_gpus, w.precision),
                       parameters=parameter_counts(w.model).to_dict())
    if w.inference is not None:
        from stage_cosim.adapters.roofline.simulate import INFERENCE_FLOPS
        from stage_cosim.inference.summary import step_summary

        result.inference = step_summary(w, cluster, step)
        result.flop_convention = INFERENCE_FLOPS
    return result


__all__ = ["simulate_astra_sim", "AstraSimError"]
