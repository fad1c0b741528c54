"""core.join: which arrivals of a question run, wait, are replayed, conflict or bypass."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from askonce.core.join import (
    Answer,
    JoinPolicy,
    Joins,
    Preference,
    Verdict,
    decode_answer,
    encode_answer,
    parse_prefer,
)

Q = ("tenant", "GET /x", "KEY0123456789abcdef")
OK = Answer(200, ((b"content-type", b"text/plain"),), b"done")


def test_the_first_runs_the_others_wait_then_a_late_one_is_replayed() -> None:
    j = Joins(JoinPolicy(ttl=10.0))
    verdict, first = j.arrive(Q, b"d", 0.0)
    assert verdict is Verdict.RUN and first is not None
    for _ in range(3):
        assert j.arrive(Q, b"d", 1.0) == (Verdict.WAIT, first)
    assert first.waiters == 3
    j.finish(Q, first, OK, 2.0)
    assert first.done and first.answer == OK
    assert j.arrive(Q, b"d", 11.9) == (Verdict.REPLAY, first)
    verdict, again = j.arrive(Q, b"d", 12.0)  # past the ttl: run again
    assert verdict is Verdict.RUN and again is not first


def test_the_same_key_with_another_request_conflicts() -> None:
    j = Joins()
    _, entry = j.arrive(Q, b"d", 0.0)
    assert j.arrive(Q, b"other", 0.0)[0] is Verdict.CONFLICT
    assert entry is not None
    j.finish(Q, entry, OK, 1.0)
    assert j.arrive(Q, b"other", 2.0)[0] is Verdict.CONFLICT


@pytest.mark.parametrize("answer", [Answer(503, (), b"busy"), Answer(200, (), b"x" * 11)])
def test_a_server_error_or_a_large_answer_goes_to_the_waiters_and_is_not_kept(answer: Answer) -> None:
    j = Joins(JoinPolicy(max_body=10))
    _, entry = j.arrive(Q, b"d", 0.0)
    assert entry is not None and j.arrive(Q, b"d", 0.0)[0] is Verdict.WAIT
    j.finish(Q, entry, answer, 1.0)
    assert entry.answer == answer  # the waiters get it
    assert j.arrive(Q, b"d", 1.0)[0] is Verdict.RUN  # a retry really tries again
    assert len(j) == 1


def test_an_abandoned_run_is_forgotten_and_its_waiters_arrive_again() -> None:
    j = Joins()
    _, entry = j.arrive(Q, b"d", 0.0)
    assert entry is not None
    j.abandon(Q, entry)
    assert entry.done and entry.answer is None and len(j) == 0
    assert j.arrive(Q, b"d", 0.0)[0] is Verdict.RUN


def test_principals_and_operations_never_share_an_answer() -> None:
    j = Joins()
    _, entry = j.arrive(Q, b"d", 0.0)
    assert entry is not None
    j.finish(Q, entry, OK, 0.0)
    assert j.arrive(("another", *Q[1:]), b"d", 0.0)[0] is Verdict.RUN
    assert j.arrive((Q[0], "POST /x", Q[2]), b"d", 0.0)[0] is Verdict.RUN


def test_full_of_questions_in_flight_it_bypasses_and_evicts_finished_ones_first() -> None:
    j = Joins(JoinPolicy(max_entries=2))
    _, a = j.arrive(("p", "op", "a"), b"", 0.0)
    _, b = j.arrive(("p", "op", "b"), b"", 0.0)
    assert j.arrive(("p", "op", "c"), b"", 0.0) == (Verdict.BYPASS, None)  # never evict in flight
    assert a is not None and b is not None
    j.finish(("p", "op", "a"), a, OK, 0.0)
    assert j.arrive(("p", "op", "c"), b"", 0.0)[0] is Verdict.RUN  # the finished one made room
    assert j.arrive(("p", "op", "b"), b"", 0.0)[0] is Verdict.WAIT
    assert j.arrive(("p", "op", "a"), b"", 0.0)[0] is Verdict.BYPASS  # evicted, and b, c run


@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from(["arrive", "finish", "abandon"]),
                          st.floats(0, 100)), max_size=300))
def test_bounded_and_every_entry_in_flight_is_remembered(ops: list[tuple[int, str, float]]) -> None:
    j = Joins(JoinPolicy(max_entries=8, ttl=5.0))
    running: dict[tuple[str, str, str], object] = {}
    now = 0.0
    for k, op, dt in ops:
        now += dt / 10
        scope = ("p", "op", str(k))
        if op == "arrive":
            verdict, entry = j.arrive(scope, b"", now)
            if verdict is Verdict.RUN:
                running[scope] = entry
        elif scope in running:
            entry = running.pop(scope)
            if op == "finish":
                j.finish(scope, entry, OK, now)  # type: ignore[arg-type]
            else:
                j.abandon(scope, entry)  # type: ignore[arg-type]
        assert len(j) <= 8
        for s in running:  # a run in flight is never forgotten: its arrivals wait
            assert j.arrive(s, b"", now)[0] is Verdict.WAIT


@pytest.mark.parametrize("bad", [{"ttl": -1}, {"ttl": float("nan")}, {"max_entries": 0},
                                 {"max_entries": 1.5}, {"max_body": -1}, {"max_body": True}])
def test_a_bad_policy_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        JoinPolicy(**bad)  # type: ignore[arg-type]


# --- an answer stored in a shared store, and the Prefer header --------------------------------------

@given(st.integers(100, 999), st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=40)),
                                       max_size=8), st.binary(max_size=200))
def test_an_encoded_answer_decodes_to_itself(status: int, headers: list[tuple[bytes, bytes]],
                                             body: bytes) -> None:
    answer = Answer(status, tuple(headers), body)
    assert decode_answer(encode_answer(answer), 1000) == answer


@given(st.binary(max_size=64))
def test_bytes_that_are_not_an_answer_decode_to_none_or_an_answer_never_an_error(raw: bytes) -> None:
    decoded = decode_answer(raw, 1000)
    assert decoded is None or 100 <= decoded.status <= 999


def test_a_stored_body_over_the_bound_or_cut_short_is_refused() -> None:
    raw = encode_answer(Answer(200, ((b"k", b"v"),), b"x" * 11))
    assert decode_answer(raw, 10) is None
    assert decode_answer(raw[:6], 100) is None  # a header cut short
    assert decode_answer(b"", 100) is None


def test_peek_shows_a_question_without_arriving() -> None:
    j = Joins(JoinPolicy(ttl=5.0))
    assert j.peek(Q, 0.0) is None
    _, entry = j.arrive(Q, b"d", 0.0)
    assert j.peek(Q, 1.0) is entry and entry is not None and entry.waiters == 0
    j.finish(Q, entry, OK, 1.0)
    assert j.peek(Q, 5.9) is entry and j.peek(Q, 6.0) is None


@pytest.mark.parametrize(("values", "expected"), [
    ([], Preference()),
    (["respond-async"], Preference(True)),
    (["respond-async, wait=10"], Preference(True, 10.0)),
    (["wait=100000", "RESPOND-ASYNC"], Preference(True, 30.0)),  # capped
    (['wait="5"'], Preference(False, 5.0)),
    (["wait=-1", "wait=1e9", "wait=", "handling=lenient"], Preference()),  # ignored
    (["respond-async, wait=\u00b2"], Preference(True)),  # a latin-1 '²': a digit to isdigit()
])
def test_prefer_asks_for_async_and_a_bounded_wait(values: list[str], expected: Preference) -> None:
    assert parse_prefer(values, 30.0) == expected
