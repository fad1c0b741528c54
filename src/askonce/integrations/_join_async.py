"""Async mode at a joining ASGI callee (``Prefer: respond-async``, RFC 7240): the wire of it.

A question asked with ``Prefer: respond-async`` is answered ``202 Accepted`` with a ``Location``
(``status_path`` followed by the operation and key, base64url) and ``Preference-Applied:
respond-async``; the run goes on in the background and its answer is kept as any joined answer.
A GET of the location is looked up under the GET's own principal, so it never finds another's.
"""

from __future__ import annotations

import base64

from askonce import _stats
from askonce.core.join import Answer, Preference, parse_prefer
from askonce.core.wire import REPLY_HEADER, Reply, format_reply
from askonce.integrations.asgi import Scope, Send

# What a 202's reply says: this callee joins, and none of the budget comes back (the run spends it).
_SPENT = format_reply(Reply(0, joins=True)).encode("ascii")

__all__ = ["MAX_LONG_POLL", "STATUS_PATH", "accepted", "accepted_answer", "located", "location",
           "prefer", "status_answer"]

PREFER = b"prefer"
STATUS_PATH = "/.askonce/answers/"
MAX_LONG_POLL = 30.0  # seconds a status GET may hold (``Prefer: wait=N``)
UNKNOWN_BODY = b"askonce: no such question here (or its answer was not kept): ask it again\n"
_UNKNOWN = Answer(404, ((b"content-type", b"text/plain"),), UNKNOWN_BODY)
_DOWN = Answer(503, ((b"content-type", b"text/plain"), (b"retry-after", b"1")),
               b"askonce: the join store cannot be asked now: try again\n")


def prefer(scope: Scope) -> Preference:
    """What the request's ``Prefer`` header lines ask (``wait`` capped to ``MAX_LONG_POLL``)."""
    return parse_prefer([v.decode("latin-1") for k, v in scope.get("headers", ()) if k == PREFER],
                        MAX_LONG_POLL)


def location(status_path: str, key: tuple[str, str, str]) -> str:
    """Where a question's answer will be: the operation and key, not the principal (the GET's
    own principal is looked up, so another's finds nothing)."""
    token = base64.urlsafe_b64encode(f"{key[1]}\x00{key[2]}".encode()).rstrip(b"=")
    return status_path + token.decode("ascii")


def located(token: str) -> tuple[str, str] | None:
    """The (operation, key) a location's last segment names, or ``None``."""
    if not 0 < len(token) <= 4096:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    operation, sep, key = raw.partition("\x00")
    return (operation, key) if sep and key else None


def accepted_answer(where: str) -> Answer:
    """202: the answer will be at the status location ``where``. Its reply says no budget is
    left: the run in the background spends what was forwarded, so the caller must not take it
    back (fail closed, as for a call whose answer has not come)."""
    body = f"askonce: accepted; GET {where} for the answer\n".encode()
    return Answer(202, ((b"content-type", b"text/plain; charset=utf-8"),
                        (b"location", where.encode()), (b"preference-applied", b"respond-async"),
                        (b"retry-after", b"1"), (REPLY_HEADER.encode(), _SPENT)), body)


def status_answer(state: str, answer: Answer | None, where: str) -> tuple[Answer, bool]:
    """What a status GET answers for a question in ``state`` (``answer``: its kept answer,
    ``running``, ``down``: the store cannot be asked, anything else: unknown), and whether it
    is the run's answer (marked ``askonce-joined: replay``)."""
    if state == "answer" and answer is not None:
        return answer, True
    if state == "running":
        return accepted_answer(where), False
    if state == "down":
        return _DOWN, False
    # never asked, another principal's, expired, or it ended with no answer kept
    _stats.count("server.join.status.unknown")
    return _UNKNOWN, False


async def accepted(scope: Scope, send: Send, status_path: str, key: tuple[str, str, str]
                   ) -> None:
    """The 202 of :func:`accepted_answer`, sent."""
    answer = accepted_answer(str(scope.get("root_path", "")) + location(status_path, key))
    await send({"type": "http.response.start", "status": 202, "headers": list(answer.headers)})
    await send({"type": "http.response.body", "body": answer.body})
