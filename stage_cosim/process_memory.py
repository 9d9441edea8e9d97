"""The memory a rank's process holds beside its tensors, on a given cluster: the CUDA context,
cuBLAS workspaces, NCCL's buffers for the communicators the rank uses, and the caching
allocator's fragmentation (the figures and their sources: :mod:`stage_cosim.hardware.runtime`).

Only NCCL's share depends on the layout: which communicators a rank of the stage uses, how many
channels each runs (inside a scale-up domain or across), and the peers of its point-to-point
traffic. Which communicators are used follows the same rules as the communicator-group file,
without building any graph (the search checks memory before it simulates).

It reads a workload's communicators, so it sits beside :mod:`stage_cosim.workload` (whose
``Workload.memory`` calls it) rather than in :mod:`stage_cosim.schedule`, below the workload,
where the memory it fills in is accounted (:class:`~stage_cosim.schedule.memory.RuntimeMemory`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stage_cosim.hardware.runtime import (
    Communicator, cublas_workspace_bytes, cuda_context_bytes, fragmentation_bytes, p2p_channels, ring_channels,
)
from stage_cosim.parallel.axes import DENSE, GROUP, GROUP_KINDS, PIPELINE_AXIS, mesh_axes, resolve_group
from stage_cosim.schedule.memory import RuntimeMemory, StageMemory
from stage_cosim.schedule.nodes import COLL

if TYPE_CHECKING:
    from stage_cosim.hardware.cluster import Cluster
    from stage_cosim.workload import Workload


def first_rank(w: "Workload", stage: int) -> int:
    """The rank of ``stage`` at coordinate 0 on every other axis (every rank of a stage joins
    communicators of the same sizes)."""
    return w.mesh.rank(**{PIPELINE_AXIS: stage})


def _kinds_used(w: "Workload", stage: int) -> list[str]:
    """The communicator-group kinds whose collectives a rank of ``stage`` runs."""
    if w.inference is not None:
        # an inference step's collectives are those of its passes (its graphs are small)
        role = w.role(stage)
        return sorted({r[9] for t in role.templates.values() for r in t.generated_rows() if r[1] == COLL})
    pp = w.parallel.pp
    out = []
    for kind in GROUP_KINDS:
        if kind.on_demand:
            # the amax reduction of delayed FP8 scaling, over every rank of the stage
            if not (w.precision.delayed and resolve_group(mesh_axes(DENSE), w.mesh.size) == kind.name):
                continue
        elif not w._group_kind_used(kind.name) or (kind.endpoints and stage not in (0, pp - 1)):
            continue
        out.append(kind.name)
    return out


def communicators(w: "Workload", stage: int, cluster: "Cluster") -> list[Communicator]:
    """The NCCL communicators a rank of ``stage`` uses, with their channels and peers."""
    par, gpu, domain = w.parallel, cluster.gpu, cluster.domain
    bw = cluster.scale_up.bandwidth_GBps
    r0 = first_rank(w, stage)

    def peer_channels(peer: int) -> int:
        return p2p_channels(gpu, bw, peer // domain == r0 // domain)

    out: list[Communicator] = []
    for kind in _kinds_used(w, stage):
        if kind not in GROUP:       # (an inference pass's pipeline group is handled below)
            continue
        members = w.group_members(r0, kind)
        if len(set(members)) <= 1:
            continue
        if (kind == "ep" and par.moe_token_dispatcher in ("alltoall", "flex")) or kind == "cp_a2a" or \
                (kind == "cp" and par.cp_comm == "a2a"):
            # all-to-all: point-to-point with every other member
            out.append(Communicator(kind, len(members), peers=tuple(peer_channels(m) for m in members if m != r0)))
        elif kind == "cp" and par.cp_comm in ("p2p", "a2a+p2p"):
            # the ring of the attention exchange: each rank receives from its predecessor
            prev = w.mesh.shift(r0, "cp", -par.cp_a2a)
            out.append(Communicator(kind, len(members), peers=(peer_channels(prev),)))
        else:
            per_domain = {}
            for m in members:
                per_domain[m // domain] = per_domain.get(m // domain, 0) + 1
            spans = len(per_domain) > 1
            out.append(Communicator(kind, len(members),
                                    ring=ring_channels(gpu, bw, per_domain[r0 // domain], spans)))
    # pipeline sends: a stage receives activations from the one before and gradients from the one
    # after (interleaved schedules wrap round: the first stage's later chunks follow the last stage)
    pp = par.pp
    if pp > 1:
        wrap = w.inference is None and par.vp > 1
        senders = set()
        if stage > 0 or wrap:
            senders.add(w.peer(r0, -1))
        if w.inference is None and (stage < pp - 1 or wrap):
            senders.add(w.peer(r0, +1))
        if senders:
            out.append(Communicator(PIPELINE_AXIS, pp, peers=tuple(peer_channels(p) for p in sorted(senders))))
    return out


def runtime_memory(w: "Workload", stage: int, cluster: "Cluster", base: StageMemory) -> RuntimeMemory:
    """The runtime memory of a rank of ``stage`` on ``cluster`` (``base``: its tensors, which the
    allocator's fragmentation is a share of; not an inference step's KV cache, which a serving
    engine allocates as one block up front)."""
    gpu = cluster.gpu
    return RuntimeMemory(cuda_context=cuda_context_bytes(gpu), cublas_workspace=cublas_workspace_bytes(gpu),
                         nccl_buffers=sum(c.buffer_bytes for c in communicators(w, stage, cluster)),
                         fragmentation=fragmentation_bytes(base.total - base.kv_cache))
