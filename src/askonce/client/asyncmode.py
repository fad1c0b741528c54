"""Async mode at the caller (``Prefer: respond-async``, RFC 7240): what to do with each response.

A try of a layer with ``ClientPolicy(respond_async=True)`` asks ``Prefer: respond-async``. A
joining callee may answer ``202`` with ``Preference-Applied: respond-async`` and a ``Location``
(``askonce.integrations.asgi_join``); the try then long-polls that location with ``GET`` and
``Prefer: wait=N`` until the answer comes, and that answer is the try's. The decisions are made
here, once, for the sync and async shells (``askonce.client.following``) of every HTTP client:

* :func:`accepted`: is a response a 202 to follow (the preference applied, a location on the
  request's own origin: a callee never sends the caller to another host), or the try's answer?
* :func:`first_poll` / :func:`decide`: after each poll's response (or its transport error), poll
  again (when, how long to ask the callee to hold it, how long to wait for it), take it as the
  answer (with the ``askonce-reply`` the try reads), or give the try up as lost.

Pure: no I/O, no clock (the shell passes ``now``); counting what a hostile callee sends is its only
side effect. Bounded: one poll outstanding per try, at most ``MAX_POLLS`` of them, never past the
question's deadline (``NO_DEADLINE`` seconds without one), at most ``MAX_POLL_ERRORS`` transport
errors in a row.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple
from urllib.parse import urljoin, urlsplit

from askonce import _stats
from askonce.client.policy import read_reply
from askonce.core.wire import QUESTION_HEADER, Reply, format_reply

# A poll repeats the request's own headers (the same principal), but those of its body, its
# question (a poll is no arrival of it) and its preference.
NOT_POLLED = frozenset({"content-length", "content-type", "content-encoding", "transfer-encoding",
                        "expect", "prefer", QUESTION_HEADER})

__all__ = ["JOINED_HEADER", "MARGIN", "MAX_POLLS", "MAX_WAIT", "NOT_POLLED", "Done", "Follow",
           "Lost", "Poll", "accepted", "decide", "first_poll", "prefer", "settled_reply"]

RESPOND_ASYNC = "respond-async"
JOINED_HEADER = "askonce-joined"  # on a kept answer: "replay"; never on a 202 that says "running"
MARGIN = 0.2  # seconds a poll's wait falls short of how long the client waits for its answer
MAX_WAIT = 30  # seconds a poll asks the callee to hold it at most (the servers' own cap)
MIN_GAP = 0.1  # seconds between a poll answered at once and the next, at least
MAX_GAP = 1.0  # ... and at most (a callee's Retry-After is clamped into this)
MAX_POLL_ERRORS = 3  # a poll's transport errors in a row, each retried as a poll
MAX_POLLS = 1000
NO_DEADLINE = 300.0  # seconds a try follows its answer when the question has no deadline
MAX_LOCATION = 2048
_PORTS = {"http": 80, "https": 443}


def prefer(value: str | None) -> str:
    """The request's ``Prefer`` with ``respond-async`` added to what the caller set (kept)."""
    if not value or not value.strip():
        return RESPOND_ASYNC
    names = {item.strip().partition("=")[0].strip().lower() for item in value.split(",")}
    return value if RESPOND_ASYNC in names else f"{value}, {RESPOND_ASYNC}"


class Follow(NamedTuple):
    """A try that follows a 202 to its answer: where, what the 202 said, until when."""

    url: str  # the status location, absolute, on the request's origin
    reply: Reply | None  # the 202's askonce-reply: the run holds what was forwarded
    until: float  # polls stop here: the question's deadline (the shell's clock)
    cap: float | None  # the try's own timeout (the framework's, the policy's attempt_timeout)
    polls: int = 0
    errors: int = 0  # transport errors in a row


class Poll(NamedTuple):
    """Send one poll: ``GET follow.url`` after ``after`` seconds, with ``Prefer: <prefer>`` (none:
    ask for no hold) and every timeout at ``timeout``; decide its response with ``follow``."""

    follow: Follow
    after: float
    prefer: str | None
    timeout: float


class Done(NamedTuple):
    """The response is the try's answer; ``reply``: the ``askonce-reply`` it carries for the try
    (``None``: leave the header as it is)."""

    reply: str | None


class Lost(NamedTuple):
    """The try failed (fail closed: the callee's run may have done the work). ``gone``: the
    callee has no answer for it (404: never kept, expired, or its run ended without one), so
    nothing is left to re-attach to; otherwise (its deadline, the polls' errors) the try is lost
    as a timed-out one is."""

    why: str
    gone: bool


def _origin(url: str) -> tuple[str, str, int] | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _PORTS or not parts.hostname or "@" in parts.netloc:
        return None
    return scheme, parts.hostname.lower(), port or _PORTS[scheme]


