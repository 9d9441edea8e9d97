"""Check a request at submit time and compute the digest of its resolved inputs.

Resolving (preset -> full model, defaults filled in, cluster preset -> full description) before
hashing makes equal design points equal, however they were spelled: ``{}`` and ``{"tp": 1}``
share a cache entry. It also catches bad input at submit, as INVALID_ARGUMENT naming the field,
instead of as a failed job.

The server reads no file a client names. The fields the request vocabulary would resolve as a
path — ``model``, ``cluster`` and an explore spec's ``baseline`` — must name a preset (their
content travels as ``model_config``, ``cluster_description`` or a mapping), checked on the text
alone, so neither a file's content nor its existence can leak; everything else is resolved with
the readers switched to presets only (``stage_cosim.files.without_local_files``), and the
worker processes run that way for good.

Process-level resources are the operator's: a request that names the Ray address or the number
of search processes is refused here, before anything starts (``serve --ray``,
``--search-workers`` set them).

The kinds that hand their request to a library function — optimize, explore, serve_sim — are
checked with that function's own parsing (``checks.py``), so a bad setting never starts a job.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Any, Callable, Mapping

from stage_cosim import __version__
from stage_cosim.adapters import BACKENDS
from stage_cosim.adapters.roofline.network import NETWORK_MODELS
from stage_cosim.bridge import checks
from stage_cosim.bridge.codec import dumps
from stage_cosim.bridge.sizing import check_fits, check_requests_fit
from stage_cosim.errors import UserError
from stage_cosim.files import without_local_files

# request keys that choose the server's processes, and the serve flags that set them instead
SERVER_SETTINGS = {"ray": "--ray", "workers": "--search-workers"}
SEARCHES = ("optimize", "explore")
_GPU_COUNT = re.compile(r"[0-9]{1,9}", re.ASCII)      # ASCII digits: str.isdigit takes "²" too
# a check of a search request at submit, in place of the real one (tests whose workers run stand-ins)
SearchCheck = Callable[[str, Mapping[str, Any]], None]


def check_server_settings(req: Mapping[str, Any]) -> None:
    for key, flag in SERVER_SETTINGS.items():
        if key in req:
            raise UserError(key, f"is chosen by the server's operator (serve {flag}), not by a request")


def check_no_server_paths(req: Mapping[str, Any]) -> None:
    """Refuse, on the text alone, every value that the vocabulary would resolve as a file."""
    from stage_cosim.hardware.cluster import CLUSTER_PRESETS
    from stage_cosim.model.presets import PRESETS

    model = req.get("model")
    if model is not None and (not isinstance(model, str) or model not in PRESETS):
        raise UserError("model", f"unknown preset {model!r} (known: {', '.join(PRESETS)}); the server reads no "
                                 "files: send a Hugging Face config's content as model_config")
    for key, content in (("cluster", "send a description as cluster_description"),
                         ("baseline", "send the description itself as a mapping")):
        value = req.get(key)
        if value is None or isinstance(value, Mapping):
            continue
        if not isinstance(value, str):
            raise UserError(key, f"must be a preset name or a description (a mapping), got {type(value).__name__}")
        name, colon, count = value.partition(":")
        if name not in CLUSTER_PRESETS:
            raise UserError(key, f"unknown preset {name!r} (known: {', '.join(CLUSTER_PRESETS)}, optionally "
                                 f"with ':GPUS'); the server reads no files: {content}")
        if colon and not (_GPU_COUNT.fullmatch(count) and int(count) > 0):
            # the preset is known: the count is what is wrong (as the local reader says it)
            raise UserError(key, f"GPU count after ':' must be a positive integer, got {count!r}")
    if req.get("trace") is not None:        # a serving simulation's request file
        raise UserError("trace", "names a file, and the server reads no files: send the requests inline as "
                                 "requests, rows of {arrival_s, input_len, output_len}")
    for key, value in req.items():
        if key not in ("model", "cluster", "baseline") and isinstance(value, str) \
                and ("/" in value or "\\" in value or value.endswith((".yaml", ".yml", ".json"))):
            raise UserError(key, "looks like a file name; the server reads no files: send the content")


def _check_search_size(kind: str, req: Mapping[str, Any], model: Any, memory_bytes: int) -> None:
    """A search is refused when even its smallest point cannot be simulated: all GPUs data-parallel
    with the largest micro-batch (the fewest micro-batches), as many stages as layers or GPUs."""
    import math

    from stage_cosim.hardware.cluster import cluster_from
    from stage_cosim.search.space import MAX_MICRO_BATCH

    batch, where = req.get("global_batch"), req.get("cluster" if kind == "optimize" else "baseline")
    if memory_bytes <= 0 or isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0 or where is None:
        return                       # the search's own checks report what is missing or wrong
    gpus = cluster_from(where).num_gpus
    micro_batches = math.ceil(batch / (gpus * min(MAX_MICRO_BATCH, batch)))
    check_fits(model.layers, min(model.layers, gpus), micro_batches, gpus, materialized=False,
               limit_bytes=memory_bytes)


def digest_of(value: Any) -> str:
    return hashlib.sha256(dumps(value).encode()).hexdigest()


@lru_cache(maxsize=1)
def defaults_fingerprint() -> str:
    """A digest of the data every answer depends on beyond its request: the GPU records (vendor
    figures and calibrated efficiencies), the cluster presets and the software profiles. A cached
    result keyed without it would outlive an upgrade that changes any (a search's request names
    no efficiencies and no switch defaults)."""
    from dataclasses import asdict

    from stage_cosim.hardware.cluster import cluster_presets
    from stage_cosim.hardware.gpu import gpu_records
    from stage_cosim.parallel.software import get_software, software_names

    return digest_of({"gpus": gpu_records(), "clusters": cluster_presets(),
                      "software": {name: asdict(get_software(name)) for name in software_names()}})


def _requests_in(req: Mapping[str, Any]) -> tuple[int, str]:
    """How many requests a serving simulation's stream holds, and the field that says so."""
    rows = req.get("requests")
    if isinstance(rows, list):
        return len(rows), "requests"
    count = req.get("num_requests")
    return (count, "num_requests") if isinstance(count, int) and not isinstance(count, bool) else (1000, "num_requests")


