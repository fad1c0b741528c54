"""The wire format: ``askonce-question`` and ``askonce-reply``, strict and bounded.

Both headers are RFC 9651 structured-field dictionaries, parsed as a *strict subset* of that grammar
(:mod:`askonce.core.sfv`, the general parser). Anything outside the subset, over the size limit, of
an unknown version, or with a value out of range is rejected *as a whole*: the parse functions
return a :class:`Malformed` carrying the reason and never raise. What ``format_question`` writes is
recognised by one regular expression first (the canonical fast path, here); anything else goes
through the general parser, and the two are checked to agree.

Receivers clamp what they accept to their own :class:`Limits`: a caller cannot raise a callee's
budget or deadline above what the callee allows.

See ``docs/protocol.md`` for the specification with examples.
"""

from __future__ import annotations

import binascii
import math
import re
from collections.abc import Callable
from typing import TypeVar

from askonce.core import is_int, is_real, sfv
from askonce.core.question import Account, Frame, Hop, Question, Tab
from askonce.core.record import Record
from askonce.core.sfv import MAX_HEADER_CHARS as MAX_HEADER_CHARS
from askonce.core.sfv import Item as Item
from askonce.core.sfv import Malformed as Malformed
from askonce.core.sfv import Token as Token
from askonce.core.sfv import Value as Value

QUESTION_HEADER = "askonce-question"
REPLY_HEADER = "askonce-reply"
VERSION = 1

# Hard protocol bounds: values beyond these are nonsense and make the whole header malformed.
# Values between a receiver's Limits and these bounds are clamped instead.
MAX_BUDGET = 1000
MAX_DEADLINE_MS = 86_400_000  # one day
_MAX_SECONDS = MAX_DEADLINE_MS / 1000
MAX_HOPS = 32
MAX_ATTEMPT = 1000
MAX_NAME = 32
MAX_SIG_BYTES = 64

REASONS = frozenset({"exhausted", "deadline", "overloaded", "cap", "breaker-open", "throttled",
                     "shed", "retried"})
"""Reasons defined in version 1. Other tokens are accepted (a newer peer's reason still means
"do not retry") but reported as they came."""


class Limits(Record):
    """A receiving layer's own maximums; incoming budgets and deadlines are clamped to them."""

    __slots__ = __match_args__ = ("max_budget", "max_deadline")
    max_budget: int
    max_deadline: float  # seconds

    def __init__(self, max_budget: int = 10, max_deadline: float = 300.0) -> None:
        _set = object.__setattr__
        _set(self, "max_budget", max_budget)
        _set(self, "max_deadline", max_deadline)
        self.__post_init__()

    def __post_init__(self) -> None:
        b = self.max_budget
        if not is_int(b) or not 0 <= b <= MAX_BUDGET:  # not a bool, a float or a str
            raise ValueError(f"max_budget must be an integer within 0..{MAX_BUDGET}, got {b!r}")
        d = self.max_deadline
        if not is_real(d) or not 0 < d <= _MAX_SECONDS:  # NaN fails
            raise ValueError(f"max_deadline must be seconds within (0, {MAX_DEADLINE_MS // 1000}], "
                             f"got {d!r}")


class Reply(Record):
    """What a callee tells its caller about the question's account.

    ``budget``: what is left after the callee's own spending. ``dnr``: do not retry, with
    ``reason``. ``pushback``: seconds the caller should wait before any retry (``None``: no
    opinion). ``joins``: the callee joins a repeated arrival of this question to the work in
    flight (``askonce.integrations.asgi_join``), so a retry of a timed-out try adds no work.
    """

    __slots__ = __match_args__ = ("budget", "dnr", "reason", "pushback", "joins")
    budget: int
    dnr: bool
    reason: str | None
    pushback: float | None
    joins: bool

    def __init__(self, budget: int, dnr: bool = False, reason: str | None = None,
                 pushback: float | None = None, joins: bool = False) -> None:
        _set = object.__setattr__
        _set(self, "budget", budget)
        _set(self, "dnr", dnr)
        _set(self, "reason", reason)
        _set(self, "pushback", pushback)
        _set(self, "joins", joins)


# --- the general parser ---------------------------------------------------------------------------

def parse_dictionary(text: str) -> dict[str, Value] | Malformed:
    """Parse the strict subset of an RFC 9651 dictionary (:mod:`askonce.core.sfv`). Never raises;
    never works past the size limit. ``parse_question`` and ``parse_reply`` call this name (so a
    benchmark can swap it)."""
    return sfv.parse_dictionary(text)


# --- askonce-question -----------------------------------------------------------------------------

_Fullmatch = Callable[[str], "re.Match[str] | None"]


