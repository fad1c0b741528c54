"""The polars engine of ``askonce audit`` against the line-by-line reader: the same result, figure for figure and in the
same order, on generated logs full of what real logs hold - malformed and non-canonical headers, unkeyed arrivals, keys
that repeat past the exact bound, late clocks, window edges, bad lines of every kind. Skipped without polars (the
``audit`` extra)."""

from __future__ import annotations

import gzip
import json
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from access_logs import header
from askonce.core.ledger import LedgerPolicy
from askonce.core.signing import sign_header
from askonce.ledger import audit
from askonce.ledger.audit import MAX_LINE, LogFormat, audit_file

pytest.importorskip("polars")

from askonce.ledger import _polars

T0 = 1_700_000_000.0
PATHS = [(("edge", 1),), (("edge", 1), ("gw", 1)), (("edge", 1), ("gw", 2)), (("edge", 2), ("gw", 1), ("api", 3)),
         (("edge", 1), ("gw", 2), ("gw", 1))]


def _header(rng: random.Random, i: int) -> Any:
    """A header value as logged: mostly canonical, some odd, some not a header at all."""
    roll = rng.random()
    key = f"question-{rng.randrange(max(1, i // 3 + 1)):08d}-xyz"  # keys repeat, some many times
    if roll < 0.55:
        return header(key, rng.choice(PATHS))
    if roll < 0.65:
        origin = rng.choice(["mid", "db", "cache"])
        return header(f"local-{rng.randrange(500):08d}-abc", rng.choice(PATHS), edge=False, origin=origin)
    odd = [None, "", "-", "v=1, k=oops", header(key).replace(", ", ","), header(key).replace("b=2", "b=5000"),
           header(key).replace("gw:1", "gw:0"), header(key).replace("edge:1", "edge:0001"),
           header(key).replace("d=1500", "d=99999999"), sign_header(header(key), "a signing secret of some length"),
           header(key) + ", s=:AAAA:", "v=1, k=\"" + "x" * 70 + "\", o=edge, b=1", 5, True,
           "v=2, k=\"abcdefghijklmnopq\""]
    return rng.choice(odd)


def _time(rng: random.Random, i: int) -> float:
    t = T0 + i * 0.7
    roll = rng.random()
    if roll < 0.03:
        return t - rng.uniform(0, 200)  # a late clock
    if roll < 0.05:
        return (round(t / 60) * 60) - rng.choice([1e-6, 0.0, 1e-9])  # at a window edge
    return t


def _jsonl(rng: random.Random, n: int) -> bytes:
    out = []
    for i in range(n):
        t = _time(rng, i)
        h = _header(rng, i)
        obj: dict[str, Any] = {"time": t, "operation": rng.choice(["GET /items/{id}", "POST /orders", "op-3", "op-4"]),
                               "status": 200, "principal": rng.choice(["", "t1", "t2"]), "askonce_question": h}
        roll = rng.random()
        if roll < 0.04:
            obj = {"askonce_question": h, "time": t, "operation": "POST /orders"}  # another key order
        elif roll < 0.06:
            del obj["operation"]
            obj["method"], obj["path"] = "GET", rng.choice(["/items/42?x=1", "/u/0123456789abcdef0123", "/a/b"])
        elif roll < 0.07:
            obj["time"] = rng.choice(["2023-11-14T22:13:20Z", "14/Nov/2023:22:13:20 +0000", "yesterday", t * 1000])
        elif roll < 0.08:
            obj["principal"] = rng.choice([7, None, "tenant \"quoted\"", "ténant"])
        elif roll < 0.09:
            obj["extra"] = {"nested": [1, 2]}
        elif roll < 0.10:
            obj["operation"] = "GET /with\\backslash\n"
        line = json.dumps(obj)
        roll = rng.random()
        if roll < 0.01:
            line = line.replace('"status": 200', '"time": 5, "status": 200')  # a repeated key: the last counts
        elif roll < 0.02:
            line = rng.choice(["not json", "[1, 2]", '{"time": NaN, "operation": "x"}', "", "   ", '{"time": 1e400}',
                               '{"time": "1700000000.5", "operation": "op", "askonce_question": null}'])
        elif roll < 0.025:
            line = line + "\r"
        elif roll < 0.03:
            out.append(b"\xff\xfe broken " + line.encode() + b"\n")
            continue
        out.append(line.encode() + b"\n")
    return b"".join(out)


