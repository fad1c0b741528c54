"""The process-wide counters of what could not be used, and the clock every shell reads.

``count`` records an event that must not pass silently (a malformed header, a fallback, a dropped
record); ``stats`` is what ``askonce.stats()`` returns. ``monotonic`` is read through this module at
each use, so that a test can swap the clock of every shell at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

monotonic: Callable[[], float] = time.monotonic

_lock = threading.Lock()
_counts: dict[str, int] = {}


def count(name: str, n: int = 1) -> None:
    """Count an event that must not pass silently (a malformed header, a fallback, a dropped
    record)."""
    with _lock:
        _counts[name] = _counts.get(name, 0) + n


def stats() -> dict[str, int]:
    """A copy of the process-wide counters, e.g. ``{"malformed.question.budget": 3}``."""
    with _lock:
        return dict(_counts)
