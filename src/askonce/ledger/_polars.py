"""The polars engine of ``askonce audit`` (the ``audit`` extra): the line-by-line reader's figures,
a chunk of lines at a time.

Lines are read as columns by regular expressions over the chunk: JSON lines whose object is flat
and has a key order seen in a sample of the chunk, nginx lines without a quote inside a quoted
field, and the header in its canonical form. Any other line, header or time text goes through the
line-by-line reader's own code (the auditor's ``parse``, ``question`` and ``times``), one at a time.
The arrivals of a chunk then reach the core ledger grouped, with the effect of one ``record`` per
arrival in order: per operation and window the counters at once, per key its arrivals and paths,
and past the exact bound the sketches in arrival order. A chunk whose times are irregular (a
window edge within float rounding) is recorded arrival by arrival.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
from collections.abc import Callable, Iterator
from typing import IO, Any, Protocol

import polars as pl

from askonce.core import wire
from askonce.core.ledger import Ledger
from askonce.core.ledger.policy import LedgerPolicy
from askonce.core.ledger.state import OperationState, Seen, bump
from askonce.core.naming import MAX_OPERATION_CHARS
from askonce.core.question import Hop, Question
from askonce.core.wire import Malformed

__all__ = ["Auditor", "audit_stream", "supports"]

CHUNK = 8 << 20
MAX_LINE = 1 << 20
UNKNOWN_ORIGIN = "~unknown"

Parsed = tuple[float, str, Any, Any]


class Auditor(Protocol):
    """What the engine uses of the line-by-line reader (``askonce.ledger.audit``)."""

    fmt: Any
    ledger: Ledger
    first: float | None
    last: float | None
    parse: Callable[[bytes], Parsed | str]
    times: Callable[[Any], float | None]

    def fail(self, reason: str) -> None: ...

    def question(self, header: Any) -> Question | Malformed | None: ...


# --- regular expressions (Rust's regex crate; classes spelled out, as Python's bytes read them) ---

_WS = r"[ \t\n\r]*"
_STR = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_NUM = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_VAL = f"(?:{_STR}|{_NUM}|true|false|null)"
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_@.$/ :-]{1,64}")
_MAX_LAYOUTS = 8
_MAX_NUMBER = 24  # digits and signs of a JSON time read here; longer ones go to Python

_NOT_SPACE = r"[^ \t\n\r\x0b\x0c]"

_NAME = r"[A-Za-z][A-Za-z0-9_.-]{0,31}"
# What wire's canonical parse accepts as it stands, its range checks written out: budget <= 1000,
# deadline <= 86,400,000 ms, attempts 1..1000, a signature of at most 64 bytes in whole quads.
_BUDGET = r"(?:0{0,3}[0-9]|0{0,2}[1-9][0-9]|0?[1-9][0-9]{2}|1000)"
_DEADLINE = r"(?:[0-9]{1,7}|0[0-9]{7}|[1-7][0-9]{7}|8[0-5][0-9]{6}|86[0-3][0-9]{5}|86400000)"
_ATTEMPT = r"(?:0{0,3}[1-9]|0{0,2}[1-9][0-9]|0?[1-9][0-9]{2}|1000)"
_B64 = "[A-Za-z0-9+/]"
_LAST = f"(?:{_B64}{{4}}|{_B64}{{3}}=|{_B64}{{2}}==)"
_SIG = f"(?:(?:{_B64}{{4}}){{0,20}}{_LAST}|(?:{_B64}{{4}}){{21}}{_B64}{{2}}==)"
_HOP = rf"{_NAME}:{_ATTEMPT}"
_STRICT = (
    rf'^v=1, k="[0-9A-Za-z_-]{{16,64}}", o={_NAME}(?:, e)?, b={_BUDGET}(?:, d={_DEADLINE})?'
    rf"(?:, p=\({_HOP}(?: {_HOP}){{0,{wire.MAX_HOPS - 1}}}\))?(?:, s=:{_SIG}:)?$"
)
_ID_SEGMENT = (r"^(?:[0-9]+|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}"
               r"-[0-9a-fA-F]{12}|[0-9a-fA-F]{16,})$")
_TOKEN_SEGMENT = r"^[0-9A-Za-z_-]{20,}$"

# Row states after reading: an arrival read here, a line for Python, bad lines.
_OK, _PYTHON, _LONG, _BAD_TIME, _BLANK = 0, 1, 2, 3, 4
# Header kinds: none (unkeyed), canonical, for Python, not a string (malformed).
_NONE, _CANON, _PY_HEADER, _NOT_TEXT = 0, 1, 2, 3
# Arrival kinds
_UNKEYED, _MALFORMED, _KEYED = 0, 1, 2


def supports(fmt: Any, secret: Any) -> bool:
    """Whether this engine reads the format (else the line-by-line reader does)."""
    if secret is not None or fmt.regex is not None:
        return False
    if fmt.kind == "nginx":
        return fmt.field is None and fmt.principal_index is None and not fmt.upstream
    names = (fmt.question_field, fmt.time_field, fmt.operation_field, fmt.principal_field)
    return all(_PLAIN_KEY.fullmatch(n) for n in names) and len(set(names)) == 4


def _key_pattern(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_ :/-" else f"[{c}]" for c in key)


# --- reading ----------------------------------------------------------------------------------


def _chunks(stream: IO[bytes], size: int | None = None) -> Iterator[bytes]:
    """Whole lines, about ``size`` bytes at a time; a line of ``MAX_LINE`` bytes or more is cut to
    ``MAX_LINE`` (so it reads as too long) and its rest skipped, never held."""
    carry = b""
    skipping = False
    while True:
        data = stream.read(size or CHUNK)
        if not data:
            break
        if skipping:
            nl = data.find(b"\n")
            if nl < 0:
                continue
            data, skipping = data[nl + 1:], False
        buf = carry + data if carry else data
        cut = buf.rfind(b"\n")
        if cut >= 0:
            yield buf[:cut + 1]
            carry = buf[cut + 1:]
        else:
            carry = buf
        if len(carry) >= MAX_LINE:
            yield carry[:MAX_LINE] + b"\n"
            carry, skipping = b"", True
    if carry:
        yield carry


def _lines(chunk: bytes) -> tuple[list[bytes], pl.Series]:
    lines = chunk.split(b"\n")
    if chunk.endswith(b"\n"):
        lines.pop()
    binary = pl.Series("raw", lines, dtype=pl.Binary)
    try:
        chunk.decode("utf-8")
        text = binary.cast(pl.String)
    except UnicodeDecodeError:
        # Lines that are not UTF-8 go to Python whole: here they read as empty.
        good = [_utf8(line) for line in lines]
        text = pl.Series("raw", good, dtype=pl.String)
    return lines, text


def _utf8(line: bytes) -> str | None:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        return None


# --- the JSON-lines shapes --------------------------------------------------------------------


class _Pairs(list[tuple[str, Any]]):
    """A JSON object's members in their order."""


