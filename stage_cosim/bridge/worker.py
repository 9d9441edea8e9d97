"""The worker process: runs jobs one at a time for the server, in its own process group.

Why a process per slot: a cancel or a run-time limit must stop a job whatever it is doing,
including an external ASTRA-sim process it started. The server starts each worker in a new
session (process group) and kills the whole group; the next job gets a fresh worker. Between
jobs a worker stays warm, so small jobs do not pay the interpreter start and imports.

Protocol (JSON lines): the server writes one job per line to stdin; the worker answers on the
file descriptor that was its stdout. Everything the job prints — to stdout or stderr, from
Python or from a child process — goes to stderr, which the server turns into log lines. After
each job the worker writes ``END_MARK`` to stderr, so the server knows the job's log is complete
before it records the job's end.

    -> {"id", "kind", "request", "options", "dir", "server"}   (server: the operator's settings)
    <- {"type": "ready"} once; per job {"type": "progress", ...}* then
       {"type": "done", "ok": true, "result_size": N} or
       {"type": "done", "ok": false, "error": "...", "parameter": "..."|null}

Limits: the address space (``--memory-bytes``, RLIMIT_AS: an allocation past it raises
MemoryError) for the worker's life, and the CPU seconds of each job (the job's ``cpu_s``,
RLIMIT_CPU: SIGXCPU stops the job). A job stopped by either fails with a one-line error, and the
worker is not used again. At its memory limit a process can hardly do anything — every
allocation fails, slowly, and the job's data is still held by the traceback — so the worker
keeps a reserve of address space, released first on MemoryError, and drops the job's frames
before it answers (the server also ends a worker that sits at its limit: ``process.py``).

A worker never outlives its server (``die_with_parent``), even one stuck where no Python code
runs: a small guard process watches the server and ends the worker's process group.

Run as ``python -m stage_cosim.bridge.worker [--parent PID] [--memory-bytes N] [--init
MODULE:FUNCTION]``; ``--init`` is called once at start (the tests install stand-ins for the
searches with it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import json
import mmap
import os
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Mapping, TextIO

END_MARK = "\x1estage-cosim-bridge:end-of-job\x1e"
RESULT_FILE = "result.json"
ARTIFACTS_DIR = "artifacts"
ARTIFACT_INDEX = "artifacts.json"
PROGRESS_INTERVAL_S = 0.1
RESERVE_BYTES = 16 << 20          # address space set aside for answering after a MemoryError
GUARD_POLL_S = 0.5


def memory_error(limit_bytes: int) -> str:
    """The one-line error of a job that outgrew the per-job memory limit (0: no limit)."""
    rule = f"more than this server's {limit_bytes / (1 << 20):,.0f} MiB per job" if limit_bytes else \
        "more than the machine had"
    return f"memory: the job needed {rule}"


def disk_error(limit_bytes: int) -> str:
    """The one-line error of a job that wrote more than the per-job disk quota."""
    return f"disk: the job wrote more than this server's {limit_bytes / (1 << 20):,.0f} MiB per job"


_stop_requested = False


def _on_sigterm(signum: int, frame: object) -> None:
    """First SIGTERM: ask the job to stop (searches poll should_stop); the server kills later."""
    global _stop_requested
    if _stop_requested:
        os._exit(143)
    _stop_requested = True


class Channel:
    """Writes protocol messages; throttles progress so a chatty job cannot flood the server."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._last_sent = 0.0
        self._pending: dict[str, Any] | None = None
        self._last_best: str | None = None

    def send(self, msg: Mapping[str, Any]) -> None:
        self.out.write(json.dumps(msg, default=str) + "\n")
        self.out.flush()

    def progress(self, done: int, total: int, detail: Mapping[str, Any] | None = None) -> None:
        msg: dict[str, Any] = {"type": "progress", "done": int(done), "total": int(total)}
        if detail is not None:
            msg["detail"] = dict(detail)
        best = json.dumps(detail.get("best"), sort_keys=True, default=str) if detail and "best" in detail else None
        now = time.monotonic()
        # a new best or the last step always goes out; the rest at most every PROGRESS_INTERVAL_S
        if (best is not None and best != self._last_best) or (total and done >= total) \
                or now - self._last_sent >= PROGRESS_INTERVAL_S:
            self._last_best = best if best is not None else self._last_best
            self._last_sent = now
            self._pending = None
            self.send(msg)
        else:
            self._pending = msg

    def flush(self) -> None:
        if self._pending is not None:
            self.send(self._pending)
            self._pending = None

    def should_stop(self) -> bool:
        return _stop_requested

    def reset(self) -> None:
        self._pending, self._last_best, self._last_sent = None, None, 0.0


