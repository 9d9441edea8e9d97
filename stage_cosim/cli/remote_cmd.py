"""``stage-cosim remote …``: the gRPC bridge from the command line (the client side).

``remote simulate``, ``synth``, ``optimize``, ``explore`` and ``serve-sim`` take the local
commands' own flags (the same click parameters) and print what the local commands print;
``remote simulate --json`` prints exactly what ``simulate --json`` prints. Server errors become
the usual one-line ``error: <parameter>: <rule>`` with exit status 2; a job that fails for another
reason prints its error and the end of its log, exit status 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click

from stage_cosim.cli import explore_cmd, optimize_cmd, serve_sim_cmd, simulate_cmd, synth_cmd
from stage_cosim.errors import UserError

# -- remote: shared pieces --------------------------------------------------------------------------------

def connection_options(f: Callable) -> Callable:
    for option in reversed((
        click.option("--server", envvar="STAGE_COSIM_SERVER", show_envvar=True, default="127.0.0.1:50051",
                     show_default=True, metavar="HOST:PORT", help="The bridge server."),
        click.option("--token", envvar="STAGE_COSIM_TOKEN", show_envvar=True, default=None,
                     help="Bearer token the server requires."),
        click.option("--tls-ca", type=click.Path(path_type=Path), default=None,
                     help="Use TLS, trusting this CA certificate (PEM)."),
        click.option("--tls", is_flag=True, help="Use TLS with the system's trusted CAs."),
    )):
        f = option(f)
    return f


def job_options(f: Callable) -> Callable:
    for option in reversed((
        click.option("--detach", is_flag=True, help="Print the job id and return at once."),
        click.option("--request-id", default=None, help="Idempotency key: resubmitting it returns the same job."),
        click.option("--job-timeout", type=float, default=0.0, help="Run-time limit, seconds (0: the server's)."),
        click.option("--no-cache", is_flag=True, help="Compute even if the same inputs were computed before."),
    )):
        f = option(f)
    return f


CONNECTION_KEYS = ("server", "token", "tls_ca", "tls")
JOB_KEYS = ("detach", "request_id", "job_timeout", "no_cache")


def _client(kw: dict[str, Any]):  # noqa: ANN202 (Client)
    from stage_cosim.bridge import Client

    tls_ca = kw.pop("tls_ca")
    if tls_ca is not None and not Path(tls_ca).is_file():
        raise UserError("tls-ca", f"{tls_ca}: no such file")
    return Client(kw.pop("server"), token=kw.pop("token") or None, tls_ca=tls_ca, tls=kw.pop("tls"), retries=3)


class JobError(click.ClickException):
    """A job failed for a reason other than bad input: its error, then the end of its log."""

    exit_code = 1


def _errors(fn: Callable) -> Callable:
    """Bridge errors as the CLI reports errors: one line naming the parameter, or the job's log."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from stage_cosim.bridge import BridgeError, JobFailed

        try:
            return fn(*args, **kwargs)
        except BridgeError as exc:
            import grpc

            if exc.code == grpc.StatusCode.UNAVAILABLE and not exc.reason:
                raise UserError("server", f"cannot reach the bridge ({exc.message.splitlines()[0]})") from None
            field = exc.field or ("token" if exc.code == grpc.StatusCode.UNAUTHENTICATED else "server")
            rule = exc.message.split(": ", 1)[1] if exc.message.startswith(f"{field}: ") else exc.message
            raise UserError(field.replace("_", "-"), rule) from None
        except JobFailed as exc:
            job = exc.job
            if job.error_parameter:
                prefix = f"{job.error_parameter}: "
                raise UserError(job.error_parameter, job.error[len(prefix):] if job.error.startswith(prefix)
                                else job.error) from None
            tail = "".join(f"\n  | {line}" for line in job.log_excerpt[-20:])
            raise JobError(f"{exc}{tail}") from None

    return wrapper


