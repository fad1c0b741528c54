"""The caller's decisions in async mode (``askonce.client.asyncmode``), without I/O: which 202 is
followed, how each poll is shaped and bounded, what ends the wait, what reply the try reads."""

from __future__ import annotations

import pytest

import askonce
from askonce.client import ClientPolicy
from askonce.client.asyncmode import (
    MAX_POLLS,
    MAX_WAIT,
    Done,
    Follow,
    Lost,
    Poll,
    accepted,
    decide,
    first_poll,
    prefer,
    settled_reply,
)
from askonce.core.wire import Reply, parse_reply

URL = "http://127.0.0.1:8080/orders?x=1"
WHERE = "/.askonce/answers/abc"
RUNNING = {"preference-applied": "respond-async", "location": WHERE, "retry-after": "1",
           "askonce-reply": "v=1, b=0, j"}


def _stat(name: str) -> int:
    return askonce.stats().get(name, 0)


def test_the_preference_is_added_to_what_the_caller_set() -> None:
    assert prefer(None) == prefer("") == "respond-async"
    assert prefer("return=minimal") == "return=minimal, respond-async"
    assert prefer("Respond-Async, wait=5") == "Respond-Async, wait=5"  # asked already: as it came


def test_a_202_that_applied_the_preference_is_followed_on_its_own_origin() -> None:
    follow = accepted(202, RUNNING, URL, now=10.0, deadline=25.0, cap=1.0)
    assert follow is not None
    assert follow.url == "http://127.0.0.1:8080" + WHERE and follow.until == 25.0
    assert follow.reply == Reply(0, joins=True) and follow.cap == 1.0
    absolute = accepted(202, {**RUNNING, "location": "HTTP://127.0.0.1:8080/a#frag"}, URL, 0.0,
                        None, None)
    assert absolute is not None and absolute.url == "http://127.0.0.1:8080/a"
    assert absolute.until == 300.0  # no deadline: bounded all the same


@pytest.mark.parametrize("location", [
    "http://127.0.0.2:8080/a", "http://localhost:8080/a", "http://127.0.0.1:8081/a",
    "https://127.0.0.1:8080/a", "//evil.example/a", "http://u:p@127.0.0.1:8080/a"])
def test_a_location_on_another_origin_is_never_followed(location: str) -> None:
    before = _stat("client.async.offsite") + _stat("client.async.bad-location")
    assert accepted(202, {**RUNNING, "location": location}, URL, 0.0, 5.0, None) is None
    assert _stat("client.async.offsite") + _stat("client.async.bad-location") == before + 1


@pytest.mark.parametrize("location", [None, "", "/a b", "/\u00e9", "/a\nb", "/" + "a" * 3000,
                                      "ftp://127.0.0.1:8080/a", "http://127.0.0.1:99999/a"])
def test_a_malformed_location_is_not_followed(location: str | None) -> None:
    headers = {**RUNNING, "location": location}
    before = _stat("client.async.bad-location")
    assert accepted(202, headers, URL, 0.0, 5.0, None) is None
    assert _stat("client.async.bad-location") == before + 1


@pytest.mark.parametrize("headers", [
    {"location": WHERE},  # the callee's own 202: it did not apply the preference
    {**RUNNING, "preference-applied": "return=minimal"},
    {**RUNNING, "askonce-joined": "replay"},  # a kept 202 answer, replayed
])
def test_any_other_202_is_the_answer(headers: dict[str, str]) -> None:
    assert accepted(202, headers, URL, 0.0, 5.0, None) is None
    assert accepted(200, RUNNING, URL, 0.0, 5.0, None) is None


def _follow(until: float = 20.0, cap: float | None = None) -> Follow:
    return Follow("http://127.0.0.1:8080" + WHERE, Reply(0, joins=True), until, cap)


def test_a_poll_asks_to_be_held_for_the_shortest_of_time_left_own_timeout_and_the_cap() -> None:
    def shape(until: float, cap: float | None) -> tuple[str | None, float]:
        poll = first_poll(_follow(until, cap), 0.0)
        assert type(poll) is Poll and poll.after == 0.0
        return poll.prefer, poll.timeout

    assert shape(100.0, None) == (f"wait={MAX_WAIT}", MAX_WAIT + 0.2)
    assert shape(5.5, None) == ("wait=5", 5.5)
    assert shape(100.0, 3.0) == ("wait=2", 3.0)
    assert shape(100.0, 1.0) == (None, 1.0)  # under a second: asked for no hold at all


