"""Adaptive admission shared by a fleet through a real ``redis-server``: the script is the core on
the server, two stores (two "processes") see each other's failures, and an unreachable Redis hands
the decision to the local controller, counted."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import askonce
from askonce.core.admission import Admission, AdmissionPolicy
from askonce.stores._redis_lua import LUA_ADMISSION, AdmissionReply, admission_args
from askonce.stores.aredis import AsyncRedisStore
from askonce.stores.base import AdmissionHandle, AsyncStore, Store
from askonce.stores.redis import RedisStore
from redis_server import RedisServer
from stats_delta import delta

POLICY = AdmissionPolicy(window=10, min_requests=20)
EVERY_CALL = 0.001  # admission_refresh: a sync on (nearly) every admit, so tests need no sleeping
DRAWS = [i / 200 for i in range(200)]  # uniform: p decides how many of these are refused


def fresh() -> str:
    return "adm-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def client(shared_redis: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(shared_redis.url)
    yield c
    c.close()


# --- the script is the core, on the server ----------------------------------------------------------

STEPS = st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 2.0, 4.5, 12.0]),
                           st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS, policy=st.builds(AdmissionPolicy, window=st.sampled_from([1, 3, 10]),
                                     min_success=st.sampled_from([0.05, 0.5, 1.0]),
                                     max_reject=st.sampled_from([0.0, 0.5, 0.99]),
                                     min_requests=st.sampled_from([1, 5, 20]),
                                     count_rejected=st.booleans()))
def test_the_script_counts_and_judges_like_the_core(client: redis.Redis, policy: AdmissionPolicy,
                                                    steps: list[tuple[float, int, int, int]]) -> None:
    script = client.register_script(LUA_ADMISSION)
    key = fresh()
    core = Admission(policy)
    now = 1000.0  # quarter seconds: exact in binary and in the script's %.6f
    for dt, requests, calls, successes in steps:
        now += dt
        successes = min(successes, calls)
        for _ in range(requests):
            core.admit(now, 0.999)
        for i in range(calls):
            core.record(now, success=i < successes)
        reply = AdmissionReply(script(keys=[key], args=[*admission_args(policy, 60), str(requests),
                                                        str(calls), str(successes), repr(now)]))
        p = core.reject_probability(now)  # rolls the core's window to now as well
        assert (reply.requests, reply.calls, reply.successes) == (core.requests, core.calls,
                                                                  core.successes)
        assert reply.p == p


def test_foreign_state_in_the_key_neither_breaks_the_script_nor_the_window(client: redis.Redis) -> None:
    script = client.register_script(LUA_ADMISSION)
    key = fresh()
    client.hset(key, mapping={"hd": "nan", "now": "inf", "R": "-5", "C": "x", "S": "1e999", "r3": "z"})
    reply = AdmissionReply(script(keys=[key], args=[*admission_args(POLICY, 60), "3", "2", "1", "1003.5"]))
    assert (reply.requests, reply.calls, reply.successes, reply.p) == (3, 2, 1, 0.0)


# --- a fleet: two stores, one window ----------------------------------------------------------------


def fail_through(handle: AdmissionHandle, n: int) -> None:
    """``n`` attempts asked about, every one made and failed."""
    for _ in range(n):
        now = time.monotonic()
        if handle.admit(now, 0.999):
            handle.record(now, success=False)


def sync(handle: AdmissionHandle) -> None:
    """One more attempt once the view is due: it syncs, sending what this handle has pending."""
    time.sleep(2 * EVERY_CALL)
    handle.admit(time.monotonic(), 0.999)


def refused(handle: AdmissionHandle) -> int:
    return sum(not handle.admit(time.monotonic(), u) for u in DRAWS)


def test_two_stores_see_each_others_failures_and_one_sheds_for_the_others_outage(
        shared_redis: RedisServer) -> None:
    target = fresh()
    seer = RedisStore(shared_redis.url, admission_refresh=EVERY_CALL)
    other = RedisStore(shared_redis.url, admission_refresh=EVERY_CALL)
    alone = RedisStore(shared_redis.url, prefix="elsewhere", admission_refresh=EVERY_CALL)
    try:
        typed: Store = seer
        fail_through(typed.admission(target, POLICY), 100)
        sync(typed.admission(target, POLICY))
        # The other store made no call of its own, yet sheds as the fleet's window says: p = 0.99
        # refuses every draw below it, 198 of the 200.
        handle = other.admission(target, POLICY)
        assert refused(handle) == 198
        shared = handle.snapshot()["shared"]
        assert isinstance(shared, dict) and shared["calls"] == 100 and shared["successes"] == 0
        # Its own refused requests joined the fleet's window: the first store sees them.
        sync(handle)
        sync(seer.admission(target, POLICY))
        seen = seer.admission(target, POLICY).snapshot()["shared"]
        assert isinstance(seen, dict)
        assert (seen["requests"], seen["calls"]) == (100 + 1 + 200 + 1 + 1, 100)
        # A store under another prefix is another fleet: nothing to shed on.
        assert refused(alone.admission(target, POLICY)) == 0
    finally:
        for s in (seer, other, alone):
            s.close()


def test_successes_anywhere_in_the_fleet_lift_the_shedding(shared_redis: RedisServer) -> None:
    target = fresh()
    failing = RedisStore(shared_redis.url, admission_refresh=EVERY_CALL)
    healthy = RedisStore(shared_redis.url, admission_refresh=EVERY_CALL)
    try:
        fail_through(failing.admission(target, POLICY), 50)
        sync(failing.admission(target, POLICY))
        handle = healthy.admission(target, POLICY)
        for _ in range(50):  # 50 successes in 100 calls: a success rate far above min_success
            now = time.monotonic()
            handle.admit(now, 0.999)
            handle.record(now, success=True)
        sync(handle)
        assert refused(failing.admission(target, POLICY)) == 0
    finally:
        failing.close()
        healthy.close()


async def _async_fleet(url: str) -> tuple[int, int, dict[str, int]]:
    target = fresh()
    sync_seer = RedisStore(url, admission_refresh=EVERY_CALL)
    # 50 ms: a view stays usable for 0.5 s, longer than the 200 admits below take even when loaded.
    astore = AsyncRedisStore(url, admission_refresh=0.05)
    try:
        fail_through(sync_seer.admission(target, POLICY), 100)
        sync(sync_seer.admission(target, POLICY))
        typed: AsyncStore = astore
        handle = typed.admission(target, POLICY)
        before = askonce.stats()
        first = handle.admit(time.monotonic(), 0.5)  # no view yet: the local controller (empty)
        deadline = time.monotonic() + 5
        while astore.admission(target, POLICY).snapshot()["shared"] is None:
            assert time.monotonic() < deadline, "the background sync never came back"
            await asyncio.sleep(0.001)
        n = refused(handle)
        return int(first), n, delta(before)
    finally:
        sync_seer.close()
        await astore.aclose()


def test_the_async_store_decides_locally_until_its_first_sync_then_with_the_fleet(
        shared_redis: RedisServer) -> None:
    first, n, moved = asyncio.run(_async_fleet(shared_redis.url))
    assert first == 1 and moved.get("store.redis.admission.stale") == 1
    # Every later admit decided on a view some background sync had fetched, fleet-wide p = 0.99.
    assert n == 198
    assert not any(name.startswith("store.redis.fallback") for name in moved)


# --- Redis away ---------------------------------------------------------------------------------------


def test_an_unreachable_redis_leaves_the_decision_to_the_local_controller_counted(
        own_redis: RedisServer) -> None:
    target = fresh()
    store = RedisStore(own_redis.url, admission_refresh=EVERY_CALL, retry_after=60)
    handle = store.admission(target, POLICY)
    try:
        fail_through(handle, 10)  # shared, and counted locally as well
        sync(handle)
        own_redis.stop()
        time.sleep(2 * EVERY_CALL)  # the next admit syncs
        before = askonce.stats()
        fail_through(handle, 90)  # the first sync fails; the rest never ask Redis
        moved = delta(before)
        assert moved.get("store.redis.error.connection") == 1
        assert moved.get("store.redis.admission.unsent") == 1  # the request of the failed sync
        # Every one of the 90 attempts and 90 verdicts was answered locally, and counted so.
        assert moved.get("store.redis.fallback.admit") == 90
        assert moved.get("store.redis.fallback.admission-record") == 90
        # The local controller saw all 100 failures: it sheds as a memory store would.
        assert refused(handle) == 198
    finally:
        store.close()


def test_a_frozen_redis_costs_a_sync_one_timeout_then_the_local_controller(
        own_redis: RedisServer) -> None:
    target = fresh()
    store = RedisStore(own_redis.url, admission_refresh=EVERY_CALL, retry_after=60, op_timeout=0.05)
    handle = store.admission(target, POLICY)
    try:
        assert handle.admit(time.monotonic(), 0.5)
        own_redis.pause()
        time.sleep(2 * EVERY_CALL)  # the next admit syncs
        before = askonce.stats()
        fail_through(handle, 30)
        moved = delta(before)
        assert moved.get("store.redis.error.timeout") == 1 and moved.get("store.redis.down") == 1
        assert moved.get("store.redis.fallback.admit") == 30
    finally:
        own_redis.resume()
        store.close()


def test_bad_admission_refresh_is_refused() -> None:
    for value in (0, -1, 61, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="admission_refresh"):
            RedisStore("redis://127.0.0.1:1", admission_refresh=value)  # type: ignore[arg-type]


def test_the_redis_stores_keep_one_handle_per_target_and_policy_bounded() -> None:
    store = RedisStore("redis://127.0.0.1:1", max_targets=2)  # no Redis call is made
    astore = AsyncRedisStore("redis://127.0.0.1:1", max_targets=2)
    try:
        typed: Store = store
        atyped: AsyncStore = astore
        for t in (typed, atyped):
            handle = t.admission("svc", POLICY)
            assert t.admission("svc", POLICY) is handle
            assert t.admission("svc", AdmissionPolicy(window=5)) is not handle
            t.admission("c", POLICY)  # a third: the oldest handle goes
            assert t.admission("svc", POLICY) is not handle
    finally:
        store.close()
        asyncio.run(astore.aclose())