def _wait(client: Any, job_id: str, progress: bool) -> Any:
    """Wait for a job, showing its progress on a terminal's stderr; the job's result."""
    from stage_cosim.bridge.jobs import STATE_NAMES

    def show(event: Any) -> None:
        if event.HasField("progress"):
            p = event.progress
            best = f", best so far {p.best_json[:80]}" if p.best_json else ""
            total = f"/{p.total}" if p.total else ""
            click.echo(f"\r{job_id}: {p.done}{total}{best}".ljust(100), err=True, nl=False)
        elif event.HasField("state"):
            click.echo(f"\r{job_id}: {STATE_NAMES[event.state.state]}".ljust(100), err=True, nl=False)

    show_it = progress and sys.stderr.isatty()
    job = client.wait(job_id, on_event=show if show_it else None)
    if show_it:
        click.echo("\r" + " " * 100 + "\r", err=True, nl=False)
    return client.result(job)


def _submit(client: Any, kind: str, req: dict[str, Any], kw: dict[str, Any], **extra: Any) -> Any:
    return client.submit(kind, req, request_id=kw["request_id"], timeout_s=kw["job_timeout"],
                         no_cache=kw["no_cache"], **extra)


# -- remote ------------------------------------------------------------------------------------------------

@click.group()
def remote() -> None:
    """Run commands on a bridge server ('stage-cosim serve'): same flags, same output."""


def _local_params(command: click.Command) -> list[click.Parameter]:
    return [p for p in command.params if p.name not in ("help",)]


@remote.command("simulate")
@connection_options
@job_options
@_errors
def remote_simulate(**kw: Any) -> None:
    """Simulate one training step on the server (the flags of 'stage-cosim simulate')."""
    from stage_cosim.cli.remote_flags import (MODEL_FLAGS, PARALLEL_FLAGS, check_locally, model_request,
                                          parallel_request, passthrough)
    from stage_cosim.result import RoleResult, SimResult

    model, _ = check_locally(kw)
    traces, full, timeline, as_json = kw["traces"], kw["full"], kw["timeline"], kw["as_json"]
    if kw.get("emit") is not None and (traces is not None or kw.get("phase") not in (None, "train")):
        raise UserError("emit", "writes a training configuration's launch arguments (not with --traces or "
                                "--phase prefill|decode)")
    if traces is not None and not traces.is_dir():
        raise UserError("traces", f"{traces} is not a directory")
    req = {**model_request(kw), **parallel_request(kw), "cluster": kw["cluster"], "network_model": kw["network_model"]}
    handled = {*CONNECTION_KEYS, *JOB_KEYS, *MODEL_FLAGS, *PARALLEL_FLAGS, "traces", "full", "timeline", "as_json",
               "cluster", "network_model", "emit"}
    req.update(passthrough(kw, handled, simulate_cmd.simulate.params))
    with _client(kw) as client:
        from stage_cosim.bridge.client import localize, name_traces

        req = localize(req)
        upload = client.upload(traces).upload_id if traces is not None else ""
        job = _submit(client, "simulate", req, kw, traces_upload=upload, full=full, timeline=timeline is not None)
        if kw["detach"]:
            click.echo(job.id)
            return
        result = _wait(client, job.id, progress=False)
        name_traces(result, upload, traces)
        if timeline is not None:
            client.download_file(job.id, "timeline.json", timeline)
    from stage_cosim.cli.emit import print_launch, try_launch

    launch, refused = try_launch(kw.get("emit"), model, result)
    if as_json:
        click.echo(json.dumps({**result, **({"launch": launch.to_dict()} if launch else {})}, indent=1))
    else:
        roles = [RoleResult(**r) for r in result.get("roles", [])]
        fields = {k: v for k, v in result.items() if k in SimResult.__dataclass_fields__ and k != "roles"}
        simulate_cmd.print_summary(SimResult(**fields, roles=roles))
        if timeline is not None:
            click.echo(f"\ntimeline: {timeline} (open in https://ui.perfetto.dev)")
        print_launch(launch)
    if refused is not None:
        raise refused


remote_simulate.params[:0] = _local_params(simulate_cmd.simulate)


