"""httpx: transports that carry the question on every attempt and retry through the askonce core.

::

    client = httpx.Client(transport=AskonceTransport(policy=ClientPolicy(layer="web")))
    client.get("http://billing/charge")        # inside askonce.question(...) or a server middleware

The transport wraps another (``httpx.HTTPTransport()`` by default) and runs each request through
:class:`askonce.client.Caller`: it writes ``askonce-question`` with the budget it forwards, reads
``askonce-reply`` back, honours Retry-After, retries only what :class:`~askonce.client.ClientPolicy`
allows, and returns the last response when it gives up (``response.askonce_reply`` says why). Each
attempt's timeouts (``request.extensions["timeout"]``, set by the client) are capped by the policy's
``attempt_timeout`` and by the question's remaining time. A request whose body cannot be replayed (a
generator) is treated as non-idempotent: it is repeated only when the connection was refused.
With ``ClientPolicy(hedge=HedgePolicy())`` the async transport hedges slow calls (a copy of the
request, sent after a delay; the first answer wins, the other is cancelled); the sync one does not.

The per-target key of buckets and breakers is scheme, host and port unless ``target=`` says
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from askonce._stats import count
from askonce.client import (
    LOST_OUTCOME,
    REFUSED_OUTCOME,
    Caller,
    ClientPolicy,
    Outcome,
    is_idempotent,
    judge_reply,
    reply_from,
)
from askonce.client.asyncmode import NOT_POLLED, prefer
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.stores.base import AsyncStore, Store

__all__ = ["AskonceTransport", "AsyncAskonceTransport", "default_target"]

_DEFAULT_POLICY = ClientPolicy()
_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_TIMEOUT_KEYS = ("connect", "read", "write", "pool")
_NO_TIMEOUTS: dict[str, Any] = {}
# Not sent with a poll of a status location (``respond_async``): the body's, the question's, the
# preference's (the poll's own is written).

# Never reached the server: no connection, or no free connection in the pool.
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Sent (at least partly), no response: the server may have worked on it.
_LOST = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError,
         httpx.RemoteProtocolError)


def default_target(request: httpx.Request) -> str:
    """``scheme://host:port``: one bucket and breaker per origin."""
    url = request.url
    return f"{url.scheme}://{url.host}:{url.port or _PORTS.get(url.scheme, 0)}"


# httpx keeps headers as (raw key, lowercased key, value) triples; for a plain ``httpx.Headers``
# the two askonce headers are read and written there directly, as ``get_list`` and
# ``__setitem__`` would (without working out the headers' encoding first).
_QUESTION_KEY = QUESTION_HEADER.encode("ascii")
_REPLY_KEY = REPLY_HEADER.encode("ascii")


def _direct() -> bool:
    """Whether this httpx keeps its headers as this module expects (else: the public methods)."""
    probe = httpx.Headers([("X-A", "b")])
    items = getattr(probe, "_list", None)
    return (hasattr(probe, "_encoding") and type(items) is list
            and items == [(b"X-A", b"x-a", b"b")])


_DIRECT = _direct()
# Encodings in which ASCII reads and writes as ASCII (httpx's own choices and the usual settings).
_PLAIN = frozenset({None, "ascii", "utf-8", "utf8", "latin-1", "latin1", "iso-8859-1"})


def _set_question(headers: httpx.Headers, value: str) -> None:
    """``headers[QUESTION_HEADER] = value``: the first such header replaced, any other dropped."""
    if type(headers) is not httpx.Headers or not _DIRECT or headers._encoding not in _PLAIN:
        headers[QUESTION_HEADER] = value
        return
    items = headers._list
    item = (_QUESTION_KEY, _QUESTION_KEY, value.encode(headers._encoding or "utf-8"))
    found = -1
    for i, (_, key, _) in enumerate(items):
        if key == _QUESTION_KEY:
            if found < 0:
                found = i
            else:  # a repeated header (never sent by askonce itself): the general path
                headers[QUESTION_HEADER] = value
                return
    if found < 0:
        items.append(item)
    else:
        items[found] = item


def _replies(headers: httpx.Headers) -> list[str]:
    """``headers.get_list(REPLY_HEADER)``: the ``askonce-reply`` values, decoded."""
    if type(headers) is not httpx.Headers or not _DIRECT or headers._encoding not in _PLAIN:
        return headers.get_list(REPLY_HEADER)
    values = [v for _, key, v in headers._list if key == _REPLY_KEY]
    if not values:
        return []
    try:  # ASCII (any valid reply) reads the same in each encoding httpx may settle on
        return [v.decode("ascii") for v in values]
    except UnicodeDecodeError:
        return headers.get_list(REPLY_HEADER)


