"""Bounded-memory summaries the ledger falls back to once its exact per-key table is full.

Two classic structures, both mergeable so that two target replicas can be combined:

* :class:`HyperLogLog` estimates how many distinct keys were seen. With ``p = 14`` it keeps 16 KiB
  of registers and has a standard error of ``1.04 / sqrt(2**14)``, about 0.8 %.
* :class:`Frequent` is the Misra-Gries "frequent items" summary: ``k`` counters, each a *lower
  bound* on an item's true count, off by at most ``offset`` (which is at most ``n / (k + 1)`` for
  ``n`` items). Any item seen more than ``n / (k + 1)`` times is guaranteed to be held. Lower bounds
  are reported, so a key is never said to be heavier than it was.

Hashes come from :func:`hashlib.blake2b` with 8-byte digests, never from the builtin ``hash`` of a
``str`` (salted per process), so that registers built by different processes can be merged.
"""

from __future__ import annotations

import array
import hashlib
import math
import sys
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

_MASK64 = (1 << 64) - 1


# person -> a keyed-up blake2b; copying it beats constructing one
_PROTOTYPES: dict[bytes, hashlib.blake2b] = {}


def digest64(*parts: str, person: bytes = b"askonce") -> int:
    """A 64-bit hash of ``parts`` that is the same in every process and every run.

    Each part is length-prefixed, so ``("ab", "c")`` and ``("a", "bc")`` hash differently.
    """
    prototype = _PROTOTYPES.get(person)
    if prototype is None:
        prototype = _PROTOTYPES.setdefault(person, hashlib.blake2b(digest_size=8, person=person))
    h = prototype.copy()
    for part in parts:
        raw = part.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(4, "big") + raw)
    return int.from_bytes(h.digest(), "big")


# principal -> blake2b already fed the principal's part, for key_digest (bounded: starts over)
_PRINCIPALS: dict[str, hashlib.blake2b] = {}
_MAX_PRINCIPALS = 1024
_LENGTHS = [n.to_bytes(4, "big") for n in range(256)]
_WORDS_OK = array.array("Q").itemsize == 8  # digests read as machine words, 8 at a time


def key_digest(principal: str, key: str) -> int:
    """``digest64(principal, key)``, the hash the ledger's sketches take, with the principal's part
    hashed once per principal."""
    h = _PRINCIPALS.get(principal)
    if h is None:
        h = _principal_prefix(principal)
    h = h.copy()
    raw = key.encode("utf-8", "surrogatepass")
    n = len(raw)
    h.update((_LENGTHS[n] if n < 256 else n.to_bytes(4, "big")) + raw)
    return int.from_bytes(h.digest(), "big")


def key_digests(pairs: Iterable[tuple[str, str]]) -> Sequence[int]:
    """``key_digest`` of each ``(principal, key)``, in order."""
    chunks: list[bytes] = []
    append = chunks.append
    prefixes = _PRINCIPALS
    lengths = _LENGTHS
    for principal, key in pairs:
        h = prefixes.get(principal)
        if h is None:
            h = _principal_prefix(principal)
        h = h.copy()
        raw = key.encode("utf-8", "surrogatepass")
        n = len(raw)
        h.update((lengths[n] if n < 256 else n.to_bytes(4, "big")) + raw)
        append(h.digest())
    if _WORDS_OK:
        words = array.array("Q", b"".join(chunks))
        if sys.byteorder == "little":
            words.byteswap()
        return words
    return [int.from_bytes(d, "big") for d in chunks]


def _principal_prefix(principal: str) -> hashlib.blake2b:
    prototype = _PROTOTYPES.get(b"askonce")
    if prototype is None:
        prototype = _PROTOTYPES.setdefault(b"askonce", hashlib.blake2b(digest_size=8,
                                                                       person=b"askonce"))
    h = prototype.copy()
    raw = principal.encode("utf-8", "surrogatepass")
    h.update(len(raw).to_bytes(4, "big") + raw)
    if len(_PRINCIPALS) >= _MAX_PRINCIPALS:
        _PRINCIPALS.clear()
    _PRINCIPALS[principal] = h
    return h


