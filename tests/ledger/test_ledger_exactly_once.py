"""The Redis ledger counts an arrival once even when Redis ran a script and its reply was lost: a
real ``redis-server`` behind a proxy on 127.0.0.1 that drops the reply of one ``EVALSHA``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

import askonce
from askonce.core.ledger import LedgerPolicy, window_index
from askonce.ledger._redis import LUA_CAP, LUA_FLUSH, Space, field
from askonce.ledger.store import RedisLedger
from redis_proxy import RedisProxy, redis_proxy
from redis_server import RedisServer
from stats_delta import delta

NOW = 1_000.0
CAP = LedgerPolicy(cap=2)


@pytest.fixture
def client(shared_redis: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(shared_redis.url)
    c.script_load(LUA_CAP)  # so that the first EVALSHA runs (no NOSCRIPT round first)
    c.script_load(LUA_FLUSH)
    yield c
    c.close()


@pytest.fixture
def proxy(shared_redis: RedisServer) -> Iterator[RedisProxy]:
    with redis_proxy(shared_redis.port) as p:
        yield p


def sha(script: str, client: redis.Redis) -> str:
    return str(client.register_script(script).sha)


def per_key(client: redis.Redis, prefix: str, policy: LedgerPolicy, key: str) -> int:
    space = Space(prefix, policy)
    k = space.op_keys(window_index(NOW, policy.window), "op")[2]
    raw = client.hget(k, field(b"a", "", key))
    return int(raw or 0)


def ledger(url: str, prefix: str, policy: LedgerPolicy) -> RedisLedger:
    # retry_after=0: the call after a lost reply asks Redis again at once.
    return RedisLedger(url, prefix=prefix, policy=policy, start=False, op_timeout=0.2,
                       read_timeout=0.3, retry_after=0.0)


def test_a_cap_reply_lost_after_the_script_ran_is_counted_once_and_caps_on_time(
        client: redis.Redis, proxy: RedisProxy) -> None:
    prefix = "x" + uuid.uuid4().hex[:10]
    shell = ledger(proxy.url, prefix, CAP)
    try:
        before = askonce.stats()
        proxy.lose_reply_of(sha(LUA_CAP, client))
        assert shell.record(NOW, "op", key="k", edge=True)  # Redis counted it; the reply is lost
        assert proxy.lost == 1 and delta(before).get("ledger.redis.cap-fallback") == 1
        assert per_key(client, prefix, CAP, "k") == 1
        assert shell.flush()
        assert per_key(client, prefix, CAP, "k") == 1  # the flush saw the cap's claim: not again
        # The cap counts from the true figure: the second arrival is within it, the third is not.
        assert shell.record(NOW, "op", key="k", edge=True)
        assert not shell.record(NOW, "op", key="k", edge=True)
        assert shell.flush()
        report = shell.report(NOW)
        assert report.totals().arrivals == 3
        assert sum(o.refused for o in report.operations) == 1
        assert per_key(client, prefix, CAP, "k") == 3
    finally:
        shell.close(timeout=1.0)


def test_a_cap_call_that_never_reached_redis_is_counted_by_the_flush(
        shared_redis: RedisServer, client: redis.Redis) -> None:
    prefix = "x" + uuid.uuid4().hex[:10]
    shell = ledger(shared_redis.url, prefix, CAP)
    try:
        shared_redis.pause()
        try:
            assert shell.record(NOW, "op", key="k", edge=True)  # timed out: may or may not have run
        finally:
            shared_redis.resume()
        # The frozen server reads the command when it thaws, and may run it before or after the
        # flush (another connection): whichever comes first counts the arrival, the other not.
        assert shell.flush()
        assert per_key(client, prefix, CAP, "k") == 1
    finally:
        shell.close(timeout=1.0)


def test_a_flush_reply_lost_is_sent_again_and_counted_once(client: redis.Redis,
                                                           proxy: RedisProxy) -> None:
    prefix = "x" + uuid.uuid4().hex[:10]
    policy = LedgerPolicy()
    shell = ledger(proxy.url, prefix, policy)
    try:
        for _ in range(5):
            shell.record(NOW, "op", key="k", edge=True)
        proxy.lose_reply_of(sha(LUA_FLUSH, client))
        assert not shell.flush()  # Redis applied it; the reply never came: held, sent again
        assert proxy.lost == 1 and shell.buffered == 5
        assert per_key(client, prefix, policy, "k") == 5
        assert shell.flush() and shell.buffered == 0
        assert per_key(client, prefix, policy, "k") == 5
        assert shell.report(NOW).totals().arrivals == 5
    finally:
        shell.close(timeout=1.0)


def test_a_cap_script_arriving_after_the_flush_counted_its_arrival_counts_nothing(
        client: redis.Redis) -> None:
    # The cap call's bytes may reach Redis after the client gave up on them (a frozen server reads
    # them when it thaws), later than the flush that counted the arrival.
    prefix = "x" + uuid.uuid4().hex[:10]
    space = Space(prefix, CAP)
    index = window_index(NOW, CAP.window)
    keys, args = space.cap_call(index, "op", True, "", "k", "replica-a", 7)
    seen = space.seen(index, "replica-a")
    client.setbit(seen, 7, 1)  # what the flush did for the uncertain arrival number 7
    assert client.register_script(LUA_CAP)(keys=keys, args=args) == -1
    assert per_key(client, prefix, CAP, "k") == 0
    # Another number is another arrival: counted, and its bit claimed against a later flush.
    keys, args = space.cap_call(index, "op", True, "", "k", "replica-a", 8)
    assert client.register_script(LUA_CAP)(keys=keys, args=args) == 1
    assert client.getbit(seen, 8) == 1 and 0 < client.pttl(seen) <= space.ttl_ms
