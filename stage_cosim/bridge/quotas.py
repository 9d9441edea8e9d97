"""The operator's quotas: what one job, one client and one connection may take of a server.

One frozen record, set by ``stage-cosim serve`` flags and never by a request. A request's own
``timeout_s`` is clamped to ``max_run_s``; everything else here a client cannot ask for at all.
"Client" means one connection (a gRPC channel): fairness is between connections, and
``max_connections_per_peer`` bounds how many of them one host may hold open.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Quotas:
    """Per-job, per-client and per-connection limits of a bridge server."""

    max_run_s: float = 3600.0
    """Longest run time a job may have, seconds; a client's ``timeout_s`` above it is clamped to it."""

    max_cpu_s: float = 0.0
    """CPU seconds a job may use (RLIMIT_CPU); 0: its run time, so never more than ``max_run_s``."""

    max_jobs_per_client: int = 0
    """Jobs one client may have running at once; its other jobs wait while other clients' jobs
    take the free workers, round-robin. 0: one fewer than the workers (at least 1), so one client
    never holds every worker."""

    job_disk_bytes: int = 4 * GIB
    """Bytes one job may write (its artifacts); past it the job fails alone with a one-line error."""

    total_disk_bytes: int = 64 * GIB
    """Bytes all jobs' directories may hold together; past it the artifacts of the oldest
    finished jobs are deleted first, then their records (queued and running jobs are kept)."""

    record_memory_bytes: int = 512 * MIB
    """Bytes of finished job records (request, result, events) kept in memory; older records are
    read back from disk when asked for."""

    max_field_chars: int = 1024
    """Characters of each text field that is not a document (``request_id``, names, choices)."""

    parse_budget_s: float = 2.0
    """Seconds of parsing (documents and checks) a client may spend in a burst; the budget
    refills at ``parse_refill`` seconds per second, and a client past it is refused with
    RESOURCE_EXHAUSTED and a retry delay until it refills."""

    parse_refill: float = 0.1
    """Parsing seconds a client's budget regains per second of wall time: a tenth of a core, so
    that a few clients parsing without pause cannot take a small server's cores (at 0.5, four
    clients sending 254 KB documents in a loop could take two)."""

    max_connection_idle_s: float = 300.0
    """A connection with no call for this long is closed (a client reconnects by itself)."""

    max_connection_age_s: float = 24 * 3600.0
    """A connection is closed after this long; calls in flight get ``max_connection_age_s`` / 100
    (at least 10 s) to finish first."""

    handshake_timeout_s: float = 10.0
    """A connection that has not finished its HTTP/2 (and TLS) handshake in this long is closed:
    a silent TCP connection never holds a file descriptor for long."""

    max_connections_per_peer: int = 64
    """Open connections one host may hold; calls on more are refused with RESOURCE_EXHAUSTED."""

    def jobs_per_client(self, workers: int) -> int:
        """The per-client running cap for a server with ``workers`` workers."""
        return self.max_jobs_per_client or max(1, workers - 1)

    def check(self) -> None:
        """Refuse settings that make no sense, naming the ``serve`` flag."""
        from stage_cosim.errors import UserError

        positive = {"max-job-timeout": self.max_run_s, "job-disk-mib": self.job_disk_bytes,
                    "total-disk-mib": self.total_disk_bytes, "record-memory-mib": self.record_memory_bytes,
                    "max-field-chars": self.max_field_chars, "parse-budget-s": self.parse_budget_s,
                    "parse-refill": self.parse_refill, "max-connection-idle-s": self.max_connection_idle_s,
                    "max-connection-age-s": self.max_connection_age_s,
                    "handshake-timeout-s": self.handshake_timeout_s,
                    "max-connections-per-peer": self.max_connections_per_peer}
        for name, value in positive.items():
            if not value > 0:
                raise UserError(name, f"must be positive, got {value}")
        for name, value in (("job-cpu-s", self.max_cpu_s), ("max-jobs-per-client", self.max_jobs_per_client)):
            if value < 0:
                raise UserError(name, f"must not be negative, got {value}")
        if self.job_disk_bytes > self.total_disk_bytes:
            raise UserError("job-disk-mib", "must not exceed --total-disk-mib (one job could never fit)")
