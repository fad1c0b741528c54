"""The naive stack's retries: the plain loop every layer writes (or gets from tenacity), no askonce.

Each layer tries up to ``attempts`` times, sleeping a full-jitter exponential backoff between tries
(tenacity's ``wait_random_exponential``), and retries connection errors, timeouts and 502/503/504.
It knows nothing of its callers: it keeps trying after they have given up, and it answers its own
caller with the last status (a timeout becomes 504, a connection error 502), which the caller
retries in turn.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

RETRY_STATUSES = frozenset({502, 503, 504})
TIMED_OUT = 504
UNREACHABLE = 502


def backoff(retry: int, base: float, cap: float, rng: random.Random) -> float:
    """Seconds before retry number ``retry`` (1 for the first): uniform in
    [0, min(cap, base * 2^(retry-1)))."""
    return rng.uniform(0.0, min(cap, base * 2 ** (retry - 1)))


async def get_async(client: Any, url: str, headers: dict[str, str], *, attempts: int,
                    timeout: float, base: float, cap: float, rng: random.Random,
                    deadline: float | None = None) -> int:
    """GET ``url`` with an ``httpx.AsyncClient`` the naive way; the final status.

    ``deadline``: a ``loop.time()`` after which no attempt starts and none runs (tenacity's
    ``stop_after_delay`` with per-attempt timeouts cut to fit).
    """
    import httpx

    loop = asyncio.get_running_loop()
    status = UNREACHABLE
    for attempt in range(1, attempts + 1):
        limit = timeout if deadline is None else min(timeout, deadline - loop.time())
        if limit <= 0:
            return TIMED_OUT
        try:
            status = (await client.get(url, headers=headers, timeout=limit)).status_code
        except httpx.TimeoutException:
            status = TIMED_OUT
        except httpx.TransportError:
            status = UNREACHABLE
        if status not in RETRY_STATUSES or attempt == attempts:
            return status
        wait = backoff(attempt, base, cap, rng)
        if deadline is not None and loop.time() + wait >= deadline:
            return status
        await asyncio.sleep(wait)
    return status


def get_sync(session: Any, url: str, headers: dict[str, str], *, attempts: int, timeout: float,
             base: float, cap: float, rng: random.Random) -> int:
    """GET ``url`` with a ``requests.Session`` the naive way; the final status."""
    import requests

    status = UNREACHABLE
    for attempt in range(1, attempts + 1):
        try:
            response = session.get(url, headers=headers, timeout=timeout)
            status = response.status_code
            response.close()
        except requests.Timeout:
            status = TIMED_OUT
        except requests.RequestException:
            status = UNREACHABLE
        if status not in RETRY_STATUSES or attempt == attempts:
            return status
        time.sleep(backoff(attempt, base, cap, rng))
    return status
