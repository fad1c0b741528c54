"""The ledger shells: thread-safe in memory, and shared through a real ``redis-server`` by several replicas."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

import askonce
from askonce.core import wire
from askonce.core.ledger import OTHER, Ledger, LedgerPolicy, Report
from askonce.core.question import Hop
from askonce.integrations._server import LedgerLike, ServerOptions
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.ledger._redis import Space, Writer
from askonce.ledger.store import LedgerUnavailable, MemoryLedger, RedisLedger, read_report
from e2e_services import uvicorn_running
from redis_server import RedisServer, free_port

PATHS = [(), (("edge", 1), ("gw", 1)), (("gw", 2),), (("edge", 2), ("gw", 3)), (("gw", 3), ("gw", 1))]
Item = tuple[float, str, str | None, bool, str | None, tuple[tuple[str, int], ...], str, bool]


def fresh() -> str:
    return "L" + uuid.uuid4().hex[:10]


def delta(before: dict[str, int], name: str) -> int:
    return askonce.stats().get(name, 0) - before.get(name, 0)


def stream(seed: int, n: int, start: float = 1_000.0, step: float = 0.05) -> list[Item]:
    rng = random.Random(seed)
    return [
        (start + i * step, rng.choice(["GET /a", "POST /b"]), rng.choice([None, *(f"key-{j:04d}" for j in range(200))]),
         rng.random() < 0.8, rng.choice([None, "gw"]), rng.choice(PATHS), rng.choice(["", "tenant-1"]),
         rng.random() < 0.03)
        for i in range(n)
    ]  # fmt: skip


def feed(ledger: Any, items: list[Item]) -> list[bool]:
    return [ledger.record(t, op, key=k, edge=e, origin=o, path=p, principal=pr, malformed=m)
            for t, op, k, e, o, p, pr, m in items]


@pytest.fixture
def url(shared_redis: RedisServer) -> str:
    return shared_redis.url


@pytest.fixture
def client(shared_redis: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(shared_redis.url)
    yield c
    c.close()


# --- in memory ---------------------------------------------------------------------------------------


def test_memory_ledger_counts_every_arrival_from_many_threads() -> None:
    shell = MemoryLedger(LedgerPolicy(cap=3))
    barrier = threading.Barrier(8)
    admitted: list[bool] = []

    def work(t: int) -> None:
        barrier.wait()
        out = [shell.record(1.0, "op", key=f"k{i}", edge=True, path=(("gw", 1 + t),)) for i in range(5_000)]
        admitted.extend(out)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = shell.report(1.0).find("op")
    assert got is not None
    assert (got.arrivals, got.distinct_keys, got.refused) == (40_000, 5_000, 25_000)
    assert admitted.count(True) == 15_000  # exactly the cap for each key, whatever the interleaving


def test_memory_ledger_fits_the_server_integrations_and_merges() -> None:
    a, b = MemoryLedger(), MemoryLedger()
    shell: LedgerLike = a
    assert ServerOptions(layer="target", ledger=shell).ledger is a
    items = stream(1, 400)
    feed(a, items[::2])
    feed(b, items[1::2])
    one = Ledger()
    feed(one, items)
    a.merge(b)
    a.note_dropped(0, "none")
    assert a.report(1_020.0) == one.report(1_020.0)


# --- Redis: replicas share one count ------------------------------------------------------------------


def _replica(url: str, prefix: str, policy: LedgerPolicy, items: list[Item]) -> list[bool]:
    with RedisLedger(url, prefix=prefix, policy=policy, op_timeout=2.0, flush_interval=0.05) as shell:
        return feed(shell, items)


@pytest.mark.parametrize("cap", [None, 3])
def test_two_replicas_in_two_processes_report_what_one_ledger_fed_everything_reports(url: str, cap: int | None) -> None:
    policy = LedgerPolicy(window=60.0, windows_kept=2, heavy_keys=5, cap=cap)
    items = stream(7, 6_000)  # 300 s of traffic: five windows, three of them kept
    prefix = fresh()
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        halves = [pool.submit(_replica, url, prefix, policy, items[i::2]) for i in (0, 1)]
        admitted = [f.result(timeout=60) for f in halves]
    one = Ledger(policy)
    expected = feed(one, items)
    now = items[-1][0]
    shared = read_report(redis.Redis.from_url(url), now, prefix=prefix, policy=policy)
    assert shared == one.report(now)
    assert shared.totals() == one.report(now).totals()
    assert shared.totals().undeclared_retries > 0 and shared.totals().retries_by
    assert sum(map(sum, admitted)) == sum(expected)  # same number refused: the cap is fleet-wide
    assert read_report(redis.Redis.from_url(url), now, prefix=prefix) == shared  # the policy from Redis' meta
    if cap is not None:
        assert shared.totals().refused > 0


def test_the_report_of_any_replica_includes_every_replica(url: str) -> None:
    policy = LedgerPolicy(window=10.0)
    prefix = fresh()
    items = stream(3, 1_000, start=500.0, step=0.01)
    with RedisLedger(url, prefix=prefix, policy=policy, start=False) as a, \
            RedisLedger(url, prefix=prefix, policy=policy, flush_interval=0.02) as b:
        feed(a, items[:600])
        feed(b, items[600:])
        deadline = time.monotonic() + 10
        while b.buffered and time.monotonic() < deadline:  # b's own thread flushes it
            time.sleep(0.01)
        assert b.buffered == 0
        one = Ledger(policy)
        feed(one, items)
        assert a.report(510.0) == one.report(510.0)  # a flushed its own buffer before reading
        assert a.local_report(510.0).totals().arrivals == 600


def test_keys_share_a_slot_per_window_and_expire(url: str, client: redis.Redis) -> None:
    prefix = fresh()
    policy = LedgerPolicy(window=60.0, windows_kept=1, max_exact_keys=2)
    with RedisLedger(url, prefix=prefix, policy=policy, start=False) as shell:
        for i in range(5):
            shell.record(61.0, "op", key=f"key-{i:016d}", edge=True, path=(("gw", 2),))
        shell.record(125.0, "op", key=None)
        shell.note_dropped(2, "test")
        shell.flush()
    keys = [k.decode() for k in client.scan_iter(match=f"{{{prefix}:*")]
    by_window: dict[str, set[int]] = {}
    for k in keys:
        by_window.setdefault(k.split("}")[0] + "}", set()).add(key_slot(k.encode()))
        assert 0 < client.pttl(k) <= (1 + 2) * 60_000 + 60_000 or k.endswith((":meta", ":dropped"))
    assert all(len(slots) == 1 for slots in by_window.values())
    assert {f"{{{prefix}:ledger:60.0:1}}", f"{{{prefix}:ledger:60.0:2}}", f"{{{prefix}:ledger}}"} <= set(by_window)


def test_a_chunk_sent_twice_counts_once(url: str, client: redis.Redis) -> None:
    policy = LedgerPolicy()
    prefix = fresh()
    writer = Writer(Space(prefix, policy), client)
    calls, expired, invalid = writer.prepare([(1.0, "op", "key-0000000000000001", True, None, (), "", False, 0)] * 3)
    calls.append(writer.dropped_call({"lost": 1}))
    assert expired == invalid == 0
    writer.send(calls)
    writer.send(calls)  # as after a timeout that hid a success
    report = read_report(client, 1.0, prefix=prefix, policy=policy)
    assert report.totals().arrivals == 3 and dict(report.dropped) == {"lost": 1}


def test_redis_overflow_is_approximate_and_capped_keys_beyond_it_are_said_unenforced(url: str) -> None:
    policy = LedgerPolicy(max_exact_keys=50, cap=2, max_operations=2)
    with RedisLedger(url, prefix=fresh(), policy=policy, start=False) as shell:
        for i in range(2_000):
            shell.record(1.0, "op", key=f"k-{i:016d}", edge=True)
        for _ in range(3):
            shell.record(1.0, "op", key="k-0000000000000000", edge=True)  # an exact key: capped
        for name in ("b", "c", "d"):
            shell.record(1.0, name, key=None)
        report = shell.report(1.0)
    got = report.find("op")
    assert got is not None and got.approximate
    assert abs(got.distinct_keys - 2_000) < 40  # 50 exact + PFCOUNT of the rest
    assert got.refused == 2 and got.cap_unenforced == 1_950
    assert [o.operation for o in report.operations] == ["b", "op", OTHER]  # as the core folds names


# --- Redis: the cap ------------------------------------------------------------------------------------


def test_cap_is_exact_under_64_concurrent_attempts_and_scoped_per_principal(url: str) -> None:
    policy = LedgerPolicy(cap=5)
    prefix = fresh()
    before = askonce.stats()
    # Four shells (four replicas' worth of connection pools and local ledgers): only Redis can keep the
    # count exact. A generous op_timeout: this test is about atomicity, not about the timeout.
    shells = [RedisLedger(url, prefix=prefix, policy=policy, op_timeout=2.0, start=False) for _ in range(4)]
    barrier = threading.Barrier(64)
    results: list[bool] = []
    lock = threading.Lock()

    def attempt(i: int) -> None:
        barrier.wait()
        ok = shells[i % 4].record(100.0, "POST /pay", key="question-0000000001", edge=True, principal="tenant-a",
                                  path=(("gw", 1 + i // 4),))
        with lock:
            results.append(ok)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(64)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert results.count(True) == 5 and len(results) == 64
        assert delta(before, "ledger.redis.cap-fallback") == 0
        # Another tenant sending the same key is another question: never refused for tenant-a's count.
        assert all(shells[0].record(100.0, "POST /pay", key="question-0000000001", edge=True,
                                    principal="tenant-b") for _ in range(5))
        assert not shells[1].record(100.0, "POST /pay", key="question-0000000001", edge=True, principal="tenant-b")
        for s in shells[1:]:
            s.flush()
        got = shells[0].report(100.0).find("POST /pay")
        assert got is not None
        assert (got.arrivals, got.refused, got.distinct_keys) == (70, 60, 2)
        assert got.heavy[0].arrivals == 64 and got.heavy[0].principal == "tenant-a"
    finally:
        for s in shells:
            s.close()


# --- Redis down ----------------------------------------------------------------------------------------


def test_redis_down_bounds_the_request_path_falls_back_to_the_local_cap_and_counts_drops(
        own_redis: RedisServer) -> None:
    before = askonce.stats()
    prefix = fresh()
    policy = LedgerPolicy(cap=3)
    shell = RedisLedger(own_redis.url, prefix=prefix, policy=policy, retry_after=0.2, max_buffer=100, start=False)
    try:
        assert shell.record(10.0, "op", key="first-question-0001", edge=True)
        shell.flush()
        own_redis.stop()
        slowest = 0.0
        admitted = []
        for i in range(300):
            t0 = time.monotonic()
            admitted.append(shell.record(10.0, "op", key="first-question-0001" if i < 4 else f"q-{i:016d}",
                                         edge=True))
            slowest = max(slowest, time.monotonic() - t0)
        # Bounded by the 50 ms client timeouts, once per retry_after, never by a TCP or default timeout.
        assert slowest < 1.0
        assert admitted[:4] == [True, True, False, False]  # the local cap: 3 per key on this replica
        assert delta(before, "ledger.redis.cap-fallback") >= 290
        assert delta(before, "ledger.redis.error.connection") >= 1
        assert not shell.flush()
        assert shell.buffered == 100
        local = shell.local_report(10.0)
        assert dict(local.dropped) == {"buffer-full": 200} and local.totals().arrivals == 301
        assert delta(before, "ledger.redis.dropped.buffer-full") == 200
        with pytest.raises(LedgerUnavailable):
            shell.report(10.0)

        own_redis.start()  # empty: what the first flush sent is gone with the old server
        time.sleep(0.25)  # retry_after
        assert shell.flush()
        shared = shell.report(10.0)
        assert shared.totals().arrivals == 100 and dict(shared.dropped) == {"buffer-full": 200}
        assert delta(before, "ledger.redis.resumed") >= 1
    finally:
        shell.close()


def test_a_frozen_redis_bounds_the_request_path_too(own_redis: RedisServer) -> None:
    shell = RedisLedger(own_redis.url, prefix=fresh(), policy=LedgerPolicy(cap=1), retry_after=30.0, start=False)
    try:
        assert shell.record(10.0, "op", key="frozen-question-01", edge=True)
        own_redis.pause()  # accepts connections, never answers
        t0 = time.monotonic()
        assert not shell.record(10.0, "op", key="frozen-question-01", edge=True)  # the local cap says no
        assert shell.record(10.0, "op", key="frozen-question-02", edge=True)
        assert time.monotonic() - t0 < 1.0
    finally:
        own_redis.resume()
        shell.close()


def test_arrivals_of_windows_no_report_shows_are_not_sent(url: str) -> None:
    before = askonce.stats()
    policy = LedgerPolicy(window=10.0, windows_kept=1)
    with RedisLedger(url, prefix=fresh(), policy=policy, start=False) as shell:
        shell.record(5.0, "op", key=None)
        shell.record(45.0, "op", key=None)
        report = shell.report(45.0)
        assert report == shell.local_report(45.0)  # the core forgets old windows too: no loss
        assert report.totals().arrivals == 1 and not report.dropped
        assert delta(before, "ledger.redis.expired") == 1


def test_reading_an_empty_prefix_or_a_dead_server_says_so(url: str) -> None:
    with pytest.raises(LookupError):
        read_report(redis.Redis.from_url(url), 1.0, prefix=fresh())
    dead = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    with pytest.raises(LedgerUnavailable):
        read_report(dead, 1.0, policy=LedgerPolicy())


@pytest.mark.parametrize(
    "kwargs",
    [{"prefix": ""}, {"prefix": "a{b"}, {"op_timeout": 0}, {"retry_after": -1}, {"batch": 0}, {"max_buffer": 1.5},
     {"flush_interval": 0}],
)
def test_options_are_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RedisLedger("redis://127.0.0.1:1/0", start=False, **kwargs)


def test_time_must_be_finite_on_the_capped_path(url: str) -> None:
    with RedisLedger(url, prefix=fresh(), policy=LedgerPolicy(cap=1), start=False) as shell, \
            pytest.raises(ValueError):
        shell.record(float("nan"), "op", key="some-question-0001", edge=True)


def test_report_is_a_report(url: str) -> None:
    with RedisLedger(url, prefix=fresh(), start=False) as shell:
        assert isinstance(shell.report(1.0), Report)


def test_without_a_local_ledger_record_is_an_append_and_bad_arrivals_are_counted_not_fatal(url: str) -> None:
    with pytest.raises(ValueError):
        RedisLedger(url, policy=LedgerPolicy(cap=1), start=False, local=False)
    with RedisLedger(url, prefix=fresh(), start=False, local=False) as shell:
        with pytest.raises(ValueError):
            shell.record(float("inf"), "op", key=None)
        shell.record(1.0, "op", key="good-question-0001", edge=True)
        shell.record(1.0, "op", key=12345, edge=True)  # type: ignore[arg-type]  # what types forbid
        report = shell.report(1.0)
        assert report.totals().arrivals == 1 and dict(report.dropped) == {"invalid": 1}
        assert shell.local_report(1.0).totals().arrivals == 0 and dict(shell.local_report(1.0).dropped) == {
            "invalid": 1}


def test_a_long_outage_holds_a_bounded_number_of_calls_and_loses_no_drop_count(own_redis: RedisServer) -> None:
    ledger = RedisLedger(own_redis.url, start=False, max_buffer=2, retry_after=0.0, op_timeout=0.05,
                         read_timeout=0.2)
    try:
        own_redis.stop()
        for i in range(200):  # 200 flushes while Redis is away, each with arrivals dropped
            for j in range(3):
                ledger.record(time.time(), "op", key=f"k{i}-{j}", edge=True)
            ledger.flush()
        assert len(ledger._held) <= 4  # one held call per flush: memory grows for as long as Redis is away
        dropped = ledger.local_report(time.time()).dropped
        assert dropped == {"buffer-full": 3 * 200 - 2}
        own_redis.start()
        assert ledger.flush()
        assert ledger.flush()  # the drop counts held back
        report = ledger.report(time.time())
        assert report.dropped == {"buffer-full": 3 * 200 - 2}
        assert report.totals().arrivals == 2
    finally:
        ledger.close(timeout=1.0)


def test_a_capped_record_with_redis_frozen_is_bounded_and_falls_back(own_redis: RedisServer) -> None:
    ledger = RedisLedger(own_redis.url, policy=LedgerPolicy(cap=1), start=False, op_timeout=0.05,
                         read_timeout=0.2, retry_after=30.0)
    try:
        own_redis.pause()
        before = askonce.stats()
        started = time.monotonic()
        assert ledger.record(time.time(), "op", key="k", edge=True)
        assert not ledger.record(time.time(), "op", key="k", edge=True)  # the local cap decides
        assert time.monotonic() - started < 2.0  # bound: one op_timeout, then Redis is left alone
        assert askonce.stats().get("ledger.redis.cap-fallback", 0) - before.get("ledger.redis.cap-fallback", 0) == 2
        assert not ledger.flush()
        own_redis.resume()
    finally:
        ledger.close(timeout=1.0)


def test_a_redis_ledger_with_nowhere_to_connect_constructs_and_records() -> None:
    ledger = RedisLedger(f"redis://127.0.0.1:{free_port()}/0", start=False, policy=LedgerPolicy(cap=2),
                         retry_after=0.0)
    try:
        recorded = [ledger.record(time.time(), "op", key="k", edge=True) for _ in range(3)]
        assert recorded == [True, True, False]  # the local cap decides while Redis is unreachable
        assert not ledger.record(time.time(), "op", key="k", edge=True)
        assert ledger.local_report(time.time()).totals().refused == 2
        assert not ledger.flush()
    finally:
        ledger.close(timeout=0.5)


def test_a_time_too_far_for_the_window_is_one_invalid_arrival_not_a_lost_batch(shared_redis: RedisServer) -> None:
    prefix = f"far-{time.monotonic_ns()}"
    ledger = RedisLedger(shared_redis.url, policy=LedgerPolicy(window=0.001, windows_kept=2), prefix=prefix,
                         start=False, local=False)
    try:
        now = time.time()
        ledger.record(now, "op", key="a", edge=True)
        ledger.record(1.7e308, "op", key="b", edge=True)  # finite, but no window of 1 ms holds it
        ledger.record(now, "op", key="c", edge=True)
        assert ledger.flush()
        report = ledger.report(now)
        assert report.totals().arrivals == 2
        assert report.dropped == {"invalid": 1}
    finally:
        ledger.close(timeout=1.0)


# --- through real servers: two replicas of a target behind one Redis -----------------------------------


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


_replica_server = uvicorn_running


async def test_two_served_replicas_cap_one_question_exactly_and_report_one_total(url: str) -> None:
    prefix = fresh()
    policy = LedgerPolicy(window=3600.0, cap=3)
    shells = [RedisLedger(url, prefix=prefix, policy=policy, op_timeout=2.0) for _ in range(2)]

    def tenant(scope: Any) -> str:
        return dict(scope["headers"]).get(b"x-tenant", b"").decode()

    apps = [AskonceASGIMiddleware(_ok, layer="target", ledger=s, principal=tenant) for s in shells]
    question = "served-question-000000001"
    try:
        with _replica_server(apps[0]) as a, _replica_server(apps[1]) as b:
            async with httpx.AsyncClient(timeout=10) as client:
                async def call(i: int, tenant_name: str) -> httpx.Response:
                    h = wire.format_question(question, "edge", True, 2, None, (Hop("edge", 1), Hop("gw", 1 + i)))
                    return await client.post((a, b)[i % 2] + "/pay", headers={"askonce-question": h,
                                                                               "x-tenant": tenant_name})

                first = await asyncio.gather(*(call(i, "tenant-a") for i in range(64)))
                other = await asyncio.gather(*(call(i, "tenant-b") for i in range(2)))
        statuses = sorted(r.status_code for r in first)
        assert statuses == [200] * 3 + [429] * 61  # across two replicas: no overshoot
        refused = next(r for r in first if r.status_code == 429)
        reply = wire.parse_reply(refused.headers["askonce-reply"])
        assert not isinstance(reply, wire.Malformed) and reply.dnr and reply.reason == "cap"
        assert [r.status_code for r in other] == [200, 200]  # tenant-a's count never refuses tenant-b
        shells[1].flush()
        got = shells[0].report(time.time()).find("POST /pay")
        assert got is not None
        assert (got.arrivals, got.refused, got.distinct_keys, got.coverage) == (66, 61, 2, 1.0)
        assert dict(got.retries_by) == {"gw": 64} and got.undeclared_retries == 0
    finally:
        for s in shells:
            s.close()
