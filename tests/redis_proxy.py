"""A TCP proxy on 127.0.0.1 in front of a real ``redis-server`` that can lose a reply.

``lose_reply_of(sha)`` arms it: the next connection that sends ``EVALSHA <sha>`` has the command
forwarded (Redis runs it) and from then on every reply on that connection is dropped, as when a
reply times out after the script ran. Other connections are untouched. ``lost`` counts the
connections that went deaf so; ``close()`` stops the proxy and every connection it holds.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class RedisProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._armed: bytes | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self.lost = 0
        threading.Thread(target=self._accept, name="redis-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose_reply_of(self, sha: str) -> None:
        with self._lock:
            self._armed = sha.encode()  # redis-py sends the name upper-case, the digest lower

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            deaf = threading.Event()
            threading.Thread(target=self._up, args=(client, server, deaf), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, deaf), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, deaf: threading.Event) -> None:
        seen = b""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                with self._lock:
                    armed = self._armed
                    if armed is not None and not deaf.is_set():
                        seen = (seen + data)[-4096:]  # a command may come in several reads
                        if b"$7\r\nEVALSHA\r\n$40\r\n" + armed in seen:
                            deaf.set()  # before the command is forwarded, so its reply is lost
                            self._armed = None
                            self.lost += 1
                dst.sendall(data)
        self._shut(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket, deaf: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not deaf.is_set():
                    dst.sendall(data)
        self._shut(src, dst)

    @staticmethod
    def _shut(*sockets: socket.socket) -> None:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def redis_proxy(upstream_port: int) -> Iterator[RedisProxy]:
    proxy = RedisProxy(upstream_port)
    try:
        yield proxy
    finally:
        proxy.close()
