"""The Redis store: one retry token bucket and one circuit breaker per target, shared by a fleet.

Every operation is one Lua script (``LUA_BUCKET``, ``LUA_BREAKER``: atomic on the server), so N
processes naming the same target share one budget and one breaker. Keys look like
``{askonce:<target>}:breaker:<policy digest>``: the hash tag keeps a target's keys in one Redis
Cluster slot, the digest keeps processes that disagree about a policy from misreading each other's
state, and every key gets a TTL (``ttl`` seconds, refreshed on use) so nothing grows without bound.

Time inside the scripts is the Redis server's ``TIME``: monotonic clocks of different processes do
not agree, so shared state must not mix them. Handles convert what they return (``retry_at``,
transition times) to the caller's clock by the offset between the caller's ``now`` and the server
time of the same call. A server clock that steps backwards is treated like the core treats a racy
``now``: the latest time seen is kept.

Failure of the store is not failure of the service. Clients built from a URL get ``op_timeout``
(50 ms) connect and read timeouts and no client-side retries; on any error the operation is answered
by a local in-memory bucket or breaker for the same target, seeded from the shared state this
handle last saw and on a 1/N share of the fleet (``core.fallback``: an open breaker stays open
until the shared ``retry_at``, first probes at a random point of the ``(N - 1) * open_for`` after
it (so N processes seeded alike do not probe together), then every ``N * open_for``; a bucket
keeps 1/N of the level
seen and refills at ``floor / N``), N being the stores Redis last counted sharing the state (a
members sorted set beside it, ``...:m``, written by the scripts when a handle passes its member
id, at most every ``HEARTBEAT`` seconds) or ``fleet_size`` if larger. What the local state learns
is never sent to Redis afterwards, so nothing is counted twice; when Redis answers again the
shared state wins, and the next fallback is seeded afresh (``askonce.stats()``:
``store.redis.fallback``, ``store.redis.fallback.<op>``,
``store.redis.error.<timeout|connection|response|other>``, ``store.redis.fallback.seeded``),
Redis is left alone for ``retry_after``
seconds (store-wide, so one outage costs one timeout, not one per target), and the next operation
after that tries Redis again (``store.redis.resumed`` when it answers). A client you pass in keeps
its own timeouts and retries: give it ``socket_timeout``/``socket_connect_timeout`` and
``retry=Retry(NoBackoff(), 0)``, or the fallback waits for them.

Deposits are counted locally and sent with the next withdrawal or every ``deposit_batch`` deposits:
one round trip per retry decision instead of one per request
(``docs/benchmarks.md ("Breakers and Redis")``). Batching only delays earned tokens, it never
invents them.

A breaker's half-open probes are leased: a process that dies holding a probe would otherwise keep
the fleet's breaker half-open for ever, so when every probe slot is taken and no verdict has come
for ``open_for`` seconds since the last probe was let through, the slots are handed out afresh
(counted as ``breaker.probe-lease-expired``).

Adaptive admission (``admission()``, ``core.admission``) is shared by the fleet too: per-second
counters of requests, calls and successes per target in one hash (``LUA_ADMISSION``), synced every
``admission_refresh`` seconds and decided locally in between, so that an admission decision costs
no round trip on its fast path; see ``stores._redis_admission``.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from askonce import _stats
from askonce._stats import count
from askonce.core import is_int, is_real
from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy, TokenBucket
from askonce.core.fallback import (
    MAX_FLEET,
    breaker_share,
    bucket_share,
    first_probe,
    fleet_size,
    seeded_bucket,
)
from askonce.stores._pool import pooled
from askonce.stores._redis_admission import RedisAdmissionHandle
from askonce.stores._redis_lua import (
    HEARTBEAT,
    LUA_ADMISSION,
    LUA_BREAKER,
    LUA_BUCKET,
    MEMBER_EXPIRY,
    BreakerReply,
    BucketReply,
    breaker_args,
    bucket_args,
    policy_digest,
    target_tag,
)
from askonce.stores.memory import BreakerHandle as MemoryBreakerHandle
from askonce.stores.memory import BucketHandle as MemoryBucketHandle
from askonce.stores.memory import Listener, notify

__all__ = ["RedisAdmissionHandle", "RedisBreakerHandle", "RedisBucketHandle", "RedisStore"]

log = logging.getLogger("askonce.stores.redis")


def error_reason(exc: BaseException) -> str:
    if isinstance(exc, redis.exceptions.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, redis.exceptions.ConnectionError | OSError):
        return "connection"
    if isinstance(exc, redis.exceptions.ResponseError):
        return "response"
    return "other"


class Health:
    """Store-wide: may Redis be asked now, or is it left alone after a failure (``retry_after``)?"""

    def __init__(self, clock: Callable[[], float], retry_after: float) -> None:
        self._clock = clock
        self._retry_after = retry_after
        self._down_until: float | None = None
        self._lock = threading.Lock()

    def usable(self) -> bool:
        down_until = self._down_until
        return down_until is None or self._clock() >= down_until

    def failed(self, op: str, exc: BaseException) -> None:
        reason = error_reason(exc)
        count(f"store.redis.error.{reason}")
        with self._lock:
            first = self._down_until is None
            self._down_until = self._clock() + self._retry_after
        if first:
            count("store.redis.down")
            log.warning("askonce: Redis store unavailable (%s on %s: %r); using local state",
                        reason, op, exc)

    def fallback(self, op: str) -> None:
        count("store.redis.fallback")
        count(f"store.redis.fallback.{op}")

    def succeeded(self) -> None:
        if self._down_until is not None:
            with self._lock:
                resumed, self._down_until = self._down_until is not None, None
            if resumed:
                count("store.redis.resumed")
                log.info("askonce: Redis store is back; shared state resumed")



def check_options(prefix: str, op_timeout: float, retry_after: float, ttl: float,
                  deposit_batch: int, admission_refresh: float = 0.1, fleet: int = 1) -> None:
    if (not isinstance(prefix, str) or not prefix or not prefix.isprintable()
            or any(c in prefix for c in "{}")):
        raise ValueError("prefix must be a non-empty printable name without braces, "
                         f"got {prefix!r}")
    for name, value in (("op_timeout", op_timeout), ("retry_after", retry_after), ("ttl", ttl),
                        ("admission_refresh", admission_refresh)):
        if not is_real(value):
            raise ValueError(f"{name} must be seconds (an int or a float), got {value!r}")
    if not 0 < op_timeout <= 60:
        raise ValueError(f"op_timeout must be within (0, 60] seconds, got {op_timeout!r}")
    if not 0 <= retry_after <= 3600:
        raise ValueError(f"retry_after must be within 0..3600 seconds, got {retry_after!r}")
    if not 0.001 <= admission_refresh <= 60:
        raise ValueError(f"admission_refresh must be within 0.001..60 seconds, "
                         f"got {admission_refresh!r}")
    if not 1 <= ttl <= 30 * 86_400 or not math.isfinite(ttl):
        raise ValueError(f"ttl must be within 1 s..30 days, got {ttl!r}")
    if not is_int(deposit_batch) or not 1 <= deposit_batch <= 1_000_000:
        raise ValueError(f"deposit_batch must be an int within 1..1000000, got {deposit_batch!r}")
    if not is_int(fleet) or not 1 <= fleet <= MAX_FLEET:
        raise ValueError(f"fleet_size must be an int within 1..{MAX_FLEET}, got {fleet!r}")


def no_retry() -> Retry:
    """Client-side retries would stretch ``op_timeout`` into seconds; the store falls back."""
    return Retry(NoBackoff(), 0)


def warn_if_retrying(client: object) -> None:
    """A client passed in keeps its settings; say so when they defeat the fallback's time bound."""
    get_retry = getattr(client, "get_retry", None)
    retry = get_retry() if callable(get_retry) else None
    retries = getattr(retry, "get_retries", lambda: 0)()
    if isinstance(retries, int) and retries > 0:
        log.warning("askonce: the Redis client retries %d times; while Redis is down each store "
                    "operation waits for them before falling back (pass a URL, or "
                    "retry=Retry(NoBackoff(), 0))", retries)


