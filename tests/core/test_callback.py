"""The pure parts of signed callbacks: which URLs are allowed, the signature and its check."""

from __future__ import annotations

import pytest

from askonce.core.callback import (
    SIGNATURE,
    STATUS,
    TIMESTAMP,
    CallbackError,
    allowed,
    callback_url,
    check,
    prefix,
    sign,
)

SECRET = b"0123456789abcdef0123"
OLD = b"fedcba9876543210fedc"
KEY = "01JD5Q3W8M0S3V2T8QK6Y7C2BZ4E9R1N0HAF"
WHERE = "/.askonce/answers/UE9TVCAvcmVwb3J0cwBrZXk"


def _signed(secret: bytes = SECRET, stamp: int = 1_000, body: bytes = b"the answer",
            status: int = 201) -> dict[str, str]:
    headers = sign(secret, KEY, WHERE, status, "text/plain", stamp, body)
    return {**headers, "content-type": "text/plain"}


def test_a_signed_callback_checks_and_carries_the_answer() -> None:
    got = check(_signed(), b"the answer", SECRET, now=1_010.0, max_age=60.0)
    assert (got.key, got.location, got.status, got.body) == (KEY, WHERE, 201, b"the answer")
    assert got.content_type == "text/plain" and got.timestamp == 1_000


@pytest.mark.parametrize("change", ["body", "status", "timestamp", "content-type", "location"])
def test_any_field_changed_after_signing_is_refused(change: str) -> None:
    headers, body = _signed(), b"the answer"
    if change == "body":
        body = b"the answeR"
    elif change == "status":
        headers[STATUS] = "200"
    elif change == "timestamp":
        headers[TIMESTAMP] = "1001"
    elif change == "content-type":
        headers["content-type"] = "text/html"
    else:
        headers["askonce-callback-location"] = WHERE + "x"
    with pytest.raises(CallbackError) as refused:
        check(headers, body, SECRET, now=1_010.0, max_age=60.0)
    assert refused.value.reason == "signature"


def test_age_is_bounded_both_ways_and_the_secret_rotates() -> None:
    with pytest.raises(CallbackError) as old:
        check(_signed(), b"the answer", SECRET, now=1_061.0, max_age=60.0)
    assert old.value.reason == "stale"
    with pytest.raises(CallbackError) as future:
        check(_signed(), b"the answer", SECRET, now=900.0, max_age=60.0)
    assert future.value.reason == "future"
    # Signed with the old secret, checked against [new, old]: accepted; against new alone: not.
    assert check(_signed(OLD), b"the answer", [SECRET, OLD], 1_000.0, 60.0).status == 201
    with pytest.raises(CallbackError):
        check(_signed(OLD), b"the answer", SECRET, 1_000.0, 60.0)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        check(_signed(), b"the answer", b"short", 1_000.0, 60.0)


@pytest.mark.parametrize("headers, reason", [
    ({}, "missing"),
    ({SIGNATURE: "%%%"}, "malformed"),
    ({SIGNATURE: "a b"}, "malformed"),
    ({STATUS: "2000"}, "malformed"),
    ({TIMESTAMP: "-5"}, "malformed"),
    ({TIMESTAMP: "1²"}, "malformed"),  # str.isdigit() says yes, int() says no
    ({STATUS: "20²"}, "malformed"),
    ({"askonce-callback-key": "short"}, "malformed"),
    ({"askonce-callback-key": "x" * 5000}, "malformed"),
])
def test_hostile_headers_are_refused_with_one_reason(headers: dict[str, str], reason: str
                                                     ) -> None:
    given = {} if not headers else {**_signed(), **headers}
    with pytest.raises(CallbackError) as refused:
        check(given, b"the answer", SECRET, 1_000.0, 60.0)
    assert refused.value.reason == reason and "\n" not in str(refused.value)


def test_callback_urls_are_normalised_and_what_could_escape_a_prefix_is_refused() -> None:
    assert callback_url("HTTP://127.0.0.1:8001/hooks/a?x=1") == "http://127.0.0.1:8001/hooks/a?x=1"
    assert callback_url("https://Example.org/h") == "https://example.org:443/h"
    hooks = [prefix("http://127.0.0.1:8001/hooks/")]
    for bad in ("ftp://127.0.0.1:8001/hooks/", "http://127.0.0.1:8001@evil/hooks/",
                "http://127.0.0.1:8001/hooks/../admin", "http://127.0.0.1:8001/hooks/%2e%2e/x",
                "http://127.0.0.1:8001/hooks/ x", "/hooks/a", "http://127.0.0.1:99999/",
                "http://127.0.0.1:8001/hooks/#f", "http://127.0.0.1:8001/hooks/\u00e9", "x" * 3000,
                "http://127.0.0.1:8001/hooks/..;/admin", "http://127.0.0.1:8001/hooks/%3b/x",
                "http://127.0.0.1:8001/hooks/a,http://127.0.0.1:8001/hooks/b"):
        url = callback_url(bad)
        assert url is None or not allowed(url, hooks), bad
    for other in ("http://127.0.0.1:8002/hooks/a", "http://127.0.0.1:8001/hooksx",
                  "http://127.0.0.1.evil:8001/hooks/a", "https://127.0.0.1:8001/hooks/a"):
        url = callback_url(other)
        assert url is not None and not allowed(url, hooks), other
    url = callback_url("http://127.0.0.1:8001/hooks/a")
    assert url is not None and allowed(url, hooks)
    for bad_prefix in ("http://127.0.0.1:8001/hooks", "http://127.0.0.1:8001/?q=1/", "hooks/"):
        with pytest.raises(ValueError, match="callback prefix"):
            prefix(bad_prefix)


def test_the_example_in_docs_protocol_md_is_what_the_code_signs_and_checks() -> None:
    import pathlib

    from askonce.integrations._join_async import location

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    start = page.index("POST /hooks/reports HTTP/1.1")
    example = page[start:page.index("```", start)].split("\n\n", 1)
    headers = dict(line.split(": ", 1) for line in example[0].splitlines()[1:])
    body = example[1].rstrip("\n").encode()
    got = check(headers, body, b"0123456789abcdef0123", now=1764672000.0, max_age=300.0)
    assert got.location == location("/.askonce/answers/", ("", "POST /reports", got.key))
    assert (got.status, got.content_type, got.body) == (200, "text/plain", b"the report")
