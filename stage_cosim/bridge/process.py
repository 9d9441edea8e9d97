"""The server's handle on one worker process (see ``worker.py`` for the other side).

The worker runs in its own session, so ``kill()`` reaches every process a job started (an
ASTRA-sim binary included) with one ``killpg``: SIGTERM first — searches see ``should_stop()``
— then SIGKILL after a short grace. A killed worker is never reused.

A job at its memory limit may never fail on its own: every allocation is refused, slowly, and
code that catches the MemoryError (or a C call retrying) can go on for as long as its CPU limit
allows. So while a job runs, the worker's address space is looked at every ``MEMORY_POLL_S``; a
worker that has sat within ``AT_LIMIT_BYTES`` of its limit for ``AT_LIMIT_S`` is killed, and the
job fails with the same one-line memory error the worker itself would give (Linux: /proc).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from stage_cosim.bridge.worker import END_MARK, RESERVE_BYTES, memory_error

STREAM_LIMIT = 16 << 20          # longest protocol or log line read in one piece
MEMORY_POLL_S = 0.5
AT_LIMIT_S = 5.0
AT_LIMIT_BYTES = RESERVE_BYTES   # nearer than the worker's own reserve: it can no longer answer


@dataclass(frozen=True)
class WorkerSettings:
    """What the server's operator decides for the processes that run jobs (``serve`` flags); a
    request can never choose these."""

    search_workers: int = 1          # processes of one optimize job's evaluation pool
    ray: str | None = None           # Ray address optimize jobs evaluate on (None: no Ray)
    # address space of each worker process (RLIMIT_AS); None: default_memory_bytes(), 0: no limit
    memory_bytes: int | None = None
    cpu_s: float = 0.0               # CPU seconds per job (RLIMIT_CPU); 0: the job's run-time limit

    def for_job(self) -> dict[str, Any]:
        return {"search_workers": self.search_workers, "ray": self.ray}


def default_memory_bytes(workers: int) -> int:
    """A share of the machine's memory per worker, leaving one share to the server and the rest:
    physical memory / (workers + 1), at least 2 GiB (a worker with its libraries takes ~0.2 GiB)."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 16 << 30
    return max(2 << 30, physical // (max(1, workers) + 1))


class WorkerDied(Exception):
    """The worker process ended while it had a job (crash, out of memory, killed).

    ``limit``: it was stopped by a resource limit, and the message is the job's one-line error."""

    def __init__(self, message: str, limit: bool = False) -> None:
        super().__init__(message)
        self.limit = limit


def address_space(pid: int) -> int | None:
    """A process's address space in bytes (VmSize, what RLIMIT_AS limits); None when unknown."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def worker_environment() -> dict[str, str]:
    """The environment a worker starts with: the server's, with the module path the server sees
    (as multiprocessing's spawn does) and no entry that means "the working directory"."""
    env = dict(os.environ)
    paths = [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
    # an empty PYTHONPATH entry reads as the working directory: it would put the jobs directory
    # (and then each job's own) on the module path
    inherited = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + inherited))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class WorkerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, memory_bytes: int = 0) -> None:
        self.proc = proc
        self.memory_bytes = memory_bytes
        self.at_memory_limit = False      # killed by the memory watchdog
        self.jobs_run = 0
        self._on_log: Callable[[str], None] | None = None
        self._end_of_log = asyncio.Event()
        self._stderr_task = asyncio.create_task(self._read_stderr())

    @classmethod
    async def start(cls, init: str | None = None, ready_timeout_s: float = 120.0, *,
                    cwd: Path | None = None, memory_bytes: int = 0) -> "WorkerProcess":
        """Start a worker and wait until it has imported the library.

        ``cwd``: a directory the server owns. The worker never starts in the server's working
        directory (whose files a request must not reach) and, from Python 3.11 on, with ``-P``: no
        directory is put in front of the module path.
        """
        env = worker_environment()
        isolate = ["-P"] if sys.version_info >= (3, 11) else []
        args = [sys.executable, *isolate, "-m", "stage_cosim.bridge.worker", "--parent", str(os.getpid())]
        args += ["--memory-bytes", str(memory_bytes)] if memory_bytes else []
        args += ["--init", init] if init else []
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env=env, limit=STREAM_LIMIT,
            cwd=str(cwd) if cwd is not None else None)
        worker = cls(proc, memory_bytes)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), ready_timeout_s)  # type: ignore[union-attr]
            if not line or json.loads(line).get("type") != "ready":
                raise WorkerDied(f"worker did not start (exit status {await proc.wait()})")
        except BaseException:
            await worker.kill(0.0)
            raise
        return worker

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while True:
            try:
                raw = await self.proc.stderr.readline()
            except (ValueError, asyncio.LimitOverrunError):     # a line over the limit: drop it
                continue
            if not raw:
                self._end_of_log.set()
                return
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line == END_MARK:
                self._end_of_log.set()
            elif self._on_log is not None:
                self._on_log(line)

    async def run(self, job: Mapping[str, Any], on_progress: Callable[[dict], None],
                  on_log: Callable[[str], None]) -> dict[str, Any]:
        """Send one job and relay its messages; returns the worker's final answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.jobs_run += 1
        self._on_log, self._end_of_log = on_log, asyncio.Event()
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise self._died() from None
        watchdog = asyncio.create_task(self._watch_memory())
        try:
            return await self._relay(on_progress)
        finally:
            watchdog.cancel()

    async def _relay(self, on_progress: Callable[[dict], None]) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                await self.proc.wait()
                raise self._died()
            msg = json.loads(line)
            if msg.get("type") == "progress":
                on_progress(msg)
            elif msg.get("type") == "done":
                try:       # the job's last log lines come before its end
                    await asyncio.wait_for(self._end_of_log.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
                self._on_log = None
                return msg

    async def _watch_memory(self) -> None:
        """Kill the worker once it has sat at its memory limit for AT_LIMIT_S (see the module)."""
        if not self.memory_bytes or address_space(self.proc.pid) is None:
            return
        since: float | None = None
        loop = asyncio.get_running_loop()
        while self.alive:
            await asyncio.sleep(MEMORY_POLL_S)
            size = address_space(self.proc.pid)
            if size is None or size < self.memory_bytes - AT_LIMIT_BYTES:
                since = None
                continue
            since = loop.time() if since is None else since
            if loop.time() - since >= AT_LIMIT_S:
                self.at_memory_limit = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                return

    def _died(self) -> WorkerDied:
        code = self.proc.returncode
        if self.at_memory_limit:
            return WorkerDied(memory_error(self.memory_bytes), limit=True)
        if code is not None and code < 0:
            if -code == signal.SIGXCPU:
                return WorkerDied("cpu: the job used more than its CPU time (its process was stopped)", limit=True)
            return WorkerDied(f"the worker process was killed by signal {signal.Signals(-code).name}")
        return WorkerDied(f"the worker process exited with status {code}")

    async def kill(self, grace_s: float = 1.0) -> None:
        """End the worker and everything it started (its whole process group)."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if sig == signal.SIGTERM and grace_s <= 0:
                continue
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), wait)
                if sig == signal.SIGTERM:
                    # the worker is gone; its children may not be
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                break
            except asyncio.TimeoutError:
                continue
        await self._drain_pipes()

    async def close(self) -> None:
        """Let an idle worker exit on end of input; kill it if it lingers."""
        if self.alive and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        await self.kill(0.0)

    async def _drain_pipes(self) -> None:
        self._on_log = None
        try:
            await asyncio.wait_for(self._stderr_task, 2.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._stderr_task.cancel()
