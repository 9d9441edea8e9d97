"""A job: its state machine and its event log.

Every change to a job is an event with a sequence number (1, 2, 3, ...), kept for the job's
life and written to the job's log on disk before any watcher sees it. A watcher that lost its
stream — or its server, killed and restarted — asks again with the last number it saw and
receives the rest: nothing is lost, nothing repeated, and the stream ends with the final state
— always: a watcher whose number is at or past the final state event (it saw the end already, or
holds a number a server lost with the end of its log) receives that event once more, with its
own number, rather than a silent, empty stream. Heartbeats are not stored; they repeat the latest
number. Log events are capped per job (the cap is announced as one more log line); the tail of
the log is always kept for error reports.

States: QUEUED -> RUNNING -> SUCCEEDED | FAILED; RUNNING -> CANCELLING -> CANCELLED;
QUEUED -> CANCELLED. SUCCEEDED, FAILED and CANCELLED are final.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLING, CANCELLED = (
    pb.QUEUED, pb.RUNNING, pb.SUCCEEDED, pb.FAILED, pb.CANCELLING, pb.CANCELLED)
FINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
STATE_NAMES = {v: k.lower() for k, v in pb.JobState.items()}
INLINE_RESULT_LIMIT = 1 << 20     # results above this travel only as the artifact result.json
MAX_LOG_EVENTS = 10_000
MAX_LINE_CHARS = 4096
EXCERPT_LINES = 40
# Every field of a job record is bounded, so a job (and a page of jobs) always fits a message:
# the request by the server's request limit, the result inline up to INLINE_RESULT_LIMIT, these:
MAX_ERROR_CHARS = 2000
MAX_PROGRESS_CHARS = 64 << 10
# So the largest message a server sends — a Job with its inline result, its progress, its error
# twice (also the state change's message) and its log excerpt (UTF-8: up to 4 bytes a character)
# — fits a default client's 4 MiB, a request may take at most what these leave:
DEFAULT_MESSAGE_BYTES = 4 << 20
RECORD_BYTES_BESIDES_REQUEST = (INLINE_RESULT_LIMIT + 2 * MAX_PROGRESS_CHARS
                                + 4 * (EXCERPT_LINES * MAX_LINE_CHARS + 2 * MAX_ERROR_CHARS) + (16 << 10))
MAX_REQUEST_BYTES = (DEFAULT_MESSAGE_BYTES - RECORD_BYTES_BESIDES_REQUEST) >> 10 << 10


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, saying so."""
    if len(text) <= limit:
        return text
    note = f"… ({len(text):,} characters)"
    return text[:max(0, limit - len(note))] + note


