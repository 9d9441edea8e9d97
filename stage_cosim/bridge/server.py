"""The gRPC server: the ``stagecosim.v1.Bridge`` service, health, reflection, auth, drain.

One asyncio loop (``grpc.aio``) serves every call; jobs run in worker processes, so a watch
stream costs an awaiting coroutine and nothing more: thousands of open streams do not starve
other calls. ``BridgeServer`` is the embeddable piece (tests and notebooks start one with
:func:`start_in_thread`); ``serve`` runs one until SIGTERM or SIGINT, then drains: health turns
NOT_SERVING, new submits are refused, running jobs get ``drain_timeout_s`` to finish and are
cancelled after it.

Safe by default: the host is 127.0.0.1; with a token, every call but the health service must
carry ``authorization: Bearer <token>``; TLS with a certificate and key.

The pieces it puts together: the settings (``config.py``), the interceptors
(``interceptors.py``), the service's methods (``servicer.py``) and the job manager
(``manager.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from stage_cosim import __version__
from stage_cosim.bridge import jobs as J
from stage_cosim.bridge.config import ServerConfig, connection_options
from stage_cosim.bridge.interceptors import SERVICE, PeerConnections, RequestDecoding, TokenAuth
from stage_cosim.bridge.limits import Limits
from stage_cosim.bridge.manager import JobManager
from stage_cosim.bridge.process import default_memory_bytes
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2_grpc as pb_grpc
from stage_cosim.bridge.servicer import BridgeServicer
from stage_cosim.bridge.uploads import UploadStore
from stage_cosim.errors import UserError


class BridgeServer:
    """The whole bridge on one asyncio loop: ``await start()`` (returns the port), ``await stop()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port = 0
        self._tmp: str | None = None
        self._server: grpc.aio.Server | None = None
        self._servicer: BridgeServicer | None = None
        self.manager: JobManager | None = None
        self.health = health_aio.HealthServicer()

    async def start(self) -> int:
        cfg = self.config
        if cfg.documents.max_request_bytes > J.MAX_REQUEST_BYTES or cfg.documents.max_bytes > J.MAX_REQUEST_BYTES:
            raise UserError("max-request-kib", f"must be at most {J.MAX_REQUEST_BYTES >> 10:,}: a job record, which "
                                               "holds the request, must fit a default client's 4 MiB messages")
        cfg.quotas.check()
        need = (cfg.limits.workers + 1) * cfg.quotas.job_disk_bytes
        if cfg.quotas.total_disk_bytes < need:
            # running jobs each keep a job's quota free: with less, a finished job could never be kept
            raise UserError("total-disk-mib", f"must be at least {need >> 20:,}: --job-disk-mib for each worker and "
                                              "for one finished job")
        if cfg.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="stage-cosim-bridge-")
        data = Path(cfg.data_dir or self._tmp)  # type: ignore[arg-type]
        worker = cfg.worker
        if worker.memory_bytes is None:
            worker = dataclasses.replace(worker, memory_bytes=default_memory_bytes(cfg.limits.workers))
        self.manager = JobManager(data, cfg.limits, cfg.worker_init, worker=worker, persistent=cfg.data_dir is not None,
                                  quotas=cfg.quotas)
        uploads = UploadStore(self.manager.uploads_root, cfg.max_upload_bytes)
        uploads.clean()
        interceptors: list[grpc.aio.ServerInterceptor] = [RequestDecoding()]
        interceptors += [TokenAuth(cfg.token)] if cfg.token else []
        interceptors += [PeerConnections(cfg.quotas.max_connections_per_peer)]
        # so_reuseport 0: a port already taken is an error, not a silently shared port
        server = grpc.aio.server(interceptors=interceptors,
                                 options=[("grpc.so_reuseport", 0), *connection_options(cfg.quotas)])
        self._servicer = BridgeServicer(self.manager, uploads, cfg)
        pb_grpc.add_BridgeServicer_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert or cfg.tls_key:
                creds = grpc.ssl_server_credentials([(_read(cfg.tls_key, "tls-key"), _read(cfg.tls_cert, "tls-cert"))])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise UserError("port", f"cannot listen on {address}: {exc}") from None
        if not self.port:
            raise UserError("port", f"cannot listen on {address}")
        await self.manager.start()
        await server.start()
        self._server = server
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Graceful: health NOT_SERVING, no new jobs, running jobs finish or are cancelled."""
        if self._server is None or self.manager is None:
            return
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        await self.manager.drain(timeout)
        await self._server.stop(grace=2.0)
        if self._servicer is not None:
            self._servicer.close()
        await self.manager.close()
        self._server = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _read(path: Path | None, name: str) -> bytes:
    if path is None:
        raise UserError(name, "is required with --tls-cert/--tls-key (give both)")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UserError(name, f"{path}: {exc.strerror}") from None


async def serve(config: ServerConfig, announce: Callable[[str], None] = print) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    server = BridgeServer(config)
    port = await server.start()
    host = config.host
    scheme = "tls" if config.tls_cert else "insecure"
    manager = server.manager
    assert manager is not None
    memory = manager.worker_settings.memory_bytes
    announce(f"stage-cosim bridge {__version__} serving on {host}:{port} ({scheme}"
             f"{', token required' if config.token else ''}; data in {manager.data}; {manager.limits.workers} "
             f"workers, {f'{memory >> 20:,} MiB' if memory else 'unlimited memory'} per job)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    announce(f"draining: running jobs have {config.drain_timeout_s:g} s to finish")
    await server.stop()
    announce("stopped")


# -- embedding --------------------------------------------------------------------------------------------

class ServerThread:
    """A BridgeServer on its own loop in a background thread (tests, notebooks).

    ``with start_in_thread(ServerConfig(port=0)) as s: Client(f"127.0.0.1:{s.port}")``
    """

    def __init__(self, config: ServerConfig) -> None:
        self.server = BridgeServer(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bridge-server", daemon=True)
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float | None = 60.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "ServerThread":
        self._thread.start()
        self.port = self.call(self.server.start())
        return self

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        try:
            self.call(self.server.stop(drain_timeout_s), timeout=drain_timeout_s + 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(config: ServerConfig) -> ServerThread:
    return ServerThread(config)


__all__ = ["BridgeServer", "Limits", "ServerConfig", "ServerThread", "serve", "start_in_thread"]
