"""The gRPC server: the ``stagecosim.v1.Bridge`` service, health, reflection, auth, drain.

One asyncio loop (``grpc.aio``) serves every call; jobs run in worker processes, so a watch
stream costs an awaiting coroutine and nothing more: thousands of open streams do not starve
other calls. ``BridgeServer`` is the embeddable piece (tests and notebooks start one with
:func:`start_in_thread`); ``serve`` runs one until SIGTERM or SIGINT, then drains: health turns
NOT_SERVING, new submits are refused, running jobs get ``drain_timeout_s`` to finish and are
cancelled after it.

Safe by default: the host is 127.0.0.1; with a token, every call but the health service must
carry ``authorization: Bearer <token>``; TLS with a certificate and key.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import hmac
import inspect
import logging
import math
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from stage_cosim import __version__
from stage_cosim.bridge import jobs as J
from stage_cosim.bridge.artifacts import ArtifactIndex, IndexCache, PageCache
from stage_cosim.bridge.codec import loads_object, request_from_design
from stage_cosim.bridge.documents import DocumentLimits, check_request_size
from stage_cosim.bridge.fair import FairGate, ParseMeter
from stage_cosim.bridge.kinds import KINDS
from stage_cosim.bridge.manager import (ArtifactsEvicted, Draining, JobManager, Limits, NotFound, QueueFull,
                                        RequestIdReused, WrongState)
from stage_cosim.bridge.paths import resolve_inside
from stage_cosim.bridge.process import WorkerSettings, default_memory_bytes
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2_grpc as pb_grpc
from stage_cosim.bridge.quotas import Quotas
from stage_cosim.bridge.resolve import resolve
from stage_cosim.bridge.status import RpcAbort, invalid
from stage_cosim.bridge.uploads import CHUNK_BYTES, UploadStore
from stage_cosim.errors import UserError

SERVICE = pb.DESCRIPTOR.services_by_name["Bridge"].full_name
log = logging.getLogger("stage_cosim.bridge")
RESOLVER_THREADS = 2
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.5, 60.0
# Keepalive: the server pings a quiet connection every 30 s and drops it when no answer comes in
# 10 s (a vanished client's streams end); clients may ping every 5 s (the client pings every 10),
# and a client that pings more often is sent away after two strikes.
KEEPALIVE = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.keepalive_permit_without_calls", 1),
             ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000), ("grpc.http2.max_ping_strikes", 2)]
PAGE_TOKEN = re.compile(r"[0-9]{1,18}", re.ASCII)     # ASCII digits only: int() takes "²" and "٣" too
MAX_PAGE_BYTES = 2 << 20          # a listing page stays well inside the 4 MiB default message limit
HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    data_dir: Path | None = None              # None: a temporary directory, removed at the end
    limits: Limits = field(default_factory=Limits)
    max_upload_bytes: int = 4 << 30
    heartbeat_s: float = 5.0
    drain_timeout_s: float = 30.0
    worker_init: str | None = None            # MODULE:FUNCTION run in each worker (tests)
    # MODULE:FUNCTION(kind, request) checking optimize and explore requests at submit instead of
    # the real searches' parsing: for workers that run stand-in searches (tests)
    search_check: str | None = None
    worker: WorkerSettings = field(default_factory=WorkerSettings)   # the operator's, never a request's
    documents: DocumentLimits = field(default_factory=DocumentLimits)  # what one request may carry
    quotas: Quotas = field(default_factory=Quotas)   # per job, client and connection (quotas.py)


def connection_options(quotas: Quotas) -> list[tuple[str, int]]:
    """gRPC server options that close idle, old and never-started connections (``quotas``)."""
    age_ms = int(quotas.max_connection_age_s * 1000)
    return [*KEEPALIVE, ("grpc.max_connection_idle_ms", int(quotas.max_connection_idle_s * 1000)),
            ("grpc.max_connection_age_ms", age_ms), ("grpc.max_connection_age_grace_ms", max(10_000, age_ms // 100)),
            ("grpc.server_handshake_timeout_ms", int(quotas.handshake_timeout_s * 1000))]


# -- errors ----------------------------------------------------------------------------------------

class Undecodable:
    """What a request's bytes become when they are not the method's message (see RequestDecoding)."""

    def __init__(self, message_type: str) -> None:
        self.message_type = message_type

    def refuse(self) -> RpcAbort:
        return invalid("request", f"is not a valid {self.message_type} message")


class RequestDecoding(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the Bridge method's message reach the method as Undecodable,
    which it answers with INVALID_ARGUMENT (grpc itself would answer UNKNOWN or INTERNAL)."""

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """The call's peer, let in (counted until :meth:`_leave`), or the call aborted with why not."""
        peer = context.peer()
        try:
            self._enter(peer)
        except RpcAbort as err:
            await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata())
        return peer

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        prefix = f"/{SERVICE}/"
        if handler is None or not details.method.startswith(prefix) or handler.request_deserializer is None:
            return handler
        method = pb.DESCRIPTOR.services_by_name["Bridge"].methods_by_name.get(details.method[len(prefix):])
        message_type = method.input_type.full_name if method is not None else "request"
        deserialize = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception:  # noqa: BLE001 (any decoding failure is the client's bytes)
                return Undecodable(message_type)

        return handler._replace(request_deserializer=tolerant)


