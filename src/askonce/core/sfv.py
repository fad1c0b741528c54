"""The general parser: a strict subset of RFC 9651 (structured field values) dictionaries, by hand.

Both askonce headers are structured-field dictionaries. What ``format_question`` writes is read by
one regular expression in :mod:`askonce.core.wire` (the canonical fast path); everything else, and
every ``askonce-reply``, comes here. The subset (the choice was measured, see
``docs/benchmarks.md``): integers, booleans, strings, tokens, byte sequences and inner lists of
those (a string inside an inner list may not contain a parenthesis), with no parameters, no decimals
and no duplicate members. Anything outside it, or over the size limit, is rejected *as a whole* with
a :class:`Malformed`; nothing raises. Every accepted dictionary is also accepted,
with the same values, by a full RFC 9651 parser (``tests/core/test_wire_differential.py`` checks it
against ``http-sfv``).

The value types (:class:`Token`, :class:`Malformed`, ``Item``, ``Value``) live here and are
re-exported by :mod:`askonce.core.wire`; ``wire.parse_dictionary`` is the name to call (and the one
``bench/bench_wire.py`` swaps for http-sfv). The expressions compile on first use.
"""

from __future__ import annotations

import binascii
import re

from askonce.core.record import Record

MAX_HEADER_CHARS = 2048  # a header longer than this is malformed, unread


class Token(str):
    """A structured-field token, told apart from a string."""

    __slots__ = ()


Item = int | bool | str | bytes
Value = Item | list[Item]


class Malformed(Record):
    """Why a header was rejected; callers count these (``askonce.stats()``), nothing raises."""

    __slots__ = __match_args__ = ("reason",)
    reason: str

    def __init__(self, reason: str) -> None:
        object.__setattr__(self, "reason", reason)

    def __bool__(self) -> bool:
        return False

_KEY = r"[a-z*][a-z0-9_.*-]*"
_ITEM = (
    r"(?P<i>-?[0-9]{1,15})(?![0-9.])"
    r'|"(?P<s>(?:[ !#-\[\]-~]|\\["\\])*)"'
    r"|\?(?P<b>[01])"
    r"|(?P<t>[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*)"
    r"|:(?P<y>[A-Za-z0-9+/]*={0,2}):"
)


class _General:
    """The general parser's expressions, compiled on first use: most processes only ever meet the
    canonical form, and importing this module (a type, a test) should not pay for them."""

    def __init__(self) -> None:
        self.member = re.compile(rf"(?P<k>{_KEY})(?:=(?:{_ITEM}|\((?P<l>[^()]*)\)))?")
        self.inner_item = re.compile(_ITEM)
        self.sep = re.compile(r"[ \t]*,[ \t]*")
        self.spaces = re.compile(r" +")
        self.escape = re.compile(r"\\([\"\\])")


_general: _General | None = None


def _rx() -> _General:
    global _general
    if _general is None:
        _general = _General()
    return _general


def _item(m: re.Match[str]) -> Item | None:
    i = m.group("i")
    if i is not None:
        return int(i)
    s = m.group("s")
    if s is not None:
        return _rx().escape.sub(r"\1", s) if "\\" in s else s
    b = m.group("b")
    if b is not None:
        return b == "1"
    t = m.group("t")
    if t is not None:
        return Token(t)
    y = m.group("y")
    if y is None or len(y) % 4:
        return None
    import base64  # only a byte sequence needs it: not imported with askonce

    try:
        return base64.b64decode(y, validate=True)
    except binascii.Error:
        return None


def _inner(text: str) -> list[Item] | None:
    body = text.strip(" ")
    rx = _rx()
    if not body:
        return []
    out: list[Item] = []
    pos, end = 0, len(body)
    while True:
        m = rx.inner_item.match(body, pos)
        if m is None:
            return None
        value = _item(m)
        if value is None:
            return None
        out.append(value)
        pos = m.end()
        if pos == end:
            return out
        s = rx.spaces.match(body, pos)
        if s is None:
            return None
        pos = s.end()


def parse_dictionary(text: str) -> dict[str, Value] | Malformed:
    """Parse the strict subset of an RFC 9651 dictionary. Never raises; never works past the size
    limit."""
    if len(text) > MAX_HEADER_CHARS:
        return Malformed("too-long")
    if not text.isascii():
        return Malformed("not-ascii")
    # Leading SP only (RFC 9651 4.2); after a member, any OWS, tabs included (4.2.2).
    text = text.strip(" ")
    rx = _rx()
    out: dict[str, Value] = {}
    pos, end, last = 0, len(text), len(text.rstrip(" \t"))
    while pos < end:
        m = rx.member.match(text, pos)
        if m is None:
            return Malformed("syntax")
        key = m.group("k")
        if key in out:
            return Malformed("duplicate")
        if m.group("l") is not None:
            items = _inner(m.group("l"))
            if items is None:
                return Malformed("syntax")
            out[key] = items
        elif m.end() - m.start() == len(key):
            out[key] = True  # a bare member is boolean true
        else:
            value = _item(m)
            if value is None:
                return Malformed("syntax")
            out[key] = value
        pos = m.end()
        if pos >= last:  # the end, or only OWS after this member
            break
        sep = rx.sep.match(text, pos)
        if sep is None or sep.end() == end:  # something after a member, or a trailing comma
            return Malformed("syntax")
        pos = sep.end()
    return out
