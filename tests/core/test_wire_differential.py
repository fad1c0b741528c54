"""The hand-written wire parser against a full RFC 9651 parser (``http-sfv``), with hypothesis.

``askonce.core.wire`` parses a strict *subset* of structured-field dictionaries (``wire.parse_dictionary``,
the general parser in ``askonce.core.sfv``). Three properties keep that claim honest:

(a) whatever our parser accepts, http-sfv accepts too, with the same members and values (we may reject
    more: parameters, decimals, duplicates, ...; we must never accept what the RFC does not);
(b) a dictionary generated inside the subset is accepted by both, with the same values as generated;
(c) what ``format_question`` / ``format_reply`` write parses identically with http-sfv.

(a) is also checked exhaustively over pairs of pieces at the grammar's edges, so that no edge depends
on hypothesis happening to draw it. Two divergences are pinned by their own tests: an empty field (an
empty dictionary per RFC 9651 section 4.2.2, which http-sfv 0.9.9 rejects; the askonce parsers reject
it for its missing version, so the header is ignored either way), and a parenthesis inside a string in
an inner list (valid RFC 9651, outside our subset: rejected, never misread).
"""

from __future__ import annotations

import base64
import string
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

http_sfv = pytest.importorskip("http_sfv")

from askonce.core import wire  # noqa: E402
from askonce.core.question import Hop, mint_key  # noqa: E402
from askonce.core.wire import (  # noqa: E402
    Malformed,
    Reply,
    format_question,
    format_reply,
    parse_dictionary,
    parse_question,
    parse_reply,
)

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Norm = tuple[Any, ...]


# --- one comparable shape for both parsers' values --------------------------------------------------


def _ours_item(v: object) -> Norm:
    if isinstance(v, wire.Token):
        return ("token", str(v))
    if type(v) is bool:
        return ("bool", v)
    if type(v) is int:
        return ("int", v)
    if type(v) is str:
        return ("string", v)
    if type(v) is bytes:
        return ("bytes", v)
    raise AssertionError(f"our parser produced an unexpected value {v!r}")


def _ours(d: dict[str, wire.Value]) -> list[tuple[str, Norm]]:
    return [(k, ("list", tuple(_ours_item(i) for i in v)) if isinstance(v, list) else _ours_item(v))
            for k, v in d.items()]


def _sfv_bare(v: object) -> Norm:
    if isinstance(v, http_sfv.Token):
        return ("token", str(v))
    if isinstance(v, http_sfv.DisplayString):
        return ("display-string", str(v))
    if type(v) is bool:
        return ("bool", v)
    if type(v) is int:
        return ("int", v)
    if isinstance(v, Decimal | float):
        return ("decimal", v)
    if isinstance(v, datetime):
        return ("date", v)
    if type(v) is str:
        return ("string", v)
    if type(v) is bytes:
        return ("bytes", v)
    raise AssertionError(f"http-sfv produced an unexpected value {v!r}")


def _sfv_member(m: Any) -> Norm:
    # Parameters are outside our subset, so they appear in the comparable shape: any would mismatch.
    if isinstance(m, http_sfv.InnerList):
        items = tuple(_sfv_bare(i.value) + ((dict(i.params),) if i.params else ()) for i in m)
        return ("list", items) + ((dict(m.params),) if m.params else ())
    return _sfv_bare(m.value) + ((dict(m.params),) if m.params else ())


def sfv_parse(text: str) -> list[tuple[str, Norm]] | None:
    """http-sfv's reading of ``text`` as a Dictionary, or ``None`` if it rejects it."""
    d = http_sfv.Dictionary()
    try:
        d.parse(text.encode("ascii"))
    except ValueError:
        return None
    return [(k, _sfv_member(m)) for k, m in d.items()]


def ours_parse(text: str) -> list[tuple[str, Norm]] | None:
    d = parse_dictionary(text)
    return None if isinstance(d, Malformed) else _ours(d)


# --- generators inside the subset -----------------------------------------------------------------

def _word(first: str, rest: str, max_rest: int) -> st.SearchStrategy[str]:
    return st.builds(str.__add__, st.sampled_from(first), st.text(alphabet=rest, max_size=max_rest))


