"""The target's ledger: counts arrivals per question and tells how much each question was amplified.

The model
---------
A *question* is one user request, minted once with a unique key by its originator. Every layer forwards
the key on every attempt, together with the *attempt path*: the hops ``(layer, attempt)`` it went
through. Only the target sees every arrival, so only the target can count the true amplification.

Each arrival is one of four kinds (:class:`Kind`):

* ``ATTRIBUTABLE`` - it carries the key minted at the edge, so it can be tied to its question;
* ``REMINTED`` - it carries a key that a middle layer (``origin``) minted because it received none or
  dropped the one it had; retries above that layer are invisible, so the report names the layer;
* ``UNKEYED`` - no key at all;
* ``MALFORMED`` - the shell could not parse what it was sent.

A question is identified by ``(principal, key)``: keys are scoped per principal (tenant) so one tenant
cannot have another tenant's question refused by sending its key. The per-key figures (distinct keys,
the arrivals-per-key distribution, heavy keys, undeclared retries, the cap) cover keyed arrivals;
distinct keys and the distribution count only attributable ones.

Figures, per operation and window:

* ``amplification`` = attributable arrivals / distinct attributable keys (also the mean of the
  per-key distribution); ``coverage`` = attributable arrivals / all arrivals.
* ``retries_by[L]`` - arrivals whose path says layer ``L`` retried: the *last* hop of ``L`` in the path
  has attempt > 1. Each layer counts at most once per arrival, so ``(("gw", 2), ("api", 3))`` is one
  retry by ``gw`` and one by ``api``, and ``(("gw", 2), ("gw", 1))`` none by ``gw`` (its last call was a
  first attempt: the earlier hop was an upstream instance of ``gw``).
* ``undeclared_retries`` - two arrivals with the same key *and the same path* mean that something
  between the last hop and the target retried without saying so. Counted as arrivals minus distinct
  ``(key, path)`` pairs, over exact keys, tracking at most ``max_paths_per_key`` paths per key; arrivals
  with a further new path are counted in ``paths_untracked`` and never as undeclared, so the figure can
  be too low but never too high, and no layer is named for it.

Time and memory
---------------
``now`` is an input (seconds); window ``i`` covers ``[i * window, (i + 1) * window)``. An arrival whose
``now`` is before the current window (a slightly late clock) is counted in the current window. The
current window and the closed windows at most ``windows_kept`` windows older are kept.

Per operation and window at most ``max_exact_keys`` keys are counted exactly; later new keys go to a
HyperLogLog (distinct count) and a Misra-Gries summary (heavy keys), see :mod:`askonce.core.sketch`,
and the report says ``approximate=True``. Then ``p50``/``p99`` cover the exact keys only, and a heavy
key found by the sketch is reported as a lower bound with its ``error``. Keys in the sketch are not
capped (``cap_unenforced`` counts their arrivals): refusing on an estimate would refuse innocent keys.
Heavy keys are listed only when seen more than once.

Memory is bounded by ``(windows_kept + 1) * (max_operations + 1)`` operation-windows, each holding at
most ``max_exact_keys`` exact entries, at most ``max_paths_per_key`` path digests per entry, one 16 KiB
HyperLogLog and ``max(256, 32 * heavy_keys)`` heavy-key counters. Each exact key costs one dict slot
holding a shared 64-bit digest of its path (plus a small object once it arrives twice). Measured with
``PYTHONPATH=src:tests python -c "import test_ledger as t; print(t.measure_bytes_per_key(100_000),
t.measure_bytes_per_key(100_000, with_keys=False))"``: about 110 bytes per key including the
24-character key string that the ledger keeps alive, about 40 for the ledger's own structures (20 to
40, with dict growth steps). Operation names beyond ``max_operations`` fold into ``"~other"``; layer,
origin and drop-reason names beyond ``max_names`` fold into ``"~other"`` too. Paths are remembered by
digest through a cache of at most 4096 paths.

Speed: for an attributable arrival of a new key, ``record`` is a handful of dict look-ups and counter
increments and makes no tuples or other objects per call. Measured at about 2.5 million calls per
second on one core (0.4 us each; a repeated key with a retry in its path: about 1 us) with
``PYTHONPATH=src python -m timeit -n 1 -r 5 -s "from askonce.core.ledger import Ledger; L = Ledger();
r = L.record; p = (('edge', 1), ('gw', 1)); ks = [f'k{i}' for i in range(10000)]"
"for k in ks: r(1.0, 'get', key=k, edge=True, path=p)"`` (10,000 calls per loop).

Merging
-------
:meth:`Ledger.merge` folds another ledger into this one window by window (windows must share a time
base, e.g. wall-clock seconds). Exact counts merge exactly: as long as no bound above is reached, two
replicas merged report exactly what one ledger fed all arrivals reports - except refusals, which each
replica decided on its own counts. Sketches merge as sketches.

The ledger is not thread-safe; the shells hold a lock around it.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from askonce.core.sketch import Frequent, HyperLogLog, digest64

__all__ = ["HeavyKey", "Kind", "Ledger", "LedgerPolicy", "OperationReport", "PerKey", "Report", "Totals"]

OTHER = "~other"
UNKNOWN_ORIGIN = "~unknown"
_PATH_CACHE_SIZE = 4096
_PATH_CACHE_MAX_HOPS = 64
_HLL_PRECISION = 14

Path = tuple[tuple[str, int], ...]


class Kind(enum.Enum):
    ATTRIBUTABLE = "attributable"
    REMINTED = "reminted"
    UNKEYED = "unkeyed"
    MALFORMED = "malformed"


def _count_field(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"ledger {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, slots=True)
class LedgerPolicy:
    window: float = 60.0  # seconds per window
    windows_kept: int = 5  # closed windows kept for reports
    max_exact_keys: int = 10_000  # per operation per window; beyond: approximate structures
    heavy_keys: int = 10  # heaviest keys reported
    max_operations: int = 256  # distinct operation names per window; beyond: folded into "~other"
    cap: int | None = None  # max arrivals per (principal, key) per operation per window; None: off
    max_paths_per_key: int = 8  # distinct paths remembered per key for undeclared-retry detection
    max_names: int = 64  # layer / origin / drop-reason names per counter; beyond: folded into "~other"

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int | float):
            raise ValueError(f"ledger window must be a number of seconds, got {self.window!r}")
        if not (math.isfinite(self.window) and self.window > 0):
            raise ValueError(f"ledger window must be a positive finite number, got {self.window!r}")
        _count_field("windows_kept", self.windows_kept, 0)
        _count_field("max_exact_keys", self.max_exact_keys, 0)
        _count_field("heavy_keys", self.heavy_keys, 0)
        _count_field("max_operations", self.max_operations, 1)
        if self.cap is not None:
            _count_field("cap", self.cap, 1)
        _count_field("max_paths_per_key", self.max_paths_per_key, 1)
        _count_field("max_names", self.max_names, 1)


def _bump(counts: dict[str, int], name: str, limit: int, n: int = 1) -> None:
    if name in counts:
        counts[name] += n
    elif len(counts) < limit:
        counts[name] = n
    else:
        counts[OTHER] = counts.get(OTHER, 0) + n


class _Seen:
    """A key that arrived more than once. A key seen once is stored as just its path digest (an int)."""

    __slots__ = ("n", "paths", "untracked")

    def __init__(self, n: int, paths: tuple[int, ...], untracked: int) -> None:
        self.n = n
        self.paths = paths
        self.untracked = untracked


_Entry = int | _Seen
_Table = dict[str, dict[str, _Entry]]  # principal -> key -> entry


def _unpack(e: _Entry) -> tuple[int, tuple[int, ...], int]:
    return (1, (e,), 0) if isinstance(e, int) else (e.n, e.paths, e.untracked)


def _combine(a: _Entry, b: _Entry, max_paths: int) -> _Seen:
    na, pa, ua = _unpack(a)
    nb, pb, ub = _unpack(b)
    paths = list(pa)
    untracked = ua + ub
    for p in pb:
        if p not in paths:
            if len(paths) < max_paths:
                paths.append(p)
            else:
                untracked += 1
    return _Seen(na + nb, tuple(paths), untracked)


class _Op:
    """The counters of one operation in one window."""

    __slots__ = (
        "arrivals", "attr", "attributable", "cap_unenforced", "exact", "heavy", "hll", "malformed",
        "overflowed", "refused", "remint", "reminted", "reminted_by", "retries_by", "unkeyed",
    )  # fmt: skip

    def __init__(self) -> None:
        self.arrivals = 0
        self.attributable = 0
        self.reminted = 0
        self.unkeyed = 0
        self.malformed = 0
        self.refused = 0
        self.cap_unenforced = 0
        self.exact = 0  # entries in attr and remint together, against max_exact_keys
        self.overflowed = False
        self.attr: _Table = {}
        self.remint: _Table = {}
        self.reminted_by: dict[str, int] = {}
        self.retries_by: dict[str, int] = {}
        self.hll: HyperLogLog | None = None
        self.heavy: Frequent[tuple[str, str]] | None = None

    def spill(self, edge: bool, principal: str, key: str, n: int, heavy_k: int) -> None:
        self.overflowed = True
        if not edge:
            return  # reminted keys have no distinct count or heavy list to feed
        if self.hll is None:
            self.hll = HyperLogLog(_HLL_PRECISION)
            self.heavy = Frequent(heavy_k)
        assert self.heavy is not None
        self.hll.add_hash(digest64(principal, key))
        self.heavy.add((principal, key), n)

    def absorb(self, other: _Op, policy: LedgerPolicy, heavy_k: int) -> None:
        for name in ("arrivals", "attributable", "reminted", "unkeyed", "malformed", "refused",
                     "cap_unenforced"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.overflowed = self.overflowed or other.overflowed
        for mine, theirs in ((self.reminted_by, other.reminted_by), (self.retries_by, other.retries_by)):
            for name, n in theirs.items():
                _bump(mine, name, policy.max_names, n)
        for edge, table, source in ((True, self.attr, other.attr), (False, self.remint, other.remint)):
            for principal, keys in source.items():
                for key, entry in keys.items():
                    mine_keys = table.get(principal)
                    have = None if mine_keys is None else mine_keys.get(key)
                    if have is not None:
                        assert mine_keys is not None
                        mine_keys[key] = _combine(have, entry, policy.max_paths_per_key)
                    elif self.exact < policy.max_exact_keys:
                        table.setdefault(principal, {})[key] = (
                            entry if isinstance(entry, int) else _Seen(entry.n, entry.paths, entry.untracked)
                        )
                        self.exact += 1
                    else:
                        self.spill(edge, principal, key, _unpack(entry)[0], heavy_k)
        if other.hll is not None and other.heavy is not None:
            if self.hll is None or self.heavy is None:
                self.hll, self.heavy = other.hll.copy(), other.heavy.copy()
            else:
                self.hll.merge(other.hll)
                self.heavy.merge(other.heavy)


class _Window:
    __slots__ = ("index", "ops", "summary")

    def __init__(self, index: int) -> None:
        self.index = index
        self.ops: dict[str, _Op] = {}
        self.summary: tuple[OperationReport, ...] | None = None  # cached once the window is closed


# The report ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PerKey:
    """Arrivals per attributable key. ``p50``/``p99`` are nearest-rank percentiles over the exactly
    tracked keys; ``max`` also covers heavy keys found by the sketch (as lower bounds)."""

    mean: float | None
    p50: int | None
    p99: int | None
    max: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "p50": self.p50, "p99": self.p99, "max": self.max}


@dataclass(frozen=True, slots=True)
class HeavyKey:
    key: str
    arrivals: int  # a lower bound: the true count is within arrivals .. arrivals + error
    principal: str = ""
    error: int = 0  # 0 for a key counted exactly; the sketch's bound for one found by the sketch

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "principal": self.principal, "arrivals": self.arrivals, "error": self.error}


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


@dataclass(frozen=True, slots=True)
class OperationReport:
    """The figures of one operation in one window (see the module docstring for their meaning)."""

    operation: str
    start: float
    end: float
    current: bool  # the window is still open
    arrivals: int
    attributable: int
    distinct_keys: int  # attributable; an estimate when approximate
    amplification: float | None
    coverage: float | None
    kinds: Mapping[Kind, int]
    per_key: PerKey
    heavy: tuple[HeavyKey, ...]  # keys with more than one arrival, heaviest first
    reminted_by: Mapping[str, int]
    retries_by: Mapping[str, int]
    undeclared_retries: int
    paths_untracked: int
    refused: int
    cap_unenforced: int
    approximate: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "operation": self.operation, "start": self.start, "end": self.end, "current": self.current,
            "arrivals": self.arrivals, "attributable": self.attributable,
            "distinct_keys": self.distinct_keys, "amplification": self.amplification,
            "coverage": self.coverage, "kinds": {k.value: n for k, n in self.kinds.items()},
            "per_key": self.per_key.to_dict(), "heavy": [h.to_dict() for h in self.heavy],
            "reminted_by": dict(self.reminted_by), "retries_by": dict(self.retries_by),
            "undeclared_retries": self.undeclared_retries, "paths_untracked": self.paths_untracked,
            "refused": self.refused, "cap_unenforced": self.cap_unenforced,
            "approximate": self.approximate,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Totals:
    """Additive figures summed over the operations and windows of a report. ``distinct_keys`` is the
    sum of per-operation, per-window counts: a key seen by two operations or windows counts twice."""

    arrivals: int
    attributable: int
    distinct_keys: int
    amplification: float | None
    coverage: float | None
    kinds: Mapping[Kind, int]
    reminted_by: Mapping[str, int]
    retries_by: Mapping[str, int]
    undeclared_retries: int
    paths_untracked: int
    refused: int
    cap_unenforced: int
    dropped: int
    approximate: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "arrivals": self.arrivals, "attributable": self.attributable,
            "distinct_keys": self.distinct_keys, "amplification": self.amplification,
            "coverage": self.coverage, "kinds": {k.value: n for k, n in self.kinds.items()},
            "reminted_by": dict(self.reminted_by), "retries_by": dict(self.retries_by),
            "undeclared_retries": self.undeclared_retries, "paths_untracked": self.paths_untracked,
            "refused": self.refused, "cap_unenforced": self.cap_unenforced, "dropped": self.dropped,
            "approximate": self.approximate,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Report:
    generated_at: float
    window: float
    operations: tuple[OperationReport, ...]  # ordered by window start, then operation name
    dropped: Mapping[str, int]  # arrivals the shells lost before counting, by reason, since creation

    @property
    def approximate(self) -> bool:
        return any(o.approximate for o in self.operations)

    def find(self, operation: str, start: float | None = None) -> OperationReport | None:
        """The operation's figures for the window beginning at ``start`` (default: its latest window)."""
        found = None
        for o in self.operations:
            if o.operation == operation and (start is None or o.start == start):
                found = o
        return found

    def totals(self, start: float | None = None) -> Totals:
        """Sum over all operations, of all windows or only of the window beginning at ``start``."""
        ops = [o for o in self.operations if start is None or o.start == start]
        arrivals = sum(o.arrivals for o in ops)
        attributable = sum(o.attributable for o in ops)
        distinct = sum(o.distinct_keys for o in ops)
        reminted_by: dict[str, int] = {}
        retries_by: dict[str, int] = {}
        for o in ops:
            for name, n in o.reminted_by.items():
                reminted_by[name] = reminted_by.get(name, 0) + n
            for name, n in o.retries_by.items():
                retries_by[name] = retries_by.get(name, 0) + n
        return Totals(
            arrivals=arrivals, attributable=attributable, distinct_keys=distinct,
            amplification=_ratio(attributable, distinct), coverage=_ratio(attributable, arrivals),
            kinds={k: sum(o.kinds[k] for o in ops) for k in Kind},
            reminted_by=reminted_by, retries_by=retries_by,
            undeclared_retries=sum(o.undeclared_retries for o in ops),
            paths_untracked=sum(o.paths_untracked for o in ops),
            refused=sum(o.refused for o in ops), cap_unenforced=sum(o.cap_unenforced for o in ops),
            dropped=sum(self.dropped.values()), approximate=any(o.approximate for o in ops),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "generated_at": self.generated_at,
            "window": self.window,
            "approximate": self.approximate,
            "dropped": dict(self.dropped),
            "operations": [o.to_dict() for o in self.operations],
        }


