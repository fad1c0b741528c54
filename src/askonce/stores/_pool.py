"""Redis clients made from a URL, with a pool that waits for a free connection.

redis-py's pools hold at most 100 connections by default (redis-py 8) and refuse one more at once:
past 100 calls in flight (async tasks, threads, or waiters holding a blocking connection) the
store would fall back to local state though Redis is healthy. A blocking pool instead waits for a
connection, within ``timeout`` (the caller's own bound), and holds up to ``max_connections``.
"""

from __future__ import annotations

from typing import Any

MAX_CONNECTIONS = 1024

__all__ = ["MAX_CONNECTIONS", "pooled"]


def pooled(module: Any, url: str, *, timeout: float, max_connections: int = MAX_CONNECTIONS,
           **connection: Any) -> Any:
    """A ``module.Redis`` (``redis`` or ``redis.asyncio``) on a blocking pool for ``url``."""
    pool = module.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                  timeout=timeout, **connection)
    return module.Redis(connection_pool=pool)