LOWER = string.ascii_lowercase
keys = _word(LOWER + "*", LOWER + string.digits + "_.*-", 8)
ints = st.integers(-(10**15) + 1, 10**15 - 1)
printable = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=16)
tokens = _word(string.ascii_letters + "*", string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~:/", 10)
byte_seqs = st.binary(max_size=16)
ows = st.text(alphabet=" \t", max_size=3)
spaces = st.text(alphabet=" ", max_size=3)


def _ser_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


# (value as the parsers should read it, its serialisation)
int_items = ints.map(lambda i: (("int", i), str(i)))
bool_items = st.booleans().map(lambda b: (("bool", b), "?1" if b else "?0"))
token_items = tokens.map(lambda t: (("token", t), t))
bytes_items = byte_seqs.map(lambda b: (("bytes", b), ":" + base64.b64encode(b).decode("ascii") + ":"))


def string_items(text: st.SearchStrategy[str]) -> st.SearchStrategy[tuple[Norm, str]]:
    return text.map(lambda s: (("string", s), _ser_string(s)))


# Our inner-list rule is ``(`` no parentheses ``)``: a string item containing a parenthesis is outside
# the subset we accept (see test_a_parenthesis_inside_an_inner_list_string_is_outside_the_subset).
no_parens = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters="()"),
                    max_size=16)
inner_items = st.one_of(int_items, bool_items, token_items, bytes_items, string_items(no_parens))
bare_items = st.one_of(int_items, bool_items, token_items, bytes_items, string_items(printable))


@st.composite
def inner_lists(draw: st.DrawFn) -> tuple[Norm, str]:
    items = draw(st.lists(inner_items, max_size=5))
    gaps = [draw(st.text(alphabet=" ", min_size=1, max_size=3)) for _ in items[1:]]
    body = items[0][1] if items else ""
    for gap, (_, ser) in zip(gaps, items[1:], strict=True):
        body += gap + ser
    text = "(" + draw(spaces) + body + draw(spaces) + ")"
    return ("list", tuple(v for v, _ in items)), text


@st.composite
def dictionaries(draw: st.DrawFn) -> tuple[list[tuple[str, Norm]], str]:
    """A dictionary inside our subset: unique keys, random OWS; bare keys for ``true``."""
    names = draw(st.lists(keys, min_size=1, max_size=6, unique=True))
    expected: list[tuple[str, Norm]] = []
    parts: list[str] = []
    for name in names:
        value, ser = draw(st.one_of(bare_items, inner_lists()))
        if value == ("bool", True) and draw(st.booleans()):
            ser = ""  # a bare member is boolean true
        expected.append((name, value))
        parts.append(name if ser == "" else f"{name}={ser}")
    text = parts[0]
    for part in parts[1:]:
        text += draw(ows) + "," + draw(ows) + part
    return expected, draw(spaces) + text + draw(spaces)


# --- (b) inside the subset: both accept, both agree with what was generated ------------------------


@EXAMPLES
@given(dictionaries())
def test_generated_dictionaries_in_the_subset_parse_the_same_in_both(case: tuple[list[tuple[str, Norm]], str]) -> None:
    expected, text = case
    assert ours_parse(text) == expected
    assert sfv_parse(text) == expected


# --- (a) whatever we accept, http-sfv accepts with the same values ---------------------------------

GRAMMAR = string.ascii_letters + string.digits + ' \t,;=()"\\:?*-._/+%@!#$&\'^`|~'


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """A valid dictionary with a few random edits: mostly near the grammar's edges."""
    _, text = draw(dictionaries())
    chars = list(text)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        at = draw(st.integers(0, len(chars)))
        if op == "insert":
            chars.insert(at, draw(st.sampled_from(GRAMMAR)))
        elif chars and at < len(chars):
            if op == "delete":
                del chars[at]
            else:
                chars[at] = draw(st.sampled_from(GRAMMAR))
    return "".join(chars)


# Members built from pieces at the grammar's edges, valid and not: a random string rarely parses at all,
# these often do, and they put a ';', a 16th digit or a decimal point exactly where it matters.
KEY_PIECES = ["a", "b", "k", "*x", "a-b.c_", "A", "1a", ""]
VALUE_PIECES = [
    "", "=1", "=-0", "=007", "=123456789012345", "=1234567890123456", "=-123456789012345", "=1.5", "=1.",
    "=?1", "=?0", "=?2", "=?", '="x"', '=""', r'="a\"b"', r'="\\"', r'="\x"', '="x)"', '="(x"', '="\t"',
    "=tok", "=T:/x*", "=*", "=:YQ==:", "=:YQ:", "=::", "=:Y Q=:", "=(1 2)", "=()", "=( a  ?1 )",
    "=(1\t2)", "=(1;p)", "=(1);p", "=(1)(2)", "=((1))", "=@1", '=%"x"', ";p", "=1;p=1", "=", "=(",
]
SEP_PIECES = [",", ", ", " , ", " ,\t", "\t,", ",,", ";", " ", ""]
EDGE_PIECES = ["", " ", "  ", "\t"]


