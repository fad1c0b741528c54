"""The Redis stores' local fallback against a real, SIGSTOPped ``redis-server``: it starts from the
shared state last seen (an open breaker stays open, a drained bucket stays drained, the fleet's
admission window decides) and takes a 1/N share of the fleet's probes, so a dead target gets about
what the shared state let through; when Redis answers again the shared state wins."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

import askonce
from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy
from askonce.stores._redis_lua import policy_digest, target_tag
from askonce.stores.aredis import AsyncRedisStore
from askonce.stores.redis import RedisStore
from redis_server import RedisServer, wait_until
from stats_delta import delta

CLOSED, OPEN = State.CLOSED, State.OPEN
# Where a test needs every call before the freeze answered by Redis, a loaded machine must not
# time it out: the freeze then costs this much per store, once.
SURE = 1.0


def fresh() -> str:
    return "fb-" + uuid.uuid4().hex[:12]


@pytest.fixture
def frozen(own_redis: RedisServer) -> Iterator[RedisServer]:
    """The test's own server; whatever happens, it is resumed before it is stopped."""
    try:
        yield own_redis
    finally:
        if own_redis.proc is not None:
            own_redis.resume()


class Fleet:
    """``k`` stores on one Redis, each a process of its own in all but name (its own member id,
    its own local fallback), each with a thread calling one target through ``@askonce.retry``
    every ``every`` seconds. The target counts its arrivals per phase, the main thread's label."""

    def __init__(self, url: str, k: int, target: str, policy: BreakerPolicy,
                 every: float = 0.005) -> None:
        self.stores = [RedisStore(url, retry_after=0.3) for _ in range(k)]
        self.phase = "warm-up"
        self.healthy = False
        self.arrivals: collections.Counter[str] = collections.Counter()
        self.unexpected: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._traffic, args=(s, target, policy, every))
                         for s in self.stores]

    def _traffic(self, store: RedisStore, target: str, policy: BreakerPolicy,
                 every: float) -> None:
        @askonce.retry(ConnectionError, store=store, target=target, breaker=policy,
                       admission=None, sleep=lambda _s: None)
        def call() -> None:
            with self._lock:
                self.arrivals[self.phase] += 1
            if not self.healthy:
                raise ConnectionError("the dead target")

        while not self._stop.is_set():
            try:
                call()
            except (ConnectionError, askonce.GaveUp):
                pass
            except BaseException as exc:  # anything else reaching the caller is a failed call
                self.unexpected.append(exc)
            time.sleep(every)

    def __enter__(self) -> Fleet:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        for s in self.stores:
            s.close()


def test_a_frozen_redis_keeps_a_dead_target_within_2x_of_the_shared_rate(
        frozen: RedisServer) -> None:
    """Five stores, a dead target, the shared breaker open. The most the shared breaker lets
    through in ``seconds`` is one probe per ``open_for``, plus the one due at the start; the
    fallback must stay within twice that. Before the fallback was seeded, each local breaker
    started closed and let ``minimum_calls`` (10) through: 50 arrivals at least."""
    k, seconds = 5, 4.0
    policy = BreakerPolicy(window_size=10, minimum_calls=10, failure_rate=0.5, open_for=1.0,
                           half_open_probes=1)
    target = fresh()
    members = f"{target_tag('askonce', target)}:breaker:{policy_digest(policy)}:m"
    client = redis.Redis.from_url(frozen.url)
    shared_most = policy.half_open_probes * (seconds / policy.open_for + 1)
    start = askonce.stats()
    with Fleet(frozen.url, k, target, policy) as fleet:
        wait_until("the shared breaker to open",
                   lambda: client.hget(f"{target_tag('askonce', target)}:breaker:"
                                       f"{policy_digest(policy)}", "st") == b"1")
        time.sleep(2.5)  # every store has heard the member count after its heartbeats
        assert client.zcard(members) == k
        fleet.phase = "shared"
        time.sleep(seconds)
        before = askonce.stats()
        fleet.phase = "frozen"
        frozen.pause()
        time.sleep(seconds)
        fleet.phase = "after"
        frozen.resume()
        wait_until("every store to answer from Redis again",
                   lambda: delta(before).get("store.redis.resumed", 0) >= k)
        moved = delta(before)
    assert not fleet.unexpected
    assert moved.get("store.redis.fallback.allow", 0) > 0
    # Each store's breaker was seeded (at the freeze, or at an earlier timeout of a loaded machine
    # whose fallback the freeze then extended).
    assert delta(start).get("store.redis.fallback.seeded", 0) >= k
    during, shared = fleet.arrivals["frozen"], fleet.arrivals["shared"]
    assert during <= 2 * shared_most, (during, shared, shared_most)
    assert shared <= shared_most + k, (shared, shared_most)  # the bound is the shared breaker's


