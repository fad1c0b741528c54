"""What must hold of askonce's wire parsers on any input: the invariants every fuzzer here checks.

:func:`check` takes one input (bytes, as a header arrives), runs askonce's parsers on it
(``parse_question``, ``parse_frame``, ``parse_reply``, ``is_rejoin``, ``parse_dictionary``) and
http-sfv's ``Dictionary``, and raises :class:`Finding` when one of these does not hold:

1. askonce never raises; each parser returns its documented type or a ``Malformed`` whose reason is
   one of :data:`REASONS` (reasons are counted per process: their set must stay bounded).
2. Over ``MAX_HEADER_CHARS`` bytes every parser says ``too-long``; bytes that are not ASCII,
   ``not-ascii``. Bytes and the same text as ``str`` parse alike.
3. Differential: what ``parse_dictionary`` accepts, http-sfv accepts with the same members and
   values (one documented divergence: an empty field, an empty dictionary to us, an error to
   http-sfv 0.9.9).
4. Round trip: http-sfv's serialisation of what both accepted is read by askonce as the same values.
5. ``parse_question`` accepts only what ``parse_dictionary`` accepts, with those values (clamped
   to the receiver's ``Limits``); a leading space (which only the general parser reads) changes
   nothing, so the canonical fast path and the general parser agree; ``format_question`` of the
   result parses back to the same question and is a fixed point; ``parse_frame`` binds the same
   question.
6. ``parse_reply`` likewise: the dictionary's values, and ``format_reply`` round-trips.
7. ``is_rejoin`` is true exactly when the value holds ``, j`` (its documented quick look) and parses
   with ``j`` true.

:func:`check` returns a short outcome label (which parser accepted, which reason rejected): a
bounded set, which the pure-Python engine of ``fuzz/fuzz_wire.py`` uses as its feedback.
"""

from __future__ import annotations

import time
from typing import Any

from http_sfv.dictionary import Dictionary
from http_sfv.item import InnerList
from http_sfv.types import Token as SfvToken

from askonce.core import wire
from askonce.core.question import Hop, Question
from askonce.core.wire import Limits, Malformed, Reply, Token

NOW = 0.0  # the receiving clock; 0 keeps deadlines exact through the round trip
LIMITS = Limits()  # what a server applies by default: budgets and deadlines get clamped
REASONS = frozenset({
    "too-long", "not-ascii", "syntax", "duplicate", "version", "key", "origin", "edge", "budget",
    "deadline", "path", "sig", "dnr", "reason", "pushback", "joins",
})
KNOWN_KEYS = ("v", "k", "o", "e", "b", "d", "p", "s", "j", "dnr", "r", "pb")

Norm = tuple[Any, ...]


class Finding(AssertionError):
    """An invariant of the module docstring that an input broke."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise Finding(what)


# --- one comparable shape for both parsers' values ------------------------------------------


def _ours_item(v: object) -> Norm:
    if isinstance(v, Token):
        return ("token", str(v))
    if type(v) in (bool, int, str, bytes):
        return (type(v).__name__, v)
    raise Finding(f"parse_dictionary produced an unexpected value {v!r}")


def ours_norm(d: dict[str, wire.Value]) -> list[tuple[str, Norm]]:
    return [(k, ("list", tuple(_ours_item(i) for i in v)) if isinstance(v, list) else _ours_item(v))
            for k, v in d.items()]


def _sfv_bare(v: object) -> Norm:
    if isinstance(v, SfvToken):
        return ("token", str(v))
    if type(v) in (bool, int, str, bytes):
        return (type(v).__name__, v)
    return ("other", type(v).__name__, repr(v))  # decimals, dates, display strings


def _sfv_member(m: Any) -> Norm:
    # Parameters are outside our subset, so they enter the shape: any would mismatch.
    if isinstance(m, InnerList):
        items = tuple(_sfv_bare(i.value) + ((dict(i.params),) if i.params else ()) for i in m)
        return ("list", items) + ((dict(m.params),) if m.params else ())
    return _sfv_bare(m.value) + ((dict(m.params),) if m.params else ())


def sfv_parse(data: bytes) -> tuple[list[tuple[str, Norm]], str] | None:
    """http-sfv's reading of ``data`` as a Dictionary and its serialisation, or ``None`` if it
    rejects it (it raises ``ValueError`` for every rejection)."""
    d = Dictionary()
    try:
        d.parse(data)
    except ValueError:
        return None
    return [(k, _sfv_member(m)) for k, m in d.items()], str(d) if len(d) else ""


# --- the askonce headers against the dictionary they came in --------------------------------


def _expected_question(d: dict[str, wire.Value]) -> Question:
    """The question ``d``'s members say, clamped to :data:`LIMITS` (``d`` was accepted)."""
    budget, ms = d["b"], d.get("d")
    assert type(budget) is int and (ms is None or type(ms) is int)
    items = d.get("p", [])
    assert isinstance(items, list)
    hops = tuple(Hop(layer, int(n)) for layer, _, n in (str(i).rpartition(":") for i in items))
    deadline = None if ms is None else NOW + min(ms / 1000, LIMITS.max_deadline)
    sig = d.get("s")
    return Question(str(d["k"]), str(d["o"]), d.get("e", False) is True,
                    min(budget, LIMITS.max_budget), deadline, hops,
                    sig if isinstance(sig, bytes) else None)