class _Layouts:
    """Key orders of flat JSON objects, learned from sample lines, each as one expression that
    recognises a line of that order."""

    def __init__(self, fmt: Any) -> None:
        self.wanted = {fmt.time_field: "time", fmt.operation_field: "op",
                       fmt.question_field: "q", fmt.principal_field: "pr"}
        for extra in ("method", "path"):
            self.wanted.setdefault(extra, extra)
        self.seen: set[tuple[str, ...]] = set()
        self.layouts: list[tuple[str, frozenset[str]]] = []  # (pattern, wanted fields it has)

    def learn(self, line: bytes) -> None:
        if len(self.layouts) >= _MAX_LAYOUTS:
            return
        try:
            pairs = json.loads(line, object_pairs_hook=_Pairs)
        except (ValueError, RecursionError):
            return
        if not isinstance(pairs, _Pairs) or not pairs:
            return
        keys = tuple(k for k, _ in pairs)
        if keys in self.seen or len(set(keys)) != len(keys):
            return
        if any(isinstance(v, dict | list) or not _PLAIN_KEY.fullmatch(k) for k, v in pairs):
            return
        self.seen.add(keys)
        body = f"{_WS},{_WS}".join(f'"{_key_pattern(k)}"{_WS}:{_WS}{_VAL}' for k in keys)
        self.layouts.append((f"^{_WS}\\{{{_WS}{body}{_WS}\\}}{_WS}$",
                             frozenset(self.wanted[k] for k in keys if k in self.wanted)))


_CHEAP_VALUE = r'("[^"\\]*(?:\\.[^"\\]*)*"|[^ \t\n\r,}]+)'