def test_a_running_answer_is_polled_again_at_once_if_held_else_after_a_gap() -> None:
    poll = first_poll(_follow(), 0.0)
    assert type(poll) is Poll
    held = decide(poll.follow, 5.0, 202, RUNNING, took=5.0)
    assert type(held) is Poll and held.after == 0.0 and held.follow.polls == 2
    quick = decide(poll.follow, 1.0, 202, RUNNING, took=0.01)
    assert type(quick) is Poll and quick.after == pytest.approx(0.99)
    hostile = decide(poll.follow, 1.0, 202, {**RUNNING, "retry-after": "0"}, took=0.0)
    assert type(hostile) is Poll and hostile.after >= 0.1  # a callee cannot make it spin
    slow = decide(poll.follow, 1.0, 202, {**RUNNING, "retry-after": "86400"}, took=0.0)
    assert type(slow) is Poll and slow.after <= 1.0
    odd = decide(poll.follow, 1.0, 202, {**RUNNING, "retry-after": "\u00b2"}, took=0.0)
    assert type(odd) is Poll and odd.after <= 1.0  # '²' is no delay-seconds: the default gap


def test_polls_stop_at_the_deadline_and_at_their_bound() -> None:
    poll = first_poll(_follow(until=2.0), 0.0)
    assert type(poll) is Poll
    assert decide(poll.follow, 1.99, 202, RUNNING, took=1.0) == Lost("deadline", False)
    assert first_poll(_follow(until=2.0), 2.5) == Lost("deadline", False)
    many = _follow(until=1e9)._replace(polls=MAX_POLLS)
    assert first_poll(many, 0.0) == Lost("polls", False)


def test_a_404_is_a_lost_answer_that_nothing_can_rejoin() -> None:
    poll = first_poll(_follow(), 0.0)
    assert type(poll) is Poll
    assert decide(poll.follow, 1.0, 404, {}, took=0.1) == Lost("gone", True)


def test_a_poll_s_own_failure_is_retried_as_a_poll_with_backoff_then_lost() -> None:
    poll = first_poll(_follow(until=100.0), 0.0)
    waits = []
    for failed in (None, 503, None):  # a transport error, the location's own 503, an error again
        assert type(poll) is Poll
        poll = decide(poll.follow, 1.0, failed, {}, took=0.1)  # type: ignore[assignment]
        assert type(poll) is Poll
        waits.append(poll.after)
    assert waits == sorted(waits) and waits[0] > 0  # backing off
    assert decide(poll.follow, 1.0, None, {}, took=0.1) == Lost("unreachable", False)
    # A good poll in between starts the count again.
    fresh = decide(poll.follow, 1.0, 202, RUNNING, took=1.0)
    assert type(fresh) is Poll and fresh.follow.errors == 0


def test_a_kept_5xx_answer_is_the_answer_not_a_poll_error() -> None:
    poll = first_poll(_follow(), 0.0)
    assert type(poll) is Poll
    done = decide(poll.follow, 1.0, 503, {"askonce-joined": "replay", "askonce-reply": "v=1, b=2"},
                  took=0.1)
    assert type(done) is Done


def test_the_answer_never_returns_more_budget_than_the_202_said() -> None:
    poll = first_poll(_follow(), 0.0)
    assert type(poll) is Poll
    done = decide(poll.follow, 1.0, 200, {"askonce-joined": "replay", "askonce-reply": "v=1, b=2"},
                  took=0.1)
    assert type(done) is Done and done.reply is not None
    assert parse_reply(done.reply) == Reply(0, joins=True)  # the status GET's own reply: b=2
    passed_on = settled_reply(Reply(1, joins=True), Reply(3, dnr=True, reason="exhausted"))
    assert passed_on == Reply(1, dnr=True, reason="exhausted", joins=True)
    assert settled_reply(None, Reply(2)) == Reply(2)
    assert settled_reply(Reply(0, joins=True), None) == Reply(0, joins=True)


def test_respond_async_is_validated() -> None:
    assert ClientPolicy().respond_async is False
    assert ClientPolicy(respond_async=True).respond_async is True
    with pytest.raises(ValueError, match="respond_async must be True or False"):
        ClientPolicy(respond_async="yes")  # type: ignore[arg-type]
