"""Carrying the question: ``askonce.question`` binds it, ``current`` reads it, ``inject`` / ``outgoing`` write
it on a call and ``extract`` / ``serve`` read it on arrival; malformed headers are counted, never raised."""

from __future__ import annotations

import pytest

import askonce
from askonce import _context, propagation
from askonce.core.question import Account, Tab


def _minter() -> str:
    raise RuntimeError("no key today")


@pytest.mark.parametrize("bad", [{"budget": -1}, {"deadline": 0}, {"origin": "no spaces"}])
def test_bad_question_arguments(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        askonce.question(**bad)  # type: ignore[arg-type]


def test_current_is_none_outside_and_bound_inside() -> None:
    assert askonce.current() is None
    with askonce.question(budget=1, deadline=None, origin="web") as q:
        assert askonce.current() == q
        assert q.edge and q.origin == "web" and q.budget == 1
    assert askonce.current() is None


def test_inject_extract_round_trip_and_serve_replies() -> None:
    headers: dict[str, str] = {}
    assert not askonce.propagation.inject(headers)
    with askonce.question(budget=2, deadline=10.0) as q:
        assert askonce.propagation.inject(headers, timeout=1.0)
    got = askonce.propagation.extract(headers)
    assert got is not None and got.key == q.key and got.budget == 2
    assert got.deadline is not None


def test_malformed_headers_are_counted_not_raised() -> None:
    before = askonce.stats().get("malformed.question.version", 0)
    assert askonce.propagation.extract({"askonce-question": "v=9, b=1"}) is None
    assert askonce.stats()["malformed.question.version"] == before + 1


@pytest.mark.parametrize("bad", ["timeout", "minter"])
def test_outgoing_gives_back_what_it_held_when_the_header_cannot_be_built(bad: str) -> None:
    account = Account(3)
    tab = Tab(None, "api", False, account, None, minter=_minter) if bad == "minter" else Tab(
        "k" * 26, "api", False, account, None)
    token = _context.FRAME.set((tab, ()))
    try:
        with pytest.raises((RuntimeError, TypeError)):
            propagation.outgoing({}, timeout="5" if bad == "timeout" else None)  # type: ignore[arg-type]
    finally:
        _context.FRAME.reset(token)
    assert account.left == 3
