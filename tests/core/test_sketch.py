"""The ledger's sketches on their own: HyperLogLog for distinct keys, Frequent for heavy hitters, and the
digest both hash with."""

from __future__ import annotations

import pytest

from askonce.core.ledger.sketch import Frequent, HyperLogLog, digest64, key_digest, key_digests

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


@pytest.mark.parametrize("principal", ["", "tenant", "tënant-\udc80"])
@pytest.mark.parametrize("key", ["k", "01JD5Q3W8M" + "0" * 26, "ключ-\ud800", "x" * 300])
def test_key_digest_and_key_digests_are_digest64(principal: str, key: str) -> None:
    assert key_digest(principal, key) == digest64(principal, key)
    assert list(key_digests([(principal, key), ("other", key)])) == [digest64(principal, key),
                                                                    digest64("other", key)]


def test_key_digest_past_the_principal_cache() -> None:
    pairs = [(f"tenant-{i}", f"key-{i}") for i in range(3_000)]  # more principals than it keeps
    assert list(key_digests(pairs)) == [digest64(p, k) for p, k in pairs]
    assert [key_digest(p, k) for p, k in pairs[::-1]] == [digest64(p, k) for p, k in pairs[::-1]]


def test_batch_adds_are_the_single_adds() -> None:
    items = [f"i{(i * 7919) % 1_000 if i % 3 else i}" for i in range(20_000)]
    one, each = Frequent[str](16), Frequent[str](16)
    for item in items:
        one.add(item)
    each.add_each(items)
    assert (each.counts, each.offset) == (one.counts, one.offset) and one.offset > 0
    single, batch = HyperLogLog(10), HyperLogLog(10)
    hashes = [digest64("", item) for item in items]
    for h in hashes:
        single.add_hash(h)
    batch.add_hashes(hashes)
    assert batch._registers == single._registers and not single.is_empty()
