"""The built-in simulator under either network model (``--network-model``): a workload or a trace
set on a cluster -> result.

``calibrated`` runs the simulator's own engine (:mod:`stage_cosim.adapters.roofline`); ``astra``
runs ASTRA-sim's replay (:mod:`stage_cosim.adapters.astra_sim.simulate`). This module is the one
that knows both: the simulator never imports the ASTRA-sim package, which builds on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from stage_cosim.adapters.roofline import simulate as roofline
from stage_cosim.adapters.roofline.simulate import Simulation
from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.workload import Workload


def simulate(w: Workload, cluster: Cluster, network_model: str = "calibrated", *,
             symmetric: bool = True, exact: bool | None = None, astra_settings=None,  # noqa: ANN001
             compute_mode: str = "replay", nccl_algo: str = "auto") -> Simulation:
    """Simulate one training step.

    ``symmetric``: one rank per pipeline stage stands for all its ranks. ``exact``: replay
    every node of the step (default only where needed: the astra network model, whose single
    communication slot per rank couples passes, and full per-rank replays); otherwise each
    pass template is simulated once and the pipeline is replayed pass by pass (fast path).
    Replay and programs are returned for exact runs (timelines), None otherwise (for the astra
    model, which always replays every node: when ``exact`` is True).

    The ``astra`` model predicts what ASTRA-sim prints for this workload's export with the
    same ``astra_settings`` (every system.json field) and ``compute_mode``, to the nanosecond.
    ``nccl_algo``: the calibrated model's all-reduce algorithm (NCCL_ALGO's role).
    """
    if network_model == "astra":
        from stage_cosim.adapters.astra_sim import simulate as astra

        _astra_algo(nccl_algo)
        return astra.simulate(w, cluster, symmetric=symmetric, exact=exact, astra_settings=astra_settings,
                              compute_mode=compute_mode)
    return roofline.simulate(w, cluster, network_model, symmetric=symmetric, exact=exact, nccl_algo=nccl_algo)


def _astra_algo(nccl_algo: str) -> None:
    if nccl_algo != "auto":
        raise UserError("nccl-algo", "the astra network model runs ASTRA-sim's own collective implementations "
                                     "(--collective-implementation); give auto")


def simulate_every_rank(w: Workload, cluster: Cluster, network_model: str = "calibrated", *,
                        astra_settings=None, compute_mode: str = "replay",  # noqa: ANN001
                        progress: Callable[[str, int, int], None] | None = None, nccl_algo: str = "auto"
                        ) -> Simulation:
    """Every rank's step, node by node: one rank per pipeline stage where that is proven to
    stand exactly for every rank of its stage, else every rank replayed
    (:func:`stage_cosim.adapters.roofline.simulate.simulate_every_rank`; the astra model's replay
    checks the same for its own network model). ``config.ranks_replayed`` says which.
    ``progress(phase, done, total)``: what is being done."""
    if network_model == "astra":
        from stage_cosim.adapters.astra_sim import simulate as astra

        _astra_algo(nccl_algo)
        return astra.simulate_every_rank(w, cluster, astra_settings=astra_settings, compute_mode=compute_mode)
    return roofline.simulate_every_rank(w, cluster, network_model, progress=progress, nccl_algo=nccl_algo)


def simulate_traces(directory: Path, cluster: Cluster, network_model: str = "calibrated", *,
                    comm_groups: Path | None = None, astra_settings=None,  # noqa: ANN001
                    compute_mode: str = "replay", symmetric: bool = True) -> Simulation:
    """Simulate a trace directory written by any generator (see
    :mod:`stage_cosim.adapters.roofline.traces`), validated first. Under another network model
    than astra, the result warns where ASTRA-sim would never finish the traces."""
    from stage_cosim.adapters.astra_sim import simulate as astra

    if network_model == "astra":
        return astra.simulate_traces(directory, cluster, comm_groups=comm_groups, astra_settings=astra_settings,
                                     compute_mode=compute_mode, symmetric=symmetric)
    return roofline.simulate_traces(directory, cluster, network_model, comm_groups=comm_groups, symmetric=symmetric,
                                    checks=(astra.deadlock_warning,))
