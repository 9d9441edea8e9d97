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

Run as ``python -m stage_cosim.bridge.worker [--init MODULE:FUNCTION]``; ``--init`` is called
once at start (the tests install stand-ins for the searches with it).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, TextIO

END_MARK = "\x1estage-cosim-bridge:end-of-job\x1e"
RESULT_FILE = "result.json"
ARTIFACTS_DIR = "artifacts"
ARTIFACT_INDEX = "artifacts.json"
PROGRESS_INTERVAL_S = 0.1

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
    except BaseException as exc:  # noqa: BLE001 (a job's failure is job data, whatever it is)
        traceback.print_exc(file=sys.stderr)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"type": "done", "ok": False, "error": f"{exc.__class__.__name__}: {first}".rstrip(": "),
                "parameter": None}
    finally:
        channel.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the protocol keeps the real stdout; anything else printing to fd 1 lands on stderr
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the server decides when a job ends
    from stage_cosim.files import forbid_local_files

    forbid_local_files()        # requests name presets and uploaded content, never the server's files
    if "--init" in argv:
        module, _, func = argv[argv.index("--init") + 1].partition(":")
        getattr(importlib.import_module(module), func)()
    # warm: the first job should not pay the imports (about 0.3 s)
    import stage_cosim.adapters.roofline.simulate  # noqa: F401
    import stage_cosim.api  # noqa: F401
    import stage_cosim.workload  # noqa: F401

    channel = Channel(proto)
    channel.send({"type": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        channel.reset()
        answer = run_job(job, channel)
        sys.stderr.write(END_MARK + "\n")
        sys.stderr.flush()
        channel.send(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
