"""Replies on the client: the ones a call gave up with are recorded (``replies()``, ``record_replies``),
and replies are read through a bounded cache that agrees with the parser. The calls go through the
``Caller`` to a real HTTP server on 127.0.0.1 (``http_target.py``)."""

from __future__ import annotations

import contextvars
import threading

import pytest

import askonce
from askonce import Reply
from askonce.client import last_reply, replies
from askonce.core.wire import REPLY_HEADER
from http_target import Target, call, policy

# --- recording the replies of give-ups --------------------------------------------------------------------


def test_a_give_up_with_a_response_returns_it_and_records_the_reply(target: Target) -> None:
    p = policy()
    with askonce.question(budget=1), replies():
        status, _ = call(p, target.url("/fail"))
        assert status == 503
        assert last_reply() == Reply(0, True, "exhausted")
    assert target.total == 2


def test_replies_sees_give_ups_made_in_threads_started_inside(target: Target) -> None:
    p = policy()
    with askonce.question(budget=2), replies():
        ctx = contextvars.copy_context()
        worker = threading.Thread(target=ctx.run, args=(call, p, target.url("/dnr")))
        worker.start()
        worker.join(10)
        reply = last_reply()
    assert reply is not None and reply.dnr and reply.reason == "overloaded"
    assert target.total == 1


# --- reading replies ---------------------------------------------------------------------------------------


def test_replies_read_through_the_cache_are_what_the_parser_says() -> None:
    from askonce import propagation
    from askonce.client import read_reply, reply_from

    values = ["v=1, b=2", "v=1, b=0, dnr, r=overloaded, pb=250", b"v=1, b=7", "v=1, b=1, dnr, r=cap"]
    for _ in range(2):  # the second time from the cache
        for value in values:
            assert read_reply({REPLY_HEADER: value}) == propagation.extract_reply({REPLY_HEADER: value})
            assert reply_from([value]) == propagation.extract_reply({REPLY_HEADER: value})
    assert reply_from([]) is None and read_reply({}) is None


@pytest.mark.parametrize(("values", "counted"), [
    (["v=1, b=nope"], "malformed.reply.budget"),
    (["v=1, b=1,"], "malformed.reply.syntax"),
    (["v=2, b=1"], "malformed.reply.version"),
    (["v=1, b=1", "v=1, b=1"], "malformed.reply.duplicate-header"),
])
def test_a_malformed_reply_is_counted_every_time_never_cached(values: list[str], counted: str) -> None:
    from askonce.client import reply_from

    before = askonce.stats().get(counted, 0)
    for _ in range(3):
        assert reply_from(values) is None
    assert askonce.stats()[counted] == before + 3


def test_the_reply_cache_is_bounded() -> None:
    from askonce.client.policy import _MAX_CACHED_REPLIES, _REPLIES, reply_from

    for budget in range(1000):
        assert reply_from([f"v=1, b={budget}, pb={budget}"]) == Reply(budget, False, None, budget / 1000)
    long = "v=1, b=1000, dnr, r=" + "x" * 32 + ", pb=86400000"
    assert len(long) > 64 and reply_from([long]) == Reply(1000, True, "x" * 32, 86_400.0)
    assert len(_REPLIES) <= _MAX_CACHED_REPLIES and long not in _REPLIES


# --- recording give-ups without a with-block ----------------------------------------------------------------


def test_record_replies_starts_a_record_that_stop_recording_ends(target: Target) -> None:
    from askonce.client import Record, record_replies, recording, stop_recording

    outer = record_replies()
    mine = Record()
    inner = record_replies(mine)
    assert recording() is mine
    with askonce.question(budget=0):
        status, _ = call(policy(), target.url("/fail"))
    assert status == 503 and mine.last == Reply(0, True, "exhausted") and last_reply() == mine.last
    stop_recording(inner)
    assert recording() is not mine and last_reply() is None  # the outer record saw nothing
    stop_recording(outer)
