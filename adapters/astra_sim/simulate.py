"""The ``astra`` network model of ``simulate``: ASTRA-sim's replay (:mod:`analytical`) as the simulator's result.

* :func:`simulate`, :func:`simulate_every_rank` — a synthesized workload: what ASTRA-sim prints
  for its export, with the simulator's result around it (stages, breakdowns, memory);
* :func:`simulate_traces` — a trace set (``--traces``), under its run directory's system and
  network where it has them;
* :func:`deadlock_warning` — whether ASTRA-sim would finish a trace set that another network
  model runs.

:mod:`stage_cosim.adapters.simulate` picks these for ``--network-model astra``.
"""

from __future__ import annotations

from pathlib import Path

from stage_cosim.adapters.astra_sim.analytical import (
    NOMINAL_NOTE, deadlock_message, engine_view, nominal, replay_checked, replay_trace_set, replay_workload,
)
from stage_cosim.adapters.astra_sim.astra_replay import Deadlock
from stage_cosim.adapters.roofline.breakdown import charge
from stage_cosim.adapters.roofline.kernels import traces_compute_model
from stage_cosim.adapters.roofline.engine import AgentProgram, Replay
from stage_cosim.adapters.roofline.simulate import Simulation, step_result
from stage_cosim.adapters.roofline.traces import carries_durations, kernel_seconds, load, trace_result
from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster, check_fits
from stage_cosim.result import SimResult
from stage_cosim.trace import location
from stage_cosim.trace.traceset import TraceSet
from stage_cosim.workload import Workload


def astra_system(cluster: Cluster, settings=None, compute: str = "replay"):  # noqa: ANN001, ANN201
    """The system.json the exporter writes for ``cluster`` with these settings."""
    from stage_cosim.adapters.astra_sim.export import AstraSettings, system_for

    return system_for(cluster, compute, settings or AstraSettings())


# -- a synthesized workload -------------------------------------------------------------------------

def simulate(w: Workload, cluster: Cluster, *, symmetric: bool = True, exact: bool | None = None,
             astra_settings=None, compute_mode: str = "replay") -> Simulation:  # noqa: ANN001
    """One training step as ASTRA-sim prints it for this workload's export with the same
    ``astra_settings`` (every system.json field) and ``compute_mode``, to the nanosecond. It
    always replays every node; replay and programs are returned when ``exact`` is True."""
    check_fits(cluster, w.mesh, w.meshes.get("expert"))
    w.check_gpu(cluster.gpu)
    return Simulation(*_simulate(w, cluster, symmetric, astra_settings, compute_mode, views=exact is True))


def simulate_every_rank(w: Workload, cluster: Cluster, *, astra_settings=None,  # noqa: ANN001
                        compute_mode: str = "replay") -> Simulation:
    """Every rank's step: ASTRA-sim's replay checks for its own network model what
    :func:`stage_cosim.adapters.roofline.simulate.stages_symmetric` checks for the engine's (every
    rank, one per stage where exact)."""
    check_fits(cluster, w.mesh, w.meshes.get("expert"))
    w.check_gpu(cluster.gpu)
    result, rep, programs = _simulate(w, cluster, True, astra_settings, compute_mode, views=True)
    result.config["ranks_replayed"] = len(programs or ()) or w.world_size
    return Simulation(result, rep, programs)


def _simulate(w: Workload, cluster: Cluster, symmetric: bool, settings, compute_mode: str,  # noqa: ANN001
              views: bool) -> tuple[SimResult, Replay | None, list[AgentProgram] | None]:
    """The astra model: ASTRA-sim's replay of this workload's export. ``views``: also return the
    replay as engine programs and times (timelines)."""
    from stage_cosim.adapters.astra_sim.export import check_compute_mode

    check_compute_mode(w, compute_mode)
    system = astra_system(cluster, settings, compute_mode)
    try:
        done = replay_workload(w, cluster, system, symmetric=symmetric, record=True)
    except Deadlock as d:
        raise UserError("workload", deadlock_message(d)) from None
    out = done.outcome
    assert out.start is not None and out.end is not None
    step_ns = max(out.finish)
    waiting = "pipeline_bubble" if w.parallel.pp > 1 else "idle"
    finish_of: dict[int, float] = {}
    bd_of: dict[int, dict[str, float]] = {}
    for a, ag in enumerate(done.agents):
        stage = w.role_of(ag.rank)
        if stage in bd_of:
            continue
        finish_of[stage] = out.finish[a] * 1e-9
        cats = ag.prog.breakdown_categories
        ns = charge(((s, e, c) for s, e, c in zip(out.start[a], out.end[a], cats) if c is not None),
                    0, step_ns, waiting)
        bd_of[stage] = {k: v * 1e-9 for k, v in ns.items()}
    result = step_result(w, cluster, "astra", done.symmetric, True, finish_of, bd_of, step_ns * 1e-9)
    result.config["astra_sim"] = {"compute": compute_mode, "system": _system_doc(system)}
    if not views:
        return result, None, None
    programs, rep = engine_view(done)
    return result, rep, programs


