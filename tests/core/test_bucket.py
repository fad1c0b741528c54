"""The retry token bucket: retries earn a ratio of requests plus a refilling floor, capped; a
misconfiguration is refused at construction."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from askonce.core.bucket import BucketPolicy, TokenBucket


def test_bucket_allows_ratio_of_requests_plus_floor() -> None:
    bucket = TokenBucket(BucketPolicy(ratio=0.1, floor=1.0, max_tokens=100), now=0.0)
    bucket.deposit(100)
    granted = sum(bucket.withdraw(0.0) for _ in range(50))
    assert granted == 11  # 100 * 0.1 earned + 1 floor token
    assert not bucket.withdraw(0.5)  # half a floor token has refilled: not enough
    assert bucket.withdraw(1.0)


def test_bucket_earned_tokens_are_capped() -> None:
    bucket = TokenBucket(BucketPolicy(ratio=1.0, floor=0.0, max_tokens=5), now=0.0)
    bucket.deposit(1000)
    assert sum(bucket.withdraw(0.0) for _ in range(100)) == 5


REFUSED: list[Any] = [
    pytest.param(lambda: BucketPolicy(ratio="0.2"), id="bucket ratio str (TypeError)"),
    pytest.param(lambda: BucketPolicy(ratio=True), id="bucket ratio bool"),
    pytest.param(lambda: BucketPolicy(floor=None), id="bucket floor None (TypeError)"),
    pytest.param(lambda: BucketPolicy(max_tokens=False), id="bucket max_tokens bool"),
    pytest.param(lambda: BucketPolicy(max_tokens=math.nan), id="bucket max_tokens nan"),
    pytest.param(lambda: BucketPolicy(floor=math.inf), id="bucket floor inf"),
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_an_empty_bucket_policy_stays_accepted() -> None:
    BucketPolicy(ratio=0, floor=0, max_tokens=0)
