"""``askonce audit``: the ledger's report from access logs that recorded ``askonce-question``.

A target that logs the header it received can be audited after the fact, without askonce running in
it: every log line is one arrival, classified and counted by the same core :class:`Ledger` a live
target uses, so the figures mean the same. Files are read line by line (memory does not grow with
the file; the ledger's own bounds hold, and past them figures turn approximate, as they do live),
plain, gzip (``.gz``) or ``-`` for stdin.

Two formats:

* ``jsonl`` - one JSON object per line. The header is the field ``askonce_question``
  (``question_field``), the time ``time`` (epoch seconds - milliseconds if over 1e11 - or an ISO
  8601 string), the operation ``operation`` (else ``method`` and ``path`` give a route-like name),
  the principal ``principal``.
* ``nginx`` - nginx/Envoy-style lines of bare words, ``"quoted"`` and ``[bracketed]`` fields, e.g.
  nginx's ``log_format`` with ``"$http_askonce_question"`` appended. The header is field ``field``
  (counted from 1, as awk does; default: the first quoted field that starts with ``v=``); the time
  is the first bracketed field (``10/Oct/2000:13:55:36 -0700`` or ISO 8601); the operation comes
  from the first ``"METHOD /path PROTO"`` field, with ids in the path replaced by ``{id}``. nginx
  escapes ``"`` as ``\\x22`` (``escape=default``) or ``\\"`` (``escape=json``); both are undone. Or
  give ``regex`` with named groups ``question``, ``time``, ``operation`` (or ``method`` and
  ``path``) and ``principal``. ``upstream``: the log is a proxy's, one line per client request,
  and the first quoted field that lists upstream statuses (nginx's
  ``"$upstream_status"``: ``504, 200``, groups joined by `` : ``) says how many tries the proxy
  made: each is an arrival at the target, so the proxy's own retries show as undeclared retries.

A missing header (absent, empty, ``-``) is an unkeyed arrival; one that does not parse is malformed.
A line that cannot be read at all (not JSON, no time, longer than 1 MiB) is a *bad line*: counted
per reason (``askonce.stats()`` ``audit.bad.<reason>``, and as dropped in the report), never fatal
here (``askonce audit`` exits 1 when not one line of a log could be read).
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import json
import math
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from askonce import _stats
from askonce.core import is_int, is_real, wire
from askonce.core.ledger import Ledger, LedgerPolicy, Report, window_index
from askonce.core.question import Question
from askonce.core.wire import Limits, Malformed

__all__ = ["AUDIT_POLICY", "ENGINES", "AuditResult", "LogFormat", "audit_file", "audit_lines",
           "engine_for"]

MAX_LINE = 1 << 20
AUDIT_POLICY = LedgerPolicy(window=3600.0, windows_kept=23, max_exact_keys=50_000)
"""Hour-long windows, the last day of the log reported; 50,000 exact keys per operation and hour."""
# Clamp nothing.
_LIMITS = Limits(max_budget=wire.MAX_BUDGET, max_deadline=wire.MAX_DEADLINE_MS / 1000)
_FIELD = re.compile(rb'"([^"\\]*(?:\\.[^"\\]*)*)"|\[([^\]]*)\]|([^\s"\[]\S*)')
_REQUEST = re.compile(rb"([A-Z]{3,10}) (\S+)(?: HTTP/[0-9.]+)?")
_ESCAPE = re.compile(r'\\x([0-9A-Fa-f]{2})|\\(["\\])')
_UNSET = ("", "-")
# nginx's $upstream_status: a status (or "-") per try, ", " between tries, " : " between groups.
_TRIES = re.compile(rb"(?:[0-9]{3}|-)(?:(?:, | : )(?:[0-9]{3}|-))*")
_MAX_TRIES = 64  # tries counted from one line at most: a proxy's own limit is far below

Parsed = tuple[float, str, Any, Any]
"""A line read: time, operation, the header's value as logged, the principal's."""


@dataclass(frozen=True, slots=True)
class LogFormat:
    """How to read a log; see the module docstring."""

    kind: str = "jsonl"
    question_field: str = "askonce_question"
    time_field: str = "time"
    operation_field: str = "operation"
    principal_field: str = "principal"
    field: int | None = None  # nginx: the header's field, from 1
    principal_index: int | None = None  # nginx: the principal's field, from 1
    # nginx: named groups question, time, operation | method + path, principal
    regex: str | None = None
    upstream: bool = False  # nginx: a proxy's log; each upstream try is an arrival

    def __post_init__(self) -> None:
        if self.kind not in ("jsonl", "nginx"):
            raise ValueError(f"log format must be 'jsonl' or 'nginx', got {self.kind!r}")
        for name in ("field", "principal_index"):
            n = getattr(self, name)
            if n is not None and (not is_int(n) or n < 1):
                raise ValueError(f"{name} counts fields from 1, got {n!r}")
        if self.regex is not None:
            try:
                groups = re.compile(self.regex).groupindex
            except re.error as exc:
                raise ValueError(f"regex does not compile: {exc}") from exc
            if "question" not in groups or "time" not in groups:
                raise ValueError("regex needs named groups 'question' and 'time'")


@dataclass(slots=True)
class AuditResult:
    """What an audit read: the report at the last time seen, lines read, and bad lines per
    reason."""

    report: Report
    lines: int
    bad: dict[str, int] = field(default_factory=dict)
    first: float | None = None
    last: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "bad_lines": dict(self.bad), "first": self.first,
                "last": self.last, "report": self.report.to_dict(),
                "totals": self.report.totals().to_dict()}


class _Times:
    """Timestamps to epoch seconds, remembering the last text (log lines come many to a second)."""

    __slots__ = ("_last", "_value")

    def __init__(self) -> None:
        self._last: Any = None
        self._value: float | None = None

    def __call__(self, raw: Any) -> float | None:
        if is_real(raw):
            t = float(raw)  # json reads NaN, Infinity and 1e400: no time
            return (t / 1000 if t > 1e11 else t) if math.isfinite(t) else None
        if raw == self._last:
            return self._value
        value: float | None = None
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if isinstance(text, str) and text:
            try:
                value = float(text)
                value = (value / 1000 if value > 1e11 else value) if math.isfinite(value) else None
            except ValueError:
                value = _parse_time(text)
        self._last, self._value = raw, value
        return value


def _parse_time(text: str) -> float | None:
    for parse in (datetime.datetime.fromisoformat, _nginx_time):
        try:
            t = parse(text)
        except ValueError:
            continue
        if t.tzinfo is None:
            t = t.replace(tzinfo=datetime.UTC)  # a log without a zone is read as UTC
        return t.timestamp()
    return None


def _nginx_time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%d/%b/%Y:%H:%M:%S %z")


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)) if m.group(1) else m.group(2), text)


def _operation(method: str, path: str) -> str:
    from askonce.core.naming import path_template  # the live targets' fallback naming

    return path_template(method, path.split("?", 1)[0])


class _Auditor:
    def __init__(self, fmt: LogFormat, policy: LedgerPolicy, secret: Any) -> None:
        self.fmt = fmt
        self.ledger = Ledger(policy)
        self.secret = secret
        self.bad: dict[str, int] = {}
        self.lines = 0
        self.first: float | None = None
        self.last: float | None = None
        self.times = _Times()
        self.regex = re.compile(fmt.regex) if fmt.regex else None
        self.parse = self._jsonl if fmt.kind == "jsonl" else self._nginx
        self.routes: dict[tuple[bytes, bytes], str] = {}
        self.tries = 1  # arrivals the line just parsed stands for (``LogFormat.upstream``)

    def fail(self, reason: str) -> None:
        self.bad[reason] = self.bad.get(reason, 0) + 1

    def arrival(self, t: float, operation: str, header: Any, principal: Any) -> None:
        try:
            # As the ledger checks it: a bad line, not the end.
            window_index(t, self.ledger.policy.window)
        except ValueError:
            return self.fail("time")
        if self.first is None:
            self.first = t
        self.last = t if self.last is None or t > self.last else self.last
        principal = (principal if isinstance(principal, str)
                     else "" if principal is None else str(principal))
        if header is None or header in _UNSET:
            self.ledger.record(t, operation, key=None, principal=principal)
            return None
        q = self.question(header)
        if q is None:
            self.ledger.record(t, operation, key=None, principal=principal)
        elif isinstance(q, Malformed):
            self.ledger.record(t, operation, key=None, principal=principal, malformed=True)
        else:
            self.ledger.record(t, operation, key=q.key, edge=q.edge, origin=q.origin,
                               path=q.path, principal=principal)
        return None

    def question(self, header: Any) -> Question | Malformed | None:
        """The header's question; ``None`` for none (unkeyed)."""
        if header is None or header in _UNSET:
            return None
        q = (wire.parse_question(header, 0.0, _LIMITS) if isinstance(header, str)
             else Malformed("type"))
        if isinstance(q, Malformed) or not q.edge or self.secret is None:
            return q
        from askonce.core.signing import verify_edge

        return q if verify_edge(header, self.secret) else dataclasses.replace(q, edge=False)

    def record(self, line: bytes) -> None:
        got = self.parse(line)
        if isinstance(got, str):
            self.fail(got)
            return
        for _ in range(self.tries):
            self.arrival(*got)
        self.tries = 1

    def _jsonl(self, line: bytes) -> Parsed | str:
        try:
            obj = json.loads(line)
        except ValueError:
            return "json"
        if not isinstance(obj, dict):
            return "json"
        fmt = self.fmt
        t = self.times(obj.get(fmt.time_field))
        if t is None:
            return "time"
        operation = obj.get(fmt.operation_field)
        if not isinstance(operation, str):
            method, path = obj.get("method"), obj.get("path")
            operation = (_operation(method, path)
                         if isinstance(method, str) and isinstance(path, str) else "~unknown")
        return t, operation, obj.get(fmt.question_field), obj.get(fmt.principal_field)

    def _nginx(self, line: bytes) -> Parsed | str:
        if self.regex is not None:
            return self._by_regex(line.decode("utf-8", "replace"))
        # Fields stay bytes until one is needed: decoding and unescaping all of them would cost more
        # than the rest of the audit together.
        header: bytes | None = None
        t: float | None = None
        request: re.Match[bytes] | None = None
        principal: bytes | None = None
        want, who = self.fmt.field, self.fmt.principal_index
        counting = self.fmt.upstream
        self.tries = 1
        parts = line.split(b'"')
        if want is None and who is None and len(parts) % 2 and b'\\"' not in line:
            # The usual case, no field numbers needed and no quote inside a quoted field: splitting
            # at quotes is much quicker than the general tokenizer below.
            for outside in parts[::2]:
                start = outside.find(b"[")
                end = outside.find(b"]", start)
                if 0 <= start < end:
                    t = self.times(outside[start + 1:end])
                    break
            for raw in parts[1::2]:
                if header is None and raw.startswith(b"v="):
                    header = raw
                elif counting and self._count_tries(raw):
                    counting = False
                elif request is None:
                    request = _REQUEST.fullmatch(raw)
        else:
            for i, m in enumerate(_FIELD.finditer(line), 1):
                kind = m.lastindex
                raw = m.group(kind or 3)
                if i == want or (want is None and header is None and kind == 1
                                 and raw.startswith(b"v=")):
                    header = raw
                if i == who:
                    principal = raw
                if kind == 2:
                    if t is None:
                        t = self.times(raw)
                elif kind == 1 and counting and self._count_tries(raw):
                    counting = False
                elif kind == 1 and request is None:
                    request = _REQUEST.fullmatch(raw)
        if t is None:
            return "time"
        operation = ("~unknown" if request is None
                     else self._route(request.group(1), request.group(2)))
        return (t, operation,
                None if header is None else _unescape(header.decode("utf-8", "replace")),
                None if principal is None else _unescape(principal.decode("utf-8", "replace")))

    def _count_tries(self, raw: bytes) -> bool:
        """Is ``raw`` an upstream status list (the first one on the line counts)? Its tries are the
        arrivals the line stands for, keyed or not."""
        if _TRIES.fullmatch(raw) is None or not any(c in b"0123456789" for c in raw):
            return False
        self.tries = min(_MAX_TRIES, raw.count(b",") + raw.count(b":") + 1)
        return True

    def _route(self, method: bytes, path: bytes) -> str:
        found = self.routes.get((method, path))
        if found is None:
            if len(self.routes) >= 4096:
                self.routes.clear()
            found = self.routes[(method, path)] = _operation(method.decode("ascii"),
                                                             path.decode("utf-8", "replace"))
        return found

    def _by_regex(self, text: str) -> Parsed | str:
        assert self.regex is not None
        m = self.regex.search(text)
        if m is None:
            return "regex"
        g = m.groupdict()
        t = self.times(g.get("time"))
        if t is None:
            return "time"
        operation = g.get("operation")
        if operation is None:
            method, path = g.get("method"), g.get("path")
            operation = _operation(method, path) if method and path else "~unknown"
        header = g.get("question")
        return t, operation, None if header is None else _unescape(header), g.get("principal")


