"""The Redis store against a real ``redis-server``: the scripts match the core, state is fleet-wide, and
the store's failure never becomes the service's failure."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

import askonce
from askonce.core.breaker import Breaker, BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy, TokenBucket
from askonce.stores._redis_lua import LUA_BREAKER, LUA_BUCKET, BreakerReply, breaker_args, bucket_args
from askonce.stores.aredis import AsyncRedisStore
from askonce.stores.base import AsyncStore, Store
from askonce.stores.memory import MemoryStore
from askonce.stores.redis import RedisStore
from redis_server import RedisServer

CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN
SMALL = BreakerPolicy(window_size=10, minimum_calls=4, failure_rate=0.5, open_for=5.0, half_open_probes=2)


def fresh() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def delta(before: dict[str, int], name: str) -> int:
    return askonce.stats().get(name, 0) - before.get(name, 0)


@pytest.fixture(scope="module")
def client(shared_redis: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(shared_redis.url)
    yield c
    c.close()


# --- the scripts are the core, on the server --------------------------------------------------------

OPS = st.sampled_from(["allow", "allow", "ok", "fail", "slow-ok", "slow-fail", "release", "state", "force_open",
                       "force_closed"])
STEPS = st.lists(st.tuples(OPS, st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 2.5, 5.0, 12.0])), max_size=60)
POLICIES = [
    SMALL,
    BreakerPolicy(window_size=5, minimum_calls=3, failure_rate=0.6, slow_call_duration=1.0, slow_call_rate=0.5,
                  open_for=2.0, half_open_probes=1),
    BreakerPolicy(window="time", window_size=3, minimum_calls=3, failure_rate=0.5, slow_call_duration=1.0,
                  open_for=2.0, half_open_probes=2),
]


def play(client: redis.Redis, policy: BreakerPolicy, steps: list[tuple[str, float]]) -> None:
    """Play the same steps on the script (with the test-only ``now`` argument) and on the core."""
    script = client.register_script(LUA_BREAKER)
    stem = fresh()
    keys = [stem, stem + ":w"]
    core = Breaker(policy)
    now = 1000.0  # times on a quarter-second grid are exact in binary and in the script's %.6f
    for op, dt in steps:
        now += dt
        success = op in ("ok", "slow-ok")
        duration = 1.5 if op.startswith("slow") else 0.0
        name = "record" if op in ("ok", "fail", "slow-ok", "slow-fail") else op
        reply = BreakerReply(script(keys=keys, args=[name, *breaker_args(policy, 60.0), "1" if success else "0",
                                                     repr(duration), repr(now)]), now)
        if reply.leased:
            return  # the script re-leases probes a dead process kept; the core has no such thing
        allowed = False
        if name == "allow":
            allowed = core.allow(now)
        elif name == "record":
            core.record(now, success=success, duration=duration)
        elif name == "state":
            core.state_at(now)
        else:
            getattr(core, name)(now)
        assert (reply.state, reply.allowed) == (core.state, allowed), (op, now)
        assert reply.retry_at == core.retry_at()
        assert reply.transitions == core.drain_transitions()


@pytest.mark.parametrize("policy", POLICIES, ids=["count", "count-slow", "time-slow"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_breaker_script_plays_like_the_core(client: redis.Redis, policy: BreakerPolicy,
                                            steps: list[tuple[str, float]]) -> None:
    play(client, policy, steps)


TIME3 = BreakerPolicy(window="time", window_size=3, minimum_calls=3, failure_rate=0.5, slow_call_duration=1.0,
                      slow_call_rate=0.5, open_for=2.0)
COUNT5 = POLICIES[1]  # five calls, judged from three, opens at 60 % failed or 50 % slow


@pytest.mark.parametrize(("policy", "steps"), [
    # Outcomes age out of a time window second by second, and only what is left decides (a slow call
    # and a failure that stayed would each tip these over the threshold).
    (TIME3, [("slow-ok", 0.0), ("ok", 1.0), ("ok", 0.0), ("ok", 2.0), ("slow-ok", 0.0), ("state", 0.0)]),
    (TIME3, [("fail", 0.0), ("ok", 1.0), ("ok", 0.0), ("ok", 2.0), ("fail", 0.0), ("state", 0.0)]),
    (TIME3, [("fail", 0.0), ("ok", 0.0), ("ok", 5.0), ("fail", 0.0), ("fail", 0.0), ("fail", 0.0)]),
    # A full count window evicts its oldest call, failure or not.
    (COUNT5, [("fail", 0.0), ("ok", 0.0), ("ok", 0.0), ("fail", 0.0), ("ok", 0.0), ("ok", 0.0), ("fail", 0.0),
              ("state", 0.0), ("fail", 0.0)]),
    # Half-open: probes, a straggler, release, a failed probe.
    (SMALL, [("force_open", 0.0), ("allow", 5.0), ("ok", 0.0), ("ok", 0.0), ("release", 0.0), ("allow", 0.0),
             ("allow", 0.0), ("allow", 0.0), ("fail", 0.0), ("state", 0.0)]),
    (COUNT5, [("force_open", 0.0), ("allow", 2.0), ("slow-ok", 0.0), ("force_closed", 0.0), ("fail", 0.0)]),
], ids=["time-slow-ages", "time-fail-ages", "time-gap", "count-evicts", "half-open", "probe-slow"])
def test_breaker_script_scenarios(client: redis.Redis, policy: BreakerPolicy, steps: list[tuple[str, float]]) -> None:
    play(client, policy, steps)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.sampled_from([0.0, 0.25, 1.0, 3.0])),
                      max_size=40),
       policy=st.builds(BucketPolicy, ratio=st.sampled_from([0.0, 0.1, 0.5, 2.0]),
                        floor=st.sampled_from([0.0, 0.5, 2.0]), max_tokens=st.sampled_from([0.0, 3.0, 100.0])))
def test_bucket_script_plays_like_the_core(client: redis.Redis, policy: BucketPolicy,
                                           steps: list[tuple[int, bool, float]]) -> None:
    script = client.register_script(LUA_BUCKET)
    key = fresh()
    now = 1000.0
    core = TokenBucket(policy, now)
    for deposits, take, dt in steps:
        now += dt
        core.deposit(deposits)
        granted, tokens, earned, floor, members = script(
            keys=[key], args=[*bucket_args(policy, deposits, take, 60_000), repr(now)])
        expected = core.withdraw(now) if take else False
        assert granted == expected
        assert float(tokens) == pytest.approx(core.tokens(now), abs=1e-9)
        # the level a fallback is seeded with (core.fallback), as the core holds it
        assert float(earned) == pytest.approx(core.earned, abs=1e-9)
        assert float(floor) == pytest.approx(core.floor_tokens, abs=1e-9)
        assert members == 0  # no member id passed: not counted


# --- keys ------------------------------------------------------------------------------------------


def test_keys_share_a_cluster_slot_and_all_expire(shared_redis: RedisServer, client: redis.Redis) -> None:
    store = RedisStore(shared_redis.url, prefix="keys-test", ttl=120)
    for target in ("payments", "a{b}c", "x" * 500, "naïve\n"):
        store.bucket(target, BucketPolicy()).withdraw(0.0)
        store.breaker(target, BreakerPolicy(window="time", window_size=5, minimum_calls=1)).record(0.0, success=True)
        store.breaker(target, SMALL).record(0.0, success=True)
    keys = client.keys("{keys-test:*")
    assert len(keys) == 4 * 8  # a bucket and two breakers (its window), each with its members set
    by_target: dict[bytes, set[int]] = {}
    for key in keys:
        by_target.setdefault(key.split(b"}")[0], set()).add(key_slot(key))
        assert 0 < client.pttl(key) <= 120_000
        assert len(key) < 200  # long or odd names are hashed into the tag
    assert len(by_target) == 4 and all(len(slots) == 1 for slots in by_target.values())
    store.close()


def test_the_stores_satisfy_the_protocols(shared_redis: RedisServer) -> None:
    store: Store = RedisStore(shared_redis.url)
    astore: AsyncStore = AsyncRedisStore(shared_redis.url)
    assert store.breaker(fresh(), SMALL).allow(0.0) and astore.bucket(fresh(), BucketPolicy()) is not None


@pytest.mark.parametrize("options", [dict(prefix="a{b"), dict(prefix=""), dict(op_timeout=0), dict(ttl=0.5),
                                     dict(deposit_batch=0), dict(retry_after=-1), dict(max_targets=0),
                                     dict(op_timeout=True), dict(op_timeout="0.05"), dict(ttl=float("nan")),
                                     dict(retry_after=None), dict(prefix=5)])
def test_bad_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RedisStore("redis://127.0.0.1:1/0", **options)


# --- fleet-wide state -----------------------------------------------------------------------------

def _spend(url: str | None, target: str, policy: BucketPolicy, start_at: float, seconds: float,
           rate: float) -> tuple[int, int, float, float, dict[str, int]]:
    """One process of a fleet in a full outage: every request fails and asks for a retry token."""
    store = RedisStore(url) if url else MemoryStore(time.monotonic)
    bucket = store.bucket(target, policy)
    while time.time() < start_at:
        time.sleep(0.001)
    requests = granted = 0
    first = time.time()
    tick = time.monotonic()
    while time.time() < start_at + seconds:
        bucket.deposit()
        requests += 1
        granted += bucket.withdraw(time.monotonic())
        tick += 1.0 / rate
        time.sleep(max(0.0, tick - time.monotonic()))
    return requests, granted, first, time.time(), askonce.stats()


def _breaker_op(url: str, target: str, op: str) -> tuple[State, bool, bool]:
    store = RedisStore(url)
    handle = store.breaker(target, SMALL)
    now = time.monotonic()
    if op == "open":
        for _ in range(SMALL.minimum_calls):
            handle.record(now, success=False)
    allowed = handle.allow(now)
    return handle.state(now), allowed, handle.retry_at() is not None


def _warm(_: int) -> int:
    import askonce.stores.redis  # noqa: F401  (pays the imports before the clock starts)

    time.sleep(0.3)
    return multiprocessing.current_process().pid or 0


@pytest.fixture(scope="module")
def fleet() -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert len(set(pool.map(_warm, range(4)))) == 4  # four live processes, each imported
        yield pool


def _run_fleet(pool: ProcessPoolExecutor, url: str | None, policy: BucketPolicy) -> tuple[int, int, float]:
    target, seconds = fresh(), 1.5
    start_at = time.time() + 0.2
    results = list(pool.map(_spend, [url] * 4, [target] * 4, [policy] * 4, [start_at] * 4, [seconds] * 4,
                            [250.0] * 4))
    assert all(r[4].get("store.redis.fallback", 0) == 0 for r in results)
    span = max(r[3] for r in results) - min(r[2] for r in results)
    return sum(r[0] for r in results), sum(r[1] for r in results), span


def test_four_processes_share_one_retry_budget(shared_redis: RedisServer, fleet: ProcessPoolExecutor) -> None:
    policy = BucketPolicy(ratio=0.1, floor=40.0, max_tokens=100.0)
    floor_cap = max(1.0, policy.floor)

    requests, granted, span = _run_fleet(fleet, shared_redis.url, policy)
    shared = policy.ratio * requests + floor_cap + policy.floor * span
    assert abs(granted - shared) <= 0.1 * shared, (requests, granted, span, shared)

    requests_m, granted_m, span_m = _run_fleet(fleet, None, policy)
    alone = policy.ratio * requests_m + 4 * (floor_cap + policy.floor * span_m)
    assert abs(granted_m - alone) <= 0.1 * alone, (requests_m, granted_m, span_m, alone)
    # What the floor gave: once for the fleet when shared, four times over with a bucket each.
    floor_shared = granted - policy.ratio * requests
    floor_alone = granted_m - policy.ratio * requests_m
    assert 3.2 <= floor_alone / floor_shared <= 4.8


def test_a_breaker_opened_by_one_process_is_open_for_the_others(shared_redis: RedisServer,
                                                                fleet: ProcessPoolExecutor) -> None:
    target = fresh()
    assert fleet.submit(_breaker_op, shared_redis.url, target, "open").result() == (OPEN, False, True)
    seen = list(fleet.map(_breaker_op, [shared_redis.url] * 3, [target] * 3, ["look"] * 3))
    assert seen == [(OPEN, False, True)] * 3
    mine = RedisStore(shared_redis.url).breaker(target, SMALL)
    moves: list[Transition] = []
    mine.add_listener(lambda t, tr: moves.append(tr))
    assert mine.state(time.monotonic()) is OPEN
    assert [(t.old, t.new, t.reason) for t in moves] == [(CLOSED, OPEN, "observed")]


def test_half_open_probes_are_counted_fleet_wide(shared_redis: RedisServer) -> None:
    policy = BreakerPolicy(window_size=10, minimum_calls=4, open_for=0.2, half_open_probes=2)
    target = fresh()
    a = RedisStore(shared_redis.url).breaker(target, policy)
    b = RedisStore(shared_redis.url).breaker(target, policy)
    a.force_open(time.monotonic())
    assert not b.allow(time.monotonic())
    retry_at = b.retry_at()
    assert retry_at is not None and 0 < retry_at - time.monotonic() <= 0.2
    time.sleep(0.25)
    admitted = [a.allow(time.monotonic()), b.allow(time.monotonic()), a.allow(time.monotonic()),
                b.allow(time.monotonic())]
    assert admitted == [True, True, False, False]
    a.record(time.monotonic(), success=True)
    b.record(time.monotonic(), success=True)
    assert a.state(time.monotonic()) is CLOSED


def test_a_registry_over_redis_keeps_an_open_breaker_through_a_flood_of_names(
        shared_redis: RedisServer) -> None:
    from askonce.breakers import BreakerRegistry

    reg = BreakerRegistry(RedisStore(shared_redis.url), policy=SMALL, max_targets=4)
    target = fresh()
    opened = reg.get(target)
    opened.handle.force_open(time.monotonic())
    before = askonce.stats()
    for _ in range(20):
        reg.get(fresh())
    assert reg.get(target) is opened and reg.states()[target] is OPEN
    assert delta(before, "breakers.registry.evicted") == 17


def test_a_probe_held_by_a_dead_process_is_leased_again(shared_redis: RedisServer) -> None:
    policy = BreakerPolicy(window_size=10, minimum_calls=4, open_for=0.1, half_open_probes=1)
    handle = RedisStore(shared_redis.url).breaker(fresh(), policy)
    handle.force_open(time.monotonic())
    time.sleep(0.15)
    assert handle.allow(time.monotonic())  # this probe's process "dies": no record, no release
    assert not handle.allow(time.monotonic())
    before = askonce.stats()
    time.sleep(0.15)
    assert handle.allow(time.monotonic())
    assert delta(before, "breaker.probe-lease-expired") == 1


def test_deposits_are_batched_and_never_counted_twice(shared_redis: RedisServer) -> None:
    policy = BucketPolicy(ratio=1.0, floor=0.0, max_tokens=1e6)
    target = fresh()
    sender = RedisStore(shared_redis.url, deposit_batch=10).bucket(target, policy)
    reader = RedisStore(shared_redis.url).bucket(target, policy)
    for _ in range(25):
        sender.deposit()
    assert reader.tokens(0.0) == 20.0  # two batches sent, five still counted locally
    assert sender.withdraw(0.0)  # sends the five with the withdrawal
    assert reader.tokens(0.0) == 24.0


# --- failure of the store is not failure of the service -------------------------------------------


def test_redis_killed_and_restarted_mid_test_breaks_no_call(own_redis: RedisServer) -> None:
    store = RedisStore(own_redis.url, retry_after=0.1)
    target = fresh()
    bucket = store.bucket(target, BucketPolicy())
    breaker = store.breaker(target, SMALL)
    errors: list[BaseException] = []
    calls = 0
    slowest = 0.0
    stop = threading.Event()

    def traffic() -> None:
        nonlocal calls, slowest
        while not stop.is_set():
            began = time.monotonic()
            try:
                bucket.deposit()
                bucket.withdraw(began)
                if breaker.allow(began):
                    breaker.record(time.monotonic(), success=True)
            except BaseException as exc:
                errors.append(exc)
            slowest = max(slowest, time.monotonic() - began)
            calls += 1
            time.sleep(0.002)

    before = askonce.stats()
    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        time.sleep(0.2)
        own_redis.stop()
        time.sleep(0.4)
        own_redis.start()
        deadline = time.monotonic() + 5
        while delta(before, "store.redis.resumed") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
    finally:
        stop.set()
        worker.join(timeout=10)
    assert not errors and calls > 50
    assert slowest < 1.0  # a bounded fallback, not redis-py's default retries
    assert delta(before, "store.redis.fallback") > 0 and delta(before, "store.redis.error.connection") > 0
    assert delta(before, "store.redis.down") >= 1 and delta(before, "store.redis.resumed") >= 1
    # Shared state is back: another process's view of the restarted server is this store's view.
    RedisStore(own_redis.url).breaker(target, SMALL).force_open(time.monotonic())
    assert breaker.state(time.monotonic()) is OPEN and not breaker.allow(time.monotonic())


def test_a_frozen_redis_costs_one_timeout_then_local_state(own_redis: RedisServer) -> None:
    store = RedisStore(own_redis.url, op_timeout=0.05, retry_after=0.3)
    target = fresh()
    breaker = store.breaker(target, SMALL)
    assert breaker.allow(time.monotonic())
    before = askonce.stats()
    own_redis.pause()
    try:
        began = time.monotonic()
        for _ in range(SMALL.minimum_calls):  # the first call times out; the rest go local at once
            breaker.record(time.monotonic(), success=False)
        took = time.monotonic() - began
        assert breaker.state(time.monotonic()) is OPEN  # the local breaker judged the failures
    finally:
        own_redis.resume()
    assert took < 1.0
    assert delta(before, "store.redis.error.timeout") == 1
    assert delta(before, "store.redis.fallback.record") == SMALL.minimum_calls
    time.sleep(0.35)
    assert breaker.state(time.monotonic()) is CLOSED  # Redis answers again: the shared breaker never opened
    assert delta(before, "store.redis.resumed") == 1


def test_a_client_passed_in_is_used(shared_redis: RedisServer) -> None:
    client = redis.Redis.from_url(shared_redis.url, socket_timeout=0.05)
    store = RedisStore(client)
    target = fresh()
    store.breaker(target, SMALL).force_open(time.monotonic())
    assert len(client.keys(f"{{askonce:{target}}}:breaker:??????????")) == 1  # the state hash
    assert store.client is client


# --- asyncio ----------------------------------------------------------------------------------------


async def test_async_and_sync_stores_share_one_state(shared_redis: RedisServer) -> None:
    target = fresh()
    astore = AsyncRedisStore(shared_redis.url)
    sync = RedisStore(shared_redis.url).breaker(target, SMALL)
    handle = astore.breaker(target, SMALL)
    for _ in range(SMALL.minimum_calls):
        assert await handle.allow(time.monotonic())
        await handle.record(time.monotonic(), success=False)
    assert sync.state(time.monotonic()) is OPEN
    assert not await handle.allow(time.monotonic()) and handle.retry_at() is not None
    await astore.aclose()


async def test_async_tasks_lose_no_counts(shared_redis: RedisServer) -> None:
    import asyncio

    policy = BucketPolicy(ratio=0.5, floor=0.0, max_tokens=1e6)
    astore = AsyncRedisStore(shared_redis.url, deposit_batch=7, op_timeout=5.0)  # counts, not time
    bucket = astore.bucket(fresh(), policy)

    async def question() -> bool:
        bucket.deposit()
        await asyncio.sleep(0)
        return await bucket.withdraw(time.monotonic())

    before = askonce.stats()
    granted = sum(await asyncio.gather(*(question() for _ in range(400))))
    # 400 calls in flight at once wait for a connection (redis-py's pool holds 100 by default
    # and refused one more): none fell back to local state.
    assert delta(before, "store.redis.fallback") == 0
    # A withdraw that reached Redis before other tasks' deposits is refused then: the tokens are
    # still there after, none lost, none made up.
    for _ in range(400):
        if not await bucket.withdraw(time.monotonic()):
            break
        granted += 1
    assert granted == 200 and await bucket.tokens(0.0) == 0.0
    await astore.aclose()


async def test_async_store_falls_back_and_resumes(own_redis: RedisServer) -> None:
    import asyncio

    # 1 s per call: on a loaded machine a healthy call never times out, so the one that meets the
    # paused server is the first timeout (and is tried: the store is not already resting)
    astore = AsyncRedisStore(own_redis.url, retry_after=0.1, op_timeout=1.0)
    target = fresh()
    breaker = astore.breaker(target, SMALL)
    bucket = astore.bucket(target, BucketPolicy(ratio=0.0, floor=1.0))
    assert await breaker.allow(time.monotonic())
    before = askonce.stats()
    own_redis.pause()  # asyncio.timeout bounds the call even where the client would wait
    try:
        assert await bucket.withdraw(time.monotonic())  # the local bucket's floor token
        assert await breaker.allow(time.monotonic())
    finally:
        own_redis.resume()
    own_redis.stop()
    await asyncio.sleep(0.15)
    assert await breaker.allow(time.monotonic())  # refused connection: local again
    own_redis.start()
    await asyncio.sleep(0.15)
    await breaker.force_open(time.monotonic())
    assert RedisStore(own_redis.url).breaker(target, SMALL).allow(time.monotonic()) is False
    assert delta(before, "store.redis.error.timeout") >= 1 and delta(before, "store.redis.error.connection") >= 1
    assert delta(before, "store.redis.resumed") >= 1
    await astore.aclose()
