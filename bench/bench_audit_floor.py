"""The floor of ``askonce audit`` (issue 16, item 4): what any engine pays on ``bench_audit.py``'s logs.

    python bench/bench_audit_floor.py                 # 64 MiB logs, 3 rounds; needs duckdb and polars
    python bench/bench_audit_floor.py --mb 128 --rounds 5

Not an engine: each stage is the least an engine with the line-by-line reader's figures must do, timed alone
(CPU seconds of the process, all threads; the minimum over rounds, each round in a fresh interpreter):

* importing the vectorized library (``audit_file`` imports it, so the audit's MB/s includes it);
* DuckDB alone: the lines read into columns (time, operation, principal, key, edge flag, path) and grouped by
  operation and key (count, first line, paths) and the keys ranked by first arrival, nothing handed to Python -
  ``loose``: ``read_json`` of four columns, no check that ``json.loads`` reads the line the same;
  ``strict``: each line parsed by ``json_extract_string`` with its keys listed (to send a line with repeated
  keys to Python) and the header matched against the canonical form (RE2), as an engine must;
* handing Python what the ledger keeps: the first 50,000 keys per operation (exact) and the attributable
  arrivals past the bound, in order (for the heavy-key summary);
* the sketches in Python on those arrivals: the distinct keys (``set`` or ``dict.fromkeys``), one blake2b per
  distinct key (``key_digests``), the HyperLogLog registers, the Misra-Gries summary fed in order.

100 MB/s is the whole 67 MB log in 0.67 s of wall time, on 2 CPUs at most 1.34 CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

_STRICT = (r'^v=1, k="[0-9A-Za-z_-]{16,64}", o=[A-Za-z][A-Za-z0-9_.-]{0,31}(?:, e)?, '
           r"b=(?:0{0,3}[0-9]|0{0,2}[1-9][0-9]|0?[1-9][0-9]{2}|1000)"
           r"(?:, d=(?:[0-9]{1,7}|0[0-9]{7}|[1-7][0-9]{7}|8[0-5][0-9]{6}|86[0-3][0-9]{5}|86400000))?"
           r"(?:, p=\([A-Za-z][A-Za-z0-9_.-]{0,31}:[0-9]{1,4}(?: [A-Za-z][A-Za-z0-9_.-]{0,31}:[0-9]{1,4}){0,15}\))?"
           r"(?:, s=:[A-Za-z0-9+/=]{4,88}:)?$")


def _sources(path: str, kind: str) -> dict[str, str]:
    lines = (f"read_csv('{path}', columns={{'raw': 'VARCHAR'}}, delim='\\0', quote='', escape='', "
             "header=false, auto_detect=false)")
    if kind == "jsonl":
        loose = (f"select time::DOUBLE t, operation op, coalesce(principal, '') pr, askonce_question h "
                 f"from read_json('{path}', format='newline_delimited', columns={{time: 'VARCHAR', "
                 "operation: 'VARCHAR', principal: 'VARCHAR', askonce_question: 'VARCHAR'})")
        strict = (f"select v[1]::DOUBLE t, v[2] op, coalesce(v[3], '') pr, v[4] h, "
                  f"len(ks) = len(list_distinct(ks)) once, regexp_full_match(v[4], '{_STRICT}') canon from "
                  "(select json_extract_string(raw, ['$.time', '$.operation', '$.principal', "
                  f"'$.askonce_question']) v, json_keys(raw) ks from {lines})")
        return {"loose": loose, "strict": strict}
    request = "split_part(raw, '\"', 2)"
    nginx = (f"select substr(raw, instr(raw, '[') + 1, instr(raw, ']') - instr(raw, '[') - 1) tt, "
             f"split_part({request}, ' ', 1) || ' ' || regexp_replace(split_part({request}, ' ', 2), "
             "'/[0-9]+', '/{id}', 'g') op, '' pr, "
             "replace(substr(raw, instr(raw, '\"v=') + 1, instr(substr(raw, instr(raw, '\"v=') + 1), '\"') - 1), "
             "'\\x22', '\"') h")
    return {"strict": f"{nginx}, regexp_full_match(h, '{_STRICT}') canon from {lines}"}


def _child(path: str, kind: str, variant: str) -> dict[str, float]:
    out: dict[str, float] = {}

    def stage(name: str, c0: float) -> float:
        now = time.process_time()
        out[name] = now - c0
        return now

    c = time.process_time()
    import duckdb

    c = stage("import duckdb", c)
    import polars  # noqa: F401  (after duckdb: what it adds)

    c = stage("import polars", c)
    con = duckdb.connect()
    src = _sources(path, kind)[variant]
    con.execute(f"""create temp table a as select *, substr(h, 9, instr(substr(h, 9), '"') - 1) key,
        contains(h, ', e, b=') edge, case when contains(h, ', p=(') then substr(h, instr(h, ', p=(') + 5,
        instr(substr(h, instr(h, ', p=(') + 5), ')') - 1) end p from ({src})""")
    c = stage("duckdb: lines to columns", c)
    con.execute("""create temp table k as select op, edge, pr, key, min(rowid) first, count(*) n,
        min(p) p0, count(distinct p) np from a where h is not null group by all""")
    c = stage("duckdb: group by operation, key", c)
    con.execute("create temp table k2 as select *, row_number() over (partition by op order by first) r from k")
    c = stage("duckdb: keys ranked by first arrival", c)
    exact = {n: v.tolist() for n, v in con.execute(
        "select op, edge, pr, key, n, p0 from k2 where r <= 50000").fetchnumpy().items()}
    c = stage("to Python: exact keys", c)
    spilled = {n: v.tolist() for n, v in con.execute(
        "select a.op, a.pr, a.key from a semi join (select op, edge, pr, key from k2 where r > 50000 and edge) s "
        "using (op, edge, pr, key) order by a.rowid").fetchnumpy().items()}
    c = stage("to Python: arrivals past the bound", c)
    out["n exact"], out["n past"] = len(exact["key"]), len(spilled["key"])

    from askonce.core.ledger.sketch import Frequent, HyperLogLog, key_digests

    tables: dict[tuple[str, bool, str], dict[str, int]] = {}
    for op, edge, pr, key, n, _ in zip(*exact.values(), strict=True):
        tables.setdefault((op, edge, pr), {})[key] = n
    c = stage("Python: exact tables", c)
    by_op: dict[str, list[tuple[str, str]]] = {}
    for op, pr, key in zip(*spilled.values(), strict=True):
        by_op.setdefault(op, []).append((pr, key))
    c = stage("Python: (principal, key) pairs", c)
    distinct = {op: dict.fromkeys(items) for op, items in by_op.items()}
    c = stage("Python: distinct pairs (dict.fromkeys)", c)
    hashes = {op: key_digests(d) for op, d in distinct.items()}
    c = stage("Python: blake2b per distinct pair", c)
    for h in hashes.values():
        HyperLogLog(14).add_hashes(h)
    c = stage("Python: HyperLogLog registers", c)
    for items in by_op.values():
        Frequent(10).add_each(items)
    stage("Python: Misra-Gries, in order", c)
    out["n distinct"] = sum(len(d) for d in distinct.values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mb", type=float, default=64.0, help="MiB per log")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    sys.path.insert(0, str(HERE))
    from bench_ledger import _generate

    out = [f"`python bench/bench_audit_floor.py --mb {args.mb:g} --rounds {args.rounds}`, load average "
           f"{os.getloadavg()[0]:.1f} at the start; CPU seconds, minimum of {args.rounds} rounds.", ""]
    with tempfile.TemporaryDirectory(prefix="askonce-bench-floor-") as tmp:
        for kind in ("jsonl", "nginx"):
            path = Path(tmp) / f"log.{kind}"
            _generate(path, kind, args.mb)
            size = path.stat().st_size / 1e6
            for variant in _sources(str(path), kind):
                best: dict[str, float] = {}
                for _ in range(args.rounds):
                    done = subprocess.run([sys.executable, __file__, "--child", str(path), kind, variant],
                                          capture_output=True, text=True, check=True)
                    for name, v in json.loads(done.stdout).items():
                        best[name] = min(best.get(name, v), v)
                counts = {n: int(best.pop(n)) for n in ("n exact", "n past", "n distinct")}
                out += [f"#### {kind} ({size:,.0f} MB), {variant}: {counts['n exact']:,} exact keys, "
                        f"{counts['n past']:,} arrivals past the bound, {counts['n distinct']:,} distinct", "",
                        "| stage | CPU s |", "|---|---:|"]
                out += [f"| {name} | {v:.3f} |" for name, v in best.items()]
                duck = sum(v for n, v in best.items() if n.startswith("duckdb"))
                py = sum(v for n, v in best.items() if n.startswith(("to Python", "Python")))
                out += [f"| **duckdb stages** | **{duck:.3f}** |", f"| **Python and hand-over** | **{py:.3f}** |",
                        f"| **all but polars' import** | **{sum(best.values()) - best['import polars']:.3f}**"
                        " |", ""]
    out.append(f"Load average at the end: {os.getloadavg()[0]:.1f}.")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
