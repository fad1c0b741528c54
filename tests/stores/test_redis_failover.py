"""The Redis store and the Redis ledger on a real Redis Cluster (3 masters, a replica each) and a
real Sentinel setup (a master, a replica, a sentinel), with a master SIGKILLed mid-run: no user
call fails (the store falls back, counted), and with ``replicas=1`` the ledger counts every
arrival exactly once across the failover."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

import askonce
from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy
from askonce.core.bucket import BucketPolicy
from askonce.core.ledger import LedgerPolicy, window_index
from askonce.ledger._redis import Space
from askonce.ledger.store import RedisLedger
from askonce.stores._redis_lua import target_tag
from askonce.stores.redis import RedisStore
from redis_server import ClusterSet, Node, SentinelSet, need_cluster_tools, wait_until
from stats_delta import delta

POLICY = LedgerPolicy(window=3600.0)  # one window for the whole run (a boundary is harmless too)
OPTIONS: dict[str, Any] = {"socket_connect_timeout": 0.05, "retry": Retry(NoBackoff(), 0)}


@pytest.fixture(autouse=True)
def _tools() -> None:
    reason = need_cluster_tools()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Redis failover tests: {reason}")
        pytest.skip(reason)


@pytest.fixture
def cluster() -> Iterator[ClusterSet]:
    with tempfile.TemporaryDirectory(prefix="askonce-cluster-") as directory:
        c = ClusterSet(directory, node_timeout=500)
        try:
            c.start()
            yield c
        finally:
            c.stop()


@pytest.fixture
def sentinel_set() -> Iterator[SentinelSet]:
    with tempfile.TemporaryDirectory(prefix="askonce-sentinel-") as directory:
        s = SentinelSet(directory)
        try:
            s.start()
            yield s
        finally:
            s.stop()


def kill(node: Node) -> None:
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait(timeout=10)
    node.proc = None


class Run:
    """User calls in a thread: every store operation and one ledger arrival per round."""

    def __init__(self, store: RedisStore, ledger: RedisLedger, target: str) -> None:
        self.errors: list[BaseException] = []
        self.sent = 0
        self._stop = threading.Event()
        self._store, self._ledger, self._target = store, ledger, target
        self._thread = threading.Thread(target=self._traffic)

    def _traffic(self) -> None:
        store, target = self._store, self._target
        bucket = store.bucket(target, BucketPolicy())
        breaker = store.breaker(target, BreakerPolicy())
        admission = store.admission(target, AdmissionPolicy())
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                bucket.deposit()
                bucket.withdraw(now)
                if breaker.allow(now):
                    breaker.record(time.monotonic(), success=True)
                if admission.admit(now, 0.5):
                    admission.record(time.monotonic(), success=True)
                self._ledger.record(time.time(), "GET /x", key=f"q{self.sent}", edge=True)
                self.sent += 1
            except BaseException as exc:  # any of them reaching the caller is a failed user call
                self.errors.append(exc)
            time.sleep(0.003)

    def through(self, fail: Callable[[], None], failed_over: Callable[[], bool],
                recover: Callable[[], None]) -> None:
        self._thread.start()
        try:
            time.sleep(0.3)
            fail()
            wait_until("the failover", failed_over, timeout=20)
            recover()
            time.sleep(0.5)
        finally:
            self._stop.set()
            self._thread.join(timeout=10)


def check(run: Run, ledger: RedisLedger, before: dict[str, int]) -> None:
    # The flusher catches up once a replica acknowledges again (a flush held during its back-off
    # waits for the next one).
    wait_until("the ledger to send what it holds", lambda: ledger.buffered == 0, timeout=10)
    ledger.close(timeout=5.0)
    moved = delta(before)
    assert not run.errors, run.errors[:3]
    assert run.sent > 100
    # The store fell back while the master was away, and came back to shared state.
    assert moved.get("store.redis.fallback", 0) > 0 and moved.get("store.redis.resumed", 0) >= 1
    # The ledger's flushes failed while the window's master was away, and were held and sent again.
    assert moved.get("ledger.redis.down", 0) >= 1 and moved.get("ledger.redis.resumed", 0) >= 1
    # Every arrival counted once: none lost in the failover (a flush counts only once replicated,
    # else it is sent again), none twice (its chunks' done-markers), nothing dropped.
    report = ledger.report(time.time())
    assert report.totals().arrivals == run.sent
    assert not report.dropped and not any(k.startswith("ledger.redis.dropped") for k in moved)


def test_a_cluster_master_killed_mid_run(cluster: ClusterSet) -> None:
    nodes = [ClusterNode("127.0.0.1", n.port) for n in cluster.nodes]
    fast = RedisCluster(startup_nodes=nodes, socket_timeout=0.05, **OPTIONS)
    slow = RedisCluster(startup_nodes=nodes, socket_timeout=1.0, **OPTIONS)
    prefix = "c" + uuid.uuid4().hex[:8]
    tag = Space(prefix, POLICY).tag(window_index(time.time(), POLICY.window))
    victim = cluster.master_of(tag)
    # A target whose keys live on the same master as the ledger's window: both lose it.
    target = next(t for t in (f"svc-{i}" for i in range(10_000))
                  if cluster.master_of(target_tag("askonce", t)) is victim)
    store = RedisStore(fast, retry_after=0.2)
    ledger = RedisLedger(slow, prefix=prefix, policy=POLICY, flush_interval=0.05,
                         retry_after=0.2, replicas=1, replica_wait=0.2)
    before = askonce.stats()
    run = Run(store, ledger, target)

    def recover() -> None:  # back as the replica of its old replica: flushes are acknowledged again
        victim.start()
        wait_until("the old master to be a replica in sync", lambda: (
            "master_link_status:up" in victim.command("info", "replication")))

    run.through(lambda: kill(victim), lambda: cluster.failed_over(victim, tag), recover)
    try:
        check(run, ledger, before)
    finally:
        store.close()
        slow.close()


def test_a_sentinel_master_killed_mid_run(sentinel_set: SentinelSet) -> None:
    sentinel = Sentinel([("127.0.0.1", sentinel_set.sentinel.port)], socket_timeout=0.5)
    name = SentinelSet.NAME
    fast = sentinel.master_for(name, socket_timeout=0.05, **OPTIONS)
    slow = sentinel.master_for(name, socket_timeout=1.0, **OPTIONS)
    store = RedisStore(fast, retry_after=0.2)
    ledger = RedisLedger(slow, prefix="s" + uuid.uuid4().hex[:8], policy=POLICY,
                         flush_interval=0.05, retry_after=0.2, replicas=1, replica_wait=0.2)
    before = askonce.stats()
    run = Run(store, ledger, "svc")
    old = sentinel_set.master

    def recover() -> None:  # back as the new master's replica (as its orchestrator would start it)
        old.extra += ["--replicaof", "127.0.0.1", str(sentinel_set.master_port())]
        old.start()
        wait_until("the old master to be a replica in sync", lambda: (
            "master_link_status:up" in old.command("info", "replication")), timeout=20)

    run.through(lambda: kill(old), lambda: sentinel_set.failed_over(old), recover)
    try:
        check(run, ledger, before)
    finally:
        store.close()
        slow.close()


def test_the_ledger_refuses_a_bad_replicas_option() -> None:
    for value in (-1, 17, 1.5, True):
        with pytest.raises(ValueError, match="replicas"):
            RedisLedger("redis://127.0.0.1:1", replicas=value, start=False)  # type: ignore[arg-type]
