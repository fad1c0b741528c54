"""Whether a failed call says something about the target's health: the one judge of it.

The breakers (``askonce.breakers``, ``@askonce.retry(breaker=...)``) ask :func:`is_failure` of every
exception a guarded call raised. A cancellation, the caller's own 4xx and a do-not-retry answer
about the question itself are no verdict: they say nothing about the target. The rule for replies
is :func:`askonce.core.verdict.health`, which the HTTP and gRPC clients and the simulator use too.
"""

from __future__ import annotations

from askonce.core import is_int
from askonce.core.verdict import health
from askonce.errors import reply_of


def _status(exc: BaseException) -> int | None:
    # httpx.HTTPStatusError and requests.HTTPError carry .response.status_code; others .status_code.
    for holder in (exc, getattr(exc, "response", None)):
        status = getattr(holder, "status_code", None)
        if is_int(status):
            return status
    return None


def is_failure(exc: BaseException) -> bool:
    """Does this exception count against the target's health? ``False``: no verdict, release."""
    if not isinstance(exc, Exception):  # cancelled, interrupted: says nothing about the target
        return False
    reply = reply_of(exc)
    if reply is not None and reply.dnr:
        return health(True, reply) is False
    status = _status(exc)
    if status is not None and 400 <= status < 500:
        return status in (408, 429)
    return True
