"""``askonce report`` and ``askonce audit``: the ledger's figures in a terminal table (rich if
installed) or JSON.

::

    askonce report --redis redis://127.0.0.1:6379/0          # what the replicas sharing Redis count
    askonce report --url http://host:8000/askonce/report.json # what a ReportApp serves
    askonce audit access.log.gz --format nginx               # the same figures from an access log

``askonce.cli`` registers these with :func:`add_report_parser` and :func:`add_audit_parser`
(``python -m askonce report ...`` runs them too). Exit status: 0, 1 when the
figures cannot be had (Redis away, no ledger under the prefix, an unreadable file), 2 for usage
errors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

__all__ = ["add_audit_parser", "add_report_parser"]

# One operation's figures in one window, as Report.to_dict() writes them.
Row = dict[str, Any]


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="the target's ledger: arrivals per question, coverage, who retried and who re-keyed",
        description="Read the shared ledger from Redis (--redis) or a running ReportApp (--url).")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--redis", metavar="URL",
                        help="Redis URL the RedisLedger replicas share (default: "
                        "$ASKONCE_REDIS or redis://127.0.0.1:6379/0)")
    source.add_argument("--url", metavar="URL", help="a ReportApp's report.json")
    p.add_argument("--prefix", default="askonce",
                   help="the RedisLedger's key prefix (default: askonce)")
    p.add_argument("--timeout", type=_seconds, default=5.0,
                   help="seconds to wait for Redis or the URL")
    _output_options(p)
    p.set_defaults(func=_report)
    return p


def add_audit_parser(subparsers: Any) -> argparse.ArgumentParser:
    from askonce.ledger.audit import AUDIT_POLICY

    p: argparse.ArgumentParser = subparsers.add_parser(
        "audit",
        help="the ledger's report computed from access logs that recorded askonce-question",
        description="Stream an access log (plain, .gz, or - for stdin) through the ledger.")
    p.add_argument("file")
    p.add_argument("--format", choices=["jsonl", "nginx"], default="jsonl")
    p.add_argument("--question-field", default="askonce_question", help="jsonl: the header's field")
    p.add_argument("--time-field", default="time", help="jsonl: epoch seconds or ISO 8601")
    p.add_argument("--operation-field", default="operation", help="jsonl (else method + path)")
    p.add_argument("--principal-field", default="principal", help="jsonl")
    p.add_argument("--field", type=int, metavar="N",
                   help="nginx: the header's field, from 1 (default: the "
                   "first quoted field starting with v=)")
    p.add_argument("--principal-index", type=int, metavar="N",
                   help="nginx: the principal's field, from 1")
    p.add_argument("--regex",
                   help="nginx: named groups question, time, operation or method+path, principal")
    p.add_argument("--upstream", action="store_true",
                   help="nginx: a proxy's log; each try in the quoted \"$upstream_status\" field "
                   "after the header is an arrival (the proxy's own retries)")
    p.add_argument("--window", type=float, default=AUDIT_POLICY.window,
                   help="seconds per window (default 3600)")
    p.add_argument("--windows-kept", type=int, default=AUDIT_POLICY.windows_kept,
                   help="closed windows reported before the last (default 23)")
    p.add_argument("--max-exact-keys", type=int, default=AUDIT_POLICY.max_exact_keys,
                   help="exact keys per operation and window; beyond: estimates (default 50000)")
    p.add_argument("--engine", choices=["auto", "polars", "python"], default="auto",
                   help="polars (pip install 'askonce[audit]') or the line-by-line reader; auto: "
                   "polars when installed and it reads the format. Both give the same figures")
    p.add_argument("--secret-env", metavar="VAR",
                   help="environment variable holding the edge-key signing "
                   "secret: e counts only with a valid signature")
    _output_options(p)
    p.set_defaults(func=_audit)
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    # NaN fails too; 0 or less: every client library refuses it, later and less clearly.
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds within (0, 3600], got {text!r}")
    return value


def _output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--plain", action="store_true",
                   help="a plain-text table even if rich is installed")


# --- the commands ---------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    try:
        data = _from_url(args.url, args.timeout) if args.url else _from_redis(args)
    except ModuleNotFoundError:  # redis: askonce.cli names the extra
        raise
    except Exception as exc:
        print(f"askonce report: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    try:
        _print(data, args.plain, f"askonce ledger ({args.url or _redis_url(args)})")
    # A URL may answer anything.
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        print(f"askonce report: {args.url or _redis_url(args)} answered a malformed report "
              f"({exc!r})", file=sys.stderr)
        return 1
    return 0


def _redis_url(args: argparse.Namespace) -> str:
    return str(args.redis or os.environ.get("ASKONCE_REDIS") or "redis://127.0.0.1:6379/0")


def _from_redis(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from askonce.ledger.store import read_report
    from askonce.stores.redis import no_retry

    client = redis.Redis.from_url(_redis_url(args), socket_timeout=args.timeout,
                                  socket_connect_timeout=args.timeout, retry=no_retry())
    try:
        return read_report(client, time.time(), prefix=args.prefix).to_dict()
    finally:
        client.close()


def _from_url(url: str, timeout: float) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read()
    try:
        data: dict[str, Any] = json.loads(body)
    except ValueError:  # an HTML page, a proxy's error page, ...
        raise ValueError(f"{url} did not answer with an askonce report (not JSON: "
                         f"{body[:40]!r})") from None
    if not isinstance(data, dict) or not isinstance(data.get("operations"), list):
        raise ValueError(f"{url} did not answer with a ledger report")
    return data


def _audit(args: argparse.Namespace) -> int:
    from askonce.core.ledger import LedgerPolicy
    from askonce.ledger.audit import LogFormat, audit_file, engine_for

    try:  # the flags: a usage error (2)
        fmt = LogFormat(kind=args.format, question_field=args.question_field,
                        time_field=args.time_field, operation_field=args.operation_field,
                        principal_field=args.principal_field, field=args.field,
                        principal_index=args.principal_index, regex=args.regex,
                        upstream=args.upstream)
        policy = LedgerPolicy(window=args.window, windows_kept=args.windows_kept,
                              max_exact_keys=args.max_exact_keys)
        engine_for(args.engine, fmt, args.secret_env)
    except ValueError as exc:
        print(f"askonce audit: {exc}", file=sys.stderr)
        return 2
    try:  # the environment and the file: the figures cannot be had (1)
        secret = None
        if args.secret_env:
            secret = os.environ.get(args.secret_env)
            if not secret:
                raise ValueError(f"environment variable {args.secret_env} is not set")
        started = time.perf_counter()
        result = audit_file(args.file, fmt, policy, secret, args.engine)
        elapsed = time.perf_counter() - started
    except (OSError, ValueError) as exc:
        print(f"askonce audit: {exc}", file=sys.stderr)
        return 1
    unread = _unread(result, fmt.kind)
    if unread is not None:  # no line read at all: the figures cannot be had
        print(f"askonce audit: {args.file}: {unread}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    _print(result.report.to_dict(), args.plain, f"askonce audit of {args.file}")
    bad = ", ".join(f"{reason} {n}" for reason, n in sorted(result.bad.items())) or "none"
    print(f"{result.lines} lines in {elapsed:.1f} s; bad lines: {bad}")
    return 0


def _unread(result: Any, kind: str) -> str | None:
    """Why no line of the log could be read, with a hint at the flag that reads them; ``None``
    when one was (a bad line among good ones is counted, not fatal) or the log is empty."""
    if not result.lines or result.first is not None:
        return None
    bad: dict[str, int] = result.bad
    why = ", ".join(f"{reason} {n}" for reason, n in sorted(bad.items()))
    if bad.get("too-long"):
        hint = "lines over 1 MiB are not read"
    elif kind == "jsonl" and bad.get("json"):
        hint = "not JSON lines: for an nginx access log, add --format nginx"
    elif kind == "nginx" and bad.get("regex"):
        hint = "the --regex matched no line"
    elif kind == "nginx":
        hint = ("no [$time_local] where nginx's layout has it: JSON lines need --format jsonl, "
                "another layout a --regex (docs/ledger.md, \"Auditing access logs\")")
    else:
        hint = "no time where --time-field says"
    return f"no line of its {result.lines} could be read ({why}): {hint}"


# --- the table ------------------------------------------------------------------------------------

_COLUMNS = ("window (UTC)", "operation", "arrivals", "keyed", "keys", "amplif.", "work/q",
            "coverage", "p50/p99/max", "undeclared", "refused", "re-minted by", "retries by")


def _cells(o: Row) -> list[str]:
    def num(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    per = o["per_key"]
    start = datetime.datetime.fromtimestamp(o["start"], datetime.UTC).strftime("%m-%d %H:%M")
    return [start + ("*" if o["current"] else ""), o["operation"], str(o["arrivals"]),
            str(o["attributable"]), str(o["distinct_keys"]) + ("~" if o["approximate"] else ""),
            num(o["amplification"]), num(o.get("work_per_question")),
            "-" if o["coverage"] is None else f"{100 * o['coverage']:.1f}%",
            "/".join("-" if per[k] is None else str(per[k]) for k in ("p50", "p99", "max")),
            str(o["undeclared_retries"]), str(o["refused"]), _names(o["reminted_by"]),
            _names(o["retries_by"])]


def _names(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def _total(ops: list[Row]) -> list[str]:
    arrivals = sum(o["arrivals"] for o in ops)
    keyed = sum(o["attributable"] for o in ops)
    keys = sum(o["distinct_keys"] for o in ops)
    work = keyed - sum(o.get("joined", 0) for o in ops)
    return ["all", "(every operation)", str(arrivals), str(keyed), str(keys),
            f"{keyed / keys:.2f}" if keys else "-", f"{work / keys:.2f}" if keys else "-",
            f"{100 * keyed / arrivals:.1f}%" if arrivals else "-", "",
            str(sum(o["undeclared_retries"] for o in ops)), str(sum(o["refused"] for o in ops)),
            "", ""]


def _print(data: dict[str, Any], plain: bool, title: str) -> None:
    ops: list[Row] = data["operations"]
    rows = [_cells(o) for o in ops]
    if ops:
        rows.append(_total(ops))
    notes = ["* the current window; ~ an estimate (keys past the exact bound)"]
    dropped = data.get("dropped") or {}
    if dropped:
        notes.append("dropped before counting: " + _names(dropped))
    if not ops:
        notes.append("no arrivals in the kept windows")
    try:
        if plain:
            raise ImportError
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        widths = [max(len(r[i]) for r in [list(_COLUMNS), *rows]) for i in range(len(_COLUMNS))]
        print(title)
        for r in [list(_COLUMNS), *rows]:
            print("  ".join(c.ljust(w) if i < 2 or i >= 10 else c.rjust(w)
                            for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        for note in notes:
            print(note)
        return
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(_COLUMNS):
        table.add_column(name, justify="left" if i < 2 or i >= 10 else "right", no_wrap=i < 10,
                         overflow="fold")
    for r in rows:
        # Text: names are not markup.
        table.add_row(*(Text(c) for c in r), end_section=r[0] == "all")
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to respect, and folded cells read badly
        console = Console(width=200)
    console.print(table)
    for note in notes:
        console.print(note, highlight=False, markup=False)
