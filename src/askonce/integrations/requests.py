"""requests: an ``HTTPAdapter`` carrying the question on every attempt, retrying through askonce.

::

    http = askonce.integrations.requests.session(ClientPolicy(layer="orders"))
    http.get("http://billing/charge", timeout=2)

:class:`AskonceAdapter` runs each request through :class:`askonce.client.Caller` (see
``askonce.integrations.httpx`` for what that means). It owns retrying: urllib3's ``max_retries`` is
fixed at ``Retry(0, read=False)`` (requests' own default), and a ``max_retries`` that would retry is
refused with ``ValueError``, so that two retry layers never multiply silently. The ``timeout``
requests passes is each attempt's timeout, capped by the policy's ``attempt_timeout`` and the
question's remaining time. A body that cannot be replayed (a file, a generator) is repeated only
when the connection was refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import ClosedPoolError, ConnectTimeoutError, MaxRetryError, ProxyError
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.util import Timeout
from urllib3.util.retry import Retry

from askonce._stats import count
from askonce.client import (
    LOST_OUTCOME,
    REFUSED_OUTCOME,
    Caller,
    ClientPolicy,
    Outcome,
    is_idempotent,
    judge_http,
)
from askonce.client.asyncmode import NOT_POLLED, prefer
from askonce.core import is_real
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.stores.base import AsyncStore, Store

__all__ = ["AskonceAdapter", "default_target", "session"]

_DEFAULT_POLICY = ClientPolicy()
_PORTS = {"http": 80, "https": 443}

# Not sent with a poll of a status location (``respond_async``): the body's, the question's, the
# preference's (the poll's own is written).

# And urllib3's Timeout, untyped in requests.
TimeoutArg = float | tuple[float | None, float | None] | None


def default_target(request: requests.PreparedRequest) -> str:
    """``scheme://host:port``: one bucket and breaker per origin."""
    url = urlsplit(request.url or "")
    try:
        port = url.port
    except ValueError:
        port = None
    return f"{url.scheme}://{url.hostname}:{port or _PORTS.get(url.scheme, 0)}"


def _no_retries(max_retries: object) -> Retry:
    if max_retries is None or max_retries is False or max_retries == 0:
        return Retry(0, read=False)
    if isinstance(max_retries, Retry) and max_retries.total in (0, False):
        return Retry(0, read=False)
    raise ValueError(
        "AskonceAdapter retries through askonce; urllib3 retries would multiply with it "
        f"(got max_retries={max_retries!r}). Set attempts on the ClientPolicy's RetryPolicy "
        "instead.")


def _number(value: object) -> float | None:
    return float(value) if is_real(value) else None


def _split(timeout: object) -> tuple[float | None, float | None]:
    """(connect, read) seconds of whatever requests accepts as a timeout.

    NaN is refused with ``ValueError`` here, before the call holds any budget.
    """
    if timeout is None:
        return None, None
    if isinstance(timeout, tuple):
        if len(timeout) != 2:  # as requests refuses it (it would not get to see it when capped)
            raise ValueError(f"Invalid timeout {timeout}. Pass a (connect, read) timeout tuple, "
                             "or a single float to set both timeouts to the same value.")
        connect, read = _number(timeout[0]), _number(timeout[1])
    elif isinstance(timeout, Timeout):
        connect, read = _number(timeout.connect_timeout), _number(timeout.read_timeout)
    else:
        connect = read = _number(timeout)
    if connect != connect or read != read:
        raise ValueError("timeout must be seconds, a (connect, read) tuple or None, "
                         f"got {timeout!r}")
    return connect, read


def _judge_error(error: Exception) -> Outcome | None:
    if isinstance(error, requests.ConnectTimeout):
        return REFUSED_OUTCOME
    if isinstance(error, requests.ReadTimeout):
        return LOST_OUTCOME
    if isinstance(error, requests.ConnectionError):
        cause = error.args[0] if error.args else None
        # With Retry(0, read=False) a failed connect arrives wrapped in MaxRetryError; errors while
        # sending or reading (reset, disconnect) arrive bare. Whatever cannot be told apart counts
        # as sent-and-lost.
        if (isinstance(cause, MaxRetryError)
                and isinstance(cause.reason, ConnectTimeoutError | ProxyError)):
            return REFUSED_OUTCOME
        if isinstance(cause, ClosedPoolError):
            return REFUSED_OUTCOME
        return LOST_OUTCOME
    return None


