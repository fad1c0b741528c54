"""Signed callbacks of async mode: the server's delivery, and the receiver's side.

A caller that asks a joining callee ``Prefer: respond-async`` may add ``askonce-callback: <URL>``:
when the run ends, the callee POSTs the answer there (the wire is :mod:`askonce.core.callback`'s).
The callee contacts only URLs its ``callbacks=`` allows (prefixes, or a callable of the URL and
the principal); by default none (the header is ignored, counted ``server.join.callback.refused``).

Delivery: at most ``TRIES`` tries, ``DELAYS`` seconds apart, each within ``TRY_TIMEOUT``; a 2xx
ends it (``server.join.callback.sent``), a connection error, timeout, 408, 429 or 5xx is tried
again (each ``server.join.callback.failed``), any other status ends it (the receiver refused it),
and a delivery that never got through is ``server.join.callback.gave-up``. Redirects are not
followed. At most ``max_background`` deliveries at once per middleware (past it
``server.join.callback.dropped``); the status location answers beside the callback.

The receiver: :func:`verify_callback` checks one (pure, time is an argument);
:class:`CallbackReceiver` is an ASGI app that verifies each POST and hands the answer to whoever
awaits it (``await receiver.answer(key, timeout)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from askonce import _stats
from askonce.core.callback import (
    CALLBACK,
    NO_ANSWER,
    Callback,
    CallbackError,
    allowed,
    callback_url,
    check,
    prefix,
    sign,
)
from askonce.core.join import Answer
from askonce.core.signing import Secret, secret_keys

__all__ = ["DELAYS", "TRIES", "TRY_TIMEOUT", "Callback", "CallbackError", "CallbackReceiver",
           "Hooks", "verify_callback"]

TRIES = 3
DELAYS = (0.25, 1.0)  # seconds before the second and third tries
TRY_TIMEOUT = 5.0  # seconds for one try: connect, send, the status line back
_AGAIN = {408, 429}  # statuses below 500 worth another try

Allow = Sequence[str] | Callable[[str, str], bool]


class Hooks:
    """Which callback URLs a middleware contacts, and the secret it signs with."""

    __slots__ = ("_allow", "_prefixes", "secret")

    def __init__(self, allow: Allow, secret: Secret | Sequence[Secret]) -> None:
        if callable(allow):
            self._allow: Callable[[str, str], bool] | None = allow
            self._prefixes: tuple[str, ...] = ()
        elif isinstance(allow, tuple | list) and all(isinstance(p, str) for p in allow):
            self._allow, self._prefixes = None, tuple(prefix(p) for p in allow)
        else:
            raise ValueError(f"callbacks must be a tuple of URL prefixes or a callable(url, "
                             f"principal) -> bool, got {allow!r}")
        try:
            secret_keys(secret)
        except (TypeError, ValueError):
            raise ValueError("callback_secret must be a secret of at least 16 bytes (or a "
                             "sequence of them, the first signing)") from None
        self.secret = secret

    @staticmethod
    def build(allow: Allow | None, secret: Secret | Sequence[Secret] | None) -> Hooks | None:
        """The middleware's ``callbacks=``/``callback_secret=``; ``None``: callbacks refused."""
        if allow is None:
            return None
        if secret is None:
            raise ValueError("callbacks need a callback_secret to sign them with")
        return Hooks(allow, secret)

    def url(self, raw: str, principal: str) -> str | None:
        """The URL to POST the answer to, if ``raw`` is one this middleware allows."""
        url = callback_url(raw)
        if url is not None:
            if self._allow is None:
                ok = allowed(url, self._prefixes)
            else:
                try:
                    ok = self._allow(url, principal) is True
                except Exception:
                    ok = False
            if ok:
                return url
        _stats.count("server.join.callback.refused")
        return None


def asked(hooks: Hooks | None, values: Iterable[str], principal: str) -> str | None:
    """The callback URL a request's ``askonce-callback`` header lines ask for, if allowed: one
    line only; without ``hooks`` it is ignored (counted)."""
    lines = list(values)
    if not lines:
        return None
    if hooks is None or len(lines) != 1:
        _stats.count("server.join.callback.refused")
        return None
    return hooks.url(lines[0], principal)


