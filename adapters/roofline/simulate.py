"""The roofline backend: a Workload (or a trace directory) on a Cluster -> SimResult."""

from __future__ import annotations

from pathlib import Path
from typing import Hashable

from stage_cosim.adapters.roofline.breakdown import charge, intervals
from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.engine import AgentProgram, Replay, replay
from stage_cosim.adapters.roofline.fast import ATTENTION_KINDS
from stage_cosim.adapters.roofline.network import CalibratedNetwork, NetworkModel
from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster, check_fits
from stage_cosim.parallel.mesh import DeviceMesh
from stage_cosim.result import RoleResult, SimResult
from stage_cosim.parallel.axes import spans_stages
from stage_cosim.schedule.program import COLL, COMP, RECV, SEND
from stage_cosim.workload import Workload

NETWORK_MODELS = ("calibrated", "astra")


def make_network(name: str, cluster: Cluster) -> NetworkModel:
    if name == "calibrated":
        return CalibratedNetwork(cluster)
    if name == "astra":
        from stage_cosim.adapters.roofline.astra import AstraNetwork

        return AstraNetwork.for_cluster(cluster)
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

    durations: dict[tuple[int, int, bool, bool], float] = {}

    def duration(n) -> float:  # noqa: ANN001
        attention = n.category in ATTENTION_KINDS
        key = (n.flops, n.mem_bytes, n.matmul, attention)
        d = durations.get(key)
        if d is None:
            d = durations[key] = compute.duration_s(n.flops, n.mem_bytes, n.matmul, attention)
        return d

    participants: dict[Hashable, int] = {}
    programs = []
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
        n = len(role.nodes)
        prog = AgentProgram(name=f"stage{role.stage}" if symmetric else f"rank{rank}", rank=rank,
                            ids=list(range(n)), types=[], deps=[], duration=[0.0] * n, kind=[""] * n,
                            coll=[None] * n, nbytes=[0] * n, peer=[-1] * n, tag=[0] * n, group=[None] * n,
                            members=[None] * n)
        for i, node in enumerate(role.nodes):
            prog.types.append(node.type)
            prog.deps.append(node.deps + node.ctrl if node.ctrl else node.deps)
            if node.type == COMP:
                prog.duration[i] = duration(node)
                continue
            prog.nbytes[i] = node.comm_bytes
            if node.type == COLL:
                prog.kind[i] = node.group
                prog.coll[i] = node.coll.value
                prog.group[i] = groups[node.group]
                prog.members[i] = members_of[node.group]
            else:
                prog.kind[i] = "pp"
                prog.tag[i] = node.tag
                prog.peer[i] = agent_of_rank(w.peer(rank, node.peer))
        programs.append(prog)
    return programs, participants, agent_of_rank


# -- where the time goes -----------------------------------------------------------------------

def breakdown(prog: AgentProgram, rep: Replay, a: int, step: float, pipelined: bool) -> dict[str, float]:
    """Seconds by category over the whole step (see :mod:`breakdown`)."""
    spans = intervals(prog.types, prog.kind, rep.start[a], rep.end[a])
    return charge(spans, 0.0, step, "pipeline_bubble" if pipelined else "idle")


# -- the backend -------------------------------------------------------------------------------

def simulate(w: Workload, cluster: Cluster, network_model: str = "calibrated", *,
             symmetric: bool = True, exact: bool | None = None
             ) -> tuple[SimResult, Replay | None, list[AgentProgram] | None]:
    """Simulate one training step.

    ``symmetric``: one rank per pipeline stage stands for all its ranks. ``exact``: replay
    every node of the step (default only where needed: the astra network model, whose single
    communication slot per rank couples passes, and full per-rank replays); otherwise each
    pass template is simulated once and the pipeline is replayed pass by pass (fast path).
    Replay and programs are returned for exact runs (timelines), None otherwise.
    """
    check_fits(cluster, w.mesh)
    compute = ComputeModel(cluster.gpu)
    network = make_network(network_model, cluster)
    if exact is None:
        exact = network_model != "calibrated" or not symmetric
    par = w.parallel
    rep = programs = None
    if exact:
        programs, participants, agent_of_rank = _programs(w, compute, symmetric)
        rep = replay(programs, network, participants, agent_of_rank)
        finish_of = {w.role_of(p.rank): rep.finish[a] for a, p in enumerate(programs)}
        step = max(rep.finish)
        seen: dict[int, dict[str, float]] = {}
        for a, prog in enumerate(programs):
            stage = w.role_of(prog.rank)
            if stage not in seen:
                seen[stage] = breakdown(prog, rep, a, step, par.pp > 1)
        bd_of = seen
    else:
        from stage_cosim.adapters.roofline.fast import simulate_fast

        finishes, totals = simulate_fast(w, network, compute)
        finish_of = dict(enumerate(finishes))
        bd_of = dict(enumerate(totals))
        step = max(finishes)
    roles = []
    for stage in sorted(finish_of):
        mem = w.memory(stage)
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
    result = SimResult(step_time_s=step, tokens_per_s=tokens / step, mfu=model_flops / (step * peak),
                       hfu=executed / (step * peak), peak_memory_bytes=peak_mem,
                       memory_capacity_bytes=gpu.memory_bytes, fits_in_memory=peak_mem <= gpu.memory_bytes,
                       breakdown=critical.breakdown, config=config, roles=roles)
    return result, rep, programs


# -- any directory of Chakra traces ------------------------------------------------------------