def _summarize(op: _Op, name: str, start: float, end: float, current: bool, heavy_n: int) -> OperationReport:
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
    heavy: dict[tuple[str, str], int] = {(p, k): -neg for neg, p, k in heapq.nsmallest(heavy_n, heavy_exact)}
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
    amplification = _ratio(op.attributable, distinct)
    per_key = PerKey(
        mean=amplification,
        p50=counts[math.ceil(0.5 * len(counts)) - 1] if counts else None,
        p99=counts[math.ceil(0.99 * len(counts)) - 1] if counts else None,
        max=top or None,
    )
    return OperationReport(
        operation=name, start=start, end=end, current=current, arrivals=op.arrivals,
        attributable=op.attributable, distinct_keys=distinct, amplification=amplification,
        coverage=_ratio(op.attributable, op.arrivals),
        kinds={Kind.ATTRIBUTABLE: op.attributable, Kind.REMINTED: op.reminted,
               Kind.UNKEYED: op.unkeyed, Kind.MALFORMED: op.malformed},
        per_key=per_key,
        heavy=tuple(HeavyKey(k, -neg, p, error if (p, k) in sketched else 0) for neg, p, k in ranked),
        reminted_by=dict(op.reminted_by), retries_by=dict(op.retries_by),
        undeclared_retries=undeclared, paths_untracked=untracked, refused=op.refused,
        cap_unenforced=op.cap_unenforced, approximate=op.overflowed,
    )  # fmt: skip


