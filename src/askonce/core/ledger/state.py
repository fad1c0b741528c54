"""The ledger's counting state: one operation in one window, and how it is summarised and merged.

Internal to the ledger and its Redis twin (:mod:`askonce.ledger._redis`), which rebuilds an
:class:`OperationState` from Redis counters to summarise it the same way. Not public API.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from askonce.core.ledger.report import HeavyKey, Kind, OperationReport, PerKey, ratio
from askonce.core.ledger.sketch import Frequent, HyperLogLog, key_digest, key_digests

if TYPE_CHECKING:
    from askonce.core.ledger.policy import LedgerPolicy

OTHER = "~other"
HLL_PRECISION = 14


def bump(counts: dict[str, int], name: str, limit: int, n: int = 1) -> None:
    if name in counts:
        counts[name] += n
    elif len(counts) < limit:
        counts[name] = n
    else:
        counts[OTHER] = counts.get(OTHER, 0) + n


class Seen:
    """A key that arrived more than once. A key seen once is stored as just its path digest
    (an int)."""

    __slots__ = ("n", "paths", "untracked")

    def __init__(self, n: int, paths: tuple[int, ...], untracked: int) -> None:
        self.n = n
        self.paths = paths
        self.untracked = untracked


Entry = int | Seen
Table = dict[str, dict[str, Entry]]  # principal -> key -> entry


def unpack(e: Entry) -> tuple[int, tuple[int, ...], int]:
    return (1, (e,), 0) if isinstance(e, int) else (e.n, e.paths, e.untracked)


def combine(a: Entry, b: Entry, max_paths: int) -> Seen:
    na, pa, ua = unpack(a)
    nb, pb, ub = unpack(b)
    paths = list(pa)
    untracked = ua + ub
    for p in pb:
        if p not in paths:
            if len(paths) < max_paths:
                paths.append(p)
            else:
                untracked += 1
    return Seen(na + nb, tuple(paths), untracked)


class OperationState:
    """The counters of one operation in one window."""

    __slots__ = (
        "_heavy", "_hll", "arrivals", "attr", "attributable", "cap_unenforced", "exact", "joined",
        "malformed", "overflowed", "pending", "refused", "remint", "reminted", "reminted_by",
        "retries_by", "unkeyed",
    )  # fmt: skip

    def __init__(self) -> None:
        self.arrivals = 0
        self.attributable = 0
        self.reminted = 0
        self.unkeyed = 0
        self.malformed = 0
        self.refused = 0
        self.cap_unenforced = 0
        self.joined = 0  # attributable arrivals answered by work they did not start (joins)
        self.exact = 0  # entries in attr and remint together, against max_exact_keys
        self.overflowed = False
        self.attr: Table = {}
        self.remint: Table = {}
        self.reminted_by: dict[str, int] = {}
        self.retries_by: dict[str, int] = {}
        self._hll: HyperLogLog | None = None
        self._heavy: Frequent[tuple[str, str]] | None = None
        # Attributable arrivals past the exact bound not yet in the sketches, in order: the sketches
        # take them a batch at a time (reading hll or heavy takes them first).
        self.pending: list[tuple[str, str]] | None = None

    @property
    def hll(self) -> HyperLogLog | None:
        if self.pending:
            self.flush()
        return self._hll

    @hll.setter
    def hll(self, value: HyperLogLog | None) -> None:
        self._hll = value

    @property
    def heavy(self) -> Frequent[tuple[str, str]] | None:
        if self.pending:
            self.flush()
        return self._heavy

    @heavy.setter
    def heavy(self, value: Frequent[tuple[str, str]] | None) -> None:
        self._heavy = value

    def sketch(self, heavy_k: int) -> list[tuple[str, str]]:
        """The pending list, with the sketches made if there are none yet."""
        self.overflowed = True
        if self._hll is None or self._heavy is None:
            self._hll = HyperLogLog(HLL_PRECISION)
            self._heavy = Frequent(heavy_k)
        pending = self.pending = []
        return pending

    def flush(self) -> None:
        """Feed the pending arrivals to the sketches."""
        items = self.pending
        if not items:
            return
        self.pending = []
        hll, heavy = self._hll, self._heavy
        assert hll is not None and heavy is not None
        # A register keeps its maximum: once per key. dict.fromkeys, not set: the distinct keys in
        # arrival order, as they lie in memory (a set's order scatters the reads).
        hll.add_hashes(key_digests(dict.fromkeys(items)))
        heavy.add_each(items)

    def spill_each(self, items: list[tuple[str, str]], heavy_k: int) -> None:
        """One attributable arrival past the exact bound for each ``(principal, key)``, in
        order."""
        if self.pending is None:
            self.sketch(heavy_k)
        self.flush()
        hll, heavy = self._hll, self._heavy
        assert hll is not None and heavy is not None
        hll.add_hashes(key_digests(dict.fromkeys(items)))
        heavy.add_each(items)

    def spill(self, edge: bool, principal: str, key: str, n: int, heavy_k: int) -> None:
        self.overflowed = True
        if not edge:
            return  # reminted keys have no distinct count or heavy list to feed
        self.flush()
        if self._hll is None or self._heavy is None:
            self._hll = HyperLogLog(HLL_PRECISION)
            self._heavy = Frequent(heavy_k)
        self._hll.add_hash(key_digest(principal, key))
        self._heavy.add((principal, key), n)

    def absorb(self, other: OperationState, policy: LedgerPolicy, heavy_k: int) -> None:
        for name in ("arrivals", "attributable", "reminted", "unkeyed", "malformed", "refused",
                     "cap_unenforced", "joined"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.overflowed = self.overflowed or other.overflowed
        for mine, theirs in ((self.reminted_by, other.reminted_by),
                             (self.retries_by, other.retries_by)):
            for name, n in theirs.items():
                bump(mine, name, policy.max_names, n)
        for edge, table, source in ((True, self.attr, other.attr),
                                    (False, self.remint, other.remint)):
            for principal, keys in source.items():
                for key, entry in keys.items():
                    mine_keys = table.get(principal)
                    have = None if mine_keys is None else mine_keys.get(key)
                    if have is not None:
                        assert mine_keys is not None
                        mine_keys[key] = combine(have, entry, policy.max_paths_per_key)
                    elif self.exact < policy.max_exact_keys:
                        table.setdefault(principal, {})[key] = (
                            entry if isinstance(entry, int)
                            else Seen(entry.n, entry.paths, entry.untracked)
                        )
                        self.exact += 1
                    else:
                        self.spill(edge, principal, key, unpack(entry)[0], heavy_k)
        if other.hll is not None and other.heavy is not None:
            if self.hll is None or self.heavy is None:
                self.hll, self.heavy = other.hll.copy(), other.heavy.copy()
            else:
                self.hll.merge(other.hll)
                self.heavy.merge(other.heavy)


class Window:
    __slots__ = ("index", "ops", "summary")

    def __init__(self, index: int) -> None:
        self.index = index
        self.ops: dict[str, OperationState] = {}
        self.summary: tuple[OperationReport, ...] | None = None  # cached once the window is closed


def summarize(op: OperationState, name: str, start: float, end: float, current: bool,
              heavy_n: int) -> OperationReport:
    counts: list[int] = []
    heavy_exact: list[tuple[int, str, str]] = []
    for principal, keys in op.attr.items():
        for key, e in keys.items():
            n = 1 if isinstance(e, int) else e.n
            counts.append(n)
            if n > 1:
                heavy_exact.append((-n, principal, key))
    undeclared = untracked = 0
    for table in (op.attr, op.remint):
        for keys in table.values():
            for e in keys.values():
                if not isinstance(e, int):
                    undeclared += e.n - len(e.paths) - e.untracked
                    untracked += e.untracked
    heavy: dict[tuple[str, str], int] = {(p, k): -neg
                                         for neg, p, k in heapq.nsmallest(heavy_n, heavy_exact)}
    distinct = len(counts)
    error = 0
    sketched: dict[tuple[str, str], int] = {}
    if op.hll is not None and op.heavy is not None:
        distinct += round(op.hll.estimate())
        error = op.heavy.offset
        sketched = op.heavy.counts
        for item, n in sketched.items():
            heavy[item] = heavy.get(item, 0) + n
    ranked = sorted(((-n, p, k) for (p, k), n in heavy.items() if n > 1))[:heavy_n]
    counts.sort()
    top = max(counts[-1] if counts else 0, -ranked[0][0] if ranked else 0)
    amplification = ratio(op.attributable, distinct)
    # Never more joins than arrivals in a window. (An arrival recorded out of order, two threads
    # at a window's end, may have its join counted in the window beside its own: not corrected.)
    joined = min(op.joined, op.attributable)
    per_key = PerKey(
        mean=amplification,
        p50=counts[math.ceil(0.5 * len(counts)) - 1] if counts else None,
        p99=counts[math.ceil(0.99 * len(counts)) - 1] if counts else None,
        max=top or None,
    )
    return OperationReport(
        operation=name, start=start, end=end, current=current, arrivals=op.arrivals,
        attributable=op.attributable, distinct_keys=distinct, amplification=amplification,
        joined=joined, work_per_question=ratio(op.attributable - joined, distinct),
        coverage=ratio(op.attributable, op.arrivals),
        kinds={Kind.ATTRIBUTABLE: op.attributable, Kind.REMINTED: op.reminted,
               Kind.UNKEYED: op.unkeyed, Kind.MALFORMED: op.malformed},
        per_key=per_key,
        heavy=tuple(HeavyKey(k, -neg, p, error if (p, k) in sketched else 0)
                    for neg, p, k in ranked),
        reminted_by=dict(op.reminted_by), retries_by=dict(op.retries_by),
        undeclared_retries=undeclared, paths_untracked=untracked, refused=op.refused,
        cap_unenforced=op.cap_unenforced, approximate=op.overflowed,
    )  # fmt: skip
