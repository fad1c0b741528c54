"""gRPC: interceptors that carry the question in metadata, sync and ``grpc.aio``, client and server.

::

    channel = grpc.intercept_channel(
        grpc.insecure_channel("billing:50051", options=channel_options()),
        AskonceClientInterceptor(ClientPolicy(layer="orders"), target="billing:50051",
                                 idempotent=True))
    server = grpc.server(pool, interceptors=[AskonceServerInterceptor(layer="billing")])

The question travels in the ``askonce-question`` metadata key, the reply in the ``askonce-reply``
*trailing* metadata key (sent with every status, errors included; the reply is known only when the
handler ends). Clients (unary-unary calls) run each call through :class:`askonce.client.Caller`;
what a status means is :func:`judge_status`'s. Servers (unary-unary and stream-unary handlers;
response streams pass through) bind the question, refuse late or capped arrivals with
``DEADLINE_EXCEEDED`` / ``RESOURCE_EXHAUSTED``, answer an escaping give-up with ``UNAVAILABLE``, and
mark every ``dnr`` reply with ``grpc-retry-pushback-ms: -1`` so that gRPC's own retry policy stops
too. :func:`channel_options` turns gRPC's own retries off. Binary keys (``askonce-question-bin``,
``askonce-reply-bin``) are never read, only counted (``malformed.question.binary``,
``malformed.reply.binary``). See ``docs/integrations.md`` for the tables.

This module is the client side; the server interceptors live in ``integrations._grpc_server`` and
are re-exported here, so ``from askonce.integrations.grpc import ...`` reaches both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import grpc
from grpc import aio

from askonce._stats import count
from askonce.client import Caller, ClientPolicy, Outcome, reply_from
from askonce.core.retry import ANSWERED, LOST, REFUSED, Failure
from askonce.core.verdict import health
from askonce.core.wire import MAX_BUDGET, QUESTION_HEADER, REPLY_HEADER, Reply
from askonce.integrations._grpc_server import (
    PUSHBACK,
    REPLY_BIN,
    AskonceServerInterceptor,
    AsyncAskonceServerInterceptor,
    Code,
    Metadata,
)
from askonce.stores.base import AsyncStore, Store

__all__ = [
    "RETRY_CODES", "AskonceClientInterceptor", "AskonceServerInterceptor",
    "AsyncAskonceClientInterceptor", "AsyncAskonceServerInterceptor", "channel_options",
    "judge_status",
]

RETRY_CODES: frozenset[grpc.StatusCode] = frozenset({Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED})
"""Retried by default; ``RESOURCE_EXHAUSTED`` only when the server says when to come back."""

# The callee answered, the fault is the caller's: no retry, and no verdict on the target's health.
_CALLERS_FAULT = frozenset({Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS,
                            Code.PERMISSION_DENIED, Code.UNAUTHENTICATED, Code.FAILED_PRECONDITION,
                            Code.OUT_OF_RANGE, Code.UNIMPLEMENTED})
# Statuses the client's own gRPC library makes when no answer came
# (timeouts, resets, lost connections).
_MAYBE_LOCAL = frozenset({Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.INTERNAL})
# UNAVAILABLE details that say the call never left: no connected address, or no address at all.
_NEVER_SENT = ("failed to connect to all addresses", "dns resolution failed", "errors resolving",
               "name resolution failure", "empty address list", "no addresses")
_DEFAULT_POLICY = ClientPolicy()


# --- what a status means --------------------------------------------------------------------------


def _pushback(trailing: Metadata | None) -> float | None:
    """``grpc-retry-pushback-ms`` in seconds.

    Negative (or not a number): the server said do not retry.
    """
    for key, value in trailing or ():
        if key == PUSHBACK:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            ok = text.isascii() and text.isdigit() and len(text) <= 9
            return int(text) / 1000 if ok else -1.0
    return None


def judge_status(code: grpc.StatusCode, details: str | None, trailing: Metadata | None,
                 retry_codes: Collection[grpc.StatusCode] = RETRY_CODES) -> Outcome:
    """A finished call's status, details and trailing metadata as an attempt's outcome.

    ``OK`` and the caller's own faults (``INVALID_ARGUMENT``, ``NOT_FOUND``, ...) are the answer.
    Any other status is a failure, retried if it is in ``retry_codes`` (and
    ``grpc-retry-pushback-ms`` does not say no). Without an ``askonce-reply``, a status gRPC may
    have made locally counts as sent and lost (fail closed), or as never sent when the details say
    that no connection could be made.
    """
    trailing = tuple(trailing or ())
    # Two replies: malformed.
    reply = reply_from([v for k, v in trailing if k == REPLY_HEADER])
    if any(k == REPLY_BIN for k, _ in trailing):
        count("malformed.reply.binary")  # the reply is ASCII metadata; a binary one is not read
    if code == Code.OK:
        return Outcome(None, reply, True)
    if code in _CALLERS_FAULT:
        return Outcome(None, reply, None)
    if reply is not None:
        delivery = ANSWERED
    elif code == Code.UNAVAILABLE and any(s in (details or "").lower() for s in _NEVER_SENT):
        delivery = REFUSED
    else:
        delivery = LOST if code in _MAYBE_LOCAL else ANSWERED
    wait = _pushback(trailing)
    if code == Code.RESOURCE_EXHAUSTED:  # overloaded: come back only when told when
        back = reply.pushback if reply is not None and not reply.dnr else None
        back = wait if back is None and wait is not None and wait >= 0 else back
        if back is None:
            # No reply: it spent nothing.
            said = reply if reply is not None and reply.dnr else Reply(
                MAX_BUDGET if reply is None else reply.budget, True, "overloaded")
            return Outcome(Failure(False, said, delivery), said, health(True, said))
        return Outcome(Failure(True, reply, delivery, back), reply, health(True, reply))
    retryable = code in retry_codes and (wait is None or wait >= 0)
    return Outcome(Failure(retryable, reply, delivery,
                           wait if wait is not None and wait > 0 else None), reply,
                   health(True, reply))


def _judge_error(error: Exception, codes: Collection[grpc.StatusCode]) -> Outcome | None:
    code = getattr(error, "code", None)
    if isinstance(error, grpc.RpcError) and callable(code):
        details, trailing = (getattr(error, "details", None),
                             getattr(error, "trailing_metadata", None))
        return judge_status(code(), details() if callable(details) else None,
                            trailing() if callable(trailing) else None, codes)
    return None


# --- the client side ------------------------------------------------------------------------------


def default_target(method: str) -> str:
    """The service of ``/pkg.Service/Method``: one bucket and breaker per service."""
    return "grpc:" + method.rsplit("/", 1)[0].lstrip("/")


class _Client:
    """Options and routing shared by the sync and aio client interceptors."""

    def __init__(
        self,
        policy: ClientPolicy = _DEFAULT_POLICY,
        *,
        target: str | Callable[[str], str] = default_target,
        idempotent: bool | Collection[str] | Callable[[str], bool] = False,
        retry_codes: Collection[grpc.StatusCode] = RETRY_CODES,
        store: Store | AsyncStore | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], object] | None = None,
        random: Callable[[], float] | None = None,
    ) -> None:
        if not (isinstance(target, str) or callable(target)):
            raise ValueError("target must be a string or a function of the method name, "
                             f"got {target!r}")
        if (isinstance(idempotent, str)
                or not (isinstance(idempotent, bool | Collection) or callable(idempotent))
                or (isinstance(idempotent, Collection)
                    and not all(isinstance(m, str) for m in idempotent))):
            raise ValueError("idempotent must be a bool, method names or a function, "
                             f"got {idempotent!r}")
        codes = frozenset(retry_codes)
        if not all(isinstance(c, grpc.StatusCode) and c != Code.OK for c in codes):
            raise ValueError("retry_codes must be grpc.StatusCode values other than OK, "
                             f"got {retry_codes!r}")
        self.caller = Caller(policy, store=store, clock=clock, sleep=sleep, random=random)
        self.target = target
        self.idempotent = (frozenset(idempotent) if isinstance(idempotent, Collection)
                           else idempotent)
        self.codes = codes

    def route(self, details: Any) -> tuple[str, bool]:
        """The call's per-target key, and whether it may be repeated after it was sent."""
        method = details.method
        method = method.decode("ascii", "replace") if isinstance(method, bytes) else str(method)
        target = self.target if isinstance(self.target, str) else self.target(method)
        said = self.idempotent
        safe = (said(method) if callable(said)
                else said if isinstance(said, bool) else method in said)
        policy = self.caller.policy
        if not safe and policy.idempotency_header is not None:
            key = policy.idempotency_header.lower()
            safe = any(k == key for k, _ in details.metadata or ())
        return target, bool(safe or policy.retry_non_idempotent)