def test_a_breaker_seen_closed_stays_closed_and_its_local_failures_are_not_sent_later(
        frozen: RedisServer) -> None:
    policy = BreakerPolicy(window_size=10, minimum_calls=10, failure_rate=0.5, open_for=5.0)
    target = fresh()
    store = RedisStore(frozen.url, retry_after=0.2, op_timeout=SURE)
    breaker = store.breaker(target, policy)
    moves: list[Transition] = []
    breaker.add_listener(lambda _t, tr: moves.append(tr))
    assert breaker.state(time.monotonic()) is CLOSED
    before = askonce.stats()
    frozen.pause()
    try:
        for _ in range(policy.minimum_calls - 1):  # one short of a verdict, in the local window
            assert breaker.allow(time.monotonic())
            breaker.record(time.monotonic(), success=False)
        assert breaker.state(time.monotonic()) is CLOSED and breaker.allow(time.monotonic())
    finally:
        frozen.resume()
    assert delta(before).get("store.redis.fallback.record", 0) == policy.minimum_calls - 1
    assert delta(before).get("store.redis.fallback.seeded", 0) == 1  # seeded closed
    wait_until("the store to answer from Redis again",
               lambda: (breaker.state(time.monotonic()) is CLOSED
                        and delta(before).get("store.redis.resumed", 0) >= 1))
    # The shared window holds only what Redis was told: five failures now make five calls, no
    # verdict. Had the nine local ones been sent too, 14 calls, 14 failed: open.
    for _ in range(5):
        breaker.record(time.monotonic(), success=False)
    assert breaker.state(time.monotonic()) is CLOSED
    stem = f"{target_tag('askonce', target)}:breaker:{policy_digest(policy)}"
    assert redis.Redis.from_url(frozen.url).hget(stem, "c") == b"5"
    assert moves == []  # closed all along, shared and local
    store.close()


def test_after_sigcont_the_shared_breaker_wins_over_the_seeded_one(frozen: RedisServer) -> None:
    """Seeded open for ``open_for`` (60 s) times the fleet, a store's local breaker would refuse
    for minutes; the shared breaker, closed by another process meanwhile, is what it follows."""
    policy = BreakerPolicy(window_size=10, minimum_calls=10, failure_rate=0.5, open_for=60.0)
    target = fresh()
    stores = [RedisStore(frozen.url, retry_after=0.2, op_timeout=SURE) for _ in range(3)]
    breakers = [s.breaker(target, policy) for s in stores]
    breakers[0].force_open(time.monotonic())
    assert [b.allow(time.monotonic()) for b in breakers] == [False] * 3
    frozen.pause()
    try:
        assert [b.allow(time.monotonic()) for b in breakers] == [False] * 3  # seeded open
        assert all(b.state(time.monotonic()) is OPEN for b in breakers)
    finally:
        frozen.resume()
    healer = RedisStore(frozen.url, op_timeout=SURE)
    healer.breaker(target, policy).force_closed(time.monotonic())
    for b in breakers:
        wait_until("the shared state to win", lambda b=b: b.allow(time.monotonic()))
        assert b.state(time.monotonic()) is CLOSED
    for s in (*stores, healer):
        s.close()


def test_a_bucket_seen_drained_stays_drained(frozen: RedisServer) -> None:
    policy = BucketPolicy(ratio=0.0, floor=0.1, max_tokens=0.0)  # one floor token, slow refill
    target = fresh()
    spender = RedisStore(frozen.url, retry_after=5.0, op_timeout=SURE).bucket(target, policy)
    looker = RedisStore(frozen.url, retry_after=5.0, op_timeout=SURE).bucket(target, policy)
    assert spender.withdraw(time.monotonic()) and not spender.withdraw(time.monotonic())
    assert looker.tokens(time.monotonic()) < 1  # it has seen the drained level
    before = askonce.stats()
    frozen.pause()
    try:
        # A fresh local bucket would grant its floor token at once, to each of them.
        assert not spender.withdraw(time.monotonic())
        assert not looker.withdraw(time.monotonic())
    finally:
        frozen.resume()
    assert delta(before).get("store.redis.fallback.seeded", 0) == 2


def test_admission_falls_back_to_the_fleets_recent_ratio(frozen: RedisServer) -> None:
    """One store made the failing attempts, the other only synced the fleet's window: frozen,
    the other sheds as the fleet did, not as its own empty history would (admit everything)."""
    policy = AdmissionPolicy()
    target = fresh()
    worker = RedisStore(frozen.url, admission_refresh=0.01, retry_after=5.0, op_timeout=SURE)
    reader = RedisStore(frozen.url, admission_refresh=0.01, retry_after=5.0, op_timeout=SURE)
    mine, theirs = worker.admission(target, policy), reader.admission(target, policy)
    for _ in range(40):
        assert mine.admit(time.monotonic(), 0.999)
        mine.record(time.monotonic(), success=False)
    time.sleep(0.02)
    mine.admit(time.monotonic(), 0.999)  # a sync: the fleet's window holds the 40 failures
    time.sleep(0.02)
    theirs.admit(time.monotonic(), 0.999)
    assert theirs.reject_probability(time.monotonic()) > 0.9  # the fleet's view
    time.sleep(0.02)
    before = askonce.stats()
    frozen.pause()
    try:
        shed = [not theirs.admit(time.monotonic(), 0.5) for _ in range(20)]
    finally:
        frozen.resume()
    assert all(shed), shed
    assert delta(before).get("store.redis.fallback.seeded", 0) >= 1


async def test_the_async_store_seeds_its_fallback_too(frozen: RedisServer) -> None:
    policy = BreakerPolicy(window_size=10, minimum_calls=10, failure_rate=0.5, open_for=60.0)
    target = fresh()
    astore = AsyncRedisStore(frozen.url, retry_after=5.0, op_timeout=SURE)
    breaker = astore.breaker(target, policy)
    await breaker.force_open(time.monotonic())
    frozen.pause()
    try:
        assert not await breaker.allow(time.monotonic())  # the fresh local one would allow
        assert await breaker.state(time.monotonic()) is OPEN
    finally:
        frozen.resume()
    await astore.aclose()


def test_a_fleet_size_hint_is_checked() -> None:
    for bad in (0, -1, 10_001, 2.0, True, "3"):
        with pytest.raises(ValueError, match="fleet_size"):
            RedisStore("redis://127.0.0.1:1/0", fleet_size=bad)  # type: ignore[arg-type]
