"""The short fuzz run of the wire parsers, and the fuzzer kept in ``fuzz/`` checked to work.

``fuzz/wire_oracle.py`` holds the invariants (askonce's parsers against http-sfv on the same bytes,
round trips, the fast path against the general parser); here hypothesis feeds it raw bytes and
mutations of the corpus, derandomized and without a database, so the run is the same every time.
The long coverage-guided run is ``python fuzz/fuzz_wire.py`` (docs/benchmarks.md has one); the
tests below check that its oracle can fail (a planted bug in a parser is caught), that its engines
report a finding (input written, exit 1), and that the corpus keeps the outcomes it was chosen for.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("http_sfv")

import askonce
from askonce.core import wire
from askonce.core.wire import Malformed, Reply

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "fuzz"
SRC = Path(askonce.__file__).resolve().parents[1]  # the askonce under test, for the subprocesses
if str(FUZZ) not in sys.path:
    sys.path.insert(0, str(FUZZ))

import fuzz_wire  # noqa: E402
from wire_oracle import Finding, check  # noqa: E402

SEEDS = fuzz_wire.seeds(fuzz_wire.CORPUS)
WORDS = fuzz_wire.tokens()
SHORT = settings(derandomize=True, database=None, deadline=None, max_examples=1000,
                 suppress_health_check=[HealthCheck.too_slow])
NO_TIME_BOUND = 10**15  # ns: these tests check logic, never how fast a parse was


# --- the short run: hypothesis feeds the oracle ---------------------------------------------


@st.composite
def mutated_seeds(draw: st.DrawFn) -> bytes:
    """A corpus input with a few edits: bytes, the dictionary's tokens, cuts and splices."""
    b = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(b)))
        edit = draw(st.sampled_from(["byte", "token", "delete", "splice"]))
        if edit == "byte":
            b[at:at + draw(st.integers(0, 1))] = draw(st.binary(min_size=1, max_size=1))
        elif edit == "token":
            b[at:at] = draw(st.sampled_from(WORDS))
        elif edit == "delete":
            del b[at:at + draw(st.integers(1, 8))]
        else:
            other = draw(st.sampled_from(SEEDS))
            b[at:] = other[draw(st.integers(0, len(other))):]
    return bytes(b)


@settings(SHORT, max_examples=1500)
@given(mutated_seeds())
def test_mutated_corpus_inputs_keep_every_invariant(data: bytes) -> None:
    check(data)


@SHORT
@given(st.binary(max_size=48) | st.text(alphabet=" \t,;=()\"\\:?*-_./abejkoprsv019", max_size=48)
       .map(str.encode))
def test_raw_inputs_keep_every_invariant(data: bytes) -> None:
    check(data)


# --- the corpus -----------------------------------------------------------------------------


def test_the_corpus_keeps_the_outcomes_it_was_chosen_for() -> None:
    labels = {check(seed)[0] for seed in SEEDS}
    firsts = {label.split("|")[0] for label in labels}
    # accepted questions and replies, and each way of being rejected that the seeds stand for
    assert {"question", "key", "too-long", "not-ascii", "syntax", "duplicate", "version",
            "path"} <= firsts, firsts
    assert any("|rejoin|" in label for label in labels)
    assert any(label.endswith("sfv-rejects") for label in labels)  # askonce rejects, so must it
    assert sum(len(s) for s in SEEDS) < 16_000 and len(SEEDS) <= 40  # small, as a corpus should be


def test_the_dictionary_file_reads_as_libfuzzer_does() -> None:
    assert b"v=1" in WORDS and b" ,\t" in WORDS and b"\xff" in WORDS and b'\\"' in WORDS


# --- the oracle can fail: a bug planted in a parser is caught --------------------------------


def _reads_decimals_as_integers(text: str) -> dict[str, wire.Value] | Malformed:
    return wire.sfv.parse_dictionary(text.replace(".5", ""))


def _loses_token_type(text: str) -> dict[str, wire.Value] | Malformed:
    d = wire.sfv.parse_dictionary(text)
    return d if isinstance(d, Malformed) else {k: str(v) if isinstance(v, wire.Token) else v
                                               for k, v in d.items()}


def _forgets_pushback(reply: Reply) -> str:
    return f"v=1, b={reply.budget}"


def _an_unknown_reason(text: str) -> dict[str, wire.Value] | Malformed:
    return Malformed(f"no-such-reason-{len(text)}")  # a reason per input: unbounded counters


def _raises_on_tabs(text: str) -> dict[str, wire.Value] | Malformed:
    if "\t" in text:
        raise IndexError("a parser bug")
    return wire.sfv.parse_dictionary(text)


@pytest.mark.parametrize(("name", "bug", "data", "says"), [
    ("parse_dictionary", _reads_decimals_as_integers, b"a=1.5", "http-sfv"),
    ("parse_dictionary", _loses_token_type, b"a=tok", "http-sfv"),
    ("format_reply", _forgets_pushback, b"v=1, b=1, pb=250", "format_reply"),
    ("parse_dictionary", _raises_on_tabs, b"v=1,\tb=2", "a parser bug"),
    ("parse_dictionary", _an_unknown_reason, b"a=1", "unknown reason"),
])
def test_the_oracle_catches_a_planted_bug(monkeypatch: pytest.MonkeyPatch, name: str, bug: object,
                                          data: bytes, says: str) -> None:
    check(data)  # holds on the real parsers
    monkeypatch.setattr(wire, name, bug)
    with pytest.raises((Finding, IndexError), match=says):
        check(data)