# --- handles: the parts sync and asyncio share ----------------------------------------------------


class BucketBase:
    __slots__ = ("_args", "_beat_at", "_fallback", "_keys", "_level", "_live", "_lock", "_members",
                 "_pending", "_store", "policy", "target")

    def __init__(self, store: StoreBase, target: str, policy: BucketPolicy) -> None:
        self._store = store
        self.target = target
        self.policy = policy
        stem = f"{target_tag(store.prefix, target)}:bucket:{policy_digest(policy)}"
        self._keys = [stem, stem + ":m"]
        self._lock = threading.Lock()  # a deposit count flushed twice would invent tokens
        self._pending = 0
        self._args = bucket_args(policy, 0, False, store.ttl_ms)
        self._fallback: MemoryBucketHandle | None = None
        self._live = False  # the last answer came from Redis: the next local one is seeded anew
        self._level: tuple[float, float] | None = None  # earned, floor tokens as Redis last said
        self._members = 0  # processes sharing the bucket as Redis last counted them
        self._beat_at = -math.inf  # when this handle last had itself counted (store clock)

    def _local(self) -> MemoryBucketHandle:
        """The local bucket for this fallback: seeded from the shared level last seen, on a 1/N
        share (``core.fallback``) the first time after an answer from Redis."""
        local = self._fallback
        if local is None or self._live:
            with self._lock:
                local = self._fallback
                if local is None or self._live:
                    local = self._fallback = self._seed()
                    self._live = False
        return local

    def _seed(self) -> MemoryBucketHandle:
        store = self._store
        fleet = fleet_size(self._members, store.fleet_size)
        policy = bucket_share(self.policy, fleet)
        now, level = store.clock(), self._level
        if level is None:
            bucket = TokenBucket(policy, now)  # never heard from Redis: a fresh share
        else:
            bucket = seeded_bucket(policy, now, level[0], level[1], fleet)
            count("store.redis.fallback.seeded")
        return MemoryBucketHandle(self.target, bucket, threading.Lock())

    def _heard(self, raw: Any) -> BucketReply:
        """Read a script's answer (raising if it does not read: Redis' failure) and remember the
        shared state it carries."""
        reply = BucketReply(raw)
        self._level = (reply.earned, reply.floor_tokens)
        if reply.members:
            self._members = reply.members
        self._live = True
        return reply

    def _count(self) -> int:
        """Count one deposit; the batch to flush now, or 0."""
        with self._lock:
            self._pending += 1
            if self._pending < self._store.deposit_batch:
                return 0
            n, self._pending = self._pending, 0
            return n

    def _take(self) -> int:
        with self._lock:
            n, self._pending = self._pending, 0
            return n

    def _args_for(self, n: int, take: bool) -> list[str]:
        args = self._args.copy()
        args[3], args[4] = str(n), "1" if take else "0"
        store = self._store
        now = store.clock()
        if now - self._beat_at >= HEARTBEAT:  # have this store counted as a member
            self._beat_at = now
            args += ["", store.member, store.member_expiry]
        return args

    def _to_local(self, n: int) -> MemoryBucketHandle:
        # Deposits Redis did not take earn tokens locally instead, so the fallback is not stingier
        # than a memory store; they are not sent again, so Redis never counts them twice.
        local = self._local()
        for _ in range(n):
            local.deposit()
        return local


