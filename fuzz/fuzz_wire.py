"""Fuzz askonce's wire parsers, differential against http-sfv.

Every input goes through :func:`wire_oracle.check` (``fuzz/wire_oracle.py``: askonce's parsers and
http-sfv's on the same bytes, and the invariants they must keep). Two engines make the inputs:

* ``atheris`` (``pip install -e '.[fuzz]'``): libFuzzer, coverage-guided over the bytecode of
  askonce and http-sfv, seeded from ``fuzz/corpus`` and the tokens of ``fuzz/wire.dict``. It runs
  in a child interpreter, because libFuzzer ends its process with ``exit()``; this process reads
  the child's log for the coverage figures and the child's last line for the counts.
* ``mutate`` (no dependency): a seeded mutation fuzzer in pure Python over the same corpus and
  tokens. Not coverage-guided: an input whose outcome (which parser accepted it, which reason
  rejected it) is new joins the pool it mutates, and ``coverage`` counts those outcomes.

    python fuzz/fuzz_wire.py                             # 10 million inputs, atheris if installed
    python fuzz/fuzz_wire.py --inputs 100000 --engine mutate --seed 7

Exit 0: no finding. Exit 1: a finding; the input is written to ``--crashes`` as ``crash-<sha1>``
(libFuzzer's naming) and named on stderr; replay it with ``--replay FILE``. The last line of
stdout is the summary: ``fuzz_wire: engine=... inputs=... seconds=... inputs/s=... ...``.
``--self-test`` plants a finding (any input holding ``((``) to see the harness catch and report it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
DICT = HERE / "wire.dict"
MAX_LEN = 4096  # past the 2048-character limit, so that too-long is exercised too
POOL = 4096  # the mutate engine's pool of inputs: bounded

Check = Callable[[bytes], tuple[str, int]]


# --- inputs ---------------------------------------------------------------------------------------


def seeds(corpus: Path) -> list[bytes]:
    """The corpus files' contents, in name order (the engines' starting points)."""
    return [p.read_bytes() for p in sorted(corpus.iterdir()) if p.is_file()]


def tokens(path: Path = DICT) -> list[bytes]:
    """The values of a libFuzzer dictionary file: ``name="value"`` lines, with ``\\xNN`` and
    ``\\"`` escapes."""
    out = []
    for line in path.read_text("ascii").splitlines():
        m = re.fullmatch(r'\s*(?:\w+\s*=\s*)?"(.*)"\s*', line)
        if m is not None and not line.lstrip().startswith("#"):
            out.append(m.group(1).encode("ascii").decode("unicode_escape").encode("latin-1"))
    return out


def mutate(rng: random.Random, data: bytes, pool: list[bytes], words: list[bytes]) -> bytes:
    """One to four edits of ``data``: a byte changed, inserted or deleted, a token inserted or
    written over, a slice dropped or repeated, a splice with another input, a cut."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(b))
        op = rng.randrange(9)
        if op == 0 and at < len(b):
            b[at] = rng.randrange(256) if rng.random() < 0.1 else rng.randrange(32, 127)
        elif op == 1:
            b.insert(at, rng.randrange(32, 127) if rng.random() < 0.9 else rng.randrange(256))
        elif op == 2 and at < len(b):
            del b[at:at + rng.randint(1, 4)]
        elif op in (3, 4):
            w = rng.choice(words)
            b[at:at + (len(w) if op == 4 else 0)] = w
        elif op == 5 and b:
            lo = rng.randrange(len(b))
            del b[lo:lo + rng.randint(1, 16)]
        elif op == 6 and b:
            lo = rng.randrange(len(b))
            b[at:at] = b[lo:lo + rng.randint(1, 32)] * rng.randint(1, 3)
        elif op == 7:
            other = rng.choice(pool)
            cut = rng.randint(0, len(other))
            b = b[:at] + other[cut:]
        elif op == 8:
            del b[at:]
    if rng.random() < 0.002:  # now and then, far past the size limit
        b = b * (MAX_LEN // max(1, len(b)))
    return bytes(b[:MAX_LEN])


# --- findings -------------------------------------------------------------------------------------


def record(data: bytes, crashes: Path) -> Path:
    """Write a finding's input as ``crash-<sha1>`` in ``crashes``."""
    crashes.mkdir(parents=True, exist_ok=True)
    path = crashes / f"crash-{hashlib.sha1(data).hexdigest()}"
    path.write_bytes(data)
    return path


