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
from collections import OrderedDict
from dataclasses import dataclass

from askonce.core import is_int, is_real

__all__ = ["Answer", "Entry", "JoinPolicy", "Joins", "Verdict"]

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
        keep = (answer.status < 500 and len(answer.body) <= self.policy.max_body
                and self.policy.ttl > 0)
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

    def _expire(self, now: float) -> None:
        finished = self._finished
        while finished:
            scope, entry = next(iter(finished.items()))
            if entry.expires > now:
                return
            finished.popitem(last=False)
            del self._entries[scope]