async def _decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.refuse()
        yield request


def _guard(method: Callable) -> Callable:
    """Turn the bridge's exceptions into status codes with details (unary and client-streaming)."""

    async def wrapper(self: "BridgeServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Undecodable):
                raise request.refuse()
            if hasattr(request, "__aiter__"):
                request = _decoded(request)
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def _guard_stream(method: Callable) -> Callable:
    async def wrapper(self: "BridgeServicer", request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        try:
            if isinstance(request, Undecodable):
                raise request.refuse()
            async for item in method(self, request, context):
                yield item
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def _as_abort(exc: Exception) -> RpcAbort:
    code = grpc.StatusCode
    if isinstance(exc, RpcAbort):
        return exc
    if isinstance(exc, UserError):
        return invalid(exc.parameter, exc.rule)
    if isinstance(exc, NotFound):
        return RpcAbort(code.NOT_FOUND, f"job_id: {exc}", "NOT_FOUND", "job_id")
    if isinstance(exc, QueueFull):
        return RpcAbort(code.RESOURCE_EXHAUSTED, str(exc), "QUEUE_FULL", retry_after_s=exc.retry_after_s)
    if isinstance(exc, Draining):
        return RpcAbort(code.UNAVAILABLE, str(exc), "DRAINING", retry_after_s=5.0)
    if isinstance(exc, RequestIdReused):
        return RpcAbort(code.ALREADY_EXISTS, f"request_id: {exc}", "REQUEST_ID_REUSED", "request_id")
    if isinstance(exc, WrongState):
        return RpcAbort(code.FAILED_PRECONDITION, f"job_id: {exc}", "WRONG_STATE", "job_id")
    if isinstance(exc, ArtifactsEvicted):
        return RpcAbort(code.FAILED_PRECONDITION, f"job_id: {exc}", "EVICTED", "job_id")
    # the details (paths, state) are for the operator's log, not for a client
    log.error("internal error", exc_info=exc)
    return RpcAbort(code.INTERNAL, f"internal error: {exc.__class__.__name__} (the server's log has the details)",
                    "INTERNAL")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    err = _as_abort(exc)
    await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata())


# -- the service -------------------------------------------------------------------------------------

class BridgeServicer(pb_grpc.BridgeServicer):
    def __init__(self, manager: JobManager, uploads: UploadStore, config: ServerConfig) -> None:
        self.manager = manager
        self.uploads = uploads
        self.config = config
        # a few threads: a flood of large submits waits its turn instead of taking the process
        self._resolver = concurrent.futures.ThreadPoolExecutor(RESOLVER_THREADS, thread_name_prefix="bridge-resolve")
        # one parse per client at a time, clients in turn; each client's parsing CPU metered
        self._gate = FairGate(RESOLVER_THREADS)
        self._meter = ParseMeter(config.quotas.parse_budget_s, config.quotas.parse_refill)
        self._upload_indexes = IndexCache(max_entries=1_000_000)
        self._pages = PageCache()           # listing pages built before (a client listing in a loop)
        self._search_check = _load_function(config.search_check) if config.search_check else None

    @_guard
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        kind = request.WhichOneof("kind")
        if kind is None:
            raise invalid("kind", f"set one of {', '.join(KINDS)}")
        quotas = self.config.quotas
        _check_text_fields(request, quotas.max_field_chars)      # kept with the job, in memory and on disk
        client = context.peer()
        wait = self._meter.wait_s(client)
        if wait > 0:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"parsing: this client used its {quotas.parse_budget_s:g} s of parsing time; "
                           f"it refills at {quotas.parse_refill:g} s per second (retry in {wait:.1f} s)",
                           "PARSE_BUDGET", retry_after_s=wait)
        # parsing and resolving take real time for large documents: never on the event loop, one
        # at a time per client, clients in turn
        loop = asyncio.get_running_loop()
        async with self._gate.slot(client):
            req, options, digest, fingerprint = await loop.run_in_executor(
                self._resolver, self._metered_prepare, client, kind, request)
        job = await self.manager.submit(kind, req, options, digest, fingerprint, request.request_id,
                                        request.timeout_s, request.no_cache, client=client)
        return job.to_proto()

    def _metered_prepare(self, client: str, kind: str,
                         request: pb.SubmitJobRequest) -> tuple[dict[str, Any], dict[str, Any], str, str]:
        """:meth:`_prepare`, its CPU time charged to ``client`` (refused requests too)."""
        t0 = time.thread_time()
        try:
            return self._prepare(kind, request)
        finally:
            self._meter.charge(client, time.thread_time() - t0)

    def _prepare(self, kind: str, request: pb.SubmitJobRequest) -> tuple[dict[str, Any], dict[str, Any], str, str]:
        """(request, options, digest, fingerprint) of a submit, checked within the limits (a thread)."""
        limits = self.config.documents
        body = getattr(request, kind)
        req = request_from_design(body.design, limits)
        options: dict[str, Any] = {}
        if kind == "simulate":
            if body.traces_upload:
                self.uploads.path(body.traces_upload, "traces_upload")
                options["traces_upload"] = body.traces_upload
            options.update({k: True for k in ("full", "timeline") if getattr(body, k)})
        elif kind == "synthesize":
            options["format"] = body.format or "chakra"
            if options["format"] not in ("chakra", "json"):
                raise invalid("format", f"must be chakra or json, got {body.format!r}")
        else:                               # optimize, explore, serve_sim: design + settings
            settings = loads_object(body.settings_json, "settings_json", limits)
            for key, value in settings.items():
                if key in req:
                    raise invalid(key, "is given both in the design and in settings_json")
                if isinstance(value, str) and not value.strip():
                    raise invalid(key, "is empty (leave the setting out for the default)")
            req.update(settings)
        # a request key named after the field it came from
        names = {"cluster": "cluster_description"} if body.design.HasField("cluster_description") else {}
        check_request_size(req, limits, names)
        digest = resolve(kind, req, options, self.manager.worker_settings.memory_bytes or 0, self._search_check)
        bare = pb.SubmitJobRequest()
        bare.CopyFrom(request)
        bare.request_id = ""
        fingerprint = hashlib.sha256(bare.SerializeToString(deterministic=True)).hexdigest()
        return req, options, digest, fingerprint

    def close(self) -> None:
        self._resolver.shutdown(wait=False, cancel_futures=True)

    @_guard
    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        return self.manager.get(request.job_id).to_proto()

    @_guard
    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        size = min(_page_size(request.page_size, 100), 1000)
        start = _page_start(request.page_token)
        # from the store: jobs no longer held in memory are listed too
        jobs, total = await self.manager.list_page(start, size)
        page, used, end = [], 0, start
        for job in jobs:
            if job is not None:         # None: removed since the listing was taken; its place is passed
                proto = job.to_proto(with_result=False)
                used += proto.ByteSize() + 8
                if page and used > MAX_PAGE_BYTES:
                    break
                page.append(proto)
            end += 1
        return pb.ListJobsResponse(jobs=page, next_page_token=str(end) if end < total else "")

    @_guard_stream
    async def WatchJob(self, request: pb.WatchJobRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.JobEvent]:
        job = self.manager.get(request.job_id)
        async for event in job.watch(request.after_seq, self._heartbeat_s(request.heartbeat_s)):
            yield event

    def _heartbeat_s(self, asked: float) -> float:
        """The watcher's heartbeat interval, within bounds (0: the server's own)."""
        base = self.config.heartbeat_s
        if not asked > 0 or not math.isfinite(asked):
            return base
        return min(max(asked, min(MIN_HEARTBEAT_S, base)), MAX_HEARTBEAT_S)

    @_guard
    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        return (await self.manager.cancel(request.job_id)).to_proto()

    @_guard
    async def UploadTraces(self, request_iterator: AsyncIterator[pb.UploadTracesRequest],
                           context: grpc.aio.ServicerContext) -> pb.Upload:
        return await self.uploads.receive(request_iterator)

    async def _owner(self, request: pb.ListArtifactsRequest | pb.DownloadRequest) -> tuple[Path, ArtifactIndex]:
        """The directory a request's paths resolve in, and the index of the files it offers."""
        owner = request.WhichOneof("owner")
        if owner == "upload_id":
            root = self.uploads.path(request.upload_id)
            index = self._upload_indexes.get(request.upload_id)
            if index is None:
                files = await asyncio.get_running_loop().run_in_executor(None, self.uploads.index, request.upload_id)
                index = ArtifactIndex.of(files)
                self._upload_indexes.put(request.upload_id, index)
            return root, index
        if owner != "job_id":
            raise invalid("job_id", "give a job_id or an upload_id")
        job = self.manager.get(request.job_id)
        if job.state != J.SUCCEEDED:
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           f"job_id: job {job.id} is {J.STATE_NAMES[job.state]}; artifacts come when it succeeds",
                           "WRONG_STATE", "job_id")
        return self.manager.artifacts_dir(job), await self.manager.artifact_index(job)

    @_guard
    async def ListArtifacts(self, request: pb.ListArtifactsRequest,
                            context: grpc.aio.ServicerContext) -> pb.ListArtifactsResponse:
        _, index = await self._owner(request)
        size = min(_page_size(request.page_size, 1000), 10_000)
        offset = _page_start(request.page_token)
        owner = request.WhichOneof("owner")
        key = (owner, getattr(request, owner), request.prefix, offset, size)
        cached = self._pages.get(key, index)
        if cached is not None:
            return cached
        lo, hi = index.span(request.prefix)            # the prefix's files: one range of the sorted index
        start = lo + offset
        page, _ = _page(range(start, min(hi, start + size)), 0, size, lambda i: pb.FileSpec(**index.spec(i)))
        end = start + len(page)
        response = pb.ListArtifactsResponse(files=page, next_page_token=str(end - lo) if end < hi else "")
        self._pages.put(key, index, response, response.ByteSize())
        return response

    @_guard_stream
    async def Download(self, request: pb.DownloadRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DownloadChunk]:
        root, index = await self._owner(request)
        path = resolve_inside(root, request.path, "path")
        spec = index.find(request.path)
        if spec is None or not path.is_file():
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, f"path: no file {request.path!r}", "NOT_FOUND", "path")
        size = spec["size"]
        if not 0 <= request.offset <= size:
            raise RpcAbort(grpc.StatusCode.OUT_OF_RANGE, f"offset: must be within 0..{size}, got {request.offset}",
                           "INVALID_FIELD", "offset")
        loop = asyncio.get_running_loop()
        offset = request.offset
        with open(path, "rb") as f:
            f.seek(offset)
            while True:
                data = await loop.run_in_executor(None, f.read, CHUNK_BYTES)
                if not data and offset < size:
                    raise RpcAbort(grpc.StatusCode.DATA_LOSS, f"path: {request.path!r} is shorter than recorded",
                                   "DIGEST_MISMATCH", "path")
                if data or offset == request.offset:     # an empty file still answers once
                    yield pb.DownloadChunk(path=request.path, offset=offset, data=data, size=size,
                                           sha256=spec["sha256"])
                offset += len(data)
                if offset >= size:
                    return

    @_guard
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        m, lim = self.manager, self.manager.limits
        return pb.ServerInfo(version=__version__, job_kinds=list(KINDS), workers=lim.workers, max_queue=lim.max_queue,
                             queued=m.queued, running=m.running, max_upload_bytes=self.uploads.max_bytes,
                             default_timeout_s=min(lim.default_timeout_s, m.max_timeout_s),
                             max_timeout_s=m.max_timeout_s,
                             draining=m.draining, jobs=len(m.jobs), cache_entries=len(m.cache),
                             max_job_memory_bytes=m.worker_settings.memory_bytes or 0,
                             job_cpu_s=m.worker_settings.cpu_s or m.quotas.max_cpu_s, max_request_bytes=self.config.documents.max_request_bytes,
                             search_workers=m.worker_settings.search_workers)


