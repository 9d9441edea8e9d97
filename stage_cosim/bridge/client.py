"""The Python client: ``Client("host:port").simulate(model="llama3-8b", tp=2)`` -> the result dict.

Retries are safe: every submit carries a request id (a fresh UUID unless you give one) that the
server uses to return the job it already created; uploads are content-addressed; watches resume
from the last event seen; downloads resume from the bytes already on disk. Calls are retried on
UNAVAILABLE (server restarting, connection dropped) and, when the server says how long to wait,
on a full queue.

Files the user names (a Hugging Face config.json, a cluster YAML file, a trace directory, a
serving simulation's request trace) are read here, on the client: the server never reads a
client's paths.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import grpc

from stage_cosim.bridge.codec import design_from_request
from stage_cosim.bridge.jobs import FINAL, STATE_NAMES
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2_grpc as pb_grpc
from stage_cosim.bridge.status import detail_of
from stage_cosim.bridge.uploads import CHUNK_BYTES
from stage_cosim.errors import UserError
from stage_cosim.files import read_yaml
from stage_cosim.model.hf import model_name, read_hf_config

T = TypeVar("T")
DEFAULT_SERVER = "127.0.0.1:50051"
HEARTBEATS_MISSED = 3
# Keepalive: ping the server every 10 s on a quiet connection, give it up after 5 s without an
# answer (the server accepts pings every 5 s).
KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
             ("grpc.http2.max_pings_without_data", 0)]
RESULT_FILE = "result.json"
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}


class BridgeError(Exception):
    """An RPC failed; ``field`` names the input at fault when the server said so."""

    def __init__(self, code: grpc.StatusCode, message: str, detail: pb.ErrorDetail | None = None) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.reason = detail.reason if detail else ""
        self.field = detail.field if detail else ""
        self.retry_after_s = detail.retry_after_s if detail else 0.0

    @classmethod
    def of(cls, error: grpc.RpcError) -> "BridgeError":
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        return cls(code, details or code.name, detail_of(error))


class JobFailed(Exception):
    """A job ended FAILED or CANCELLED; ``job`` holds the error, its parameter and a log excerpt."""

    def __init__(self, job: pb.Job) -> None:
        state = STATE_NAMES[job.state]
        super().__init__(f"job {job.id} {state}: {job.error}" if job.error else f"job {job.id} {state}")
        self.job = job
        self.parameter = job.error_parameter
        self.log_excerpt = list(job.log_excerpt)


# -- files the user names ---------------------------------------------------------------------------

def localize(req: Mapping[str, Any]) -> dict[str, Any]:
    """Replace local file names in a request by their content (``model``, ``cluster``, ``baseline``,
    and a serving simulation's ``trace``, which becomes inline ``requests`` rows).

    The result means on the server what the names mean here: the model's and the cluster's names
    are filled in the way the local readers would (from the file's folder, from the path).
    """
    from stage_cosim.model.presets import PRESETS

    out = dict(req)
    model = out.get("model")
    if isinstance(model, str) and model not in PRESETS:
        path = Path(model)
        if model.endswith(".json") or path.exists():
            cfg, file = read_hf_config(path)
            if isinstance(cfg, dict) and not cfg.get("_name_or_path"):
                cfg["_name_or_path"] = model_name(cfg, file)      # as the local reader names it
            out.pop("model")
            out["model_config"] = cfg
    for key in ("cluster", "baseline"):       # a cluster file (an explore spec's baseline too)
        value = out.get(key)
        if isinstance(value, str) and (value.endswith((".yaml", ".yml")) or Path(value).is_file()):
            doc = read_yaml(Path(value), key)
            if not isinstance(doc, dict):
                raise UserError(key, f"{value}: expected a mapping")
            doc.setdefault("name", value)
            out[key] = doc
    if isinstance(out.get("trace"), (str, Path)):
        out["requests"] = trace_rows(out)
        out.pop("trace")
    return out


def trace_rows(req: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The requests of a serving request's ``trace`` file (CSV or JSON lines) as inline rows,
    read and checked as ``serve-sim`` reads them locally (the same errors, in the same order);
    the server sorts and checks the rows as the local reader does."""
    from stage_cosim.api import requests_of

    reqs = requests_of({**req, "trace": str(req["trace"])})
    return [{"arrival_s": float(a), "input_len": int(i), "output_len": int(o)}
            for a, i, o in zip(reqs.arrival_s, reqs.input_len, reqs.output_len)]


def name_traces(result: Any, upload_id: str, traces: str | Path | None) -> None:
    """Put the client's trace directory back where the result names the uploaded copy."""
    config = result.get("config") if isinstance(result, dict) else None
    if traces is not None and isinstance(config, dict) and config.get("traces") == f"upload:{upload_id}":
        config["traces"] = str(Path(traces))


def file_digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# -- metadata ----------------------------------------------------------------------------------------

class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                    "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call on the channel."""

    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(d.metadata or []) + [self._pair]
        return _Details(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)


# -- silent streams --------------------------------------------------------------------------------

class _Watched:
    def __init__(self, call: Any, silence_s: float) -> None:
        self.call, self.silence_s = call, silence_s
        self.deadline = time.monotonic() + silence_s
        self.silent = False

    def heard(self) -> None:
        self.deadline = time.monotonic() + self.silence_s


class _Watchdog:
    """One thread (for all clients of the process) that cancels a watch stream heard nothing from
    for too long; it runs while there are streams to watch."""

    def __init__(self) -> None:
        self._watched: set[_Watched] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, call: Any, silence_s: float) -> _Watched:
        watched = _Watched(call, silence_s)
        with self._lock:
            self._watched.add(watched)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bridge-watchdog", daemon=True)
                self._thread.start()
        return watched

    def forget(self, watched: _Watched) -> None:
        with self._lock:
            self._watched.discard(watched)

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
                late = [w for w in self._watched if not w.silent and now > w.deadline]
            for w in late:
                w.silent = True
                w.call.cancel()


_WATCHDOG = _Watchdog()


# -- the client ----------------------------------------------------------------------------------------

class Client:
    """A connection to a bridge server. Use as a context manager or call ``close()``."""

    def __init__(self, address: str = DEFAULT_SERVER, *, token: str | None = None,
                 tls_ca: str | Path | bytes | None = None, tls: bool = False, retries: int = 5,
                 backoff_s: float = 0.2, timeout_s: float = 60.0, heartbeat_s: float = 2.0) -> None:
        self.address = address
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self._token = token
        self._credentials = None
        if tls or tls_ca is not None:
            ca = tls_ca if isinstance(tls_ca, (bytes, type(None))) else Path(tls_ca).read_bytes()
            self._credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        self._old_channels: list[grpc.Channel] = []
        self._watchdog = _WATCHDOG
        self._connect()

    def _connect(self) -> None:
        """A channel with its own connection (not shared with other channels to the address)."""
        options = [*KEEPALIVE, ("grpc.use_local_subchannel_pool", 1)]
        if self._credentials is not None:
            channel = grpc.secure_channel(self.address, self._credentials, options=options)
        else:
            channel = grpc.insecure_channel(self.address, options=options)
        self._raw_channel = channel
        self.channel = grpc.intercept_channel(channel, _BearerToken(self._token)) if self._token else channel
        self.stub = pb_grpc.BridgeStub(self.channel)

    def _reconnect(self) -> None:
        """Give up the connection (it went silent) for a new one; calls still on the old channel
        finish or fail there (it is closed with the client)."""
        self._old_channels.append(self._raw_channel)
        self._connect()

    def close(self) -> None:
        for channel in self._old_channels:
            channel.close()
        self._raw_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------------

    def _retry(self, call: Callable[[], T]) -> T:
        attempt = 0
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                err = BridgeError.of(exc)
                retry = err.code in _RETRYABLE or (err.reason == "QUEUE_FULL" and err.retry_after_s > 0)
                if not retry or attempt >= self.retries:
                    raise err from None
                attempt += 1
                time.sleep(max(err.retry_after_s, self.backoff_s * 2 ** (attempt - 1)))

    def _stream_backoff(self, exc: grpc.RpcError, attempt: int) -> int:
        """A dropped resumable stream: raise unless retryable and retries remain, else wait and
        return the next attempt number."""
        err = BridgeError.of(exc)
        if err.code not in _RETRYABLE:
            raise err from None
        return self._backoff(attempt, exc)

    def _backoff(self, attempt: int, exc: grpc.RpcError) -> int:
        if attempt >= self.retries:
            raise BridgeError.of(exc) from None
        time.sleep(self.backoff_s * 2 ** attempt)
        return attempt + 1

    def _unary(self, method: str, request: Any) -> Any:
        return self._retry(lambda: getattr(self.stub, method)(request, timeout=self.timeout_s))

    # -- jobs ------------------------------------------------------------------------------------------

    def submit(self, kind: str, request: Mapping[str, Any] | None = None, *, request_id: str | None = None,
               timeout_s: float = 0.0, no_cache: bool = False, traces_upload: str = "", full: bool = False,
               timeline: bool = False, format: str = "", settings: Mapping[str, Any] | None = None,
               **fields: Any) -> pb.Job:
        """Queue a job of ``kind`` (simulate, synthesize, optimize, explore, serve_sim); returns at once.

        ``request`` and ``fields`` are design keys (the api vocabulary); for optimize, explore and
        serve_sim, keys that are not design fields — and ``settings`` — are its settings.
        """
        from stage_cosim.bridge.codec import DESIGN_FIELDS

        req = localize({**(request or {}), **fields})
        msg = pb.SubmitJobRequest(request_id=request_id or str(uuid.uuid4()), timeout_s=timeout_s, no_cache=no_cache)
        if kind in ("optimize", "explore", "serve_sim"):
            extra = localize(settings or {})
            extra.update({k: v for k, v in req.items() if k not in DESIGN_FIELDS and k != "model_config"})
            design = {k: v for k, v in req.items() if k not in extra}
            body = pb.ServeSimJob if kind == "serve_sim" else pb.SearchJob
            getattr(msg, kind).CopyFrom(body(design=design_from_request(design),
                                             settings_json=json.dumps(extra) if extra else ""))
        elif kind == "simulate":
            msg.simulate.CopyFrom(pb.SimulateJob(design=design_from_request(req), traces_upload=traces_upload,
                                                 full=full, timeline=timeline))
        elif kind == "synthesize":
            msg.synthesize.CopyFrom(pb.SynthJob(design=design_from_request(req), format=format))
        else:
            raise UserError("kind", f"must be simulate, synthesize, optimize, explore or serve_sim, got {kind!r}")
        return self._unary("SubmitJob", msg)

    def job(self, job_id: str) -> pb.Job:
        """The job now (polling)."""
        return self._unary("GetJob", pb.GetJobRequest(job_id=job_id))

    def jobs(self, page_size: int = 100) -> Iterator[pb.Job]:
        """Every job the server knows, newest first."""
        token = ""
        while True:
            page = self._unary("ListJobs", pb.ListJobsRequest(page_size=page_size, page_token=token))
            yield from page.jobs
            token = page.next_page_token
            if not token:
                return

    def cancel(self, job_id: str) -> pb.Job:
        return self._unary("CancelJob", pb.CancelJobRequest(job_id=job_id))

    def watch(self, job_id: str, after_seq: int = 0, heartbeats: bool = False) -> Iterator[pb.JobEvent]:
        """The job's events after ``after_seq`` until its final state, resuming over dropped streams.

        The server sends a heartbeat every ``heartbeat_s`` while nothing happens; a stream that
        stays silent for ``HEARTBEATS_MISSED`` of them (a connection dropped without a word) is
        given up for a new connection, and the watch resumes where it was."""
        seq, attempt = after_seq, 0
        silence_s = HEARTBEATS_MISSED * self.heartbeat_s + 1.0
        while True:
            call = self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id, after_seq=seq, heartbeat_s=self.heartbeat_s))
            watched = self._watchdog.watch(call, silence_s)
            try:
                for event in call:
                    watched.heard()
                    attempt = 0
                    if event.HasField("heartbeat"):
                        if heartbeats:
                            yield event
                        continue
                    seq = event.seq
                    yield event
                    if event.HasField("state") and event.state.state in FINAL:
                        return
                if not watched.silent:
                    return
                self._reconnect()       # the stream ended without the final state
            except grpc.RpcError as exc:
                if not watched.silent:
                    attempt = self._stream_backoff(exc, attempt)
                    continue
                self._reconnect()
                attempt = self._backoff(attempt, exc)
            finally:
                self._watchdog.forget(watched)
                call.cancel()

    def wait(self, job_id: str, on_event: Callable[[pb.JobEvent], None] | None = None) -> pb.Job:
        """Watch until the job is final; returns the final job."""
        for event in self.watch(job_id):
            if on_event is not None:
                on_event(event)
            if event.HasField("state") and event.state.state in FINAL:
                return event.state.job
        return self.job(job_id)

    def result(self, job: str | pb.Job) -> Any:
        """A finished job's result (parsed JSON); JobFailed if it failed or was cancelled."""
        job = self.wait(job) if isinstance(job, str) else job
        if job.state not in FINAL:
            job = self.wait(job.id)
        if job.state != pb.SUCCEEDED:
            raise JobFailed(job)
        if job.result_json:
            return json.loads(job.result_json)
        chunks = []
        for chunk in self._download_stream({"job_id": job.id}, RESULT_FILE, 0):
            chunks.append(chunk.data)
        return json.loads(b"".join(chunks))

    # -- one-call conveniences ------------------------------------------------------------------------

    def simulate(self, request: Mapping[str, Any] | None = None, *, traces: str | Path | None = None,
                 full: bool = False, timeline: str | Path | None = None, **fields: Any) -> dict[str, Any]:
        """Simulate one training step remotely; returns what ``stage-cosim simulate --json`` prints."""
        upload = self.upload(traces).upload_id if traces is not None else ""
        job = self.submit("simulate", request, traces_upload=upload, full=full, timeline=timeline is not None,
                          **fields)
        result = self.result(job.id)
        name_traces(result, upload, traces)
        if timeline is not None:
            self.download_file(job.id, "timeline.json", timeline)
        return result

    def synthesize(self, request: Mapping[str, Any] | None = None, *, out: str | Path, format: str = "chakra",
                   **fields: Any) -> dict[str, Any]:
        """Synthesize remotely and download the trace set into ``out``; returns the manifest."""
        job = self.submit("synthesize", request, format=format, **fields)
        manifest = self.result(job.id)
        self.download(job.id, out, prefix="traces/", strip="traces/")
        return manifest

    def optimize(self, request: Mapping[str, Any] | None = None, **fields: Any) -> Any:
        return self.result(self.submit("optimize", request, **fields).id)

    def explore(self, request: Mapping[str, Any] | None = None, **fields: Any) -> Any:
        return self.result(self.submit("explore", request, **fields).id)

    def serve_sim(self, request: Mapping[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """A serving simulation remotely; returns what ``stage-cosim serve-sim --json`` prints
        (== ``stage_cosim.api.serve_sim``). A ``trace`` file is read here and sent inline."""
        return self.result(self.submit("serve_sim", request, **fields).id)

    # -- data ------------------------------------------------------------------------------------------

    def upload(self, directory: str | Path) -> pb.Upload:
        """Upload every file under ``directory`` (a trace set); the server checks each digest."""
        from stage_cosim.bridge.paths import walk_files

        root = Path(directory)
        if not root.is_dir():
            raise UserError("traces", f"{root} is not a directory")
        names = walk_files(root)
        specs = []
        for name in names:
            size, digest = file_digest(root / name)
            specs.append(pb.FileSpec(path=name, size=size, sha256=digest))

        def messages() -> Iterator[pb.UploadTracesRequest]:
            yield pb.UploadTracesRequest(header=pb.UploadHeader(files=specs))
            for spec in specs:
                with open(root / spec.path, "rb") as f:
                    offset = 0
                    while data := f.read(CHUNK_BYTES):
                        yield pb.UploadTracesRequest(chunk=pb.FileChunk(path=spec.path, offset=offset, data=data))
                        offset += len(data)

        return self._retry(lambda: self.stub.UploadTraces(messages()))

    def artifacts(self, job_id: str = "", *, upload_id: str = "", prefix: str = "") -> list[pb.FileSpec]:
        owner = {"upload_id": upload_id} if upload_id else {"job_id": job_id}
        files: list[pb.FileSpec] = []
        token = ""
        while True:
            page = self._unary("ListArtifacts", pb.ListArtifactsRequest(**owner, prefix=prefix, page_token=token))
            files.extend(page.files)
            token = page.next_page_token
            if not token:
                return files

    def _download_stream(self, owner: Mapping[str, str], path: str, offset: int) -> Iterator[pb.DownloadChunk]:
        call = self.stub.Download(pb.DownloadRequest(**owner, path=path, offset=offset))
        try:
            yield from call
        finally:
            call.cancel()

    def download(self, job_id: str, dest: str | Path, *, prefix: str = "", strip: str = "",
                 upload_id: str = "") -> list[Path]:
        """Download a job's (or an upload's) files under ``prefix`` into ``dest``, less ``strip``."""
        owner = {"upload_id": upload_id} if upload_id else {"job_id": job_id}
        written = []
        for spec in self.artifacts(job_id, upload_id=upload_id, prefix=prefix):
            name = spec.path[len(strip):] if strip and spec.path.startswith(strip) else spec.path
            target = Path(dest) / name
            self._download_file(owner, spec, target)
            written.append(target)
        return written

    def download_file(self, job_id: str, path: str, target: str | Path, *, upload_id: str = "") -> Path:
        """Download one file to ``target``.

        It is written to ``<target>.part`` first, continued from its size after a dropped stream
        or an interrupted earlier call, checked against the server's SHA-256, then renamed.
        """
        owner = {"upload_id": upload_id} if upload_id else {"job_id": job_id}
        spec = next((s for s in self.artifacts(job_id, upload_id=upload_id, prefix=path) if s.path == path), None)
        if spec is None:
            raise BridgeError(grpc.StatusCode.NOT_FOUND, f"path: no file {path!r}")
        self._download_file(owner, spec, Path(target))
        return Path(target)

    def _download_file(self, owner: Mapping[str, str], spec: pb.FileSpec, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + ".part")
        attempt = 0
        while True:
            offset = part.stat().st_size if part.exists() else 0
            if offset > spec.size:
                part.unlink()
                offset = 0
            try:
                with open(part, "ab") as f:
                    if offset < spec.size or spec.size == 0:
                        for chunk in self._download_stream(owner, spec.path, offset):
                            f.write(chunk.data)
                break
            except grpc.RpcError as exc:
                attempt = self._stream_backoff(exc, attempt)
        size, digest = file_digest(part)
        if (size, digest) != (spec.size, spec.sha256):
            part.unlink()
            raise BridgeError(grpc.StatusCode.DATA_LOSS, f"sha256: {spec.path} arrived damaged (digest mismatch)")
        os.replace(part, target)

    # -- server ------------------------------------------------------------------------------------------

    def server_info(self) -> pb.ServerInfo:
        return self._unary("GetServerInfo", pb.GetServerInfoRequest())

    def health(self, service: str = "") -> str:
        """SERVING, NOT_SERVING, ... from the standard health service (answers without a token)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = self._retry(lambda: stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