class BreakerBase:
    __slots__ = ("_args", "_beat_at", "_fallback", "_keys", "_listeners", "_live", "_lock",
                 "_members", "_retry_at", "_seen", "_store", "policy", "target")

    def __init__(self, store: StoreBase, target: str, policy: BreakerPolicy) -> None:
        self._store = store
        self.target = target
        self.policy = policy
        stem = f"{target_tag(store.prefix, target)}:breaker:{policy_digest(policy)}"
        self._keys = [stem, stem + ":w", stem + ":m"]
        self._args = breaker_args(policy, store.ttl)
        self._lock = threading.Lock()
        self._seen = State.CLOSED
        self._retry_at: float | None = None
        self._listeners: tuple[Listener, ...] = ()
        self._fallback: MemoryBreakerHandle | None = None
        self._live = False  # the last answer came from Redis: the next local one is seeded anew
        self._members = 0  # processes sharing the breaker as Redis last counted them
        self._beat_at = -math.inf  # when this handle last had itself counted (caller's clock)

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x != listener)

    def retry_at(self) -> float | None:
        return self._retry_at

    def at_rest(self, now: float) -> bool:
        """Closed when last seen, its local fallback (if any) at rest: for a registry's eviction,
        read-only and without a round trip."""
        local = self._fallback
        return self._seen is State.CLOSED and (local is None or self._live or local.at_rest(now))

    def _call_args(self, op: str, success: bool, duration: float, now: float) -> list[str]:
        args = [op, *self._args, "1" if success else "0", repr(float(duration))]
        if now - self._beat_at >= HEARTBEAT:  # have this store counted as a member
            self._beat_at = now
            args += ["", self._store.member, self._store.member_expiry]
        return args

    def _observe(self, state: State, retry_at: float | None, moved: list[Transition],
                 now: float) -> None:
        """Remember what the shared (or local) breaker said; tell listeners what changed."""
        with self._lock:
            seen, self._seen, self._retry_at = self._seen, state, retry_at
        if not moved and state is not seen:
            # Another process moved the shared breaker; this one only sees the result.
            moved = [Transition(seen, state, now, "observed")]
        if moved:
            notify(self._listeners, self.target, moved)

    def _answer(self, reply: BreakerReply, now: float) -> bool:
        if reply.leased:
            count("breaker.probe-lease-expired")
        if reply.members:
            self._members = reply.members
        self._observe(reply.state, reply.retry_at, reply.transitions, now)
        self._live = True
        return reply.allowed

    def _local(self, now: float) -> MemoryBreakerHandle:
        """The local breaker for this fallback: seeded from the shared state last seen, on a 1/N
        share (``core.fallback``) the first time after an answer from Redis."""
        local = self._fallback
        if local is None or self._live:
            with self._lock:
                local = self._fallback
                if local is None or self._live:
                    local = self._fallback = self._seed(now)
                    self._live = False
        return local

    def _seed(self, now: float) -> MemoryBreakerHandle:
        """Under the lock: a local breaker as the shared one was last seen (``_seen``,
        ``_retry_at``: only a shared answer sets them before the first local one)."""
        fleet = fleet_size(self._members, self._store.fleet_size)
        local = MemoryBreakerHandle(self.target, breaker_share(self.policy, fleet))
        until = first_probe(self._seen, self._retry_at, now, self.policy.open_for, fleet,
                            random.random())
        if until is not None:
            local.hold_open(now, until)  # before the listener: the fleet's breaker was open
        if self._live:
            count("store.redis.fallback.seeded")
        local.add_listener(self._forward)
        return local

    def _forward(self, target: str, transition: Transition) -> None:
        local = self._fallback
        self._observe(transition.new, None if local is None else local.retry_at(), [transition],
                      transition.at)

    def _local_op(self, op: str, now: float, success: bool, duration: float) -> bool:
        local = self._local(now)
        allowed = False
        if op == "allow":
            allowed = local.allow(now)
        elif op == "record":
            local.record(now, success=success, duration=duration)
        elif op == "release":
            local.release(now)
        elif op == "force_open":
            local.force_open(now)
        elif op == "force_closed":
            local.force_closed(now)
        # Listeners see the move from the shared view to the local one as a change ("observed").
        self._observe(local.state(now), local.retry_at(), [], now)
        return allowed