class HyperLogLog:
    """Distinct-count estimate over 64-bit hashes (Flajolet et al. 2007, with linear counting
    below)."""

    __slots__ = ("_mask", "_registers", "_shift", "p")

    def __init__(self, p: int = 14) -> None:
        if not 4 <= p <= 18:
            raise ValueError(f"HyperLogLog precision p must be within 4..18, got {p!r}")
        self.p = p
        self._registers = bytearray(1 << p)
        self._shift = 64 - p
        self._mask = (1 << (64 - p)) - 1

    def add_hash(self, h: int) -> None:
        shift = self._shift
        # The rank is the position of the leftmost 1 in the remaining 64 - p bits
        # (all zero: 64 - p + 1).
        rank = shift + 1 - (h & self._mask).bit_length()
        registers = self._registers
        index = h >> shift
        if rank > registers[index]:
            registers[index] = rank

    def add_hashes(self, hashes: Iterable[int]) -> None:
        shift = self._shift
        top = shift + 1
        mask = self._mask
        registers = self._registers
        for h in hashes:
            rank = top - (h & mask).bit_length()
            index = h >> shift
            if rank > registers[index]:
                registers[index] = rank

    def merge(self, other: HyperLogLog) -> None:
        if other.p != self.p:
            raise ValueError(f"cannot merge HyperLogLog of precision {other.p} into {self.p}")
        mine = self._registers
        for i, r in enumerate(other._registers):
            if r > mine[i]:
                mine[i] = r

    def copy(self) -> HyperLogLog:
        twin = HyperLogLog(self.p)
        twin._registers[:] = self._registers
        return twin

    def estimate(self) -> float:
        m = len(self._registers)
        regs = bytes(self._registers)
        # A histogram of register values is computed in C by bytes.count; summing 2**-r per register
        # in Python would cost a loop of m iterations.
        total = 0.0
        zeros = 0
        for r in range(0, 64 - self.p + 2):
            c = regs.count(r)
            if c:
                total += c * 2.0**-r
                if r == 0:
                    zeros = c
        alpha = 0.7213 / (1.0 + 1.079 / m)
        raw = alpha * m * m / total
        if raw <= 2.5 * m and zeros:
            return m * math.log(m / zeros)
        # With 64-bit hashes hash collisions stay negligible far beyond any count a ledger sees, so
        # the large-range correction of the 32-bit paper is not needed.
        return raw

    def is_empty(self) -> bool:
        return not any(self._registers)


class Frequent(Generic[T]):
    """Misra-Gries heavy hitters: at most ``k`` counters, each a lower bound on its item's count."""

    __slots__ = ("counts", "k", "offset")

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"Frequent needs at least one counter, got k={k!r}")
        self.k = k
        self.counts: dict[T, int] = {}
        # Total amount subtracted from every count: the largest possible underestimate.
        self.offset = 0

    def add(self, item: T, count: int = 1) -> None:
        counts = self.counts
        have = counts.get(item)
        if have is not None:
            counts[item] = have + count
            return
        if len(counts) < self.k:
            counts[item] = count
            return
        # Full: take the same amount off every counter and off the newcomer. Each such pass
        # removes at least k + 1 units and only n units ever arrive, so the passes cost O(1)
        # amortised per item.
        cut = min(count, min(counts.values()))
        self.offset += cut
        for key in [key for key, c in counts.items() if c <= cut]:
            del counts[key]
        for key in counts:
            counts[key] -= cut
        if count > cut:
            counts[item] = count - cut

    def add_each(self, items: Iterable[T]) -> None:
        """``add(item)`` for each item, in order."""
        counts = self.counts
        get = counts.get
        k = self.k
        for item in items:
            have = get(item)
            if have is not None:
                counts[item] = have + 1
            elif len(counts) < k:
                counts[item] = 1
            else:
                self.add(item)

    def merge(self, other: Frequent[T]) -> None:
        """Combine two summaries (Agarwal et al. 2012): sum, then cut back to ``k`` counters."""
        self._absorb(other.counts.items(), other.offset)

    def _absorb(self, items: Iterable[tuple[T, int]], offset: int) -> None:
        counts = self.counts
        for item, c in items:
            counts[item] = counts.get(item, 0) + c
        self.offset += offset
        if len(counts) > self.k:
            cut = sorted(counts.values(), reverse=True)[self.k]
            self.offset += cut
            for key in [key for key, c in counts.items() if c <= cut]:
                del counts[key]
            for key in counts:
                counts[key] -= cut

    def copy(self) -> Frequent[T]:
        twin: Frequent[T] = Frequent(self.k)
        twin.counts = dict(self.counts)
        twin.offset = self.offset
        return twin

    def top(self, n: int) -> list[tuple[T, int]]:
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]
