"""Propagation: binding a question to the running code, and moving it through headers.

``question()`` mints a question at an originator and binds it; ``bind`` and ``fanout`` bind one
that exists; ``inject`` and ``extract`` move it through a header mapping; ``outgoing`` forwards it
on one call and holds the budget sent; ``serve`` is what a server integration wraps a request in:
extract (or mint) and bind on the way in, the reply to send on the way out. The binding itself is
:mod:`askonce._context`'s one ``ContextVar``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import Token
from types import TracebackType
from typing import Any, TypeVar

from askonce import _stats
from askonce._context import FRAME
from askonce._stats import count
from askonce.core import wire
from askonce.core.question import Account, Frame, Hop, Question, Tab, mint_key
from askonce.core.retry import ANSWERED, LOST, REFUSED, settle
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER, Limits, Malformed, Reply
from askonce.errors import reply_of


def new_key() -> str:
    """A fresh question key: time-sortable, 128 random bits, URL-safe."""
    return mint_key(time.time_ns() // 1_000_000, os.urandom(16))


def tab_from(q: Question, now: float | None = None) -> Tab:
    """A fresh process-local account for a question that arrived from elsewhere."""
    return Tab(q.key, q.origin, q.edge, Account(q.budget), q.deadline, sig=q.sig)


def minted_tab(layer: str, originator: bool, budget: int, deadline: float | None, limits: Limits,
               now: float, secret: bytes | str | None = None, key: str | None = None) -> Tab:
    """The question a server layer mints when none (or a bad one) arrived: clamped by ``limits``,
    its key minted lazily (or ``key``, one it adopts); signed with ``secret`` if one is given (an
    originator's edge key)."""
    tab = Tab(key, layer, originator, Account(min(budget, limits.max_budget)),
              None if deadline is None else now + min(deadline, limits.max_deadline),
              minter=None if key is not None else new_key)
    if secret is not None:
        tab.sig = sign(tab.key, secret)
    return tab


def sign(key: str, secret: bytes | str) -> bytes:
    """The signature of an edge key (``core.signing.mac``)."""
    from askonce.core.signing import mac  # hmac and hashlib load only when keys are signed

    return mac(key, secret)


class question:
    """Mint a question at an originator and bind it for the block (``with`` or ``async with``).

    ``budget`` is the number of retries the whole question may cost, across every layer below;
    ``deadline`` is seconds from now. ``origin`` names the minting layer; ``edge=True`` declares it
    an originator, whose keys the target counts as attributable. ``secret``: the originators' shared
    secret; the key is then signed (``core.signing``) so that targets checking signatures can
    tell real edge keys from forged ones.
    """

    __slots__ = ("_tab", "_token", "question")

    def __init__(
        self,
        *,
        budget: int = 2,
        deadline: float | None = 30.0,
        origin: str = "edge",
        edge: bool = True,
        key: str | None = None,
        secret: bytes | str | None = None,
    ) -> None:
        if not 0 <= budget <= wire.MAX_BUDGET:
            raise ValueError(f"budget must be within 0..{wire.MAX_BUDGET}, got {budget!r}")
        if deadline is not None and not 0 < deadline <= wire.MAX_DEADLINE_MS / 1000:
            raise ValueError(
                f"deadline must be within (0, 86400] seconds or None, got {deadline!r}")
        if not wire.valid_name(origin):
            raise ValueError(f"origin must be a name like 'edge' or 'web-1', got {origin!r}")
        now = _stats.monotonic()
        key = key or new_key()
        tab = Tab(key, origin, edge, Account(budget), None if deadline is None else now + deadline,
                  sig=sign(key, secret) if edge and secret is not None else None)
        self._tab = tab
        self.question = tab.snapshot(())
        self._token: Token[Frame | None] | None = None

    def __enter__(self) -> Question:
        self._token = FRAME.set((self._tab, ()))
        return self.question

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._token is not None:
            FRAME.reset(self._token)
            self._token = None

    async def __aenter__(self) -> Question:
        return self.__enter__()

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(t, e, tb)


@contextmanager
def bind(q: Question | Tab, path: tuple[Hop, ...] | None = None) -> Iterator[Question]:
    """Bind an existing question (e.g. one ``extract`` returned) for the block."""
    tab = q if isinstance(q, Tab) else tab_from(q)
    hops = path if path is not None else (q.path if isinstance(q, Question) else ())
    token = FRAME.set((tab, hops))
    try:
        yield tab.snapshot(hops)
    finally:
        FRAME.reset(token)


@contextmanager
def fanout(label: str) -> Iterator[Question]:
    """Bind a child of the current question for one of several distinct calls made for it.

    The child's key is derived from the parent's and ``label`` (retrying the parent reproduces the
    same children), and it draws on the parent's budget. Without a bound question this binds nothing
    new.
    """
    frame = FRAME.get()
    if frame is None:
        raise LookupError("askonce.fanout() needs a bound question (askonce.question() or a "
                          "server middleware)")
    tab, path = frame
    child = tab.child(label)
    token = FRAME.set((child, path))
    try:
        yield child.snapshot(path)
    finally:
        FRAME.reset(token)


# --- headers ------------------------------------------------------------------------------------


class Duplicate:
    """What ``header_value`` returns for a header sent more than once (malformed as a whole)."""


DUPLICATE = Duplicate()


def header_value(headers: Any, name: str) -> str | bytes | Duplicate | None:
    """The one value of header ``name`` in any mapping the integrations see; ``DUPLICATE`` if
    it was sent more than once; ``None`` if absent."""
    getter = getattr(headers, "get_all", None) or getattr(headers, "get_list", None)
    # Multi-valued mappings (httpx, starlette, email.message): duplicates are malformed.
    if getter is not None:
        values = getter(name)
        if not values:
            return None
        if len(values) > 1:
            return DUPLICATE
        return values[0]  # type: ignore[no-any-return]
    value = headers.get(name)
    if value is None:
        # ASGI-style and gRPC-style mappings use bytes keys.
        value = headers.get(name.encode("ascii"))
    return value  # type: ignore[no-any-return]


_T = TypeVar("_T")


def _read(headers: Any, name: str, what: str,
          parse: Callable[[str | bytes], _T | Malformed]) -> _T | None:
    """The parsed value of header ``name``; ``None`` if absent, sent twice or malformed (the last
    two counted as ``malformed.<what>.<why>``)."""
    raw = header_value(headers, name)
    if raw is None:
        return None
    if isinstance(raw, Duplicate):
        count(f"malformed.{what}.duplicate-header")
        return None
    parsed = parse(raw)
    if isinstance(parsed, Malformed):
        count(f"malformed.{what}.{parsed.reason}")
        return None
    return parsed


def extract(
    headers: Mapping[str, str] | Any, *, limits: Limits = Limits(), now: float | None = None
) -> Question | None:
    """The question in ``headers`` (clamped to ``limits``), or ``None`` if absent or malformed.

    A malformed header is treated as absent and counted in ``askonce.stats()`` as
    ``malformed.question.<why>``; nothing raises.
    """
    return _read(headers, QUESTION_HEADER, "question", lambda raw: wire.parse_question(
        raw, _stats.monotonic() if now is None else now, limits))


def extract_reply(headers: Mapping[str, str] | Any) -> Reply | None:
    """The reply in response ``headers``, or ``None`` if absent or malformed (counted)."""
    return _read(headers, REPLY_HEADER, "reply", wire.parse_reply)


def question_header(frame: Frame, now: float, timeout: float | None = None,
                    budget: int | None = None, rejoin: bool = False) -> str:
    """The ``askonce-question`` value for an outgoing call made from ``frame``.

    ``timeout``: how long this caller will wait for the answer; the callee gets the tighter of it
    and the question's deadline, so it never works for a caller who has stopped listening.
    ``rejoin``: the attempt re-attaches to the run in flight (``wire.format_question``).
    """
    tab, path = frame
    remaining = None if tab.deadline is None else tab.deadline - now
    if timeout is not None:
        remaining = timeout if remaining is None else min(remaining, timeout)
    sent = tab.account.left if budget is None else budget
    return wire.format_question(tab.key, tab.origin, tab.edge, sent, remaining, path, tab.sig,
                                rejoin)


def inject(headers: MutableMapping[str, str], *, timeout: float | None = None,
           now: float | None = None) -> bool:
    """Write the bound question into ``headers``; returns False (and writes nothing) if none is
    bound.

    This only writes: the budget is not held in escrow. For a call whose reply you can read, prefer
    :class:`outgoing`, which holds what it forwards and settles it from the reply.
    """
    frame = FRAME.get()
    if frame is None:
        return False
    now = _stats.monotonic() if now is None else now
    headers[QUESTION_HEADER] = question_header(frame, now, timeout)
    return True


class outgoing:
    """One call to another process: forward the question, hold the budget sent, settle it from the
    reply.

    ::

        with askonce.outgoing(headers, timeout=2.0) as call:
            response = send(headers)
            call.answered(response.headers)      # reads askonce-reply; or call.answered(reply=...)

    Leaving the block without ``answered``: an exception marked ``askonce_reached = False`` (never
    sent) returns the held budget; any other exception counts as sent-and-lost (fail closed: the
    callee may have spent all it was forwarded); a clean exit counts as answered by a callee that
    said nothing. With no question bound, nothing is written and nothing held.
    """

    __slots__ = ("_frame", "_held", "_settled", "reply")

    def __init__(self, headers: MutableMapping[str, str], *, timeout: float | None = None,
                 now: float | None = None) -> None:
        self._frame = FRAME.get()
        self._held = 0
        self._settled = False
        self.reply: Reply | None = None
        if self._frame is not None:
            account = self._frame[0].account
            self._held = account.hold(account.left)
            try:
                headers[QUESTION_HEADER] = question_header(
                    self._frame, _stats.monotonic() if now is None else now, timeout, self._held)
            # Nothing was sent (a bad timeout, a key minter that failed): give it back.
            except BaseException:
                account.release(self._held)
                self._held = 0
                raise

    @property
    def held(self) -> int:
        return self._held

    def _settle(self, delivery: str, reply: Reply | None) -> None:
        if self._settled:
            return
        self._settled = True
        self.reply = reply
        if self._frame is not None:
            settle(self._frame[0].account, self._held, delivery, reply)

    def answered(self, headers: Any = None, *, reply: Reply | None = None) -> Reply | None:
        """A response came back; its headers (or a reply already parsed) settle the held budget."""
        if reply is None and headers is not None:
            reply = extract_reply(headers)
        self._settle(ANSWERED, reply)
        return reply

    def lost(self) -> None:
        """Sent, and no response: fail closed."""
        self._settle(LOST, None)

    def refused(self) -> None:
        """Provably never reached the callee."""
        self._settle(REFUSED, None)

    def __enter__(self) -> outgoing:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._settled:
            return
        if e is None:
            self._settle(ANSWERED, None)
        elif getattr(e, "askonce_reached", None) is False:
            self._settle(REFUSED, None)
        else:
            reply = reply_of(e)
            self._settle(LOST if reply is None else ANSWERED, reply)


class Serving:
    """The server side of one request: the bound question and the reply to send back.

    Made by :func:`serve`. ``question`` is ``None`` only when nothing arrived and minting is off.
    ``minted`` says whether this layer had to mint the key (nothing usable arrived).
    """

    __slots__ = ("minted", "tab")

    def __init__(self, tab: Tab, minted: bool) -> None:
        self.tab = tab
        self.minted = minted

    def reply(self, error: BaseException | None = None) -> Reply:
        """The reply for the caller: what is left of the budget, and do-not-retry if a give-up says
        so."""
        inner = None if error is None else reply_of(error)
        left = self.tab.account.left
        if inner is not None and inner.dnr:
            return Reply(min(left, inner.budget), True, inner.reason, inner.pushback)
        return Reply(left)

    def reply_header(self, error: BaseException | None = None) -> str:
        return wire.format_reply(self.reply(error))


@contextmanager
def serve(
    headers: Any,
    *,
    layer: str,
    originator: bool = False,
    budget: int = 2,
    deadline: float | None = 30.0,
    limits: Limits = Limits(),
    secret: bytes | str | None = None,
) -> Iterator[Serving]:
    """Bind the question that arrived in ``headers`` for the block, or mint one if none (or a bad
    one) came.

    A layer configured as an ``originator`` mints attributable edge keys (signed with ``secret`` if
    one is given); any other layer mints a local key (``edge=False``, origin ``layer``) that the
    target's ledger reads as re-minted by this layer.
    """
    now = _stats.monotonic()
    q = extract(headers, limits=limits, now=now)
    if q is not None:
        tab, path, minted = tab_from(q), q.path, False
    else:
        tab = minted_tab(layer, originator, budget, deadline, limits, now,
                         secret if originator else None)
        path, minted = (), True
    token = FRAME.set((tab, path))
    try:
        yield Serving(tab, minted)
    finally:
        FRAME.reset(token)
