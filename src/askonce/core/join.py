"""Answer once: a repeated arrival of the same question joins the work in flight, or is replayed.

A callee that sees the same question again (the same principal, operation and key: the key is
the originator's, forwarded unchanged, so it is exactly an idempotency key) need not run the
handler again. :class:`Joins` decides each arrival, sans-IO (time is an input):

* ``RUN``: nothing is known about this question: run the handler, then :meth:`Joins.finish`
  (or :meth:`Joins.abandon` if it produced no answer);
* ``WAIT``: the first arrival is still running: wait for its answer (the shell's business:
  the entry's ``signal`` slot is the shell's to use), then take ``entry.answer``;
* ``REPLAY``: it finished within ``ttl`` and its answer was kept: send that answer again;
* ``CONFLICT``: the same key came with a different request body: refuse it (422), as the
  IETF Idempotency-Key draft does;
* ``BYPASS``: the table is full of questions in flight: run without joining (counted by the shell).

Only answers that are not server errors are kept for replay: a retry of a failed question must
really be tried again, while those who joined the failed run get its failure (they asked for that
run's answer). An answer larger than ``max_body`` is not kept (a shell that could not buffer it
abandons the run instead, and its waiters arrive again). Bounded:
at most ``max_entries`` questions, finished ones evicted first (oldest first), and a question in
flight is never evicted, so a flood of distinct keys costs ``BYPASS``, never a lost answer.
"""

from __future__ import annotations

import enum
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass

from askonce.core import is_int, is_real

__all__ = ["Answer", "Entry", "JoinPolicy", "Joins", "Preference", "Verdict", "decode_answer",
           "encode_answer", "keeps", "parse_prefer"]

Scope = tuple[str, str, str]  # (principal, operation, key)


@dataclass(frozen=True, slots=True)
class JoinPolicy:
    ttl: float = 60.0  # seconds a finished answer is kept for replay
    max_entries: int = 10_000  # questions remembered at once, in flight and finished
    max_body: int = 1 << 20  # bytes of one answer's body kept for replay

    def __post_init__(self) -> None:
        if not is_real(self.ttl) or not 0 <= self.ttl <= 86_400:
            raise ValueError(f"join ttl must be seconds within 0..86400, got {self.ttl!r}")
        if not is_int(self.max_entries) or not 1 <= self.max_entries <= 10_000_000:
            raise ValueError(f"join max_entries must be an int within 1..10000000, "
                             f"got {self.max_entries!r}")
        if not is_int(self.max_body) or not 0 <= self.max_body <= 1 << 30:
            raise ValueError(f"join max_body must be an int within 0..1 GiB, got {self.max_body!r}")


@dataclass(frozen=True, slots=True)
class Answer:
    """A finished handler's response, as the shell captured it."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


class Verdict(enum.Enum):
    RUN = "run"
    WAIT = "wait"
    REPLAY = "replay"
    CONFLICT = "conflict"
    BYPASS = "bypass"


class Entry:
    """One question's state: in flight (``answer`` is ``None`` until done) or finished."""

    __slots__ = ("answer", "digest", "done", "expires", "signal", "waiters")

    def __init__(self, digest: bytes) -> None:
        self.digest = digest
        self.done = False
        self.answer: Answer | None = None
        self.expires = math.inf
        self.waiters = 0
        self.signal: object = None  # the shell's: an event the waiters wait on