def _load_function(spec: str) -> Callable[..., Any]:
    """The function named ``MODULE:FUNCTION``."""
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _page(items: list, start: int, size: int, to_proto: Callable[[Any], Any]) -> tuple[list, str]:
    """Up to ``size`` items from ``start`` as messages, and the next page's token ("" at the end).
    A page also ends before it would outgrow a default client's message limit."""
    page: list = []
    used = 0
    for item in items[start:start + size]:
        proto = to_proto(item)
        used += proto.ByteSize() + 8
        if page and used > MAX_PAGE_BYTES:
            break
        page.append(proto)
    end = start + len(page)
    return page, str(end) if end < len(items) else ""


# text fields that carry a document, bounded by the document limits (DocumentLimits) instead
DOCUMENT_FIELDS = frozenset({"model_config", "cluster_description", "settings_json"})


def _check_text_fields(message: Any, limit: int) -> None:
    """Every text field of a submit that is not a document (request_id, names, choices) holds at
    most ``limit`` characters; the first longer one is refused, named. Cheap: run on the loop,
    before any parsing."""
    for fd, value in message.ListFields():
        if fd.message_type is not None:
            for item in value if fd.is_repeated else (value,):
                _check_text_fields(item, limit)
            continue
        if fd.type != fd.TYPE_STRING or fd.name in DOCUMENT_FIELDS:
            continue
        for text in value if fd.is_repeated else (value,):
            if len(text) > limit:
                raise invalid(fd.name, f"is {len(text):,} characters long: more than {limit:,} "
                                       "characters (this server's limit)")


