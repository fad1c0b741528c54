"""The Redis store for asyncio (``redis.asyncio``): scripts, keys and fallback as ``stores.redis``.

Satisfies ``stores.base.AsyncStore``. Every Redis call is bounded by
``asyncio.timeout(op_timeout)`` as well as by the client's own timeouts, so even a client you
configured yourself cannot hold a caller for longer than ``op_timeout`` before the local fallback
answers. A cancelled caller is never swallowed: only ``Exception`` is turned into a fallback,
``CancelledError`` propagates.

``deposit()`` stays synchronous (it is on the first-attempt path and must not await): deposits are
counted locally and sent with the next ``withdraw``, or by a background task once ``deposit_batch``
of them have piled up while a loop is running. Admission handles sync with the fleet in such
background tasks too (their ``admit`` is synchronous: ``stores._redis_admission``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from askonce import _stats
from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy, State
from askonce.core.bucket import BucketPolicy
from askonce.stores._pool import kept_cancel, pooled
from askonce.stores._redis_admission import AsyncRedisAdmissionHandle
from askonce.stores._redis_lua import LUA_ADMISSION, LUA_BREAKER, LUA_BUCKET, BreakerReply
from askonce.stores.redis import BreakerBase, BucketBase, StoreBase, no_retry, warn_if_retrying

__all__ = ["AsyncRedisAdmissionHandle", "AsyncRedisBreakerHandle", "AsyncRedisBucketHandle",
           "AsyncRedisStore"]


class AsyncRedisBucketHandle(BucketBase):
    """Satisfies ``stores.base.AsyncBucketHandle``; never raises for Redis' sake."""

    __slots__ = ()
    _store: AsyncRedisStore

    def deposit(self) -> None:
        store = self._store
        if not store.health.usable():
            store.health.fallback("deposit")
            self._local().deposit()
            return
        n = self._count()
        if n:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: give the batch back, the next withdraw sends it
                with self._lock:
                    self._pending += n
                return
            store.spawn(loop, self._send(n, False, "deposit"))

    async def withdraw(self, now: float) -> bool:
        store = self._store
        if not store.health.usable():
            store.health.fallback("withdraw")
            return self._to_local(self._take()).withdraw(now)
        granted = await self._send(self._take(), True, "withdraw")
        return granted if granted is not None else self._local().withdraw(now)

    async def tokens(self, now: float) -> float:
        store = self._store
        if store.health.usable():
            try:
                raw = await store.run(store.bucket_script(
                    keys=self._keys, args=self._args_for(self._take(), False)))
                return self._heard(raw).tokens
            except Exception as exc:
                store.health.failed("tokens", exc)
        return self._local().tokens(now)

    async def _send(self, n: int, take: bool, op: str) -> bool | None:
        store = self._store
        try:
            raw = await store.run(store.bucket_script(keys=self._keys,
                                                      args=self._args_for(n, take)))
            reply = self._heard(raw)  # an answer that does not read is Redis' failure
        except Exception as exc:
            store.health.failed(op, exc)
            store.health.fallback(op)
            self._to_local(n)
            return None
        store.health.succeeded()
        return reply.granted


class AsyncRedisBreakerHandle(BreakerBase):
    """Satisfies ``stores.base.AsyncBreakerHandle``.

    One breaker shared by every process naming the target.
    """

    __slots__ = ()
    _store: AsyncRedisStore

    async def allow(self, now: float) -> bool:
        return await self._run("allow", now)

    async def record(self, now: float, *, success: bool, duration: float = 0.0) -> None:
        await self._run("record", now, success, duration)

    async def release(self, now: float) -> None:
        await self._run("release", now)

    async def state(self, now: float) -> State:
        await self._run("state", now)
        return self._seen

    async def force_open(self, now: float) -> None:
        await self._run("force_open", now)

    async def force_closed(self, now: float) -> None:
        await self._run("force_closed", now)

    async def _run(self, op: str, now: float, success: bool = True, duration: float = 0.0) -> bool:
        store = self._store
        health = store.health
        if health.usable():
            try:
                raw = await store.run(store.breaker_script(
                    keys=self._keys, args=self._call_args(op, success, duration, now)))
                # An answer that does not read is Redis' failure, not the caller's.
                reply = BreakerReply(raw, now)
            except Exception as exc:
                health.failed(op, exc)
            else:
                health.succeeded()
                return self._answer(reply, now)
        health.fallback(op)
        return self._local_op(op, now, success, duration)


class AsyncRedisStore(StoreBase):
    """Fleet-wide buckets and breakers in Redis, asyncio client; see ``stores.redis.RedisStore``."""

    def __init__(self, client_or_url: str | aioredis.Redis | aioredis.RedisCluster, *,
                 prefix: str = "askonce",
                 op_timeout: float = 0.05, retry_after: float = 1.0, ttl: float = 3600.0,
                 deposit_batch: int = 32, clock: Callable[[], float] = _stats.monotonic,
                 max_targets: int = 4096, admission_refresh: float = 0.1,
                 fleet_size: int = 1) -> None:
        super().__init__(prefix=prefix, op_timeout=op_timeout, retry_after=retry_after, ttl=ttl,
                         deposit_batch=deposit_batch, clock=clock, max_targets=max_targets,
                         admission_refresh=admission_refresh, fleet_size=fleet_size)
        if isinstance(client_or_url, str):
            made: aioredis.Redis = pooled(aioredis, client_or_url, timeout=op_timeout,
                                 socket_timeout=op_timeout, socket_connect_timeout=op_timeout,
                                 retry=no_retry())
            client_or_url = made
        else:
            warn_if_retrying(client_or_url)
        self.client = client_or_url
        self.bucket_script = client_or_url.register_script(LUA_BUCKET)
        self.breaker_script = client_or_url.register_script(LUA_BREAKER)
        self.admission_script = client_or_url.register_script(LUA_ADMISSION)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, call: Awaitable[Any]) -> Any:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of a call that
        # finished as the task was cancelled, swallowing the cancellation; redis-py's own
        # wait_for can, so kept_cancel raises what it swallowed.
        async with asyncio.timeout(self.op_timeout):
            return await kept_cancel(call)

    def spawn(self, loop: asyncio.AbstractEventLoop, call: Awaitable[Any]) -> None:
        async def go() -> None:
            await call

        task = loop.create_task(go())
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    def bucket(self, target: str, policy: BucketPolicy) -> AsyncRedisBucketHandle:
        handle: AsyncRedisBucketHandle = self._handle(
            "bucket", target, policy, lambda: AsyncRedisBucketHandle(self, target, policy))
        return handle

    def breaker(self, target: str, policy: BreakerPolicy) -> AsyncRedisBreakerHandle:
        handle: AsyncRedisBreakerHandle = self._handle(
            "breaker", target, policy, lambda: AsyncRedisBreakerHandle(self, target, policy))
        return handle

    def admission(self, target: str, policy: AdmissionPolicy) -> AsyncRedisAdmissionHandle:
        """The target's adaptive admission, shared by the fleet; it syncs in background tasks
        (``stores._redis_admission``)."""
        handle: AsyncRedisAdmissionHandle = self._handle(
            "admission", target, policy, lambda: AsyncRedisAdmissionHandle(self, target, policy))
        return handle

    async def aclose(self) -> None:
        """Wait for deposit flushes in flight, then close the client."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()
