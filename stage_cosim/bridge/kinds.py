"""What each job kind does, inside a worker process.

Each runner takes the request (the project's vocabulary), the kind's options, the job's
artifact directory and a reporter, and returns the result as plain data — exactly what the local
command prints with ``--json``. Library functions do the work; the runners only wire them up:

* simulate: ``stage_cosim.api.simulate``; the three ``simulate`` flags outside the request
  vocabulary (``--traces``, ``--full``, ``--timeline``) take the same library calls as
  ``stage_cosim/cli/simulate_cmd.py`` does.
* synthesize: ``stage_cosim.api.synth`` into ``traces/``; the result is the manifest.
* optimize, explore: ``stage_cosim.api.optimize`` / ``explore``, looked up when the job runs
  (they arrive later than the bridge; a missing one fails the job, it does not break the server).
* serve_sim: ``stage_cosim.api.serve_sim`` (looked up the same way); its progress callback's
  (requests done, total) become the job's progress.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from stage_cosim.bridge.resolve import SEARCHES
from stage_cosim.errors import UserError
from stage_cosim.trace.formats import FORMATS

KINDS = ("simulate", "synthesize", "optimize", "explore", "serve_sim")
TRACES_DIR = "traces"
TIMELINE_FILE = "timeline.json"


class Reporter(Protocol):
    def progress(self, done: int, total: int, detail: Mapping[str, Any] | None = None) -> None: ...
    def should_stop(self) -> bool: ...


def run(kind: str, req: dict[str, Any], options: Mapping[str, Any], out: Path, report: Reporter,
        server: Mapping[str, Any] | None = None) -> Any:
    """``server``: the operator's process settings (``search_workers``, ``ray``), never a request's."""
    if kind == "simulate":
        return simulate(req, options, out)
    if kind == "synthesize":
        return synthesize(req, options, out, report)
    if kind in SEARCHES:
        return search(kind, req, report, server or {})
    if kind == "serve_sim":
        return serve_sim(req, report)
    raise UserError("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")


def simulate(req: dict[str, Any], options: Mapping[str, Any], out: Path) -> dict[str, Any]:
    from stage_cosim import api

    traces, full, timeline = options.get("traces"), bool(options.get("full")), bool(options.get("timeline"))
    if not (traces or full or timeline):
        return api.simulate(req)
    # Beyond api.simulate's vocabulary: the calls of `stage-cosim simulate` for these flags.
    from stage_cosim.adapters.simulate import simulate_traces
    from stage_cosim.adapters.roofline.timeline import timeline_events, write_timeline
    from stage_cosim.workload import synthesize as synth_workload

    api.check_request(req)
    backend = req.get("backend") or "roofline"
    if backend != "roofline":
        raise UserError("backend", "traces, full and timeline need the roofline backend")
    network_model = str(req.get("network_model") or "calibrated")
    if traces:
        directory = Path(traces)
        n = len([p for p in directory.iterdir() if p.suffix in (".et", ".json") and p.stem.rsplit(".", 1)[-1].isdigit()])
        result, rep, programs = simulate_traces(directory, api.cluster_of(req, n), network_model)
        names = None
    else:
        model, parallel = api.model_of(req), api.parallel_of(req)
        cluster = api.cluster_of(req, parallel.world_size)
        workload = synth_workload(model, parallel, cluster.gpu, inference=api.inference_of(req))
        result, rep, programs = _replay(workload, cluster, network_model, full, timeline)
        names = [[n.name for n in workload.role(workload.role_of(p.rank)).nodes] for p in programs or []]
    if timeline:
        labels = names or [[f"node{i}" for i in p.ids] for p in programs]
        write_timeline(out / TIMELINE_FILE, timeline_events(programs, rep, labels))
    doc = result.to_dict()
    if traces and doc.get("config", {}).get("traces") == str(traces):
        # the server's directory means nothing to the client, which puts back its own name
        doc["config"]["traces"] = f"upload:{options.get('traces_upload', '')}"
    return doc


def _replay(workload: Any, cluster: Any, network_model: str, full: bool, timeline: bool) -> tuple[Any, Any, Any]:
    """(result, replay, programs) as ``stage-cosim simulate`` computes them for --full and --timeline:
    every rank replayed node by node (``simulate_every_rank``, where the simulator has it); else
    the usual replay, and for a timeline a node-level replay of its own, whose record it draws."""
    from stage_cosim.adapters import simulate as simulator

    every_rank = getattr(simulator, "simulate_every_rank", None)
    if full and every_rank is not None:
        return every_rank(workload, cluster, network_model)
    if full:
        return simulator.simulate(workload, cluster, network_model, symmetric=False, exact=True if timeline else None)
    exact = True if timeline and network_model == "astra" else None
    result, rep, programs = simulator.simulate(workload, cluster, network_model, exact=exact)
    if timeline and rep is None:
        _, rep, programs = simulator.simulate(workload, cluster, network_model, exact=True)
    return result, rep, programs


def synthesize(req: dict[str, Any], options: Mapping[str, Any], out: Path, report: Reporter) -> dict[str, Any]:
    from stage_cosim import api

    fmt = str(options.get("format") or "chakra")
    if fmt not in FORMATS:
        raise UserError("format", f"must be {' or '.join(FORMATS)}, got {fmt!r}")
    return api.synth(req, out / TRACES_DIR, fmt=fmt, force=False,
                     progress=lambda done, total: report.progress(done, total))


def search(kind: str, req: dict[str, Any], report: Reporter, server: Mapping[str, Any]) -> Any:
    import stage_cosim.api as api

    if kind == "optimize":      # the operator's processes: a request cannot name them (resolve.py)
        if server.get("search_workers", 1) != 1:
            req["workers"] = int(server["search_workers"])
        if server.get("ray"):
            req["ray"] = str(server["ray"])

    fn: Callable[..., Any] | None = getattr(api, kind, None)
    if fn is None:
        raise UserError(kind, f"is not available in this build (stage_cosim.api.{kind} is missing)")

    total = int(req.get("budget" if kind == "optimize" else "candidates") or 0)
    fastest: dict[str, Any] | None = None

    def progress(detail: Mapping[str, Any]) -> None:
        # best-so-far in one place whatever the search reports: its own "best", optimize's
        # best_point/best_score, or (explore reports each candidate) the fastest candidate yet
        nonlocal fastest
        detail = dict(detail)
        if "best" not in detail and detail.get("best_point") is not None:
            detail["best"] = {"point": detail["best_point"], "score": detail.get("best_score")}
        elif "best" not in detail and detail.get("step_time_s") is not None:
            if fastest is None or detail["step_time_s"] < fastest["step_time_s"]:
                fastest = {k: detail[k] for k in ("values", "step_time_s", "cost_per_gpu") if k in detail}
            detail["best"] = fastest
        done = detail.get("done", detail.get("evaluations", detail.get("candidates", 0)))
        report.progress(int(done or 0), int(detail.get("total", total) or 0), detail)

    return fn(req, progress=progress, should_stop=report.should_stop)


def serve_sim(req: dict[str, Any], report: Reporter) -> Any:
    import stage_cosim.api as api

    fn: Callable[..., Any] | None = getattr(api, "serve_sim", None)
    if fn is None:
        raise UserError("serve_sim", "is not available in this build (stage_cosim.api.serve_sim is missing)")
    return fn(req, progress=lambda done, total: report.progress(int(done), int(total)))