def _read_json(text: pl.Series, layouts: _Layouts) -> pl.DataFrame:
    """Per line: state, time (number or text), operation, header and principal as read."""
    raw = pl.col("raw")
    frame = pl.DataFrame({"raw": text})
    fields = {v: k for k, v in layouts.wanted.items()}
    hits = [raw.str.contains(pattern).alias(f"m{j}")
            for j, (pattern, _) in enumerate(layouts.layouts)]
    frame = frame.with_columns(*hits, (raw.str.len_bytes() == raw.str.len_chars()).alias("ascii"))
    values = []
    for name, key in fields.items():
        if not any(name in has for _, has in layouts.layouts):
            values += [pl.lit(None, dtype=pl.String).alias(name),
                       pl.lit(False).alias(f"has_{name}")]
            continue
        present = pl.lit(False)
        for j, (_, has) in enumerate(layouts.layouts):
            if name in has:
                present = present | pl.col(f"m{j}")
        quoted = f'"{key}"'
        tail = raw.str.slice(raw.str.find(quoted, literal=True))
        value = tail.str.extract(f'^"{_key_pattern(key)}"{_WS}:{_WS}{_CHEAP_VALUE}', 1)
        values.append(pl.when(present).then(value).otherwise(None).alias(name))
        values.append(present.alias(f"has_{name}"))
    matched = pl.any_horizontal(*(pl.col(f"m{j}") for j in range(len(layouts.layouts)))
                                ) if layouts.layouts else pl.lit(False)
    frame = frame.select(raw, (matched & pl.col("ascii")).alias("matched"), *values)
    # A field the layout has but that was not found where it stands: Python reads the line.
    lost = pl.any_horizontal(*(pl.col(f"has_{n}") & pl.col(n).is_null() for n in fields))
    frame = frame.with_columns((pl.col("matched") & ~lost).alias("matched"))
    return _json_values(frame.with_columns(*(_value(f) for f in fields)))


def _value(name: str) -> pl.Expr:
    """A JSON value's text as: kind (s string, e escaped string, n number, o other, null absent)
    and content."""
    v = pl.col(name)
    is_str = v.str.starts_with('"')
    content = v.str.slice(1).str.head(-1)
    kind = (pl.when(v.is_null()).then(pl.lit(None, dtype=pl.String))
            .when(is_str & content.str.contains("\\", literal=True)).then(pl.lit("e"))
            .when(is_str).then(pl.lit("s"))
            .when(v.str.contains(r"^-?[0-9]")).then(pl.lit("n"))
            .otherwise(pl.lit("o")))
    return pl.struct(kind.alias("k"), pl.when(is_str).then(content).otherwise(v).alias("v")
                     ).alias(name)


def _json_values(cols: pl.DataFrame) -> pl.DataFrame:
    names = ("time", "op", "q", "pr", "method", "path")
    k = {f: pl.col(f).struct.field("k") for f in names}
    v = {f: pl.col(f).struct.field("v") for f in names}
    q_plain = v["q"].str.replace_all('\\"', '"', literal=True)

    def yes(e: pl.Expr) -> pl.Expr:
        return e.fill_null(False)

    op_not_text = yes(k["op"] != "s") | k["op"].is_null()
    python = (
        ~pl.col("matched")
        | yes(k["time"] == "e") | yes(k["op"] == "e") | yes(k["pr"] == "e")
        | yes(k["pr"].is_in(["n", "o"]) & v["pr"].ne("null"))
        | yes((k["time"] == "n") & (v["time"].str.len_bytes() > _MAX_NUMBER))
        | yes((k["q"] == "e") & q_plain.str.contains("\\", literal=True))
        | (op_not_text & (yes(k["method"] == "e") | yes(k["path"] == "e")))
    )
    by_route = yes(k["method"] == "s") & yes(k["path"] == "s")
    return cols.select(
        pl.col("raw"),
        pl.when(python).then(pl.lit(_PYTHON)).otherwise(pl.lit(_OK)).alias("state"),
        pl.when(k["time"] == "n").then(v["time"]).otherwise(None).alias("tnum"),
        pl.when(k["time"] == "s").then(v["time"]).otherwise(None).alias("ttext"),
        pl.when(k["op"] == "s").then(v["op"])
        .when(by_route).then(_template(v["method"], v["path"]))
        .otherwise(pl.lit("~unknown")).alias("op"),
        pl.when(k["q"].is_in(["s", "e"])).then(q_plain).otherwise(None).alias("h"),
        yes(k["q"].is_in(["n", "o"]) & v["q"].ne("null")).alias("h_not_text"),
        pl.when(k["pr"] == "s").then(v["pr"]).otherwise(pl.lit("")).alias("pr"),
    )


def _template(method: pl.Expr, path: pl.Expr) -> pl.Expr:
    """``askonce.core.naming.path_template`` of ``method`` and the path before any ``?``."""
    segments = path.str.split("?").list.first().str.split("/")
    element = pl.element()
    ids = (element.str.contains(_ID_SEGMENT)
           | (element.str.contains(_TOKEN_SEGMENT) & element.str.contains("[0-9]")))
    out = segments.list.eval(pl.when(ids).then(pl.lit("{id}")).otherwise(element)).list.join("/")
    return pl.concat_str([method, pl.lit(" "), out]).str.slice(0, MAX_OPERATION_CHARS)


# --- nginx lines ------------------------------------------------------------------------------


