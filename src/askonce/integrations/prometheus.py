"""Prometheus (prometheus-client) metrics: the ledger's figures per operation, ``askonce.stats()``.

::

    from prometheus_client import REGISTRY, start_http_server
    from askonce.integrations.prometheus import LedgerCollector

    # a MemoryLedger or RedisLedger (anything with report(now))
    REGISTRY.register(LedgerCollector(ledger))
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
where they were (and counts the failure). Label cardinality is bounded: at most ``max_operations``
operation names (further ones become ``~other``), layer and origin names are bounded by the ledger's
``max_names``, and at most ``max_events`` event names (then ``~other``). With a :class:`RedisLedger`
every replica reports the fleet's figures: scrape one of them, or aggregate with ``max``, not
``sum``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, CollectorRegistry

from askonce import _stats
from askonce.core import is_int
from askonce.core.ledger import OTHER, OperationReport, Report
from askonce.ledger.store import LedgerShell

__all__ = ["LedgerCollector", "register"]

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


class LedgerCollector:
    """A prometheus-client collector over a ledger shell's reports; see the module docstring."""

    def __init__(self, ledger: LedgerShell | None = None, *,
                 report: Callable[[float], Report] | None = None,
                 clock: Callable[[], float] = time.time, events: bool = True,
                 max_operations: int = 512, max_events: int = 256,
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
        for name, n in (("max_operations", max_operations), ("max_events", max_events)):
            if not is_int(n) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        if (not isinstance(prefix, str) or not prefix.isascii()
                or not prefix.replace("_", "").isalnum() or not prefix[0].isalpha()):
            raise ValueError(f"prefix must be a metric name prefix like 'askonce', got {prefix!r}")
        self._report: Callable[[float], Report] = report
        self._clock = clock
        self._events = events
        self._max_ops = max_operations
        self._max_events = max_events
        self._p = prefix
        self._lock = threading.Lock()
        self._retired: dict[Series, float] = {}  # windows that left the report, summed
        # (operation, start) -> its figures
        self._shown: dict[tuple[str, float], dict[Series, float]] = {}
        self._names: set[str] = set()
        self._latest: dict[str, OperationReport] = {}
        self._dropped: dict[str, int] = {}
        self._errors = 0

    def describe(self) -> list[Metric]:
        """The metric names, without reading a report: registering touches no ledger, no Redis."""
        return list(self._families({}, {}, {}, 0))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._refresh()
            totals = dict(self._retired)
            for figures in self._shown.values():
                for series, v in figures.items():
                    totals[series] = totals.get(series, 0.0) + v
            families = list(self._families(totals, self._latest, self._dropped, self._errors))
        yield from families

    def _refresh(self) -> None:
        try:
            report = self._report(self._clock())
        except Exception:
            self._errors += 1
            _stats.count("prometheus.report.error")
            return
        shown: dict[tuple[str, float], dict[Series, float]] = {}
        latest: dict[str, OperationReport] = {}
        for o in report.operations:
            name = self._name(o.operation)
            shown[(o.operation, o.start)] = self._figures(o, name)
            latest[name] = o  # operations come in window order: the last one seen is the newest
        for window, figures in self._shown.items():
            if window not in shown:  # left the report: its last figures are final
                for series, v in figures.items():
                    self._retired[series] = self._retired.get(series, 0.0) + v
        self._shown = shown
        self._latest = latest
        self._dropped = dict(report.dropped)

    def _name(self, operation: str) -> str:
        if operation in self._names:
            return operation
        if len(self._names) < self._max_ops:
            self._names.add(operation)
            return operation
        return OTHER

    def _figures(self, o: OperationReport, name: str) -> dict[Series, float]:
        out: dict[Series, float] = {}

        def add(series: Series, v: float) -> None:
            out[series] = out.get(series, 0.0) + v

        for kind, n in o.kinds.items():
            add(("arrivals", (name, kind.value)), n)
        for metric, attr, _ in _SIMPLE:
            add((metric, (name,)), getattr(o, attr))
        for layer, n in o.retries_by.items():
            add(("retries", (name, layer)), n)
        for origin, n in o.reminted_by.items():
            add(("reminted", (name, origin)), n)
        return out

    def _families(self, totals: dict[Series, float], latest: dict[str, OperationReport],
                  dropped: dict[str, int], errors: int) -> Iterator[Metric]:
        p = f"{self._p}_ledger_"
        for metric, label, doc in _LABELLED:
            family = CounterMetricFamily(p + metric, doc, labels=["operation", label])
            for (m, labels), v in sorted(totals.items()):
                if m == metric:
                    family.add_metric(list(labels), v)
            yield family
        for metric, _, doc in _SIMPLE:
            family = CounterMetricFamily(p + metric, doc, labels=["operation"])
            for (m, labels), v in sorted(totals.items()):
                if m == metric:
                    family.add_metric(list(labels), v)
            yield family
        family = CounterMetricFamily(p + "dropped", "Arrivals lost before they were counted",
                                     labels=["reason"])
        for reason, n in sorted(dropped.items()):
            family.add_metric([reason], n)
        yield family
        yield CounterMetricFamily(p + "report_errors", "Scrapes whose ledger report failed",
                                  value=errors)
        gauges = {
            "amplification": GaugeMetricFamily(
                p + "amplification", "Attributable arrivals per distinct key, latest window",
                labels=["operation"]),
            "coverage": GaugeMetricFamily(
                p + "coverage_ratio", "Attributable share of arrivals, latest window",
                labels=["operation"]),
            "per_key": GaugeMetricFamily(
                p + "arrivals_per_key", "Arrivals per attributable key, latest window",
                labels=["operation", "stat"]),
            "approximate": GaugeMetricFamily(
                p + "approximate", "1 if the latest window's figures are estimates",
                labels=["operation"]),
        }
        for name, o in sorted(latest.items()):
            if o.amplification is not None:
                gauges["amplification"].add_metric([name], o.amplification)
            if o.coverage is not None:
                gauges["coverage"].add_metric([name], o.coverage)
            for stat, attr in _PER_KEY:
                v = getattr(o.per_key, attr)
                if v is not None:
                    gauges["per_key"].add_metric([name, stat], v)
            gauges["approximate"].add_metric([name], 1.0 if o.approximate else 0.0)
        yield from gauges.values()
        if self._events:
            yield self._event_family()

    def _event_family(self) -> Metric:
        family = CounterMetricFamily(f"{self._p}_events",
                                     "askonce.stats(): events that must not pass silently",
                                     labels=["event"])
        folded: dict[str, int] = {}
        for i, (event, n) in enumerate(sorted(_stats.stats().items())):
            name = event if i < self._max_events else OTHER
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
