"""The hot path's shortcuts agree with the plain code they replace, and their caches stay bounded.

* ``wire.parse_frame`` is ``parse_question`` then ``propagation.tab_from``, without the ``Question``;
* the canonical parse reads a path text's hops from a cache (``wire._PATHS``), ``format_question`` a
  path's text (``wire._PATH_TEXTS``): both are keyed by what callers send, so both are bounded, and a
  warm cache must give what a cold one gives;
* ``format_question`` builds one string instead of joining parts; ``mint_key`` encodes in one pass;
  ``Account.hold`` clamps without ``min``/``max`` when it can.
"""

from __future__ import annotations

import base64
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from askonce import propagation
from askonce.core import question as qmod
from askonce.core import wire
from askonce.core.question import Account, Hop, Tab, mint_key
from askonce.core.wire import Limits, Malformed, format_question, parse_frame, parse_question

KEY = mint_key(1_700_000_000_000, bytes(range(16)))

names = st.from_regex(r"[A-Za-z][A-Za-z0-9_.-]{0,8}", fullmatch=True)
hops = st.builds(Hop, names, st.integers(1, 1000))
paths = st.lists(hops, max_size=40).map(tuple)

canonical_like = st.builds(
    lambda key, origin, e, b, d, p, s: f'v=1, k="{key}", o={origin}{", e" if e else ""}, b={b}'
    + ("" if d is None else f", d={d}") + ("" if not p else ", p=(" + " ".join(p) + ")")
    + ("" if s is None else f", s=:{s}:"),
    key=st.from_regex(r"[0-9A-Za-z_-]{14,66}", fullmatch=True),
    origin=st.from_regex(r"[A-Za-z][A-Za-z0-9_.-]{0,33}", fullmatch=True),
    e=st.booleans(),
    b=st.integers(0, 2000).map(str) | st.just("0010"),
    d=st.none() | st.integers(0, 10**8),
    p=st.lists(st.from_regex(r"[A-Za-z][a-z0-9]{0,3}:[0-9]{1,4}", fullmatch=True), max_size=34),
    s=st.none() | st.binary(min_size=1, max_size=70).map(lambda b: base64.b64encode(b).decode()) | st.just("abc"),
)
arbitrary = st.text(alphabet=st.sampled_from(list('v=1, k"o:eb()dpsS0123456789AZaz_-')), max_size=140)
limits = st.builds(Limits, st.integers(0, 1000), st.floats(0.001, 86_400))


def _as_frame(q: object) -> object:
    """What ``parse_frame`` returns, made comparable: the tab's values and the path."""
    if isinstance(q, Malformed):
        return q
    assert isinstance(q, tuple)
    tab, path = q
    assert isinstance(tab, Tab)
    return (tab.key, tab.origin, tab.edge, tab.account.left, tab.deadline, tab.sig, path)


def _via_question(text: str | bytes, now: float, lim: Limits) -> object:
    q = parse_question(text, now, lim)
    if isinstance(q, Malformed):
        return q
    return _as_frame((propagation.tab_from(q), q.path))


@given(canonical_like | arbitrary, st.floats(0, 1e6), limits)
def test_parse_frame_is_parse_question_then_tab_from(text: str, now: float, lim: Limits) -> None:
    assert _as_frame(parse_frame(text, now, lim)) == _via_question(text, now, lim)
    assert _as_frame(parse_frame(text.encode(), now, lim)) == _via_question(text.encode(), now, lim)


def test_parse_frame_gives_each_arrival_an_account_of_its_own() -> None:
    text = format_question(KEY, "edge", True, 3, 2.0, (Hop("edge", 1),))
    first, second = parse_frame(text, 0.0), parse_frame(text, 0.0)
    assert isinstance(first, tuple) and isinstance(second, tuple)
    assert first[0].account is not second[0].account
    assert first[0].account.spend() and first[0].left == 2 and second[0].left == 3


def test_parse_frame_rejects_what_parse_question_rejects() -> None:
    assert parse_frame(b"v=1, k=\xff", 0.0) == Malformed("not-ascii")
    assert parse_frame("x" * (wire.MAX_HEADER_CHARS + 1), 0.0) == Malformed("too-long")
    assert parse_frame(f'v=1, k="{KEY}", o=edge, b=1, p=(a:0)', 0.0) == Malformed("path")


# --- the path caches -----------------------------------------------------------------------------------


@given(canonical_like | arbitrary)
def test_a_warm_path_cache_parses_as_a_cold_one(text: str) -> None:
    wire._PATHS.clear()
    cold = parse_question(text, 0.0)
    warm = parse_question(text, 0.0)  # its path, if it had a valid one, now comes from the cache
    wire._PATHS.clear()
    assert warm == cold


