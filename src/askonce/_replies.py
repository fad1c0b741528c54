"""Passing give-ups upward: where the give-ups of the calls made inside a request are recorded.

Every give-up of an outgoing call (:mod:`askonce.client`) is noted here, so that a server
middleware, which wraps each request in :func:`replies`, can read :func:`last_reply` before
answering and pass a downstream do-not-retry on even when the handler turned the downstream error
into a response of its own. Re-exported from :mod:`askonce.client`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar, Token

from askonce.core.wire import Reply

__all__ = ["Record", "last_reply", "record_replies", "recording", "replies", "stop_recording"]


class Record:
    """Where the give-ups of calls made inside one :func:`replies` block are written: the latest
    one.

    One per block, bound in a context variable: threads and tasks started inside copy the binding,
    so their give-ups land here too. A server integration may record into an object of its own (a
    subclass).
    """

    __slots__ = ("last",)

    def __init__(self, last: Reply | None = None) -> None:
        self.last = last  # the reply of the latest give-up


RECORD: ContextVar[Record | None] = ContextVar("askonce.client.record", default=None)


@contextmanager
def replies() -> Iterator[None]:
    """Record give-ups of calls made in the block, including from threads and tasks started inside
    it.

    A server middleware wraps each request in this and reads :func:`last_reply` before answering.
    """
    token = record_replies()
    try:
        yield
    finally:
        stop_recording(token)


def record_replies(record: Record | None = None) -> Token[Record | None]:
    """Start recording give-ups in the current context, as entering :func:`replies` does, without a
    block.

    For a server that cannot wrap a request in ``with``: hand the token to :func:`stop_recording`
    when the request is done, or drop it when the context is the request's own and is thrown away
    with it. ``record``: where to record (a fresh :class:`Record` if not given).
    """
    return RECORD.set(Record() if record is None else record)


def stop_recording(token: Token[Record | None]) -> None:
    """End what :func:`record_replies` started: the record in place before it is back."""
    RECORD.reset(token)


def recording() -> Record | None:
    """The record give-ups are written to now: the innermost :func:`replies` block's, or
    ``None``."""
    return RECORD.get()


def last_reply() -> Reply | None:
    """The reply of the latest outgoing call that gave up, as recorded in the innermost
    :func:`replies`.

    Outside any ``replies()`` block: the latest give-up made in this very context (thread or task).
    """
    record = RECORD.get()
    return None if record is None else record.last


def note(reply: Reply) -> None:
    """Record a give-up's reply for ``last_reply()`` in the running context."""
    record = RECORD.get()
    if record is None:
        RECORD.set(Record(reply))
    else:
        record.last = reply


def attach(response: object, reply: Reply) -> None:
    """Hang a give-up's reply on the response it came with (a type with ``__slots__``: skipped;
    ``last_reply()`` still has it)."""
    with suppress(AttributeError, TypeError):
        response.askonce_reply = reply  # type: ignore[attr-defined]
