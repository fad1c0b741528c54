"""The target's ledger: counts arrivals per question and tells how much each one was amplified.

The model
---------
A *question* is one user request, minted once with a unique key by its originator. Every layer
forwards the key on every attempt, together with the *attempt path*: the hops ``(layer, attempt)``
it went through. Only the target sees every arrival, so only the target can count the true
amplification.

Each arrival is one of four kinds (:class:`Kind`):

* ``ATTRIBUTABLE`` - it carries the key minted at the edge, so it can be tied to its question;
* ``REMINTED`` - it carries a key that a middle layer (``origin``) minted because it received none
  or dropped the one it had; retries above that layer are invisible, so the report names the layer;
* ``UNKEYED`` - no key at all;
* ``MALFORMED`` - the shell could not parse what it was sent.

A question is identified by ``(principal, key)``: keys are scoped per principal (tenant) so one
tenant cannot have another tenant's question refused by sending its key. The per-key figures
(distinct keys, the arrivals-per-key distribution, heavy keys, undeclared retries, the cap) cover
keyed arrivals; distinct keys and the distribution count only attributable ones.

Figures, per operation and window:

* ``amplification`` = attributable arrivals / distinct attributable keys (also the mean of the
  per-key distribution); ``coverage`` = attributable arrivals / all arrivals.
* ``retries_by[L]`` - arrivals whose path says layer ``L`` retried: the *last* hop of ``L`` in the
  path has attempt > 1. Each layer counts at most once per arrival, so ``(("gw", 2), ("api", 3))``
  is one retry by ``gw`` and one by ``api``, and ``(("gw", 2), ("gw", 1))`` none by ``gw`` (its last
  call was a first attempt: the earlier hop was an upstream instance of ``gw``).
* ``undeclared_retries`` - two arrivals with the same key *and the same path* mean that something
  between the last hop and the target retried without saying so. Counted as arrivals minus distinct
  ``(key, path)`` pairs, over exact keys, tracking at most ``max_paths_per_key`` paths per key;
  arrivals with a further new path are counted in ``paths_untracked`` and never as undeclared, so
  the figure can be too low but never too high, and no layer is named for it.

Time and memory
---------------
``now`` is an input (seconds); window ``i`` covers ``[i * window, (i + 1) * window)``. An arrival
whose ``now`` is before the current window (a slightly late clock) is counted in the current window.
The current window and the closed windows at most ``windows_kept`` windows older are kept.

Per operation and window at most ``max_exact_keys`` keys are counted exactly; later new keys go to a
HyperLogLog (distinct count) and a Misra-Gries summary (heavy keys), see :mod:`.sketch`,
and the report says ``approximate=True``. Then ``p50``/``p99`` cover the exact keys only, and a
heavy key found by the sketch is reported as a lower bound with its ``error``. Keys in the sketch
are not capped (``cap_unenforced`` counts their arrivals): refusing on an estimate would refuse
innocent keys. Heavy keys are listed only when seen more than once.

Memory is bounded by ``(windows_kept + 1) * (max_operations + 1)`` operation-windows, each holding
at most ``max_exact_keys`` exact entries, at most ``max_paths_per_key`` path digests per entry, one
16 KiB HyperLogLog and ``max(256, 32 * heavy_keys)`` heavy-key counters (and, in the current
window, at most 256 arrivals past the bound that the sketches take as one batch: reading them takes
the batch first, so no report sees the difference). Each exact key costs one
dict slot holding a shared 64-bit digest of its path (plus a small object once it arrives twice);
the measured bytes per key are in ``docs/ledger.md`` ("Figures"). Operation names beyond
``max_operations`` fold into ``"~other"``; layer, origin and drop-reason names beyond ``max_names``
fold into ``"~other"`` too. Paths are remembered by digest through a cache of at most 4096 paths.

Speed: for an attributable arrival of a new key, ``record`` is a handful of dict look-ups and
counter increments and makes no tuples or other objects per call (throughput: ``docs/ledger.md``,
"Figures").

Merging
-------
:meth:`Ledger.merge` folds another ledger into this one window by window (windows must share a time
base, e.g. wall-clock seconds). Exact counts merge exactly: as long as no bound above is reached,
two replicas merged report exactly what one ledger fed all arrivals reports - except refusals, which
each replica decided on its own counts. Sketches merge as sketches.

The ledger is not thread-safe; the shells hold a lock around it.
"""

