"""What an inference step's result adds to a training step's: latency, memory traffic, KV cache."""

from __future__ import annotations

from typing import Any


def step_summary(w, cluster, step_s: float) -> dict[str, Any]:  # noqa: ANN001 (Workload, Cluster)
    """The inference part of a result (``SimResult.inference``).

    * ``latency_s``: the step (a prefill's time to the first token of its batch; a decode
      step's time per output token);
    * ``bytes_read``: what the step must read from HBM, summed over the GPUs, as memory
      bandwidth utilization counts it: the model's weights (all of them, the embedding table
      included) once per micro-batch (with two-batch overlap, once per each of its two) and
      each request's KV cache once (a hybrid model's SSM state with it: ``kv_cache_bytes_per_gpu``
      holds both); ``mbu`` is that over
      the step's time at the GPUs' peak HBM bandwidth (how a decode step is judged);
    * ``kv_cache_bytes_per_token_per_gpu``: what one token of one request occupies in the
      cache of the fullest GPU (the unit a paged KV cache is sized in), attention layers only;
    * ``state_bytes_per_sequence_per_gpu``: the fixed state of one request on that GPU (the
      SSM layers' scan state and convolution window; 0 for a transformer).
    """
    inf, par = w.inference, w.parallel
    ranks = w.world_size // par.pp
    mems = [w.memory(s) for s in range(par.pp)]
    weights = sum(m.weights for m in mems) * ranks * par.num_microbatches * (2 if w.two_batch else 1)
    kv = sum(m.kv_cache for m in mems) * ranks
    hbm = cluster.gpu.hbm_GBps * 1e9 * cluster.num_gpus
    per_token = max(w.kv_cache_bytes_per_token(s) for s in range(par.pp))
    new = inf.batch * inf.new_tokens
    return {
        **inf.to_dict(), "micro_batch": par.micro_batch, "micro_batches": par.num_microbatches,
        "requests_per_replica": inf.batch // par.dp, "new_tokens": new, "latency_s": step_s,
        "weights_bytes_per_gpu": max(m.weights for m in mems), "kv_cache_bytes_per_gpu": max(m.kv_cache for m in mems),
        "kv_cache_bytes_per_token_per_gpu": per_token,
        "state_bytes_per_sequence_per_gpu": max(w.state_bytes_per_sequence(s) for s in range(par.pp)),
        "bytes_read": weights + kv,
        "mbu": (weights + kv) / (step_s * hbm),
    }