def _on_first_use(name: str, pattern: str) -> _Fullmatch:
    """A stand-in for the module global ``name``: on its first call it compiles ``pattern`` and
    puts the expression's ``fullmatch`` in its place, so later calls cost what a compiled one
    does. Compiling at import cost more than any other line of ``import askonce``, and a process
    may never read a header (an in-process ``@askonce.retry``)."""

    def compile_then_match(text: str) -> re.Match[str] | None:
        fullmatch = re.compile(pattern).fullmatch
        globals()[name] = fullmatch
        return fullmatch(text)

    return compile_then_match


_name_fullmatch = _on_first_use("_name_fullmatch", r"[A-Za-z][A-Za-z0-9_.-]{0,31}")
_key_fullmatch = _on_first_use("_key_fullmatch", r"[0-9A-Za-z_-]{16,64}")


def valid_name(name: str) -> bool:
    """Layer and origin names: a letter, then up to 31 of letters, digits, ``_ . -``."""
    return _name_fullmatch(name) is not None


def _int_in(value: Value | None, hi: int) -> int | None:
    if type(value) is int and 0 <= value <= hi:
        return value
    return None


def _hop(item: Item) -> Hop | None:
    if type(item) is not Token:
        return None
    layer, colon, n = item.rpartition(":")
    if not colon or not valid_name(layer) or not n.isdigit() or len(n) > 4:
        return None
    attempt = int(n)
    return Hop(layer, attempt) if 1 <= attempt <= MAX_ATTEMPT else None


_HOP_TEXT = r"[A-Za-z][A-Za-z0-9_.-]{0,31}:[0-9]{1,4}"
_canonical_fullmatch = _on_first_use("_canonical_fullmatch", (
    r'v=1, k="([0-9A-Za-z_-]{16,64})", o=([A-Za-z][A-Za-z0-9_.-]{0,31})(, e)?, b=([0-9]{1,4})'
    rf"(?:, d=([0-9]{{1,8}}))?(?:, p=\(({_HOP_TEXT}(?: {_HOP_TEXT}){{0,{MAX_HOPS - 1}}})\))?"
    r"(?:, s=:([A-Za-z0-9+/]{4,88}={0,2}):)?"
))


# Paths repeat (the few routes questions take through a fleet), so the canonical parse reads each
# path text's hops once. The key is header text a caller chose: the cache holds only texts that
# parsed, of at most ``_MAX_PATH_TEXT`` characters, and starts over when ``_MAX_PATHS`` are held; a
# miss parses as if there were no cache (``tests/core/test_wire_caches.py``).
_PATHS: dict[str, tuple[Hop, ...]] = {}
_MAX_PATHS = 256
_MAX_PATH_TEXT = 256

_K = TypeVar("_K")
_V = TypeVar("_V")


def _keep(cache: dict[_K, _V], key: _K, value: _V) -> None:
    """Remember ``value``: a cache full at ``_MAX_PATHS`` starts over (paths repeat; their texts
    are bounded)."""
    if len(cache) >= _MAX_PATHS:
        cache.clear()
    cache[key] = value


def _canonical_path(p: str) -> tuple[Hop, ...] | None:
    """The hops of a path text that matched the canonical expression and is not cached yet (the
    caller looks in ``_PATHS`` first); ``None`` if an attempt is out of range."""
    hops = []
    for hop in p.split(" "):
        layer, _, n = hop.rpartition(":")
        attempt = int(n)
        if not 1 <= attempt <= MAX_ATTEMPT:
            return None
        hops.append(Hop(layer, attempt))
    path = tuple(hops)
    if len(p) <= _MAX_PATH_TEXT:
        _keep(_PATHS, p, path)
    return path


_Fields = tuple[str, str, bool, int, float | None, tuple[Hop, ...], bytes | None]
"""A question's members in :class:`Question`'s order: key, origin, edge, budget, deadline, path,
sig."""


def _canonical(text: str, now: float, limits: Limits) -> _Fields | None:
    """The fast path: exactly what :func:`format_question` writes, in its order and spacing.

    Anything else, including a value out of range, returns ``None`` and goes to the general parser,
    which decides (``tests/core/test_wire.py`` checks both paths agree on arbitrary input).
    """
    m = _canonical_fullmatch(text)
    if m is None:
        return None
    key, origin, edge, b, d, p, sig_text = m.groups()
    budget = int(b)
    if budget > MAX_BUDGET:
        return None
    deadline: float | None = None
    if d is not None:
        ms = int(d)
        if ms > MAX_DEADLINE_MS:
            return None
        seconds, most = ms / 1000, limits.max_deadline
        deadline = now + (most if most < seconds else seconds)  # min(), without the call
    path: tuple[Hop, ...] = ()
    if p is not None:
        hops = _PATHS.get(p) or _canonical_path(p)
        if hops is None:
            return None
        path = hops
    sig = None
    if sig_text is not None:
        if len(sig_text) % 4:
            return None
        import base64  # only a signed key needs it: not imported with askonce

        try:
            sig = base64.b64decode(sig_text, validate=True)
        except binascii.Error:
            return None
        if len(sig) > MAX_SIG_BYTES:
            return None
    most = limits.max_budget
    return key, origin, edge is not None, most if most < budget else budget, deadline, path, sig