def _stamp(t: float) -> str:
    return time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(t))


def _escape(h: str) -> str:
    return h.replace('"', "\\x22")


def _nginx(rng: random.Random, n: int) -> bytes:
    out = []
    for i in range(n):
        t = _time(rng, i)
        h = _header(rng, i)
        value = "-" if not isinstance(h, str) or not h else h
        value = value.replace('"', "\\x22")
        stamp = _stamp(t)
        request = rng.choice(["GET /items/42 HTTP/1.1", "POST /orders HTTP/2.0", "GET /u/0123456789abcdef01 HTTP/1.1",
                              "-", "GET /a?b=1 HTTP/1.1"])
        line = f'10.0.0.1 - - [{stamp}] "{request}" 200 5 "-" "curl/8.0" "{value}"'
        roll = rng.random()
        if roll < 0.02:
            line = line.replace("\\x22", '\\"')  # escape=json: a quote inside a quoted field
        elif roll < 0.03:
            line = f'"{value}" [{stamp}] "{request}"'  # the header first
        elif roll < 0.04:
            line = rng.choice(["garbage", "", f'"quoted [not a time]" {line}', f"x [{stamp} no close", "\t"])
        elif roll < 0.05:
            line = line.replace("curl/8.0", "agent \\\\x22 odd")
        out.append(line.encode() + b"\n")
    return b"".join(out)


POLICIES = [
    LedgerPolicy(window=60.0, windows_kept=3, max_exact_keys=40, max_operations=3, max_names=2, max_paths_per_key=2,
                 heavy_keys=3, cap=2),
    LedgerPolicy(window=3600.0, windows_kept=23, max_exact_keys=50_000),
    LedgerPolicy(window=7.0, windows_kept=50, max_exact_keys=1, cap=1, max_paths_per_key=1),
]


def _both(path: Path, fmt: LogFormat, policy: LedgerPolicy) -> tuple[dict[str, Any], dict[str, Any]]:
    fast = audit_file(str(path), fmt, policy, engine="polars")
    slow = audit_file(str(path), fmt, policy, engine="python")
    assert fast.report == slow.report
    return fast.to_dict(), slow.to_dict()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["jsonl", "nginx"])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_engines_agree_on_generated_logs(kind: str, seed: int, policy: LedgerPolicy, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_polars, "CHUNK", 8192)  # many chunks: windows, keys and lines cross their edges
    rng = random.Random(seed)
    data = (_jsonl if kind == "jsonl" else _nginx)(rng, 3_000)
    path = tmp_path / f"access.{kind}"
    path.write_bytes(data)
    fast, slow = _both(path, LogFormat(kind=kind), policy)
    assert json.dumps(fast) == json.dumps(slow)  # the same figures in the same order
    assert slow["lines"] > 2_500 and slow["report"]["operations"]
    if kind == "jsonl":
        assert set(slow["bad_lines"]) == {"json", "time"}


