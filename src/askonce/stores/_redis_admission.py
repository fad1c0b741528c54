"""Adaptive admission shared by a fleet through Redis (``core.admission``, ``LUA_ADMISSION``).

The loop calls ``admit`` and ``record`` in place, synchronously, in the async shells too, so a call
must not wait for Redis on its fast path. Each handle therefore keeps:

* a local controller (``stores.memory.AdmissionHandle``) fed with every attempt and verdict: the
  fallback's history, so that it decides at once when Redis goes away;
* the deltas (requests, calls, successes) not yet sent, added to the fleet's current second at the
  next sync (so they land up to ``admission_refresh`` seconds late, on the server's clock);
* the fleet's view from the last sync: its reject probability and window counters.

A call decides with the fleet's probability. Once the view is ``admission_refresh`` seconds old,
the next ``admit`` syncs: the sync store inline (one script call, bounded by ``op_timeout``; other
threads meanwhile decide with the view they have), the asyncio store in a background task (that
call decides with the view it has). Without a view, or with one older than
``10 * admission_refresh``, the local controller decides (``store.redis.admission.stale``).
While Redis is unusable the local controller decides (``store.redis.fallback.admit``): the first
time after a sync that answered, it is replaced by one seeded with the fleet's window as last
synced (its requests, calls and successes, plus this handle's unsent deltas, counted in the
current second: they age out one window later; ``store.redis.fallback.seeded``), so it decides
with the fleet's recent success ratio rather than this process's alone. Deltas
are not kept for later (they would land in the wrong second; the local controller has them), and
deltas a failed sync carried are counted as ``store.redis.admission.unsent`` (the script may or
may not have run: they are not sent again, so never counted twice).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Awaitable
from typing import Any, Protocol

from askonce._stats import count
from askonce.core.admission import AdmissionPolicy
from askonce.stores._redis_lua import AdmissionReply, admission_args, policy_digest, target_tag
from askonce.stores.memory import AdmissionHandle as LocalAdmission

__all__ = ["AdmissionBase", "AsyncRedisAdmissionHandle", "RedisAdmissionHandle"]

_STALE = 10  # refresh intervals after which a view is not trusted


class _Health(Protocol):
    def usable(self) -> bool: ...

    def failed(self, op: str, exc: BaseException) -> None: ...

    def fallback(self, op: str) -> None: ...

    def succeeded(self) -> None: ...


class _Store(Protocol):
    """What a handle needs of ``stores.redis.StoreBase``."""

    @property
    def prefix(self) -> str: ...

    @property
    def ttl(self) -> float: ...

    @property
    def admission_refresh(self) -> float: ...

    @property
    def health(self) -> _Health: ...

    @property
    def admission_script(self) -> Any: ...


class AdmissionBase:
    """The parts the sync and asyncio handles share; see the module."""

    __slots__ = ("_args", "_keys", "_live", "_local", "_lock", "_pending", "_store", "_synced_at",
                 "_syncing", "_syncing_since", "_view", "policy", "target")

    def __init__(self, store: _Store, target: str, policy: AdmissionPolicy) -> None:
        self._store = store
        self.target = target
        self.policy = policy
        self._keys = [f"{target_tag(store.prefix, target)}:admission:{policy_digest(policy)}"]
        self._args = admission_args(policy, store.ttl)
        self._local = LocalAdmission(target, policy)
        self._lock = threading.Lock()
        self._pending = [0, 0, 0]  # requests, calls, successes not yet sent
        self._view: AdmissionReply | None = None
        self._synced_at = -math.inf  # the caller's clock
        self._syncing = False
        self._syncing_since = -math.inf  # when the sync in flight started (the caller's clock)
        self._live = False  # the last sync answered: the next fallback is seeded anew

    def _seed(self, now: float, unsent: list[int]) -> None:
        """Once per fallback: a local controller seeded with the fleet's window last synced."""
        with self._lock:
            view, live, self._live = self._view, self._live, False
            if not live or view is None or now - self._synced_at >= self.policy.window:
                return
            local = LocalAdmission(self.target, self.policy)
            local.add(now, view.requests + unsent[0], view.calls + unsent[1],
                      view.successes + unsent[2])
            self._local = local
        count("store.redis.fallback.seeded")

    def admit(self, now: float, u: float) -> bool:
        if self._live and not self._store.health.usable():
            self._seed(now, self._pending)
        local = self._local
        admitted = local.admit(now, u)  # validates now and u before anything is counted
        if not self._store.health.usable():
            self._store.health.fallback("admit")
            return admitted
        with self._lock:
            self._pending[0] += 1
            # A sync in flight for longer than a stale view lasts never reported (its task was
            # cancelled, or its loop closed before it ran): another may start.
            free = (not self._syncing
                    or now - self._syncing_since >= _STALE * self._store.admission_refresh)
            due = free and now - self._synced_at >= self._store.admission_refresh
            if due:
                self._syncing, self._syncing_since = True, now
        view = self._sync(now) if due else self._view
        if not self._store.health.usable():  # the sync just failed
            self._store.health.fallback("admit")
            if self._local is not local:  # seeded with the fleet's window, this attempt in it
                return not u < self._local.reject_probability(now)
            return admitted
        if view is None or now - self._synced_at >= _STALE * self._store.admission_refresh:
            count("store.redis.admission.stale")  # no recent view yet (asyncio: syncing)
            return admitted
        return not u < view.p

    def record(self, now: float, *, success: bool) -> None:
        if self._live and not self._store.health.usable():
            self._seed(now, self._pending)
        self._local.record(now, success=success)
        if not self._store.health.usable():
            self._store.health.fallback("admission-record")
            return
        with self._lock:
            self._pending[1] += 1
            if success:
                self._pending[2] += 1

    def reject_probability(self, now: float) -> float:
        """The fleet's as last synced, or the local controller's while that is not usable."""
        view = self._view
        if view is None or not self._store.health.usable():
            return self._local.reject_probability(now)
        return view.p

    def snapshot(self) -> dict[str, object]:
        """The fleet's window as last synced (``None`` before) and the local controller's."""
        view = self._view
        shared = None if view is None else {
            "requests": view.requests, "calls": view.calls, "successes": view.successes,
            "reject_probability": view.p}
        return {"shared": shared, "local": self._local.snapshot()}

    def at_rest(self, now: float) -> bool:
        return self._local.at_rest(now)

    def _sync(self, now: float) -> AdmissionReply | None:
        raise NotImplementedError

    def _take(self) -> list[str]:
        with self._lock:
            deltas, self._pending = self._pending, [0, 0, 0]
        return [*self._args, *map(str, deltas)]

    def _settle(self, now: float, raw: Any, args: list[str]) -> AdmissionReply | None:
        """Read a script's answer (``raw``), or an exception it raised; the view to decide with."""
        view: AdmissionReply | None = None
        failure = raw if isinstance(raw, BaseException) else None
        if failure is None:
            try:
                view = AdmissionReply(raw)
            except Exception as exc:  # an answer that does not read is Redis' failure
                failure = exc
        if failure is not None:
            self._store.health.failed("admission", failure)
            deltas = [int(x) for x in args[-3:]]
            if sum(deltas):
                count("store.redis.admission.unsent", sum(deltas))
            self._seed(now, deltas)
        else:
            self._store.health.succeeded()
        with self._lock:
            self._view, self._syncing = view, False
            if view is not None:
                self._synced_at = now
                self._live = True
        return view


