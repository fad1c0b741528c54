"""What a client policy decides about HTTP: Retry-After, how a response is judged, where the reply is
read from, and which requests may be repeated."""

from __future__ import annotations

from email.utils import formatdate
from typing import Any

import pytest

import askonce
from askonce import Reply
from askonce.client import ClientPolicy, is_idempotent, judge_http, parse_retry_after


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("5", 5.0),
        (" 0 ", 0.0),
        (b"12", 12.0),
        ("90000", 86_400.0),  # bounded to a day
        ("9" * 40, 86_400.0),
        (formatdate(1_000_010.0, usegmt=True), 10.0),  # an HTTP-date ten seconds after `wall`
        (formatdate(999_000.0, usegmt=True), 0.0),  # in the past: no wait
        ("soon", None),
        ("-1", None),
        ("1.5", None),
        ("", None),
        ("\u0661", None),  # a non-ASCII digit
        ("x" * 100, None),
        (None, None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date_bounded(value: str | bytes | None, expected: float | None) -> None:
    assert parse_retry_after(value, wall=1_000_000.0) == expected


def test_a_malformed_retry_after_is_counted() -> None:
    before = askonce.stats().get("malformed.retry-after", 0)
    assert parse_retry_after("tomorrow-ish") is None
    assert askonce.stats()["malformed.retry-after"] == before + 1


@pytest.mark.parametrize(
    ("status", "headers", "failure", "retryable", "health"),
    [
        (200, {}, False, None, True),
        (404, {}, False, None, None),  # an answer; says nothing about the target's health
        (500, {}, True, False, False),
        (502, {}, True, True, False),
        (503, {}, True, True, False),
        (504, {}, True, True, False),
        (429, {}, True, False, False),  # throttled with no word on when to come back: not retried
        (429, {"retry-after": "2"}, True, True, False),
    ],
)
def test_judging_http_responses(status: int, headers: dict[str, str], failure: bool, retryable: bool | None,
                                health: bool | None) -> None:
    outcome = judge_http(ClientPolicy(), status, headers)
    assert (outcome.failure is not None) is failure and outcome.health is health
    if outcome.failure is not None:
        assert outcome.failure.retryable is retryable and outcome.failure.delivery == "answered"
        assert outcome.failure.retry_after == (2.0 if headers else None)


def test_the_reply_is_read_from_any_response() -> None:
    outcome = judge_http(ClientPolicy(), 503, {"askonce-reply": "v=1, b=0, dnr, r=overloaded, pb=250"})
    assert outcome.reply == Reply(0, True, "overloaded", 0.25)
    assert outcome.failure is not None and outcome.failure.reply == outcome.reply


@pytest.mark.parametrize(
    ("method", "headers", "kw", "expected"),
    [
        ("GET", {}, {}, True),
        ("put", {}, {}, True),
        ("POST", {}, {}, False),
        ("PATCH", {}, {}, False),
        ("POST", {"Idempotency-Key": "abc"}, {}, True),
        ("POST", {"Idempotency-Key": "abc"}, {"idempotency_header": None}, False),
        ("POST", {}, {"retry_non_idempotent": True}, True),
        ("GET", {}, {"idempotent_methods": frozenset({"head"})}, False),
    ],
)
def test_what_may_be_repeated(method: str, headers: dict[str, str], kw: dict[str, Any], expected: bool) -> None:
    assert is_idempotent(ClientPolicy(**kw), method, headers) is expected
