"""Question keys: minted keys sort by time, derived (fan-out) keys are deterministic and distinct."""

from __future__ import annotations

from askonce.core.question import derive_key, mint_key

KEY = mint_key(0, bytes(16))


def test_derived_keys_are_deterministic_and_distinct() -> None:
    assert derive_key(KEY, "a") == derive_key(KEY, "a")
    assert derive_key(KEY, "a") != derive_key(KEY, "b")
    assert derive_key(KEY, "a")[:10] == KEY[:10]


def test_minted_keys_sort_by_time_and_are_long_enough() -> None:
    a, b = mint_key(1000, b"\xff" * 16), mint_key(1001, bytes(16))
    assert a < b and len(a) == 36