@st.composite
def fragments(draw: st.DrawFn) -> str:
    n = draw(st.integers(1, 4))
    members = [draw(st.sampled_from(KEY_PIECES)) + draw(st.sampled_from(VALUE_PIECES)) for _ in range(n)]
    text = members[0]
    for member in members[1:]:
        text += draw(st.sampled_from(SEP_PIECES)) + member
    return draw(st.sampled_from(EDGE_PIECES)) + text + draw(st.sampled_from(EDGE_PIECES))


near_misses = st.one_of(mutated(), fragments(), st.text(alphabet=GRAMMAR, max_size=40))


@EXAMPLES
@given(near_misses)
def test_whatever_we_accept_http_sfv_accepts_with_equal_values(text: str) -> None:
    ours = ours_parse(text)
    if ours is None:
        return
    if text.strip(" ") == "":  # the one divergence on http-sfv's side (module docstring)
        assert ours == []
        return
    assert sfv_parse(text) == ours


def test_every_pair_of_edge_pieces_we_accept_http_sfv_reads_the_same() -> None:
    # Exhaustive over the piece vocabulary above, so no edge depends on hypothesis drawing it.
    accepted = 0
    singles = [e1 + k + v + e2 for k in KEY_PIECES for v in VALUE_PIECES for e1 in EDGE_PIECES for e2 in EDGE_PIECES]
    pairs = [f"a{v1}{sep}b{v2}" for v1 in VALUE_PIECES for sep in SEP_PIECES for v2 in VALUE_PIECES]
    for text in singles + pairs:
        ours = ours_parse(text)
        if ours is None or text.strip(" ") == "":
            continue
        accepted += 1
        assert sfv_parse(text) == ours, text
    assert accepted > 1000  # the vocabulary keeps producing headers we accept, or this proves nothing


@pytest.mark.parametrize("text", [
    "a=1;x=2", "a=1.5", "a=1, a=2", "a=(1 2);p", "a=@1659578233", 'a=%"x"', "a=1234567890123456",
    "A=1", "a=:YQ:", "a=?2", "a=(1  ( 2))", "a=1,", ",a=1", "a=1 b=2", "a=\"\t\"",
])
def test_we_reject_outside_the_subset_or_the_rfc(text: str) -> None:
    assert ours_parse(text) is None


def test_a_parenthesis_inside_an_inner_list_string_is_outside_the_subset() -> None:
    # Valid RFC 9651, and http-sfv reads it; our inner-list rule stops at the first parenthesis and
    # rejects the header. Safe (a rejection, never a misreading), and askonce never sends strings in
    # inner lists; pinned here so that a change to the rule is a conscious one.
    text = 'a=("x)" 1)'
    assert sfv_parse(text) == [("a", ("list", (("string", "x)"), ("int", 1))))]
    assert ours_parse(text) is None


def test_empty_field_is_an_empty_dictionary_for_us_and_an_error_for_http_sfv() -> None:
    assert ours_parse("") == [] and ours_parse("   ") == []
    assert sfv_parse("") is None
    assert parse_question("", now=0.0) == Malformed("version")


# --- (c) what we write, http-sfv reads the same way -------------------------------------------------

layer_names = _word(string.ascii_letters, string.ascii_letters + string.digits + "_.-", 31)
question_keys = st.tuples(st.integers(0, 2**48), st.binary(min_size=16, max_size=16)).map(
    lambda t: mint_key(t[0], t[1]))


def _sfv_dict(text: str) -> Any:
    d = http_sfv.Dictionary()
    d.parse(text.encode("ascii"))
    return d