@pytest.mark.parametrize("kind", ["jsonl", "nginx"])
def test_the_engines_agree_on_a_flood_of_distinct_keys_past_the_exact_bound(kind: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Thousands of keys past the bound with a few hot ones: the heavy-key summary is full and cuts, so its figures
    # depend on the order the arrivals reach it.
    monkeypatch.setattr(_polars, "CHUNK", 1 << 15)
    rng = random.Random(6)
    items = []
    for i in range(8_000):
        hot = i > 200 and rng.random() < 0.3  # the hot keys come once the exact table is full
        key = f"hot-{rng.randrange(4)}-padding-xyz" if hot else f"cold-{i:08d}-padding-xyz"
        items.append((T0 + i * 0.01, header(key, rng.choice(PATHS)), rng.choice(["", "t1"])))
    if kind == "jsonl":
        lines = [json.dumps({"time": t, "operation": "op", "principal": p, "askonce_question": h}) for t, h, p in items]
    else:
        lines = [f'1.2.3.4 - - [{_stamp(t)}] "GET /x HTTP/1.1" 200 "{_escape(h)}"' for t, h, _ in items]
    path = tmp_path / f"flood.{kind}"
    path.write_text("\n".join(lines) + "\n")
    fast, slow = _both(path, LogFormat(kind=kind), LedgerPolicy(window=3600.0, max_exact_keys=100, heavy_keys=4))
    assert fast == slow
    (op,) = slow["report"]["operations"]
    assert op["approximate"] and [h["key"][:4] for h in op["heavy"]] == ["hot-"] * 4
    assert any(h["error"] > 0 for h in op["heavy"])
    # and the sketches themselves, not only what the report shows of them
    policy = LedgerPolicy(window=3600.0, max_exact_keys=100, heavy_keys=4)
    engine, reader = (audit._Auditor(LogFormat(kind=kind), policy, None) for _ in range(2))
    with open(path, "rb") as f:
        _polars.audit_stream(f, engine)
    with open(path, "rb") as f:
        for line in audit._lines(f):
            assert line is not None
            reader.record(line)
    name = "GET /x" if kind == "nginx" else "op"
    mine, theirs = engine.ledger._ops[name], reader.ledger._ops[name]
    assert mine.heavy is not None and theirs.heavy is not None and mine.hll is not None and theirs.hll is not None
    assert (mine.heavy.counts, mine.heavy.offset) == (theirs.heavy.counts, theirs.heavy.offset)
    assert mine.hll._registers == theirs.hll._registers


def test_the_engines_agree_on_a_compressed_log_with_overlong_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    monkeypatch.setattr(_polars, "CHUNK", 1 << 16)
    data = _jsonl(random.Random(3), 500)
    long = b'{"time": 1, "x": "' + b"y" * (MAX_LINE + 5) + b'"}\n'
    exact = b'{"time": 2, "x": "' + b"z" * (MAX_LINE - 21) + b'"}\n'  # one byte short of too long
    path = tmp_path / "access.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(data + long + exact + b"x" * MAX_LINE + b"\n" + data + b"x" * (3 * MAX_LINE))
    fast, slow = _both(path, LogFormat(), POLICIES[0])
    assert fast == slow and slow["bad_lines"]["too-long"] == 3


def test_usual_lines_never_reach_the_line_by_line_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4)
    lines = [json.dumps({"time": T0 + i, "operation": "op", "principal": "", "askonce_question": header(
        f"question-{i % 700:08d}-xyz", rng.choice(PATHS))}).encode() + b"\n" for i in range(2_000)]
    path = tmp_path / "plain.jsonl"
    path.write_bytes(b"".join(lines))
    calls = []
    real = audit._Auditor._jsonl

    def counted(self: Any, line: bytes) -> Any:
        calls.append(line)
        return real(self, line)

    monkeypatch.setattr(audit._Auditor, "_jsonl", counted)
    fast = audit_file(str(path), engine="polars")
    assert calls == []
    slow = audit_file(str(path), engine="python")
    assert len(calls) == 2_000 and fast.to_dict() == slow.to_dict()


def test_the_engine_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="engine"):
        audit.engine_for("polars", LogFormat(kind="nginx", field=3))
    with pytest.raises(ValueError, match="engine"):
        audit.engine_for("quick", LogFormat())
    assert audit.engine_for("auto", LogFormat(kind="nginx", regex=r"(?P<question>.*) (?P<time>\S+)")) is None
    assert audit.engine_for("auto", LogFormat(), secret="s") is None
    assert audit.engine_for("auto", LogFormat()) is _polars


def test_the_engine_holds_a_chunk_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_polars, "CHUNK", 1 << 18)
    lines = [json.dumps({"time": T0 + i * 0.001, "operation": "op", "askonce_question": header(f"question-{i:09d}")})
             for i in range(40_000)]
    peaks = []
    for copies in (1, 4):
        log = tmp_path / f"big-{copies}.jsonl"
        log.write_text("\n".join(lines * copies) + "\n")
        tracemalloc.start()
        try:
            result = audit_file(str(log), policy=LedgerPolicy(window=3600.0, max_exact_keys=2_000), engine="polars")
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert result.report.totals().arrivals == 40_000 * copies and result.report.approximate
    assert peaks[1] < 1.25 * peaks[0]  # a file four times as long: no more memory