def _ascii(text: str | bytes) -> str | Malformed:
    """Header bytes as text: bounded before decoding, ASCII only (RFC 9651 fields are)."""
    if not isinstance(text, bytes):
        return text
    if len(text) > MAX_HEADER_CHARS:
        return Malformed("too-long")
    try:
        return text.decode("ascii")
    except UnicodeDecodeError:
        return Malformed("not-ascii")


def parse_question(text: str | bytes, now: float,
                   limits: Limits = Limits()) -> Question | Malformed:
    """Decode an ``askonce-question`` value into a :class:`Question` on the local clock, clamped."""
    decoded = _ascii(text)
    if isinstance(decoded, Malformed):
        return decoded
    if len(decoded) <= MAX_HEADER_CHARS:
        fields = _canonical(decoded, now, limits)
        if fields is not None:
            return Question(*fields)
    return _parse_question_general(decoded, now, limits)


def parse_frame(text: str | bytes, now: float, limits: Limits = Limits()) -> Frame | Malformed:
    """:func:`parse_question` straight into what a server binds: a fresh process-local :class:`Tab`
    for the question (its own :class:`Account` of the budget that came) and the attempt path.

    The same values as ``parse_question`` and then ``context.tab_from``, without the
    :class:`Question` in between, which the hot path of a server middleware never needs
    (``tests/core/test_wire_caches.py``).
    """
    if type(text) is bytes and len(text) <= MAX_HEADER_CHARS:  # _ascii, spelled out
        try:
            decoded = text.decode("ascii")
        except UnicodeDecodeError:
            return Malformed("not-ascii")
    else:
        ascii_ = _ascii(text)
        if isinstance(ascii_, Malformed):
            return ascii_
        decoded = ascii_
    if len(decoded) <= MAX_HEADER_CHARS:
        fields = _canonical(decoded, now, limits)
        if fields is not None:
            key, origin, edge, budget, deadline, path, sig = fields
            return Tab(key, origin, edge, Account(budget), deadline, None, sig), path
    q = _parse_question_general(decoded, now, limits)
    if isinstance(q, Malformed):
        return q
    return Tab(q.key, q.origin, q.edge, Account(q.budget), q.deadline, None, q.sig), q.path


def _parse_question_general(text: str, now: float, limits: Limits) -> Question | Malformed:
    d = parse_dictionary(text)
    if isinstance(d, Malformed):
        return d
    if d.get("v") != VERSION or type(d.get("v")) is not int:
        return Malformed("version")
    key = d.get("k")
    if type(key) is not str or _key_fullmatch(key) is None:
        return Malformed("key")
    origin = d.get("o")
    if type(origin) is not Token or not valid_name(origin):
        return Malformed("origin")
    edge = d.get("e", False)
    if type(edge) is not bool:
        return Malformed("edge")
    budget = _int_in(d.get("b"), MAX_BUDGET)
    if budget is None:
        return Malformed("budget")
    deadline: float | None = None
    if "d" in d:
        ms = _int_in(d["d"], MAX_DEADLINE_MS)
        if ms is None:
            return Malformed("deadline")
        deadline = now + min(ms / 1000, limits.max_deadline)
    path: tuple[Hop, ...] = ()
    if "p" in d:
        items = d["p"]
        if not isinstance(items, list) or len(items) > MAX_HOPS:
            return Malformed("path")
        hops = [_hop(i) for i in items]
        if None in hops:
            return Malformed("path")
        path = tuple(h for h in hops if h is not None)
    sig = d.get("s")
    if sig is not None and (type(sig) is not bytes or not 1 <= len(sig) <= MAX_SIG_BYTES):
        return Malformed("sig")
    return Question(str(key), str(origin), edge, min(budget, limits.max_budget), deadline, path,
                    sig)


def to_ms(seconds: float, *, up: bool) -> int:
    """Seconds to whole milliseconds within the protocol's range. Time left is floored (a callee is
    never given more time than its caller has); pushback is rounded up (a caller never waits less
    than asked). The 1e-6 absorbs binary floating point (1.001 * 1000 is 1000.9999...). Out of
    range, infinite or NaN: clamped first (NaN as 0), so this never raises; within 0..86400 s
    neither rounding leaves 0..86400000."""
    if not 0 <= seconds <= _MAX_SECONDS:
        seconds = _MAX_SECONDS if seconds > _MAX_SECONDS else 0.0
    return math.ceil(seconds * 1000 - 1e-6) if up else math.floor(seconds * 1000 + 1e-6)