@remote.command("synth")
@connection_options
@job_options
@_errors
def remote_synth(**kw: Any) -> None:
    """Synthesize traces on the server and download them (the flags of 'stage-cosim synth')."""
    from stage_cosim.cli.remote_flags import check_locally, model_request, parallel_request
    from stage_cosim.trace.writer import atomic_directory

    model, parallel = check_locally(kw)
    out, fmt, force, quiet = kw["out"], kw["fmt"], kw["force"], kw["quiet"]
    req = {**model_request(kw), **parallel_request(kw)}
    t0 = time.perf_counter()
    with _client(kw) as client:
        from stage_cosim.bridge.client import localize

        job = _submit(client, "synthesize", localize(req), kw, format=fmt)
        if kw["detach"]:
            click.echo(job.id)
            return
        with atomic_directory(out, force) as scratch:      # a failure leaves nothing behind
            manifest = _wait(client, job.id, progress=not quiet)
            client.download(job.id, scratch, prefix="traces/", strip="traces/")
    elapsed = time.perf_counter() - t0
    if not quiet:
        synth_cmd.print_summary(model, parallel, manifest, out, elapsed)


remote_synth.params[:0] = _local_params(synth_cmd.synth)


@remote.command("optimize")
@connection_options
@job_options
@_errors
def remote_optimize(**kw: Any) -> None:
    """Find the best parallelization on the server (the flags of 'stage-cosim optimize').

    Every search flag travels under its own name (--global-batch as global_batch, --top as top);
    the output flags (--json, --plot, --quiet) act here; progress shows the best so far.
    """
    from stage_cosim.bridge.client import localize
    from stage_cosim.cli.remote_flags import MODEL_FLAGS, check_locally, model_request, param_default
    from stage_cosim.bridge.resolve import SERVER_SETTINGS

    model, _ = check_locally(kw, parallel=False)
    local = {"as_json", "plot", "quiet", "cluster", "emit", *MODEL_FLAGS, *CONNECTION_KEYS, *JOB_KEYS}
    if kw.get("emit") is not None and kw.get("phase") == "serve":
        raise UserError("emit", "writes a training configuration's launch arguments (not with --phase serve)")
    req = {**model_request(kw), "cluster": kw["cluster"]}
    for param in optimize_cmd.optimize.params:
        if _flag_key(param) in SERVER_SETTINGS:           # the server's processes are its operator's
            if kw.get(param.name) != param_default(param):
                raise UserError(max(param.opts, key=len).lstrip("-"), "is set by the server's operator "
                                f"(serve {SERVER_SETTINGS[_flag_key(param)]}), not by a remote command")
        elif param.name not in local and kw.get(param.name) is not None:
            req[_flag_key(param)] = kw[param.name]
    with _client(kw) as client:
        job = _submit(client, "optimize", localize(req), kw)
        if kw["detach"]:
            click.echo(job.id)
            return
        doc = _wait(client, job.id, progress=not (kw["quiet"] or kw["as_json"]))
    from stage_cosim.cli.emit import print_launch, try_launch

    launch, refused = try_launch(kw.get("emit"), model, doc.get("best"))
    if launch is not None:
        doc["launch"] = launch.to_dict()
    if kw.get("plot") is not None and doc.get("top"):
        optimize_cmd.plot_top(doc, kw["plot"])
    if kw["as_json"]:
        click.echo(json.dumps(doc, indent=1))
    else:
        from stage_cosim.search.evaluate import Objective

        optimize_cmd.print_report(doc, Objective(kw["objective"], kw.get("price") or 0.0), kw["top_k"])
        print_launch(launch)
    if doc.get("interrupted"):
        raise click.exceptions.Exit(130)
    if refused is not None:
        raise refused


remote_optimize.params[:0] = _local_params(optimize_cmd.optimize)


def _flag_key(param: click.Parameter) -> str:
    """A flag's name in the request vocabulary: its long option, '-' as '_' (--top -> top)."""
    longest = max(param.opts, key=len)
    return longest.lstrip("-").replace("-", "_")


