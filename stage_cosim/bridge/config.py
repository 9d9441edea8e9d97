"""A bridge server's settings, and the gRPC options its connections are held to."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stage_cosim.bridge.documents import DocumentLimits
from stage_cosim.bridge.limits import Limits
from stage_cosim.bridge.process import WorkerSettings
from stage_cosim.bridge.quotas import Quotas

# Keepalive: the server pings a quiet connection every 30 s and drops it when no answer comes in
# 10 s (a vanished client's streams end); clients may ping every 5 s (the client pings every 10),
# and a client that pings more often is sent away after two strikes.
KEEPALIVE = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.keepalive_permit_without_calls", 1),
             ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000), ("grpc.http2.max_ping_strikes", 2)]


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    data_dir: Path | None = None              # None: a temporary directory, removed at the end
    limits: Limits = field(default_factory=Limits)
    max_upload_bytes: int = 4 << 30
    heartbeat_s: float = 5.0
    drain_timeout_s: float = 30.0
    worker_init: str | None = None            # MODULE:FUNCTION run in each worker (tests)
    # MODULE:FUNCTION(kind, request) checking optimize and explore requests at submit instead of
    # the real searches' parsing: for workers that run stand-in searches (tests)
    search_check: str | None = None
    worker: WorkerSettings = field(default_factory=WorkerSettings)   # the operator's, never a request's
    documents: DocumentLimits = field(default_factory=DocumentLimits)  # what one request may carry
    quotas: Quotas = field(default_factory=Quotas)   # per job, client and connection (quotas.py)


def connection_options(quotas: Quotas) -> list[tuple[str, int]]:
    """gRPC server options that close idle, old and never-started connections (``quotas``)."""
    age_ms = int(quotas.max_connection_age_s * 1000)
    return [*KEEPALIVE, ("grpc.max_connection_idle_ms", int(quotas.max_connection_idle_s * 1000)),
            ("grpc.max_connection_age_ms", age_ms), ("grpc.max_connection_age_grace_ms", max(10_000, age_ms // 100)),
            ("grpc.server_handshake_timeout_ms", int(quotas.handshake_timeout_s * 1000))]
