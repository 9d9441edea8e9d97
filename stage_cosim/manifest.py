"""The manifest that describes a written trace set: configuration, counts, per-role costs."""

from __future__ import annotations

from typing import Any

from stage_cosim import __version__
from stage_cosim.trace.chakra import SCHEMA_VERSION
from stage_cosim.workload import Workload


def build_manifest(w: Workload, *, fmt: str, prefix: str, groups_file: str, files: int,
                   bytes_written: int, cluster: Any = None) -> dict[str, Any]:
    """``cluster``: the machine the traces are for, which decides the runtime memory (CUDA
    context, cuBLAS workspaces, NCCL buffers, fragmentation) in each role's peak memory; by
    default DGX H100 nodes, where the rank count fills them."""
    kinds = w.group_counts()
    target = cluster if cluster is not None else _default_target(w)
    roles = [w.role_summary(s) for s in range(len(w.roles))]
    if target is not None:
        for s, role in enumerate(roles):
            role["peak_memory_bytes"] = w.memory(s, target).to_dict()
    return {
        "generator": f"stage-cosim {__version__}",
        "format": {"kind": fmt, "chakra_schema": SCHEMA_VERSION, "prefix": prefix,
                   "files": f"{prefix}.<rank>.{'et' if fmt == 'chakra' else 'json'}",
                   "communicator_groups": groups_file},
        "model": {**w.model.to_dict(), "params": w.model.param_count(),
                  "padded_vocab": w.parallel.padded_vocab(w.model.vocab)},
        "parallel": w.parallel.to_dict(),
        **({"inference": w.inference.to_dict()} if w.inference is not None else {}),
        "mesh": {"order": list(w.mesh.order), "degrees": dict(w.mesh.degrees)},
        "counts": {"ranks": w.world_size, "roles": len(w.roles), "files": files,
                   "bytes_written": bytes_written, "communicator_groups": kinds,
                   "nodes_per_role": [len(r.nodes) for r in w.roles]},
        "totals": {"matmul_flops": w.total_matmul_flops(), "model_flops": w.total_model_flops()},
        "runtime_memory_for": target.name if target is not None else None,
        "roles": roles,
    }


def _default_target(w: Workload) -> Any:
    from stage_cosim.errors import UserError
    from stage_cosim.hardware import resolve_cluster

    try:
        return resolve_cluster("dgx-h100", w.world_size)
    except UserError:
        return None