def _lines(stream: IO[bytes]) -> Iterator[bytes | None]:
    """Lines of at most ``MAX_LINE`` bytes; ``None`` for a longer one (its rest is skipped, never
    held)."""
    while True:
        line = stream.readline(MAX_LINE)
        if not line:
            return
        if len(line) == MAX_LINE and not line.endswith(b"\n"):
            while True:
                rest = stream.readline(MAX_LINE)
                if not rest or rest.endswith(b"\n"):
                    break
            yield None
            continue
        yield line


def audit_lines(lines: Iterable[bytes | None], fmt: LogFormat = LogFormat(),
                policy: LedgerPolicy = AUDIT_POLICY,
                secret: bytes | str | Sequence[bytes | str] | None = None) -> AuditResult:
    """Audit log lines (bytes; ``None`` marks a line too long to read). ``secret``: count ``e`` as
    an edge key only with a valid signature (:mod:`askonce.core.signing`)."""
    auditor = _Auditor(fmt, policy, secret)
    parse, arrival, fail = auditor.parse, auditor.arrival, auditor.fail
    n = 0
    for line in lines:
        n += 1
        if line is None:
            fail("too-long")
        elif line.strip():
            got = parse(line)
            if got.__class__ is str:
                fail(got)
            else:
                arrival(*got)
                if auditor.tries > 1:  # a proxy's log (LogFormat.upstream): its own retries
                    for _ in range(auditor.tries - 1):
                        arrival(*got)
                    auditor.tries = 1
        else:
            n -= 1  # blank lines are no arrivals and no errors
    return _result(auditor, n)