def run_one(check: Check, data: bytes, max_ns: int) -> tuple[str, int]:
    """``check(data)``, and a bound on askonce's CPU time: an input over ``max_ns`` is measured
    again (a cache, a collection may have run) and is a finding only if it is slow twice."""
    label, ns = check(data)
    if ns > max_ns:
        _, again = check(data)
        if again > max_ns:
            raise TimeoutError(f"askonce took {min(ns, again) / 1e6:.1f} ms on a {len(data)}-byte "
                               "input")
        ns = again
    return label, ns


PLANTED = b"(("


def planted(check: Check) -> Check:
    """``check``, and a finding on any input holding :data:`PLANTED` (``--self-test``): no seed
    holds it, so only a run that mutates its inputs and reports what it finds gets there."""

    def with_plant(data: bytes) -> tuple[str, int]:
        if PLANTED in data:
            raise AssertionError(f"the planted finding: the input holds {PLANTED!r}")
        return check(data)

    return with_plant


def summary(fields: dict[str, object]) -> str:
    return "fuzz_wire: " + " ".join(f"{k}={v}" for k, v in fields.items())


# --- the pure-Python engine -----------------------------------------------------------------------


def fuzz_mutate(check: Check, inputs: int, corpus: list[bytes], words: list[bytes], seed: int,
                crashes: Path, max_ns: int,
                max_seconds: float = math.inf) -> tuple[int, dict[str, object]]:
    """Run ``inputs`` inputs (or as many as ``max_seconds`` allow): the corpus first, then
    mutations of the pool. Return the exit status and the summary's fields."""
    rng = random.Random(seed)
    pool = list(corpus) or [b""]
    outcomes: set[str] = set()
    worst = 0
    start = time.perf_counter()
    n = 0
    status = 0
    stop = start + max_seconds
    while n < inputs and (n % 1024 or time.perf_counter() < stop):
        data = corpus[n] if n < len(corpus) else mutate(rng, rng.choice(pool), pool, words)
        n += 1
        try:
            label, ns = run_one(check, data, max_ns)
        except Exception as e:
            path = record(data, crashes)
            print(f"fuzz_wire: finding on input {n}: {type(e).__name__}: {e}\n"
                  f"  input written to {path}", file=sys.stderr)
            status = 1
            break
        worst = max(worst, ns)
        if label not in outcomes:
            outcomes.add(label)
            if len(pool) >= POOL:
                pool[rng.randrange(min(len(corpus), POOL - 1), POOL)] = data  # seeds stay
            else:
                pool.append(data)
    seconds = time.perf_counter() - start
    stopped = "finding" if status else "inputs" if n == inputs else "time"
    return status, {"engine": "mutate", "inputs": n, "stopped": stopped,
                    "seconds": f"{seconds:.1f}",
                    "inputs/s": f"{n / seconds:.0f}" if seconds else "-",
                    "coverage": f"{len(outcomes)} outcomes", "worst_ms": f"{worst / 1e6:.2f}",
                    "findings": status}


# --- the atheris engine ---------------------------------------------------------------------------