class _Exchange:
    __slots__ = ("_adapter", "_connect", "_kwargs", "_timeout", "request", "timeout")

    def __init__(self, adapter: AskonceAdapter, request: requests.PreparedRequest,
                 timeout: TimeoutArg, kwargs: dict[str, Any]) -> None:
        self._adapter = adapter
        self.request = request
        self._timeout = timeout
        self._connect, self.timeout = _split(timeout)
        self._kwargs = kwargs

    def send(self, header: str, timeout: float | None) -> requests.Response:
        self.request.headers[QUESTION_HEADER] = header
        given: TimeoutArg = self._timeout
        if timeout is not None:
            connect, read = self._connect, self.timeout
            given = (timeout if connect is None else min(connect, timeout),
                     timeout if read is None else min(read, timeout))
        return HTTPAdapter.send(self._adapter, self.request, timeout=given, **self._kwargs)

    def judge(self, response: requests.Response) -> Outcome:
        return judge_http(self._adapter.caller.policy, response.status_code, response.headers)

    def judge_error(self, error: Exception) -> Outcome | None:
        return _judge_error(error)

    # --- async mode (askonce.client.following) ---

    @property
    def url(self) -> str:
        return self.request.url or ""

    def ask_async(self) -> None:
        headers = self.request.headers
        given = headers.get("Prefer")
        headers["Prefer"] = prefer(given.decode("latin-1") if isinstance(given, bytes) else given)

    def parts(self, response: requests.Response) -> tuple[int, Any]:
        return response.status_code, response.headers

    def reply_to(self, response: requests.Response, value: str) -> None:
        response.headers[REPLY_HEADER] = value

    def poll(self, url: str, wait: str | None, timeout: float) -> requests.Response:
        """A GET of the status location with the request's own headers (its principal's); the
        answer is returned as the request's (``response.request``, ``response.url``)."""
        poll = requests.PreparedRequest()
        headers = {k: v for k, v in self.request.headers.items() if k.lower() not in NOT_POLLED}
        if wait is not None:
            headers["Prefer"] = wait
        poll.prepare(method="GET", url=url, headers=headers)
        response = HTTPAdapter.send(self._adapter, poll, timeout=timeout, **self._kwargs)
        response.request, response.url = self.request, self.url
        return response

    def discard(self, response: requests.Response) -> None:
        # Reading a short body to its end returns the connection to the pool; a long one is closed.
        left = self._adapter.caller.policy.max_discard
        try:
            for chunk in response.iter_content(16_384):
                left -= len(chunk)
                if left < 0:
                    break
        except (requests.RequestException, Urllib3Error, OSError):
            count("client.discard-failed")
        finally:
            response.close()


class AskonceAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` sending through askonce; mount it with ``session.mount(prefix, ...)``.

    ``target``: the per-target key (bucket, breaker) of a request. ``store``, ``clock``, ``sleep``,
    ``random``: see :class:`askonce.client.Caller`. Pool options are ``HTTPAdapter``'s.
    """

    def __init__(
        self,
        policy: ClientPolicy = _DEFAULT_POLICY,
        *,
        target: Callable[[requests.PreparedRequest], str] = default_target,
        store: Store | AsyncStore | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], object] | None = None,
        random: Callable[[], float] | None = None,
        pool_connections: int = 10,
        pool_maxsize: int = 10,
        max_retries: int | Retry | None = None,
        pool_block: bool = False,
    ) -> None:
        retries = _no_retries(max_retries)
        if not callable(target):
            raise ValueError(f"target must be a function of the request, got {target!r}")
        self.caller = Caller(policy, store=store, clock=clock, sleep=sleep, random=random)
        self._target = target
        super().__init__(pool_connections=pool_connections, pool_maxsize=pool_maxsize,
                         max_retries=retries, pool_block=pool_block)

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: TimeoutArg = None,
        verify: bool | str = True,
        cert: str | tuple[str, str] | None = None,
        proxies: dict[str, str] | None = None,
    ) -> requests.Response:
        policy = self.caller.policy
        body = request.body
        idempotent = (body is None or isinstance(body, bytes | str)) and is_idempotent(
            policy, request.method or "GET", request.headers)
        kwargs: dict[str, Any] = {"stream": stream, "verify": verify, "cert": cert,
                                  "proxies": proxies}
        caller = self.caller
        return caller.call(_Exchange(self, request, timeout, kwargs),
                           target=self._target(request) if caller.per_target else "",
                           idempotent=idempotent)


def session(policy: ClientPolicy = _DEFAULT_POLICY, **adapter: Any) -> requests.Session:
    """A ``requests.Session`` with an :class:`AskonceAdapter` for ``http://`` and ``https://``."""
    s = requests.Session()
    mounted = AskonceAdapter(policy, **adapter)
    s.mount("http://", mounted)
    s.mount("https://", mounted)
    return s
