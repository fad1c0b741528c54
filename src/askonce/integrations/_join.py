"""What the ASGI and WSGI join middlewares share: the run a waiter joins, and its account.

A waiter's own header carries what its caller still holds for the question (``b``), which is what
the run was forwarded (``Run.budget``) less the re-attaches that caller has paid since. What is
left for the question is then the run's own left less those re-attaches: the waiter's account is
lowered to it, and its ``askonce-reply`` says so.
"""

from __future__ import annotations

import hashlib

from askonce._replies import recording
from askonce.core.question import Tab
from askonce.integrations._server import Arrival

JOINED_HEADER = b"askonce-joined"
MAX_REARRIVALS = 3  # a waiter whose run was abandoned arrives again, at most this often
MAX_WAIT = 300.0  # seconds a waiter waits for a question without a deadline
CONFLICT_BODY = b"this question's key came with another request"


class Run:
    """The shell's slot on a join entry: how its waiters are woken, and the run's account."""

    __slots__ = ("budget", "owner", "tab", "wake")

    def __init__(self, owner: object, wake: object, tab: Tab) -> None:
        self.owner = owner  # the event loop (ASGI) the wake event belongs to, or None
        self.wake = wake
        self.tab = tab
        self.budget = tab.account.left  # what the run was forwarded


def joined(waiter: Tab, run: object) -> None:
    """Lower a waiter's account to what the run it joined left for the question."""
    if isinstance(run, Run):
        waiter.account.lower_to(run.tab.account.left - (run.budget - waiter.account.left))


def announce() -> None:
    """Say in this request's ``askonce-reply`` that this layer joins (member ``j``)."""
    arrival = recording()
    if isinstance(arrival, Arrival):
        arrival.joins = True


def detach() -> None:
    """This request runs a question others may join: its caller going away does not cancel it
    (``AskonceASGIMiddleware``'s disconnect watch); its deadline still does."""
    arrival = recording()
    if isinstance(arrival, Arrival):
        arrival.detached = True


def digest(query: bytes, body: bytes) -> bytes:
    """What tells two requests under one key apart (the IETF Idempotency-Key draft's
    fingerprint)."""
    return hashlib.blake2b(query + b"\x00" + body, digest_size=16).digest()
