"""The question: one user request's identity, its traveling retry budget and its deadline.

Three objects, from the outside in:

* :class:`Question` is the immutable *value* a user sees (``askonce.current()``) and the wire
  carries: key, who minted it, whether that was a declared originator ("edge"), the remaining
  budget, the deadline and the attempt path. Snapshots are cheap to reason about and safe to hand
  around.
* :class:`Tab` is the per-process *account* of one question: the part that must be shared, not
  copied. A retry anywhere in the process spends from the same tab, so sibling calls of the same
  question see the lowered budget at once. The budget only ever goes down (``spend`` and
  ``lower_to``).
* A frame, ``(tab, path)``, is what the context variable binds: the tab plus the attempt path of the
  code that runs now. Frames are plain tuples because one is made for every attempt on the hot path.

Key minting and fan-out derivation are pure functions of their inputs (time and random bytes are
passed in), so the simulator can mint reproducible keys and a retry of the parent reproduces the
same child keys.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from askonce.core.record import Record

# Crockford's base32: sortable in ASCII order, no ambiguous letters, URL-safe.
_B32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_TIME_CHARS = 10  # 50 bits of millisecond time: good until the year 37648
_RAND_CHARS = 26  # 130 bits of room for 128 random bits
KEY_LENGTH = _TIME_CHARS + _RAND_CHARS

# One lock for every tab's budget. Spending happens only when a retry is about to happen, which is
# rare and brief, so one shared lock costs less than a lock per question on the hot path.
_SPEND_LOCK = threading.Lock()


def _b32(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        out.append(_B32[value & 31])
        value >>= 5
    return "".join(reversed(out))


# Two base32 characters per 10 bits: a key's 180 bits (50 of time, 2 zero bits, 128 random) in
# 18 steps.
_PAIRS = tuple(a + b for a in _B32 for b in _B32)
_TIME_MASK = (1 << 5 * _TIME_CHARS) - 1
_WORD = (1 << 60) - 1


def mint_key(now_ms: int, random16: bytes) -> str:
    """A new question key: 48+ bits of time (so keys sort by minting time) then 128 random bits.

    >>> mint_key(0, bytes(16))
    '000000000000000000000000000000000000'
    """
    if len(random16) != 16:
        raise ValueError("mint_key needs exactly 16 random bytes")
    # _b32(max(0, now_ms), _TIME_CHARS) + _b32(random, _RAND_CHARS), in one pass
    # (tests/core/test_wire_caches.py): the key's 180 bits as three 60-bit words (shifts of small
    # ints, not of the whole), six pairs of characters each, written out as one string.
    rand = int.from_bytes(random16, "big")
    a = (max(0, now_ms) & _TIME_MASK) << 10 | rand >> 120
    b, c = rand >> 60 & _WORD, rand & _WORD
    p = _PAIRS
    return (f"{p[a >> 50]}{p[a >> 40 & 1023]}{p[a >> 30 & 1023]}{p[a >> 20 & 1023]}"
            f"{p[a >> 10 & 1023]}{p[a & 1023]}{p[b >> 50]}{p[b >> 40 & 1023]}"
            f"{p[b >> 30 & 1023]}{p[b >> 20 & 1023]}{p[b >> 10 & 1023]}{p[b & 1023]}"
            f"{p[c >> 50]}{p[c >> 40 & 1023]}{p[c >> 30 & 1023]}{p[c >> 20 & 1023]}"
            f"{p[c >> 10 & 1023]}{p[c & 1023]}")


def derive_key(parent: str, label: str) -> str:
    """The key of a fan-out child: a pure function of the parent key and a stable label.

    The child keeps the parent's time prefix (so it sorts with its parent) and replaces the random
    part with a keyed hash, so retrying the parent reproduces exactly the same children.
    """
    from hashlib import blake2b  # hashlib is slow to import; only fan-out needs it

    digest = blake2b(label.encode("utf-8"), digest_size=16,
                     key=parent.encode("ascii")[:64]).digest()
    return parent[:_TIME_CHARS] + _b32(int.from_bytes(digest, "big"), _RAND_CHARS)


class Hop(NamedTuple):
    """One step of the attempt path: which layer made the call and which attempt of its own it
    was."""

    layer: str
    attempt: int

    def __str__(self) -> str:
        return f"{self.layer}:{self.attempt}"


class Question(Record):
    """An immutable snapshot of a question's identity and account.

    ``deadline`` is an absolute time on the reading process's monotonic clock (``None``: no
    deadline); on the wire it travels as remaining milliseconds, so clocks of different hosts never
    meet.
    """

    __slots__ = __match_args__ = ("key", "origin", "edge", "budget", "deadline", "path", "sig")
    key: str
    origin: str
    edge: bool
    budget: int
    deadline: float | None
    path: tuple[Hop, ...]
    # An originator's HMAC of the key (askonce.core.signing), forwarded unchanged.
    sig: bytes | None

    def __init__(self, key: str, origin: str, edge: bool, budget: int,
                 deadline: float | None = None, path: tuple[Hop, ...] = (),
                 sig: bytes | None = None) -> None:
        _set = object.__setattr__
        _set(self, "key", key)
        _set(self, "origin", origin)
        _set(self, "edge", edge)
        _set(self, "budget", budget)
        _set(self, "deadline", deadline)
        _set(self, "path", path)
        _set(self, "sig", sig)

    def remaining(self, now: float) -> float | None:
        """Seconds left until the deadline at ``now`` (never negative), or ``None`` without a
        deadline."""
        return None if self.deadline is None else max(0.0, self.deadline - now)


class Account:
    """The budget of one question in one process; shared by every tab of the question (fan-out too).

    ``spend`` takes a retry from it; ``hold``/``release`` put what is forwarded to another process
    in escrow until its reply says what is left (so ``left`` plus what is held never goes up);
    ``lower_to`` follows a reply. All of it is atomic across threads.
    """

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    # The lock's acquire and release are called directly, in try/finally: cheaper than its context
    # manager.

    def spend(self, n: int = 1) -> bool:
        _SPEND_LOCK.acquire()
        try:
            if self.left >= n:
                self.left -= n
                return True
            return False
        finally:
            _SPEND_LOCK.release()

    def lower_to(self, n: int) -> None:
        _SPEND_LOCK.acquire()
        try:
            if n < self.left:
                self.left = max(0, n)
        finally:
            _SPEND_LOCK.release()

    def hold(self, n: int) -> int:
        """Put up to ``n`` in escrow for a call to another process; returns what was held.

        Concurrent calls of one question must not each be forwarded the whole budget (two callees
        would each spend it): what is forwarded is held until the reply says what came back.
        """
        _SPEND_LOCK.acquire()
        try:
            left = self.left
            held = n if 0 <= n <= left else max(0, min(n, left))
            self.left = left - held
            return held
        finally:
            _SPEND_LOCK.release()

    def release(self, n: int) -> None:
        """Return what a callee did not spend of what was held for it."""
        if n > 0:
            _SPEND_LOCK.acquire()
            try:
                self.left += n
            finally:
                _SPEND_LOCK.release()


class Tab:
    """One question's identity and account inside one process.

    The key may be minted lazily (``minter``) so that a layer which binds a question only to share
    its budget with inner layers pays for minting only if a key is ever needed (a header, a log
    line).
    """

    __slots__ = ("_key", "_minter", "account", "deadline", "edge", "origin", "sig")

    def __init__(
        self,
        key: str | None,
        origin: str,
        edge: bool,
        account: Account,
        deadline: float | None,
        minter: Callable[[], str] | None = None,
        sig: bytes | None = None,
    ) -> None:
        self._key = key  # None: minted on first use by ``minter``
        self.sig = sig
        self._minter = minter
        self.origin = origin
        self.edge = edge
        self.account = account
        self.deadline = deadline

    @property
    def key(self) -> str:
        key = self._key
        if key is None:
            if self._minter is None:
                raise ValueError("a Tab made without a key needs a minter")
            key = self._key = self._minter()
        return key

    @property
    def left(self) -> int:
        return self.account.left

    @property
    def minted_here(self) -> bool:
        """Whether this process minted the key (nothing usable arrived): no one else knows it."""
        return self._minter is not None

    def child(self, label: str) -> Tab:
        """A fan-out child: a key derived from this one and ``label``, drawing on the same account.

        The child carries no signature: only a holder of the originators' secret could sign its key.
        """
        return Tab(derive_key(self.key, label), self.origin, self.edge, self.account, self.deadline)

    def snapshot(self, path: tuple[Hop, ...]) -> Question:
        return Question(self.key, self.origin, self.edge, self.account.left, self.deadline, path,
                        self.sig)


Frame = tuple[Tab, tuple[Hop, ...]]
"""What the context variable binds: the question's tab and the attempt path of the running code."""