def _worker(inputs: int, max_ns: int, max_seconds: float, self_test: bool,
            libfuzzer: list[str]) -> None:
    """The child: instrument askonce and http-sfv as they are imported, then hand libFuzzer the
    check. After ``inputs`` inputs (or ``max_seconds``) it prints the counts as one JSON line and
    ends itself."""
    import atheris  # type: ignore[import-untyped, import-not-found, unused-ignore]

    with atheris.instrument_imports(include=["askonce", "http_sfv"]):
        import wire_oracle
    check = planted(wire_oracle.check) if self_test else wire_oracle.check
    count = 0
    worst = 0
    start = time.perf_counter()
    stop = start + max_seconds

    def one(data: bytes) -> None:
        nonlocal count, worst
        _, ns = run_one(check, data, max_ns)
        worst = max(worst, ns)
        count += 1
        if count >= inputs or (count % 1024 == 0 and time.perf_counter() >= stop):
            seconds = time.perf_counter() - start
            print(json.dumps({"inputs": count, "seconds": seconds, "worst_ns": worst,
                              "stopped": "inputs" if count >= inputs else "time"}), flush=True)
            os._exit(0)  # libFuzzer would otherwise go on; what it found is on disk already

    atheris.Setup([sys.argv[0], *libfuzzer], one)
    atheris.Fuzz()


_COV = re.compile(rb"^#(\d+)\s.*cov: (\d+) ft: (\d+) corp: (\d+)")
_UNITS = re.compile(rb"^stat::number_of_executed_units: (\d+)")
_RAISED = re.compile(rb"^\w*(?:Error|Finding|Exception): .*")


def fuzz_atheris(inputs: int, corpus: Path, seed: int, crashes: Path, max_ns: int, work: Path,
                 timeout: int, verbose: bool, self_test: bool,
                 max_seconds: float = math.inf) -> tuple[int, dict[str, object]]:
    """Run the child; return the exit status and the summary's fields (coverage from its log)."""
    grown = work / "corpus"
    grown.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    log = work / "libfuzzer.log"
    before = set(crashes.iterdir())  # libFuzzer's artifacts: crash-, timeout-, oom-, slow-unit-
    libfuzzer = [f"-seed={seed}", f"-max_len={MAX_LEN}", f"-dict={DICT}", f"-timeout={timeout}",
                 f"-artifact_prefix={crashes}{os.sep}", "-print_final_stats=1", str(grown),
                 str(corpus)]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--inputs", str(inputs),
           "--max-ms", str(max_ns / 1e6), "--max-seconds", str(max_seconds),
           *(["--self-test"] if self_test else []), "--", *libfuzzer]
    start = time.perf_counter()
    runs, edges, features, units = 0, 0, 0, 0  # the last of libFuzzer's status lines
    raised = b""
    pipe = subprocess.PIPE
    with log.open("wb") as out, subprocess.Popen(cmd, stdout=pipe, stderr=pipe) as child:
        assert child.stderr is not None and child.stdout is not None
        for line in child.stderr:
            out.write(line)
            m = _COV.search(line)
            if m is not None:
                runs, edges, features, units = (int(g) for g in m.groups())
            n = _UNITS.match(line)
            if n is not None:
                runs = int(n[1])
            if verbose:
                sys.stderr.buffer.write(line)
                sys.stderr.flush()
        lines = child.stdout.read().strip().splitlines()  # the traceback of a finding, or counts
        out.write(b"".join(line + b"\n" for line in lines))
        last = lines[-1] if lines else b""
        rc = child.wait()
    for line in lines:
        e = _RAISED.match(line)
        if e is not None:
            raised = e[0]
    seconds = time.perf_counter() - start
    counts = json.loads(last) if rc == 0 and last.startswith(b"{") else None
    fields: dict[str, object] = {"engine": "atheris"}
    if counts is None:
        found = sorted(set(crashes.iterdir()) - before)
        print(f"fuzz_wire: libFuzzer stopped (exit {rc}) after {runs} inputs: "
              f"{raised.decode('utf-8', 'replace').strip()}\n  its log: {log}", file=sys.stderr)
        for path in found:
            print(f"  input written to {path}", file=sys.stderr)
        fields.update({"inputs": runs, "seconds": f"{seconds:.1f}",
                       "coverage": f"{edges} edges {features} features", "corpus": units,
                       "findings": max(1, len(found))})
        return 1, fields
    n = counts["inputs"]
    fields.update({"inputs": n, "stopped": counts["stopped"], "seconds": f"{seconds:.1f}",
                   "inputs/s": f"{n / counts['seconds']:.0f}",
                   "coverage": f"{edges} edges {features} features", "corpus": units,
                   "worst_ms": f"{counts['worst_ns'] / 1e6:.2f}", "findings": 0})
    return 0, fields