def _check_question(d: dict[str, wire.Value] | Malformed, q: Question | Malformed) -> None:
    if isinstance(q, Malformed):
        return
    _require(not isinstance(d, Malformed), f"parse_question accepted, parse_dictionary says {d}")
    assert not isinstance(d, Malformed)
    _require(q == _expected_question(d), f"question {q} is not what its dictionary says {d}")
    remaining = q.remaining(NOW)
    again = wire.format_question(q.key, q.origin, q.edge, q.budget, remaining, q.path, q.sig)
    q2 = wire.parse_question(again, NOW, LIMITS)
    _require(q2 == q, f"format_question({q}) = {again!r} parses as {q2}")
    assert isinstance(q2, Question)
    again2 = wire.format_question(q2.key, q2.origin, q2.edge, q2.budget, q2.remaining(NOW), q2.path,
                                  q2.sig)
    _require(again2 == again, f"format_question is not a fixed point: {again!r} then {again2!r}")


def _check_reply(d: dict[str, wire.Value] | Malformed, r: Reply | Malformed) -> None:
    if isinstance(r, Malformed):
        return
    _require(not isinstance(d, Malformed), f"parse_reply accepted, parse_dictionary says {d}")
    assert not isinstance(d, Malformed)
    budget, pb = d["b"], d.get("pb")
    assert type(budget) is int and (pb is None or type(pb) is int)
    reason = None if d.get("r") is None else str(d["r"])
    expected = Reply(budget, d.get("dnr", False) is True, reason, None if pb is None else pb / 1000,
                     d.get("j", False) is True)
    _require(r == expected, f"reply {r} is not what its dictionary says {d}")
    again = wire.format_reply(r)
    r2 = wire.parse_reply(again)
    _require(r2 == r, f"format_reply({r}) = {again!r} parses as {r2}")


# --- the check ------------------------------------------------------------------------------------


def _label(m: object, accepted: str) -> str:
    if isinstance(m, Malformed):
        _require(m.reason in REASONS, f"unknown reason {m.reason!r}")
        return m.reason
    return accepted


def check(data: bytes) -> tuple[str, int]:
    """Run every parser on ``data`` and check the module's invariants; return the outcome label and
    the CPU nanoseconds of this thread askonce's parsers took (http-sfv's and the checks' not
    counted; CPU, because a busy machine stretches wall time without the parser doing more)."""
    t0 = time.thread_time_ns()
    q = wire.parse_question(data, NOW, LIMITS)
    frame = wire.parse_frame(data, NOW, LIMITS)
    r = wire.parse_reply(data)
    rejoin = wire.is_rejoin(data)
    elapsed = time.thread_time_ns() - t0

    _require(isinstance(q, Question | Malformed), f"parse_question returned {q!r}")
    _require(isinstance(r, Reply | Malformed), f"parse_reply returned {r!r}")
    _require(type(rejoin) is bool, f"is_rejoin returned {rejoin!r}")
    labels = [_label(q, "question"), _label(r, "reply"), "rejoin" if rejoin else "-"]
    if isinstance(frame, Malformed):
        _require(frame == q, f"parse_frame says {frame}, parse_question {q}")
    else:
        _require(isinstance(q, Question) and frame[0].snapshot(frame[1]) == q,
                 f"parse_frame binds {frame}, parse_question says {q}")

    if len(data) > wire.MAX_HEADER_CHARS or not data.isascii():
        reason = "too-long" if len(data) > wire.MAX_HEADER_CHARS else "not-ascii"
        _require(q == r == Malformed(reason) and not rejoin, f"{reason} input: {q}, {r}, {rejoin}")
        return "|".join([reason, *labels]), elapsed

    text = data.decode("ascii")
    t0 = time.thread_time_ns()
    d = wire.parse_dictionary(text)
    q_text = wire.parse_question(text, NOW, LIMITS)
    r_text = wire.parse_reply(text)
    short = len(text) < wire.MAX_HEADER_CHARS
    spaced = wire.parse_question(" " + text, NOW, LIMITS) if short else q
    elapsed += time.thread_time_ns() - t0
    _require(q_text == q and r_text == r, f"str and bytes differ: {q_text} {q}, {r_text} {r}")
    _require(spaced == q, f"the fast path says {q}, the general parser {spaced}")
    _require(isinstance(d, dict | Malformed), f"parse_dictionary returned {d!r}")
    labels.append(_label(d, "dict"))
    _check_question(d, q)
    _check_reply(d, r)
    holds_j = isinstance(d, dict) and d.get("j") is True
    _require(rejoin == (holds_j and b", j" in data), f"is_rejoin is {rejoin} for {d}")

    theirs = sfv_parse(data)
    labels.append("sfv" if theirs is not None else "sfv-rejects")
    if isinstance(d, Malformed):
        return "|".join(labels), elapsed
    labels.append("".join(k for k in KNOWN_KEYS if k in d))
    if text.strip(" ") == "":  # the documented divergence: an empty field
        _require(d == {}, f"an empty field parses as {d}")
        return "|".join(labels), elapsed
    ours = ours_norm(d)
    _require(theirs is not None, f"askonce accepts {ours}, http-sfv rejects")
    assert theirs is not None
    values, serialised = theirs
    _require(values == ours, f"askonce reads {ours}, http-sfv {values}")
    if len(serialised) <= wire.MAX_HEADER_CHARS:
        back = wire.parse_dictionary(serialised)
        _require(not isinstance(back, Malformed) and ours_norm(back) == ours,
                 f"http-sfv's serialisation {serialised!r} reads as {back}")
    return "|".join(labels), elapsed