def test_the_oracle_catches_a_fast_path_that_disagrees_with_the_general_parser(
        monkeypatch: pytest.MonkeyPatch) -> None:
    text = next(s for s in SEEDS if s.startswith(b"v=1, k=") and b", e, b=2" in s)
    assert check(text)[0].startswith("question|")
    real = wire._canonical

    def one_too_many(t: str, now: float, limits: wire.Limits) -> object:
        fields = real(t, now, limits)  # the canonical fast path only: both parsers of a question
        return None if fields is None else (*fields[:3], fields[3] + 1, *fields[4:])

    monkeypatch.setattr(wire, "_canonical", one_too_many)
    with pytest.raises(Finding, match="the fast path says"):
        check(text)


# --- the engines report what they find -------------------------------------------------------


def test_the_mutate_engine_runs_its_inputs_and_finds_outcomes_past_the_corpus(
        tmp_path: Path) -> None:
    status, fields = fuzz_wire.fuzz_mutate(check, 3000, SEEDS, WORDS, 5, tmp_path, NO_TIME_BOUND)
    corpus_outcomes = len({check(seed)[0] for seed in SEEDS})
    assert status == 0 and fields["inputs"] == 3000 and fields["findings"] == 0
    assert int(str(fields["coverage"]).split()[0]) > corpus_outcomes
    assert not list(tmp_path.iterdir())


def test_the_mutate_engine_writes_a_finding_and_stops(tmp_path: Path) -> None:
    assert not any(fuzz_wire.PLANTED in seed for seed in SEEDS)  # only mutation gets there
    status, fields = fuzz_wire.fuzz_mutate(fuzz_wire.planted(check), 200_000, SEEDS, WORDS, 5,
                                           tmp_path, NO_TIME_BOUND)
    (crash,) = tmp_path.iterdir()
    assert status == 1 and fields["findings"] == 1 and int(str(fields["inputs"])) < 200_000
    assert fuzz_wire.PLANTED in crash.read_bytes()
    assert crash.name == f"crash-{hashlib.sha1(crash.read_bytes()).hexdigest()}"


def _timings(*ns: int) -> tuple[fuzz_wire.Check, list[bytes]]:
    """A check that reports the given times, one per call, and records its calls."""
    times, calls = iter(ns), []

    def timed(data: bytes) -> tuple[str, int]:
        calls.append(data)
        return "x", next(times)

    return timed, calls


def test_a_slow_input_is_a_finding_only_if_it_is_slow_twice() -> None:
    fast, calls = _timings(5)
    assert fuzz_wire.run_one(fast, b"a", 10) == ("x", 5) and calls == [b"a"]
    once, calls = _timings(50, 5)  # a busy machine: measured again, and it was
    assert fuzz_wire.run_one(once, b"a", 10) == ("x", 5) and calls == [b"a", b"a"]
    twice, _ = _timings(50, 60)
    with pytest.raises(TimeoutError, match=r"0\.0 ms on a 1-byte input"):
        fuzz_wire.run_one(twice, b"a", 10)


# --- the command ----------------------------------------------------------------------------------


def _command(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, str(FUZZ / "fuzz_wire.py"), *args, "--max-ms", "1e9"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


ENGINES = ["mutate", pytest.param("atheris", marks=pytest.mark.skipif(
    not fuzz_wire._has_atheris(), reason="atheris is not installed (the fuzz extra)"))]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_command_runs_its_inputs_and_prints_the_summary(engine: str, tmp_path: Path) -> None:
    done = _command("--engine", engine, "--inputs", "2000", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"fuzz_wire: engine={engine} inputs=2000 "), last
    assert "findings=0" in last and "coverage=" in last and "inputs/s=" in last
    assert not list(tmp_path.iterdir())  # no crash file, and atheris's work directory removed


@pytest.mark.parametrize("engine", ENGINES)
def test_the_command_reports_a_finding_and_exits_1(engine: str, tmp_path: Path) -> None:
    done = _command("--engine", engine, "--self-test", "--inputs", "200000", "--crashes", "out",
                    cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    crashes = list((tmp_path / "out").iterdir())
    assert crashes and all(fuzz_wire.PLANTED in c.read_bytes() for c in crashes)
    assert "the planted finding" in done.stderr and "findings=1" in done.stdout
    replayed = _command("--replay", str(crashes[0]), cwd=tmp_path)  # the real oracle: it holds
    assert replayed.returncode == 0 and "holds" in replayed.stdout, replayed.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_the_command_stops_at_max_seconds_with_its_summary(engine: str, tmp_path: Path) -> None:
    done = _command("--engine", engine, "--inputs", str(10**9), "--max-seconds", "0.5",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    fields = dict(f.split("=", 1) for f in done.stdout.strip().splitlines()[-1].split()[1:]
                  if "=" in f)
    assert fields["stopped"] == "time" and 0 < int(fields["inputs"]) < 10**9, fields


def test_the_command_rejects_bad_arguments_in_one_line(tmp_path: Path) -> None:
    done = _command("--inputs", "0", cwd=tmp_path)
    assert done.returncode == 2 and "--inputs" in done.stderr.strip().splitlines()[-1]
