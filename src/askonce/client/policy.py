"""How a client layer judges an attempt: its policy, an HTTP answer's outcome, Retry-After, replies.

The pure-ish half of :mod:`askonce.client` (no I/O; counting malformed values is its only side
effect): :class:`ClientPolicy`, :class:`Outcome` and :func:`judge_http` / :func:`judge_reply` (which
statuses fail and whether they may be retried), :func:`parse_retry_after`, :func:`read_reply` /
:func:`reply_from` (the ``askonce-reply`` of a response, through a bounded cache of parsed values)
and :func:`is_idempotent`. Everything here is re-exported by :mod:`askonce.client`, its public home.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from askonce import _stats, propagation
from askonce.core import is_int, is_real
from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy
from askonce.core.bucket import BucketPolicy
from askonce.core.hedge import HedgePolicy
from askonce.core.retry import ANSWERED, LOST, REFUSED, Failure, RetryPolicy
from askonce.core.verdict import health
from askonce.core.wire import REPLY_HEADER, Reply, valid_name

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
MAX_RETRY_AFTER = 86_400.0
DEFAULT_RETRY = RetryPolicy()
DEFAULT_ADMISSION = AdmissionPolicy()


@dataclass(frozen=True, slots=True)
class ClientPolicy:
    """How one client layer calls other processes.

    ``retry``: attempts, backoff, and the budget and deadline of questions this layer mints when
    nothing is bound (``originator=True`` mints attributable edge keys, otherwise local ones). A
    failed HTTP response is retried when its status is in ``retry_statuses``, or in
    ``throttle_statuses`` *and* it says when to come back (Retry-After): a throttled client that
    guesses its own wait only adds to the load. Methods in ``idempotent_methods``, or any request
    carrying ``idempotency_header``, may be retried after they may have reached the target; others
    only when the connection was refused, unless ``retry_non_idempotent``.
    ``bucket``/``breaker``: per-target retry token bucket and circuit breaker (both off by
    default; ``BucketPolicy()`` caps retries at 20 % of calls plus 10/s).
    ``admission``: per-target adaptive admission (``core.admission``; on by default, ``None``
    turns it off): once the target answers fewer than 5 % of attempts, attempts are shed in
    proportion to the shortfall (``CircuitOpen``, reason ``shed``). The breaker (off by default)
    is for a dependency that is either up or down; with one, every attempt goes through the loop.
    ``attempt_timeout`` caps each attempt's timeouts (the question's remaining time always does).
    ``max_discard``: bytes read from a failed attempt's body so its connection can be reused; past
    it the connection is closed instead.
    ``deadline_grace``: seconds (at most a tenth of the attempt's limit) by which the deadline sent
    with an attempt falls short of how long the client waits for it, so that an askonce callee's
    answer at that deadline, which says what it spent, still arrives; such an answer is then retried
    like a timeout (``core.retry.own_deadline``). 0 (the default): the callee gets the whole wait,
    its answer at that deadline is a do-not-retry, and an attempt that times out is lost and its
    forwarded budget forfeited (fail closed): timeouts are not retried.
    ``rejoin`` (on by default): toward a target whose replies say it joins (``askonce-reply`` member
    ``j``), an attempt is given the question's whole time left and waits for it (``attempt_timeout``
    is not applied: the callee answers by that deadline), and a try that still times out (the
    framework's own timeout) is retried as a re-attach to the work in flight there
    (``core.retry.RetryState.on_failure``), unsafe methods too; toward any other target a timed-out
    try stays lost.
    ``hedge`` (off by default): the async clients send an idempotent call's first try (or any
    call's, toward a target that joins) again if it has not answered after a delay (fixed, or the
    target's learned latency percentile), the first answer winning; the hedge costs one from the
    question's budget, forwards none, and is throttled to a few percent of calls
    (:class:`~askonce.core.hedge.HedgePolicy`; docs/integrations-clients.md, "Hedging").
    ``respond_async`` (off by default): each try asks ``Prefer: respond-async`` (RFC 7240) and is
    given the question's whole time left; a callee that answers ``202`` with ``Preference-Applied:
    respond-async`` and a ``Location`` on the same origin is long-polled there until its answer,
    which the caller gets as if the try had returned it (:mod:`askonce.client.asyncmode`). The
    polls are not tries: they spend no budget, and only the answer is judged.
    """

    layer: str = "client"
    retry: RetryPolicy = DEFAULT_RETRY
    retry_statuses: frozenset[int] = frozenset({502, 503, 504})
    throttle_statuses: frozenset[int] = frozenset({429})
    idempotent_methods: frozenset[str] = IDEMPOTENT_METHODS
    idempotency_header: str | None = "Idempotency-Key"
    retry_non_idempotent: bool = False
    originator: bool = False
    bucket: BucketPolicy | None = None
    breaker: BreakerPolicy | None = None
    admission: AdmissionPolicy | None = DEFAULT_ADMISSION
    attempt_timeout: float | None = None
    max_discard: int = 65_536
    deadline_grace: float = 0.0
    rejoin: bool = True
    hedge: HedgePolicy | None = None
    respond_async: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.layer, str) or not valid_name(self.layer):
            raise ValueError(
                f"layer must be a name like 'api' or 'billing-client', got {self.layer!r}")
        for name, kinds in (("retry", RetryPolicy), ("bucket", (BucketPolicy, type(None))),
                            ("breaker", (BreakerPolicy, type(None))),
                            ("admission", (AdmissionPolicy, type(None))),
                            ("hedge", (HedgePolicy, type(None)))):
            if not isinstance(getattr(self, name), kinds):
                raise ValueError(f"{name} must be {name.capitalize()}Policy(...) or None, "
                                 f"got {getattr(self, name)!r}")
        # "no" is truthy: a str would retry every POST.
        for name in ("retry_non_idempotent", "originator", "rejoin", "respond_async"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("retry_statuses", "throttle_statuses"):
            statuses = _collection(name, getattr(self, name))
            if not all(is_int(s) and 100 <= s <= 599 for s in statuses):  # http.HTTPStatus too
                raise ValueError(f"{name} must hold HTTP status codes (100..599), "
                                 f"got {getattr(self, name)!r}")
            object.__setattr__(self, name, statuses)
        methods = _collection("idempotent_methods", self.idempotent_methods)
        if not all(isinstance(m, str) and m.isascii() and m.isalpha() for m in methods):
            raise ValueError(
                f"idempotent_methods must be method names, got {self.idempotent_methods!r}")
        object.__setattr__(self, "idempotent_methods", frozenset(m.upper() for m in methods))
        header = self.idempotency_header
        if header is not None and not (isinstance(header, str) and header.isascii()
                                       and header.replace("-", "").isalnum()):
            raise ValueError(f"idempotency_header must be a header name or None, got {header!r}")
        t = self.attempt_timeout
        if t is not None and (not is_real(t) or not 0 < t <= MAX_RETRY_AFTER):
            raise ValueError(f"attempt_timeout must be within (0, 86400] s or None, got {t!r}")
        g = self.deadline_grace
        if not is_real(g) or not 0 <= g <= 10:
            raise ValueError(f"deadline_grace must be within 0..10 s, got {g!r}")
        if not is_int(self.max_discard) or not 0 <= self.max_discard <= 1 << 26:
            raise ValueError(
                f"max_discard must be an int within 0..64 MiB, got {self.max_discard!r}")


def _collection(name: str, value: Any) -> frozenset[Any]:
    """A set-like option as a frozenset; a str is refused (it is a collection of letters: "GET" is
    G, E, T)."""
    if isinstance(value, str | bytes):
        raise ValueError(f"{name} must be a collection (a set or a list), not a single "
                         f"{type(value).__name__}: {value!r}")
    try:
        return frozenset(value)
    except TypeError:  # not iterable (503 for {503}), or holding what cannot be hashed
        raise ValueError(f"{name} must be a collection (a set or a list), got {value!r}") from None


# --- what an attempt came to ----------------------------------------------------------------------


class Outcome(NamedTuple):
    """An attempt as the integration judged it. ``failure`` is ``None`` when the attempt is the
    answer.

    ``health`` is the breaker's verdict on the target: ``True`` healthy, ``False`` failing, ``None``
    no verdict (the client's own 4xx says nothing about the target).
    """

    failure: Failure | None
    reply: Reply | None = None
    health: bool | None = True


REFUSED_OUTCOME = Outcome(Failure(True, None, REFUSED), None, False)
"""The request provably never reached the target (refused, connect timeout): retry, nothing was
spent."""
LOST_OUTCOME = Outcome(Failure(True, None, LOST), None, False)
"""Sent, and no response (read timeout, reset): the target may have spent all it was forwarded."""


def parse_retry_after(value: str | bytes | None, wall: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After value (delay-seconds or an HTTP-date), within 0..86400.

    ``None`` if absent or malformed (counted as ``malformed.retry-after``); a date in the past is 0.
    ``wall``: the current Unix time (``time.time()`` if not given).
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    text = value.strip()
    if not text or len(text) > 64 or not text.isascii():
        _stats.count("malformed.retry-after")
        return None
    if text.isdigit():
        return min(float(text), MAX_RETRY_AFTER) if len(text) <= 12 else MAX_RETRY_AFTER
    try:
        when = email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        _stats.count("malformed.retry-after")
        return None
    seconds = when - (time.time() if wall is None else wall)
    return min(max(0.0, seconds), MAX_RETRY_AFTER) if math.isfinite(seconds) else None


def judge_http(policy: ClientPolicy, status: int, headers: Any,
               wall: float | None = None) -> Outcome:
    """An HTTP response as an attempt's outcome: statuses >= 500, the retry and throttle statuses
    fail.

    ``headers``: any mapping with ``get`` (httpx, requests, ``email.message``). Everything else is
    the answer, even a 404: the target answered, and retrying would not change it.
    """
    return judge_reply(policy, status, read_reply(headers), headers, wall)


def judge_reply(policy: ClientPolicy, status: int, reply: Reply | None, headers: Any,
                wall: float | None = None) -> Outcome:
    """:func:`judge_http` for a reply already read (``headers`` is read only for Retry-After)."""
    if (status < 500 and status not in policy.retry_statuses
            and status not in policy.throttle_statuses):
        if status < 400:
            return _ANSWERED_PLAIN if reply is None else Outcome(None, reply, True)
        return Outcome(None, reply, None)
    retry_after = parse_retry_after(headers.get("retry-after"), wall)
    retryable = status in policy.retry_statuses or (status in policy.throttle_statuses
                                                    and retry_after is not None)
    return Outcome(Failure(retryable, reply, ANSWERED, retry_after), reply, health(True, reply))


_ANSWERED_PLAIN = Outcome(None, None, True)

# Parsed replies by their raw value. A target answers the same few values (``v=1, b=2``) over and
# over, and a Reply is immutable, so each is parsed once. Bounded: values longer than 64 characters,
# and any value once 256 are kept, are parsed every time.
_REPLIES: dict[str | bytes, Reply] = {}
_MAX_CACHED_REPLIES = 256


class _Raw:
    """Raw ``askonce-reply`` values, as ``propagation.extract_reply`` reads them (two or more:
    malformed)."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[str | bytes]) -> None:
        self.values = values

    def get_all(self, name: str) -> Sequence[str | bytes]:
        return self.values


def reply_from(values: Sequence[str | bytes]) -> Reply | None:
    """The reply among a response's raw ``askonce-reply`` values; ``None`` if absent or malformed
    (counted).

    What ``propagation.extract_reply`` returns for a header mapping holding ``values``, read from a
    cache for the values seen before.
    """
    if len(values) == 1:
        return _cached(values[0], _Raw(values))
    return None if not values else propagation.extract_reply(_Raw(values))


def read_reply(headers: Any) -> Reply | None:
    """``propagation.extract_reply(headers)``, read from the cache of :func:`reply_from` when it can
    be."""
    raw = propagation.header_value(headers, REPLY_HEADER)
    if isinstance(raw, propagation.Duplicate):
        return propagation.extract_reply(headers)  # counts it
    return None if raw is None else _cached(raw, headers)


def _cached(raw: str | bytes, headers: Any) -> Reply | None:
    """The reply whose raw value is ``raw``: from the cache, else
    ``propagation.extract_reply(headers)``."""
    cached = _REPLIES.get(raw)
    if cached is not None:
        return cached
    reply = propagation.extract_reply(headers)
    if reply is not None and len(raw) <= 64 and len(_REPLIES) < _MAX_CACHED_REPLIES:
        _REPLIES[raw] = reply
    return reply


def is_idempotent(policy: ClientPolicy, method: str, headers: Any) -> bool:
    """May this request be repeated after it may have reached the target?"""
    if policy.retry_non_idempotent or method.upper() in policy.idempotent_methods:
        return True
    return (policy.idempotency_header is not None
            and headers.get(policy.idempotency_header) is not None)