class Joins:
    """The questions one callee is answering or has answered. Not thread-safe: shells lock."""

    __slots__ = ("_entries", "_finished", "policy")

    def __init__(self, policy: JoinPolicy = JoinPolicy()) -> None:
        self.policy = policy
        self._entries: dict[Scope, Entry] = {}
        self._finished: OrderedDict[Scope, Entry] = OrderedDict()  # oldest finish first

    def __len__(self) -> int:
        return len(self._entries)

    def arrive(self, scope: Scope, digest: bytes, now: float) -> tuple[Verdict, Entry | None]:
        """Decide an arrival of ``scope`` whose request body digests to ``digest``."""
        self._expire(now)
        entry = self._entries.get(scope)
        if entry is not None:
            if entry.digest != digest:
                return Verdict.CONFLICT, entry
            if not entry.done:
                entry.waiters += 1
                return Verdict.WAIT, entry
            return Verdict.REPLAY, entry  # kept: _expire dropped the stale ones
        if len(self._entries) >= self.policy.max_entries:
            if not self._finished:
                return Verdict.BYPASS, None
            old, _ = self._finished.popitem(last=False)
            del self._entries[old]
        entry = self._entries[scope] = Entry(digest)
        return Verdict.RUN, entry

    def finish(self, scope: Scope, entry: Entry, answer: Answer, now: float) -> None:
        """The run of ``entry`` answered: hand ``answer`` to its waiters; keep it if it may be
        replayed (not a server error, small enough, a ttl above zero)."""
        entry.done, entry.answer = True, answer
        keep = keeps(self.policy, answer)
        if self._entries.get(scope) is not entry:
            return
        if keep:
            entry.expires = now + self.policy.ttl
            self._finished[scope] = entry
        else:
            del self._entries[scope]

    def abandon(self, scope: Scope, entry: Entry) -> None:
        """The run of ``entry`` ended without an answer (it raised, it was cancelled): forget it;
        its waiters find ``entry.done`` with no answer and arrive again."""
        entry.done = True
        if self._entries.get(scope) is entry:
            del self._entries[scope]

    def peek(self, scope: Scope, now: float) -> Entry | None:
        """The entry of ``scope`` (in flight, or finished and kept), without arriving."""
        self._expire(now)
        return self._entries.get(scope)

    def _expire(self, now: float) -> None:
        finished = self._finished
        while finished:
            scope, entry = next(iter(finished.items()))
            if entry.expires > now:
                return
            finished.popitem(last=False)
            del self._entries[scope]


def keeps(policy: JoinPolicy, answer: Answer) -> bool:
    """Whether ``answer`` is kept for replay: not a server error, small enough, a ttl above 0."""
    return answer.status < 500 and len(answer.body) <= policy.max_body and policy.ttl > 0


# An answer stored outside the process (a shared store): status, header count, then each header
# as two lengths and its bytes, then the body. Bounded and strictly parsed on the way back.
_HEAD = struct.Struct(">HH")
MAX_HEADERS = 100


def encode_answer(answer: Answer) -> bytes:
    """``answer`` as bytes for a shared store (headers past ``MAX_HEADERS`` or 64 kB are cut)."""
    headers = [(k[:65535], v[:65535]) for k, v in answer.headers[:MAX_HEADERS]]
    parts = [_HEAD.pack(answer.status, len(headers))]
    for k, v in headers:
        parts += [_HEAD.pack(len(k), len(v)), k, v]
    parts.append(answer.body)
    return b"".join(parts)


def decode_answer(raw: bytes, max_body: int) -> Answer | None:
    """The answer ``encode_answer`` wrote, or ``None`` if ``raw`` is not one (or its body is
    larger than ``max_body``)."""
    try:
        status, n = _HEAD.unpack_from(raw, 0)
        at, headers = _HEAD.size, []
        if not 100 <= status <= 999 or n > MAX_HEADERS:
            return None
        for _ in range(n):
            kl, vl = _HEAD.unpack_from(raw, at)
            at += _HEAD.size
            k, v = raw[at:at + kl], raw[at + kl:at + kl + vl]
            if len(k) != kl or len(v) != vl:
                return None
            headers.append((k, v))
            at += kl + vl
    except struct.error:
        return None
    body = raw[at:]
    return Answer(status, tuple(headers), body) if len(body) <= max_body else None


@dataclass(frozen=True, slots=True)
class Preference:
    """What a ``Prefer`` header (RFC 7240) asks of a joining server."""

    respond_async: bool = False
    wait: float | None = None  # seconds the caller is willing to wait (``wait=N``)


def parse_prefer(values: list[str], max_wait: float) -> Preference:
    """``respond-async`` and ``wait=N`` (capped to ``max_wait``) from the ``Prefer`` header lines;
    anything else, or a malformed ``wait``, is ignored (a preference may always be ignored)."""
    respond_async, wait = False, None
    for value in values[:16]:
        for item in value[:1024].split(","):
            name, _, arg = item.strip().partition("=")
            name = name.strip().lower()
            if name == "respond-async":
                respond_async = True
            elif name == "wait":
                arg = arg.strip().strip('"')
                if arg.isascii() and arg.isdigit() and len(arg) <= 6:  # not '²': not a digit
                    wait = min(float(arg), max_wait)
    return Preference(respond_async, wait)
