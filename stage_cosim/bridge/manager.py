"""The job manager: a bounded queue, a fixed number of worker slots, a result cache.

Everything here runs on the server's asyncio loop and never blocks it: worker processes are
driven through asyncio pipes, file work goes to the default executor (an event is one small
append, made on the loop so that it is on disk before a watcher sees it). The pieces:

* submit: idempotent by the client's request id; refused with QueueFull when ``max_queue`` jobs
  wait; answered from the cache at once when the same resolved inputs already succeeded.
* slots: ``workers`` loops, each owning one warm worker process (``process.py``); a job that is
  cancelled or runs past its limit takes its process down with it, and the slot starts another.
* storage (``store.py``, which the manager builds on): each job's directory, final records in
  memory within bounds, the listing, the cache, the disk quota. A restarted server reloads final
  jobs (results, downloads, idempotency and cache survive) and queues again the jobs that had not
  finished — queued or running when the server was killed, or queued when it was stopped —
  numbering their events on from the last one kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
from pathlib import Path
from typing import Any

from stage_cosim.bridge import jobs as J
from stage_cosim.bridge.artifacts import ArtifactIndex
from stage_cosim.bridge.codec import dumps
from stage_cosim.bridge.fair import FairQueue
from stage_cosim.bridge.jobs import JobRecord
from stage_cosim.bridge.limits import Limits
from stage_cosim.bridge.paths import disk_usage
from stage_cosim.bridge.process import WorkerDied, WorkerProcess, WorkerSettings
from stage_cosim.bridge.quotas import Quotas
from stage_cosim.bridge.store import JobStore, evict_artifacts
from stage_cosim.bridge.worker import ARTIFACT_INDEX, RESULT_FILE, disk_error


class QueueFull(Exception):
    def __init__(self, queued: int, retry_after_s: float) -> None:
        super().__init__(f"the queue is full ({queued} jobs waiting)")
        self.retry_after_s = retry_after_s


class Draining(Exception):
    """The server is shutting down and takes no new work."""


class RequestIdReused(Exception):
    """A request id came back with a different request."""


class WrongState(Exception):
    pass


class JobManager(JobStore):
    def __init__(self, data_dir: Path, limits: Limits | None = None, worker_init: str | None = None,
                 uploads_root: Path | None = None, worker: WorkerSettings | None = None,
                 persistent: bool = False, quotas: Quotas | None = None) -> None:
        super().__init__(data_dir, limits or Limits(), quotas or Quotas())
        self.uploads_root = Path(uploads_root).resolve() if uploads_root else self.data / "uploads"
        self.worker_init = worker_init
        self.worker_settings = worker or WorkerSettings()
        # a data directory that outlives this server: queued jobs wait there for the next one
        self.persistent = persistent
        self.draining = False
        # per-client caps, round-robin between clients (fair.py)
        self._queue: FairQueue[JobRecord] = FairQueue(self.quotas.jobs_per_client(self.limits.workers))
        self._slots: list[asyncio.Task] = []
        self._workers: set[WorkerProcess] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.jobs_root.mkdir(parents=True, exist_ok=True)
        self.uploads_root.mkdir(parents=True, exist_ok=True)
        for job in self._load():       # at start, before serving: blocking is fine here
            self._queue.put_nowait(job.client, job)
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
            await loop.run_in_executor(None, evict_artifacts, self.job_dir(job))
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