class StoreBase:
    """Options, health and handle caches shared by ``RedisStore`` and ``AsyncRedisStore``."""

    def __init__(self, *, prefix: str, op_timeout: float, retry_after: float, ttl: float,
                 deposit_batch: int, clock: Callable[[], float], max_targets: int,
                 admission_refresh: float, fleet_size: int) -> None:
        check_options(prefix, op_timeout, retry_after, ttl, deposit_batch, admission_refresh,
                      fleet_size)
        if max_targets < 1:
            raise ValueError("max_targets must be at least 1")
        self.prefix = prefix
        self.clock = clock
        self.fleet_size = fleet_size
        self.member = os.urandom(8).hex()  # this store in the members sets (core.fallback's N)
        self.member_expiry = repr(MEMBER_EXPIRY)
        self.op_timeout = op_timeout
        self.ttl = ttl
        self.ttl_ms = int(ttl * 1000)
        self.deposit_batch = deposit_batch
        self.admission_refresh = admission_refresh
        self.health = Health(clock, retry_after)
        self._max = max_targets
        self._lock = threading.Lock()
        self._handles: OrderedDict[tuple[str, str, object], Any] = OrderedDict()

    def _handle(self, kind: str, target: str, policy: object, make: Callable[[], Any]) -> Any:
        key = (kind, target, policy)
        handle = self._handles.get(key)
        if handle is None:
            with self._lock:
                handle = self._handles.get(key)
                if handle is None:
                    handle = self._handles[key] = make()
                    if len(self._handles) > self._max:
                        self._handles.popitem(last=False)
                        count("store.redis.evicted")
        return handle


# --- the sync store -------------------------------------------------------------------------------


class RedisBucketHandle(BucketBase):
    """Satisfies ``stores.base.BucketHandle``; never raises for Redis' sake."""

    __slots__ = ()
    _store: RedisStore

    def deposit(self) -> None:
        if not self._store.health.usable():
            self._store.health.fallback("deposit")
            self._local().deposit()
            return
        n = self._count()
        if n:
            self._send(n, False, "deposit")

    def withdraw(self, now: float) -> bool:
        if not self._store.health.usable():
            self._store.health.fallback("withdraw")
            return self._to_local(self._take()).withdraw(now)
        granted = self._send(self._take(), True, "withdraw")
        return granted if granted is not None else self._local().withdraw(now)

    def tokens(self, now: float) -> float:
        """Tokens left (earned plus floor), flushing pending deposits.

        While Redis is away, the local bucket's tokens.
        """
        if self._store.health.usable():
            try:
                raw = self._store.bucket_script(keys=self._keys,
                                                args=self._args_for(self._take(), False))
                return self._heard(raw).tokens
            except Exception as exc:
                self._store.health.failed("tokens", exc)
        return self._local().tokens(now)

    def _send(self, n: int, take: bool, op: str) -> bool | None:
        store = self._store
        try:
            # An answer that does not read is Redis' failure, not the caller's.
            reply = self._heard(store.bucket_script(keys=self._keys, args=self._args_for(n, take)))
        except Exception as exc:
            store.health.failed(op, exc)
            store.health.fallback(op)
            self._to_local(n)
            return None
        store.health.succeeded()
        return reply.granted


