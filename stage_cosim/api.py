"""The library's front door: requests in the project's one vocabulary, plain data out.

A request is a mapping with the same names as the command-line flags and config files:

    model:          preset name, or a path to a Hugging Face config.json
    model_config:   the content of a Hugging Face config.json (instead of ``model``)
    layers, hidden, ffn, heads, kv_heads, head_dim, vocab, max_seq, attention: overrides
    dp, tp, pp, vp, sp, micro_batch, global_batch, seq_len, zero, recompute, schedule,
    pp_layers, axis_order, tp_comm_overlap, overlap_param_gather: the parallel configuration
    phase, batch, input_len, context_len, kv_cache_dtype, weight_dtype, fp8_activation_scale,
    attention_dp, two_batch_overlap: an inference step (phase prefill or decode) instead of a
                    training step
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
PARALLEL_KEYS = tuple(f.name for f in fields(ParallelConfig) if f.init and f.name != "assumed")
# An inference step (phase prefill or decode); ``micro_batch`` is shared with the parallel keys.
INFERENCE_KEYS = ("phase", "batch", "input_len", "context_len", "kv_cache_dtype", "weight_dtype",
                  "fp8_activation_scale", "attention_dp", "two_batch_overlap")
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
    if "dp" not in kw:
        kw["dp"] = derived_dp(req.get("cluster"), *(kw.get(a, 1) for a in ("tp", "cp", "pp")))
    try:
        return ParallelConfig(**kw)
    except TypeError as exc:
        raise UserError("parallel", str(exc)) from None


def cluster_gpus(spec: "str | Mapping[str, Any] | None") -> int | None:
    """The GPU count a cluster request names: ``preset:COUNT``, a description's (or a YAML
    file's) ``num_gpus``; None where it names none (a bare preset is sized to the job)."""
    from stage_cosim.files import local_files_allowed, read_yaml
    from stage_cosim.hardware.cluster import resolve_cluster

    if spec is None:
        return None
    if isinstance(spec, Mapping):
        n = spec.get("num_gpus")
        return n if isinstance(n, int) and not isinstance(n, bool) else None
    spec = str(spec)
    if local_files_allowed() and (spec.endswith((".yaml", ".yml")) or Path(spec).is_file()):
        doc = read_yaml(Path(spec), "cluster")
        return resolve_cluster(spec).num_gpus if isinstance(doc, dict) and doc.get("num_gpus") is not None else None
    return resolve_cluster(spec).num_gpus if ":" in spec else None


