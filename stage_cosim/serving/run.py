"""A serving run: a deployment of instances on a cluster, a request stream, the report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from stage_cosim.errors import UserError
from stage_cosim.inference.config import InferenceConfig
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel.config import ParallelConfig
from stage_cosim.serving.config import SLO, ServingConfig
from stage_cosim.serving.engine import DECODE, MIXED, PREFILL, Cluster
from stage_cosim.serving.instance import InstanceKind, instance_kind, pool_instances
from stage_cosim.serving.metrics import summarize
from stage_cosim.serving.requests import Requests


@dataclass
class Deployment:
    """Instances of one layout on a cluster: every GPU in mixed instances, or a prefill pool and
    a decode pool."""

    model: ModelConfig
    kind: InstanceKind
    pools: list[tuple[str, InstanceKind, int]]
    cluster: Any
    serving: ServingConfig

    @property
    def gpus(self) -> int:
        return sum(kind.gpus * count for _, kind, count in self.pools)

    def to_dict(self) -> dict[str, Any]:
        return {"instance": self.kind.to_dict(),
                "pools": {role: {"instances": count, "gpus": kind.gpus * count} for role, kind, count in self.pools},
                "gpus": self.gpus}


def deploy(model: ModelConfig, parallel: ParallelConfig, inference: InferenceConfig, cluster,  # noqa: ANN001
           serving: ServingConfig, kind: InstanceKind | None = None) -> Deployment:
    kind = kind or instance_kind(model, parallel, inference, cluster, serving)
    if serving.disaggregated:
        total = serving.prefill_gpus + serving.decode_gpus
        if total > cluster.num_gpus:
            raise UserError("prefill-gpus", f"prefill-gpus + decode-gpus = {total} exceeds the cluster's "
                                            f"{cluster.num_gpus} GPUs")
        pools = [(PREFILL, kind, pool_instances(serving.prefill_gpus, kind, "prefill-gpus")),
                 (DECODE, kind, pool_instances(serving.decode_gpus, kind, "decode-gpus"))]
    else:
        pools = [(MIXED, kind, pool_instances(cluster.num_gpus, kind, "cluster"))]
    return Deployment(model, kind, pools, cluster, serving)


def simulate_serving(dep: Deployment, requests: Requests, slo: SLO,
                     progress: Callable[[int, int], None] | None = None,
                     requests_out: str | Path | None = None,
                     stop: Callable[[Any, float], bool] | None = None) -> dict[str, Any] | None:
    """Run ``requests`` through the deployment; the report (see :mod:`metrics`), and with
    ``requests_out`` every request's times written there as CSV (see :mod:`output`). ``stop``
    (see :meth:`Cluster.run`) may end the run early: None then, no report."""
    reqs = requests.clipped(dep.model.max_seq) if dep.model.position == "learned" else requests
    engines = Cluster(dep.pools, dep.serving, dep.cluster, _windows(dep.model))
    sims_before = dep.kind.timer.stats.simulations
    log, trace = engines.run(reqs, progress, stop)
    if trace is None:
        return None
    report = summarize(log, trace, slo, dep.gpus)
    if requests_out is not None:
        from stage_cosim.files import reported_write
        from stage_cosim.serving.output import write_requests_csv

        with reported_write("requests-out", Path(requests_out)):
            write_requests_csv(log, requests_out)
    report["deployment"] = dep.to_dict()
    report["serving"] = {"enable_prefix_caching": dep.serving.enable_prefix_caching,
                         "enable_chunked_prefill": dep.serving.enable_chunked_prefill,
                         "guaranteed_no_evict": dep.serving.guaranteed_no_evict,
                         "max_num_seqs": dep.serving.max_num_seqs, "chunk_tokens": dep.serving.chunk_tokens,
                         "step_overhead_s": dep.serving.step_overhead_s,
                         "request_overhead_s": dep.serving.request_overhead_s,
                         "request_timeout_s": dep.serving.request_timeout_s,
                         "kv_offloading_size": dep.serving.kv_offloading_size,
                         "cuda_graph_sizes": list(dep.serving.cuda_graph_sizes or []) or None}
    stats = dep.kind.timer.stats
    report["step_times"] = {"resolution": dep.serving.step_resolution, "steps": trace.steps,
                            "simulations": stats.simulations - sims_before, "cached_shapes": stats.simulations,
                            "mode": stats.mode, "reason": stats.reason}
    return report


def _windows(model: ModelConfig) -> tuple[int | None, ...]:
    """The model's attention kinds in BatchShape order (global first, then windows ascending)."""
    ws = set(model.layer_windows())
    return tuple(sorted(ws, key=lambda w: (w is not None, w or 0)))


def sweep(dep: Deployment, stream, rates: list[float], slo: SLO,  # noqa: ANN001 (RequestStream)
          progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """The same workload at each arrival rate (latency against load); step times are shared."""
    from dataclasses import replace

    return [simulate_serving(dep, replace(stream, rate=r).generate(), slo, progress) for r in rates]
