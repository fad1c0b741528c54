"""RedisJoinStore against a real ``redis-server``: one run per question across store instances
(as across replicas), the lease a dead holder leaves expires, and Redis down means run unjoined."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest

import askonce
from askonce.core.join import Answer, JoinPolicy, Verdict
from askonce.stores.join_redis import TIMED_OUT, RedisJoinStore
from redis_server import RedisServer

POLICY = JoinPolicy(ttl=30.0, max_body=1000)
OK = Answer(200, ((b"content-type", b"text/plain"),), b"done")
D = b"d" * 16


def scope() -> tuple[str, str, str]:
    return ("tenant", "POST /orders", uuid.uuid4().hex)


@pytest.fixture
def stores(shared_redis: RedisServer) -> Iterator[tuple[RedisJoinStore, RedisJoinStore]]:
    a, b = RedisJoinStore(shared_redis.url, lease=0.6), RedisJoinStore(shared_redis.url, lease=0.6)
    yield a, b
    a.close()
    b.close()


def test_one_runs_another_replica_waits_for_its_answer_then_it_is_replayed(
        stores: tuple[RedisJoinStore, RedisJoinStore]) -> None:
    a, b = stores
    q = scope()
    verdict, _, token = a.arrive(q, D, POLICY)
    assert verdict is Verdict.RUN and token is not None
    assert b.arrive(q, D, POLICY)[0] is Verdict.WAIT
    got: list[Answer | None] = []
    waiter = threading.Thread(target=lambda: got.append(b.wait(q, 10.0, POLICY)))
    waiter.start()
    a.finish(q, token, OK, POLICY)
    waiter.join(10)
    assert got == [OK]
    assert b.arrive(q, D, POLICY) == (Verdict.REPLAY, OK, None)
    assert b.arrive(q, b"e" * 16, POLICY)[0] is Verdict.CONFLICT


def test_a_failed_answer_goes_to_the_waiters_and_the_next_arrival_runs_again(
        stores: tuple[RedisJoinStore, RedisJoinStore]) -> None:
    a, b = stores
    q = scope()
    _, _, token = a.arrive(q, D, POLICY)
    assert token is not None and b.arrive(q, D, POLICY)[0] is Verdict.WAIT
    failed = Answer(503, (), b"busy")
    a.finish(q, token, failed, POLICY)
    assert b.wait(q, 10.0, POLICY) == failed  # pushed before the wait began: still there
    assert b.arrive(q, D, POLICY)[0] is Verdict.RUN


def test_a_holder_keeps_the_question_past_its_lease_while_it_renews(
        stores: tuple[RedisJoinStore, RedisJoinStore]) -> None:
    a, b = stores
    q = scope()
    assert a.arrive(q, D, POLICY)[0] is Verdict.RUN
    assert b.arrive(q, D, POLICY)[0] is Verdict.WAIT
    assert b.wait(q, 1.5, POLICY) is TIMED_OUT  # 2.5 leases: still held, renewed
    a.close()  # renewals stop, as when its process dies
    assert b.arrive(q, D, POLICY)[0] is Verdict.WAIT
    assert b.wait(q, 30.0, POLICY) is None  # the lease expired: arrive again and take it over


def test_a_crashed_holder_blocks_the_key_no_longer_than_its_lease(shared_redis: RedisServer) -> None:
    holder, waiter = RedisJoinStore(shared_redis.url, lease=0.5), RedisJoinStore(shared_redis.url)
    q = scope()
    try:
        assert holder.arrive(q, D, POLICY)[0] is Verdict.RUN
        holder.close()  # no more renewals: as if its process were killed
        assert waiter.arrive(q, D, POLICY)[0] is Verdict.WAIT
        assert waiter.wait(q, 30.0, POLICY) is None  # the lease expired with no answer
        verdict, _, token = waiter.arrive(q, D, POLICY)
        assert verdict is Verdict.RUN and token is not None  # taken over
        waiter.finish(q, token, OK, POLICY)
        assert waiter.arrive(q, D, POLICY)[1] == OK
    finally:
        waiter.close()


def test_a_waiter_stops_at_its_own_deadline_and_a_rejoin_never_takes_a_lease(
        stores: tuple[RedisJoinStore, RedisJoinStore]) -> None:
    a, b = stores
    q = scope()
    assert b.arrive(q, D, POLICY, may_run=False)[0] is Verdict.BYPASS  # nothing to join
    assert a.arrive(q, D, POLICY)[0] is Verdict.RUN
    assert b.arrive(q, D, POLICY, may_run=False)[0] is Verdict.WAIT
    assert b.wait(q, 0.2, POLICY) is TIMED_OUT


def test_the_async_form_shares_the_same_questions(
        stores: tuple[RedisJoinStore, RedisJoinStore]) -> None:
    a, b = stores
    q = scope()

    async def go() -> Answer | None:
        verdict, _, token = await a.aarrive(q, D, POLICY)
        assert verdict is Verdict.RUN and token is not None
        assert (await b.aarrive(q, D, POLICY))[0] is Verdict.WAIT
        waiting = asyncio.ensure_future(b.await_answer(q, 10.0, POLICY))
        await asyncio.sleep(0.05)
        await a.afinish(q, token, OK, POLICY)
        return await waiting

    assert asyncio.run(go()) == OK
    assert a.arrive(q, D, POLICY)[0] is Verdict.REPLAY  # the sync form sees the async one's


def test_waiters_past_the_bound_run_unjoined(shared_redis: RedisServer) -> None:
    a, b = RedisJoinStore(shared_redis.url), RedisJoinStore(shared_redis.url, max_waiters=0)
    q = scope()
    before = askonce.stats()
    try:
        assert a.arrive(q, D, POLICY)[0] is Verdict.RUN
        assert b.arrive(q, D, POLICY)[0] is Verdict.BYPASS
        assert askonce.stats()["server.join.redis.waiters-full"] == \
            before.get("server.join.redis.waiters-full", 0) + 1
    finally:
        a.close()
        b.close()


def test_status_long_polls_cannot_take_the_slots_repeated_arrivals_join_with(
        shared_redis: RedisServer) -> None:
    """One principal holding long-polls of its own running question must not make another's
    repeat run again: polls hold at most a quarter of ``max_waiters``."""
    a, b = RedisJoinStore(shared_redis.url, max_waiters=4), RedisJoinStore(shared_redis.url)
    mallory, alice = scope(), ("alice", "GET /report", uuid.uuid4().hex)
    before = askonce.stats()
    try:
        assert b.arrive(mallory, D, POLICY)[0] is Verdict.RUN
        assert b.arrive(alice, D, POLICY)[0] is Verdict.RUN
        polls = [threading.Thread(target=a.look, args=(mallory, POLICY, 3.0)) for _ in range(4)]
        for t in polls:
            t.start()
        for t in polls[1:]:
            t.join(timeout=30)  # past the quarter: answered at once
        assert askonce.stats().get("server.join.redis.polls-full", 0) - \
            before.get("server.join.redis.polls-full", 0) == 3
        verdict = a.arrive(alice, D, POLICY)[0]
        assert verdict is Verdict.WAIT  # joins alice's run, not BYPASS (run again)
        a.unwait()
        polls[0].join(timeout=30)
    finally:
        a.close()
        b.close()


def test_redis_down_runs_unjoined_counted_and_is_left_alone_for_a_while(
        own_redis: RedisServer) -> None:
    store = RedisJoinStore(own_redis.url, retry_after=30.0)
    q = scope()
    own_redis.stop()
    before = askonce.stats()
    try:
        assert store.arrive(q, D, POLICY) == (Verdict.BYPASS, None, None)
        assert store.arrive(q, D, POLICY) == (Verdict.BYPASS, None, None)
        after = askonce.stats()
        assert after["server.join.redis.error.connection"] == \
            before.get("server.join.redis.error.connection", 0) + 1
        assert after["server.join.redis.down"] == before.get("server.join.redis.down", 0) + 1
    finally:
        store.close()


@pytest.mark.parametrize(("kw", "word"), [
    ({"url": "http://x"}, "url"), ({"lease": 0}, "lease"), ({"op_timeout": -1}, "op_timeout"),
    ({"max_waiters": -1}, "max_waiters"), ({"prefix": "a}b"}, "prefix")])
def test_bad_options_are_one_line_errors(kw: dict[str, object], word: str) -> None:
    args = {"url": "redis://127.0.0.1:1/0", **kw}
    with pytest.raises(ValueError, match=word):
        RedisJoinStore(**args)  # type: ignore[arg-type]