def _location(request_url: str, value: object) -> str | None:
    """The absolute status location, if it is one to follow: printable ASCII, bounded, on the
    request's origin (scheme, host, port), no credentials. Counted when refused."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LOCATION or not value.isascii() \
            or not value.isprintable() or " " in value:
        _stats.count("client.async.bad-location")
        return None
    where = urljoin(request_url, value)
    here, there = _origin(request_url), _origin(where)
    if there is None:
        _stats.count("client.async.bad-location")
        return None
    if here != there:
        _stats.count("client.async.offsite")
        return None
    return where.partition("#")[0]


def _applied(headers: Any) -> bool:
    value = headers.get("preference-applied")
    return (isinstance(value, str) and len(value) <= 1024
            and RESPOND_ASYNC in (v.strip().lower() for v in value.split(",")))


def accepted(status: int, headers: Any, request_url: str, now: float, deadline: float | None,
             cap: float | None) -> Follow | None:
    """A try's response: a 202 to follow (the state to follow it with), or ``None``: the answer.

    ``headers``: any mapping with ``get``. Followed only when the callee says it applied the
    preference, has not replayed a kept 202 (``askonce-joined``), and gives a location to follow
    (:func:`_location`); any other 202 is the callee's answer, as it came.
    """
    if status != 202 or not _applied(headers) or headers.get(JOINED_HEADER) is not None:
        return None
    where = _location(request_url, headers.get("location"))
    if where is None:
        return None
    _stats.count("client.async.followed")
    until = deadline if deadline is not None else now + NO_DEADLINE
    return Follow(where, read_reply(headers), until, cap)


def first_poll(follow: Follow, now: float) -> Poll | Lost:
    """The first poll, at once."""
    return _poll(follow, now, 0.0)


def _poll(follow: Follow, now: float, after: float) -> Poll | Lost:
    """The next poll after ``after`` seconds: it asks the callee to hold it ``N`` whole seconds, N
    = min(the question's time left, the try's own timeout, ``MAX_WAIT``) less ``MARGIN``, and
    waits for it as long as that minimum. None past the deadline or ``MAX_POLLS``."""
    if follow.polls >= MAX_POLLS:
        _stats.count("client.async.too-many-polls")
        return Lost("polls", False)
    left = follow.until - now - after
    if left <= MARGIN / 4:
        _stats.count("client.async.deadline")
        return Lost("deadline", False)
    window = min(left, MAX_WAIT + MARGIN, math.inf if follow.cap is None else follow.cap)
    hold = int(window - MARGIN) if window > MARGIN else 0
    _stats.count("client.async.poll")
    return Poll(follow._replace(polls=follow.polls + 1), after,
                f"wait={hold}" if hold >= 1 else None, window)


def _gap(headers: Any) -> float:
    """Seconds between polls answered at once: the callee's Retry-After (delay-seconds),
    clamped into ``MIN_GAP..MAX_GAP``; ``MAX_GAP`` without one."""
    value = headers.get("retry-after")
    text = value.strip() if isinstance(value, str) else ""
    if text.isascii() and text.isdigit() and len(text) <= 12:  # str.isdigit() takes '²' too
        return min(max(float(text), MIN_GAP), MAX_GAP)
    if text:
        _stats.count("client.async.bad-retry-after")
    return MAX_GAP


def decide(follow: Follow, now: float, status: int | None, headers: Any,
           took: float) -> Poll | Done | Lost:
    """After a poll: its status and headers (``status`` ``None``: the poll's own transport error),
    ``took`` seconds after it was sent. Still running (202 saying so): poll again, at once if the
    callee held the poll, else after a gap. 404: the answer is gone. A 5xx or 429 that is not a
    kept answer (no ``askonce-joined``) is the status location's own failure: retried as a poll,
    like a transport error, with backoff. Anything else is the answer."""
    if status is None or (headers.get(JOINED_HEADER) is None and (status >= 500 or status == 429)):
        errors = follow.errors + 1
        _stats.count("client.async.poll-error")
        if errors > MAX_POLL_ERRORS:
            return Lost("unreachable", False)
        return _poll(follow._replace(errors=errors), now, min(MAX_GAP, MIN_GAP * 2 ** errors))
    if status == 404:
        _stats.count("client.async.gone")
        return Lost("gone", True)
    if status == 202 and headers.get(JOINED_HEADER) is None and _applied(headers):
        return _poll(follow._replace(errors=0), now, max(0.0, _gap(headers) - max(0.0, took)))
    reply = settled_reply(follow.reply, read_reply(headers))
    return Done(None if reply is None else format_reply(reply))


def settled_reply(accepted: Reply | None, answer: Reply | None) -> Reply | None:
    """The reply the try reads: the answer's, but never more budget back than the 202 said (the
    run held what was forwarded; a status location's own reply is about the poll, not the run),
    and joining if either says so."""
    if accepted is None or answer is None:
        return answer if accepted is None else accepted
    return Reply(min(accepted.budget, answer.budget), answer.dnr, answer.reason, answer.pushback,
                 accepted.joins or answer.joins)
