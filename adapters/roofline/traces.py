"""Simulate a trace set from any generator: the ``--traces`` of ``simulate``.

Compute time: a trace set that carries durations (any compute node with ``duration_micros``
> 0, as ASTRA-sim's ``--compute replay`` traces and our exports do) is replayed by them;
otherwise each kernel is timed by our GPU model from ``num_ops``, ``tensor_size`` and its
``op_kind`` (matmul, attention, vector). So the traces ``synth`` and ``astra-sim export`` write
read back to the step time of the direct simulation. Traces from other generators carry no
``op_kind``: it is read from the node's op type, its name (``aten::mm``, a cuBLAS/CUTLASS GEMM
kernel, flash attention, ``aten::softmax`` ...), and where the name says nothing, from its
arithmetic intensity (see :func:`op_kind_of`).

Ranks with equal traces (one pipeline stage) are simulated once where that is exact (see
:mod:`classes`); communicator groups are named by their kind (tp, dp, embedding) when the
trace set's manifest says which ids are which, so that streams and breakdowns are those of
the direct simulation.

This is the ``calibrated`` network model's replay; :func:`load` and :func:`trace_result` are also
the ``astra`` model's (:mod:`stage_cosim.adapters.astra_sim.simulate`), which replays the trace set
as ASTRA-sim would.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Mapping, Sequence

from stage_cosim.adapters.roofline.breakdown import step_breakdown
from stage_cosim.adapters.roofline.classes import (
    K_COLL, Classes, Topology, membership, replay_ns, symmetric as is_symmetric, target_of, trace_classes,
)
from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.engine import AgentProgram, DeadlockError, Replay, replay
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.adapters.roofline.routing import TokenRouting
from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster
from stage_cosim.parallel.mesh import DeviceMesh
from stage_cosim.result import RoleResult, SimResult
from stage_cosim.schedule.nodes import COLL, COMP, RECV, SEND
from stage_cosim.trace import location
from stage_cosim.trace.traceset import NodeTable, TraceSet
from stage_cosim.trace.validate import validate

_TYPES = {4: COMP, 5: SEND, 6: RECV, 7: COLL}


def carries_durations(ts: TraceSet) -> bool:
    """Whether the traces say how long their kernels take (any compute node with a duration)."""
    return any(d > 0 for t in ts.classes for typ, d in zip(t.types, t.duration_micros) if typ == 4)


# Op types by name, for traces without ``op_kind`` (PyTorch operators as Chakra's converter names
# them, and GPU kernel names): attention kernels, then GEMM-like ones, then known memory-bound ones.
_ATTENTION = re.compile(r"attention|flash|fmha|sdpa|scaled_dot_product", re.I)
_GEMM = re.compile(r"gemm|matmul|xmma|wgmma|cutlass|cublas|nvjet|s16816|convolution|conv[123]d|cudnn|linear"
                   r"|(?:^|[^a-z])(?:add|badd|addb)?b?mm(?:[^a-z]|$)", re.I)
_MEMORY_BOUND = re.compile(r"elementwise|norm|softmax|gelu|silu|relu|swiglu|dropout|add|mul|copy|cat|fill|embedding"
                           r"|index|reduce|sum|mean|cast|convert|clone|contiguous|transpose|permute|rope|rotary|zero|scale|exp"
                           r"|sigmoid|tanh|where|pad|slice|split",
                           re.I)


def op_kind_of(name: str, num_ops: int, tensor_size: int, compute: ComputeModel) -> str:
    """The op type of a compute node that does not say it (another generator's trace): attention
    and GEMM-like kernels by name (they run on the tensor cores); other named ops (normalization,
    softmax, element-wise ...) at the vector rate, which makes them memory-bound on their
    ``tensor_size``; a name that says nothing by arithmetic intensity — above the GPU's vector
    ridge point (vector FLOP/s over achievable bandwidth) only tensor-core work gets, so it is
    taken as a GEMM, below it the vector rate."""
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "matmul"
    if _MEMORY_BOUND.search(name) or num_ops <= 0:
        return "vector"
    g = compute.gpu
    ridge = g.vector_peak_tflops * 1e12 / (g.hbm_GBps * 1e9 * g.memory_efficiency)
    return "matmul" if tensor_size <= 0 or num_ops / tensor_size > ridge else "vector"


def kernel_seconds(ts: TraceSet, compute: ComputeModel) -> list[list[float]]:
    """Per class, each compute node's time (file order; 0 for other nodes)."""
    by_duration = carries_durations(ts)
    out = []
    for t in ts.classes:
        secs = [0.0] * len(t)
        for i, typ in enumerate(t.types):
            if typ != 4:
                continue
            cpu = t.attrs[i].get("is_cpu_op", (None, False))[1] is True
            if by_duration or cpu:
                secs[i] = replay_ns(t.duration_micros[i]) * 1e-9
                continue
            ops, size = t.int_attr(i, "num_ops", 0) or 0, t.int_attr(i, "tensor_size", 0) or 0
            kind = t.attrs[i].get("op_kind")
            secs[i] = compute.duration_of(ops, size, str(kind[1]) if kind is not None else
                                          op_kind_of(t.names[i], ops, size, compute),
                                          groups=(t.int_attr(i, "attention_rows", 0) or t.int_attr(i, "gemm_groups", 0)
                                                  or 1),
                                          keys=t.int_attr(i, "attention_keys", 0) or 0)
        out.append(secs)
    return out


def group_kinds(manifest: dict) -> dict[str, str]:
    """Communicator-group id -> kind (tp, dp, embedding) from a manifest, where it says."""
    counts = manifest.get("counts", {}).get("communicator_groups") or manifest.get("communicator_groups") or {}
    out, nxt = {}, 1
    for kind, n in counts.items():
        for g in range(nxt, nxt + int(n)):
            out[str(g)] = kind
        nxt += int(n)
    return out


def _manifest(located: location.Located) -> dict:
    for d in (located.trace_dir, located.run_dir):
        if d is not None and (d / "manifest.json").is_file():
            try:
                doc = json.loads((d / "manifest.json").read_text())
            except (OSError, ValueError):       # unreadable, not text, not JSON: no manifest
                return {}
            return doc if isinstance(doc, dict) else {}
    return {}


def _table_program(name: str, rank: int, t: NodeTable, values: Sequence, secs: Sequence[float],
                   kinds: dict[str, str], members_of, agent_of: dict[int, int],  # noqa: ANN001
                   send_kind=lambda rank, peer: "pp") -> AgentProgram:  # noqa: ANN001
    """One engine program: sends and receives name the agent of their peer (and its rank, for
    the link it takes) and their kind (the pipeline's, or the ring of context parallelism)."""
    order = sorted(range(len(t)), key=t.ids.__getitem__)
    pos = {t.ids[i]: k for k, i in enumerate(order)}
    hole_value = dict(zip(t.holes, values))
    n = len(order)
    prog = AgentProgram(name=name, rank=rank, ids=[t.ids[i] for i in order], types=[], deps=[], duration=[0.0] * n,
                        kind=[""] * n, coll=[None] * n, nbytes=[0] * n, peer=[-1] * n, tag=[0] * n, group=[None] * n,
                        members=[None] * n)
    from stage_cosim.trace.chakra import COLLECTIVE_NAMES

    for k, i in enumerate(order):
        typ = _TYPES.get(t.types[i])
        if typ is None:
            raise UserError("traces", f"rank {rank} node {t.ids[i]}: node type {t.types[i]} cannot be simulated")
        prog.types.append(typ)
        prog.deps.append(sorted({pos[d] for d in t.data_deps[i] + t.ctrl_deps[i] if d in pos}))
        if typ == COMP:
            prog.duration[k] = secs[i]
            continue
        prog.nbytes[k] = t.int_attr(i, "comm_size", 0) or 0
        if typ == COLL:
            pg = target_of(hole_value.get(i), K_COLL)
            prog.kind[k] = kinds.get(str(pg), f"pg:{pg}")
            prog.coll[k] = COLLECTIVE_NAMES.get(t.int_attr(i, "comm_type", -1) or 0, "UNKNOWN")
            prog.group[k] = ("pg", pg)
            prog.members[k] = tuple(members_of(pg))
            inv = t.attrs[i].get("involved_dim")
            if inv is not None and isinstance(inv[1], list):
                prog.involved[k] = tuple(bool(x) for x in inv[1])
        else:
            target = target_of(hole_value.get(i), 2)
            prog.kind[k] = send_kind(rank, target)
            prog.tag[k] = t.int_attr(i, "comm_tag", 0) or 0
            prog.peer[k] = agent_of[target]  # type: ignore[index]
            prog.peer_rank[k] = target  # type: ignore[assignment]
    return prog


def send_kinds(manifest: dict):  # noqa: ANN201 (rank, peer -> kind)
    """The kind of a send or receive from the manifest's mesh: between ranks that differ only
    in their cp coordinate it is the ring of context parallelism, else the pipeline's."""
    mesh_doc = manifest.get("mesh")
    if not mesh_doc or mesh_doc.get("degrees", {}).get("cp", 1) == 1:
        return lambda rank, peer: "pp"
    mesh = DeviceMesh(tuple(mesh_doc["degrees"].items()), tuple(mesh_doc["order"]))
    others = [a for a in mesh.order if a != "cp"]

    def kind(rank: int, peer: int) -> str:
        return "cp" if all(mesh.coord(rank, a) == mesh.coord(peer, a) for a in others) else "pp"
    return kind


def _symmetric_here(cl, reps: dict[int, int], members_of, net: Topology) -> bool:  # noqa: ANN001
    """Whether one rank per class stands exactly for its class in this engine.

    The rule of :func:`classes.symmetric`, but a representative may also send to and
    receive from ranks of its own class: the ring of context parallelism round a stage's cp
    ranks, whose ranks differ only in their peers. Its agent then pairs with itself, its own
    send to the next rank standing for the previous rank's send to it — exact here, where the
    ring's sends have a stream of their own, when every rank's peers are as far as its
    representative's over every network dimension their ends differ in (this engine prices a
    transfer by where both ends sit). (ASTRA-sim's single communication slot makes a ring's
    ranks differ: a send that becomes ready at the instant the slot frees goes before or after
    another operation depending on the order of simultaneous events, which follows rank order;
    its replay keeps one agent per rank there.)"""
    def link(a: int, b: int) -> tuple[tuple[int, int], ...]:
        return tuple((d, net.dims[d].hops(x, y)) for d, (x, y) in enumerate(zip(net.coords[a], net.coords[b]))
                     if x != y)

    def in_class(r: int, kind: int, t: object) -> bool:
        return kind != K_COLL and isinstance(t, int) and 0 <= t < cl.n_ranks and cl.class_of[t] == cl.class_of[r]

    def targets(r: int):  # noqa: ANN202
        return [(kind, t) for kind, t in cl.targets(r) if not in_class(r, kind, t)]

    if not is_symmetric(Classes(cl.class_of, cl.n_ranks, cl.pairs, targets), reps, members_of, net):
        return False
    for r in range(cl.n_ranks):
        rep = reps[cl.class_of[r]]
        if rep != r and any(kind != K_COLL and link(rep, theirs) != link(r, mine)  # type: ignore[arg-type]
                            for kind, theirs, mine in cl.pairs(r)):
            return False
    return True


def agent_programs(ts: TraceSet, cluster: Cluster, compute: ComputeModel, kinds: dict[str, str],
                   symmetric: bool = True, send_kind=lambda rank, peer: "pp"  # noqa: ANN001
                   ) -> tuple[list[AgentProgram], dict[Hashable, int], object]:
    """Engine programs of a trace set: one per class where that is exact, else one per rank.
    Returns the programs, how many agents take part in each group, and rank -> agent."""
    n = len(ts.class_of)
    members_of = membership(ts.groups, n)
    secs = kernel_seconds(ts, compute)
    agents: list[int] = list(range(n))
    agent_of = {r: r for r in range(n)}
    if symmetric and len(ts.classes) < n:
        cl, reps = trace_classes(ts, members_of)
        if _symmetric_here(cl, reps, members_of, Topology(cluster.network_dims())):
            order = sorted(reps)
            agents = [reps[c] for c in order]
            index = {c: a for a, c in enumerate(order)}
            agent_of = {r: index[ts.class_of[r]] for r in range(n)}
    programs = []
    for _a, r in enumerate(agents):
        c = ts.class_of[r]
        programs.append(_table_program(f"rank{r}", r, ts.classes[c], ts.values_of(r), secs[c], kinds, members_of,
                                       agent_of, send_kind))
    participants: dict[Hashable, int] = {}
    for p in programs:
        for g, m in zip(p.group, p.members):
            if g is not None and g not in participants:
                participants[g] = len({agent_of[x] for x in m})  # type: ignore[union-attr]
    return programs, participants, agent_of.__getitem__


@dataclass
class Loaded:
    """A trace set read and checked for a cluster: the directory given, where its files are, its
    traces, its manifest (empty where it has none) and its groups' kinds (:func:`group_kinds`)."""

    directory: Path
    located: location.Located
    ts: TraceSet
    manifest: dict
    kinds: dict[str, str]


def load(directory: Path, cluster: Cluster, comm_groups: Path | None = None) -> Loaded:
    """Read a trace directory (an export's run directory, a trace directory, or either with the
    group file given) and validate it, for ``cluster``."""
    located = location.locate(directory, comm_groups)
    ts = location.read(located)
    problems = validate(ts, 5)
    if problems:
        raise UserError("traces", f"{directory} is not a valid trace set: {problems[0]} "
                                  f"(run 'stage-cosim validate {directory}')")
    n = len(ts.class_of)
    if n != cluster.num_gpus:
        raise UserError("cluster", f"has {cluster.num_gpus} GPUs but the traces have {n} ranks")
    manifest = _manifest(located)
    return Loaded(directory, located, ts, manifest, group_kinds(manifest))


def simulate_traces(directory: Path, cluster: Cluster, network_model: str = "calibrated", *,
                    comm_groups: Path | None = None, symmetric: bool = True,
                    checks: Sequence[Callable[[TraceSet, location.Located], list[str]]] = ()
                    ) -> tuple[SimResult, Replay, list[AgentProgram]]:
    """Simulate a trace directory (an export's run directory, a trace directory, or either with
    the group file given), validated first. ``checks``: what else to say about traces that ran,
    each a list of warnings (:func:`stage_cosim.adapters.simulate.simulate_traces` passes
    ASTRA-sim's: whether its binary would finish them)."""
    loaded = load(directory, cluster, comm_groups)
    ts = loaded.ts
    from stage_cosim.adapters.roofline.kernels import traces_compute_model
    from stage_cosim.adapters.roofline.measured_allreduce import step_network

    # an inference step's traces (their manifest says so): the serving kernel model, as simulate prices them
    compute = traces_compute_model(cluster.gpu, loaded.manifest)
    if network_model != "calibrated":
        raise UserError("network-model", f"must be calibrated or astra, got {network_model!r}")
    programs, participants, agent_of_rank = agent_programs(ts, cluster, compute, loaded.kinds, symmetric,
                                                           send_kinds(loaded.manifest))
    try:
        network = step_network(CalibratedNetwork(cluster, routing=TokenRouting.of_manifest(loaded.manifest)), cluster,
                               bool((loaded.manifest or {}).get("inference")))
        rep = replay(programs, network, participants, agent_of_rank)
    except DeadlockError as exc:
        raise UserError("traces", f"the traces never finish: {exc}") from None
    warnings = [w for check in checks for w in check(ts, loaded.located)]
    return trace_result(loaded, cluster, network_model, programs, rep, {"warnings": warnings} if warnings else {})


def trace_result(loaded: Loaded, cluster: Cluster, network_model: str, programs: list[AgentProgram], rep: Replay,
                 extra: Mapping[str, object]) -> tuple[SimResult, Replay, list[AgentProgram]]:
    """The result of a trace set's replay (``extra``: more entries of its config)."""
    ts, manifest = loaded.ts, loaded.manifest
    n = len(ts.class_of)
    step = max(rep.finish)
    par = manifest.get("parallel") or {}
    tokens = par.get("global_batch", 0) * par.get("seq_len", 0)
    peak = cluster.gpu.bf16_tflops * 1e12 * cluster.num_gpus
    model_flops = manifest.get("totals", {}).get("model_flops", 0) or manifest.get("model_flops_per_step", 0)
    executed = sum((t.int_attr(i, "num_ops", 0) or 0) * len(ts.members_of(c))
                   for c, t in enumerate(ts.classes) for i, typ in enumerate(t.types) if typ == 4)
    role_mem = {r["stage"]: r["peak_memory_bytes"] for r in manifest.get("roles", []) or manifest.get("stages", [])}
    mesh_doc = manifest.get("mesh")
    mesh = DeviceMesh(tuple(mesh_doc["degrees"].items()), tuple(mesh_doc["order"])) if mesh_doc else None
    roles = []
    for a, prog in enumerate(programs):
        bd = step_breakdown(prog, rep, a, step, bool(par.get("pp", 1) > 1))
        stage = mesh.coord(prog.rank, "pp") if mesh is not None else a
        mem = role_mem.get(stage, {}) if mesh is not None else {}
        roles.append(RoleResult(stage, rep.finish[a], bd["compute"], bd, int(mem.get("total", 0)), mem))
    critical = max(roles, key=lambda r: r.finish_s)
    peak_mem = max((r.peak_memory_bytes for r in roles), default=0)
    config = {"traces": str(loaded.directory), "cluster": cluster.to_dict(), "num_gpus": cluster.num_gpus,
              "network_model": network_model, "symmetric": len(programs) < n, "model": manifest.get("model"),
              "parallel": par or None, "model_flops_per_step": model_flops, "executed_flops_per_step": executed,
              "compute": "trace durations" if carries_durations(ts) else "GPU model", **extra}
    result = SimResult(step_time_s=step, tokens_per_s=tokens / step if tokens else 0.0,
                       mfu=model_flops / (step * peak), hfu=executed / (step * peak), peak_memory_bytes=peak_mem,
                       memory_capacity_bytes=cluster.gpu.memory_bytes,
                       fits_in_memory=peak_mem <= cluster.gpu.memory_bytes, breakdown=critical.breakdown,
                       config=config, roles=roles)
    return result, rep, programs