def _judge_error(error: Exception) -> Outcome | None:
    if isinstance(error, _REFUSED):
        return REFUSED_OUTCOME
    if isinstance(error, _LOST):
        return LOST_OUTCOME
    return None


class _Attempts:
    """What sync and async exchanges share.

    The request, its original timeouts, the header per attempt.
    """

    __slots__ = ("_capped", "_policy", "_timeouts", "_wrapped", "request", "timeout")

    def __init__(self, request: httpx.Request, policy: ClientPolicy, wrapped: Any) -> None:
        self.request = request
        self._policy = policy
        self._wrapped = wrapped  # the sync or async transport, per subclass
        given = request.extensions.get("timeout")
        # Only read, never written (it may be the shared _NO_TIMEOUTS).
        self._timeouts: dict[str, Any] = given if type(given) is dict else _NO_TIMEOUTS
        read = self._timeouts.get("read")
        self.timeout: float | None = float(read) if isinstance(read, int | float) else None
        for t in self._timeouts.values():
            # NaN: refused here, before the call holds any budget (the core cannot send it).
            if t != t:
                raise ValueError(f"timeouts must be seconds or None, got {self._timeouts!r}")
        self._capped = False

    def prepare(self, header: str, limit: float | None) -> httpx.Request:
        request = self.request
        _set_question(request.headers, header)
        if limit is not None:
            given = self._timeouts
            # The usual case, seconds of timeout in a question with longer to run: as it came.
            if not self._capped:
                for k in _TIMEOUT_KEYS:
                    t = given.get(k)
                    if t is None or t > limit:
                        break
                else:
                    return request
            request.extensions["timeout"] = {
                k: limit if given.get(k) is None else min(float(given[k]), limit)
                for k in _TIMEOUT_KEYS}
            self._capped = True
        return request

    def judge(self, response: httpx.Response) -> Outcome:
        headers = response.headers
        return judge_reply(self._policy, response.status_code, reply_from(_replies(headers)),
                           headers)

    def judge_error(self, error: Exception) -> Outcome | None:
        return _judge_error(error)

    # --- async mode (askonce.client.following) ---

    @property
    def url(self) -> str:
        return str(self.request.url)

    def ask_async(self) -> None:
        headers = self.request.headers
        headers["prefer"] = prefer(headers.get("prefer"))

    def parts(self, response: httpx.Response) -> tuple[int, Any]:
        return response.status_code, response.headers

    def reply_to(self, response: httpx.Response, value: str) -> None:
        response.headers[REPLY_HEADER] = value

    def polling(self, url: str, wait: str | None, timeout: float) -> httpx.Request:
        """A GET of the status location with the request's own headers (its principal's)."""
        headers = httpx.Headers([(k, v) for k, v in self.request.headers.multi_items()
                                 if k.lower() not in NOT_POLLED])
        if wait is not None:
            headers["prefer"] = wait
        return httpx.Request("GET", url, headers=headers,
                             extensions={"timeout": dict.fromkeys(_TIMEOUT_KEYS, timeout)})


class _Exchange(_Attempts):
    __slots__ = ()

    def send(self, header: str, timeout: float | None) -> httpx.Response:
        wrapped: httpx.BaseTransport = self._wrapped
        return wrapped.handle_request(self.prepare(header, timeout))

    def poll(self, url: str, wait: str | None, timeout: float) -> httpx.Response:
        wrapped: httpx.BaseTransport = self._wrapped
        return wrapped.handle_request(self.polling(url, wait, timeout))

    def discard(self, response: httpx.Response) -> None:
        # Reading a short body lets the connection go back to the pool; closing cuts a long one off.
        left = self._policy.max_discard
        try:
            for chunk in response.iter_raw():
                left -= len(chunk)
                if left < 0:
                    break
        except (httpx.HTTPError, OSError):
            count("client.discard-failed")
        finally:
            response.close()


