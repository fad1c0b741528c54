"""A bare WSGI app whose bodies are lazy generators with ``close()``, for the WSGI middleware tests: it
gives up (``BudgetExhausted``) or fails at every point of a response, by path, and records which of its
bodies the server closed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import askonce
from askonce import Reply

KEY = "01J9ZQ4M6T8V0XKD3C5B7N9P1R"
GOOD = f'v=1, k="{KEY}", o=edge, e, b=2, d=5000'


class Closes:
    """The app's iterables that were closed, by path (PEP 3333: the server must close what it got)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paths: list[str] = []

    def add(self, path: str) -> None:
        with self.lock:
            self.paths.append(path)


class Body:
    """A response body with ``close``: the generator runs lazily, as a streaming app's does."""

    def __init__(self, chunks: Iterator[bytes], closes: Closes, path: str) -> None:
        self.chunks = chunks
        self.closes = closes
        self.path = path

    def __iter__(self) -> Iterator[bytes]:
        return self.chunks

    def close(self) -> None:
        self.closes.add(self.path)


def exhausted() -> askonce.BudgetExhausted:
    return askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="db", key=None, attempts=3)


def make_app(closes: Closes) -> Callable[[dict[str, Any], Any], Iterable[bytes]]:
    """A bare WSGI app whose bodies are generators: ``start_response`` runs at the first ``next``."""

    def chunks(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        path = environ["PATH_INFO"]
        if path == "/lazy-give-up":  # before start_response: nothing is sent yet
            raise exhausted()
        if path == "/lazy-bug":
            raise RuntimeError("a plain bug, before start_response")
        status = {"/no-content": "204 No Content", "/not-modified": "304 Not Modified"}.get(path, "200 OK")
        start_response(status, [] if status[0] == "3" or status[0:3] == "204" else
                       [("content-type", "text/plain")])
        if path == "/started-give-up":  # start_response called, but no byte sent: still time for a 503
            raise exhausted()
        if path in ("/no-content", "/not-modified"):
            return
        yield b""  # an empty chunk sends nothing (PEP 3333): the headers are still not out
        if path == "/empty-then-give-up":
            raise exhausted()
        q = askonce.current()
        yield f"{None if q is None else q.key} {None if q is None else q.budget} " \
              f"{None if q is None else q.origin}\n".encode()
        if path == "/midstream-give-up":  # the headers went out with the first chunk: too late for a 503
            raise exhausted()
        yield b"end\n"

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ["PATH_INFO"]
        if path in ("/write", "/write-then-give-up", "/write-then-raise"):  # the legacy write() callable
            write = start_response("200 OK", [("content-type", "text/plain")])
            write(b"written\n")  # the headers go out with it
            if path == "/write-then-raise":  # from the app call itself, not from its body
                raise exhausted()

            def rest() -> Iterator[bytes]:
                if path == "/write-then-give-up":
                    raise exhausted()
                yield b"returned\n"

            return Body(rest(), closes, path)
        return Body(chunks(environ, start_response), closes, path)

    return app
