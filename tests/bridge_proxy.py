"""A TCP proxy for the bridge's tests that can drop every open connection on demand.

A client talking through it sees what a flaky network does to a long stream: the connection
is cut mid-stream (``drop_all``), or goes silent without a word, every byte lost in both
directions while the sockets stay open (``stall_all``); then the next connection works again.
"""

from __future__ import annotations

import socket
import threading


class DroppingProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._stalled: set[int] = set()          # ids of sockets whose bytes are now discarded
        self._silent: list[socket.socket] = []   # stalled sockets, kept open until close()
        self._lock = threading.Lock()
        self.drops = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if id(src) not in self._stalled:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def drop_all(self) -> None:
        """Cut every open connection (both directions)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.drops += 1

    def stall_all(self) -> None:
        """Every open connection goes silent: nothing more passes, nothing is closed."""
        with self._lock:
            conns, self._conns = self._conns, []
            self._stalled.update(id(s) for s in conns)
            self._silent += conns

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            self._conns += self._silent
        self.drop_all()
