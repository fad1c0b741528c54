"""The backoff: delays grow to a cap, whatever the retry number; a misconfiguration is refused at
construction."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from askonce.core.backoff import Backoff


@pytest.mark.parametrize("bad", [{"base": -1}, {"base": 2.0, "cap": 1.0}, {"multiplier": 0.5}])
def test_backoff_validation(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**bad)  # type: ignore[arg-type]


def test_backoff_is_capped_even_for_huge_retry_numbers() -> None:
    assert Backoff(base=0.1, cap=3.0).delay(10_000, 0.999) <= 3.0


REFUSED: list[Any] = [
    pytest.param(lambda: Backoff(base="0.1"), id="backoff base str (TypeError)"),
    pytest.param(lambda: Backoff(cap=True), id="backoff cap bool"),
    pytest.param(lambda: Backoff(multiplier=None), id="backoff multiplier None (TypeError)"),
    pytest.param(lambda: Backoff(jitter="no"), id="backoff jitter str (truthy: jitter on)"),
    pytest.param(lambda: Backoff(jitter=0), id="backoff jitter int"),
    pytest.param(lambda: Backoff(base=math.nan), id="backoff base nan"),
    pytest.param(lambda: Backoff(cap=math.inf), id="backoff cap inf"),
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_the_smallest_backoff_stays_accepted() -> None:
    Backoff(base=0, cap=0, multiplier=1, jitter=False)