def index_artifacts(artifacts: Path) -> list[dict[str, Any]]:
    """Path, size and SHA-256 of every file a job leaves, computed here, off the server's loop."""
    from stage_cosim.bridge.paths import walk_files

    out = []
    for rel in walk_files(artifacts):
        h = hashlib.sha256()
        size = 0
        with open(artifacts / rel, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
        out.append({"path": rel, "size": size, "sha256": h.hexdigest()})
    return out


def run_job(job: Mapping[str, Any], channel: Channel) -> dict[str, Any]:
    """Run one job; the answer to send back (never raises)."""
    from stage_cosim.bridge import kinds
    from stage_cosim.errors import UserError
    from stage_cosim.trace.chakra import TraceFormatError

    job_dir = Path(job["dir"])
    artifacts = job_dir / ARTIFACTS_DIR
    artifacts.mkdir(parents=True, exist_ok=True)
    # whatever a relative name means to the code a job runs, it means inside the job's directory
    os.chdir(job_dir)
    try:
        result = kinds.run(job["kind"], dict(job["request"]), job.get("options") or {}, artifacts, channel,
                           job.get("server") or {})
        text = json.dumps(result)
        tmp = artifacts / (RESULT_FILE + ".partial")
        tmp.write_text(text)
        os.replace(tmp, artifacts / RESULT_FILE)
        index = index_artifacts(artifacts)
        (job_dir / ARTIFACT_INDEX).write_text(json.dumps(index))
        return {"type": "done", "ok": True, "result_size": len(text.encode())}
    except UserError as exc:
        return {"type": "done", "ok": False, "error": str(exc), "parameter": exc.parameter}
    except TraceFormatError as exc:
        return {"type": "done", "ok": False, "error": f"traces: {exc}", "parameter": "traces"}
    except MemoryError as exc:
        # The address-space limit stopped an allocation. Nothing may be allocated before room is
        # made: the reserve goes first, then the job's frames (held by the traceback) and data.
        _limits.release_reserve()
        exc.__traceback__ = exc.__context__ = exc.__cause__ = None
        return _limits.memory_answer
    except OSError as exc:
        if exc.errno == errno.EFBIG:       # a file past RLIMIT_FSIZE: the disk quota (file_size_limit)
            return {"type": "done", "ok": False, "error": disk_error(int(job.get("disk_bytes") or 0)),
                    "parameter": None}
        return _failure(exc)
    except CpuLimitExceeded as exc:
        return {"type": "done", "ok": False, "error": f"cpu: the job used more than its {exc.seconds:,.0f} s of "
                "CPU time", "parameter": None, "retire": True}
    except BaseException as exc:  # noqa: BLE001 (a job's failure is job data, whatever it is)
        return _failure(exc)
    finally:
        channel.flush()


def _failure(exc: BaseException) -> dict[str, Any]:
    """The answer for a job that raised ``exc``: its traceback to the log, its first line as the error."""
    traceback.print_exception(exc, file=sys.stderr)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return {"type": "done", "ok": False, "error": f"{exc.__class__.__name__}: {first}".rstrip(": "),
            "parameter": None}


class CpuLimitExceeded(BaseException):
    """Raised in the job's code when it has used its CPU seconds (SIGXCPU)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"CPU limit of {seconds:g} s")
        self.seconds = seconds


class _Limits:
    """This worker's resource limits, and whether a job is running (signals act only then)."""

    memory_bytes = 0
    cpu_s = 0.0
    in_job = False
    reserve: mmap.mmap | None = None
    # built before it is needed: at the limit, building it could fail
    memory_answer: dict[str, Any] = {"type": "done", "ok": False, "error": memory_error(0), "parameter": None,
                                     "retire": True}

    def release_reserve(self) -> None:
        if self.reserve is not None:
            self.reserve.close()           # unmapped: its address space is free again
            self.reserve = None


_limits = _Limits()


def _on_sigxcpu(signum: int, frame: object) -> None:
    if _limits.in_job:
        raise CpuLimitExceeded(_limits.cpu_s)


@contextlib.contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    """Within the block, this process may use ``seconds`` more CPU seconds (RLIMIT_CPU: SIGXCPU)."""
    import math
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if seconds > 0:
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        limit = math.ceil(used + seconds)
        resource.setrlimit(resource.RLIMIT_CPU, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    _limits.cpu_s, _limits.in_job = seconds, True
    try:
        yield
    finally:
        _limits.in_job = False
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


@contextlib.contextmanager
def file_size_limit(max_bytes: int) -> Iterator[None]:
    """Within the block, no file this process writes may grow past ``max_bytes`` (RLIMIT_FSIZE):
    the write fails with EFBIG (SIGXFSZ is ignored) instead of filling the disk."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if max_bytes > 0:
        limit = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def limit_memory(max_bytes: int) -> None:
    """Cap this process's address space: an allocation past it raises MemoryError."""
    import resource

    if max_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
        _limits.memory_bytes = max_bytes
        _limits.memory_answer = dict(_limits.memory_answer, error=memory_error(max_bytes))
        try:       # anonymous and untouched: address space, no memory
            _limits.reserve = mmap.mmap(-1, RESERVE_BYTES)
        except (OSError, ValueError):
            _limits.reserve = None


def _kill_my_group(*_: object) -> None:
    """The server is gone: end this worker and everything its job started, at once."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def die_with_parent(parent: int) -> None:
    """Make sure this worker never outlives the server that started it.

    Three ways, each ending the whole process group (the job's children too): on Linux the
    kernel signals the worker when its parent dies (PR_SET_PDEATHSIG); everywhere, the server's
    end of the job pipe closes when it dies, which the thread reading jobs sees (``read_jobs``);
    both need the interpreter to run, so on Linux a guard process watches too (``start_guard``).
    """
    signal.signal(signal.SIGHUP, _kill_my_group)
    if sys.platform.startswith("linux"):
        _set_parent_death_signal(signal.SIGHUP)
    if parent and os.getppid() != parent:        # the server died before the signal was armed
        _kill_my_group()
    start_guard(parent)


def _parent_of(pid: int) -> int:
    """The parent process of ``pid`` (Linux: from /proc), 0 when ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def start_guard(server: int) -> None:
    """Fork a guard that ends this worker's process group once the server is gone.

    The parent-death signal reaches Python code only between two bytecodes; a worker stuck in
    one long C call (an allocation retried at the memory limit) would outlive its server. The
    guard runs no job and holds no pipe: every half second it checks that the worker's parent is
    still the server, and kills the whole group when it is not; it ends with the worker.
    Linux only (it reads /proc)."""
    if not sys.platform.startswith("linux") or not server:
        return
    worker = os.getpid()
    if os.fork() != 0:
        return
    try:                                     # the guard
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            with contextlib.suppress(OSError):      # no pipe of the server's stays open because of it
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # only the group's SIGKILL, or the worker's end, stops it
        _set_parent_death_signal(signal.SIGKILL)
        while os.getppid() == worker:
            if _parent_of(worker) != server:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(GUARD_POLL_S)
    finally:
        os._exit(0)


def _set_parent_death_signal(sig: int) -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def read_jobs(stream: TextIO, jobs: "queue.Queue[str | None]") -> None:
    """Hand the server's job lines to the main thread; at the end of input, finish: a server that
    closes the pipe while a job runs has died (a live one kills the group itself)."""
    for line in stream:
        if line.strip():
            jobs.put(line)
    if _limits.in_job:
        _kill_my_group()
    jobs.put(None)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m stage_cosim.bridge.worker")
    ap.add_argument("--parent", type=int, default=0, help="the server's pid: die with it")
    ap.add_argument("--memory-bytes", type=int, default=0, help="address-space limit (RLIMIT_AS)")
    ap.add_argument("--init", default=None, help="MODULE:FUNCTION to call once at start")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    # the protocol keeps the real stdout; anything else printing to fd 1 lands on stderr
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    die_with_parent(args.parent)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the server decides when a job ends
    signal.signal(signal.SIGXCPU, _on_sigxcpu)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past its limit: EFBIG, not the end of the worker
    from stage_cosim.files import forbid_local_files

    forbid_local_files()        # requests name presets and uploaded content, never the server's files
    if args.init:
        module, _, func = args.init.partition(":")
        getattr(importlib.import_module(module), func)()
    # warm: the first job should not pay the imports (about 0.3 s)
    import stage_cosim.adapters.simulate  # noqa: F401
    import stage_cosim.api  # noqa: F401
    import stage_cosim.workload  # noqa: F401

    limit_memory(args.memory_bytes)        # after the imports: they are not the job's
    jobs: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=read_jobs, args=(sys.stdin, jobs), name="read-jobs", daemon=True).start()
    channel = Channel(proto)
    channel.send({"type": "ready", "pid": os.getpid()})
    while (line := jobs.get()) is not None:
        job = json.loads(line)
        channel.reset()
        with cpu_limit(float(job.get("cpu_s") or 0)), file_size_limit(int(job.get("disk_bytes") or 0)):
            answer = run_job(job, channel)
        sys.stderr.write(END_MARK + "\n")
        sys.stderr.flush()
        channel.send(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
