"""A TCP proxy in front of Postgres that can lose a server's answer on purpose.

:class:`CuttingProxy` forwards every byte both ways until it is armed with
:meth:`CuttingProxy.cut`; then, for the next ``n`` answers that carry a marker (by
default an INSERT's command tag), it closes both sides instead of forwarding the answer.
The server has done the work and committed it (Postgres sends a command's answer when
it is ready for the next query, after the commit of an autocommit statement); the
client sees a connection lost and cannot know whether its statement took effect: an
ambiguous commit, made on demand. Use it with ``sslmode=disable`` (it reads the bytes).

:meth:`CuttingProxy.pause` holds every byte in both directions (a network partition:
what a standby streaming through it has not received yet, it will not have);
:meth:`CuttingProxy.resume` lets them through again, :meth:`CuttingProxy.close` drops them.
:meth:`CuttingProxy.crash` is a server that went away: every connection through the
proxy is closed and new ones are closed at once (each refusal's time is kept in
:attr:`CuttingProxy.refused`) until :meth:`CuttingProxy.recover`.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from types import TracebackType

__all__ = ["CuttingProxy"]

INSERT_TAG = re.compile(rb"INSERT 0 (\d+)\x00")


class CuttingProxy:
    """Listens on 127.0.0.1 (a free port) and forwards to ``upstream``."""

    def __init__(self, upstream: tuple[str, int], marker: re.Pattern[bytes] = INSERT_TAG) -> None:
        self.upstream = upstream
        self.marker = marker
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._cuts_left = 0
        #: Every marked answer the server sent through the proxy: (its match, cut?).
        self.answers: list[tuple[bytes, bool]] = []
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._flowing = threading.Event()
        self._flowing.set()
        self._down = False
        #: When each connection attempt was refused during a crash (time.monotonic).
        self.refused: list[float] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, n: int = 1) -> None:
        """Lose the next ``n`` marked answers (and their connections)."""
        with self._lock:
            self._cuts_left = n

    @property
    def cuts_left(self) -> int:
        """How many of the cuts :meth:`cut` asked for are still to come."""
        with self._lock:
            return self._cuts_left

    def pause(self) -> None:
        """Hold every byte from now on, both ways (connections stay open)."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def crash(self) -> None:
        """Close every connection through the proxy; refuse new ones until recover()."""
        self._down = True
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def recover(self) -> None:
        self._down = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down:
                with self._lock:
                    self.refused.append(time.monotonic())
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while not self._flowing.wait(0.05):
                    if self._closed:
                        return
                if answers and self._loses(data):
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _loses(self, data: bytes) -> bool:
        found = [m.group(0) for m in self.marker.finditer(data)]
        if not found:
            return False
        with self._lock:
            lose = self._cuts_left > 0
            if lose:
                self._cuts_left -= 1
            self.answers += [(tag, lose) for tag in found]
        return lose

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