@remote.command("explore")
@connection_options
@job_options
@_errors
def remote_explore(**kw: Any) -> None:
    """Explore hardware designs on the server (the arguments of 'stage-cosim explore').

    SPEC is read here and its content sent; its settings are the request.
    """
    from stage_cosim.bridge.client import localize
    from stage_cosim.files import read_yaml

    spec: Path = kw["spec"]
    doc = read_yaml(spec, "spec")
    if not isinstance(doc, dict):
        raise UserError("spec", f"{spec}: expected a mapping")
    from stage_cosim.search.explore_spec import spec_from_dict

    settings = spec_from_dict(doc, str(spec))   # the local checks and messages, before anything is sent
    with _client(kw) as client:
        job = _submit(client, "explore", localize(doc), kw)
        if kw["detach"]:
            click.echo(job.id)
            return
        result = _wait(client, job.id, progress=not (kw["quiet"] or kw["as_json"]))
    if kw.get("plot") is not None:
        explore_cmd.plot_frontier(result, kw["plot"])
    if kw["as_json"]:
        click.echo(json.dumps(result, indent=1))
    else:
        explore_cmd.print_report(result, settings)


remote_explore.params[:0] = _local_params(explore_cmd.explore)


@remote.command("serve-sim")
@connection_options
@job_options
@_errors
def remote_serve_sim(**kw: Any) -> None:
    """Simulate serving a request stream on the server (the flags of 'stage-cosim serve-sim').

    A --trace file is read here and its requests sent inline; --json, --plot and --quiet act here.
    """
    from stage_cosim.bridge.client import localize
    from stage_cosim.files import FIGURE_SUFFIXES, check_output

    plot, as_json, quiet, rates = kw["plot"], kw["as_json"], kw["quiet"], kw["rates"]
    check_output(plot, "plot", FIGURE_SUFFIXES)
    local = {"plot", "as_json", "quiet", "rates", "arch", *CONNECTION_KEYS, *JOB_KEYS}
    if kw.get("arch") is not None:
        raise UserError("arch", "serve-sim takes a model by --model (a preset or config.json)")
    # the request the local command builds from the same flags
    req = {k: v for k, v in kw.items() if v is not None and k not in local}
    if plot is not None:
        if rates is None and req.get("rate") is None:
            raise UserError("plot", "sweeps the arrival rate: give --rate (or --rates)")
        req["rates"] = rates or ",".join(f"{f * req['rate']:g}" for f in serve_sim_cmd.SWEEP)
    elif rates is not None:
        raise UserError("rates", "is the sweep of --plot")
    with _client(kw) as client:
        job = _submit(client, "serve_sim", localize(req), kw)
        if kw["detach"]:
            click.echo(job.id)
            return
        report = _wait(client, job.id, progress=not (quiet or as_json))
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        serve_sim_cmd.print_report(report)
    if plot is not None:
        try:
            serve_sim_cmd.plot_sweep(report["runs"], plot)
        except OSError as exc:
            raise UserError("plot", f"{plot}: could not be written ({exc.strerror or exc})") from None
        if not as_json:
            click.echo(f"plot             {plot} (latency against load, {len(report['runs'])} rates)")


remote_serve_sim.params[:0] = _local_params(serve_sim_cmd.serve_sim)


# -- remote: jobs ------------------------------------------------------------------------------------------

def _job_line(job: Any) -> str:
    from stage_cosim.bridge.jobs import STATE_NAMES

    progress = f" {job.progress.done}/{job.progress.total}" if job.progress.total else ""
    cached = " (cached)" if job.cached else ""
    error = f"  {job.error}" if job.error else ""
    return f"{job.id}  {job.kind:<10} {STATE_NAMES[job.state]:<10}{progress}{cached}{error}"


