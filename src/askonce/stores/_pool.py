"""Redis clients made from a URL, with a pool that waits for a free connection.

redis-py's pools hold at most 100 connections by default (redis-py 8) and refuse one more at once:
past 100 calls in flight (async tasks, threads, or waiters holding a blocking connection) the
store would fall back to local state though Redis is healthy. A blocking pool instead waits for a
connection, within ``timeout`` (the caller's own bound), and holds up to ``max_connections``.

redis-py's asyncio client can also lose a cancellation: it writes each command under
``asyncio.wait_for``, which on Python 3.11 returns the result of a write that finished as the task
was cancelled. ``kept_cancel`` awaits a command and raises the lost ``CancelledError`` itself, so a
cancelled caller (a client gone, a timeout above) stops instead of running on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

MAX_CONNECTIONS = 1024

__all__ = ["MAX_CONNECTIONS", "kept_cancel", "pooled"]

T = TypeVar("T")


def pooled(module: Any, url: str, *, timeout: float, max_connections: int = MAX_CONNECTIONS,
           **connection: Any) -> Any:
    """A ``module.Redis`` (``redis`` or ``redis.asyncio``) on a blocking pool for ``url``."""
    pool = module.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                  timeout=timeout, **connection)
    return module.Redis(connection_pool=pool)


async def kept_cancel(call: Awaitable[T]) -> T:
    """``await call``; if the task was cancelled meanwhile and ``call`` returned anyway, or failed
    with an error of its own instead (a swallowed cancellation, then a Redis error), raise
    ``CancelledError``: the caller was cancelled, and must not fall back and go on."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    try:
        result = await call
    except Exception as exc:
        if task is not None and task.cancelling() > before:
            raise asyncio.CancelledError from exc
        raise
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return result
