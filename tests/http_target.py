"""A real HTTP target on 127.0.0.1 for the client tests, and the smallest integration that calls it.

``Target`` counts arrivals per question key and behaves by path:

    /ok             200                    /fail/N    503 for the first N arrivals of a key, then 200
    /fail           503 always             /flaky     503 for 10 % of arrivals (seeded), else 200
    /status/S       status S               /after/S   503 with Retry-After: S on a key's first arrival
    /dnr            503 + do-not-retry     /close     closes the connection without a response
    /slow           waits (up to 5 s, released at teardown), then 200
    /t429           429 with Retry-After: 1 on a key's first arrival, then 200

It answers as an askonce-aware target (``askonce-reply`` with the budget it was given, nothing spent)
unless the query has ``plain``. ``StdlibExchange`` is a third client, on ``http.client``, that drives the
``Caller`` the way an integration does; ``call`` makes one call through it.
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import askonce
from askonce import Question, Reply, RetryPolicy
from askonce.client import LOST_OUTCOME, REFUSED_OUTCOME, Caller, ClientPolicy, Outcome, judge_http
from askonce.core.backoff import NO_WAIT
from askonce.core.wire import REPLY_HEADER, format_reply


class Target:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.reset()
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, so released connections can be seen being reused
            disable_nagle_algorithm = True  # headers and body go out in two writes: no delayed-ACK stalls

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                target.handle(self)

            do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], OSError):  # a client that gave up is what tests do
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        with self.lock:
            self.arrivals: Counter[str | None] = Counter()
            self.seen: list[Question | None] = []
            self.raw: list[str | None] = []
            self.ports: list[int] = []
            self.flaky = __import__("random").Random(7)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def total(self) -> int:
        return sum(self.arrivals.values())

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            h.rfile.read(length)
        elif h.headers.get("Transfer-Encoding") == "chunked":
            while (size := int(h.rfile.readline().strip() or b"0", 16)) > 0:
                h.rfile.read(size + 2)
            h.rfile.readline()
        url = urlsplit(h.path)
        kind, _, arg = url.path.strip("/").partition("/")
        q = askonce.propagation.extract(h.headers)
        key = None if q is None else q.key
        with self.lock:
            self.arrivals[key] += 1
            n = self.arrivals[key]
            self.seen.append(q)
            self.raw.append(h.headers.get("askonce-question"))
            self.ports.append(h.client_address[1])
            unlucky = self.flaky.random() < 0.1
        status, headers = 200, {}
        if kind == "close":
            h.close_connection = True
            return
        if kind == "slow":
            self.release.wait(5.0)
        elif kind == "fail":
            status = 503 if not arg or n <= int(arg) else 200
        elif kind == "flaky":
            status = 503 if unlucky else 200
        elif kind == "status":
            status = int(arg)
        elif kind == "after" and n == 1:
            status, headers = 503, {"Retry-After": arg}
        elif kind == "t429" and n == 1:
            status, headers = 429, {"Retry-After": "1"}
        budget = 0 if q is None else q.budget
        if kind == "dnr":
            status, headers = 503, {REPLY_HEADER: format_reply(Reply(budget, True, "overloaded"))}
        elif "plain" not in url.query:
            headers.setdefault(REPLY_HEADER, format_reply(Reply(budget)))
        body = b"ok" if status < 400 else b"no" * 10
        h.send_response(status)
        for name, value in headers.items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def refused_url() -> str:
    """A URL nothing listens on: connecting is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/ok"


def policy(**kw: Any) -> ClientPolicy:
    """A client layer "web" trying 3 times with no waits, no token bucket and no adaptive admission
    (the tests share one target, and its failures would shed the next test's calls), unless told
    otherwise."""
    retry = kw.pop("retry", RetryPolicy(attempts=3, backoff=NO_WAIT))
    return ClientPolicy(**{"layer": "web", "retry": retry, "bucket": None, "admission": None, **kw})


# --- a third client, on http.client, to drive the Caller the way an integration does ----------------


class StdlibExchange:
    """One GET through ``http.client``: the smallest possible integration."""

    def __init__(self, p: ClientPolicy, url: str, timeout: float | None = 5.0) -> None:
        self.policy = p
        self.parts = urlsplit(url)
        self.timeout = timeout

    def send(self, header: str, timeout: float | None) -> tuple[int, http.client.HTTPMessage]:
        conn = http.client.HTTPConnection(self.parts.hostname or "", self.parts.port, timeout=timeout)
        try:
            try:
                conn.connect()
            except OSError as e:
                raise ConnectionRefusedError(str(e)) from e
            path = self.parts.path + ("?" + self.parts.query if self.parts.query else "")
            conn.request("GET", path, headers={"askonce-question": header})
            resp = conn.getresponse()
            resp.read()
            return resp.status, resp.headers
        finally:
            conn.close()

    def judge(self, response: tuple[int, http.client.HTTPMessage]) -> Outcome:
        return judge_http(self.policy, response[0], response[1])

    def judge_error(self, error: Exception) -> Outcome | None:
        if isinstance(error, ConnectionRefusedError):
            return REFUSED_OUTCOME
        if isinstance(error, OSError | http.client.HTTPException):
            return LOST_OUTCOME
        return None

    def discard(self, response: object) -> None:
        pass


def call(p: ClientPolicy, url: str, **caller: Any) -> Any:
    return Caller(p, **caller).call(StdlibExchange(p, url), target="t")