@dataclass
class JobRecord:
    id: str
    kind: str
    request: dict[str, Any]                     # the request the job runs (vocabulary keys)
    options: dict[str, Any]                     # kind options (traces, full, timeline, format)
    request_id: str
    fingerprint: str                            # digest of the submit message (idempotency check)
    digest: str                                 # digest of the resolved inputs (cache key)
    timeout_s: float
    no_cache: bool = False
    state: int = QUEUED
    created_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    finished_at: float = 0.0
    progress: pb.Progress = field(default_factory=pb.Progress)
    result_json: str = ""                       # inline result (at most INLINE_RESULT_LIMIT bytes)
    result_size: int = 0
    error: str = ""
    error_parameter: str = ""
    cached: bool = False
    events: list[pb.JobEvent] = field(default_factory=list)
    log_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=EXCERPT_LINES))
    log_events: int = 0
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    client: str = ""                            # who submitted it (fair queueing; not on the wire)
    stored_bytes: int = 0                       # bytes of its record and event log on disk
    # called with every event before any watcher sees it (the manager appends it to the job's log
    # on disk, so the numbers a watcher saw survive the server)
    sink: Callable[[pb.JobEvent], None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    # -- state ---------------------------------------------------------------------------------

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def set_state(self, state: int, message: str = "") -> None:
        if self.final:
            return
        self.error = clip(" ".join(self.error.split()), MAX_ERROR_CHARS)      # one line, bounded
        message = clip(" ".join(message.split()), MAX_ERROR_CHARS)
        now = time.time()
        if state == RUNNING:
            self.started_at = now
        if state in FINAL:
            self.finished_at = now
        self.state = state
        snapshot = self.to_proto()
        snapshot.last_seq += 1                  # the snapshot travels in the event it precedes
        self._append(pb.JobEvent(state=pb.StateChange(state=state, message=message, job=snapshot)))

    def set_progress(self, done: int, total: int, detail_json: str = "", best_json: str = "") -> None:
        # JSON cut short is no JSON: a detail over the limit is replaced by a note of its size
        if len(detail_json) > MAX_PROGRESS_CHARS:
            detail_json = f'{{"omitted_bytes": {len(detail_json)}}}'
        if len(best_json) > MAX_PROGRESS_CHARS:
            best_json = f'{{"omitted_bytes": {len(best_json)}}}'
        self.progress = pb.Progress(done=done, total=total, detail_json=detail_json,
                                    best_json=best_json or self.progress.best_json)
        self._append(pb.JobEvent(progress=self.progress))

    def log(self, line: str, stream: str = "stderr") -> None:
        line = line.rstrip("\n")[:MAX_LINE_CHARS]
        self.log_tail.append(line)
        self.log_events += 1
        if self.log_events <= MAX_LOG_EVENTS:
            self._append(pb.JobEvent(log=pb.LogLine(stream=stream, line=line)))
        elif self.log_events == MAX_LOG_EVENTS + 1:
            self._append(pb.JobEvent(log=pb.LogLine(
                stream="bridge", line=f"(more than {MAX_LOG_EVENTS} log lines: the rest is not streamed)")))

    def _append(self, event: pb.JobEvent) -> None:
        event.seq = len(self.events) + 1
        event.time = time.time()
        event.job_id = self.id
        if self.sink is not None:
            self.sink(event)
        self.events.append(event)
        self._changed.set()
        self._changed = asyncio.Event()

    # -- watching ------------------------------------------------------------------------------

    async def watch(self, after_seq: int, heartbeat_s: float) -> AsyncIterator[pb.JobEvent]:
        """Stored events after ``after_seq``, then live ones, until the final state event — which
        ends every stream of a finished job, sent again when ``after_seq`` is at or past it."""
        seq = max(0, after_seq)
        ended = False
        while True:
            while seq < len(self.events):
                event = self.events[seq]
                ended = ended or (event.HasField("state") and event.state.state in FINAL)
                yield event
                seq += 1
            if self.final:
                if not ended:
                    yield self.final_event()
                return
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), heartbeat_s)
            except asyncio.TimeoutError:
                yield pb.JobEvent(seq=len(self.events), time=time.time(), job_id=self.id,
                                  heartbeat=pb.Heartbeat(state=self.state))

    def final_event(self) -> pb.JobEvent:
        """The event that made this (final) job final; rebuilt from the record if the log lost it."""
        for event in reversed(self.events):
            if event.HasField("state") and event.state.state in FINAL:
                return event
        return pb.JobEvent(seq=len(self.events), time=self.finished_at, job_id=self.id,
                           state=pb.StateChange(state=self.state, message=self.error, job=self.to_proto()))

    # -- views ---------------------------------------------------------------------------------

    def to_proto(self, with_result: bool = True) -> pb.Job:
        from stage_cosim.bridge.codec import dumps

        job = pb.Job(id=self.id, kind=self.kind, state=self.state, request_id=self.request_id,
                     digest=self.digest, created_at=self.created_at, started_at=self.started_at,
                     finished_at=self.finished_at, timeout_s=self.timeout_s, result_size=self.result_size,
                     error=self.error, error_parameter=self.error_parameter, cached=self.cached,
                     last_seq=len(self.events), request_json=dumps(self.request))
        job.progress.CopyFrom(self.progress)
        if with_result:
            job.result_json = self.result_json
        if self.state in (FAILED, CANCELLED):
            job.log_excerpt.extend(self.log_tail)
        return job

    def to_dict(self) -> dict[str, Any]:
        """What is saved to disk for a finished job (the event log is saved beside it)."""
        from google.protobuf.json_format import MessageToDict

        return {"id": self.id, "kind": self.kind, "request": self.request, "options": self.options,
                "request_id": self.request_id, "fingerprint": self.fingerprint, "digest": self.digest,
                "timeout_s": self.timeout_s, "no_cache": self.no_cache, "state": self.state,
                "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
                "progress": MessageToDict(self.progress), "result_size": self.result_size, "error": self.error,
                "error_parameter": self.error_parameter, "cached": self.cached, "log_tail": list(self.log_tail)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], events: list[pb.JobEvent]) -> "JobRecord":
        from google.protobuf.json_format import ParseDict

        job = cls(id=d["id"], kind=d["kind"], request=d["request"], options=d["options"],
                  request_id=d["request_id"], fingerprint=d["fingerprint"], digest=d["digest"],
                  timeout_s=d["timeout_s"], no_cache=d["no_cache"], state=d["state"],
                  created_at=d["created_at"], started_at=d["started_at"], finished_at=d["finished_at"],
                  progress=ParseDict(d["progress"], pb.Progress()), result_size=d["result_size"],
                  error=d["error"], error_parameter=d["error_parameter"], cached=d["cached"], events=events)
        job.log_tail.extend(d["log_tail"])
        return job