def test_the_path_cache_is_bounded_and_holds_only_short_valid_paths() -> None:
    wire._PATHS.clear()
    for i in range(3 * wire._MAX_PATHS):
        q = parse_question(format_question(KEY, "edge", False, 1, None, (Hop("a", 1), Hop(f"l{i}", 2))), 0.0)
        assert not isinstance(q, Malformed) and q.path == (Hop("a", 1), Hop(f"l{i}", 2))
        assert len(wire._PATHS) <= wire._MAX_PATHS
    wire._PATHS.clear()
    long_path = tuple(Hop("x" * 31 + str(i % 10), 1000) for i in range(wire.MAX_HOPS))
    q = parse_question(format_question(KEY, "edge", False, 1, None, long_path), 0.0)
    assert not isinstance(q, Malformed) and q.path == long_path
    assert parse_question(f'v=1, k="{KEY}", o=edge, b=1, p=(a:1 b:1001)', 0.0) == Malformed("path")
    assert wire._PATHS == {}  # neither the long text nor the invalid one was kept


@given(st.lists(paths, min_size=1, max_size=5))
def test_a_warm_path_text_cache_formats_as_a_cold_one(many: list[tuple[Hop, ...]]) -> None:
    for path in many:
        wire._PATH_TEXTS.clear()
        cold = format_question(KEY, "o", False, 1, None, path)
        warm = format_question(KEY, "o", False, 1, None, path)
        assert warm == cold
        assert cold.endswith(f", p=({wire._path_text(path)})" if path else "b=1")


def test_a_path_that_cannot_be_a_cache_key_is_written_as_before() -> None:
    path = [Hop("edge", 1), Hop("gw", 2)]  # a list where a tuple belongs: unhashable, written all the same
    text = format_question(KEY, "o", False, 1, None, path)  # type: ignore[arg-type]
    assert text == f'v=1, k="{KEY}", o=o, b=1, p=(edge:1 gw:2)'


def test_the_path_text_cache_is_bounded() -> None:
    wire._PATH_TEXTS.clear()
    for i in range(3 * wire._MAX_PATHS):
        format_question(KEY, "o", False, 1, None, (Hop(f"l{i}", 1),))
        assert len(wire._PATH_TEXTS) <= wire._MAX_PATHS
    wire._PATH_TEXTS.clear()
    format_question(KEY, "o", False, 1, None, tuple(Hop("x" * 32, 1000) for _ in range(wire.MAX_HOPS)))
    assert wire._PATH_TEXTS == {}  # longer than _MAX_PATH_TEXT: not kept


# --- format_question against the plain join it replaces --------------------------------------------------


def _format_reference(key: str, origin: str, edge: bool, budget: int, remaining: float | None,
                      path: tuple[Hop, ...] = (), sig: bytes | None = None) -> str:
    parts = [f'v={wire.VERSION}, k="{key}", o={origin}']
    if edge:
        parts.append("e")
    parts.append(f"b={max(0, min(budget, wire.MAX_BUDGET))}")
    if remaining is not None:
        parts.append(f"d={wire.to_ms(remaining, up=False)}")
    if path:
        parts.append(f"p=({wire._path_text(path)})")
    if sig:
        parts.append(f"s=:{base64.b64encode(sig[:wire.MAX_SIG_BYTES]).decode('ascii')}:")
    return ", ".join(parts)


@given(
    st.from_regex(r"[0-9A-Za-z_-]{16,64}", fullmatch=True), names, st.booleans(), st.integers(-5, 2000),
    st.none() | st.floats(-10, 1e6, allow_nan=False) | st.integers(-5, 10**9) | st.sampled_from([1.001, 0.0015, 2.5]),
    paths, st.none() | st.binary(max_size=80),
)
def test_format_question_writes_what_the_plain_join_wrote(key: str, origin: str, edge: bool, budget: int,
                                                          remaining: float | None, path: tuple[Hop, ...],
                                                          sig: bytes | None) -> None:
    assert format_question(key, origin, edge, budget, remaining, path, sig) == _format_reference(
        key, origin, edge, budget, remaining, path, sig)


@pytest.mark.parametrize("remaining", [math.inf, -math.inf, math.nan])
def test_format_question_clamps_what_is_not_a_time_as_to_ms_does(remaining: float) -> None:
    assert format_question(KEY, "o", False, 1, remaining) == _format_reference(KEY, "o", False, 1, remaining)
    assert f"d={wire.to_ms(remaining, up=False)}" in format_question(KEY, "o", False, 1, remaining)


# --- mint_key and Account.hold ----------------------------------------------------------------------------


def _mint_reference(now_ms: int, random16: bytes) -> str:
    return qmod._b32(max(0, now_ms), qmod._TIME_CHARS) + qmod._b32(int.from_bytes(random16, "big"), qmod._RAND_CHARS)


@given(st.integers(-(2**60), 2**62) | st.sampled_from([0, 1_700_000_000_000, 2**50 - 1, 2**50]),
       st.binary(min_size=16, max_size=16))
def test_mint_key_encodes_as_the_character_by_character_loop(now_ms: int, random16: bytes) -> None:
    assert mint_key(now_ms, random16) == _mint_reference(now_ms, random16)


@given(st.integers(0, 50), st.integers(-5, 60))
def test_hold_holds_what_the_min_max_clamp_held(left: int, n: int) -> None:
    account = Account(left)
    assert account.hold(n) == max(0, min(n, left))
    assert account.left == left - max(0, min(n, left))


def test_a_failing_spend_does_not_keep_the_lock() -> None:
    account = Account(1)
    with pytest.raises(TypeError):
        account.spend(None)  # type: ignore[arg-type]
    assert account.spend() and account.left == 0  # the lock was released