def _read_nginx(text: pl.Series) -> pl.DataFrame:
    """The usual line: its first ``[`` opens the time, its first quoted field is the request (or
    none is), its header the first quoted field starting ``v=``. Other lines go to Python."""
    raw = pl.col("raw")
    frame = pl.DataFrame({"raw": text})
    quotes = raw.str.count_matches('"', literal=True)
    simple = ((quotes % 2 == 0) & ~raw.str.contains('\\"', literal=True)
              & (raw.str.len_bytes() == raw.str.len_chars()))
    # positions are bytes and slices characters: equal on ASCII lines, the only ones read here
    q1 = raw.str.find('"', literal=True)
    after = raw.str.slice(q1 + 1)
    first = after.str.head(after.str.find('"', literal=True))
    request = first.str.extract_groups(
        rf"^([A-Z]{{3,10}}) ({_NOT_SPACE}+)(?: HTTP/[0-9.]+)?$")
    hv = raw.str.find('"v=', literal=True)
    opens = raw.str.head(hv).str.count_matches('"', literal=True) % 2 == 0
    h_tail = raw.str.slice(hv + 1)
    header = h_tail.str.head(h_tail.str.find('"', literal=True))
    lb = raw.str.find("[", literal=True)
    outside = raw.str.head(lb).str.count_matches('"', literal=True) % 2 == 0
    b_tail = raw.str.slice(lb + 1)
    rb, rq = b_tail.str.find("]", literal=True), b_tail.str.find('"', literal=True)
    closed = rb.is_not_null() & (rq.is_null() | (rb < rq))
    frame = frame.with_columns(simple.alias("simple"), quotes.alias("quotes"),
                               request.alias("req"), hv.alias("hv"), opens.alias("opens"),
                               header.alias("hdr"), lb.alias("lb"), outside.alias("outside"),
                               closed.alias("closed"), b_tail.str.head(rb).alias("ttext"))
    method, path = pl.col("req").struct.field("1"), pl.col("req").struct.field("2")
    has_request = method.is_not_null()
    # Python looks further when the first quoted field is no request, the first `[` is quoted or
    # not closed in its field, or `"v=` is a closing quote.
    plain_line = (pl.col("simple")
                  & (has_request | (pl.col("quotes") == 0))
                  & (pl.col("lb").is_null() | (pl.col("outside") & pl.col("closed")))
                  & (pl.col("hv").is_null() | pl.col("opens")))
    h = pl.when(pl.col("hv").is_not_null()).then(pl.col("hdr")).otherwise(None)
    plain = h.str.replace_all("\\x22", '"', literal=True)
    return frame.select(
        raw,
        pl.when(plain_line).then(pl.lit(_OK)).otherwise(pl.lit(_PYTHON)).alias("state"),
        pl.lit(None, dtype=pl.String).alias("tnum"),
        pl.when(pl.col("lb").is_not_null()).then(pl.col("ttext")).otherwise(None).alias("ttext"),
        pl.when(has_request).then(_template(method, path)).otherwise(pl.lit("~unknown")
                                                                     ).alias("op"),
        plain.alias("h"),
        pl.lit(False).alias("h_not_text"),
        pl.lit("").alias("pr"),
        # A backslash left after undoing \x22: Python undoes the escapes.
        plain.str.contains("\\", literal=True).fill_null(False).alias("h_escaped"),
    )


# --- the header -------------------------------------------------------------------------------


def _headers(frame: pl.DataFrame) -> pl.DataFrame:
    """The header's kind, and for a canonical one that ``wire.parse_question`` accepts as it stands
    its key, origin, edge flag and path text (any other goes to Python)."""
    h = pl.col("h")
    strict = h.str.contains(_STRICT) & (h.str.len_chars() <= wire.MAX_HEADER_CHARS)
    tail = h.str.slice(8)  # after 'v=1, k="'
    k_end = tail.str.find('"', literal=True)
    o_tail = tail.str.slice(k_end + 5)  # after '", o='
    p_tail = h.str.slice(h.str.find(", p=(", literal=True) + 5)
    escaped = pl.col("h_escaped") if "h_escaped" in frame.columns else pl.lit(False)
    kind = (pl.when(pl.col("h_not_text")).then(pl.lit(_NOT_TEXT))
            .when(h.is_null() | h.is_in(["", "-"])).then(pl.lit(_NONE))
            .when(escaped | ~strict).then(pl.lit(_PY_HEADER))
            .otherwise(pl.lit(_CANON)))
    return frame.with_columns(
        kind.alias("hk"), tail.str.head(k_end).alias("key"),
        o_tail.str.head(o_tail.str.find(",", literal=True)).alias("org"),
        h.str.contains(", e, b=", literal=True).alias("edge"),
        pl.when(h.str.contains(", p=(", literal=True))
        .then(p_tail.str.head(p_tail.str.find(")", literal=True))).otherwise(None).alias("p"))