# --- the command ----------------------------------------------------------------------------------


def _has_atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(prog="fuzz_wire.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=10_000_000,
                    help="how many inputs (default 10 million)")
    ap.add_argument("--max-seconds", type=float, default=math.inf,
                    help="stop after this long even short of --inputs (summary: stopped=time)")
    ap.add_argument("--engine", choices=["auto", "atheris", "mutate"], default="auto",
                    help="atheris if installed (auto), or the pure-Python mutation fuzzer")
    ap.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    ap.add_argument("--corpus", type=Path, default=CORPUS,
                    help="seed inputs, read only (fuzz/corpus)")
    ap.add_argument("--crashes", type=Path, default=Path("."),
                    help="where a finding's input goes (.)")
    ap.add_argument("--work", type=Path, help="atheris: keep the corpus it grows and its log here "
                                              "(default: a temporary directory, removed)")
    ap.add_argument("--max-ms", type=float, default=100.0,
                    help="askonce's CPU ms on one input over this, twice: a finding (100)")
    ap.add_argument("--timeout", type=int, default=10,
                    help="atheris: libFuzzer's per-input limit, seconds (10)")
    ap.add_argument("--replay", type=Path, help="check this one input and say what happened")
    ap.add_argument("--self-test", action="store_true",
                    help="plant a finding (an input holding '((') and see it reported: exit 1")
    ap.add_argument("-v", "--verbose", action="store_true", help="atheris: show libFuzzer's log")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inputs < 1 or args.max_ms <= 0 or args.timeout < 1 or not args.max_seconds > 0:
        ap.error("--inputs, --max-seconds, --max-ms and --timeout must be positive")
    max_ns = int(args.max_ms * 1e6)
    if args.worker:
        _worker(args.inputs, max_ns, args.max_seconds, args.self_test, rest)
        return 0
    if args.replay is not None:
        return replay(args.replay, max_ns)
    if not args.corpus.is_dir():
        ap.error(f"--corpus {args.corpus}: not a directory")
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if _has_atheris() else "mutate"
    elif engine == "atheris" and not _has_atheris():
        ap.error("--engine atheris: atheris is not installed (pip install -e '.[fuzz]')")
    if engine == "mutate":
        import wire_oracle

        check = planted(wire_oracle.check) if args.self_test else wire_oracle.check
        status, fields = fuzz_mutate(check, args.inputs, seeds(args.corpus), tokens(),
                                     args.seed, args.crashes, max_ns, args.max_seconds)
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix="askonce-fuzz-"))
        status, fields = fuzz_atheris(args.inputs, args.corpus.resolve(), args.seed,
                                      args.crashes.resolve(), max_ns, work.resolve(), args.timeout,
                                      args.verbose, args.self_test, args.max_seconds)
        if args.work is None and status == 0:  # a failed run keeps its log (named on stderr)
            shutil.rmtree(work, ignore_errors=True)
    print(summary(fields), flush=True)
    return status


def replay(path: Path, max_ns: int) -> int:
    import wire_oracle

    data = path.read_bytes()
    try:
        label, ns = run_one(wire_oracle.check, data, max_ns)
    except Exception as e:
        print(f"fuzz_wire: {path}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"fuzz_wire: {path}: holds ({label}, {ns / 1e6:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