# The ledger ---------------------------------------------------------------------------------------


class Ledger:
    """Counts and classifies arrivals at the target; see the module docstring."""

    __slots__ = ("_cap", "_closed", "_current", "_dropped", "_end", "_heavy_k", "_max_exact", "_max_paths",
                 "_names", "_ops", "_paths", "policy")  # fmt: skip

    def __init__(self, policy: LedgerPolicy = LedgerPolicy()) -> None:
        self.policy = policy
        # Copies of policy fields: the hot path reads them as one attribute load instead of two.
        self._cap = policy.cap
        self._max_exact = policy.max_exact_keys
        self._max_paths = policy.max_paths_per_key
        self._names = policy.max_names
        # Misra-Gries undercounts by at most n / (k + 1) for n spilled arrivals; 256 counters (10 KiB or
        # so, less than the HyperLogLog beside it) keep that under half a percent of the spill.
        self._heavy_k = max(256, 32 * policy.heavy_keys)
        self._current: _Window | None = None
        self._closed: list[_Window] = []  # oldest first
        self._ops: dict[str, _Op] = {}
        self._end = -math.inf  # the first record() opens a window
        self._paths: dict[Path, tuple[int, tuple[str, ...]]] = {}  # path -> (digest, layers that retried)
        self._dropped: dict[str, int] = {}

    def record(
        self,
        now: float,
        operation: str,
        *,
        key: str | None,
        edge: bool = False,
        origin: str | None = None,
        path: Path = (),
        principal: str = "",
        malformed: bool = False,
    ) -> bool:
        """Classify and count one arrival; return False if it is over the cap (it is counted anyway)."""
        # Written for the attributable arrival of a new key: no allocation, and rare cases branch out.
        if not now < self._end:  # `not <` also sends NaN to _roll, which rejects it
            self._roll(now)
        op = self._ops.get(operation)
        if op is None:
            op = self._operation(operation)
        op.arrivals += 1
        info = self._paths.get(path)
        if info is None:
            info = self._learn(path)
        digest, retried = info
        if retried:
            for layer in retried:
                _bump(op.retries_by, layer, self._names)
        if key is None or malformed:
            if malformed:
                op.malformed += 1
            else:
                op.unkeyed += 1
            return True
        if edge:
            op.attributable += 1
            table = op.attr
        else:
            op.reminted += 1
            _bump(op.reminted_by, UNKNOWN_ORIGIN if origin is None else origin, self._names)
            table = op.remint
        keys = table.get(principal)
        if keys is not None:
            entry = keys.get(key)
            if entry is not None:
                return self._again(op, keys, key, entry, digest)
            if op.exact < self._max_exact:
                keys[key] = digest
                op.exact += 1
                return True
        return self._first(op, table, edge, principal, key, digest)

    def _first(self, op: _Op, table: _Table, edge: bool, principal: str, key: str, digest: int) -> bool:
        if op.exact < self._max_exact:
            table[principal] = {key: digest}
            op.exact += 1
            return True
        op.spill(edge, principal, key, 1, self._heavy_k)
        if self._cap is not None:
            op.cap_unenforced += 1
        return True

    def _again(self, op: _Op, keys: dict[str, _Entry], key: str, entry: _Entry, digest: int) -> bool:
        if isinstance(entry, int):
            seen = _combine(entry, digest, self._max_paths)
            keys[key] = seen
        else:
            seen = entry
            seen.n += 1
            if digest not in seen.paths:
                if len(seen.paths) < self._max_paths:
                    seen.paths += (digest,)
                else:
                    seen.untracked += 1
        if self._cap is not None and seen.n > self._cap:
            op.refused += 1
            return False
        return True

    def _operation(self, name: str) -> _Op:
        ops = self._ops
        if len(ops) < self.policy.max_operations:  # once "~other" exists, len exceeds the limit
            fresh = ops[name] = _Op()
            return fresh
        folded = ops.get(OTHER)
        if folded is None:
            folded = ops[OTHER] = _Op()
        return folded

    def _learn(self, path: Path) -> tuple[int, tuple[str, ...]]:
        last: dict[str, int] = {}
        parts: list[str] = []
        for layer, attempt in path:
            last[layer] = attempt
            parts += (layer, str(attempt))
        retried = tuple(layer for layer, attempt in last.items() if isinstance(attempt, int) and attempt > 1)
        info = (digest64(*parts, person=b"askonce-path"), retried)
        if len(path) <= _PATH_CACHE_MAX_HOPS:
            if len(self._paths) >= _PATH_CACHE_SIZE:
                self._paths.clear()  # entries keep their digests; only re-learning costs
            self._paths[path] = info
        return info

    def _roll(self, now: float) -> None:
        if not math.isfinite(now):
            raise ValueError(f"ledger time must be a finite number of seconds, got {now!r}")
        index = math.floor(now / self.policy.window)
        current = self._current
        if current is not None:
            if index <= current.index:
                return  # late clock, or float rounding at a window edge: count in the current window
            if current.ops:
                self._closed.append(current)
        self._install(_Window(index))

    def _install(self, current: _Window) -> None:
        horizon = current.index - self.policy.windows_kept
        self._closed = [w for w in self._closed if horizon <= w.index < current.index]
        self._current = current
        self._ops = current.ops
        self._end = (current.index + 1) * self.policy.window

    def note_dropped(self, n: int, reason: str) -> None:
        """Count ``n`` arrivals a shell lost before they reached :meth:`record` (shown in every report)."""
        _count_field("dropped count", n, 0)
        if n:
            _bump(self._dropped, reason, self._names, n)

    def report(self, now: float) -> Report:
        """The figures of the current window and the kept closed windows, per operation."""
        if not now < self._end:
            self._roll(now)
        window = self.policy.window
        heavy_n = self.policy.heavy_keys
        ops: list[OperationReport] = []
        for w in self._closed:
            if w.summary is None:
                start = w.index * window
                w.summary = tuple(
                    _summarize(w.ops[name], name, start, start + window, False, heavy_n) for name in sorted(w.ops)
                )
            ops.extend(w.summary)
        current = self._current
        if current is not None:
            start = current.index * window
            ops.extend(
                _summarize(current.ops[name], name, start, start + window, True, heavy_n)
                for name in sorted(current.ops)
            )
        return Report(generated_at=now, window=window, operations=tuple(ops), dropped=dict(self._dropped))

    def merge(self, other: Ledger) -> None:
        """Add ``other``'s counts (another replica's) into this ledger; ``other`` is left unchanged."""
        if other is self:
            raise ValueError("cannot merge a ledger into itself")
        if other.policy != self.policy:
            raise ValueError("cannot merge ledgers with different policies")
        windows = {w.index: w for w in self._windows()}
        for theirs in other._windows():
            mine = windows.get(theirs.index)
            if mine is None:
                mine = windows[theirs.index] = _Window(theirs.index)
            mine.summary = None
            saved, self._ops = self._ops, mine.ops  # _operation() folds names into the ops it is given
            try:
                for name, op in theirs.ops.items():
                    target = mine.ops.get(name)
                    if target is None:
                        target = self._operation(name)
                    target.absorb(op, self.policy, self._heavy_k)
            finally:
                self._ops = saved
        for reason, n in other._dropped.items():
            _bump(self._dropped, reason, self._names, n)
        if windows:
            newest = max(windows)
            self._closed = [windows[i] for i in sorted(windows) if i < newest and windows[i].ops]
            self._install(windows[newest])

    def _windows(self) -> list[_Window]:
        return [*self._closed, *([self._current] if self._current is not None else [])]
