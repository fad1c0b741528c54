"""What a ledger is told to do (:class:`LedgerPolicy`) and its windows.

Kept apart from the counting (:mod:`askonce.core.ledger`) so that the counting state and the shells
can read the policy without importing the ledger itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from askonce.core import is_int, is_real

MIN_WINDOW = 0.001
MAX_WINDOW = 366 * 86_400.0
MAX_WINDOWS_KEPT = 100_000

def count_field(name: str, value: object, low: int) -> None:
    """Refuse (``ValueError``) a ledger option that is not an integer of at least ``low``."""
    if not is_int(value) or value < low:
        raise ValueError(f"ledger {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, slots=True)
class LedgerPolicy:
    window: float = 60.0  # seconds per window
    windows_kept: int = 5  # closed windows kept for reports
    max_exact_keys: int = 10_000  # per operation per window; beyond: approximate structures
    heavy_keys: int = 10  # heaviest keys reported
    max_operations: int = 256  # distinct operation names per window; beyond: folded into "~other"
    cap: int | None = None  # max arrivals per (principal, key) per operation per window; None: off
    max_paths_per_key: int = 8  # distinct paths remembered per key for undeclared-retry detection
    # Layer / origin / drop-reason names per counter; beyond: folded into "~other".
    max_names: int = 64

    def __post_init__(self) -> None:
        if not is_real(self.window):
            raise ValueError(f"ledger window must be a number of seconds, got {self.window!r}")
        # Far below a millisecond a time divided by the window leaves the float range; far beyond
        # a year a Redis TTL of windows_kept + 2 windows is no valid expiry. Either is a typo.
        if not MIN_WINDOW <= self.window <= MAX_WINDOW:
            raise ValueError(f"ledger window must be within {MIN_WINDOW}..{MAX_WINDOW:.0f} s, "
                             f"got {self.window!r}")
        count_field("windows_kept", self.windows_kept, 0)
        # A report reads every kept window (from Redis: one by one).
        if self.windows_kept > MAX_WINDOWS_KEPT:
            raise ValueError(f"ledger windows_kept must be at most {MAX_WINDOWS_KEPT}, "
                             f"got {self.windows_kept!r}")
        count_field("max_exact_keys", self.max_exact_keys, 0)
        count_field("heavy_keys", self.heavy_keys, 0)
        count_field("max_operations", self.max_operations, 1)
        if self.cap is not None:
            count_field("cap", self.cap, 1)
        count_field("max_paths_per_key", self.max_paths_per_key, 1)
        count_field("max_names", self.max_names, 1)


def window_index(now: float, window: float) -> int:
    """The index of the window holding ``now``; ``ValueError`` for a time that is not finite or so
    far from zero that ``now / window`` is not either."""
    index = now / window
    if not math.isfinite(index):
        raise ValueError("ledger time must be a finite number of seconds (within range of the "
                         f"window), got {now!r}")
    return math.floor(index)
