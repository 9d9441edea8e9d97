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
import collections
import contextlib
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
from stage_cosim.bridge.codec import dumps
from stage_cosim.bridge.jobs import JobRecord
from stage_cosim.bridge.process import WorkerDied, WorkerProcess, WorkerSettings
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.worker import ARTIFACT_INDEX, ARTIFACTS_DIR, RESULT_FILE

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


@dataclass
class Limits:
    workers: int = 2
    max_queue: int = 1024
    default_timeout_s: float = 3600.0
    max_timeout_s: float = 24 * 3600.0
    kill_grace_s: float = 1.0
    max_jobs_per_worker: int = 1000
    max_cache_entries: int = 100_000
    # final jobs kept in memory; older ones are read back from disk when asked for
    max_jobs_in_memory: int = 20_000


class JobManager:
    def __init__(self, data_dir: Path, limits: Limits | None = None, worker_init: str | None = None,
                 uploads_root: Path | None = None, worker: WorkerSettings | None = None,
                 persistent: bool = False) -> None:
        self.data = Path(data_dir).resolve()        # workers change directory: every path absolute
        self.jobs_root = self.data / "jobs"
        self.uploads_root = Path(uploads_root).resolve() if uploads_root else self.data / "uploads"
        self.limits = limits or Limits()
        self.worker_init = worker_init
        self.worker_settings = worker or WorkerSettings()
        # a data directory that outlives this server: queued jobs wait there for the next one
        self.persistent = persistent
        self.jobs: dict[str, JobRecord] = {}
        self.by_request_id: dict[str, str] = {}
        self.cache: dict[str, str] = {}                 # digest -> id of a job that succeeded
        self.draining = False
        self._queue: asyncio.Queue[JobRecord] = asyncio.Queue()
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
        if not JOB_ID.match(job_id or ""):
            return None
        job = self._load_final(self.jobs_root / job_id)
        if job is not None:
            self._index(job)
            self._final_order.append(job.id)
        return job

    def _forget_old(self) -> None:
        while len(self.jobs) > self.limits.max_jobs_in_memory and self._final_order:
            self.jobs.pop(self._final_order.popleft(), None)

    def job_dir(self, job: JobRecord) -> Path:
        return self.jobs_root / job.id

    def artifacts_dir(self, job: JobRecord) -> Path:
        return self.job_dir(job) / ARTIFACTS_DIR

    def artifact_index(self, job: JobRecord) -> list[dict[str, Any]]:
        path = self.job_dir(job) / ARTIFACT_INDEX
        return json.loads(path.read_text()) if path.is_file() else []

    @property
    def queued(self) -> int:
        return sum(1 for j in self.jobs.values() if j.state == J.QUEUED)

    @property
    def running(self) -> int:
        return len(self._running)

    async def submit(self, kind: str, request: dict[str, Any], options: dict[str, Any], digest: str,
                     fingerprint: str, request_id: str, timeout_s: float, no_cache: bool) -> JobRecord:
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
                        timeout_s=min(limit, self.limits.max_timeout_s), no_cache=no_cache)
        self._index(job)
        await self._write_request(job)          # the directory and the request, before any event
        job.sink = self._event_log(job)
        job.set_state(J.QUEUED)
        if cached is not None:
            await self._finish_from_cache(job, cached)
        else:
            self._queue.put_nowait(job)
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
                job = await self._queue.get()
                if job.state != J.QUEUED or self.draining:      # draining: it waits on disk
                    continue
                cached = None if job.no_cache else self._cached(job.digest)
                if cached is not None:           # an identical job finished while this one waited
                    await self._finish_from_cache(job, cached)
                    continue
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
        finally:
            if worker is not None:
                await self._retire(worker)

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
                   "cpu_s": self.worker_settings.cpu_s or job.timeout_s}

        def on_progress(msg: dict) -> None:
            detail = msg.get("detail")
            best = dumps(detail["best"]) if isinstance(detail, dict) and detail.get("best") is not None else ""
            job.set_progress(msg.get("done", 0), msg.get("total", 0), dumps(detail) if detail is not None else "",
                             best)

        run = asyncio.create_task(worker.run(message, on_progress, job.log))
        stop = asyncio.create_task(job.cancel_requested.wait())
        timeout = max(0.0, job.timeout_s)
        done, _ = await asyncio.wait({run, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
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
        else:
            job.error = f"timeout: the job ran longer than its limit of {job.timeout_s:g} s"
            job.log(job.error, "bridge")
            job.set_state(J.FAILED, job.error)
        await self._persist(job)
        return False

    async def _record_answer(self, job: JobRecord, answer: dict[str, Any]) -> None:
        if job.cancel_requested.is_set():
            job.set_state(J.CANCELLED, "cancelled")
        elif answer.get("ok"):
            size = int(answer.get("result_size", 0))
            job.result_size = size
            if size <= J.INLINE_RESULT_LIMIT:
                path = self.artifacts_dir(job) / RESULT_FILE
                job.result_json = await asyncio.get_running_loop().run_in_executor(None, path.read_text)
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
               "timeout_s": job.timeout_s, "no_cache": job.no_cache, "created_at": job.created_at}
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
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(MessageToDict(event)) + "\n").encode())
            finally:
                os.close(fd)

        return append

    async def _persist(self, job: JobRecord) -> None:
        """Save a final job's record (its events are in the log already): written last, it marks
        the job final."""
        record = json.dumps(job.to_dict())
        directory = self.job_dir(job)

        def write() -> None:
            directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(directory / RECORD_FILE, record)

        await asyncio.get_running_loop().run_in_executor(None, write)
        self._final_order.append(job.id)
        self._forget_old()

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
            self._final_order.append(job.id)
        self._forget_old()
        for d in sorted(pending, key=lambda d: d["created_at"]):
            directory = self.jobs_root / d["id"]
            shutil.rmtree(directory / ARTIFACTS_DIR, ignore_errors=True)
            for partial in directory.glob("*.partial"):
                partial.unlink(missing_ok=True)
            job = JobRecord(id=d["id"], kind=d["kind"], request=d["request"], options=d["options"],
                            request_id=d["request_id"], fingerprint=d["fingerprint"], digest=d["digest"],
                            timeout_s=d["timeout_s"], no_cache=d["no_cache"], created_at=d["created_at"],
                            events=_read_events(directory / EVENTS_FILE))
            self._index(job)
            job.sink = self._event_log(job)         # numbering goes on from the last event kept
            states = [e.state.state for e in job.events if e.HasField("state")]
            if states and states[-1] == J.CANCELLING:       # a cancel was under way: it stands
                job.set_state(J.CANCELLED, "cancelled (the server stopped before the job did)")
                _atomic_write(directory / RECORD_FILE, json.dumps(job.to_dict()))
                self._final_order.append(job.id)
                continue
            if any(state != J.QUEUED for state in states):
                job.log("queued again: the server stopped before this job finished", "bridge")
                job.set_state(J.QUEUED)
            self._queue.put_nowait(job)

    @staticmethod
    def _load_final(directory: Path) -> JobRecord | None:
        """A final job from its directory, or None (not final, missing or damaged)."""
        try:
            d = json.loads((directory / RECORD_FILE).read_text())
            job = JobRecord.from_dict(d, _read_events(directory / EVENTS_FILE))
            if job.state == J.SUCCEEDED and job.result_size <= J.INLINE_RESULT_LIMIT:
                job.result_json = (directory / ARTIFACTS_DIR / RESULT_FILE).read_text()
            return job
        except (OSError, ValueError, KeyError):
            return None

    def _index(self, job: JobRecord) -> None:
        self.jobs[job.id] = job
        if job.request_id:
            self.by_request_id[job.request_id] = job.id


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