class RedisBreakerHandle(BreakerBase):
    """Satisfies ``stores.base.BreakerHandle``.

    One breaker shared by every process naming the target.
    """

    __slots__ = ()
    _store: RedisStore

    def allow(self, now: float) -> bool:
        return self._run("allow", now)

    def record(self, now: float, *, success: bool, duration: float = 0.0) -> None:
        self._run("record", now, success, duration)

    def release(self, now: float) -> None:
        self._run("release", now)

    def state(self, now: float) -> State:
        self._run("state", now)
        return self._seen

    def force_open(self, now: float) -> None:
        self._run("force_open", now)

    def force_closed(self, now: float) -> None:
        self._run("force_closed", now)

    def _run(self, op: str, now: float, success: bool = True, duration: float = 0.0) -> bool:
        health = self._store.health
        if health.usable():
            try:
                raw = self._store.breaker_script(keys=self._keys,
                                                 args=self._call_args(op, success, duration,
                                                                      now))
                # An answer that does not read is Redis' failure, not the caller's.
                reply = BreakerReply(raw, now)
            except Exception as exc:
                health.failed(op, exc)
            else:
                health.succeeded()
                return self._answer(reply, now)
        health.fallback(op)
        return self._local_op(op, now, success, duration)


class RedisStore(StoreBase):
    """Fleet-wide buckets and breakers in Redis (sync client); satisfies ``stores.base.Store``.

    ``client_or_url``: a ``redis://`` URL (the store builds a client with ``op_timeout`` timeouts
    and no retries) or a ``redis.Redis`` you configured. ``clock`` is the caller's monotonic clock,
    used for the back-off and for local fallback state.
    """

    def __init__(self, client_or_url: str | redis.Redis | redis.RedisCluster, *,
                 prefix: str = "askonce",
                 op_timeout: float = 0.05, retry_after: float = 1.0, ttl: float = 3600.0,
                 deposit_batch: int = 32, clock: Callable[[], float] = _stats.monotonic,
                 max_targets: int = 4096, admission_refresh: float = 0.1,
                 fleet_size: int = 1) -> None:
        super().__init__(prefix=prefix, op_timeout=op_timeout, retry_after=retry_after, ttl=ttl,
                         deposit_batch=deposit_batch, clock=clock, max_targets=max_targets,
                         admission_refresh=admission_refresh, fleet_size=fleet_size)
        if isinstance(client_or_url, str):
            made: redis.Redis = pooled(redis, client_or_url, timeout=op_timeout,
                                 socket_timeout=op_timeout, socket_connect_timeout=op_timeout,
                                 retry=no_retry())
            client_or_url = made
        else:
            warn_if_retrying(client_or_url)
        self.client = client_or_url
        self.bucket_script = client_or_url.register_script(LUA_BUCKET)
        self.breaker_script = client_or_url.register_script(LUA_BREAKER)
        self.admission_script = client_or_url.register_script(LUA_ADMISSION)

    def bucket(self, target: str, policy: BucketPolicy) -> RedisBucketHandle:
        handle: RedisBucketHandle = self._handle("bucket", target, policy,
                                                 lambda: RedisBucketHandle(self, target, policy))
        return handle

    def breaker(self, target: str, policy: BreakerPolicy) -> RedisBreakerHandle:
        handle: RedisBreakerHandle = self._handle("breaker", target, policy,
                                                  lambda: RedisBreakerHandle(self, target, policy))
        return handle

    def admission(self, target: str, policy: AdmissionPolicy) -> RedisAdmissionHandle:
        """The target's adaptive admission, shared by every process naming it (see the module)."""
        handle: RedisAdmissionHandle = self._handle(
            "admission", target, policy, lambda: RedisAdmissionHandle(self, target, policy))
        return handle

    def close(self) -> None:
        self.client.close()
