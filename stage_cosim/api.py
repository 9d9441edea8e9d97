"""The library's front door: requests in the project's one vocabulary, plain data out.

A request is a mapping with the same names as the command-line flags and config files:

    model:          preset name, or a path to a Hugging Face config.json
    model_config:   the content of a Hugging Face config.json (instead of ``model``)
    layers, hidden, ffn, heads, kv_heads, head_dim, vocab, max_seq, attention: overrides
    dp, tp, pp, vp, sp, micro_batch, global_batch, seq_len, zero, recompute, schedule,
    pp_layers, axis_order, tp_comm_overlap, overlap_param_gather: the parallel configuration
    phase, batch, input_len, context_len, kv_cache_dtype: an inference step (phase prefill or
                    decode) instead of a training step
    cluster:        "preset[:GPUS]", a YAML path, or a full description (mapping)
    network_model:  "calibrated" | "astra"

The CLI and the gRPC bridge are thin shells over these functions, so ``simulate --json`` and a
remote simulate job return the same object.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping

from stage_cosim.errors import UserError
from stage_cosim.inference.config import TRAIN, InferenceConfig
from stage_cosim.model import ModelConfig, resolve_model
from stage_cosim.model.config import MODEL_SWITCHES
from stage_cosim.model.presets import DEFAULT_MODEL
from stage_cosim.parallel import ParallelConfig
from stage_cosim.parallel.config import FP8_OPTIONS

MODEL_OVERRIDES = ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "max_seq", *MODEL_SWITCHES)
PARALLEL_KEYS = tuple(f.name for f in fields(ParallelConfig))
# An inference step (phase prefill or decode); ``micro_batch`` is shared with the parallel keys.
INFERENCE_KEYS = ("phase", "batch", "input_len", "context_len", "kv_cache_dtype")
REQUEST_KEYS = {"model", "model_config", "cluster", "network_model", "backend", *MODEL_OVERRIDES, *PARALLEL_KEYS,
                *INFERENCE_KEYS}


def model_of(req: Mapping[str, Any]) -> ModelConfig:
    if req.get("model_config") is not None:
        from stage_cosim.model.hf import model_from_hf_dict

        model = model_from_hf_dict(req["model_config"], "model_config")
    else:
        model = resolve_model(str(req.get("model") or DEFAULT_MODEL))
    return model.with_overrides(**{k: req.get(k) for k in MODEL_OVERRIDES})


def parallel_of(req: Mapping[str, Any]) -> ParallelConfig:
    kw = {k: req[k] for k in PARALLEL_KEYS if req.get(k) is not None}
    for key in ("pp_layers", "axis_order"):
        if isinstance(kw.get(key), list):
            kw[key] = tuple(kw[key])
        if isinstance(kw.get(key), str):
            kw[key] = tuple(x.strip() for x in kw[key].split(","))
    if "pp_layers" in kw:
        try:
            kw["pp_layers"] = tuple(int(x) for x in kw["pp_layers"])
        except (TypeError, ValueError):
            raise UserError("pp-layers", "must be a list of integers") from None
    try:
        return ParallelConfig(**kw)
    except TypeError as exc:
        raise UserError("parallel", str(exc)) from None


def inference_of(req: Mapping[str, Any]) -> InferenceConfig | None:
    """The inference step a request asks for (``phase`` prefill or decode), or None (training)."""
    phase = req.get("phase") or TRAIN
    given = {k: req[k] for k in INFERENCE_KEYS[1:] if req.get(k) is not None}
    if phase == TRAIN:
        for k in given:
            raise UserError(k, "is an inference field (with phase prefill or decode)")
        return None
    for k, instead in (("seq_len", "input_len or context_len"), ("global_batch", "batch")):
        if req.get(k) is not None:
            raise UserError(k, f"is a training field; an inference step takes {instead}")
    return InferenceConfig(str(phase), **given, micro_batch=req.get("micro_batch"))


def cluster_of(req: Mapping[str, Any], gpus: int):  # noqa: ANN201 (Cluster)
    from stage_cosim.hardware.cluster import cluster_from

    return cluster_from(req.get("cluster") or "dgx-h100", gpus)


def check_request(req: Mapping[str, Any]) -> None:
    for key in req:
        if key not in REQUEST_KEYS:
            raise UserError(key, "is not a request field")


def simulate(req: Mapping[str, Any]) -> dict[str, Any]:
    """Simulate one training step; returns ``SimResult.to_dict()`` (what ``simulate --json`` prints)."""
    from stage_cosim.adapters.roofline.simulate import simulate as run
    from stage_cosim.workload import synthesize

    check_request(req)
    model, parallel, inference = model_of(req), parallel_of(req), inference_of(req)
    backend = req.get("backend") or "roofline"
    cluster = cluster_of(req, parallel.world_size)
    workload = synthesize(model, parallel, cluster.gpu, inference=inference)
    if backend == "astra-sim":
        # the binary comes from this process's ASTRA_SIM_BIN (a server never runs a client's path)
        from stage_cosim.adapters.astra_sim.backend import simulate_astra_sim

        return simulate_astra_sim(workload, cluster).to_dict()
    if backend != "roofline":
        raise UserError("backend", f"must be roofline or astra-sim, got {backend!r}")
    result, _, _ = run(workload, cluster, str(req.get("network_model") or "calibrated"))
    return result.to_dict()


def synth(req: Mapping[str, Any], out: Path, *, fmt: str = "chakra", force: bool = False,
          progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write a trace set into ``out`` (atomically); returns its manifest."""
    import json

    from stage_cosim.manifest import build_manifest
    from stage_cosim.trace.writer import GROUPS_FILE, MANIFEST_FILE, TRACE_PREFIX, atomic_directory, write_traces
    from stage_cosim.workload import synthesize

    check_request(req)
    parallel = parallel_of(req)
    # the GPU decides the FP8 kernels (a cluster is optional here)
    gpu = cluster_of(req, parallel.world_size).gpu if req.get("cluster") else None
    workload = synthesize(model_of(req), parallel, gpu, inference=inference_of(req))
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, workload.world_size)

    with atomic_directory(out, force) as scratch:
        stats = write_traces(workload, scratch, fmt, progress=tick)
        manifest = build_manifest(workload, fmt=fmt, prefix=TRACE_PREFIX, groups_file=GROUPS_FILE,
                                  files=stats.files, bytes_written=stats.bytes_written)
        (scratch / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


OPTIMIZE_KEYS = {"objective", "price", "seed", "budget", "workers", "ray", "headroom", "allow_cross_domain_tp",
                 "top", "exhaustive_limit"}


def optimize(req: Mapping[str, Any], progress: Callable[[dict], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The best parallelization (what ``optimize --json`` prints). The request needs the model,
    ``cluster`` with its GPU count, ``global_batch`` and ``seq_len``; search settings are optional."""
    from stage_cosim.hardware.cluster import resolve_cluster
    from stage_cosim.search.evaluate import Objective
    from stage_cosim.search.optimize import OptimizeSettings, optimize as run
    from stage_cosim.search.space import default_space

    for key in req:
        if key not in REQUEST_KEYS | OPTIMIZE_KEYS:
            raise UserError(key, "is not an optimize request field")
    for key in ("global_batch", "seq_len", "cluster"):
        if not req.get(key):
            raise UserError(key, "is required for optimize")
    model = model_of(req)
    spec = req["cluster"]
    cluster = cluster_of(req, 0) if isinstance(spec, Mapping) else resolve_cluster(str(spec))
    settings = OptimizeSettings(objective=Objective(str(req.get("objective") or "step-time"),
                                                    float(req.get("price") or 0.0)),
                                seed=int(req.get("seed") or 0), budget=req.get("budget"),
                                workers=int(req.get("workers") or 1), ray=req.get("ray"),
                                top_k=int(req.get("top") or 5), headroom=float(req.get("headroom") or 0.0),
                                network_model=str(req.get("network_model") or "calibrated"),
                                allow_cross_domain_tp=bool(req.get("allow_cross_domain_tp")),
                                exhaustive_limit=int(req.get("exhaustive_limit") or 1500))
    precision = {k: req[k] for k in ("dtype", *FP8_OPTIONS) if req.get(k) is not None}
    space = default_space(model, cluster, int(req["global_batch"]), int(req["seq_len"]),
                          allow_cross_domain_tp=settings.allow_cross_domain_tp, precision=precision)
    return run(space, cluster, settings, progress=progress, should_stop=should_stop).to_dict()


def explore(req: Mapping[str, Any], progress: Callable[[dict], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Hardware design-space exploration (what ``explore --json`` prints); the request is the
    content of an explore spec (see ``stage-cosim explore --help``)."""
    from stage_cosim.search.explore import explore as run, spec_from_dict

    return run(spec_from_dict(dict(req), "request"), progress=progress, should_stop=should_stop)