class _AsyncExchange(_Attempts):
    __slots__ = ()

    def fork(self) -> _AsyncExchange | None:
        """An exchange of its own for a hedge (``ClientPolicy.hedge``): a copy of the request, as
        it came, since each attempt writes its own header and timeouts into the request it sends;
        ``None`` for a body that cannot be sent twice."""
        request = self.request
        if not isinstance(request.stream, httpx.ByteStream):
            return None
        copy = httpx.Request(request.method, request.url, headers=request.headers.copy(),
                             stream=request.stream, extensions=dict(request.extensions))
        fork = _AsyncExchange(copy, self._policy, self._wrapped)
        # The timeouts as they came (a capped copy is capped afresh for the hedge's limit).
        fork._timeouts, fork.timeout, fork._capped = self._timeouts, self.timeout, self._capped
        return fork

    async def send(self, header: str, timeout: float | None) -> httpx.Response:
        wrapped: httpx.AsyncBaseTransport = self._wrapped
        return await wrapped.handle_async_request(self.prepare(header, timeout))

    async def poll(self, url: str, wait: str | None, timeout: float) -> httpx.Response:
        wrapped: httpx.AsyncBaseTransport = self._wrapped
        return await wrapped.handle_async_request(self.polling(url, wait, timeout))

    async def discard(self, response: httpx.Response) -> None:
        left = self._policy.max_discard
        try:
            async for chunk in response.aiter_raw():
                left -= len(chunk)
                if left < 0:
                    break
        except (httpx.HTTPError, OSError):
            count("client.discard-failed")
        finally:
            await response.aclose()


def _check_target(target: object) -> None:
    if not callable(target):
        raise ValueError(f"target must be a function of the request, got {target!r}")


def _idempotent(request: httpx.Request, policy: ClientPolicy) -> bool:
    """``extensions={"askonce.idempotent": True}`` (or ``False``) overrides a request's method."""
    if not isinstance(request.stream, httpx.ByteStream):  # a generator body cannot be sent twice
        return False
    said = request.extensions.get("askonce.idempotent")
    return (said if isinstance(said, bool)
            else is_idempotent(policy, request.method, request.headers))


class AskonceTransport(httpx.BaseTransport):
    """A sync transport: ``httpx.Client(transport=AskonceTransport(policy=...))``.

    ``wrapped``: the transport that does the I/O (``httpx.HTTPTransport()`` by default; its own
    ``retries=`` only repeats failed connects, which never reach the server). ``target``: the
    per-target key of a request. ``store``, ``clock``, ``sleep``, ``random``: see
    :class:`askonce.client.Caller`.
    """

    def __init__(
        self,
        wrapped: httpx.BaseTransport | None = None,
        *,
        policy: ClientPolicy = _DEFAULT_POLICY,
        target: Callable[[httpx.Request], str] = default_target,
        store: Store | AsyncStore | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], object] | None = None,
        random: Callable[[], float] | None = None,
    ) -> None:
        if wrapped is not None and not isinstance(wrapped, httpx.BaseTransport):
            raise ValueError("wrapped must be an httpx.BaseTransport, "
                             f"got {type(wrapped).__name__}")
        _check_target(target)
        self.wrapped = wrapped if wrapped is not None else httpx.HTTPTransport()
        self.caller = Caller(policy, store=store, clock=clock, sleep=sleep, random=random)
        self._target = target

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        caller = self.caller
        policy = caller.policy
        return caller.call(_Exchange(request, policy, self.wrapped),
                           target=self._target(request) if caller.per_target else "",
                           idempotent=_idempotent(request, policy))

    def close(self) -> None:
        self.wrapped.close()


class AsyncAskonceTransport(httpx.AsyncBaseTransport):
    """The async transport: ``httpx.AsyncClient(transport=AsyncAskonceTransport(policy=...))``."""

    def __init__(
        self,
        wrapped: httpx.AsyncBaseTransport | None = None,
        *,
        policy: ClientPolicy = _DEFAULT_POLICY,
        target: Callable[[httpx.Request], str] = default_target,
        store: Store | AsyncStore | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], object] | None = None,
        random: Callable[[], float] | None = None,
    ) -> None:
        if wrapped is not None and not isinstance(wrapped, httpx.AsyncBaseTransport):
            raise ValueError("wrapped must be an httpx.AsyncBaseTransport, "
                             f"got {type(wrapped).__name__}")
        _check_target(target)
        self.wrapped = wrapped if wrapped is not None else httpx.AsyncHTTPTransport()
        self.caller = Caller(policy, store=store, clock=clock, sleep=sleep, random=random)
        self._target = target

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        caller = self.caller
        policy = caller.policy
        return await caller.acall(_AsyncExchange(request, policy, self.wrapped),
                                  target=self._target(request) if caller.per_target else "",
                                  idempotent=_idempotent(request, policy))

    async def aclose(self) -> None:
        await self.wrapped.aclose()