def derived_dp(cluster: "str | Mapping[str, Any] | None", tp: int, cp: int, pp: int) -> int:
    """The data-parallel degree when none is given: as Megatron derives it from the world size,
    the cluster's GPUs over tp * cp * pp where the cluster names a count; else 1 (and 1 for
    degrees that are not positive integers: ParallelConfig names the bad one)."""
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in (tp, cp, pp)):
        return 1
    n = cluster_gpus(cluster)
    if n is None:
        return 1
    model_parallel = tp * cp * pp
    if n % model_parallel:
        raise UserError("dp", f"is not given, and the cluster's {n} GPUs are not a multiple of "
                              f"tp*cp*pp = {model_parallel}: give --dp or a GPU count that is")
    return n // model_parallel


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
    from stage_cosim.adapters.simulate import simulate as run
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
    machine = cluster_of(req, parallel.world_size) if req.get("cluster") else None
    workload = synthesize(model_of(req), parallel, machine.gpu if machine else None, inference=inference_of(req))
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, workload.world_size)

    with atomic_directory(out, force) as scratch:
        stats = write_traces(workload, scratch, fmt, progress=tick)
        manifest = build_manifest(workload, fmt=fmt, prefix=TRACE_PREFIX, groups_file=GROUPS_FILE,
                                  files=stats.files, bytes_written=stats.bytes_written, cluster=machine)
        (scratch / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# A serving simulation: the request stream, the engine's settings, the latency targets.
SERVE_KEYS = {"rate", "num_requests", "output_len", "lengths", "length_spread", "seed", "requests", "trace",
              "max_num_seqs", "chunk_tokens", "kv_block_size", "hbm_utilization", "step_overhead",
              "step_resolution", "prefill_gpus", "decode_gpus", "routing", "slo_ttft", "slo_tpot", "rates",
              "enable_prefix_caching", "request_timeout", "request_overhead", "prefix_len", "prefix_groups",
              "requests_out", "engine", "enable_chunked_prefill", "kv_offloading_size", "cuda_graph_sizes",
              "guaranteed_no_evict"}
# a serving run's client timeout unless the request says otherwise (0: none): the measuring
# harnesses' (vLLM's benchmark_serving and its kin give up after 300 s)
DEFAULT_REQUEST_TIMEOUT_S = 300.0
# the inference fields a serving run takes (the phase and batch are the engine's)
SERVE_INFERENCE_KEYS = ("kv_cache_dtype", "weight_dtype", "fp8_activation_scale", "attention_dp", "two_batch_overlap")


def serving_of(req: Mapping[str, Any], timeout: float | None = None):  # noqa: ANN201 (ServingConfig, SLO)
    """The engine settings and latency targets of a serving request: what it gives, else its
    engine profile's defaults (``engine``), else ServingConfig's; ``timeout`` the client
    timeout unless ``request_timeout`` is given (0: none)."""
    from stage_cosim.serving.config import SLO, ServingConfig
    from stage_cosim.serving.engines import engine_profile

    names = {"max_num_seqs": "max_num_seqs", "chunk_tokens": "chunk_tokens", "kv_block_size": "kv_block_size",
             "hbm_utilization": "hbm_utilization", "step_overhead": "step_overhead_s",
             "step_resolution": "step_resolution", "prefill_gpus": "prefill_gpus", "decode_gpus": "decode_gpus",
             "routing": "routing", "enable_prefix_caching": "enable_prefix_caching",
             "enable_chunked_prefill": "enable_chunked_prefill", "guaranteed_no_evict": "guaranteed_no_evict",
             "request_timeout": "request_timeout_s", "request_overhead": "request_overhead_s",
             "kv_offloading_size": "kv_offloading_size", "cuda_graph_sizes": "cuda_graph_sizes"}
    given = {field: req[key] for key, field in names.items() if req.get(key) is not None}
    given.setdefault("request_timeout_s", timeout)
    if given["request_timeout_s"] == 0:
        given["request_timeout_s"] = None
    if req.get("engine") is not None:
        given = {**engine_profile(req["engine"]).settings(int(req.get("tp") or 1)), **given}
    cfg = ServingConfig(**given)
    return cfg, SLO(req.get("slo_ttft"), req.get("slo_tpot"))


def requests_of(req: Mapping[str, Any]):  # noqa: ANN201 (RequestStream | Requests)
    """The request stream: a ``trace`` file, inline ``requests`` rows, or Poisson arrivals."""
    from stage_cosim.serving.requests import RequestStream, read_trace, requests_from_rows

    given = [k for k in ("trace", "requests") if req.get(k) is not None]
    if len(given) > 1:
        raise UserError("trace", "give the requests as a trace file or inline, not both")
    if given:
        for k in ("rate", "num_requests", "lengths", "length_spread", "output_len", "input_len", "rates", "prefix_len",
                  "prefix_groups"):
            if req.get(k) is not None:
                raise UserError(k, f"describes generated requests; the {given[0]} gives them")
        if given[0] == "trace":
            return read_trace(req["trace"], "trace")
        rows = req["requests"]
        if not isinstance(rows, list):
            raise UserError("requests", "must be a list of {arrival_s, input_len, output_len}")
        return requests_from_rows(rows, "requests")
    if req.get("rate") is None:
        raise UserError("rate", "is required (requests per second), unless a trace gives the requests")
    kw = {k: req[k] for k in ("num_requests", "input_len", "output_len", "lengths", "seed", "prefix_len", "prefix_groups")
          if req.get(k) is not None}
    if req.get("length_spread") is not None:
        kw["spread"] = req["length_spread"]
    return RequestStream(rate=req["rate"], **kw)


def deployment_of(req: Mapping[str, Any]):  # noqa: ANN201 (Deployment)
    """The serving deployment a request describes (model, layout, cluster, engine settings)."""
    from stage_cosim.serving.run import deploy

    model = model_of(req)
    par_req = {k: v for k, v in req.items() if k in PARALLEL_KEYS}
    for key in ("micro_batch", "global_batch", "seq_len"):
        if par_req.get(key) is not None:
            raise UserError(key, "is a training or single-step field; a serving run batches requests itself "
                                 "(--max-num-seqs, --chunk-tokens)")
    parallel = parallel_of(par_req)
    inference = InferenceConfig("decode", **{k: req[k] for k in SERVE_INFERENCE_KEYS if req.get(k) is not None})
    serving, _ = serving_of(req)
    # without a GPU count the cluster is the deployment: dp replicas (or one instance with
    # attention data parallelism), or the two pools
    gpus = (serving.prefill_gpus + serving.decode_gpus) if serving.disaggregated else parallel.world_size
    cluster = cluster_of(req, gpus)
    return deploy(model, parallel, inference, cluster, serving)


def serve_sim(req: Mapping[str, Any], progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """A serving simulation (what ``serve-sim --json`` prints): the request stream through the
    deployment; with ``rates``, one report per arrival rate under ``runs`` as well."""
    from stage_cosim.serving.requests import RequestStream
    from stage_cosim.serving.run import simulate_serving, sweep

    for key in req:
        if key not in SERVE_KEYS | (REQUEST_KEYS - {"phase", "batch", "context_len", "backend"}):
            raise UserError(key, "is not a serve-sim request field")
    if req.get("request_timeout") is None:
        req = {**req, "request_timeout": DEFAULT_REQUEST_TIMEOUT_S}
    if req.get("requests_out") is not None:
        from stage_cosim.files import check_output, local_files_allowed

        if not local_files_allowed():
            raise UserError("requests-out", "no file is written here: run serve-sim locally for per-request output")
        check_output(Path(req["requests_out"]), "requests-out", (".csv",))
    stream = requests_of(req)
    dep = deployment_of(req)
    _, slo = serving_of(req)
    requests = stream.generate() if isinstance(stream, RequestStream) else stream
    report = simulate_serving(dep, requests, slo, progress, req.get("requests_out"))
    if req.get("engine") is not None:
        report["engine"] = req["engine"]
    report["workload"] = _workload_doc(stream, requests)
    from stage_cosim.hardware.gpu import calibration_warning

    if (note := calibration_warning(dep.cluster.gpu)) is not None:
        report["warnings"] = [note]          # the GPU's efficiencies are borrowed, not measured
    rates = req.get("rates")
    if rates:
        if not isinstance(stream, RequestStream):
            raise UserError("rates", "sweeps generated requests; a trace has its own arrival times")
        values = _rates(rates)
        report["runs"] = [{"rate": r, **run} for r, run in zip(values, sweep(dep, stream, values, slo))]
    return report


def _rates(rates: Any) -> list[float]:
    if isinstance(rates, str):
        rates = [x for x in rates.split(",") if x.strip()]
    try:
        values = [float(x) for x in rates]
    except (TypeError, ValueError):
        raise UserError("rates", "must be a list of positive numbers (requests per second)") from None
    if not values or any(not (v > 0 and v < float("inf")) for v in values):
        raise UserError("rates", "must be a list of positive numbers (requests per second)")
    return values


def _workload_doc(stream, requests) -> dict[str, Any]:  # noqa: ANN001
    from dataclasses import asdict

    from stage_cosim.serving.requests import RequestStream

    doc: dict[str, Any] = asdict(stream) if isinstance(stream, RequestStream) else {"source": "trace"}
    doc.update({"requests": len(requests), "input_len_mean": float(requests.input_len.mean()),
                "output_len_mean": float(requests.output_len.mean()), "offered_rate": requests.rate})
    return doc


OPTIMIZE_KEYS = {"objective", "price", "seed", "budget", "workers", "ray", "headroom", "allow_cross_domain_tp",
                 "top", "exhaustive_limit"}


def optimize(req: Mapping[str, Any], progress: Callable[[dict], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The best parallelization (what ``optimize --json`` prints). The request needs the model,
    ``cluster`` with its GPU count, ``global_batch`` and ``seq_len``; search settings are optional."""
    from stage_cosim.hardware.runtime import DEFAULT_HEADROOM
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
                                top_k=int(req.get("top") or 5),
                                headroom=float(req["headroom"] if req.get("headroom") is not None else DEFAULT_HEADROOM),
                                network_model=str(req.get("network_model") or "calibrated"),
                                allow_cross_domain_tp=bool(req.get("allow_cross_domain_tp")),
                                exhaustive_limit=int(req.get("exhaustive_limit") or 1500))
    precision = {k: req[k] for k in ("dtype", *FP8_OPTIONS) if req.get(k) is not None}
    space = default_space(model, cluster, int(req["global_batch"]), int(req["seq_len"]),
                          allow_cross_domain_tp=settings.allow_cross_domain_tp, precision=precision)
    return run(space, cluster, settings, progress=progress, should_stop=should_stop).to_dict()


# Feasible serving layouts enumerated whole (the answer proven optimal) rather than searched
# with a budget: a layout settled after the first few ends at its first failing probe below the
# best found, so a DGX's 80 or so take minutes, not the half hour of simulating each to its edge.
SERVE_EXHAUSTIVE_LIMIT = 200

SERVE_OPTIMIZE_KEYS = {"slo_ttft", "slo_tpot", "attainment", "input_len", "output_len", "lengths", "length_spread",
                       "num_requests", "chunk_tokens", "kv_cache_dtype", "weight_dtype", "hbm_utilization",
                       "step_overhead", "step_resolution", "seed", "budget", "workers", "ray", "top",
                       "exhaustive_limit", "search"}


def optimize_serving(req: Mapping[str, Any], progress: Callable[[dict], None] | None = None,
                     should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """The serving layout with the most goodput per GPU under the SLOs (what ``optimize --phase
    serve --json`` prints). The request needs the model, ``cluster`` with its GPU count and at
    least one of ``slo_ttft``, ``slo_tpot``; ``search`` restricts dimensions ({"tp": [1, 2], …})."""
    from dataclasses import replace

    from stage_cosim.hardware.cluster import resolve_cluster
    from stage_cosim.search.optimize import OptimizeSettings
    from stage_cosim.search.serving import ServeTarget, optimize_serving as run
    from stage_cosim.serving.requests import RequestStream

    for key in req:
        if key not in SERVE_OPTIMIZE_KEYS | {"model", "model_config", "cluster", *MODEL_OVERRIDES}:
            raise UserError(key, "is not a serving-search request field")
    if not req.get("cluster"):
        raise UserError("cluster", "is required for optimize")
    model = model_of(req)
    spec = req["cluster"]
    cluster = cluster_of(req, 0) if isinstance(spec, Mapping) else resolve_cluster(str(spec))
    stream_kw = {k: req[k] for k in ("input_len", "output_len", "lengths") if req.get(k) is not None}
    if req.get("length_spread") is not None:
        stream_kw["spread"] = req["length_spread"]
    stream = RequestStream(rate=1.0, seed=int(req.get("seed") or 0), **stream_kw)
    serving, slo = serving_of({k: req[k] for k in ("chunk_tokens", "hbm_utilization", "step_overhead", "step_resolution",
                                                   "slo_ttft", "slo_tpot") if req.get(k) is not None})
    inference = InferenceConfig("decode", **{k: req[k] for k in ("kv_cache_dtype", "weight_dtype")
                                            if req.get(k) is not None})
    target = ServeTarget(stream, slo, float(req["attainment"]) if req.get("attainment") is not None else 0.9,
                         inference, serving)
    settings = OptimizeSettings(seed=int(req.get("seed") or 0), budget=req.get("budget"),
                                workers=int(req.get("workers") or 1), ray=req.get("ray"),
                                top_k=int(req.get("top") or 5),
                                exhaustive_limit=int(req.get("exhaustive_limit") or SERVE_EXHAUSTIVE_LIMIT))
    search = req.get("search") or {}
    if not isinstance(search, Mapping):
        raise UserError("search", "must map dimension names to lists of choices")
    num = req.get("num_requests") or 500
    if not isinstance(num, int) or num < 20:
        raise UserError("num-requests", f"must be an integer of at least 20, got {num!r}")
    return run(model, cluster, replace(target), settings, overrides={k: list(v) for k, v in search.items()},
               num_requests=num, progress=progress, should_stop=should_stop)


def explore(req: Mapping[str, Any], progress: Callable[[dict], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Hardware design-space exploration (what ``explore --json`` prints); the request is the
    content of an explore spec (see ``stage-cosim explore --help``)."""
    from stage_cosim.search.explore import explore as run
    from stage_cosim.search.explore_spec import spec_from_dict

    return run(spec_from_dict(dict(req), "request"), progress=progress, should_stop=should_stop)