def _request(hooks: Hooks, url: str, key: str, location: str, answer: Answer | None
             ) -> tuple[str, int, bool, bytes]:
    """Where to connect, and the POST's bytes."""
    status, body, content_type = NO_ANSWER, b"", ""
    if answer is not None:
        status, body = answer.status, answer.body
        for k, v in answer.headers:
            if k.lower() == b"content-type":
                text = v.decode("latin-1")
                content_type = text if text.isprintable() and text.isascii() else ""
    headers = sign(hooks.secret, key, location, status, content_type, int(time.time()), body)
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {target} HTTP/1.1", f"host: {parts.netloc}", "connection: close",
             f"content-length: {len(body)}", "user-agent: askonce-callback"]
    if content_type:
        lines.append(f"content-type: {content_type}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    host = parts.hostname or ""
    return host, parts.port or 80, parts.scheme == "https", head + body


def _status(line: bytes) -> int:
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise OSError("not an HTTP response")
    return int(parts[1])


def _settled(status: int | None, tries: int) -> bool:
    """Count one try's outcome; whether the delivery is over."""
    if status is not None and 200 <= status < 300:
        _stats.count("server.join.callback.sent")
        return True
    _stats.count("server.join.callback.failed")
    over = (status is not None and status < 500 and status not in _AGAIN) or tries >= TRIES
    if over:
        _stats.count("server.join.callback.gave-up")
    return over


async def adeliver(hooks: Hooks, url: str, key: str, location: str,
                   answer: Answer | None) -> None:
    """POST the answer to ``url`` (see the module docstring), on the running loop."""
    host, port, tls, data = _request(hooks, url, key, location, answer)
    for tries in range(1, TRIES + 1):
        status: int | None = None
        try:
            async with asyncio.timeout(TRY_TIMEOUT):  # (not wait_for: see stores.aredis)
                status = await _apost(host, port, tls, data)
        except (OSError, TimeoutError, ValueError):
            status = None
        if _settled(status, tries):
            return
        await asyncio.sleep(DELAYS[min(tries, len(DELAYS)) - 1])


def _tls() -> ssl.SSLContext:
    """One client context for every delivery: making one reads the CA store from disk."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = ssl.create_default_context()
    return _CONTEXT


_CONTEXT: ssl.SSLContext | None = None


async def _apost(host: str, port: int, tls: bool, data: bytes) -> int:
    context = _tls() if tls else None
    reader, writer = await asyncio.open_connection(host, port, ssl=context)
    try:
        writer.write(data)
        await writer.drain()
        return _status(await reader.readline())
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


def deliver(hooks: Hooks, url: str, key: str, location: str, answer: Answer | None) -> None:
    """:func:`adeliver` for a thread (the WSGI middleware's background threads)."""
    host, port, tls, data = _request(hooks, url, key, location, answer)
    for tries in range(1, TRIES + 1):
        status: int | None = None
        try:
            status = _post(host, port, tls, data)
        except (OSError, ValueError):
            status = None
        if _settled(status, tries):
            return
        time.sleep(DELAYS[min(tries, len(DELAYS)) - 1])


def _post(host: str, port: int, tls: bool, data: bytes) -> int:
    with socket.create_connection((host, port), timeout=TRY_TIMEOUT) as raw:
        sock = _tls().wrap_socket(raw, server_hostname=host) if tls else raw
        with sock, sock.makefile("rb") as f:
            sock.sendall(data)
            return _status(f.readline(65536))


# --- the receiver ---------------------------------------------------------------------------------


def verify_callback(headers: Mapping[str, str] | Iterable[tuple[bytes | str, bytes | str]],
                    body: bytes, secret: Secret | Sequence[Secret], now: float,
                    max_age: float = 300.0) -> Callback:
    """The answer a callback POST carries, if signed with ``secret`` (any of several) at most
    ``max_age`` seconds from ``now`` (seconds since the epoch); else :class:`CallbackError`
    (``reason``: ``missing``, ``malformed``, ``repeated``, ``signature``, ``stale``, ``future``).
    ``headers``: a mapping (any case) or the request's (name, value) pairs (ASGI's bytes)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    fields: dict[str, str] = {}
    for n, (k, v) in enumerate(pairs):
        if n >= 200:
            raise CallbackError("malformed", "callback refused: too many headers")
        name = (k.decode("latin-1") if isinstance(k, bytes) else str(k)).lower()
        value = v.decode("latin-1") if isinstance(v, bytes) else str(v)
        if name in fields and (name.startswith("askonce-callback") or name == "content-type"):
            raise CallbackError("repeated", f"callback refused: {name} came twice")
        fields[name] = value
    return check(fields, body, secret, now, max_age)


class _Slot:
    __slots__ = ("answer", "born", "waiters")

    def __init__(self, born: float) -> None:
        self.answer: Callback | None = None
        self.born = born
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Callback]]] = []


class CallbackReceiver:
    """An ASGI app that takes signed callbacks: ``POST`` (any path) verified by
    :func:`verify_callback` (204; 400 malformed, 401 a bad signature or age, 405, 413 a body over
    ``max_body``, 503 the table full), and ``await receiver.answer(key, timeout)`` returns its
    :class:`~askonce.core.callback.Callback` (``TimeoutError`` if none came in time).

    Bounded: at most ``max_pending`` keys awaited or answered-not-yet-taken; an answer nobody has
    asked for yet is kept ``keep`` seconds. A repeated callback for a key is acknowledged and
    ignored (the first answer stands). Counted: ``callback.received``, ``callback.duplicate``,
    ``callback.refused.<reason>``, ``callback.full``. Serves any event loop; ``answer`` may be
    awaited on another.
    """

    def __init__(self, secret: Secret | Sequence[Secret], *, max_age: float = 300.0,
                 max_pending: int = 10_000, max_body: int = 1 << 20, keep: float = 300.0
                 ) -> None:
        secret_keys(secret)  # a bad secret fails here, not at the first callback
        for name, value in (("max_age", max_age), ("keep", keep)):
            if not isinstance(value, int | float) or not 0 < value <= 86_400:
                raise ValueError(f"{name} must be seconds within (0, 86400], got {value!r}")
        for name, top, n in (("max_pending", 10_000_000, max_pending),
                             ("max_body", 1 << 30, max_body)):
            if not isinstance(n, int) or not 1 <= n <= top:
                raise ValueError(f"{name} must be an int within 1..{top}, got {n!r}")
        self.secret, self.max_age, self.keep = secret, float(max_age), float(keep)
        self.max_pending, self.max_body = max_pending, max_body
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._slots)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # served on its own: nothing to start or stop
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope.get("method") != "POST":
            await _answer(send, 405, b"askonce: callbacks are POSTed\n")
            return
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the sender went away
            size += len(message.get("body", b""))
            if size > self.max_body:
                _stats.count("callback.refused.too-large")
                await _answer(send, 413, b"askonce: callback body too large\n")
                return
            body.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                break
        try:
            got = verify_callback(scope.get("headers", ()), b"".join(body), self.secret,
                                  time.time(), self.max_age)
        except CallbackError as exc:
            _stats.count(f"callback.refused.{exc.reason}")
            await _answer(send, 400 if exc.reason in ("missing", "malformed", "repeated")
                          else 401, f"askonce: {exc}\n".encode())
            return
        if not self._resolve(got):
            _stats.count("callback.full")
            await _answer(send, 503, b"askonce: too many callbacks pending\n")
            return
        await _answer(send, 204, b"")

    def _slot(self, key: str, now: float) -> _Slot | None:
        """The slot of ``key``, made if need be (under the lock); ``None``: the table is full."""
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        while self._slots:  # answers nobody took within ``keep``
            old_key, old = next(iter(self._slots.items()))
            if old.waiters or now - old.born <= self.keep:
                break
            del self._slots[old_key]
        if len(self._slots) >= self.max_pending:  # full: past a waiter, too (bounded scan)
            for old_key in [k for k, old in self._slots.items()
                            if not old.waiters and now - old.born > self.keep]:
                del self._slots[old_key]
        if len(self._slots) >= self.max_pending:
            return None
        slot = self._slots[key] = _Slot(now)
        return slot

    def _resolve(self, got: Callback) -> bool:
        with self._lock:
            slot = self._slot(got.key, _stats.monotonic())
            if slot is None:
                return False
            if slot.answer is not None:
                _stats.count("callback.duplicate")
                return True
            _stats.count("callback.received")
            slot.answer, slot.born = got, _stats.monotonic()
            waiters, slot.waiters = slot.waiters, []
            if not waiters:
                return True  # kept for an answer() to come
            # Kept in the slot as well until a waiter has it: one whose timeout fires in the same
            # turn as this hand-over must not lose an answer the sender was told was received.
        for loop, future in waiters:
            loop.call_soon_threadsafe(_set, future, got)
        return True

    async def answer(self, key: str, timeout: float) -> Callback:
        """The callback for question ``key``, once it came (at once if it already had):
        ``TimeoutError`` after ``timeout`` seconds; ``LookupError`` if the table is full."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Callback] = loop.create_future()
        with self._lock:
            slot = self._slot(key, _stats.monotonic())
            if slot is None:
                _stats.count("callback.full")
                raise LookupError("too many callbacks pending: answer() refused")
            if slot.answer is not None:
                del self._slots[key]
                return slot.answer
            slot.waiters.append((loop, future))
        try:
            async with asyncio.timeout(timeout):
                got = await future
        except BaseException:
            with self._lock:
                if (loop, future) in slot.waiters:
                    slot.waiters.remove((loop, future))
                    if not slot.waiters and slot.answer is None \
                            and self._slots.get(key) is slot:
                        del self._slots[key]
            raise
        with self._lock:
            if self._slots.get(key) is slot and not slot.waiters:
                del self._slots[key]  # taken
        return got


def _set(future: asyncio.Future[Callback], got: Callback) -> None:
    if not future.done():
        future.set_result(got)


async def _answer(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


CALLBACK_HEADER = CALLBACK.encode("ascii")
