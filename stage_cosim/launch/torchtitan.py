"""torchtitan job TOML keys for a parallel configuration (its FSDP layouts).

The keys are those of torchtitan's TOML job files (``[parallelism]``, ``[training]``,
``[activation_checkpoint]``; the releases configured by TOML). torchtitan shards data-parallel
replicas with FSDP2: ZeRO 3 is ``fsdp_reshard_after_forward = "always"`` (parameters gathered
again for the backward), ZeRO 2 ``"never"`` (kept from the forward through the backward). Its
tensor parallelism always shards the sequence between the tensor-parallel regions (``--sp``);
its context parallelism passes keys and values round the ring (``alltoall``) or gathers them
(``allgather``), load-balanced head-and-tail. The pipeline's stages are given by the modules of
each (``module_fqns_per_model_part``), with the names of torchtitan's decoder models.
"""

from __future__ import annotations

from typing import Any

from stage_cosim.launch.frameworks import refuse
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig

ROTATE_METHOD = {"p2p": "alltoall", "all-gather": "allgather"}
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B", "zb-v": "ZBVZeroBubble",
             "dualpipev": "DualPipeV"}
RESHARD = {2: "never", 3: "always"}


def model_parts(layers: tuple[int, ...]) -> list[list[str]]:
    """Each (virtual) stage's modules: the embedding with the first, the final norm and the
    output layer with the last."""
    parts, first = [], 0
    for n in layers:
        parts.append([f"layers.{i}" for i in range(first, first + n)])
        first += n
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def torchtitan_toml(model: ModelConfig, par: ParallelConfig) -> dict[str, dict[str, Any]]:
    if par.dp > 1 and par.zero not in RESHARD:
        raise refuse("torchtitan", f"shards data parallelism with FSDP (--zero 2 or 3), not ZeRO {par.zero}")
    if par.tp > 1 and not par.sp:
        raise refuse("torchtitan", "tensor parallelism always shards the sequence too (--sp)")
    if par.schedule not in SCHEDULES:
        raise refuse("torchtitan", f"has no {par.schedule} schedule (its zero-bubble ones: zb-v, dualpipev)")
    if par.dtype != "bf16":
        raise refuse("torchtitan", "emission covers BF16 training (its float8 converters are not emitted)")
    if par.recompute == "selective":
        raise refuse("torchtitan", "has no Megatron-style selective recomputation (its selective modes checkpoint "
                                   "every n-th layer or chosen ops)")
    if par.cp > 1 and par.cp_comm not in ROTATE_METHOD:
        raise refuse("torchtitan", f"context parallelism rotates keys and values (p2p) or gathers them "
                                   f"(all-gather), not {par.cp_comm}")
    if par.cp > 1 and not par.cp_load_balance:
        raise refuse("torchtitan", "emission keeps its head-and-tail load balancing (--cp-load-balance)")
    if model.mtp_num_layers:
        raise refuse("torchtitan", f"has no multi-token prediction ({model.name})")
    if tuple(par.axis_order) != ("tp", "cp", "dp", "pp"):
        raise refuse("torchtitan", f"maps ranks as tp, cp, dp, pp, not {', '.join(par.axis_order)} (--axis-order)")
    if model.is_moe:
        if par.expert_tp not in (1, par.tp):
            raise refuse("torchtitan", f"expert tensor parallelism is 1 or tp ({par.tp}), not {par.expert_tp}")
        if par.moe_token_dispatcher != "alltoall" or par.moe_capacity_factor is not None:
            raise refuse("torchtitan", "routes tokens dropless by all-to-all (--moe-token-dispatcher alltoall, "
                                       "no --moe-capacity-factor)")
    p: dict[str, Any] = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": par.dp}
    if par.dp > 1:
        p["fsdp_reshard_after_forward"] = RESHARD[par.zero]
    p["tensor_parallel_degree"] = par.tp
    if par.tp > 1:
        # torchtitan's async TP is the tp collectives pipelined with their GEMMs (--tp-comm-overlap)
        p["enable_async_tensor_parallel"] = par.tp_comm_overlap
    p["context_parallel_degree"] = par.cp
    if par.cp > 1:
        p["context_parallel_rotate_method"] = ROTATE_METHOD[par.cp_comm]
    p["pipeline_parallel_degree"] = par.pp
    if par.pp > 1:
        p["pipeline_parallel_schedule"] = SCHEDULES[par.schedule]
        p["pipeline_parallel_microbatch_size"] = par.micro_batch
        p["module_fqns_per_model_part"] = model_parts(par.layers_per_stage(model.layers))
    if model.is_moe:
        p["expert_parallel_degree"] = par.ep
        p["expert_tensor_parallel_degree"] = par.expert_tp
    # with pipelining a rank's batch is split into micro-batches; without, micro-batches are
    # accumulated (global_batch_size over local_batch_size x dp)
    local = par.global_batch // par.dp if par.pp > 1 else par.micro_batch
    training = {"local_batch_size": local, "global_batch_size": par.global_batch, "seq_len": par.seq_len}
    return {"parallelism": p, "training": training,
            "activation_checkpoint": _activation_checkpoint(par.recompute)}


def _activation_checkpoint(recompute: str) -> dict[str, str]:
    """torchtitan's [activation_checkpoint] for a recompute mode (Megatron's selective is refused)."""
    if recompute == "op":
        return {"mode": "selective", "selective_ac_option": "op"}
    return {"mode": "full" if recompute == "full" else "none"}
