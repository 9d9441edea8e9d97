"""``stage-cosim serve``: run the gRPC bridge server (its settings, limits and TLS), refusing a
port another process holds before gRPC tries it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from stage_cosim.bridge.jobs import MAX_REQUEST_BYTES
from stage_cosim.bridge.quotas import MIB, Quotas
from stage_cosim.errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_JOB_MEMORY_MIB = 256         # below this a worker cannot hold the library, let alone a job
Q = Quotas()                     # the defaults of the quota flags


# -- serve -----------------------------------------------------------------------------------------------

@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback should come with --token and TLS.")
@click.option("--port", type=int, default=50051, show_default=True, help="Port (0: any free port, printed).")
@click.option("--token", envvar="STAGE_COSIM_TOKEN", show_envvar=True, default=None,
              help="Require 'authorization: Bearer TOKEN' on every call but health checks.")
@click.option("--tls-cert", type=click.Path(path_type=Path), default=None, help="PEM certificate (with --tls-key).")
@click.option("--tls-key", type=click.Path(path_type=Path), default=None, help="PEM private key.")
@click.option("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)), show_default=True,
              help="Jobs running at once, each in its own process.")
@click.option("--max-queue", type=int, default=1024, show_default=True,
              help="Jobs waiting at most; more are refused with RESOURCE_EXHAUSTED.")
@click.option("--job-timeout", type=float, default=3600.0, show_default=True,
              help="Run-time limit of a job, seconds (a client may ask for less, or more up to --max-job-timeout).")
@click.option("--max-job-timeout", type=float, default=Q.max_run_s, show_default=True,
              help="Longest run-time limit, seconds; a client's longer timeout_s is clamped to it.")
@click.option("--max-upload-mib", type=int, default=4096, show_default=True, help="Largest trace-set upload.")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Keep jobs, results and uploads here (a restarted server finds them again); "
                   "default: a temporary directory removed at exit.")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="On SIGTERM, seconds running jobs get to finish before they are cancelled.")
@click.option("--heartbeat", type=float, default=5.0, show_default=True, help="Seconds between heartbeats on watch streams.")
@click.option("--search-workers", type=int, default=1, show_default=True,
              help="Processes each optimize job evaluates with (requests cannot choose).")
@click.option("--ray", "ray_address", default=None, metavar="auto|ADDRESS",
              help="Optimize jobs evaluate on this Ray cluster (requests cannot choose; default: no Ray).")
@click.option("--max-job-memory-mib", type=int, default=None,
              help="Address space of each job's process; larger jobs are refused at submit or fail "
                   "[default: physical memory / (workers + 1), at least 2048; 0: no limit].")
@click.option("--job-cpu-s", type=float, default=0.0,
              help="CPU seconds a job may use [default 0: its run-time limit].")
@click.option("--max-request-kib", type=int, default=256, show_default=True,
              help="Largest document a request carries (model_config, cluster_description, settings_json) "
                   f"and largest request once parsed [at most {MAX_REQUEST_BYTES >> 10:,}: a job record "
                   "must fit a default client's 4 MiB messages].")
@click.option("--max-jobs-per-client", type=int, default=Q.max_jobs_per_client, show_default=True,
              help="Jobs one client (connection) may run at once; others' jobs take turns round-robin "
                   "[0: workers - 1, at least 1].")
@click.option("--job-disk-mib", type=int, default=Q.job_disk_bytes // MIB, show_default=True,
              help="Disk one job may write; past it the job fails alone.")
@click.option("--total-disk-mib", type=int, default=Q.total_disk_bytes // MIB, show_default=True,
              help="Disk all jobs may hold; past it the oldest finished jobs' artifacts are deleted first, "
                   "then their records.")
@click.option("--record-memory-mib", type=int, default=Q.record_memory_bytes // MIB, show_default=True,
              help="Memory for finished job records; older ones are read back from disk when asked for.")
@click.option("--max-field-chars", type=int, default=Q.max_field_chars, show_default=True,
              help="Longest request_id and other non-document text field.")
@click.option("--parse-budget-s", type=float, default=Q.parse_budget_s, show_default=True,
              help="Seconds of request parsing a client may spend in a burst (then RESOURCE_EXHAUSTED).")
@click.option("--parse-refill", type=float, default=Q.parse_refill, show_default=True,
              help="Parsing seconds a client's budget regains per second.")
@click.option("--max-connection-idle-s", type=float, default=Q.max_connection_idle_s, show_default=True,
              help="Close a connection without calls after this long.")
@click.option("--max-connection-age-s", type=float, default=Q.max_connection_age_s, show_default=True,
              help="Close any connection after this long (calls in flight get a grace period).")
@click.option("--handshake-timeout-s", type=float, default=Q.handshake_timeout_s, show_default=True,
              help="Close a connection that has not completed its handshake in this long.")
@click.option("--max-connections-per-peer", type=int, default=Q.max_connections_per_peer, show_default=True,
              help="Connections with calls in flight one host may hold.")
@click.option("--worker-init", default=None, hidden=True, help="MODULE:FUNCTION to run in each worker (tests).")
@click.option("--search-check", default=None, hidden=True,
              help="MODULE:FUNCTION checking optimize and explore requests instead of the searches (tests).")
def serve(host: str, port: int, token: str | None, tls_cert: Path | None, tls_key: Path | None, workers: int,
          max_queue: int, job_timeout: float, max_job_timeout: float, max_upload_mib: int, data_dir: Path | None,
          drain_timeout: float, heartbeat: float, search_workers: int, ray_address: str | None,
          max_job_memory_mib: int | None, job_cpu_s: float, max_request_kib: int, max_jobs_per_client: int,
          job_disk_mib: int, total_disk_mib: int, record_memory_mib: int, max_field_chars: int,
          parse_budget_s: float, parse_refill: float, max_connection_idle_s: float, max_connection_age_s: float,
          handshake_timeout_s: float, max_connections_per_peer: int, worker_init: str | None,
          search_check: str | None) -> None:
    """Serve synthesis, simulation and search over gRPC (stagecosim.v1.Bridge)."""
    import asyncio

    from stage_cosim.bridge.documents import DocumentLimits
    from stage_cosim.bridge.limits import Limits
    from stage_cosim.bridge.process import WorkerSettings
    from stage_cosim.bridge.server import ServerConfig, serve as run_server

    for name, value in (("workers", workers), ("max-queue", max_queue), ("job-timeout", job_timeout),
                        ("max-job-timeout", max_job_timeout), ("max-upload-mib", max_upload_mib),
                        ("heartbeat", heartbeat), ("search-workers", search_workers),
                        ("max-request-kib", max_request_kib)):
        if value <= 0:
            raise UserError(name, f"must be positive, got {value}")
    if not 0 <= port <= 65535:
        raise UserError("port", f"must be within 0..65535, got {port}")
    _check_port(host, port)
    for name, value in (("drain-timeout", drain_timeout), ("job-cpu-s", job_cpu_s),
                        ("max-job-memory-mib", max_job_memory_mib or 0)):
        if value < 0:
            raise UserError(name, f"must not be negative, got {value}")
    if max_request_kib << 10 > MAX_REQUEST_BYTES:
        raise UserError("max-request-kib", f"must be at most {MAX_REQUEST_BYTES >> 10:,} (a job record, which "
                                           "holds the request, must fit a default client's 4 MiB messages), got "
                                           f"{max_request_kib:,}")
    if max_job_memory_mib and max_job_memory_mib < MIN_JOB_MEMORY_MIB:
        raise UserError("max-job-memory-mib", f"must be 0 (no limit) or at least {MIN_JOB_MEMORY_MIB} (a worker holds "
                                              f"the library before any job), got {max_job_memory_mib}")
    quotas = Quotas(max_run_s=max_job_timeout, max_cpu_s=job_cpu_s, max_jobs_per_client=max_jobs_per_client,
                    job_disk_bytes=job_disk_mib * MIB, total_disk_bytes=total_disk_mib * MIB,
                    record_memory_bytes=record_memory_mib * MIB, max_field_chars=max_field_chars,
                    parse_budget_s=parse_budget_s, parse_refill=parse_refill,
                    max_connection_idle_s=max_connection_idle_s, max_connection_age_s=max_connection_age_s,
                    handshake_timeout_s=handshake_timeout_s, max_connections_per_peer=max_connections_per_peer)
    quotas.check()
    if bool(tls_cert) != bool(tls_key):
        raise UserError("tls-key" if tls_cert else "tls-cert", "is required with the other TLS flag (give both)")
    if host not in LOOPBACK and not token:
        click.echo(f"warning: listening on {host} without --token: anyone who can reach it can run jobs", err=True)
    if host not in LOOPBACK and not tls_cert:
        click.echo(f"warning: listening on {host} without TLS: requests and tokens travel in clear", err=True)
    limits = Limits(workers=workers, max_queue=max_queue, default_timeout_s=min(job_timeout, max_job_timeout),
                    max_timeout_s=max_job_timeout)
    config = ServerConfig(host=host, port=port, token=token or None, tls_cert=tls_cert, tls_key=tls_key,
                          data_dir=data_dir, limits=limits, max_upload_bytes=max_upload_mib << 20,
                          heartbeat_s=heartbeat, drain_timeout_s=drain_timeout, worker_init=worker_init,
                          search_check=search_check, quotas=quotas,
                          worker=WorkerSettings(search_workers=search_workers, ray=ray_address or None,
                                                memory_bytes=None if max_job_memory_mib is None else max_job_memory_mib << 20,
                                                cpu_s=job_cpu_s),
                          documents=DocumentLimits(max_bytes=max_request_kib << 10,
                                                   max_request_bytes=max_request_kib << 10,
                                                   max_text_chars=max_field_chars))

    def announce(line: str) -> None:
        click.echo(line)
        sys.stdout.flush()      # a supervisor reading our output sees the port at once

    asyncio.run(run_server(config, announce=announce))


def _check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on before gRPC tries it: gRPC's own failure
    writes a log line of its core to stderr first and an error that points at its settings.
    A plain socket with the server's options (SO_REUSEADDR, no port sharing) fails alike."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError("host", f"cannot resolve {host!r}: {exc.strerror}") from None
    failures = []
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise UserError("port", f"cannot listen on {host}:{port}: {exc.strerror}") from None
            failures.append(exc)
    if failures and len(failures) == len(infos):
        raise UserError("port", f"cannot listen on {host}:{port}: {failures[0].strerror}")


