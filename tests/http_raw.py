"""HTTP on raw sockets, byte for byte: ``Canned``, a server that answers with a head the test writes, and
``raw``, a client that writes a request by hand and reads the whole response as it came."""

from __future__ import annotations

import contextlib
import socket
import threading

from askonce import Reply
from askonce.core import wire
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER


class Canned:
    """A socket server that answers each request with ``head`` and a two-byte body, counting arrivals."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.head = b"HTTP/1.1 200 OK\r\n"
        self.lock = threading.Lock()
        self.arrivals = 0
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def url(self, path: str = "/x") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            t = threading.Thread(target=self._one, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                with self.lock:
                    self.arrivals += 1
                conn.sendall(self.head + b"content-length: 2\r\nconnection: close\r\n\r\nok")
            except OSError:
                return

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (closing alone does not, on Linux)
        self.sock.close()
        self.thread.join(5)
        for t in self.threads:
            t.join(5)



class Response:
    def __init__(self, data: bytes) -> None:
        head, _, self.body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split()[1]) if lines[0] else 0
        self.headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            self.headers.append((name.strip().lower(), value.strip()))
        self.complete = True
        if self.all("transfer-encoding") == ["chunked"]:
            self.body, self.complete = _dechunk(self.body)

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    @property
    def reply(self) -> Reply:
        (value,) = self.all(REPLY_HEADER)
        parsed = wire.parse_reply(value)
        assert isinstance(parsed, Reply), (value, parsed)
        return parsed


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    """A chunked body's bytes, and whether it ended with its last chunk (a cut stream does not)."""
    out = b""
    while True:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            return out, False
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            return out, True
        if len(rest) < size + 2:
            return out + rest[:size], False
        out, data = out + rest[:size], rest[size + 2:]


def raw(url: str, path: str = "/ok", headers: bytes = b"", method: bytes = b"GET") -> Response:
    """One HTTP/1.1 request written by hand (``Connection: close``); the whole response as it came."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(method + b" " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + headers + b"\r\n")
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
    return Response(data)


def q(text: str | bytes) -> bytes:
    value = text.encode("ascii") if isinstance(text, str) else text
    return QUESTION_HEADER.encode() + b": " + value + b"\r\n"
