"""The job manager: a bounded queue, a fixed number of worker slots, a result cache.

Everything here runs on the server's asyncio loop and never blocks it: worker processes are
driven through asyncio pipes, file work goes to the default executor (an event is one small
append, made on the loop so that it is on disk before a watcher sees it). The pieces:

* submit: idempotent by the client's request id; refused with QueueFull when ``max_queue`` jobs
  wait; answered from the cache at once when the same resolved inputs already succeeded.
* slots: ``workers`` loops, each owning one warm worker process (``process.py``); a job that is
  cancelled or runs past its limit takes its process down with it, and the slot starts another.
* storage: ``<data>/jobs/<id>/`` holds the request, the event log (``events.jsonl``, appended
  as events happen), the artifacts (``artifacts/``, what clients may download) and, once the job
  is final, ``job.json``. A restarted server reloads final jobs (results, downloads, idempotency
  and cache survive) and queues again the jobs that had not finished — queued or running when
  the server was killed, or queued when it was stopped — numbering their events on from the
  last one kept.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from google.protobuf.json_format import MessageToDict, ParseDict

from stage_cosim.bridge import jobs as J
from stage_cosim.bridge.artifacts import ArtifactIndex, IndexCache
from stage_cosim.bridge.codec import dumps
from stage_cosim.bridge.fair import FairQueue
from stage_cosim.bridge.jobs import JobRecord
from stage_cosim.bridge.paths import disk_usage
from stage_cosim.bridge.process import WorkerDied, WorkerProcess, WorkerSettings
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.quotas import MIB, Quotas
from stage_cosim.bridge.worker import ARTIFACT_INDEX, ARTIFACTS_DIR, RESULT_FILE, disk_error

REQUEST_FILE, RECORD_FILE, EVENTS_FILE = "request.json", "job.json", "events.jsonl"
JOB_ID = re.compile(r"^j-[0-9a-f]{16}$")


class QueueFull(Exception):
    def __init__(self, queued: int, retry_after_s: float) -> None:
        super().__init__(f"the queue is full ({queued} jobs waiting)")
        self.retry_after_s = retry_after_s


class Draining(Exception):
    """The server is shutting down and takes no new work."""


class NotFound(Exception):
    pass


class RequestIdReused(Exception):
    """A request id came back with a different request."""


class WrongState(Exception):
    pass


class ArtifactsEvicted(Exception):
    """A job's artifacts were deleted to keep the data directory within its disk quota."""


@dataclass
class Limits:
    workers: int = 2
    max_queue: int = 1024
    default_timeout_s: float = 3600.0
    max_timeout_s: float = 3600.0
    kill_grace_s: float = 1.0
    max_jobs_per_worker: int = 1000
    max_cache_entries: int = 100_000
    # final jobs kept in memory; older ones are read back from disk when asked for
    max_jobs_in_memory: int = 20_000


