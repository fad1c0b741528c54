"""What the core ledger costs in memory per exactly tracked key (``core/test_ledger_core.py`` and
``bench/bench_ledger.py`` measure it)."""

from __future__ import annotations

import tracemalloc

from askonce.core.ledger import Ledger, LedgerPolicy

FIRST = (("edge", 1), ("gw", 1), ("api", 1))


def measure_bytes_per_key(n: int, *, with_keys: bool = True) -> float:
    """Bytes of traced memory per exactly tracked key, for ``n`` new attributable keys.

    With ``with_keys`` the 24-character key strings are made while tracing, as they are in a server
    where the ledger is what keeps them alive; without, only the ledger's own structures count.
    """
    ledger = Ledger(LedgerPolicy(max_exact_keys=n + 1))
    ledger.record(0.0, "op", key="warm-up", edge=True, path=FIRST)  # window, operation, path cache
    made = [] if with_keys else [f"{i:024d}" for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        if with_keys:
            for i in range(n):
                ledger.record(0.0, "op", key=f"{i:024d}", edge=True, path=FIRST)
        else:
            for key in made:
                ledger.record(0.0, "op", key=key, edge=True, path=FIRST)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / n
