"""Check a request at submit time and compute the digest of its resolved inputs.

Resolving (preset -> full model, defaults filled in, cluster preset -> full description) before
hashing makes equal design points equal, however they were spelled: ``{}`` and ``{"tp": 1}``
share a cache entry. It also catches bad input at submit, as INVALID_ARGUMENT naming the field,
instead of as a failed job.

The server reads no file a client names: ``model`` must be a preset (a config's content travels
as ``model_config``) and ``cluster`` a preset (a description travels as a mapping).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from stage_cosim import __version__
from stage_cosim.bridge.codec import dumps
from stage_cosim.errors import UserError

NETWORK_MODELS = ("calibrated", "astra")


def check_no_server_paths(req: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> None:
    from stage_cosim.hardware.cluster import CLUSTER_PRESETS
    from stage_cosim.model.presets import PRESETS

    model = req.get("model")
    if model is not None and model not in PRESETS:
        raise UserError("model", f"unknown preset {model!r} (known: {', '.join(PRESETS)}); the server reads no "
                                 "files: send a Hugging Face config's content as model_config")
    cluster = req.get("cluster")
    if isinstance(cluster, str) and cluster.partition(":")[0] not in CLUSTER_PRESETS:
        raise UserError("cluster", f"unknown preset {cluster.partition(':')[0]!r} (known: {', '.join(CLUSTER_PRESETS)}); "
                                   "the server reads no files: send a description as cluster_description")
    for key, value in (settings or {}).items():
        if isinstance(value, str) and ("/" in value or value.endswith((".yaml", ".yml", ".json"))):
            raise UserError(key, "looks like a file name; the server reads no files: send the content")


def digest_of(value: Any) -> str:
    return hashlib.sha256(dumps(value).encode()).hexdigest()


def resolve(kind: str, req: dict[str, Any], options: Mapping[str, Any],
            settings: Mapping[str, Any] | None = None) -> str:
    """Validate ``req`` for ``kind``; returns the digest of its resolved inputs (the cache key)."""
    from stage_cosim import api

    check_no_server_paths(req, settings)
    if kind in ("optimize", "explore"):
        model = api.model_of(req).to_dict()
        return digest_of({"v": __version__, "kind": kind, "model": model, "request": req})
    api.check_request(req)
    model, parallel = api.model_of(req), api.parallel_of(req)
    resolved: dict[str, Any] = {"v": __version__, "kind": kind, "model": model.to_dict(),
                                "parallel": parallel.to_dict(), "options": dict(options)}
    if kind == "simulate":
        network = req.get("network_model") or "calibrated"
        if network not in NETWORK_MODELS:
            raise UserError("network-model", f"must be one of {', '.join(NETWORK_MODELS)}, got {network!r}")
        # with an uploaded trace set the GPU count comes from its files; the description still counts
        gpus = 1 if options.get("traces") else parallel.world_size
        resolved.update(cluster=api.cluster_of(req, gpus).to_dict(), network_model=network,
                        backend=req.get("backend") or "roofline")
    return digest_of(resolved)