from __future__ import annotations

import math

from askonce.core.ledger.policy import (
    LedgerPolicy,
    count_field,
    window_index,
)
from askonce.core.ledger.report import HeavyKey, Kind, OperationReport, PerKey, Report, Totals
from askonce.core.ledger.sketch import digest64
from askonce.core.ledger.state import OTHER as OTHER
from askonce.core.ledger.state import Entry, OperationState, Window, bump, combine, summarize

__all__ = ["HeavyKey", "Kind", "Ledger", "LedgerPolicy", "OperationReport", "PerKey", "Report",
           "Totals", "window_index"]

UNKNOWN_ORIGIN = "~unknown"
_PATH_CACHE_SIZE = 4096
_PATH_CACHE_MAX_HOPS = 64
_PENDING = 256  # spilled arrivals an operation holds before its sketches take them

Path = tuple[tuple[str, int], ...]


# The ledger ---------------------------------------------------------------------------------------


class Ledger:
    """Counts and classifies arrivals at the target; see the module docstring."""

    __slots__ = ("_cap", "_closed", "_current", "_dropped", "_end", "_heavy_k", "_last_info",
                 "_last_path", "_max_exact", "_max_paths", "_names", "_ops", "_paths",
                 "policy")  # fmt: skip

    def __init__(self, policy: LedgerPolicy = LedgerPolicy()) -> None:
        self.policy = policy
        # Copies of policy fields: the hot path reads them as one attribute load instead of two.
        self._cap = policy.cap
        self._max_exact = policy.max_exact_keys
        self._max_paths = policy.max_paths_per_key
        self._names = policy.max_names
        # Misra-Gries undercounts by at most n / (k + 1) for n spilled arrivals; 256 counters (less
        # memory than the HyperLogLog beside it) keep that under half a percent of the spill.
        self._heavy_k = max(256, 32 * policy.heavy_keys)
        self._current: Window | None = None
        self._closed: list[Window] = []  # oldest first
        self._ops: dict[str, OperationState] = {}
        self._end = -math.inf  # the first record() opens a window
        # path -> (digest, layers that retried)
        self._paths: dict[Path, tuple[int, tuple[str, ...]]] = {}
        self._last_path: Path | None = None
        self._last_info: tuple[int, tuple[str, ...]] = (0, ())
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
        """Classify and count one arrival; return False if it is over the cap (it is counted
        anyway)."""
        # Written for the attributable arrival of a new key: no allocation; rare cases branch out.
        if not now < self._end:  # `not <` also sends NaN to _roll, which rejects it
            self._roll(now)
        op = self._ops.get(operation)
        if op is None:
            op = self._operation(operation)
        op.arrivals += 1
        if path is self._last_path:  # callers pass a path they parsed once: the same object
            digest, retried = self._last_info
        else:
            info = self._paths.get(path)
            if info is None:
                info = self._learn(path)
            self._last_path, self._last_info = path, info
            digest, retried = info
        if retried:
            for layer in retried:
                bump(op.retries_by, layer, self._names)
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
            bump(op.reminted_by, UNKNOWN_ORIGIN if origin is None else origin, self._names)
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
        elif op.exact < self._max_exact:
            table[principal] = {key: digest}
            op.exact += 1
            return True
        # Past the exact bound: the sketches.
        if self._cap is not None:
            op.cap_unenforced += 1
        if edge:
            pending = op.pending
            if pending is None:
                pending = op.sketch(self._heavy_k)
            pending.append((principal, key))
            if len(pending) >= _PENDING:
                op.flush()
        else:
            op.overflowed = True
        return True

    def joined(self, at: float, operation: str, *, edge: bool) -> None:
        """An arrival recorded before, at ``at``, was answered by work it did not start: it waited
        for the run of its question in flight, or got that run's kept answer
        (``integrations.asgi_join``). Counted, when ``edge`` (attributable), beside its arrival:
        in the kept window of ``at``, even after that window closed, so that a wait across a
        window's end does not move the join to a window without its arrival. A window that holds
        no arrival of ``operation`` (an arrival recorded late counts in the window then current)
        sends the join to the current window; a time before the kept windows counts nowhere (its
        arrival is no longer reported either). The report's ``work_per_question`` is attributable
        arrivals less these, per question."""
        if not at < self._end:
            self._roll(at)
        if not edge:
            return
        ops = self._ops
        current = self._current
        if current is not None:
            index = window_index(at, self.policy.window)
            if index < current.index - self.policy.windows_kept:
                return
            if index < current.index:
                closed = next((w for w in self._closed if w.index == index), None)
                kept = None if closed is None else (closed.ops.get(operation)
                                                    or closed.ops.get(OTHER))
                if closed is not None and kept is not None:
                    closed.summary = None
                    kept.joined += 1
                    return
        op = ops.get(operation)
        if op is None:
            op = self._operation(operation)
        op.joined += 1

    def _again(self, op: OperationState, keys: dict[str, Entry], key: str, entry: Entry,
               digest: int) -> bool:
        if isinstance(entry, int):
            seen = combine(entry, digest, self._max_paths)
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

    def _operation(self, name: str) -> OperationState:
        ops = self._ops
        if len(ops) < self.policy.max_operations:  # once "~other" exists, len exceeds the limit
            fresh = ops[name] = OperationState()
            return fresh
        folded = ops.get(OTHER)
        if folded is None:
            folded = ops[OTHER] = OperationState()
        return folded

    def _learn(self, path: Path) -> tuple[int, tuple[str, ...]]:
        last: dict[str, int] = {}
        parts: list[str] = []
        for layer, attempt in path:
            last[layer] = attempt
            parts += (layer, str(attempt))
        retried = tuple(layer for layer, attempt in last.items()
                        if isinstance(attempt, int) and attempt > 1)
        info = (digest64(*parts, person=b"askonce-path"), retried)
        if len(path) <= _PATH_CACHE_MAX_HOPS:
            if len(self._paths) >= _PATH_CACHE_SIZE:
                self._paths.clear()  # entries keep their digests; only re-learning costs
            self._paths[path] = info
        return info

    def _roll(self, now: float) -> None:
        index = window_index(now, self.policy.window)
        current = self._current
        if current is not None:
            if index <= current.index:
                # Late clock, or float rounding at a window edge: count in the current window.
                return
            if current.ops:
                for op in current.ops.values():
                    op.flush()  # a closed window holds nothing pending
                self._closed.append(current)
        self._install(Window(index))

    def _install(self, current: Window) -> None:
        horizon = current.index - self.policy.windows_kept
        self._closed = [w for w in self._closed if horizon <= w.index < current.index]
        self._current = current
        self._ops = current.ops
        self._end = (current.index + 1) * self.policy.window

    def note_dropped(self, n: int, reason: str) -> None:
        """Count ``n`` arrivals a shell lost before they reached :meth:`record` (shown in every
        report)."""
        count_field("dropped count", n, 0)
        if n:
            bump(self._dropped, reason, self._names, n)

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
                    summarize(w.ops[name], name, start, start + window, False, heavy_n)
                    for name in sorted(w.ops)
                )
            ops.extend(w.summary)
        current = self._current
        if current is not None:
            start = current.index * window
            ops.extend(
                summarize(current.ops[name], name, start, start + window, True, heavy_n)
                for name in sorted(current.ops)
            )
        return Report(generated_at=now, window=window, operations=tuple(ops),
                      dropped=dict(self._dropped))

    def merge(self, other: Ledger) -> None:
        """Add ``other``'s counts (another replica's) into this ledger; ``other`` is left
        unchanged."""
        if other is self:
            raise ValueError("cannot merge a ledger into itself")
        if other.policy != self.policy:
            raise ValueError("cannot merge ledgers with different policies")
        windows = {w.index: w for w in self._windows()}
        for theirs in other._windows():
            mine = windows.get(theirs.index)
            if mine is None:
                mine = windows[theirs.index] = Window(theirs.index)
            mine.summary = None
            # _operation() folds names into the ops it is given.
            saved, self._ops = self._ops, mine.ops
            try:
                for name, op in theirs.ops.items():
                    target = mine.ops.get(name)
                    if target is None:
                        target = self._operation(name)
                    target.absorb(op, self.policy, self._heavy_k)
            finally:
                self._ops = saved
        for reason, n in other._dropped.items():
            bump(self._dropped, reason, self._names, n)
        if windows:
            newest = max(windows)
            self._closed = [windows[i] for i in sorted(windows) if i < newest and windows[i].ops]
            self._install(windows[newest])

    def _windows(self) -> list[Window]:
        return [*self._closed, *([self._current] if self._current is not None else [])]
