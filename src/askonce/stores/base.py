"""The state-store interface: where per-target retry buckets, circuit breakers and admission live.

A store hands out *handles* per target. Handles of the in-memory store are process-local; those of
the Redis store are shared by every process that names the same target. The retry shells and
integrations only ever talk to these protocols, so swapping the store changes nothing else.

``now`` is the caller's monotonic clock. A store that shares state across hosts may use its own
clock instead (Redis ``TIME``), since monotonic clocks of different processes do not agree; handles
say so.

A store must never let its own failure reach user code: a shared store that cannot answer within its
time bound falls back to local state and counts the fallback (``askonce.stats()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

# Annotations only: users of buckets alone never need the breaker module, slow to import.
if TYPE_CHECKING:
    from askonce.core.admission import AdmissionPolicy
    from askonce.core.breaker import BreakerPolicy, State
    from askonce.core.bucket import BucketPolicy


class BucketHandle(Protocol):
    def deposit(self) -> None:
        """Count one request (a first attempt) toward the target's earned retry tokens."""

    def withdraw(self, now: float) -> bool:
        """Take one retry token, if there is one."""


class BreakerHandle(Protocol):
    def allow(self, now: float) -> bool:
        """May a call to the target start now?"""

    def record(self, now: float, *, success: bool, duration: float = 0.0) -> None:
        """The outcome of a call that ``allow`` let through."""

    def release(self, now: float) -> None:
        """A call that was let through ended with no verdict (cancelled, the client's own 4xx)."""

    def retry_at(self) -> float | None:
        """While open: when a probe will be let through (on the caller's clock)."""

    def state(self, now: float) -> State: ...


class AdmissionHandle(Protocol):
    """One target's adaptive admission (``core.admission``), called in place by the loop: in memory
    and cheap, so synchronous in the async shells too. The memory store's is process-local; the
    Redis stores' is shared by the fleet and syncs with it every ``admission_refresh`` seconds,
    deciding locally in between."""

    def admit(self, now: float, u: float) -> bool:
        """Count an attempt and decide it (refused when the draw ``u`` in [0, 1) says so)."""

    def record(self, now: float, *, success: bool) -> None:
        """The verdict on an attempt that ``admit`` let through and that was made."""


class Store(Protocol):
    def bucket(self, target: str, policy: BucketPolicy) -> BucketHandle: ...

    def breaker(self, target: str, policy: BreakerPolicy) -> BreakerHandle: ...

    def admission(self, target: str, policy: AdmissionPolicy) -> AdmissionHandle: ...


class AsyncBucketHandle(Protocol):
    def deposit(self) -> None: ...

    async def withdraw(self, now: float) -> bool: ...


class AsyncBreakerHandle(Protocol):
    async def allow(self, now: float) -> bool: ...

    async def record(self, now: float, *, success: bool, duration: float = 0.0) -> None: ...

    async def release(self, now: float) -> None: ...

    def retry_at(self) -> float | None: ...

    async def state(self, now: float) -> State: ...


class AsyncStore(Protocol):
    def bucket(self, target: str, policy: BucketPolicy) -> AsyncBucketHandle: ...

    def breaker(self, target: str, policy: BreakerPolicy) -> AsyncBreakerHandle: ...

    def admission(self, target: str, policy: AdmissionPolicy) -> AdmissionHandle: ...