def _result(auditor: _Auditor, n: int) -> AuditResult:
    for reason, count in auditor.bad.items():
        auditor.ledger.note_dropped(count, f"bad line: {reason}")
        _stats.count(f"audit.bad.{reason}", count)
    now = auditor.last if auditor.last is not None else 0.0
    return AuditResult(auditor.ledger.report(now), n, dict(auditor.bad), auditor.first,
                       auditor.last)


ENGINES = ("auto", "polars", "python")
"""``auto``: polars when it is installed (the ``audit`` extra) and reads the format, else Python."""


def engine_for(engine: str, fmt: LogFormat,
               secret: bytes | str | Sequence[bytes | str] | None = None) -> Any:
    """The polars engine's module, or ``None`` for the line-by-line reader; ``ValueError`` if
    ``engine`` is ``"polars"`` and it cannot read this format or is not installed."""
    if engine not in ENGINES:
        raise ValueError(f"audit engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "python":
        return None
    try:
        from askonce.ledger import _polars
    except ImportError:
        if engine == "polars":
            raise ValueError("the polars engine needs polars: pip install 'askonce[audit]'"
                             ) from None
        return None
    if not _polars.supports(fmt, secret):
        if engine == "polars":
            raise ValueError("the polars engine reads neither --regex, --field, "
                             "--principal-index, --upstream nor --secret-env: "
                             "use --engine python")
        return None
    return _polars


def audit_file(path: str, fmt: LogFormat = LogFormat(), policy: LedgerPolicy = AUDIT_POLICY,
               secret: bytes | str | Sequence[bytes | str] | None = None,
               engine: str = "auto") -> AuditResult:
    """Audit a file (``.gz`` is decompressed on the fly; ``-`` is stdin), streaming. ``engine``:
    see :data:`ENGINES`; both give the same result."""
    fast = engine_for(engine, fmt, secret)
    if path == "-":
        return _audit_stream(sys.stdin.buffer, fmt, policy, secret, fast)
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as stream:
        return _audit_stream(stream, fmt, policy, secret, fast)


def _audit_stream(stream: IO[bytes], fmt: LogFormat, policy: LedgerPolicy,
                  secret: bytes | str | Sequence[bytes | str] | None, fast: Any) -> AuditResult:
    if fast is None:
        return audit_lines(_lines(stream), fmt, policy, secret)
    auditor = _Auditor(fmt, policy, secret)
    return _result(auditor, fast.audit_stream(stream, auditor))
