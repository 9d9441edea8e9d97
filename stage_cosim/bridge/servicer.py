"""The ``stagecosim.v1.Bridge`` service: each RPC, over the job manager and the upload store.

A method's exceptions become status codes with details (:func:`_guard`): a user error names its
field, the manager's refusals have their own codes, anything else is INTERNAL with the details in
the server's log only. Parsing a submit runs in a few threads, one client at a time in turn, its
CPU time metered per client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import grpc

from stage_cosim import __version__
from stage_cosim.bridge import jobs as J
from stage_cosim.bridge.artifacts import ArtifactIndex, IndexCache, PageCache
from stage_cosim.bridge.codec import loads_object, request_from_design
from stage_cosim.bridge.config import ServerConfig
from stage_cosim.bridge.documents import check_request_size
from stage_cosim.bridge.fair import FairGate, ParseMeter
from stage_cosim.bridge.interceptors import Undecodable
from stage_cosim.bridge.kinds import KINDS
from stage_cosim.bridge.manager import Draining, JobManager, QueueFull, RequestIdReused, WrongState
from stage_cosim.bridge.paths import resolve_inside
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2_grpc as pb_grpc
from stage_cosim.bridge.resolve import resolve
from stage_cosim.bridge.status import RpcAbort, invalid
from stage_cosim.bridge.store import ArtifactsEvicted, NotFound
from stage_cosim.bridge.uploads import CHUNK_BYTES, UploadStore
from stage_cosim.errors import UserError
from stage_cosim.trace.formats import FORMATS

log = logging.getLogger("stage_cosim.bridge")
RESOLVER_THREADS = 2
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.5, 60.0
PAGE_TOKEN = re.compile(r"[0-9]{1,18}", re.ASCII)     # ASCII digits only: int() takes "²" and "٣" too
MAX_PAGE_BYTES = 2 << 20          # a listing page stays well inside the 4 MiB default message limit


# -- a method's exceptions as status codes --------------------------------------------------------

def _refuse_undecodable(request: Any) -> None:
    """A message the interceptor could not decode is refused here, inside the guard."""
    if isinstance(request, Undecodable):
        raise request.refuse()


async def _decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        _refuse_undecodable(request)
        yield request


def _guard(method: Callable) -> Callable:
    """Turn the bridge's exceptions into status codes with details (unary and client-streaming)."""

    @functools.wraps(method)
    async def wrapper(self: "BridgeServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _refuse_undecodable(request)
            if hasattr(request, "__aiter__"):
                request = _decoded(request)
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    return wrapper


def _guard_stream(method: Callable) -> Callable:
    """:func:`_guard` for server-streaming methods (an async generator needs its own wrapper)."""

    @functools.wraps(method)
    async def wrapper(self: "BridgeServicer", request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        try:
            _refuse_undecodable(request)
            async for item in method(self, request, context):
                yield item
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

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
            if options["format"] not in FORMATS:
                raise invalid("format", f"must be {' or '.join(FORMATS)}, got {body.format!r}")
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