def _metadata(details: Any, header: str) -> list[tuple[str, str | bytes]]:
    kept = [(k, v) for k, v in details.metadata or () if k != QUESTION_HEADER]
    kept.append((QUESTION_HEADER, header))
    return kept


class _Details(grpc.ClientCallDetails):
    """The call's details for one attempt: its own metadata and deadline."""

    def __init__(self, base: grpc.ClientCallDetails, timeout: float | None, metadata: Any) -> None:
        self.method = base.method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def _timeout(timeout: Any) -> float | None:
    # Refused before the call holds any budget: a NaN deadline would fail inside the call, with
    # the budget held.
    if timeout is not None and timeout != timeout:
        raise ValueError(f"timeout must be seconds or None, got {timeout!r}")
    return timeout  # type: ignore[no-any-return]


class _Exchange:
    __slots__ = ("_codes", "_continuation", "_details", "_request", "timeout")

    def __init__(self, continuation: Callable[[Any, Any], Any], details: Any, request: Any,
                 codes: frozenset[grpc.StatusCode]) -> None:
        self._continuation = continuation
        self._details = details
        self._request = request
        self._codes = codes
        self.timeout: float | None = _timeout(details.timeout)

    def judge_error(self, error: Exception) -> Outcome | None:
        return _judge_error(error, self._codes)


