"""The httpx transport writes ``askonce-question`` and reads ``askonce-reply`` in httpx's header
list directly: the result must be what ``Headers.__setitem__`` and ``Headers.get_list`` give,
whatever the headers already hold (absent, once under another spelling, repeated, not ASCII), and a subclass
of ``httpx.Headers`` is left to its own methods."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.integrations import httpx as ah

HEADER_LISTS: list[list[tuple[Any, Any]]] = [
    [],
    [("accept", "*/*"), ("host", "example")],
    [("Askonce-Question", "old"), ("accept", "*/*")],
    [("accept", "*/*"), ("askonce-question", "one"), ("x", "y"), ("ASKONCE-QUESTION", "two")],
    [(b"x-latin", "é".encode("latin-1")), (b"askonce-question", b"k=1")],
]


class Spy(httpx.Headers):
    """A subclass whose own methods must be the ones used."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.used: list[str] = []

    def __setitem__(self, key: str, value: str) -> None:
        self.used.append("set")
        super().__setitem__(key, value)

    def get_list(self, key: str, split_commas: bool = False) -> list[str]:
        self.used.append("get_list")
        return super().get_list(key, split_commas)


@pytest.mark.parametrize("items", HEADER_LISTS)
@pytest.mark.parametrize("encoding", [None, "latin-1", "utf-16"])
def test_the_question_is_written_as_setitem_writes_it(items: list[tuple[Any, Any]],
                                                      encoding: str | None) -> None:
    value = "k=abc, o=edge, b=2, d=2500, p=(edge/1)"
    ours, theirs = httpx.Headers(items), httpx.Headers(items)
    if encoding is not None:
        ours.encoding = theirs.encoding = encoding
    ah._set_question(ours, value)
    theirs[QUESTION_HEADER] = value
    assert ours.raw == theirs.raw
    assert ours.get_list(QUESTION_HEADER) == [value]


def test_a_second_attempt_replaces_the_first_attempts_header() -> None:
    headers = httpx.Headers([("accept", "*/*")])
    ah._set_question(headers, "first")
    ah._set_question(headers, "second")
    assert headers.multi_items() == [("accept", "*/*"), (QUESTION_HEADER, "second")]


REPLY_LISTS: list[list[tuple[Any, Any]]] = [
    [],
    [("content-length", "5")],
    [("Askonce-Reply", "v=1, b=2")],
    [("askonce-reply", "v=1, b=2"), ("x", "y"), ("ASKONCE-REPLY", "v=1, b=0")],
    [(b"askonce-reply", "v=1, r=é".encode()), (b"x", b"y")],
    [(b"askonce-reply", "v=1, r=é".encode("latin-1"))],
]


@pytest.mark.parametrize("items", REPLY_LISTS)
@pytest.mark.parametrize("encoding", [None, "latin-1", "utf-16"])
def test_the_replies_are_read_as_get_list_reads_them(items: list[tuple[Any, Any]],
                                                     encoding: str | None) -> None:
    ours, theirs = httpx.Headers(items), httpx.Headers(items)
    if encoding is not None:
        ours.encoding = theirs.encoding = encoding
    assert ah._replies(ours) == theirs.get_list(REPLY_HEADER)


def test_a_headers_subclass_is_left_to_its_own_methods() -> None:
    headers = Spy([("askonce-reply", "v=1, b=2")])
    ah._set_question(headers, "k=1")
    assert ah._replies(headers) == ["v=1, b=2"]
    assert headers.used == ["set", "get_list"]
    assert headers[QUESTION_HEADER] == "k=1"


def test_an_httpx_that_keeps_its_headers_otherwise_gets_the_public_methods(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert ah._direct()  # the httpx installed here keeps (raw, lowercased, value) triples
    used: list[str] = []
    setitem, get_list = httpx.Headers.__setitem__, httpx.Headers.get_list

    def spy_set(self: httpx.Headers, key: str, value: str) -> None:
        used.append("set")
        setitem(self, key, value)

    def spy_get(self: httpx.Headers, key: str, split_commas: bool = False) -> list[str]:
        used.append("get_list")
        return get_list(self, key, split_commas)

    monkeypatch.setattr(httpx.Headers, "__setitem__", spy_set)
    monkeypatch.setattr(httpx.Headers, "get_list", spy_get)
    headers = httpx.Headers([("askonce-reply", "v=1, b=2")])
    ah._set_question(headers, "k=1")
    ah._replies(headers)
    assert used == []  # the direct path
    monkeypatch.setattr(ah, "_DIRECT", False)
    ah._set_question(headers, "k=2")
    assert ah._replies(headers) == ["v=1, b=2"]
    assert used == ["set", "get_list"]
    assert headers.get_list(QUESTION_HEADER) == ["k=2"]
