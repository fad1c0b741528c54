"""What the counters (``askonce.stats()``) did since a snapshot."""

from __future__ import annotations

import askonce


def delta(before: dict[str, int]) -> dict[str, int]:
    """The counters that moved since ``before`` was taken, by how much."""
    after = askonce.stats()
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
