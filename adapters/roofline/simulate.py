"""The roofline backend: a Workload (or a trace directory) on a Cluster -> SimResult.

The engine's network models (``calibrated``); the ``astra`` model runs ASTRA-sim's own replay
(:mod:`stage_cosim.adapters.astra_sim.simulate`), and :mod:`stage_cosim.adapters.simulate` picks
between them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Hashable, NamedTuple

from stage_cosim.adapters.roofline.breakdown import step_breakdown
from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.engine import AgentProgram, Replay, replay
from stage_cosim.adapters.roofline.kernels import step_compute_model
from stage_cosim.adapters.roofline.measured_allreduce import step_network
from stage_cosim.adapters.roofline.network import ALGORITHMS, NETWORK_MODELS, CalibratedNetwork, NetworkModel
from stage_cosim.adapters.roofline.routing import TokenRouting
from stage_cosim.adapters.roofline.run_cache import active, environment, step_key
from stage_cosim.errors import UserError
from stage_cosim.model.params import parameter_counts
from stage_cosim.hardware.cluster import Cluster, check_fits
from stage_cosim.result import RoleResult, SimResult, fp8_mfu
from stage_cosim.parallel.axes import spans_stages
from stage_cosim.gc_pause import gc_paused
from stage_cosim.schedule.nodes import COLL, COMP, SEND
from stage_cosim.workload import Workload

INFERENCE_FLOPS = ("model FLOPs = matmul and attention FLOPs of the forward: the (query, key) pairs a causal "
                   "kernel computes, logits for each sequence's last token only")


class Simulation(NamedTuple):
    """What a simulation returns: the result, and the replay and the programs it ran (None where
    the fast path timed pass templates instead of replaying every node). Unpacks as before:
    ``result, rep, programs = simulate(...)``."""

    result: SimResult
    replay: Replay | None
    programs: list[AgentProgram] | None


def make_network(name: str, cluster: Cluster, routing: TokenRouting | None = None,
                 nccl_algo: str = "auto", inference: bool = False) -> NetworkModel:
    """The network model the event-driven engine runs with (the ``astra`` model runs ASTRA-sim's
    own replay instead: :mod:`stage_cosim.adapters.astra_sim.simulate`); ``routing``: the
    workload's routed tokens where its dispatcher deduplicates them (:class:`TokenRouting`);
    ``nccl_algo``: the all-reduce algorithm (NCCL_ALGO's role, ``ALGORITHMS``); ``inference``: an
    inference step's network, its one-domain collectives no faster than the GPU's measured
    nccl-tests sweep (:func:`.measured_allreduce.step_network`), as ``step_compute_model``
    gives an inference step its measured kernels."""
    if name == "calibrated":
        if nccl_algo not in ALGORITHMS:
            raise UserError("nccl-algo", f"must be one of {', '.join(ALGORITHMS)}, got {nccl_algo!r}")
        return step_network(CalibratedNetwork(cluster, algorithm=nccl_algo, routing=routing), cluster, inference)
    raise UserError("network-model", f"must be one of {', '.join(NETWORK_MODELS)}, got {name!r}")


# -- programs from a synthesized workload ------------------------------------------------------

def _programs(w: Workload, compute: ComputeModel, symmetric: bool
              ) -> tuple[list[AgentProgram], dict[Hashable, int], object]:
    pp = w.parallel.pp
    if symmetric:
        reps = [w.mesh.rank(pp=s) for s in range(pp)]
        agent_of_rank = w.role_of

        def agent_rank(a: int) -> int:
            return reps[a]
    else:
        reps = list(range(w.world_size))

        def agent_of_rank(r: int) -> int:
            return r

        def agent_rank(a: int) -> int:
            return a

    durations: dict[tuple[int, int, bool, bool, int], float] = {}
    participants: dict[Hashable, int] = {}
    programs = []
    # what every rank of a stage runs alike (shared by its ranks' programs: a replay of every
    # rank holds one copy per stage, not per rank), and its communication nodes
    columns: dict[int, tuple] = {}
    for a, rank in enumerate(reps):
        role = w.role(w.role_of(rank))
        members_of = {kind: tuple(w.group_members(rank, kind)) for kind in w.group_kinds}
        groups: dict[str, Hashable] = {}
        for kind, members in members_of.items():
            if symmetric and not spans_stages(kind):   # the agent stands for all its members
                groups[kind] = (kind, a)
                participants[groups[kind]] = 1
            else:
                groups[kind] = (kind, w.group_id(rank, kind))
                participants[groups[kind]] = len({agent_of_rank(r) for r in members})
        n = role.num_nodes
        shared = columns.get(role.stage)
        if shared is None:
            types, deps, dur, kind_of, coll = [], [], [0.0] * n, [""] * n, [None] * n
            nbytes, tag = [0] * n, [0] * n
            comm: list[tuple[int, str, str, int]] = []
            # (the nodes' columns, without creating the nodes of the passes)
            for i, (typ, ds, flops, mem, matmul, cat, ngroups, keys, c, cbytes, group, peer, tg) in enumerate(
                    role.replay_rows()):
                types.append(typ)
                deps.append(ds)
                if typ == COMP:
                    dur[i] = compute.row_duration_s(durations, flops, mem, matmul, cat, ngroups, keys)
                    continue
                nbytes[i] = cbytes
                kind_of[i] = group
                comm.append((i, typ, group, peer))
                if typ == COLL:
                    coll[i] = c.value
                else:
                    tag[i] = tg
            shared = columns[role.stage] = (types, deps, dur, kind_of, coll, nbytes, tag, comm)
        types, deps, dur, kind_of, coll, nbytes, tag, comm = shared
        prog = AgentProgram(name=f"stage{role.stage}" if symmetric else f"rank{rank}", rank=rank,
                            ids=range(n), types=types, deps=deps, duration=dur, kind=kind_of,  # type: ignore[arg-type]
                            coll=coll, nbytes=nbytes, peer=[-1] * n, tag=tag, group=[None] * n, members=[None] * n)
        for i, typ, group, peer_delta in comm:
            if typ == COLL:
                prog.group[i] = groups[group]
                prog.members[i] = members_of[group]
            else:
                peer = w.peer(rank, peer_delta, group)
                prog.peer[i] = agent_of_rank(peer)
                prog.peer_rank[i] = peer
        programs.append(prog)
    return programs, participants, agent_of_rank


# -- every rank, one per class where that is proven exact -------------------------------------

def stages_symmetric(w: Workload, network: NetworkModel,
                     progress: Callable[[int, int], None] | None = None) -> bool:
    """Whether one rank per pipeline stage stands exactly for every rank of its stage.

    Every rank of a stage runs the stage's graph, so its times can differ from the
    representative's only through what its communication costs and whom it waits for. They
    are equal, by induction over the replay's events, where for every rank: each collective's
    group is placed as the network sees the representative's (``placement_key``: equal keys,
    equal durations) and holds members of the same stages; each message goes to a rank of the
    same stage as the representative's and costs the same (``p2p``); and the representative's
    groups that span stages hold the representatives of those stages (representatives wait
    only for representatives). ``progress(done, total)`` is called as ranks are checked."""
    key = getattr(network, "placement_key", None)
    if key is None:
        return False
    pp = w.parallel.pp
    reps = [w.mesh.rank(pp=s) for s in range(pp)]
    colls: list[list[str]] = []
    msgs: list[list[tuple[int, str, int]]] = []
    for role in w.roles:
        kinds, sends = set(), set()
        for n in role.nodes:
            if n.type == COLL:
                kinds.add(n.group)
            elif n.type == SEND:
                sends.add((n.peer, n.group, n.comm_bytes))
        colls.append(sorted(kinds))
        msgs.append(sorted(sends))
    shapes: dict[tuple[str, int], tuple] = {}

    def shape(rank: int, kind: str) -> tuple:
        g = (kind, w.group_id(rank, kind))
        found = shapes.get(g)
        if found is None:
            members = w.group_members(rank, kind)
            found = shapes[g] = (key(members), tuple(sorted(w.role_of(m) for m in members)))
        return found

    for s, rep in enumerate(reps):
        for kind in colls[s]:
            if spans_stages(kind):
                members = set(w.group_members(rep, kind))
                if any(reps[w.role_of(m)] not in members for m in members):
                    return False
    want = [({kind: shape(rep, kind) for kind in colls[s]},
             [(w.role_of(w.peer(rep, d, g)), network.p2p(rep, w.peer(rep, d, g), b)) for d, g, b in msgs[s]])
            for s, rep in enumerate(reps)]
    n = w.world_size
    step = max(1, n // 100)
    for r in range(n):
        s = w.role_of(r)
        groups, links = want[s]
        if any(shape(r, kind) != groups[kind] for kind in colls[s]):
            return False
        for (d, g, b), (stage, cost) in zip(msgs[s], links):
            q = w.peer(r, d, g)
            if w.role_of(q) != stage or network.p2p(r, q, b) != cost:
                return False
        if progress is not None and (r + 1) % step == 0:
            progress(r + 1, n)
    return True


def simulate_every_rank(w: Workload, cluster: Cluster, network_model: str = "calibrated", *,
                        progress: Callable[[str, int, int], None] | None = None, nccl_algo: str = "auto"
                        ) -> Simulation:
    """Every rank's step, node by node: one rank per pipeline stage where
    :func:`stages_symmetric` proves it stands exactly for every rank of its stage (the result
    is then the per-rank replay's), else every rank replayed. ``config.ranks_replayed`` says
    which. ``progress(phase, done, total)``: what is being done."""
    check_fits(cluster, w.mesh, w.meshes.get("expert"))
    w.check_gpu(cluster.gpu)
    with gc_paused():
        network = make_network(network_model, cluster, TokenRouting.of(w.model, w.parallel), nccl_algo,
                               inference=w.inference is not None)
        if progress is not None:
            progress("building the stages' graphs", 0, 1)
        proven = w.parallel.pp < w.world_size and stages_symmetric(
            w, network, None if progress is None else lambda done, n: progress("checking every rank", done, n))
        if progress is not None:
            progress(f"replaying {w.parallel.pp if proven else w.world_size} ranks", 0, 1)
        result, rep, programs = _simulate_roofline(w, cluster, network_model, proven, True, nccl_algo)
    result.config["ranks_replayed"] = len(programs or ())
    result.config["symmetric"] = proven
    return Simulation(result, rep, programs)


# -- the backend -------------------------------------------------------------------------------

def simulate(w: Workload, cluster: Cluster, network_model: str = "calibrated", *,
             symmetric: bool = True, exact: bool | None = None, nccl_algo: str = "auto") -> Simulation:
    """Simulate one training step with the engine's network model (``calibrated``).

    ``symmetric``: one rank per pipeline stage stands for all its ranks. ``exact``: replay
    every node of the step (default only where needed: full per-rank replays); otherwise each
    pass template is simulated once and the pipeline is replayed pass by pass (fast path).
    Replay and programs are returned for exact runs (timelines), None otherwise.
    """
    check_fits(cluster, w.mesh, w.meshes.get("expert"))
    w.check_gpu(cluster.gpu)
    # the stages' graphs (built on first use), the programs and the replay's events are many
    # small acyclic objects: the cycle collector would only rescan them
    with gc_paused():
        return Simulation(*_simulate_roofline(w, cluster, network_model, symmetric, exact, nccl_algo))


def _simulate_roofline(w: Workload, cluster: Cluster, network_model: str, symmetric: bool, exact: bool | None,
                       nccl_algo: str = "auto") -> tuple[SimResult, Replay | None, list[AgentProgram] | None]:
    # inference steps: the serving kernel model (the measured GEMMs), as serve-sim prices them
    compute = step_compute_model(cluster.gpu, w.inference is not None, w.parallel.software)
    network = make_network(network_model, cluster, TokenRouting.of(w.model, w.parallel), nccl_algo,
                               inference=w.inference is not None)
    if exact is None:
        # The pass-level fast path times each pass as if it started on idle streams; ZeRO-3's
        # parameter gathers prefetch across passes, which a pipeline's interleaved passes turn
        # into overlaps the pass templates cannot see (4-9 % off the node-level replay): those
        # configurations replay node by node.
        exact = not symmetric or (w.parallel.zero >= 3 and w.parallel.pp > 1)
    par = w.parallel
    rep = programs = None
    # a search's candidates whose graphs are the same but for names (recomputation that
    # changes nothing on this model, ...) time alike: the timings are kept (:mod:`.run_cache`)
    kept = active()
    env = environment(network, compute) if kept is not None else None
    key = step_key(w, env, symmetric, exact) if env is not None else None
    found = kept.get(key) if key is not None else None
    if found is not None:
        finish_of, bd_of, step = found[0], {s: dict(bd) for s, bd in found[1].items()}, found[2]
    elif exact:
        programs, participants, agent_of_rank = _programs(w, compute, symmetric)
        rep = replay(programs, network, participants, agent_of_rank)
        finish_of = {w.role_of(p.rank): rep.finish[a] for a, p in enumerate(programs)}
        step = max(rep.finish)
        seen: dict[int, dict[str, float]] = {}
        for a, prog in enumerate(programs):
            stage = w.role_of(prog.rank)
            if stage not in seen:
                seen[stage] = step_breakdown(prog, rep, a, step, par.pp > 1)
        bd_of = seen
    else:
        from stage_cosim.adapters.roofline.fast import simulate_fast

        finishes, totals = simulate_fast(w, network, compute)
        finish_of = dict(enumerate(finishes))
        bd_of = dict(enumerate(totals))
        step = max(finishes)
    if key is not None and found is None:
        kept.put(key, (dict(finish_of), {s: dict(bd) for s, bd in bd_of.items()}, step), size=sum(
            role.num_nodes for role in w.roles) // 100 + 1)
    result = step_result(w, cluster, network_model, symmetric, exact, finish_of, bd_of, step)
    if nccl_algo != "auto":
        result.config["nccl_algo"] = nccl_algo      # what --nccl-algo forced
    return result, rep, programs


def step_result(w: Workload, cluster: Cluster, network_model: str, symmetric: bool, exact: bool,
                finish_of: dict[int, float], bd_of: dict[int, dict[str, float]], step: float) -> SimResult:
    """The step's result from each pipeline stage's finish and breakdown (seconds)."""
    par = w.parallel
    roles = []
    for stage in sorted(finish_of):
        mem = w.memory(stage, cluster)
        bd = bd_of[stage]
        roles.append(RoleResult(stage, finish_of[stage], bd["compute"], bd, mem.total, mem.to_dict()))
    critical = max(roles, key=lambda r: (r.finish_s, -r.stage))
    gpu = cluster.gpu
    model_flops = w.total_model_flops()
    executed = w.total_executed_flops()
    peak = gpu.bf16_tflops * 1e12 * cluster.num_gpus
    tokens = par.global_batch * par.seq_len
    peak_mem = max(r.peak_memory_bytes for r in roles)
    config = {
        "model": w.model.to_dict(), "parallel": par.to_dict(), "cluster": cluster.to_dict(),
        "num_gpus": cluster.num_gpus, "network_model": network_model, "symmetric": symmetric,
        "exact": exact, "model_flops_per_step": model_flops, "executed_flops_per_step": executed,
    }
    if w.inference is not None:
        config["inference"] = w.inference.to_dict()
    result = SimResult(step_time_s=step, tokens_per_s=tokens / step, mfu=model_flops / (step * peak),
                       hfu=executed / (step * peak), peak_memory_bytes=peak_mem,
                       memory_capacity_bytes=gpu.memory_bytes, fits_in_memory=peak_mem <= gpu.memory_bytes,
                       breakdown=critical.breakdown, config=config, roles=roles,
                       precision=w.precision.to_dict(),
                       mfu_fp8=fp8_mfu(model_flops, step, gpu, cluster.num_gpus, w.precision),
                       parameters=parameter_counts(w.model).to_dict())
    if w.inference is not None:
        from stage_cosim.inference.summary import step_summary

        result.inference = step_summary(w, cluster, step)
        result.flop_convention = INFERENCE_FLOPS
    return result


# -- any directory of Chakra traces ------------------------------------------------------------

def simulate_traces(directory: Path, cluster: Cluster, network_model: str = "calibrated", **kw) -> Simulation:  # noqa: ANN003
    """Simulate a trace directory written by any generator (see :mod:`traces`)."""
    from stage_cosim.adapters.roofline.traces import simulate_traces as run

    return Simulation(*run(directory, cluster, network_model, **kw))