def resolve(kind: str, req: dict[str, Any], options: Mapping[str, Any], memory_bytes: int = 0,
            search_check: SearchCheck | None = None) -> str:
    """Validate ``req`` for ``kind``; returns the digest of its resolved inputs (the cache key).

    ``memory_bytes``: the per-job memory limit; a job that cannot be simulated within it is
    refused (``sizing.py``). ``search_check``: checks optimize and explore requests instead of
    the real searches' parsing (a server whose workers run stand-ins)."""
    check_server_settings(req)
    check_no_server_paths(req)
    with without_local_files():
        return _resolve(kind, req, options, memory_bytes, search_check)


def _resolve(kind: str, req: dict[str, Any], options: Mapping[str, Any], memory_bytes: int,
             search_check: SearchCheck | None) -> str:
    from stage_cosim import api

    if kind in SEARCHES or kind == "serve_sim":
        (search_check if search_check is not None and kind in SEARCHES else checks.check)(kind, req)
        model = api.model_of(req)
        if kind == "serve_sim":
            check_requests_fit(*_requests_in(req), limit_bytes=memory_bytes)
        else:
            _check_search_size(kind, req, model, memory_bytes)
        return digest_of({"v": __version__, "defaults": defaults_fingerprint(), "kind": kind,
                          "model": model.to_dict(), "request": req})
    api.check_request(req)
    model, parallel = api.model_of(req), api.parallel_of(req)
    if not options.get("traces_upload"):          # an uploaded trace set is bounded by the upload limit
        degrees = {"dp": parallel.dp, "tp": parallel.tp, "pp": parallel.pp}
        check_fits(model.layers, parallel.pp, parallel.num_microbatches, parallel.world_size,
                   materialized=kind == "synthesize" or bool(options.get("full") or options.get("timeline")),
                   limit_bytes=memory_bytes, rank_field=max(degrees, key=degrees.get))  # type: ignore[arg-type]
    resolved: dict[str, Any] = {"v": __version__, "defaults": defaults_fingerprint(), "kind": kind,
                                "model": model.to_dict(),
                                "parallel": parallel.to_dict(), "options": dict(options)}
    if kind == "simulate":
        network = req.get("network_model") or "calibrated"
        if network not in NETWORK_MODELS:
            raise UserError("network-model", f"must be one of {', '.join(NETWORK_MODELS)}, got {network!r}")
        # with an uploaded trace set the GPU count comes from its files; the description still counts
        gpus = 1 if options.get("traces") else parallel.world_size
        backend = req.get("backend") or "roofline"
        if backend not in BACKENDS:
            raise UserError("backend", f"must be {' or '.join(BACKENDS)}, got {backend!r}")
        resolved.update(cluster=api.cluster_of(req, gpus).to_dict(), network_model=network, backend=backend)
    return digest_of(resolved)
