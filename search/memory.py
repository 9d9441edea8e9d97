"""A configuration's peak memory per rank from its compiled blocks, without synthesizing it.

The search checks memory before it simulates: a configuration whose busiest rank holds more
than the GPU's HBM less the headroom is infeasible. :func:`~stage_cosim.search.evaluate.evaluate`
synthesizes the configuration for that (the compiled blocks bound to its numbers, the meshes,
the stages' arguments) and asks :meth:`~stage_cosim.workload.Workload.memory` of every stage.
None of that needs a role graph: the memory is the model states per ZeRO stage, the activations
of the micro-batches the schedule holds at once, the workspace, the FP8 caches and the runtime
(CUDA context, cuBLAS, NCCL buffers of the communicators used, fragmentation), and
``Workload.memory`` computes it from the blocks and the schedule alone.

So the same figure, to the byte, comes from the same code run on the blocks a search already
holds: the lower bounds bind every configuration's blocks (:class:`~stage_cosim.search.bound.StepBound`
keeps them, shared between the configurations that differ only in the schedule or the virtual
stages), and :func:`peak_bytes` puts a :class:`~stage_cosim.workload.Workload` around them the
way ``synthesize`` does, with no graph built. A test holds it to the synthesized workload's
figure on random configurations of several models.
"""

from __future__ import annotations

from typing import Any

from stage_cosim.hardware.cluster import Cluster
from stage_cosim.hardware.runtime import DEFAULT_HEADROOM
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.parallel.axes import DENSE, EXPERT, MESHES
from stage_cosim.parallel.mesh import DeviceMesh


def workload_from_blocks(model: ModelConfig, par: ParallelConfig, blocks: Any, precision: Any) -> Any:
    """The :class:`~stage_cosim.workload.Workload` ``synthesize`` builds for ``par`` (the same
    meshes and stage arguments), around training blocks already bound (``training_blocks``);
    no role graph is built until one is asked for."""
    from stage_cosim.workload import Workload

    degrees = par.degrees()
    orders = par.mesh_orders()
    meshes = {DENSE: DeviceMesh.build({a: degrees[a] for a in MESHES[DENSE]}, orders[DENSE], par.mesh_splits())}
    if model.is_moe:
        meshes[EXPERT] = DeviceMesh.build({a: degrees[a] for a in MESHES[EXPERT]}, orders[EXPERT])
    role_args = dict(pp=par.pp, vp=par.vp, schedule=par.schedule, num_microbatches=par.num_microbatches,
                     layers_per_vstage=par.layers_per_stage(model.layers), blocks=blocks, zero=par.zero,
                     tied_embeddings=model.shares_embedding, degrees=degrees | dict(meshes[DENSE].size),
                     overlap_param_gather=par.overlap_param_gather, tp_comm_overlap=par.tp_comm_overlap,
                     overlap_grad_reduce=par.overlap_grad_reduce, block_cache={})
    return Workload(model, par, meshes, role_args, precision)


def peak_bytes(model: ModelConfig, cluster: Cluster, par: ParallelConfig, blocks: Any, precision: Any) -> int:
    """The busiest rank's peak memory on ``cluster``, bytes, runtime included: what
    :func:`~stage_cosim.search.evaluate.evaluate` compares with the HBM, from ``blocks``
    (``training_blocks(model, par, precision)``)."""
    w = workload_from_blocks(model, par, blocks, precision)
    return max(w.memory(s, cluster).total for s in range(par.pp))


def fits(model: ModelConfig, cluster: Cluster, par: ParallelConfig, blocks: Any, precision: Any,
         headroom: float = DEFAULT_HEADROOM) -> bool:
    """Whether ``par`` fits in memory as :func:`~stage_cosim.search.evaluate.evaluate` decides
    it: its peak within the HBM less ``headroom``."""
    return peak_bytes(model, cluster, par, blocks, precision) <= cluster.gpu.memory_bytes * (1 - headroom)