def _path_text(path: tuple[Hop, ...]) -> str:
    if len(path) > MAX_HOPS:  # keep the hops nearest the target, where retries matter most
        path = path[-MAX_HOPS:]
    return " ".join(f"{h.layer}:{h.attempt}" for h in path)


# Path texts by path: a layer sends the same few paths over and over. Bounded like ``_PATHS``: texts
# of at most ``_MAX_PATH_TEXT`` characters, and the cache starts over when ``_MAX_PATHS`` are held.
_PATH_TEXTS: dict[tuple[Hop, ...], str] = {}


def _cached_path_text(path: tuple[Hop, ...]) -> str:
    try:
        text = _PATH_TEXTS.get(path)
    except TypeError:
        # Not hashable (a list passed where a tuple of hops belongs): written without the cache.
        return _path_text(path)
    if text is None:
        text = _path_text(path)
        if len(text) <= _MAX_PATH_TEXT:
            _keep(_PATH_TEXTS, path, text)
    return text


def format_question(
    key: str,
    origin: str,
    edge: bool,
    budget: int,
    remaining: float | None,
    path: tuple[Hop, ...] = (),
    sig: bytes | None = None,
    rejoin: bool = False,
) -> str:
    """Encode a question; ``remaining`` is seconds left until the deadline (``None``: no
    deadline). ``rejoin``: the attempt re-attaches to the question's run in flight at the callee
    (member ``j``, last): a callee that joins refuses to run it anew (:func:`is_rejoin`)."""
    if not 0 < budget < MAX_BUDGET:
        budget = max(0, min(budget, MAX_BUDGET))
    text = f'v={VERSION}, k="{key}", o={origin}, e, b={budget}' if edge else (
        f'v={VERSION}, k="{key}", o={origin}, b={budget}')
    if remaining is not None:
        # to_ms(remaining, up=False), spelled out: int() is math.floor on 0..86400 s, and what is
        # outside (infinite and NaN too) is clamped before it is multiplied, as to_ms does
        if 0 <= remaining <= _MAX_SECONDS:
            text += f", d={int(remaining * 1000 + 1e-6)}"
        else:
            text += f", d={MAX_DEADLINE_MS if remaining > _MAX_SECONDS else 0}"
    if path:
        text += f", p=({_cached_path_text(path)})"
    if sig:
        import base64

        text += f", s=:{base64.b64encode(sig[:MAX_SIG_BYTES]).decode('ascii')}:"
    if rejoin:
        text += ", j"
    return text


def is_rejoin(text: str | bytes) -> bool:
    """Does this ``askonce-question`` value re-attach (member ``j`` true)? A quick look first:
    only a value holding ``, j`` is parsed."""
    raw = text if isinstance(text, bytes) else text.encode("latin-1", "replace")
    if b", j" not in raw:
        return False
    decoded = _ascii(raw)
    if isinstance(decoded, Malformed):
        return False
    d = parse_dictionary(decoded)
    return not isinstance(d, Malformed) and d.get("j") is True


# --- askonce-reply --------------------------------------------------------------------------------


def parse_reply(text: str | bytes) -> Reply | Malformed:
    """Decode an ``askonce-reply`` value. Never raises."""
    decoded = _ascii(text)
    if isinstance(decoded, Malformed):
        return decoded
    d = parse_dictionary(decoded)
    if isinstance(d, Malformed):
        return d
    if d.get("v") != VERSION or type(d.get("v")) is not int:
        return Malformed("version")
    budget = _int_in(d.get("b"), MAX_BUDGET)
    if budget is None:
        return Malformed("budget")
    dnr = d.get("dnr", False)
    if type(dnr) is not bool:
        return Malformed("dnr")
    reason = d.get("r")
    if reason is not None and (type(reason) is not Token or len(reason) > MAX_NAME):
        return Malformed("reason")
    pushback: float | None = None
    if "pb" in d:
        ms = _int_in(d["pb"], MAX_DEADLINE_MS)
        if ms is None:
            return Malformed("pushback")
        pushback = ms / 1000
    joins = d.get("j", False)
    if type(joins) is not bool:
        return Malformed("joins")
    return Reply(budget, dnr, None if reason is None else str(reason), pushback, joins)


def format_reply(reply: Reply) -> str:
    parts = [f"v={VERSION}, b={max(0, min(reply.budget, MAX_BUDGET))}"]
    if reply.dnr:
        parts.append("dnr")
    if reply.reason is not None:
        parts.append(f"r={reply.reason}")
    if reply.pushback is not None:
        parts.append(f"pb={to_ms(reply.pushback, up=True)}")
    if reply.joins:
        parts.append("j")
    return ", ".join(parts)