class JobManager:
    def __init__(self, data_dir: Path, limits: Limits | None = None, worker_init: str | None = None,
                 uploads_root: Path | None = None, worker: WorkerSettings | None = None,
                 persistent: bool = False, quotas: Quotas | None = None) -> None:
        self.data = Path(data_dir).resolve()        # workers change directory: every path absolute
        self.jobs_root = self.data / "jobs"
        self.uploads_root = Path(uploads_root).resolve() if uploads_root else self.data / "uploads"
        self.limits = limits or Limits()
        self.worker_init = worker_init
        self.worker_settings = worker or WorkerSettings()
        self.quotas = quotas or Quotas()
        # a data directory that outlives this server: queued jobs wait there for the next one
        self.persistent = persistent
        self.jobs: dict[str, JobRecord] = {}
        self.by_request_id: dict[str, str] = {}
        self.cache: dict[str, str] = {}                 # digest -> id of a job that succeeded
        self.draining = False
        # per-client caps, round-robin between clients (fair.py)
        self._queue: FairQueue[JobRecord] = FairQueue(self.quotas.jobs_per_client(self.limits.workers))
        # every job in the store, in memory or not, oldest first: ListJobs pages from it
        self._listing: list[tuple[float, str]] = []
        # bytes of each final job record held in memory (record_memory_bytes bounds the sum)
        self._weights: dict[str, int] = {}
        self.record_bytes = 0
        # disk bytes of each final job's directory, oldest finish first (total_disk_bytes)
        self._usage: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._with_artifacts: set[str] = set()
        self.disk_bytes = 0
        self._indexes = IndexCache()
        self._disk_lock = asyncio.Lock()
        self._slots: list[asyncio.Task] = []
        self._workers: set[WorkerProcess] = set()
        self._running: set[str] = set()
        self._final_order: collections.deque[str] = collections.deque()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.jobs_root.mkdir(parents=True, exist_ok=True)
        self.uploads_root.mkdir(parents=True, exist_ok=True)
        self._load()       # at start, before serving: blocking is fine here
        for i in range(self.limits.workers):
            self._slots.append(asyncio.create_task(self._slot(i), name=f"bridge-slot-{i}"))

    async def drain(self, timeout_s: float) -> None:
        """Take no new work, give running jobs ``timeout_s``, then cancel them. Queued jobs stay
        queued in a persistent data directory (the next server runs them, as after a crash) and
        are cancelled otherwise (no server will)."""
        self.draining = True
        for job in [j for j in self.jobs.values() if j.state == J.QUEUED and not self.persistent]:
            await self.cancel(job.id, "the server is shutting down")
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            for job_id in list(self._running):
                await self.cancel(job_id, "the server's shutdown deadline passed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.limits.kill_grace_s + 10)

    async def close(self) -> None:
        for task in self._slots:
            task.cancel()
        await asyncio.gather(*self._slots, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in list(self._workers)), return_exceptions=True)

    # -- the RPCs' side ----------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id) or self._reload(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        return job

    def _reload(self, job_id: str) -> JobRecord | None:
        """A final job forgotten from memory, read back from its directory."""
        if not JOB_ID.match(job_id or "") or job_id not in self._usage:
            return None
        return self._remember_final(self._load_final(self.jobs_root / job_id))

    def _remember_final(self, job: JobRecord | None) -> JobRecord | None:
        """Hold a final job read from disk in memory again (if another call did not already)."""
        if job is None or job.id not in self._usage:            # gone: evicted meanwhile
            return None
        if job.id in self.jobs:
            return self.jobs[job.id]
        self._index(job)
        self._hold(job)
        self._forget_old()
        return job

    def _hold(self, job: JobRecord) -> None:
        """Count a final job's record against the memory bound, newest last."""
        weight = job.stored_bytes + len(job.result_json)
        self.record_bytes += weight - self._weights.get(job.id, 0)
        self._weights[job.id] = weight
        self._final_order.append(job.id)

    def _forget_old(self) -> None:
        """Drop the oldest final records from memory past either bound (count or bytes)."""
        while (len(self.jobs) > self.limits.max_jobs_in_memory or self.record_bytes > self.quotas.record_memory_bytes) \
                and self._final_order:
            job_id = self._final_order.popleft()
            if job_id in self._weights and self.jobs.get(job_id) is not None and self.jobs[job_id].final:
                self.jobs.pop(job_id, None)
                self.record_bytes -= self._weights.pop(job_id)

    async def list_page(self, start: int, size: int) -> tuple[list[JobRecord | None], int]:
        """The jobs at positions ``start`` to ``start + size`` of the store, newest first (None for
        one that could not be read back: removed meanwhile); and how many jobs the store holds.
        Jobs no longer in memory are read back (in a thread) for this page only: a listing does
        not push the recent records out of memory."""
        total = len(self._listing)
        ids = [self._listing[total - 1 - i][1] for i in range(start, min(total, start + size))]
        missing = [i for i in ids if i not in self.jobs]
        loaded: dict[str, JobRecord] = {}
        if missing:
            read = await asyncio.get_running_loop().run_in_executor(
                None, lambda: [self._load_final(self.jobs_root / i) for i in missing])
            loaded = {job.id: job for job in read if job is not None}
        return [self.jobs.get(i) or loaded.get(i) for i in ids], total

    def job_dir(self, job: JobRecord) -> Path:
        return self.jobs_root / job.id

    def artifacts_dir(self, job: JobRecord) -> Path:
        return self.job_dir(job) / ARTIFACTS_DIR

    async def artifact_index(self, job: JobRecord) -> ArtifactIndex:
        """The job's artifact index: read once (in a thread), then from memory."""
        index = self._indexes.get(job.id)
        if index is None:
            if job.id in self._usage and job.id not in self._with_artifacts:
                raise ArtifactsEvicted(f"the artifacts of job {job.id} were deleted: this server keeps "
                                       f"{self.quotas.total_disk_bytes / MIB:,.0f} MiB of jobs and deletes the "
                                       "oldest finished jobs' artifacts first")
            path = self.job_dir(job) / ARTIFACT_INDEX
            index = await asyncio.get_running_loop().run_in_executor(None, ArtifactIndex.load, path)
            index = index if index is not None else ArtifactIndex.of([])
            self._indexes.put(job.id, index)
        return index

    @property
    def max_timeout_s(self) -> float:
        return min(self.limits.max_timeout_s, self.quotas.max_run_s)

    def cpu_s(self, job: JobRecord) -> float:
        """CPU seconds ``job`` may use: the operator's setting, at most its run time."""
        set_ = [s for s in (self.worker_settings.cpu_s, self.quotas.max_cpu_s) if s > 0]
        return min([*set_, job.timeout_s]) if set_ else job.timeout_s

    @property
    def queued(self) -> int:
        return sum(1 for j in self.jobs.values() if j.state == J.QUEUED)

    @property
    def running(self) -> int:
        return len(self._running)

    async def submit(self, kind: str, request: dict[str, Any], options: dict[str, Any], digest: str,
                     fingerprint: str, request_id: str, timeout_s: float, no_cache: bool,
                     client: str = "") -> JobRecord:
        """A new job, or the one this request id created before."""
        known = self.by_request_id.get(request_id) if request_id else None
        job = self.jobs.get(known) or self._reload(known) if known else None
        if job is not None:
            if job.fingerprint != fingerprint:
                raise RequestIdReused(f"request id {request_id!r} was used for a different request")
            return job
        if self.draining:
            raise Draining("the server is shutting down")
        cached = None if no_cache else self._cached(digest)
        if cached is None and self.queued >= self.limits.max_queue:
            raise QueueFull(self.queued, retry_after_s=max(0.5, min(30.0, self.queued * 0.01)))
        limit = timeout_s if timeout_s > 0 else self.limits.default_timeout_s
        job = JobRecord(id=f"j-{secrets.token_hex(8)}", kind=kind, request=request, options=options,
                        request_id=request_id, fingerprint=fingerprint, digest=digest,
                        timeout_s=min(limit, self.max_timeout_s), no_cache=no_cache, client=client)
        self._index(job)
        self._list(job)
        await self._write_request(job)          # the directory and the request, before any event
        job.sink = self._event_log(job)
        job.set_state(J.QUEUED)
        if cached is not None:
            await self._finish_from_cache(job, cached)
        else:
            self._queue.put_nowait(job.client, job)
        return job

    async def cancel(self, job_id: str, why: str = "cancelled by a client") -> JobRecord:
        job = self.get(job_id)
        if job.state in (J.SUCCEEDED, J.FAILED):
            raise WrongState(f"job {job_id} already {J.STATE_NAMES[job.state]}")
        if job.state == J.QUEUED:
            job.log(why, "bridge")
            job.set_state(J.CANCELLED, why)
            await self._persist(job)
        elif job.state == J.RUNNING:
            job.log(why, "bridge")
            job.set_state(J.CANCELLING, why)
            job.cancel_requested.set()
        return job

    # -- cache -----------------------------------------------------------------------------------

    def _cached(self, digest: str) -> JobRecord | None:
        job_id = self.cache.get(digest)
        job = (self.jobs.get(job_id) or self._reload(job_id)) if job_id else None
        if job is None or job.state != J.SUCCEEDED or not (self.artifacts_dir(job) / RESULT_FILE).is_file():
            return None
        return job

    async def _finish_from_cache(self, job: JobRecord, source: JobRecord) -> None:
        def link() -> None:
            shutil.copytree(self.artifacts_dir(source), self.artifacts_dir(job), copy_function=_link_or_copy,
                            dirs_exist_ok=True)
            shutil.copyfile(self.job_dir(source) / ARTIFACT_INDEX, self.job_dir(job) / ARTIFACT_INDEX)

        await asyncio.get_running_loop().run_in_executor(None, link)
        job.cached = True
        job.result_json, job.result_size = source.result_json, source.result_size
        job.progress = source.progress
        job.log(f"result from the cache (job {source.id}, same inputs)", "bridge")
        job.set_state(J.SUCCEEDED, "cached")
        await self._persist(job)

    def _remember(self, job: JobRecord) -> None:
        if len(self.cache) >= self.limits.max_cache_entries:
            self.cache.pop(next(iter(self.cache)))
        self.cache[job.digest] = job.id

    # -- slots -----------------------------------------------------------------------------------

    async def _slot(self, number: int) -> None:
        worker: WorkerProcess | None = None
        try:
            worker = await self._start_worker()
        except Exception:  # noqa: BLE001 (retried when a job comes)
            worker = None
        try:
            while True:
                client, job = await self._queue.get()
                try:
                    worker = await self._take(job, worker)
                finally:
                    self._queue.done(client)
        finally:
            if worker is not None:
                await self._retire(worker)

    async def _take(self, job: JobRecord, worker: WorkerProcess | None) -> WorkerProcess | None:
        """Run one job taken from the queue on ``worker`` (or a new one); the worker to keep."""
        if job.state != J.QUEUED or self.draining:      # draining: it waits on disk
            return worker
        cached = None if job.no_cache else self._cached(job.digest)
        if cached is not None:           # an identical job finished while this one waited
            await self._finish_from_cache(job, cached)
            return worker
        self._running.add(job.id)
        self._idle.clear()
        try:
            if worker is None or not worker.alive or worker.jobs_run >= self.limits.max_jobs_per_worker:
                if worker is not None:
                    await self._retire(worker)
                worker = await self._start_worker()
            keep = await self._execute(job, worker)
        except Exception as exc:  # noqa: BLE001 (a worker that cannot start fails the job)
            job.log(f"could not run the job: {exc}", "bridge")
            job.error = f"bridge: {exc}"
            job.set_state(J.FAILED, job.error)
            await self._persist(job)
            keep = False
        finally:
            self._running.discard(job.id)
            if not self._running:
                self._idle.set()
        if not keep and worker is not None:
            await self._retire(worker)
            worker = None
        return worker

    async def _start_worker(self) -> WorkerProcess:
        worker = await WorkerProcess.start(self.worker_init, cwd=self.jobs_root,
                                           memory_bytes=self.worker_settings.memory_bytes or 0)
        self._workers.add(worker)
        return worker

    async def _retire(self, worker: WorkerProcess) -> None:
        self._workers.discard(worker)
        await worker.close()

    async def _execute(self, job: JobRecord, worker: WorkerProcess) -> bool:
        """Run ``job`` on ``worker``; returns whether the worker may take another job."""
        if job.state != J.QUEUED:            # cancelled while its worker started
            return True
        job.set_state(J.RUNNING)
        options = dict(job.options)
        if options.get("traces_upload"):
            options["traces"] = str(self.uploads_root / options["traces_upload"])
        message = {"id": job.id, "kind": job.kind, "request": job.request, "options": options,
                   "dir": str(self.job_dir(job)), "server": self.worker_settings.for_job(),
                   "cpu_s": self.cpu_s(job), "disk_bytes": self.quotas.job_disk_bytes}

        def on_progress(msg: dict) -> None:
            detail = msg.get("detail")
            best = dumps(detail["best"]) if isinstance(detail, dict) and detail.get("best") is not None else ""
            job.set_progress(msg.get("done", 0), msg.get("total", 0), dumps(detail) if detail is not None else "",
                             best)

        run = asyncio.create_task(worker.run(message, on_progress, job.log))
        stop = asyncio.create_task(job.cancel_requested.wait())
        disk = asyncio.create_task(self._watch_disk(job))
        timeout = max(0.0, job.timeout_s)
        done, _ = await asyncio.wait({run, stop, disk}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        disk.cancel()
        if run in done:
            try:
                answer = run.result()
            except WorkerDied as exc:        # a limit's own one-line error, or what ended the worker
                job.error = str(exc) if exc.limit else f"worker: {exc}"
                job.set_state(J.FAILED, job.error)
                await self._persist(job)
                return False
            await self._record_answer(job, answer)
            return not answer.get("retire")
        # cancelled, or past the run-time limit: the job's whole process group goes
        await worker.kill(self.limits.kill_grace_s)
        run.cancel()
        with contextlib.suppress(BaseException):
            await run
        if job.cancel_requested.is_set():
            job.set_state(J.CANCELLED, "cancelled")
        elif disk in done and not disk.cancelled():
            # what it wrote is over the quota and incomplete: it goes at once
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: shutil.rmtree(self.artifacts_dir(job), ignore_errors=True))
            job.error = disk_error(self.quotas.job_disk_bytes)
            job.log(job.error, "bridge")
            job.set_state(J.FAILED, job.error)
        else:
            job.error = f"timeout: the job ran longer than its limit of {job.timeout_s:g} s"
            job.log(job.error, "bridge")
            job.set_state(J.FAILED, job.error)
        await self._persist(job)
        return False

    async def _watch_disk(self, job: JobRecord) -> None:
        """Return once the running job's directory holds more than its disk quota. (A single file
        cannot outgrow the quota at all: the worker sets RLIMIT_FSIZE; this catches many files.)
        Each look walks the directory in a thread; the next comes after four times as long, at
        least every 0.25 s, so a job of 100,000 files is not walked without pause."""
        loop = asyncio.get_running_loop()
        directory = self.artifacts_dir(job)
        interval = 0.25
        while True:
            await asyncio.sleep(interval)
            t0 = loop.time()
            if await loop.run_in_executor(None, disk_usage, directory) > self.quotas.job_disk_bytes:
                return
            interval = max(0.25, 4 * (loop.time() - t0))

    async def _record_answer(self, job: JobRecord, answer: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        # the watch looks every 0.25 s at best: a job that wrote past its quota between two looks,
        # then ended, is caught here, before anything of it is kept
        over = answer.get("ok") and not job.cancel_requested.is_set() and \
            await loop.run_in_executor(None, disk_usage, self.artifacts_dir(job)) > self.quotas.job_disk_bytes
        if job.cancel_requested.is_set():
            job.set_state(J.CANCELLED, "cancelled")
        elif over:
            await loop.run_in_executor(None, _evict_artifacts, self.job_dir(job))
            job.error = disk_error(self.quotas.job_disk_bytes)
            job.log(job.error, "bridge")
            job.set_state(J.FAILED, job.error)
        elif answer.get("ok"):
            size = int(answer.get("result_size", 0))
            job.result_size = size
            if size <= J.INLINE_RESULT_LIMIT:
                path = self.artifacts_dir(job) / RESULT_FILE
                job.result_json = await loop.run_in_executor(None, path.read_text)
            # the index once, now, in a thread: listings and downloads page from memory
            index = await loop.run_in_executor(None, ArtifactIndex.load, self.job_dir(job) / ARTIFACT_INDEX)
            if index is not None:
                self._indexes.put(job.id, index)
            self._remember(job)
            job.set_state(J.SUCCEEDED)
        else:
            job.error = str(answer.get("error") or "failed")
            job.error_parameter = str(answer.get("parameter") or "")
            job.set_state(J.FAILED, job.error)
        await self._persist(job)

    # -- storage ---------------------------------------------------------------------------------

    async def _write_request(self, job: JobRecord) -> None:
        doc = {"id": job.id, "kind": job.kind, "request": job.request, "options": job.options,
               "request_id": job.request_id, "fingerprint": job.fingerprint, "digest": job.digest,
               "timeout_s": job.timeout_s, "no_cache": job.no_cache, "created_at": job.created_at,
               "client": job.client}
        directory = self.job_dir(job)

        def write() -> None:
            directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(directory / REQUEST_FILE, json.dumps(doc))

        await asyncio.get_running_loop().run_in_executor(None, write)

    def _event_log(self, job: JobRecord) -> Callable[[pb.JobEvent], None]:
        """Append each event to the job's log as it happens: one small write (to the OS, not
        synced), so a killed server's events, and their numbers, are there when it restarts."""
        path = self.job_dir(job) / EVENTS_FILE

        def append(event: pb.JobEvent) -> None:
            line = (json.dumps(MessageToDict(event)) + "\n").encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

        return append

    async def _persist(self, job: JobRecord) -> None:
        """Save a final job's record (its events are in the log already): written last, it marks
        the job final."""
        record = json.dumps(job.to_dict())
        directory = self.job_dir(job)

        def write() -> int:
            directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(directory / RECORD_FILE, record)
            return disk_usage(directory)

        used = await asyncio.get_running_loop().run_in_executor(None, write)
        job.stored_bytes = len(record) + _size_of(directory / EVENTS_FILE)
        self._hold(job)
        self._forget_old()
        self._account(job.id, used, (directory / ARTIFACTS_DIR).is_dir())
        await self._enforce_disk()

    # -- disk ------------------------------------------------------------------------------------

    def _account(self, job_id: str, used: int, artifacts: bool, keep_place: bool = False) -> None:
        """Record a final job's disk bytes; it becomes the newest finished unless ``keep_place``."""
        self.disk_bytes += used - (self._usage.get(job_id, 0) if keep_place else self._usage.pop(job_id, 0))
        self._usage[job_id] = used
        (self._with_artifacts.add if artifacts else self._with_artifacts.discard)(job_id)

    def disk_budget(self) -> int:
        """Bytes finished jobs may hold: the total quota less a job quota for each running job."""
        return self.quotas.total_disk_bytes - len(self._running) * self.quotas.job_disk_bytes

    async def _enforce_disk(self) -> None:
        """Within the total disk quota: the oldest finished jobs' artifacts go first (their records,
        and inline results, stay); if that is not enough, the oldest finished jobs go entirely."""
        async with self._disk_lock:         # one pass at a time: each waits on threads between its steps
            await self._evict_oldest()

    async def _evict_oldest(self) -> None:
        loop = asyncio.get_running_loop()
        for job_id in [i for i in self._usage if i in self._with_artifacts]:
            if self.disk_bytes <= self.disk_budget():
                return
            self._indexes.drop(job_id)
            self._with_artifacts.discard(job_id)       # before the wait: no listing reads it now
            left = await loop.run_in_executor(None, _evict_artifacts, self.jobs_root / job_id)
            self._account(job_id, left, False, keep_place=True)
        for job_id in list(self._usage):
            if self.disk_bytes <= self.disk_budget():
                return
            self._drop(job_id)
            await loop.run_in_executor(None, functools.partial(shutil.rmtree, self.jobs_root / job_id, ignore_errors=True))

    def _drop(self, job_id: str) -> None:
        """Forget a final job entirely (its directory is being removed)."""
        self.disk_bytes -= self._usage.pop(job_id, 0)
        self._with_artifacts.discard(job_id)
        self._indexes.drop(job_id)
        job = self.jobs.pop(job_id, None)
        self.record_bytes -= self._weights.pop(job_id, 0)
        if job is not None and job.request_id and self.by_request_id.get(job.request_id) == job_id:
            del self.by_request_id[job.request_id]
        for digest in [d for d, i in self.cache.items() if i == job_id] if job is None else [job.digest]:
            if self.cache.get(digest) == job_id:
                del self.cache[digest]
        created = job.created_at if job is not None else None
        i = bisect.bisect_left(self._listing, (created, job_id)) if created is not None else None
        if i is not None and i < len(self._listing) and self._listing[i][1] == job_id:
            del self._listing[i]
        else:
            self._listing = [entry for entry in self._listing if entry[1] != job_id]

    def _load(self) -> None:
        """Reload what an earlier server with the same data directory left."""
        pending: list[dict[str, Any]] = []
        finals: list[JobRecord] = []
        for directory in sorted(self.jobs_root.iterdir()) if self.jobs_root.is_dir() else []:
            job = self._load_final(directory)
            if job is not None:
                finals.append(job)
                continue
            try:
                if (directory / REQUEST_FILE).is_file() and not (directory / RECORD_FILE).exists():
                    pending.append(json.loads((directory / REQUEST_FILE).read_text()))
            except (OSError, ValueError):
                continue            # a damaged directory is skipped, not fatal
        for job in sorted(finals, key=lambda j: j.finished_at):
            if job.state == J.SUCCEEDED:
                self.cache[job.digest] = job.id
            self._index(job)
            self._list(job)
            self._hold(job)
            directory = self.job_dir(job)
            self._account(job.id, disk_usage(directory), (directory / ARTIFACTS_DIR).is_dir())
        self._forget_old()
        for d in sorted(pending, key=lambda d: d["created_at"]):
            directory = self.jobs_root / d["id"]
            shutil.rmtree(directory / ARTIFACTS_DIR, ignore_errors=True)
            for partial in directory.glob("*.partial"):
                partial.unlink(missing_ok=True)
            job = JobRecord(id=d["id"], kind=d["kind"], request=d["request"], options=d["options"],
                            request_id=d["request_id"], fingerprint=d["fingerprint"], digest=d["digest"],
                            timeout_s=min(d["timeout_s"], self.max_timeout_s), no_cache=d["no_cache"],
                            created_at=d["created_at"], events=_read_events(directory / EVENTS_FILE),
                            client=str(d.get("client", "")))
            self._index(job)
            self._list(job)
            job.sink = self._event_log(job)         # numbering goes on from the last event kept
            states = [e.state.state for e in job.events if e.HasField("state")]
            if states and states[-1] == J.CANCELLING:       # a cancel was under way: it stands
                job.set_state(J.CANCELLED, "cancelled (the server stopped before the job did)")
                record = json.dumps(job.to_dict())
                _atomic_write(directory / RECORD_FILE, record)
                job.stored_bytes = len(record) + _size_of(directory / EVENTS_FILE)
                self._hold(job)
                self._account(job.id, disk_usage(directory), False)
                continue
            if any(state != J.QUEUED for state in states):
                job.log("queued again: the server stopped before this job finished", "bridge")
                job.set_state(J.QUEUED)
            self._queue.put_nowait(job.client, job)

    @staticmethod
    def _load_final(directory: Path) -> JobRecord | None:
        """A final job from its directory, or None (not final, missing or damaged)."""
        try:
            text = (directory / RECORD_FILE).read_text()
            d = json.loads(text)
            job = JobRecord.from_dict(d, _read_events(directory / EVENTS_FILE))
            job.stored_bytes = len(text) + _size_of(directory / EVENTS_FILE)
            if job.state == J.SUCCEEDED and job.result_size <= J.INLINE_RESULT_LIMIT:
                job.result_json = (directory / ARTIFACTS_DIR / RESULT_FILE).read_text()
            return job
        except (OSError, ValueError, KeyError):
            return None

    def _index(self, job: JobRecord) -> None:
        self.jobs[job.id] = job
        if job.request_id:
            self.by_request_id[job.request_id] = job.id

    def _list(self, job: JobRecord) -> None:
        """Add a job to the store's listing (kept sorted by creation)."""
        bisect.insort(self._listing, (job.created_at, job.id))


def _evict_artifacts(directory: Path) -> int:
    """Delete a job's artifacts and their index; the bytes its directory still holds."""
    shutil.rmtree(directory / ARTIFACTS_DIR, ignore_errors=True)
    (directory / ARTIFACT_INDEX).unlink(missing_ok=True)
    return disk_usage(directory)


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_events(path: Path) -> list[pb.JobEvent]:
    """A job's event log; a last line cut short by a crash is dropped (its event was never sent:
    it is written before any watcher sees it)."""
    events: list[pb.JobEvent] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return events
    for line in lines:
        try:
            events.append(ParseDict(json.loads(line), pb.JobEvent()))
        except ValueError:
            break
    return events


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)

