"""Submit-time checks of the kinds that hand their request to a library function: optimize,
explore and serve_sim.

Such a job would otherwise meet a bad setting only in its worker — after a queue slot, a process
and the imports — and fail there. Each check here runs the parsing the job will run, and none of
the work (no graph, no simulation), so a bad key or value is INVALID_ARGUMENT naming it before a
job exists:

* explore: ``search.explore_spec.spec_from_dict``, exactly what the worker calls first;
* optimize: the keys ``api.optimize`` accepts and the values its settings become (``Objective``,
  integers, fractions), as ``stage-cosim optimize``'s flags check them;
* serve_sim: the keys ``api.serve_sim`` accepts; the request stream, engine settings, latency
  targets and rates as ``api.requests_of`` / ``serving_of`` build them; the model, layout and
  cluster as ``api.deployment_of`` reads them (not its instance sizing, which builds a graph).

The server calls :func:`check` from the resolver (``resolve.py``) with local files switched off.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from stage_cosim.errors import UserError

# api.serve_sim's request: its own keys and the design keys a serving run takes (the phase, the
# batch and the context are the engine's; the backend is the roofline's)
SERVE_SIM_EXCLUDED = frozenset({"phase", "batch", "context_len", "backend"})
# optimize settings and what each must be (as stage-cosim optimize's flags take them)
_INTEGERS = {"seed": None, "budget": 1, "top": 1, "exhaustive_limit": 1, "global_batch": 1, "seq_len": 1}


def serve_sim_keys() -> frozenset[str]:
    from stage_cosim import api

    return frozenset(api.SERVE_KEYS | (api.REQUEST_KEYS - SERVE_SIM_EXCLUDED))


def check(kind: str, req: Mapping[str, Any]) -> None:
    """Raise a UserError naming the first bad field of ``req`` for ``kind`` (other kinds: nothing)."""
    checker: Callable[[Mapping[str, Any]], None] | None = {
        "optimize": check_optimize, "explore": check_explore, "serve_sim": check_serve_sim}.get(kind)
    if checker is None:
        return
    try:
        checker(req)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        # the library met a value of a type it did not expect: still the request's fault
        raise UserError("settings_json", f"is not a valid {kind} request ({exc.__class__.__name__}: "
                                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None


def _integer(req: Mapping[str, Any], key: str, minimum: int | None) -> None:
    value = req.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(key, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise UserError(key, f"must be at least {minimum}, got {value}")


def _number(req: Mapping[str, Any], key: str, low: float, high: float | None = None) -> None:
    """``req[key]`` (when given) a finite number in [low, high)."""
    value = req.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(key, f"must be a finite number, got {value!r}")
    if value < low or (high is not None and value >= high):
        span = f"in [{low:g}, {high:g})" if high is not None else f"at least {low:g}"
        raise UserError(key, f"must be {span}, got {value!r}")


def check_optimize(req: Mapping[str, Any]) -> None:
    from stage_cosim import api
    from stage_cosim.search.evaluate import Objective

    allowed = api.REQUEST_KEYS | api.OPTIMIZE_KEYS
    for key in req:
        if key not in allowed:
            raise UserError(key, "is not an optimize request field")
    for key in ("global_batch", "seq_len", "cluster"):
        if not req.get(key):
            raise UserError(key, "is required for optimize")
    for key, minimum in _INTEGERS.items():
        _integer(req, key, minimum)
    _number(req, "price", 0.0)
    _number(req, "headroom", 0.0, 1.0)
    objective = req.get("objective") or "step-time"
    if not isinstance(objective, str):
        raise UserError("objective", f"must be a name, got {objective!r}")
    Objective(objective, float(req.get("price") or 0.0))
    if not isinstance(req.get("allow_cross_domain_tp", False), bool):
        raise UserError("allow_cross_domain_tp", f"must be true or false, got {req['allow_cross_domain_tp']!r}")


def check_explore(req: Mapping[str, Any]) -> None:
    from stage_cosim.search.explore_spec import spec_from_dict

    spec_from_dict(dict(req), "request")


def check_serve_sim(req: Mapping[str, Any]) -> None:
    from stage_cosim import api
    from stage_cosim.inference.config import InferenceConfig

    allowed = serve_sim_keys()
    for key in req:
        if key not in allowed:
            raise UserError(key, "is not a serve-sim request field")
    _integer(req, "seed", None)          # the stream takes any seed; numpy's generator does not
    api.requests_of(req)                 # the stream or the inline rows (a trace was refused before)
    serving, _ = api.serving_of(req)
    api.model_of(req)
    par_req = {k: v for k, v in req.items() if k in api.PARALLEL_KEYS}
    for key in ("micro_batch", "global_batch", "seq_len"):
        if par_req.get(key) is not None:
            raise UserError(key, "is a training or single-step field; a serving run batches requests itself "
                                 "(--max-num-seqs, --chunk-tokens)")
    parallel = api.parallel_of(par_req)
    InferenceConfig("decode", **{k: req[k] for k in api.SERVE_INFERENCE_KEYS if req.get(k) is not None})
    gpus = (serving.prefill_gpus + serving.decode_gpus) if serving.disaggregated else parallel.world_size
    api.cluster_of(req, gpus)
    if req.get("rates"):
        api._rates(req["rates"])         # the worker's own parsing of the sweep  # noqa: SLF001
