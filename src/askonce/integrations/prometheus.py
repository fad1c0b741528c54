"""Prometheus (prometheus-client) metrics: the ledger's figures per operation, ``askonce.stats()``.

::

    from prometheus_client import REGISTRY, start_http_server
    from askonce.integrations.asgi import route_operations   # or askonce.integrations.wsgi's
    from askonce.integrations.prometheus import LedgerCollector

    # a MemoryLedger or RedisLedger (anything with report(now))
    REGISTRY.register(LedgerCollector(ledger, operations=route_operations(app),
                                      layers=["edge", "api", "worker"], origins=["api"]))
    start_http_server(9100)

Every scrape reads ``ledger.report(time.time())`` and exposes (prefix ``askonce_ledger_``):

==========================================  =======  ===============================================
``arrivals_total{operation,kind}``          counter  arrivals by kind: attributable, reminted,
                                                     unkeyed, malformed (``kind="attributable"`` is
                                                     the attributable count)
``distinct_keys_total{operation}``          counter  distinct attributable keys, summed over windows
``undeclared_retries_total{operation}``     counter  repeats of a (key, path): hidden retries below
``retries_total{operation,layer}``          counter  arrivals whose path says ``layer`` retried
``reminted_total{operation,origin}``        counter  arrivals with a key ``origin`` re-minted
``refused_total{operation}``                counter  arrivals refused by the cap
``cap_unenforced_total{operation}``         counter  arrivals of keys past the exact bound (not
                                                     capped)
``paths_untracked_total{operation}``        counter  arrivals whose path was past the tracked few
``dropped_total{reason}``                   counter  arrivals lost before counting (buffer full,
                                                     ...)
``amplification{operation}``                gauge    attributable arrivals per distinct key, latest
                                                     window
``coverage_ratio{operation}``               gauge    attributable / all arrivals, latest window
``arrivals_per_key{operation,stat}``        gauge    ``p50``, ``p99``, ``max`` over keys, latest
                                                     window
``approximate{operation}``                  gauge    1 if the latest window's figures are estimates
``report_errors_total``                     counter  scrapes whose report failed (e.g. Redis away)
==========================================  =======  ===============================================

and ``askonce_events_total{event}`` from ``askonce.stats()`` (malformed headers, fallbacks, drops).

The ledger counts in windows and forgets old ones; counters must only grow. So the collector
remembers each window's figures while the report shows it, and adds them to a running total when the
window leaves the report: a counter is that total plus the windows still shown. Scrape more often
than ``window * windows_kept`` seconds or windows pass unseen. A failed report leaves the counters
where they were (and counts the failure). With a :class:`RedisLedger` every replica reports the
fleet's figures: scrape one of them, or aggregate with ``max``, not ``sum``.

Labels
------
Operation, layer and origin names come from the request: the path (where no route table names the
operation) and the ``askonce-question`` header, which any client writes. So label values are bounded
and chosen by configuration, not by whoever sends first:

* ``operations=``, ``layers=``, ``origins=``, ``reasons=`` (drop reasons): an allow-list. A listed
  name has series of its own for good; any other is counted under ``~other``.
  ``route_operations(app)`` of :mod:`.asgi` and :mod:`.wsgi` lists the names a route table gives
  (``"GET /items/{item_id}"`` for each route and method, ``"GET ~unmatched"``...), so real routes
  keep their labels whatever names a flood brings.
* Without a list, a name gets series of its own while a slot is free (at most ``max_operations``
  operations and ``max_names`` layers, origins and reasons at a time; the busiest new names first)
  and keeps them while a window of the report shows it; otherwise ``~other``. Under a flood the
  slots go to the flood: configure lists for the names that matter.
* The names askonce writes itself (:data:`RESERVED`: ``~other``, ``~unknown``, ``~unsigned``; no
  header can carry a ``~``) always have their own.

Which label a name gets is decided once per window and kept while the window is shown, so no count
moves from one series to another under a counter. An unlisted name is forgotten once no window of
the report shows it: its series stop being exported, which Prometheus marks stale. Their totals are
not moved to ``~other``: Prometheus has already seen them as the named series' increase, so
``rate()`` of ``~other`` would count them a second time, as a burst that never happened. A name
that comes back starts again from what the report shows: to Prometheus a new series, or across the
gap a counter reset, as after a restart. So no exported series goes down while it is exported; a
sum of raw counter values over a label can (sum rates, not counters). Listed names are never
forgotten. Drop reasons and events are counts since start and never leave: an
unlisted one keeps its slot for good (at most ``max_names`` reasons and ``max_events`` events).

The series exported are at most :func:`series_bound` of the label counts (``collector.bound``): with
``O`` operation, ``L`` layer and ``R`` origin labels (a list's size or the ``max_``, plus the three
reserved), ``O * (15 + L + R)`` per-operation series, the reasons, one ``report_errors`` and
``max_events + 1`` events; 3,828 with the defaults. Memory is bounded by the ledger's report (the
label each name of a shown window got) and those series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, CollectorRegistry

from askonce import _stats
from askonce.core import is_int
from askonce.core.ledger import OTHER, OperationReport, Report
from askonce.core.naming import MAX_OPERATION_CHARS
from askonce.integrations._server import UNKNOWN, UNSIGNED
from askonce.ledger.store import LedgerShell

__all__ = ["RESERVED", "LedgerCollector", "register", "series_bound"]

Series = tuple[str, tuple[str, ...]]  # metric name, label values
_PER_KEY = (("p50", "p50"), ("p99", "p99"), ("max", "max"))
_SIMPLE = (("distinct_keys", "distinct_keys", "Distinct attributable keys (summed over windows)"),
           ("undeclared_retries", "undeclared_retries",
            "Repeats of a (key, path) pair: retries nobody declared"),
           ("refused", "refused", "Arrivals refused by the per-key cap"),
           ("cap_unenforced", "cap_unenforced",
            "Arrivals of keys beyond the exact bound, not capped"),
           ("paths_untracked", "paths_untracked",
            "Arrivals whose path was beyond the tracked few per key"))
_LABELLED = (("arrivals", "kind", "Arrivals at the target by kind"),
             ("retries", "layer", "Arrivals whose attempt path says this layer retried"),
             ("reminted", "origin", "Arrivals carrying a key re-minted by this origin"))
_KINDS = 4  # core.ledger.Kind
_GAUGES = 6  # amplification, coverage_ratio, arrivals_per_key (3 stats), approximate
_OPERATION, _LAYER, _ORIGIN = range(3)  # the kinds of name a window labels
_BY_NAME = (None, "retries", "reminted")  # the metric each kind of name (but the operation) labels

RESERVED = frozenset({OTHER, UNKNOWN, UNSIGNED})
"""Names askonce itself writes (no header can carry a ``~``): always labels of their own."""


def series_bound(operations: int, layers: int, origins: int, reasons: int, events: int) -> int:
    """The most series a collector exports, given how many names of each kind may have a label
    (an allow-list's size, else ``max_operations``, ``max_names``, ``max_events``)."""
    o, lay, ori, r = (n + len(RESERVED) for n in (operations, layers, origins, reasons))
    return o * (_KINDS + len(_SIMPLE) + _GAUGES + lay + ori) + r + 1 + events + 1


class _Names:
    """The label values of one kind of name: an allow-list, or at most ``limit`` names at a time."""

    __slots__ = ("allowed", "limit", "own")

    def __init__(self, allowed: frozenset[str] | None, limit: int) -> None:
        self.allowed = allowed
        self.limit = limit
        self.own: set[str] = set()  # names with series of their own without being listed

    def label(self, name: str, own: set[str]) -> str:
        """The label of ``name``; an unlisted name takes a free slot in ``own``, else ``~other``."""
        if name in RESERVED:
            return name
        if self.allowed is not None:
            return name if name in self.allowed else OTHER
        if name not in own:
            if len(own) >= self.limit:
                return OTHER
            own.add(name)
        return name


class _Window:
    """A window the report shows: the label each name got in it, kept for the window's life (a
    name moved to another series would take its count away from a counter), and its figures."""

    __slots__ = ("figures", "labels", "read")

    def __init__(self) -> None:
        self.labels: tuple[dict[str, str], ...] = ({}, {}, {})  # operations, layers, origins
        self.figures: dict[Series, float] = {}
        self.read: list[OperationReport] = []  # what the figures were made of

    def unchanged(self, ops: list[OperationReport]) -> bool:
        """The same report values as last time (a closed window of a memory ledger: cached)."""
        read = self.read
        return len(read) == len(ops) and all(a is b for a, b in zip(read, ops, strict=True))


def _allow_list(what: str, names: Iterable[str] | None, cut: int | None = None
                ) -> frozenset[str] | None:
    if names is None:
        return None
    if isinstance(names, str | bytes) or not isinstance(names, Iterable):
        raise ValueError(f"{what} must be a collection of names or None, got {names!r}")
    out = frozenset(names)
    bad = [n for n in out if not isinstance(n, str)]
    if bad:
        raise ValueError(f"{what} must hold names (str), got {bad[0]!r}")
    # Operation names are cut as the servers cut them, so that a long route still matches.
    return out if cut is None else frozenset(n[:cut] for n in out)


class LedgerCollector:
    """A prometheus-client collector over a ledger shell's reports; see the module docstring."""

    def __init__(self, ledger: LedgerShell | None = None, *,
                 report: Callable[[float], Report] | None = None,
                 clock: Callable[[], float] = time.time, events: bool = True,
                 operations: Iterable[str] | None = None, layers: Iterable[str] | None = None,
                 origins: Iterable[str] | None = None, reasons: Iterable[str] | None = None,
                 max_operations: int = 64, max_names: int = 16, max_events: int = 256,
                 prefix: str = "askonce") -> None:
        if (ledger is None) == (report is None):
            raise ValueError("give a ledger (with report(now)) or a report callable, not both")
        report = report if report is not None else getattr(ledger, "report", None)
        if not callable(report):
            raise ValueError("ledger must have a report(now) method, or report be callable, "
                             f"got {ledger or report!r}")
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning the Unix time, got {clock!r}")
        if not isinstance(events, bool):
            raise ValueError(f"events must be True or False, got {events!r}")
        for name, n in (("max_operations", max_operations), ("max_names", max_names),
                        ("max_events", max_events)):
            if not is_int(n) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        if (not isinstance(prefix, str) or not prefix.isascii()
                or not prefix.replace("_", "").isalnum() or not prefix[0].isalpha()):
            raise ValueError(f"prefix must be a metric name prefix like 'askonce', got {prefix!r}")
        self._report: Callable[[float], Report] = report
        self._clock = clock
        self._events = events
        self._p = prefix
        self._lock = threading.Lock()
        self._names = (
            _Names(_allow_list("operations", operations, MAX_OPERATION_CHARS), max_operations),
            _Names(_allow_list("layers", layers), max_names),
            _Names(_allow_list("origins", origins), max_names),
        )
        self._reasons = _Names(_allow_list("reasons", reasons), max_names)
        self._event_names = _Names(None, max_events)
        ops, lay, ori, why = (n.limit if n.allowed is None else len(n.allowed)
                              for n in (*self._names, self._reasons))
        self.bound = series_bound(ops, lay, ori, why, max_events)
        """The most series this collector exports (``series_bound``)."""
        self._retired: dict[Series, float] = {}  # windows that left the report, summed
        self._windows: dict[float, _Window] = {}  # by start: the windows the report shows
        self._horizon = float("-inf")  # the newest window that left the report
        self._gauges: dict[str, dict[str, float]] = {}
        self._dropped: dict[str, int] = {}
        self._errors = 0

    def describe(self) -> list[Metric]:
        """The metric names, without reading a report: registering touches no ledger, no Redis."""
        with self._lock:  # the event names get their labels here too
            return list(self._families({}, {}, {}, 0))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._refresh()
            totals = dict(self._retired)
            for window in self._windows.values():
                for series, v in window.figures.items():
                    totals[series] = totals.get(series, 0.0) + v
            families = list(self._families(totals, self._gauges, self._dropped, self._errors))
        yield from families

    def _refresh(self) -> None:
        try:
            report = self._report(self._clock())
        except Exception:
            self._errors += 1
            _stats.count("prometheus.report.error")
            return
        shown: dict[float, list[OperationReport]] = {}
        for o in report.operations:
            if o.start > self._horizon:  # a window that left the report is not counted twice
                shown.setdefault(o.start, []).append(o)
        for start, window in self._windows.items():
            if start not in shown:  # left the report: its last figures are final
                self._horizon = max(self._horizon, start)
                for series, v in window.figures.items():
                    self._retired[series] = self._retired.get(series, 0.0) + v
        windows = {start: self._windows.get(start) or _Window() for start in shown}
        own = tuple(set() if names.allowed is not None else
                    {label for w in windows.values() for label in w.labels[kind].values()
                     if label not in RESERVED}
                    for kind, names in enumerate(self._names))
        fresh = [start for start, w in windows.items() if not w.unchanged(shown[start])]
        for start in sorted(fresh, reverse=True):  # the newest first: it stays the longest
            self._label(windows[start], shown[start], own)
        for start in fresh:
            windows[start].figures = self._figures(windows[start], shown[start])
            windows[start].read = shown[start]
        self._windows = windows
        for kind, names in enumerate(self._names):
            gone = names.own - own[kind]
            if gone:
                self._forget(kind, gone)
            names.own = own[kind]
        self._gauges = self._latest(windows, shown)
        dropped: dict[str, int] = {}
        for reason, n in sorted(report.dropped.items()):
            label = self._reasons.label(reason, self._reasons.own)
            dropped[label] = dropped.get(label, 0) + n
        self._dropped = dropped

    def _label(self, window: _Window, ops: list[OperationReport],
               own: tuple[set[str], ...]) -> None:
        """Give the names new to ``window`` their labels, the busiest first."""
        new: tuple[dict[str, int], ...] = ({}, {}, {})
        for o in ops:
            for kind, counts in ((_OPERATION, {o.operation: o.arrivals}),
                                 (_LAYER, o.retries_by), (_ORIGIN, o.reminted_by)):
                labels, fresh = window.labels[kind], new[kind]
                for name, n in counts.items():
                    if name not in labels:
                        fresh[name] = fresh.get(name, 0) + n
        for kind, fresh in enumerate(new):
            labels, names, taken = window.labels[kind], self._names[kind], own[kind]
            free = names.allowed is None and len(taken) < names.limit
            # With no slot to give, the order does not matter.
            for name in sorted(fresh, key=lambda name: (-fresh[name], name)) if free else fresh:
                labels[name] = names.label(name, taken)

    @staticmethod
    def _figures(window: _Window, ops: list[OperationReport]) -> dict[Series, float]:
        out: dict[Series, float] = {}
        get = out.get
        op_labels, layer_labels, origin_labels = window.labels
        for o in ops:
            name = op_labels[o.operation]
            for kind, n in o.kinds.items():
                series: Series = ("arrivals", (name, kind.value))
                out[series] = get(series, 0.0) + n
            for metric, attr, _ in _SIMPLE:
                series = (metric, (name,))
                out[series] = get(series, 0.0) + getattr(o, attr)
            for layer, n in o.retries_by.items():
                series = ("retries", (name, layer_labels[layer]))
                out[series] = get(series, 0.0) + n
            for origin, n in o.reminted_by.items():
                series = ("reminted", (name, origin_labels[origin]))
                out[series] = get(series, 0.0) + n
        return out

    def _forget(self, kind: int, gone: set[str]) -> None:
        """Names no window shows any more: their series are no longer exported (see the module
        docstring for why their totals are not moved to ``~other``)."""
        at = 0 if kind == _OPERATION else 1
        metric = _BY_NAME[kind]
        retired = self._retired
        for series in [s for s in retired if (metric is None or s[0] == metric)
                       and s[1][at] in gone]:
            del retired[series]

    @staticmethod
    def _latest(windows: dict[float, _Window],
                shown: dict[float, list[OperationReport]]) -> dict[str, dict[str, float]]:
        """The gauges of each operation label, from the newest window that shows it (names folded
        into one label: amplification and coverage of their sums, the largest max)."""
        newest: dict[str, tuple[float, list[OperationReport]]] = {}
        for start, ops in shown.items():
            labels = windows[start].labels[_OPERATION]
            for o in ops:
                name = labels[o.operation]
                seen = newest.get(name)
                if seen is None or seen[0] < start:
                    newest[name] = (start, [o])
                elif seen[0] == start:
                    seen[1].append(o)
        out: dict[str, dict[str, float]] = {}
        for name, (_, ops) in newest.items():
            gauges: dict[str, float] = {"approximate": float(any(o.approximate for o in ops))}
            if len(ops) == 1:
                o = ops[0]
                values = {"amplification": o.amplification, "coverage": o.coverage,
                          **{stat: getattr(o.per_key, attr) for stat, attr in _PER_KEY}}
            else:
                attributable = sum(o.attributable for o in ops)
                distinct = sum(o.distinct_keys for o in ops)
                arrivals = sum(o.arrivals for o in ops)
                tops = [o.per_key.max for o in ops if o.per_key.max is not None]
                values = {"amplification": attributable / distinct if distinct else None,
                          "coverage": attributable / arrivals if arrivals else None,
                          "max": max(tops) if tops else None}
            gauges.update({k: v for k, v in values.items() if v is not None})
            out[name] = gauges
        return out

    def _families(self, totals: dict[Series, float], gauges: dict[str, dict[str, float]],
                  dropped: dict[str, int], errors: int) -> Iterator[Metric]:
        p = f"{self._p}_ledger_"
        by_metric: dict[str, list[tuple[tuple[str, ...], float]]] = {}
        for (metric, labels), v in sorted(totals.items()):
            by_metric.setdefault(metric, []).append((labels, v))
        for metric, label, doc in _LABELLED:
            family = CounterMetricFamily(p + metric, doc, labels=["operation", label])
            for labels, v in by_metric.get(metric, ()):
                family.add_metric(list(labels), v)
            yield family
        for metric, _, doc in _SIMPLE:
            family = CounterMetricFamily(p + metric, doc, labels=["operation"])
            for labels, v in by_metric.get(metric, ()):
                family.add_metric(list(labels), v)
            yield family
        family = CounterMetricFamily(p + "dropped", "Arrivals lost before they were counted",
                                     labels=["reason"])
        for reason, n in sorted(dropped.items()):
            family.add_metric([reason], n)
        yield family
        yield CounterMetricFamily(p + "report_errors", "Scrapes whose ledger report failed",
                                  value=errors)
        amplification = GaugeMetricFamily(
            p + "amplification", "Attributable arrivals per distinct key, latest window",
            labels=["operation"])
        coverage = GaugeMetricFamily(
            p + "coverage_ratio", "Attributable share of arrivals, latest window",
            labels=["operation"])
        per_key = GaugeMetricFamily(
            p + "arrivals_per_key", "Arrivals per attributable key, latest window",
            labels=["operation", "stat"])
        approximate = GaugeMetricFamily(
            p + "approximate", "1 if the latest window's figures are estimates",
            labels=["operation"])
        for name, values in sorted(gauges.items()):
            if "amplification" in values:
                amplification.add_metric([name], values["amplification"])
            if "coverage" in values:
                coverage.add_metric([name], values["coverage"])
            for stat, _ in _PER_KEY:
                if stat in values:
                    per_key.add_metric([name, stat], values[stat])
            approximate.add_metric([name], values["approximate"])
        yield from (amplification, coverage, per_key, approximate)
        if self._events:
            yield self._event_family()

    def _event_family(self) -> Metric:
        family = CounterMetricFamily(f"{self._p}_events",
                                     "askonce.stats(): events that must not pass silently",
                                     labels=["event"])
        names = self._event_names
        folded: dict[str, int] = {}
        for event, n in sorted(_stats.stats().items()):  # a name keeps its label once it has one
            name = names.label(event, names.own)
            folded[name] = folded.get(name, 0) + n
        for event, n in folded.items():
            family.add_metric([event], n)
        return family


def register(ledger: LedgerShell, registry: CollectorRegistry = REGISTRY,
             **options: Any) -> LedgerCollector:
    """Make a :class:`LedgerCollector` for ``ledger`` and register it (default: global registry)."""
    collector = LedgerCollector(ledger, **options)
    registry.register(collector)
    return collector
