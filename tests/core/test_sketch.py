"""The ledger's sketches on their own: HyperLogLog for distinct keys, Frequent for heavy hitters, and the
digest both hash with."""

from __future__ import annotations

import pytest

from askonce.core.ledger.sketch import Frequent, HyperLogLog, digest64

DIGEST_TENANT_KEY = 0x456D5445B36A7D0D  # blake2b, 8 bytes, person "askonce"


@pytest.mark.parametrize("n", [1_000, 20_000])
def test_hyperloglog_alone(n: int) -> None:
    hll = HyperLogLog(14)
    assert hll.is_empty() and hll.estimate() == 0.0
    for i in range(n):
        hll.add_hash(digest64("", f"x{i}"))
        hll.add_hash(digest64("", f"x{i}"))  # repeats do not count
    assert abs(hll.estimate() - n) / n < 0.03


def test_digest_is_the_same_in_every_process() -> None:
    # A fixed value: the builtin hash of a str would change with PYTHONHASHSEED.
    assert digest64("tenant", "key") == DIGEST_TENANT_KEY
    assert digest64("ab", "c") != digest64("a", "bc")


def test_frequent_add_weighted_item_when_full() -> None:
    f: Frequent[str] = Frequent(2)
    f.add("a")
    f.add("b", 3)
    f.add("c", 5)
    assert (f.counts, f.offset) == ({"b": 2, "c": 4}, 1)


def test_frequent_merge_keeps_heavy_items_and_lower_bounds() -> None:
    a: Frequent[str] = Frequent(4)
    b: Frequent[str] = Frequent(4)
    for i in range(200):
        a.add(f"a{i}")
        b.add(f"b{i}")
        a.add("hot")
        b.add("hot")
    a.merge(b)
    assert len(a.counts) <= 4
    assert 0 < a.counts["hot"] <= 400
    assert a.counts["hot"] >= 400 - a.offset