class RedisAdmissionHandle(AdmissionBase):
    """Satisfies ``stores.base.AdmissionHandle``; a due sync runs inline (bounded by
    ``op_timeout``)."""

    __slots__ = ()

    def _sync(self, now: float) -> AdmissionReply | None:
        args = self._take()
        try:
            raw: Any = self._store.admission_script(keys=self._keys, args=args)
        except Exception as exc:
            raw = exc
        except BaseException:  # interrupted (a gevent timeout, Ctrl-C): the next call syncs
            with self._lock:
                self._syncing = False
            raise
        return self._settle(now, raw, args)


class _AsyncStore(_Store, Protocol):
    def run(self, call: Awaitable[Any]) -> Awaitable[Any]: ...

    def spawn(self, loop: asyncio.AbstractEventLoop, call: Awaitable[Any]) -> None: ...


class AsyncRedisAdmissionHandle(AdmissionBase):
    """Satisfies ``stores.base.AdmissionHandle`` for the asyncio store: a due sync runs in a
    background task on the running loop, and the call decides with the view it has."""

    __slots__ = ()
    _store: _AsyncStore

    def _sync(self, now: float) -> AdmissionReply | None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to sync on: the deltas wait for a call that has one
            with self._lock:
                self._syncing = False
            return self._view
        args = self._take()
        self._store.spawn(loop, self._go(now, args))
        return self._view

    async def _go(self, now: float, args: list[str]) -> None:
        store = self._store
        try:
            raw: Any = await store.run(store.admission_script(keys=self._keys, args=args))
        except Exception as exc:
            raw = exc
        except BaseException:  # cancelled: the next admit syncs again
            with self._lock:
                self._syncing = False
            raise
        self._settle(now, raw, args)
