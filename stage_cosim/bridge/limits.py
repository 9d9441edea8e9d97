"""The job manager's limits: workers, queue, run times, worker reuse, and what it holds in memory.

The operator's per-job, per-client and per-connection quotas are apart (``quotas.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


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
