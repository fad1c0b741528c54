"""The question bound to the running code: one ``ContextVar`` holding a :data:`Frame`.

The binding follows threads started with ``contextvars.copy_context`` and asyncio tasks created
inside the request. ``FRAME`` is read and set directly by the shells' hot paths (the loop, the
server middleware); everything else reads it through :func:`current` and :func:`current_frame`.
"""

from __future__ import annotations

from contextvars import ContextVar

from askonce.core.question import Frame, Question

FRAME: ContextVar[Frame | None] = ContextVar("askonce.frame", default=None)


def current() -> Question | None:
    """A snapshot of the question bound to the running code, or ``None``."""
    frame = FRAME.get()
    return None if frame is None else frame[0].snapshot(frame[1])


def current_frame() -> Frame | None:
    """The bound frame (the question's account and the path to this layer), or ``None``."""
    return FRAME.get()
