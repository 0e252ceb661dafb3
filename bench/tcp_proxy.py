"""A loopback TCP forwarder that fault tests and ``bench/chaos.py`` can break and heal.

Three states, switched from any thread::

    forwarding ──stop()──► refused      (nothing listens: connections are refused,
        ▲  │                             open ones are reset)
        │  └─blackhole()─► blackholed   (connections are accepted and whatever is sent
        │                                is read and dropped, nothing ever comes back:
        └──── start() ◄────┘             packets lost, not refused)

``start()`` heals either fault (after a blackhole, the connections that lost bytes
are closed: a client sees them end, as when a real network path comes back after
its TCP retries gave up).
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (see module doc)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._blackholed = False
        self.port = 0

    @property
    def blackholed(self) -> bool:
        return self._blackholed

    def start(self) -> None:
        """Forward again (listen if not listening; end a blackhole's connections)."""
        if self._blackholed:
            self._blackholed = False
            self._drop_connections()
        if self._listener is not None:
            return
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Refuse: close the listener and every connection."""
        self._blackholed = False
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self._drop_connections()

    def blackhole(self) -> None:
        """Keep accepting, drop every byte in both directions from now on."""
        self._blackholed = True

    def _drop_connections(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._blackholed:
                with self._lock:
                    self._sockets.append(client)
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _swallow(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self._blackholed:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