def _page_size(size: int, default: int) -> int:
    if size < 0:
        raise invalid("page_size", f"must not be negative, got {size}")
    return size or default


def _page_start(token: str) -> int:
    if not token:
        return 0
    if not PAGE_TOKEN.fullmatch(token):
        raise invalid("page_token", "is not a token this server gave")
    return int(token)


# -- authentication ------------------------------------------------------------------------------------

class TokenAuth(grpc.aio.ServerInterceptor):
    """Every call but the health service must carry ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """The call's peer, let in (counted until :meth:`_leave`), or the call aborted with why not."""
        peer = context.peer()
        try:
            self._enter(peer)
        except RpcAbort as err:
            await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata())
        return peer

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, self._expected):
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    err = RpcAbort(grpc.StatusCode.UNAUTHENTICATED, "token: missing or wrong bearer token", "UNAUTHENTICATED", "token")

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata())

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)


# -- connections per peer --------------------------------------------------------------------------------

class PeerConnections(grpc.aio.ServerInterceptor):
    """At most ``cap`` connections of one host with calls in flight; a call that would open one
    more is refused with RESOURCE_EXHAUSTED (the health service is never refused).

    gRPC shows a server no connection, only calls and their peer (``ipv4:HOST:PORT``: one
    connection each), so a connection counts while it has a call in flight. A connection with
    none is closed by the server's idle limit, and one that never starts HTTP/2 by its handshake
    timeout (:func:`connection_options`)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._calls: collections.Counter[str] = collections.Counter()          # peer -> calls in flight
        self._hosts: dict[str, set[str]] = collections.defaultdict(set)        # host -> its peers with calls

    def _enter(self, peer: str) -> None:
        host = peer.rsplit(":", 1)[0]
        peers = self._hosts[host]
        if peer not in peers and len(peers) >= self.cap:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"connections: {host} already has {len(peers)} connections with calls in flight "
                           f"(this server's limit); use fewer channels", "TOO_MANY_CONNECTIONS")
        peers.add(peer)
        self._calls[peer] += 1

    def _leave(self, peer: str) -> None:
        self._calls[peer] -= 1
        if self._calls[peer] <= 0:
            del self._calls[peer]
            host = peer.rsplit(":", 1)[0]
            self._hosts[host].discard(peer)
            if not self._hosts[host]:
                del self._hosts[host]

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """The call's peer, let in (counted until :meth:`_leave`), or the call aborted with why not."""
        peer = context.peer()
        try:
            self._enter(peer)
        except RpcAbort as err:
            await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata())
        return peer

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary or handler.stream_unary:
            behavior = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                peer = await self._admit(context)
                try:
                    result = behavior(request, context)
                    return await result if inspect.isawaitable(result) else result
                finally:
                    self._leave(peer)

            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
            return make(unary, **kw)
        behavior = handler.unary_stream or handler.stream_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            peer = await self._admit(context)
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):             # a handler that writes with context.write
                    await result
                    return
                async for item in result:
                    yield item
            finally:
                self._leave(peer)

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(stream, **kw)