@remote.command("status")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@connection_options
@_errors
def remote_status(job_id: str | None, as_json: bool, **kw: Any) -> None:
    """A job's state, progress and error; without JOB_ID, the server and its jobs."""
    from google.protobuf.json_format import MessageToDict

    with _client(kw) as client:
        if job_id:
            job = client.job(job_id)
            if as_json:
                doc = MessageToDict(job, preserving_proto_field_name=True)
                doc.pop("result_json", None)
                click.echo(json.dumps(doc, indent=1))
                return
            click.echo(_job_line(job))
            if job.progress.best_json:
                click.echo(f"best so far: {job.progress.best_json}")
            for line in job.log_excerpt:
                click.echo(f"  | {line}")
            return
        info = client.server_info()
        jobs = list(client.jobs())
        if as_json:
            click.echo(json.dumps({"server": MessageToDict(info, preserving_proto_field_name=True),
                                   "jobs": [MessageToDict(j, preserving_proto_field_name=True) for j in jobs]}, indent=1))
            return
        memory = f"{info.max_job_memory_bytes >> 20:,} MiB per job" if info.max_job_memory_bytes else "no memory limit"
        click.echo(f"{client.address}: stage-cosim {info.version}, {client.health()}, {info.running} running, "
                   f"{info.queued} queued of {info.max_queue}, {info.workers} workers, {memory}"
                   f"{', draining' if info.draining else ''}")
        for job in jobs:
            click.echo(_job_line(job))


@remote.command("cancel")
@click.argument("job_id")
@connection_options
@_errors
def remote_cancel(job_id: str, **kw: Any) -> None:
    """Cancel a job (a running one's processes are killed)."""
    with _client(kw) as client:
        click.echo(_job_line(client.cancel(job_id)))


@remote.command("watch")
@click.argument("job_id")
@click.option("--after", type=int, default=0, show_default=True, help="Only events after this sequence number.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event.")
@connection_options
@_errors
def remote_watch(job_id: str, after: int, as_json: bool, **kw: Any) -> None:
    """Follow a job's events until it ends (Ctrl-C stops watching, not the job)."""
    from google.protobuf.json_format import MessageToDict

    from stage_cosim.bridge.jobs import STATE_NAMES

    with _client(kw) as client:
        for event in client.watch(job_id, after_seq=after):
            if as_json:
                click.echo(json.dumps(MessageToDict(event, preserving_proto_field_name=True)))
                continue
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            if event.HasField("state"):
                msg = f" {event.state.message}" if event.state.message else ""
                click.echo(f"{event.seq:>5} {stamp} state {STATE_NAMES[event.state.state]}{msg}")
            elif event.HasField("progress"):
                p = event.progress
                best = f" best {p.best_json}" if p.best_json else ""
                click.echo(f"{event.seq:>5} {stamp} progress {p.done}/{p.total or '?'}{best}")
            elif event.HasField("log"):
                click.echo(f"{event.seq:>5} {stamp} {event.log.stream}: {event.log.line}")


@remote.command("result")
@click.argument("job_id")
@connection_options
@_errors
def remote_result(job_id: str, **kw: Any) -> None:
    """Wait for a job and print its result as JSON (what the local command prints with --json)."""
    with _client(kw) as client:
        click.echo(json.dumps(client.result(job_id), indent=1))


@remote.command("download")
@click.argument("job_id")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory to write into.")
@click.option("--prefix", default="", help="Only artifacts under this path (e.g. traces/).")
@connection_options
@_errors
def remote_download(job_id: str, out: Path, prefix: str, **kw: Any) -> None:
    """Download a finished job's artifacts (resumes an interrupted download)."""
    with _client(kw) as client:
        files = client.download(job_id, out, prefix=prefix)
    click.echo(f"downloaded {len(files)} files to {out}")


@remote.command("upload")
@click.argument("directory", type=click.Path(path_type=Path))
@connection_options
@_errors
def remote_upload(directory: Path, **kw: Any) -> None:
    """Upload a trace set; prints its id (for 'simulate' jobs of other clients)."""
    with _client(kw) as client:
        up = client.upload(directory)
    click.echo(f"{up.upload_id}  {len(up.files)} files, {up.total_bytes} bytes")
