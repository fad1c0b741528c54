"""The Redis store against another writer: state hashes holding what the scripts never write.

Another process (a different askonce version, an operator's ``HSET``, a key collision) can leave values
in a bucket's or breaker's hash that the scripts never write: ``inf``, ``nan`` (Lua's ``tonumber`` reads
both), states out of range. The store must not turn that into an exception in the caller, unlimited
retries for the whole fleet, or a breaker that stays open (or wedged half-open) for ever.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

import askonce
from askonce.core.breaker import BreakerPolicy, State
from askonce.core.bucket import BucketPolicy
from askonce.stores.aredis import AsyncRedisStore
from askonce.stores.redis import RedisStore
from redis_server import RedisServer

POLICY = BreakerPolicy(window_size=10, minimum_calls=4, failure_rate=0.5, open_for=0.2, half_open_probes=1)


@pytest.fixture
def client(shared_redis: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(shared_redis.url)
    yield c
    c.close()


@pytest.fixture
def store(shared_redis: RedisServer) -> Iterator[RedisStore]:
    s = RedisStore(shared_redis.url, prefix="foreign-" + uuid.uuid4().hex[:8], retry_after=0.0, op_timeout=1.0)
    yield s
    s.close()


def _state_key(client: redis.Redis, store: RedisStore, kind: str) -> bytes:
    keys = [k for k in client.keys(f"{{{store.prefix}:*") if kind.encode() in k and not k.endswith((b":w", b":m"))]
    assert len(keys) == 1, keys
    return keys[0]


@pytest.mark.parametrize("field", ["e", "f"])
@pytest.mark.parametrize("value", ["inf", "1e999", "nan", "-inf", "1e300", "-5"])
def test_a_bucket_with_foreign_values_grants_what_a_sane_one_would(client: redis.Redis, store: RedisStore,
                                                                    field: str, value: str) -> None:
    # floor 0 and 5 earned tokens at most: a sane bucket grants at most 5 retries, then refuses
    policy = BucketPolicy(ratio=1.0, floor=0.0, max_tokens=5.0)
    bucket = store.bucket("b", policy)
    bucket.withdraw(0.0)  # the hash exists now
    client.hset(_state_key(client, store, "bucket"), field, value)
    for _ in range(50):
        bucket.deposit()
    granted = sum(bucket.withdraw(0.0) for _ in range(20))
    tokens = bucket.tokens(0.0)
    assert granted <= 5  # inf earned tokens: every retry of the fleet granted, for ever
    assert 0.0 <= tokens <= 5.0  # nan: the figure is garbage and nothing is ever earned again
    for _ in range(10):
        bucket.deposit()
    assert bucket.withdraw(0.0)  # -inf: a bucket that never grants a retry again


@pytest.mark.parametrize("fields", [
    {"st": "7"}, {"st": "-1"}, {"st": "1.5"}, {"st": "nan"},
    {"st": "1", "oa": "inf"}, {"st": "1", "oa": "nan"}, {"st": "1", "oa": ""}, {"st": "1", "oa": "1e300"},
    {"now": "inf"}, {"now": "nan"}, {"st": "2", "pa": "inf", "ho": "inf"}, {"st": "2", "pa": "nan"},
    {"c": "nan", "f": "inf"}, {"nx": "1e18"}, {"nx": "nan", "fl": "-3"},
])
def test_a_breaker_with_foreign_state_answers_and_recovers(client: redis.Redis, store: RedisStore,
                                                           fields: dict[str, str]) -> None:
    breaker = store.breaker("t", POLICY)
    assert breaker.allow(0.0)
    key = _state_key(client, store, "breaker")
    client.hset(key, mapping=fields)
    before = askonce.stats()
    # Never an exception in the caller; and within open_for plus a probe, the breaker admits calls again.
    breaker.allow(0.0)
    recovered = False
    for i in range(60):
        now = 0.05 * i
        ok = breaker.allow(now)
        if ok:
            breaker.record(now, success=True)
            if breaker.state(now) is State.CLOSED and breaker.allow(now):
                recovered = True
                break
        time.sleep(0.05)
    assert recovered, client.hgetall(key)
    assert askonce.stats().get("store.redis.fallback", 0) == before.get("store.redis.fallback", 0)


async def test_the_async_breaker_with_an_out_of_range_state_does_not_raise(shared_redis: RedisServer,
                                                                           client: redis.Redis) -> None:
    store = AsyncRedisStore(shared_redis.url, prefix="foreign-" + uuid.uuid4().hex[:8], retry_after=0.0, op_timeout=1.0)
    try:
        breaker = store.breaker("t", POLICY)
        assert await breaker.allow(0.0)
        key = _state_key(client, store, "breaker")  # type: ignore[arg-type]
        client.hset(key, "st", "9")
        await breaker.allow(0.0)  # IndexError from the reply's parsing, in the caller
        assert (await breaker.state(0.0)) is State.CLOSED  # an unknown state is read as closed, afresh
    finally:
        await store.aclose()