# --- the engine -------------------------------------------------------------------------------


class _Engine:
    def __init__(self, auditor: Auditor) -> None:
        self.a = auditor
        self.ledger = auditor.ledger
        self.policy: LedgerPolicy = auditor.ledger.policy
        self.json = auditor.fmt.kind == "jsonl"
        self.layouts = _Layouts(auditor.fmt)
        self.lines = 0
        self.path_ids: dict[tuple[Any, ...], int] = {}
        self.path_info: list[tuple[int, tuple[str, ...]]] = []
        self.text_paths: dict[str, int] = {}
        self.time_texts: dict[str, float | None] = {}
        self.exact_keys: dict[OperationState, tuple[int, pl.DataFrame]] = {}

    def chunk(self, chunk: bytes) -> None:
        self._finish(*self.read(chunk))

    def read(self, chunk: bytes) -> tuple[pl.DataFrame, list[bytes]]:
        """The chunk's lines as columns (no ledger, no auditor: another thread may run it)."""
        lines, text = _lines(chunk)
        if self.json:
            for i in range(0, len(lines), max(1, len(lines) // 8)):
                self.layouts.learn(lines[i])
            frame = _read_json(text, self.layouts)
        else:
            frame = _read_nginx(text)
        return _headers(self._states(frame)), lines

    def _states(self, frame: pl.DataFrame) -> pl.DataFrame:
        raw = pl.col("raw")
        blank = raw.str.strip_chars(" \t\n\r\x0b\x0c") == ""
        return frame.with_columns(
            pl.int_range(pl.len(), dtype=pl.UInt32).alias("i"),
            pl.when(raw.is_null()).then(pl.lit(_PYTHON))
            .when(raw.str.len_bytes() >= MAX_LINE).then(pl.lit(_LONG))
            .when(blank).then(pl.lit(_BLANK))
            .otherwise(pl.col("state")).alias("state"),
        )

    # Times, Python's rows, paths: then the ledger.

    def _finish(self, frame: pl.DataFrame, lines: list[bytes]) -> None:
        frame = frame.filter(pl.col("state") != _BLANK)
        self.lines += frame.height
        times = self._times(frame)
        frame = frame.with_columns(pl.Series("t", times, dtype=pl.Float64))
        window = self.policy.window
        bad_time = (pl.col("state") == _OK) & (
            pl.col("t").is_null() | ~(pl.col("t") / window).is_finite())
        frame = frame.with_columns(pl.when(bad_time).then(pl.lit(_BAD_TIME))
                                   .otherwise(pl.col("state")).alias("state"))
        # Python's lines and headers.
        special = frame.filter((pl.col("state") != _OK) | (pl.col("hk") == _PY_HEADER)
                               | (pl.col("hk") == _NOT_TEXT))
        extra: dict[int, tuple[Any, ...] | str] = {}
        for i, state, hk, h, t, op, pr in special.select(
                "i", "state", "hk", "h", "t", "op", "pr").iter_rows():
            if state == _LONG:
                extra[i] = "too-long"
            elif state == _BAD_TIME:
                extra[i] = "time"
            elif state == _PYTHON:
                extra[i] = self._python_line(lines[i])
            else:
                extra[i] = self._arrival(t, op, h if hk == _PY_HEADER else 5, pr)
        rows = frame.filter((pl.col("state") == _OK) & (pl.col("hk") != _PY_HEADER)
                            & (pl.col("hk") != _NOT_TEXT))
        arrivals = self._arrivals(rows, extra)
        self._record(arrivals)

    def _times(self, frame: pl.DataFrame) -> list[float | None]:
        num = frame.get_column("tnum").cast(pl.Float64, strict=False)
        num = pl.select(pl.when(num > 1e11).then(num / 1000).otherwise(num)).to_series()
        num = pl.select(pl.when(num.is_finite()).then(num).otherwise(None)).to_series()
        texts = frame.get_column("ttext")
        cache = self.time_texts
        for text in texts.drop_nulls().unique().to_list():
            if text not in cache:
                if len(cache) >= 4096:
                    cache.clear()
                cache[text] = self.a.times(text)
        parsed = texts.replace_strict(cache, default=None, return_dtype=pl.Float64)
        return pl.select(pl.coalesce(num, parsed)).to_series().to_list()

    def _python_line(self, line: bytes) -> tuple[Any, ...] | str:
        got = self.a.parse(line)
        if isinstance(got, str):
            return got
        t, operation, header, principal = got
        if not _valid_time(t, self.policy.window):
            return "time"
        principal = (principal if isinstance(principal, str)
                     else "" if principal is None else str(principal))
        return self._arrival(t, operation, header, principal)

    def _arrival(self, t: float, operation: str, header: Any, principal: str) -> tuple[Any, ...]:
        q = self.a.question(header)
        if q is None:
            return (t, operation, principal, _UNKEYED, False, None, None, self._pid(()))
        if isinstance(q, Malformed):
            return (t, operation, principal, _MALFORMED, False, None, None, self._pid(()))
        return (t, operation, principal, _KEYED, q.edge, q.origin, q.key, self._pid(q.path))

    def _pid(self, path: tuple[Any, ...]) -> int:
        pid = self.path_ids.get(path)
        if pid is None:
            ledger = self.ledger
            info = ledger._paths.get(path) or ledger._learn(path)
            pid = self.path_ids[path] = len(self.path_info)
            self.path_info.append(info)
        return pid

    def _text_pid(self, text: str | None) -> int:
        if text is None:
            return self._pid(())
        pid = self.text_paths.get(text)
        if pid is None:
            hops = []
            for hop in text.split(" "):
                layer, _, n = hop.rpartition(":")
                hops.append(Hop(layer, int(n)))
            pid = self.text_paths[text] = self._pid(tuple(hops))
        return pid

    def _arrivals(self, rows: pl.DataFrame, extra: dict[int, tuple[Any, ...] | str]
                  ) -> pl.DataFrame:
        texts = rows.get_column("p").unique().to_list()
        mapping = {t: self._text_pid(t) for t in texts if t is not None}
        kind = (pl.when(pl.col("hk") == _CANON).then(pl.lit(_KEYED, dtype=pl.UInt8))
                .otherwise(pl.lit(_UNKEYED, dtype=pl.UInt8)))
        keyed = pl.col("hk") == _CANON
        empty = self._pid(())
        mine = rows.select(
            pl.col("i"), pl.col("t"), pl.col("op"), pl.col("pr"), kind.alias("kind"),
            (pl.col("edge") & keyed).alias("edge"),
            pl.when(keyed).then(pl.col("org")).otherwise(None).alias("org"),
            pl.when(keyed).then(pl.col("key")).otherwise(None).alias("key"),
            pl.when(keyed & pl.col("p").is_not_null())
            .then(pl.col("p").replace_strict(mapping, default=empty, return_dtype=pl.UInt32))
            .otherwise(pl.lit(empty, dtype=pl.UInt32)).alias("pid"),
        )
        bad = sorted((i, r) for i, r in extra.items() if isinstance(r, str))
        for _, reason in bad:
            self.a.fail(reason)
        theirs = [(i, *r) for i, r in extra.items() if not isinstance(r, str)]
        if theirs:
            cols = list(zip(*theirs, strict=True))
            types = (pl.UInt32, pl.Float64, pl.String, pl.String, pl.UInt8, pl.Boolean, pl.String,
                     pl.String, pl.UInt32)
            other = pl.DataFrame({name: pl.Series(col, dtype=dtype) for name, col, dtype in zip(
                mine.columns, cols, types, strict=True)})
            mine = pl.concat([mine, other]).sort("i")
        return mine

    # The ledger.

    def _record(self, rows: pl.DataFrame) -> None:
        if rows.height == 0:
            return
        a = self.a
        t = rows.get_column("t")
        first, top = t[0], t.max()
        assert isinstance(top, float)
        if a.first is None:
            a.first = first
        a.last = top if a.last is None or top > a.last else a.last
        segments = self._windows(t)
        if segments is None:
            return self._one_by_one(rows)
        start = 0
        for end, index in segments:
            part = rows.slice(start, end - start)
            ledger = self.ledger
            t0 = part.get_column("t")[0]
            if not t0 < ledger._end:
                ledger._roll(t0)
            current = ledger._current
            if current is None or current.index != index:  # pragma: no cover - checked above
                return self._one_by_one(rows.slice(start))
            self._segment(part)
            start = end
        return None

    def _windows(self, t: pl.Series) -> list[tuple[int, int]] | None:
        """(end row, window index) of each run of rows in one window, as ``record`` would roll;
        ``None`` when float rounding at a window edge could make the answer differ."""
        window = self.policy.window
        current = self.ledger._current
        g = (t / window).floor()
        if g.abs().max() > 2.0**52:  # type: ignore[operator]
            return None
        gi = g.cast(pl.Int64)
        c0 = current.index if current is not None else None
        run = gi.cum_max()
        if c0 is not None:
            run = pl.select(pl.max_horizontal(run, pl.lit(c0))).to_series()
        prev = run.shift(1, fill_value=c0 if c0 is not None else None)
        end_prev = (prev + 1).cast(pl.Float64) * window
        rolls = (t >= end_prev) | prev.is_null()
        advances = (gi > prev) | prev.is_null()
        if (rolls != advances).any():
            return None
        changes = pl.select(pl.arg_where(advances)).to_series().to_list()
        runs = run.to_list()
        starts = changes[1:] if changes and changes[0] == 0 else changes
        bounds = [*starts, len(runs)]
        return [(b, runs[b - 1]) for b in bounds if b > 0]

    def _one_by_one(self, rows: pl.DataFrame) -> None:
        record = self.ledger.record
        paths = {pid: path for path, pid in self.path_ids.items()}
        for _, t, op, pr, kind, edge, org, key, pid in rows.iter_rows():
            if kind == _KEYED:
                record(t, op, key=key, edge=edge, origin=org, path=paths[pid], principal=pr)
            else:
                record(t, op, key=None, principal=pr, malformed=kind == _MALFORMED)

    def _segment(self, rows: pl.DataFrame) -> None:
        ledger = self.ledger
        policy = self.policy
        names = rows.get_column("op").unique(maintain_order=True).to_list()
        ops: list[OperationState] = []
        for name in names:
            op = ledger._ops.get(name)
            ops.append(op if op is not None else ledger._operation(name))
        self.exact_keys = {op: v for op, v in self.exact_keys.items() if op in ledger._ops.values()}
        rows = rows.with_columns(
            pl.col("op").replace_strict({n: j for j, n in enumerate(names)},
                                        return_dtype=pl.UInt32).alias("opi"))
        keyed = pl.col("kind") == _KEYED
        counts = rows.group_by("opi").agg(
            pl.len().alias("n"), (pl.col("kind") == _UNKEYED).sum().alias("unkeyed"),
            (pl.col("kind") == _MALFORMED).sum().alias("malformed"),
            (keyed & pl.col("edge")).sum().alias("attr"),
            (keyed & ~pl.col("edge")).sum().alias("rem"))
        for opi, n, unkeyed, malformed, attr, rem in counts.iter_rows():
            op = ops[opi]
            op.arrivals += n
            op.unkeyed += unkeyed
            op.malformed += malformed
            op.attributable += attr
            op.reminted += rem
        limit = policy.max_names
        retried = [pid for pid, (_, r) in enumerate(self.path_info) if r]
        if retried:
            by_path = (rows.filter(pl.col("pid").is_in(retried)).group_by("opi", "pid")
                       .agg(pl.len().alias("n"), pl.col("i").min().alias("first")).sort("first"))
            layers: dict[int, dict[str, int]] = {}
            for opi, pid, n, _ in by_path.iter_rows():
                mine = layers.setdefault(opi, {})
                for layer in self.path_info[pid][1]:
                    mine[layer] = mine.get(layer, 0) + n
            for opi, mine in layers.items():
                for layer, n in mine.items():
                    bump(ops[opi].retries_by, layer, limit, n)
        origins = (rows.filter(keyed & ~pl.col("edge")).group_by("opi", "org")
                   .agg(pl.len().alias("n"), pl.col("i").min().alias("first")).sort("first"))
        for opi, org, n, _ in origins.iter_rows():
            bump(ops[opi].reminted_by, UNKNOWN_ORIGIN if org is None else org, limit, n)
        self._keys(rows.filter(keyed), ops)

    def _keys(self, rows: pl.DataFrame, ops: list[OperationState]) -> None:
        if rows.height == 0:
            return
        policy = self.policy
        digests = pl.DataFrame({"pid": pl.Series(range(len(self.path_info)), dtype=pl.UInt32),
                                "dig": pl.Series([d for d, _ in self.path_info], dtype=pl.UInt64)})
        rows = rows.join(digests, on="pid", how="left", maintain_order="left")
        groups = (rows.group_by("opi", "edge", "pr", "key", maintain_order=True)
                  .agg(pl.len().alias("n"), pl.col("dig").first().alias("d0"),
                       pl.col("dig").n_unique().alias("nd")))
        gid = groups.with_row_index("g").select("opi", "edge", "pr", "key", "g")
        rows = rows.join(gid, on=["opi", "edge", "pr", "key"], how="left", maintain_order="left")
        several: dict[int, list[tuple[int, int]]] = {}
        if groups.get_column("nd").max() > 1:  # type: ignore[operator]
            multi = pl.Series(groups.with_row_index("g").filter(pl.col("nd") > 1).get_column("g"))
            per = (rows.filter(pl.col("g").is_in(multi.implode()))
                   .group_by("g", "dig", maintain_order=True).agg(pl.len().alias("c")))
            for g, d, c in per.iter_rows():
                several.setdefault(g, []).append((d, c))
        max_exact, max_paths, cap = policy.max_exact_keys, policy.max_paths_per_key, policy.cap
        spilled: list[int] = []
        groups = groups.with_row_index("g")
        full = [j for j, op in enumerate(ops) if op.exact >= max_exact]
        if full:
            # An operation already full: its new keys all go to the sketches, found without Python.
            known = self._exact(ops, full)
            groups = groups.join(known, on=["opi", "edge", "pr", "key"], how="left",
                                 maintain_order="left")
            quick = pl.col("opi").is_in(full) & pl.col("known").is_null()
            past = groups.filter(quick)
            for opi, n in past.group_by("opi").agg(pl.col("n").sum()).iter_rows():
                ops[opi].overflowed = True
                if cap is not None:
                    ops[opi].cap_unenforced += n
            spilled += past.filter(pl.col("edge")).get_column("g").to_list()
            groups = groups.filter(~quick)
        columns = (groups.get_column(c).to_list() for c in ("g", "opi", "edge", "pr", "key", "n",
                                                             "d0"))
        for g, opi, edge, pr, key, n, d0 in zip(*columns, strict=True):
            op = ops[opi]
            table = op.attr if edge else op.remint
            keys = table.get(pr)
            entry = None if keys is None else keys.get(key)
            if entry is None and op.exact >= max_exact:
                op.overflowed = True
                if cap is not None:
                    op.cap_unenforced += n
                if edge:
                    spilled.append(g)
                continue
            if keys is None:
                keys = table[pr] = {}
            if entry is None:
                op.exact += 1
                before, paths, untracked = 0, [], 0
            elif isinstance(entry, int):
                before, paths, untracked = 1, [entry], 0
            else:
                before, paths, untracked = entry.n, list(entry.paths), entry.untracked
            for d, c in several.get(g) or ((d0, n),):
                if d not in paths:
                    if len(paths) < max_paths:
                        paths.append(d)
                    else:
                        untracked += c
            total = before + n
            keys[key] = paths[0] if total == 1 else Seen(total, tuple(paths), untracked)
            if cap is not None and total > cap:
                op.refused += total - max(before, cap)
        if spilled:
            self._sketch(rows, spilled, ops)

    def _exact(self, ops: list[OperationState], full: list[int]) -> pl.DataFrame:
        """The exactly counted keys of the full operations ``full`` (by index into ``ops``)."""
        frames = []
        for j in full:
            op = ops[j]
            cached = self.exact_keys.get(op)
            if cached is None or cached[0] != op.exact:
                cols: tuple[list[bool], list[str], list[str]] = ([], [], [])
                for edge, table in ((True, op.attr), (False, op.remint)):
                    for pr, keys in table.items():
                        cols[0].extend([edge] * len(keys))
                        cols[1].extend([pr] * len(keys))
                        cols[2].extend(keys)
                frame = pl.DataFrame({"edge": pl.Series(cols[0], dtype=pl.Boolean),
                                      "pr": pl.Series(cols[1], dtype=pl.String),
                                      "key": pl.Series(cols[2], dtype=pl.String)})
                cached = self.exact_keys[op] = (op.exact, frame)
            frames.append(cached[1].with_columns(pl.lit(j, dtype=pl.UInt32).alias("opi"),
                                                 pl.lit(True).alias("known")))
        return pl.concat(frames).select("opi", "edge", "pr", "key", "known")

    def _sketch(self, rows: pl.DataFrame, spilled: list[int], ops: list[OperationState]) -> None:
        picked = rows.filter(pl.col("g").is_in(pl.Series(spilled, dtype=pl.UInt32).implode()))
        heavy_k = self.ledger._heavy_k
        for (opi,), part in picked.group_by("opi", maintain_order=True):
            items = list(zip(part.get_column("pr").to_list(), part.get_column("key").to_list(),
                             strict=True))
            ops[opi].spill_each(items, heavy_k)


def _valid_time(t: float, window: float) -> bool:
    return math.isfinite(t / window)  # as window_index checks it


def audit_stream(stream: IO[bytes], auditor: Auditor) -> int:
    """Read ``stream`` into the auditor's ledger; the number of lines read (blank ones not
    counted)."""
    engine = _Engine(auditor)
    # The next chunk is read into columns (polars, which lets go of the GIL) while this one is
    # recorded.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ahead: concurrent.futures.Future[tuple[pl.DataFrame, list[bytes]]] | None = None
        for chunk in _chunks(stream):
            read = pool.submit(engine.read, chunk)
            if ahead is not None:
                engine._finish(*ahead.result())
            ahead = read
        if ahead is not None:
            engine._finish(*ahead.result())
    return engine.lines