@EXAMPLES
@given(
    key=question_keys,
    origin=layer_names,
    edge=st.booleans(),
    budget=st.integers(0, 2000),
    remaining=st.none() | st.floats(0, 200_000, allow_nan=False),
    path=st.lists(st.tuples(layer_names, st.integers(1, wire.MAX_ATTEMPT)), max_size=wire.MAX_HOPS + 4),
)
def test_format_question_parses_identically_with_http_sfv(key: str, origin: str, edge: bool, budget: int,
                                                          remaining: float | None,
                                                          path: list[tuple[str, int]]) -> None:
    hops = tuple(Hop(a, n) for a, n in path)
    text = format_question(key, origin, edge, budget, remaining, hops)
    assert sfv_parse(text) == ours_parse(text) is not None
    q = parse_question(text, now=0.0, limits=wire.Limits(max_budget=wire.MAX_BUDGET,
                                                           max_deadline=wire.MAX_DEADLINE_MS / 1000))
    assert not isinstance(q, Malformed)
    d = _sfv_dict(text)
    assert d["v"].value == wire.VERSION
    assert (d["k"].value, d["o"].value) == (q.key, q.origin)
    assert isinstance(d["o"].value, http_sfv.Token)
    assert ("e" in d and d["e"].value is True) == q.edge
    assert d["b"].value == q.budget == min(budget, wire.MAX_BUDGET)
    assert (q.deadline is None) == ("d" not in d)
    if q.deadline is not None:
        assert q.deadline == d["d"].value / 1000
    sent = [str(i.value) for i in d["p"]] if "p" in d else []
    assert sent == [str(h) for h in q.path] == [str(h) for h in hops[-wire.MAX_HOPS:]]


reasons = st.none() | st.sampled_from(sorted(wire.REASONS)) | tokens.filter(lambda t: len(t) <= wire.MAX_NAME)


@EXAMPLES
@given(budget=st.integers(0, 2000), dnr=st.booleans(), reason=reasons,
       pushback=st.none() | st.floats(0, 100_000, allow_nan=False))
def test_format_reply_parses_identically_with_http_sfv(budget: int, dnr: bool, reason: str | None,
                                                       pushback: float | None) -> None:
    text = format_reply(Reply(budget, dnr, reason, pushback))
    assert sfv_parse(text) == ours_parse(text) is not None
    r = parse_reply(text)
    assert not isinstance(r, Malformed)
    d = _sfv_dict(text)
    assert d["v"].value == wire.VERSION
    assert d["b"].value == r.budget == min(budget, wire.MAX_BUDGET)
    assert ("dnr" in d and d["dnr"].value is True) == r.dnr == dnr
    assert (str(d["r"].value) if "r" in d else None) == r.reason == reason
    assert (d["pb"].value / 1000 if "pb" in d else None) == r.pushback


# --- the askonce parsers on near misses: accepted only if http-sfv agrees ---------------------------


@st.composite
def near_questions(draw: st.DrawFn) -> str:
    key = draw(question_keys)
    hops = tuple(Hop(a, n) for a, n in draw(st.lists(st.tuples(layer_names, st.integers(1, 9)), max_size=4)))
    text = format_question(key, draw(layer_names), draw(st.booleans()), draw(st.integers(0, 9)),
                           draw(st.none() | st.floats(0, 100, allow_nan=False)), hops)
    chars = list(text)
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(chars) - 1))
        chars[at] = draw(st.sampled_from(GRAMMAR))
    return "".join(chars)


@EXAMPLES
@given(near_questions())
def test_an_accepted_question_is_read_the_same_by_http_sfv(text: str) -> None:
    q = parse_question(text, now=0.0)
    if isinstance(q, Malformed):
        return
    assert sfv_parse(text) == ours_parse(text)
    d = _sfv_dict(text)
    assert (d["v"].value, d["k"].value, str(d["o"].value)) == (wire.VERSION, q.key, q.origin)
    assert type(d["b"].value) is int and d["b"].value >= q.budget  # clamped down, never up


@EXAMPLES
@given(st.one_of(
    st.builds(lambda b, x, tail: f"v=1, b={b}{x}{tail}", st.integers(0, 9), st.sampled_from(["", ", dnr", ", dnr=?0"]),
              st.text(alphabet=GRAMMAR, max_size=12)),
    st.text(alphabet=GRAMMAR, max_size=30),
))
def test_an_accepted_reply_is_read_the_same_by_http_sfv(text: str) -> None:
    r = parse_reply(text)
    if isinstance(r, Malformed):
        return
    assert sfv_parse(text) == ours_parse(text)
    d = _sfv_dict(text)
    assert (d["v"].value, d["b"].value) == (wire.VERSION, r.budget)
    assert ("dnr" in d and d["dnr"].value is True) == r.dnr