# -- the server ------------------------------------------------------------------------------------------

class BridgeServer:
    """The whole bridge on one asyncio loop: ``await start()`` (returns the port), ``await stop()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port = 0
        self._tmp: str | None = None
        self._server: grpc.aio.Server | None = None
        self._servicer: BridgeServicer | None = None
        self.manager: JobManager | None = None
        self.health = health_aio.HealthServicer()

    async def start(self) -> int:
        cfg = self.config
        if cfg.documents.max_request_bytes > J.MAX_REQUEST_BYTES or cfg.documents.max_bytes > J.MAX_REQUEST_BYTES:
            raise UserError("max-request-kib", f"must be at most {J.MAX_REQUEST_BYTES >> 10:,}: a job record, which "
                                               "holds the request, must fit a default client's 4 MiB messages")
        cfg.quotas.check()
        need = (cfg.limits.workers + 1) * cfg.quotas.job_disk_bytes
        if cfg.quotas.total_disk_bytes < need:
            # running jobs each keep a job's quota free: with less, a finished job could never be kept
            raise UserError("total-disk-mib", f"must be at least {need >> 20:,}: --job-disk-mib for each worker and "
                                              "for one finished job")
        if cfg.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="stage-cosim-bridge-")
        data = Path(cfg.data_dir or self._tmp)  # type: ignore[arg-type]
        worker = cfg.worker
        if worker.memory_bytes is None:
            worker = dataclasses.replace(worker, memory_bytes=default_memory_bytes(cfg.limits.workers))
        self.manager = JobManager(data, cfg.limits, cfg.worker_init, worker=worker, persistent=cfg.data_dir is not None,
                                  quotas=cfg.quotas)
        uploads = UploadStore(self.manager.uploads_root, cfg.max_upload_bytes)
        uploads.clean()
        interceptors: list[grpc.aio.ServerInterceptor] = [RequestDecoding()]
        interceptors += [TokenAuth(cfg.token)] if cfg.token else []
        interceptors += [PeerConnections(cfg.quotas.max_connections_per_peer)]
        # so_reuseport 0: a port already taken is an error, not a silently shared port
        server = grpc.aio.server(interceptors=interceptors,
                                 options=[("grpc.so_reuseport", 0), *connection_options(cfg.quotas)])
        self._servicer = BridgeServicer(self.manager, uploads, cfg)
        pb_grpc.add_BridgeServicer_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert or cfg.tls_key:
                creds = grpc.ssl_server_credentials([(_read(cfg.tls_key, "tls-key"), _read(cfg.tls_cert, "tls-cert"))])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise UserError("port", f"cannot listen on {address}: {exc}") from None
        if not self.port:
            raise UserError("port", f"cannot listen on {address}")
        await self.manager.start()
        await server.start()
        self._server = server
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Graceful: health NOT_SERVING, no new jobs, running jobs finish or are cancelled."""
        if self._server is None or self.manager is None:
            return
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        await self.manager.drain(timeout)
        await self._server.stop(grace=2.0)
        if self._servicer is not None:
            self._servicer.close()
        await self.manager.close()
        self._server = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _read(path: Path | None, name: str) -> bytes:
    if path is None:
        raise UserError(name, "is required with --tls-cert/--tls-key (give both)")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UserError(name, f"{path}: {exc.strerror}") from None


