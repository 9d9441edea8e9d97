"""The job store: every job a server knows, in memory and in its data directory.

``<data>/jobs/<id>/`` holds the request, the event log (``events.jsonl``, appended as events
happen), the artifacts (``artifacts/``, what clients may download) and, once the job is final,
``job.json``. The store holds final records in memory within a count and a byte bound (older
ones are read back from disk when asked for), the listing that pages every job, the result cache
(resolved inputs -> a job that succeeded), and keeps the data directory within its disk quota:
the oldest finished jobs' artifacts go first, then the oldest finished jobs entirely. A restarted
server reloads the final jobs and gets back those that had not finished, to queue them again
(:meth:`JobStore._load`).

On the server's loop, work here is either one small step or handed to the default executor.
The job manager (``manager.py``) is a store that also queues and runs jobs.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from google.protobuf.json_format import MessageToDict, ParseDict

from stage_cosim.bridge import jobs as J
from stage_cosim.bridge.artifacts import ArtifactIndex, IndexCache
from stage_cosim.bridge.jobs import JobRecord
from stage_cosim.bridge.limits import Limits
from stage_cosim.bridge.paths import disk_usage
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.quotas import MIB, Quotas
from stage_cosim.bridge.worker import ARTIFACT_INDEX, ARTIFACTS_DIR, RESULT_FILE

REQUEST_FILE, RECORD_FILE, EVENTS_FILE = "request.json", "job.json", "events.jsonl"
JOB_ID = re.compile(r"^j-[0-9a-f]{16}$")


class NotFound(Exception):
    pass


class ArtifactsEvicted(Exception):
    """A job's artifacts were deleted to keep the data directory within its disk quota."""


class JobStore:
    def __init__(self, data_dir: Path, limits: Limits, quotas: Quotas) -> None:
        self.data = Path(data_dir).resolve()        # workers change directory: every path absolute
        self.jobs_root = self.data / "jobs"
        self.limits = limits
        self.quotas = quotas
        self.jobs: dict[str, JobRecord] = {}
        self.by_request_id: dict[str, str] = {}
        self.cache: dict[str, str] = {}                 # digest -> id of a job that succeeded
        # every job in the store, in memory or not, oldest first: ListJobs pages from it
        self._listing: list[tuple[float, str]] = []
        # bytes of each final job record held in memory (record_memory_bytes bounds the sum)
        self._weights: dict[str, int] = {}
        self.record_bytes = 0
        # disk bytes of each final job's directory, oldest finish first (total_disk_bytes)
        self._usage: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._with_artifacts: set[str] = set()
        self.disk_bytes = 0
        # the jobs running now: each keeps a job's disk quota free (disk_budget)
        self._running: set[str] = set()
        self._indexes = IndexCache()
        self._disk_lock = asyncio.Lock()
        self._final_order: collections.deque[str] = collections.deque()

    # -- jobs --------------------------------------------------------------------------------------

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
            left = await loop.run_in_executor(None, evict_artifacts, self.jobs_root / job_id)
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

    def _load(self) -> list[JobRecord]:
        """Reload what an earlier server with the same data directory left; the jobs to queue
        again, oldest first."""
        pending: list[dict[str, Any]] = []
        queue: list[JobRecord] = []
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
            queue.append(job)
        return queue

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


def evict_artifacts(directory: Path) -> int:
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

