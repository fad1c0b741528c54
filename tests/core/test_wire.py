"""The wire format: strict, bounded, never raising; clamped to the receiver's limits."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import askonce
from askonce.core import sfv, wire
from askonce.core.question import Hop, Question, mint_key
from askonce.core.wire import Limits, Malformed, Reply, format_question, format_reply, parse_question, parse_reply

KEY = mint_key(1_700_000_000_000, bytes(range(16)))
SHORT_KEY = "0123456789abcdefABCDEF"


def test_question_round_trip_with_every_member() -> None:
    text = format_question(KEY, "edge", True, 2, 2.5, (Hop("edge", 1), Hop("gw", 2)))
    assert text == f'v=1, k="{KEY}", o=edge, e, b=2, d=2500, p=(edge:1 gw:2)'
    q = parse_question(text, now=100.0)
    assert not isinstance(q, Malformed)
    assert (q.key, q.origin, q.edge, q.budget, q.path) == (KEY, "edge", True, 2, (Hop("edge", 1), Hop("gw", 2)))
    assert q.deadline == pytest.approx(102.5)


def test_minimal_question_has_no_deadline_and_no_path() -> None:
    q = parse_question(f'v=1, k="{KEY}", o=svc, b=0', now=0.0)
    assert not isinstance(q, Malformed)
    assert (q.edge, q.budget, q.deadline, q.path) == (False, 0, None, ())


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (f'v=2, k="{KEY}", o=edge, b=1', "version"),
        (f'k="{KEY}", o=edge, b=1', "version"),
        (f'v="1", k="{KEY}", o=edge, b=1', "version"),
        (f'v=1, k="{KEY}", o=edge, b=-1', "budget"),
        (f'v=1, k="{KEY}", o=edge, b=1001', "budget"),
        (f'v=1, k="{KEY}", o=edge, b=1.5', "syntax"),
        (f'v=1, k="{KEY}", o=edge', "budget"),
        (f'v=1, k="{KEY}", o=edge, b=1, d=-5', "deadline"),
        (f'v=1, k="{KEY}", o=edge, b=1, d=86400001', "deadline"),
        (f'v=1, k="{KEY}", o=edge, b=1, b=2', "duplicate"),
        ('v=1, k="short", o=edge, b=1', "key"),
        ('v=1, k="bad key with spaces!!", o=edge, b=1', "key"),
        (f'v=1, k="{KEY}", o="edge", b=1', "origin"),
        (f'v=1, k="{KEY}", o=edge, e=1, b=1', "edge"),
        (f'v=1, k="{KEY}", o=edge, b=1, p=(gw)', "path"),
        (f'v=1, k="{KEY}", o=edge, b=1, p=(gw:0)', "path"),
        (f'v=1, k="{KEY}", o=edge, b=1, p=("gw:1")', "path"),
        (f'v=1, k="{KEY}", o=edge, b=1, p=gw:1', "path"),
        (f'v=1, k="{KEY}", o=edge, b=1;x=1', "syntax"),
        (f'v=1, k="{KEY}", o=edge, b=1,', "syntax"),
        (f'v=1,, k="{KEY}", o=edge, b=1', "syntax"),
        (f'V=1, k="{KEY}", o=edge, b=1', "syntax"),
        (f'v=1, k="{KEY}", o=édge, b=1', "not-ascii"),
        ("", "version"),
        ("v=1, " + "x=1, " * 600, "too-long"),
    ],
)
def test_malformed_questions_are_rejected_whole_with_a_reason(text: str, reason: str) -> None:
    assert parse_question(text, now=0.0) == Malformed(reason)


def test_path_longer_than_the_limit_is_rejected() -> None:
    hops = " ".join(f"l{i}:1" for i in range(wire.MAX_HOPS + 1))
    assert parse_question(f'v=1, k="{KEY}", o=edge, b=1, p=({hops})', now=0.0) == Malformed("path")


def test_format_keeps_the_hops_nearest_the_target_when_the_path_is_too_long() -> None:
    path = tuple(Hop(f"l{i}", 1) for i in range(40))
    q = parse_question(format_question(KEY, "edge", True, 1, None, path), now=0.0)
    assert not isinstance(q, Malformed)
    assert q.path == path[-wire.MAX_HOPS:]


def test_unknown_members_are_ignored_within_a_version() -> None:
    q = parse_question(f'v=1, k="{KEY}", o=edge, b=1, future=?1, zz=(a b)', now=0.0)
    assert not isinstance(q, Malformed) and q.budget == 1


@pytest.mark.parametrize(("sent_budget", "sent_ms", "budget", "deadline"), [
    (2, 1000, 2, 1.0),        # within limits: kept
    (50, 1000, 5, 1.0),       # budget above the receiver's maximum: clamped
    (2, 600_000, 2, 60.0),    # deadline above the receiver's maximum: clamped
    (1000, 86_400_000, 5, 60.0),
])
def test_incoming_budget_and_deadline_are_clamped(sent_budget: int, sent_ms: int, budget: int,
                                                   deadline: float) -> None:
    q = parse_question(f'v=1, k="{KEY}", o=edge, b={sent_budget}, d={sent_ms}', now=10.0,
                       limits=Limits(max_budget=5, max_deadline=60.0))
    assert not isinstance(q, Malformed)
    assert q.budget == budget
    assert q.deadline == pytest.approx(10.0 + deadline)


def test_bytes_input_is_accepted_and_bad_bytes_rejected() -> None:
    assert not isinstance(parse_question(f'v=1, k="{KEY}", o=edge, b=1'.encode(), now=0.0), Malformed)
    assert parse_question(b"v=1, k=\xff", now=0.0) == Malformed("not-ascii")


@pytest.mark.parametrize("reply", [
    Reply(0), Reply(3, True, "exhausted"), Reply(0, True, "overloaded", 0.5), Reply(1, False, None, 2.0),
    Reply(0, True, "breaker-open"), Reply(2, joins=True), Reply(0, True, "deadline", 1.0, True),
])
def test_reply_round_trip(reply: Reply) -> None:
    assert parse_reply(format_reply(reply)) == reply


@pytest.mark.parametrize(("text", "reason"), [
    ("v=1", "budget"), ("v=1, b=-1", "budget"), ("v=3, b=1", "version"), ("v=1, b=1, dnr=2", "dnr"),
    ('v=1, b=1, r="cap"', "reason"), ("v=1, b=1, pb=-1", "pushback"), ("v=1, b=1, dnr, dnr", "duplicate"),
    ("v=1, b=1, j=1", "joins"),
])
def test_malformed_replies(text: str, reason: str) -> None:
    assert parse_reply(text) == Malformed(reason)


def test_string_escapes_are_unescaped() -> None:
    d = wire.parse_dictionary(r'a="x\"y\\z"')
    assert d == {"a": 'x"y\\z'}


def test_byte_sequences_and_booleans_and_tokens() -> None:
    d = wire.parse_dictionary("a=:aGVsbG8=:, b=?0, c=tok/en:x, d")
    assert d == {"a": b"hello", "b": False, "c": "tok/en:x", "d": True}
    assert isinstance(d, dict) and isinstance(d["c"], wire.Token)


@given(st.text(max_size=300))
def test_parse_never_raises_on_any_text(text: str) -> None:
    parse_question(text, now=0.0)
    parse_reply(text)


@given(st.binary(max_size=300))
def test_parse_never_raises_on_any_bytes(data: bytes) -> None:
    parse_question(data, now=0.0)
    parse_reply(data)


names = st.from_regex(r"[A-Za-z][A-Za-z0-9_.-]{0,31}", fullmatch=True)


@given(
    key=st.binary(min_size=16, max_size=16).map(lambda b: mint_key(1, b)),
    origin=names,
    edge=st.booleans(),
    budget=st.integers(0, 10),
    remaining=st.none() | st.integers(0, 300_000),
    path=st.lists(st.tuples(names, st.integers(1, 1000)), max_size=wire.MAX_HOPS),
)
def test_question_round_trip_property(key: str, origin: str, edge: bool, budget: int, remaining: int | None,
                                      path: list[tuple[str, int]]) -> None:
    hops = tuple(Hop(a, b) for a, b in path)
    text = format_question(key, origin, edge, budget, None if remaining is None else remaining / 1000, hops)
    q = parse_question(text, now=0.0, limits=Limits(max_budget=10, max_deadline=300.0))
    assert not isinstance(q, Malformed)
    assert (q.key, q.origin, q.edge, q.budget, q.path) == (key, origin, edge, budget, hops)
    if remaining is None:
        assert q.deadline is None
    else:
        assert q.deadline == pytest.approx(remaining / 1000)


@given(budget=st.integers(0, 1000), dnr=st.booleans(), reason=st.none() | st.sampled_from(sorted(wire.REASONS)),
       pushback_ms=st.none() | st.integers(0, 86_400_000))
def test_reply_round_trip_property(budget: int, dnr: bool, reason: str | None, pushback_ms: int | None) -> None:
    reply = Reply(budget, dnr, reason, None if pushback_ms is None else pushback_ms / 1000)
    assert parse_reply(format_reply(reply)) == reply


def _doc_examples(prefix: str) -> list[str]:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(prefix + ":")]


def test_every_example_in_the_protocol_doc_parses() -> None:
    questions, replies = _doc_examples("askonce-question"), _doc_examples("askonce-reply")
    assert questions and len(replies) == 3
    for text in questions:
        assert not isinstance(parse_question(text, now=0.0), Malformed), text
    for text in replies:
        reply = parse_reply(text)
        assert not isinstance(reply, Malformed), text
        assert parse_reply(format_reply(reply)) == reply


def _general(text: str) -> object:
    return wire._parse_question_general(text, 0.0, Limits())


canonical_like = st.builds(
    lambda key, origin, e, b, d, p: f'v=1, k="{key}", o={origin}{", e" if e else ""}, b={b}'
    + ("" if d is None else f", d={d}") + ("" if not p else ", p=(" + " ".join(p) + ")"),
    key=st.from_regex(r"[0-9A-Za-z_-]{14,66}", fullmatch=True),
    origin=st.from_regex(r"[A-Za-z][A-Za-z0-9_.-]{0,33}", fullmatch=True),
    e=st.booleans(),
    b=st.integers(0, 2000).map(str) | st.just("0010"),
    d=st.none() | st.integers(0, 10**8),
    p=st.lists(st.from_regex(r"[A-Za-z][a-z0-9]{0,3}:[0-9]{1,4}", fullmatch=True), max_size=34),
)


@given(canonical_like)
def test_fast_path_agrees_with_the_general_parser_on_canonical_like_text(text: str) -> None:
    assert parse_question(text, now=0.0) == _general(text)


@given(st.text(alphabet=st.sampled_from(list('v=1, k"o:eb()dp0123456789AZaz_-')), max_size=120))
def test_fast_path_agrees_with_the_general_parser_on_arbitrary_text(text: str) -> None:
    assert parse_question(text, now=0.0) == _general(text)


def test_what_format_question_writes_takes_the_fast_path() -> None:
    text = format_question(KEY, "edge", True, 2, 1.5, (Hop("edge", 1), Hop("gw", 3)))
    fields = wire._canonical(text, 0.0, Limits())
    assert fields is not None and Question(*fields) == _general(text)
    assert wire._canonical(text + ", x=1", 0.0, Limits()) is None  # extras: the general parser decides


def test_the_general_parser_is_compiled_only_when_a_header_needs_it() -> None:
    # The general parser's expressions are kept out of ``import askonce`` and of the canonical fast
    # path; the first header outside the canonical form compiles them.
    code = (
        "import askonce; from askonce.core import sfv, wire; compiled = lambda: sfv._general is not None; "
        "a = compiled(); wire.parse_question(wire.format_question('k' * 16, 'o', True, 2, 1.0), 0.0); "
        "b = compiled(); r = wire.parse_reply('v=1, b=2'); print(a, b, compiled(), r == wire.Reply(2))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False", "True", "True"]


def test_parse_dictionary_is_the_one_entry_to_the_general_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    # Swapping wire.parse_dictionary swaps the parser under parse_question and parse_reply (the
    # benchmark compares parsers this way).
    seen: list[str] = []

    def spy(text: str) -> object:
        seen.append(text)
        return sfv.parse_dictionary(text)

    monkeypatch.setattr(wire, "parse_dictionary", spy)
    assert wire.parse_reply("v=1, b=2") == wire.Reply(2)
    assert not isinstance(wire.parse_question("b=1, v=1, o=x, k=\"abcdefghijklmnop\"", 0.0), wire.Malformed)
    assert len(seen) == 2


# --- the wire clamps before it rounds ---------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "ms"), [
    (math.inf, wire.MAX_DEADLINE_MS), (-math.inf, 0), (math.nan, 0), (1e12, wire.MAX_DEADLINE_MS),
    (86_400.0000001, wire.MAX_DEADLINE_MS), (-0.5, 0), (0.0, 0), (2.5, 2500), (1.001, 1001),
])
def test_to_ms_clamps_into_the_protocol_range_and_never_raises(seconds: float, ms: int) -> None:
    assert wire.to_ms(seconds, up=True) == ms
    assert wire.to_ms(seconds, up=False) == ms


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_format_question_writes_the_deadline_to_ms_would(remaining: float) -> None:
    text = wire.format_question(SHORT_KEY, "api", False, 2, remaining)
    assert text.endswith(f", d={wire.to_ms(remaining, up=False)}")
    q = wire.parse_question(text, 0.0, Limits(max_deadline=86_400))
    assert isinstance(q, askonce.Question)  # whatever was asked, the header parses


@pytest.mark.parametrize("pushback", [math.inf, math.nan, 1e12, -3.0])
def test_format_reply_writes_any_pushback_within_a_day(pushback: float) -> None:
    reply = wire.parse_reply(wire.format_reply(Reply(0, True, "overloaded", pushback)))
    assert isinstance(reply, Reply) and reply.pushback is not None
    assert 0 <= reply.pushback <= wire.MAX_DEADLINE_MS / 1000


# --- limits refuse at construction what they would misread -------------------------------------------------


REFUSED: list[Any] = [
    pytest.param(lambda: Limits(max_budget="3"), id="Limits max_budget str (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: Limits(max_budget=2.5), id="Limits max_budget float"),  # type: ignore[arg-type]
    pytest.param(lambda: Limits(max_budget=True), id="Limits max_budget bool"),
    pytest.param(lambda: Limits(max_deadline="3"), id="Limits max_deadline str (TypeError)"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfigured_limit_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


NAMED: list[Any] = [
    pytest.param(lambda: Limits(max_deadline=True), id="Limits max_deadline bool"),
    pytest.param(lambda: Limits(max_deadline=math.nan), id="Limits max_deadline nan"),
    pytest.param(lambda: Limits(max_budget=None), id="Limits max_budget None"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", NAMED)
def test_a_misconfigured_limit_is_a_value_error_naming_the_value(make: Any) -> None:
    with pytest.raises(ValueError, match=r"got|not a single"):
        make()



@pytest.mark.parametrize(("text", "ok"), [
    ("v=1, b=2\t", True),  # OWS after the last member is discarded (RFC 9651 4.2.2)
    ("v=1, b=2 \t ", True),
    ("v=1,\tb=2", True),
    ("\tv=1, b=2", False),  # before the first member only SP is discarded (4.2)
    ("v=1, b=2,\t", False),  # a trailing comma stays malformed
])
def test_whitespace_around_members_as_rfc_9651_says(text: str, ok: bool) -> None:
    import http_sfv

    parsed = parse_reply(text)
    assert (not isinstance(parsed, Malformed)) is ok
    d = http_sfv.Dictionary()
    try:
        d.parse(text.encode())
        sfv_ok = True
    except ValueError:
        sfv_ok = False
    assert sfv_ok is ok  # the reference parser agrees