def programs_from_traces(ranks: dict, groups: dict[str, list[int]], compute: ComputeModel | None
                         ) -> tuple[list[AgentProgram], dict[Hashable, int]]:
    """Agent programs of a trace set (one agent per rank). Compute nodes take their time from
    ``num_ops``/``tensor_size`` through ``compute`` (or ``duration_micros`` when those are
    absent, when the node is a CPU op, or when ``compute`` is None)."""
    world = len(ranks)
    everyone = tuple(range(world))
    participants: dict[Hashable, int] = {}
    programs = []
    for rank in range(world):
        nodes = sorted(ranks[rank], key=lambda n: n.id)
        index = {n.id: i for i, n in enumerate(nodes)}
        n = len(nodes)
        prog = AgentProgram(name=f"rank{rank}", rank=rank, ids=[x.id for x in nodes], types=[], deps=[],
                            duration=[0.0] * n, kind=[""] * n, coll=[None] * n, nbytes=[0] * n, peer=[-1] * n,
                            tag=[0] * n, group=[None] * n, members=[None] * n)
        for i, node in enumerate(nodes):
            t = {4: COMP, 5: SEND, 6: RECV, 7: COLL}.get(node.type)
            if t is None:
                raise UserError("traces", f"rank {rank} node {node.id}: node type {node.type_name} cannot be simulated")
            prog.types.append(t)
            prog.deps.append([index[d] for d in list(node.data_deps) + list(node.ctrl_deps) if d in index])
            if t == COMP:
                ops, size = node.int_attr("num_ops"), node.int_attr("tensor_size")
                if compute is not None and ops is not None and size and not node.attrs.get("is_cpu_op"):
                    prog.duration[i] = compute.duration_s(ops, size, True)
                else:
                    prog.duration[i] = max(node.duration_micros, 0) * 1e-6
                continue
            prog.nbytes[i] = node.int_attr("comm_size", 0) or 0
            if t == COLL:
                pg = str(node.attrs.get("pg_name", "") or "0")
                members = everyone if pg == "0" else tuple(groups.get(pg, ()))
                if not members:
                    raise UserError("traces", f"rank {rank} node {node.id}: communicator group {pg} is not defined")
                from stage_cosim.trace.chakra import COLLECTIVE_NAMES

                prog.kind[i] = f"pg:{pg}"
                prog.coll[i] = COLLECTIVE_NAMES.get(node.int_attr("comm_type", -1), "UNKNOWN")
                prog.group[i] = ("pg", pg)
                prog.members[i] = members
                if isinstance(node.attrs.get("involved_dim"), list):
                    prog.involved[i] = tuple(bool(x) for x in node.attrs["involved_dim"])
                participants[("pg", pg)] = len(members)
            else:
                prog.kind[i] = "pp"
                prog.tag[i] = node.int_attr("comm_tag", 0) or 0
                prog.peer[i] = node.int_attr("comm_dst" if t == SEND else "comm_src", -1)
        programs.append(prog)
    return programs, participants


def simulate_traces(directory: Path, cluster: Cluster, network_model: str = "calibrated"
                    ) -> tuple[SimResult, Replay, list[AgentProgram]]:
    """Simulate a trace directory written by any generator (validated first)."""
    import json

    from stage_cosim.trace.validate import load_trace_set, validate_trace_set

    ranks, groups = load_trace_set(directory)
    problems = validate_trace_set(ranks, groups, limit=5)
    if problems:
        raise UserError("traces", f"{directory} is not a valid trace set: {problems[0]} "
                                  f"(run 'stage-cosim validate {directory}')")
    if len(ranks) != cluster.num_gpus:
        raise UserError("cluster", f"has {cluster.num_gpus} GPUs but the traces have {len(ranks)} ranks")
    compute = ComputeModel(cluster.gpu)
    network = make_network(network_model, cluster)
    programs, participants = programs_from_traces(ranks, groups or {}, compute)
    rep = replay(programs, network, participants, lambda r: r)
    step = max(rep.finish)
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    par = manifest.get("parallel", {})
    tokens = par.get("global_batch", 0) * par.get("seq_len", 0)
    peak = cluster.gpu.bf16_tflops * 1e12 * cluster.num_gpus
    model_flops = manifest.get("totals", {}).get("model_flops", 0)
    executed = sum(n.int_attr("num_ops", 0) or 0 for nodes in ranks.values() for n in nodes if n.type == 4)
    role_mem = {r["stage"]: r["peak_memory_bytes"] for r in manifest.get("roles", [])}
    mesh_doc = manifest.get("mesh")
    mesh = DeviceMesh(tuple(mesh_doc["degrees"].items()), tuple(mesh_doc["order"])) if mesh_doc else None
    roles = []
    for a, prog in enumerate(programs):
        bd = breakdown(prog, rep, a, step, bool(par.get("pp", 1) > 1))
        mem = role_mem.get(mesh.coord(a, "pp"), {}) if mesh is not None else {}
        roles.append(RoleResult(a, rep.finish[a], bd["compute"], bd, int(mem.get("total", 0)), mem))
    critical = max(roles, key=lambda r: r.finish_s)
    peak_mem = max((r.peak_memory_bytes for r in roles), default=0)
    config = {"traces": str(directory), "cluster": cluster.to_dict(), "num_gpus": cluster.num_gpus,
              "network_model": network_model, "symmetric": False, "model": manifest.get("model"),
              "parallel": par or None, "model_flops_per_step": model_flops, "executed_flops_per_step": executed}
    result = SimResult(step_time_s=step, tokens_per_s=tokens / step if tokens else 0.0,
                       mfu=model_flops / (step * peak), hfu=executed / (step * peak), peak_memory_bytes=peak_mem,
                       memory_capacity_bytes=cluster.gpu.memory_bytes,
                       fits_in_memory=peak_mem <= cluster.gpu.memory_bytes, breakdown=critical.breakdown,
                       config=config, roles=roles)
    return result, rep, programs