class _SyncExchange(_Exchange):
    __slots__ = ()

    def send(self, header: str, timeout: float | None) -> Any:
        return self._continuation(
            _Details(self._details, timeout, _metadata(self._details, header)), self._request)

    def judge(self, outcome: Any) -> Outcome:
        # For a call made with .future() this waits for it: the retry loop needs its status.
        return judge_status(outcome.code(), outcome.details(), outcome.trailing_metadata(),
                            self._codes)

    def discard(self, outcome: Any) -> bool:
        """A finished call holds no connection: nothing to release (it stays whole)."""
        return False


class AskonceClientInterceptor(_Client, grpc.UnaryUnaryClientInterceptor):
    """Sync unary-unary calls through askonce.

    ``grpc.intercept_channel(channel, AskonceClientInterceptor(...))``.

    ``target``: the per-target key of buckets and breakers (pass the channel's target; default: the
    service name). ``idempotent``: ``True``, the full method names (``"/pkg.Service/Get"``), or a
    function of the method name; a call carrying the policy's ``idempotency_header`` (lowercased) in
    its metadata is idempotent too. ``retry_codes``: statuses retried (:data:`RETRY_CODES`).
    ``store``, ``clock``, ``sleep``, ``random``: see :class:`askonce.client.Caller`. A failed call
    raises ``grpc.RpcError`` as usual, with ``askonce_reply`` attached; a give-up before any attempt
    raises ``askonce.GaveUp``.
    """

    def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        target, idempotent = self.route(client_call_details)
        return self.caller.call(
            _SyncExchange(continuation, client_call_details, request, self.codes),
            target=target, idempotent=idempotent)


class _Finished(NamedTuple):
    call: Any
    code: grpc.StatusCode
    details: str | None
    trailing: Any


class _AsyncExchange(_Exchange):
    __slots__ = ()

    async def send(self, header: str, timeout: float | None) -> _Finished:
        d = self._details
        attempt = aio.ClientCallDetails(d.method, timeout, aio.Metadata(*_metadata(d, header)),
                                        d.credentials, d.wait_for_ready)
        call = await self._continuation(attempt, self._request)
        return _Finished(call, await call.code(), await call.details(),
                         await call.trailing_metadata())

    def judge(self, finished: _Finished) -> Outcome:
        return judge_status(finished.code, finished.details, finished.trailing, self._codes)

    async def discard(self, finished: _Finished) -> bool:
        """A finished call holds no connection: nothing to release (it stays whole)."""
        return False


class AsyncAskonceClientInterceptor(_Client, aio.UnaryUnaryClientInterceptor):
    """The ``grpc.aio`` form of :class:`AskonceClientInterceptor`.

    ``aio.insecure_channel(target, interceptors=[AsyncAskonceClientInterceptor(...)])``.

    Options as :class:`AskonceClientInterceptor`. ``grpc.aio`` makes a new error object each time a
    call is awaited, so the reply of a give-up is read with :func:`askonce.client.last_reply`.
    """

    async def intercept_unary_unary(self, continuation: Any,
                                    client_call_details: aio.ClientCallDetails,
                                    request: Any) -> Any:
        target, idempotent = self.route(client_call_details)
        finished = await self.caller.acall(
            _AsyncExchange(continuation, client_call_details, request, self.codes),
            target=target, idempotent=idempotent)
        return finished.call


def channel_options(options: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """Channel ``options`` with gRPC's own retries off, for askonce's to run.

    Adds ``("grpc.enable_retries", 0)``. Raises ``ValueError`` if ``options`` turn retries on or
    carry a service config with a ``retryPolicy`` or ``hedgingPolicy``: two retry layers would
    multiply silently. (Retries off also ends gRPC's transparent retries of calls that never left;
    askonce retries those itself, as never sent.)
    """
    out: list[tuple[str, Any]] = []
    for name, value in options:
        if name == "grpc.enable_retries":
            if value not in (0, False):
                raise ValueError("grpc.enable_retries would stack gRPC's retries on askonce's; "
                                 "leave it out")
            continue
        if name == "grpc.service_config":
            try:
                config = json.loads(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"grpc.service_config is not JSON: {exc}") from exc
            methods = config.get("methodConfig", ()) if isinstance(config, dict) else ()
            if any(isinstance(m, dict) and ("retryPolicy" in m or "hedgingPolicy" in m)
                   for m in methods):
                raise ValueError("the service config's retryPolicy/hedgingPolicy would stack "
                                 "gRPC's retries on askonce's; remove it, or use gRPC's retries "
                                 "without the askonce interceptor")
        out.append((name, value))
    out.append(("grpc.enable_retries", 0))
    return out