def _system_doc(system) -> dict:  # noqa: ANN001
    from stage_cosim.adapters.astra_sim.config_files import system_json_dict

    return system_json_dict(system)


# -- a trace set ------------------------------------------------------------------------------------

def simulate_traces(directory: Path, cluster: Cluster, *, comm_groups: Path | None = None,
                    astra_settings=None, compute_mode: str = "replay",  # noqa: ANN001
                    symmetric: bool = True) -> Simulation:
    """A trace directory (see :func:`stage_cosim.adapters.roofline.traces.load`) as ASTRA-sim
    replays it: the simulator's own compute rule where the traces carry durations (or
    system.json asks for its roofline); our GPU model's, in ns, where they do not."""
    loaded = load(directory, cluster, comm_groups)
    ts = loaded.ts
    # an inference step's traces (their manifest says so): the measured GEMMs, as simulate prices them
    compute = traces_compute_model(cluster.gpu, loaded.manifest)
    used: list[str] = []
    system, dims = astra_inputs(loaded.located, cluster, astra_settings, compute_mode, used)
    durations = None
    if not system.roofline_enabled and not carries_durations(ts):
        secs = kernel_seconds(ts, compute)
        durations = [[max(1, round(s * 1e9)) if typ == 4 else 0 for s, typ in zip(secs[c], t.types)]
                     for c, t in enumerate(ts.classes)]
    done = replay_checked(ts, system, dims, "traces", symmetric=symmetric, record=True, durations=durations)
    programs, rep = engine_view(done)
    return Simulation(*trace_result(loaded, cluster, "astra", programs, rep, {"astra_files": used} if used else {}))


def astra_inputs(located: location.Located, cluster: Cluster, settings, compute_mode: str,  # noqa: ANN001
                 used: list[str] | None = None):  # noqa: ANN201 (AstraSystem, list[NetworkDim])
    """The system and network the astra model runs a trace set under: the run directory's own
    system.json and network.yml where they are (what the binary would run), with the settings
    given explicitly on the command line put over the file's; else the export's defaults for the
    cluster with those settings."""
    from stage_cosim.adapters.astra_sim.config_files import read_network_yml, read_system_json
    from stage_cosim.adapters.astra_sim.export import AstraSettings, apply_settings

    settings = settings or AstraSettings()
    run_dir = located.run_dir
    if run_dir is None:
        return astra_system(cluster, settings, compute_mode), cluster.network_dims()
    network_file = run_dir / "network.yml"
    dims = read_network_yml(network_file) if network_file.is_file() else cluster.network_dims()
    system = apply_settings(read_system_json(run_dir / "system.json"), cluster, compute_mode, settings, len(dims))
    if used is not None:
        used += [str(run_dir / "system.json")] + ([str(network_file)] if network_file.is_file() else [])
    return system, dims


def deadlock_warning(ts: TraceSet, located: location.Located) -> list[str]:
    """Whether ASTRA-sim would deadlock on these traces (one communication operation at a time
    per rank, issued in id order), under the run directory's files or a nominal network: the
    calibrated model runs them (real clusters overlap their communication streams), but the
    simulator they were written for would not."""
    from stage_cosim.adapters.astra_sim.config_files import read_network_yml, read_system_json

    run_dir = located.run_dir
    try:
        if run_dir is not None and (run_dir / "network.yml").is_file():
            system, dims, where = read_system_json(run_dir / "system.json"), read_network_yml(run_dir / "network.yml"), ""
        else:
            (system, dims), where = nominal(len(ts.class_of)), NOMINAL_NOTE
        replay_trace_set(ts, system, dims)
    except Deadlock as d:
        return [f"ASTRA-sim would never finish these traces: {deadlock_message(d)}{where}; the calibrated model "
                f"overlaps communication as real clusters do and finishes them"]
    except UserError:
        return []          # an input the simulator cannot run at all: validate says which
    return []
