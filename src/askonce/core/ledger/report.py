"""What a target's ledger reports: per-operation arrivals, amplification, coverage, heavy keys.

Plain frozen values (:class:`Report`, :class:`OperationReport`, :class:`Totals`, :class:`PerKey`,
:class:`HeavyKey`), made by :mod:`askonce.core.ledger` and read by the report endpoint, Prometheus
and the audit tool. See :mod:`askonce.core.ledger` for what the counts mean.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["HeavyKey", "Kind", "OperationReport", "PerKey", "Report", "Totals"]


class Kind(enum.Enum):
    ATTRIBUTABLE = "attributable"
    REMINTED = "reminted"
    UNKEYED = "unkeyed"
    MALFORMED = "malformed"



@dataclass(frozen=True, slots=True)
class PerKey:
    """Arrivals per attributable key. ``p50``/``p99`` are nearest-rank percentiles over the exactly
    tracked keys; ``max`` also covers heavy keys found by the sketch (as lower bounds)."""

    mean: float | None
    p50: int | None
    p99: int | None
    max: int | None

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True, slots=True)
class HeavyKey:
    key: str
    arrivals: int  # a lower bound: the true count is within arrivals .. arrivals + error
    principal: str = ""
    error: int = 0  # 0 for a key counted exactly; the sketch's bound for one found by the sketch

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "principal": self.principal, "arrivals": self.arrivals,
                "error": self.error}


def _plain(report: Any) -> dict[str, Any]:
    """A report value's fields as JSON-ready data, in field order: kinds by name, nested values
    as dicts."""
    out: dict[str, Any] = {}
    for f in fields(report):
        value = getattr(report, f.name)
        if isinstance(value, Mapping):
            value = {k.value if isinstance(k, Kind) else k: n for k, n in value.items()}
        elif isinstance(value, tuple):
            value = [v.to_dict() for v in value]
        elif hasattr(value, "to_dict"):
            value = value.to_dict()
        out[f.name] = value
    return out


def ratio(a: int, b: int) -> float | None:
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
    # Attributable arrivals answered by work they did not start (joined to a run in flight, or
    # replayed), and the work started per question beside amplification's arrivals per question.
    joined: int
    work_per_question: float | None
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
        return _plain(self)


@dataclass(frozen=True, slots=True)
class Totals:
    """Additive figures summed over the operations and windows of a report. ``distinct_keys`` is
    the sum of per-operation, per-window counts: a key seen by two operations or windows counts
    twice."""

    arrivals: int
    attributable: int
    distinct_keys: int
    amplification: float | None
    joined: int
    work_per_question: float | None
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
        return _plain(self)


@dataclass(frozen=True, slots=True)
class Report:
    generated_at: float
    window: float
    operations: tuple[OperationReport, ...]  # ordered by window start, then operation name
    # Arrivals the shells lost before counting, by reason, since creation.
    dropped: Mapping[str, int]

    @property
    def approximate(self) -> bool:
        return any(o.approximate for o in self.operations)

    def find(self, operation: str, start: float | None = None) -> OperationReport | None:
        """The operation's figures for the window beginning at ``start`` (default: its latest
        window)."""
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
        joined = sum(o.joined for o in ops)
        reminted_by: dict[str, int] = {}
        retries_by: dict[str, int] = {}
        for o in ops:
            for name, n in o.reminted_by.items():
                reminted_by[name] = reminted_by.get(name, 0) + n
            for name, n in o.retries_by.items():
                retries_by[name] = retries_by.get(name, 0) + n
        return Totals(
            arrivals=arrivals, attributable=attributable, distinct_keys=distinct,
            amplification=ratio(attributable, distinct), joined=joined,
            work_per_question=ratio(attributable - joined, distinct),
            coverage=ratio(attributable, arrivals),
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