async def serve(config: ServerConfig, announce: Callable[[str], None] = print) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    server = BridgeServer(config)
    port = await server.start()
    host = config.host
    scheme = "tls" if config.tls_cert else "insecure"
    manager = server.manager
    assert manager is not None
    memory = manager.worker_settings.memory_bytes
    announce(f"stage-cosim bridge {__version__} serving on {host}:{port} ({scheme}"
             f"{', token required' if config.token else ''}; data in {manager.data}; {manager.limits.workers} "
             f"workers, {f'{memory >> 20:,} MiB' if memory else 'unlimited memory'} per job)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    announce(f"draining: running jobs have {config.drain_timeout_s:g} s to finish")
    await server.stop()
    announce("stopped")


# -- embedding --------------------------------------------------------------------------------------------

class ServerThread:
    """A BridgeServer on its own loop in a background thread (tests, notebooks).

    ``with start_in_thread(ServerConfig(port=0)) as s: Client(f"127.0.0.1:{s.port}")``
    """

    def __init__(self, config: ServerConfig) -> None:
        self.server = BridgeServer(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bridge-server", daemon=True)
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float | None = 60.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "ServerThread":
        self._thread.start()
        self.port = self.call(self.server.start())
        return self

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        try:
            self.call(self.server.stop(drain_timeout_s), timeout=drain_timeout_s + 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(config: ServerConfig) -> ServerThread:
    return ServerThread(config)


__all__ = ["BridgeServer", "Limits", "ServerConfig", "ServerThread", "serve", "start_in_thread"]
