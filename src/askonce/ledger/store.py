"""Shells around the core ledger: thread-safe in memory, and in Redis so that a target's replicas
share one count.

:class:`MemoryLedger` is a :class:`~askonce.core.ledger.Ledger` behind a lock. :class:`RedisLedger`
keeps one too (this replica's view, and the cap's fallback) and also appends every arrival to a
bounded buffer that a background thread aggregates and writes to Redis (``flush_interval``, or
sooner once ``batch`` arrivals wait), so the request path does no I/O unless a cap is set. Both
expose exactly what the server integrations call:
``record(now, operation, *, key, edge, origin, path, principal, malformed) -> bool`` and
``report(now)``; ``now`` is wall-clock seconds so that replicas agree on windows.

What lives in Redis (see :mod:`askonce.ledger._redis` for the key layout and the scripts): per
window and operation, counters, a hash of arrivals per (principal, key), a hash of arrivals per
(key, path), a HyperLogLog (PFADD/PFCOUNT) of the attributable keys beyond the exact bound, and the
retries per layer and re-mints per origin; every key has a TTL of ``windows_kept + 2`` windows and
all the keys of one window share one hash tag. :meth:`RedisLedger.report` reads them back and
summarises them with the core, so figures mean exactly what they mean in memory; they lag the other
replicas by at most a flush.

The cap across replicas is exact: with a cap set, each keyed arrival increments its (operation,
principal, key, window) count in one Lua script on the request path (client timeouts ``op_timeout``,
50 ms) and the answer decides. If Redis fails or times out, Redis is left alone for ``retry_after``
seconds and the local ledger's cap decides instead: a per-replica cap, so a fleet of N replicas
admits up to N times the cap for a key while Redis is away (``ledger.redis.cap-fallback`` counts
those calls).

Redis down: arrivals wait in the buffer up to ``max_buffer``; what does not fit is dropped and
counted (``Ledger.note_dropped`` on the local ledger, ``askonce.stats()``
``ledger.redis.dropped.<reason>``, and in Redis' shared ``dropped`` once it is back), so the report
shows the loss instead of hiding it.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from askonce import _stats
from askonce.core import is_int
from askonce.core.ledger import Ledger, LedgerPolicy, Report, window_index
from askonce.ledger import _redis as lr
from askonce.ledger._redis import COUNTED, MAX_SEQ, REFUSED, SEQ_SHIFT, UNCERTAIN

if TYPE_CHECKING:
    import redis

__all__ = ["LedgerShell", "LedgerUnavailable", "MemoryLedger", "RedisLedger", "read_report"]

log = logging.getLogger("askonce.ledger")
Path = tuple[tuple[str, int], ...]


class LedgerShell(Protocol):
    """What a server integration and the report publishers use: thread-safe ``record`` and
    ``report``."""

    def record(self, now: float, operation: str, *, key: str | None, edge: bool = False,
               origin: str | None = None, path: Path = (), principal: str = "",
               malformed: bool = False) -> bool: ...

    def report(self, now: float) -> Report: ...


class MemoryLedger:
    """A core :class:`Ledger` behind a lock: safe to record from many threads and report from
    another."""

    thread_safe = True  # integrations may skip a lock of their own
    __slots__ = ("_lock", "_record", "ledger", "policy")

    def __init__(self, policy: LedgerPolicy = LedgerPolicy()) -> None:
        self.policy = policy
        self.ledger = Ledger(policy)
        self._lock = threading.Lock()
        self._record = self.ledger.record

    def record(self, now: float, operation: str, *, key: str | None, edge: bool = False,
               origin: str | None = None, path: Path = (), principal: str = "",
               malformed: bool = False) -> bool:
        with self._lock:
            return self._record(now, operation, key=key, edge=edge, origin=origin, path=path,
                                principal=principal, malformed=malformed)

    def report(self, now: float) -> Report:
        with self._lock:
            return self.ledger.report(now)

    def joined(self, at: float, operation: str, *, edge: bool) -> None:
        """An arrival recorded at ``at`` answered by a run it did not start
        (:meth:`Ledger.joined`)."""
        with self._lock:
            self.ledger.joined(at, operation, edge=edge)

    def note_dropped(self, n: int, reason: str) -> None:
        with self._lock:
            self.ledger.note_dropped(n, reason)

    def merge(self, other: Ledger | MemoryLedger) -> None:
        """Fold another replica's counts in (see :meth:`Ledger.merge`)."""
        if isinstance(other, MemoryLedger):
            with other._lock:
                snapshot = Ledger(other.policy)
                snapshot.merge(other.ledger)
            other = snapshot
        with self._lock:
            self.ledger.merge(other)


class LedgerUnavailable(ConnectionError):
    """The shared figures could not be read from Redis (``RedisLedger.local_report`` still
    works)."""


Arrival = tuple[float, str, "str | None", bool, "str | None", Path, str, bool, int]


class _Health:
    """Is Redis to be asked now, or left alone for ``retry_after`` seconds after a failure?"""

    def __init__(self, clock: Callable[[], float], retry_after: float) -> None:
        self._clock = clock
        self._retry_after = retry_after
        self.down_until: float | None = None

    def usable(self) -> bool:
        down = self.down_until
        return down is None or self._clock() >= down

    def failed(self, what: str, exc: BaseException) -> None:
        from askonce.stores.redis import error_reason

        _stats.count(f"ledger.redis.error.{error_reason(exc)}")
        first = self.down_until is None
        self.down_until = self._clock() + self._retry_after
        if first:
            _stats.count("ledger.redis.down")
            log.warning("askonce: ledger cannot reach Redis (%s: %r); buffering, local cap",
                        what, exc)

    def succeeded(self) -> None:
        if self.down_until is not None:
            self.down_until = None
            _stats.count("ledger.redis.resumed")
            log.warning("askonce: ledger reaches Redis again")


class RedisLedger:
    """A ledger shared by every replica of a target through Redis; see the module docstring.

    ``client_or_url``: a ``redis://`` URL (two clients are made: one with ``op_timeout`` for the
    request path, one with ``read_timeout`` for flushes and reports, both without client retries) or
    a ``redis.Redis`` used for both (give it timeouts). ``clock`` is monotonic, for the back-off
    only. ``start=False`` runs no flusher thread: call :meth:`flush` yourself. ``local=False`` (only
    without a cap) keeps no local ledger: :meth:`record` is then an append to the buffer, and
    :meth:`local_report` shows only what was dropped. ``replicas``: a flush counts as done only
    once that many replicas acknowledged it within ``replica_wait`` seconds (``WAIT``), else it is
    sent again (``ledger.redis.not-replicated``): a failover then loses no flushed arrival, and
    none is counted twice (the done-markers). A ``redis.cluster.RedisCluster`` works too: flushes
    and reports go one command at a time, each to its slot's node.
    """

    thread_safe = True

    def __init__(self, client_or_url: str | redis.Redis | redis.RedisCluster, *,
                 policy: LedgerPolicy = LedgerPolicy(),
                 prefix: str = "askonce", op_timeout: float = 0.05, read_timeout: float = 2.0,
                 retry_after: float = 1.0, flush_interval: float = 0.25, batch: int = 4096,
                 max_buffer: int = 100_000, clock: Callable[[], float] = time.monotonic,
                 start: bool = True, local: bool = True, replicas: int = 0,
                 replica_wait: float = 0.1) -> None:
        lr.check_prefix(prefix)
        if not local and policy.cap is not None:
            raise ValueError(
                "a capped RedisLedger needs its local ledger: it is the cap's fallback")
        for name, value, low, high in (("op_timeout", op_timeout, 0.001, 60.0),
                                       ("read_timeout", read_timeout, 0.001, 600.0),
                                       ("retry_after", retry_after, 0.0, 3600.0),
                                       ("flush_interval", flush_interval, 0.001, 3600.0),
                                       ("replica_wait", replica_wait, 0.001, 60.0)):
            if not (isinstance(value, int | float) and low <= value <= high):
                raise ValueError(f"{name} must be within {low}..{high} seconds, got {value!r}")
        for name, n in (("batch", batch), ("max_buffer", max_buffer)):
            if not is_int(n) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        if not is_int(replicas) or not 0 <= replicas <= 16:
            raise ValueError(f"replicas must be an int within 0..16, got {replicas!r}")
        self._replicas = replicas
        self._replica_wait_ms = max(1, int(replica_wait * 1000))
        self.policy = policy
        self.local = MemoryLedger(policy)
        self.space = lr.Space(prefix, policy)
        self.client: redis.Redis | redis.RedisCluster
        self.reader: redis.Redis | redis.RedisCluster
        if isinstance(client_or_url, str):
            self.client, self.reader = lr.clients(client_or_url, op_timeout, read_timeout)
        else:
            self.client = self.reader = client_or_url
        self._cap_script = self.client.register_script(lr.LUA_CAP)
        # This replica's capped arrivals are numbered per window, so that one whose cap call
        # failed is counted once (see ``_redis``'s seen bitmap).
        self._replica = uuid.uuid4().hex[:16]
        self._seqs: dict[int, itertools.count[int]] = {}
        self._writer = lr.Writer(self.space, self.reader, self._replica)
        self._health = _Health(clock, retry_after)
        self._cap = policy.cap
        self._lock = self.local._lock  # one lock for the local ledger and the buffer
        # Without a cap the local ledger only serves local_report(); local=False makes record() an
        # append.
        self._local_record = self.local._record if local else None
        self._flush_lock = threading.Lock()  # one flush at a time
        self._seq_lock = threading.Lock()
        self._buffer: list[Arrival] = []
        self._held: list[lr.Call] = []  # calls Redis did not take, sent again with the next flush
        self._held_n = 0  # the arrivals they carry
        self._unsent_dropped: dict[str, int] = {}
        self._batch = batch
        self._max_buffer = max_buffer
        self._interval = flush_interval
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="askonce-ledger-flush",
                                            daemon=True)
            self._thread.start()

    # --- the request path -------------------------------------------------------------------------

    def record(self, now: float, operation: str, *, key: str | None, edge: bool = False,
               origin: str | None = None, path: Path = (), principal: str = "",
               malformed: bool = False) -> bool:
        """Count one arrival; with a cap, False if it is over the cap (answered by Redis, else
        locally)."""
        flag = -1
        if self._cap is not None and key is not None and not malformed:
            index = window_index(now, self.policy.window)  # ValueError for a time no window holds
            # I/O: before the lock, never under it.
            flag = self._capped(index, operation, key, edge, principal)
        local = self._local_record
        if local is None and not math.isfinite(now):  # the local ledger would have said so
            raise ValueError(f"ledger time must be a finite number of seconds, got {now!r}")
        with self._lock:
            allowed = True if local is None else local(now, operation, key=key, edge=edge,
                                                       origin=origin, path=path,
                                                       principal=principal, malformed=malformed)
            if flag < 0:  # the local ledger decided; a cap call that may have run stays marked
                flag = (-flag if flag < -1 else 0) | (0 if allowed else REFUSED)
            else:
                allowed = not flag & REFUSED
            buffer = self._buffer
            if len(buffer) + self._held_n < self._max_buffer:
                buffer.append((now, operation, key, edge, origin, path, principal, malformed, flag))
                if len(buffer) == self._batch:
                    self._wake.set()
            else:
                self._drop_locked(1, "buffer-full")
        return allowed

    def _capped(self, index: int, operation: str, key: str, edge: bool, principal: str) -> int:
        """The Redis cap's verdict as buffer flags, or a negative number for the local ledger to
        decide: -1, or ``-(UNCERTAIN | seq << SEQ_SHIFT)`` when the script may have run."""
        health = self._health
        if health.usable():
            seq = self._seq(index)
            keys, args = self.space.cap_call(index, operation, edge, principal, key,
                                             self._replica, seq)
            try:
                n = int(self._cap_script(keys=keys, args=args))
            except Exception as exc:
                health.failed("cap", exc)
                _stats.count("ledger.redis.cap-fallback")
                # It may have run (a lost reply): the flush counts it unless the script had.
                return -1 if seq < 0 else -(UNCERTAIN | seq << SEQ_SHIFT)
            health.succeeded()
            if n == 0:  # beyond the exact bound in Redis: counted (and not capped) at the flush
                return 0
            if n < 0:  # a flush counted it first (this call's reply was late): not refused
                return COUNTED
            assert self._cap is not None
            return COUNTED | (REFUSED if n > self._cap else 0)
        _stats.count("ledger.redis.cap-fallback")
        return -1

    def _seq(self, index: int) -> int:
        """The next sequence number of this replica's capped arrivals in window ``index``; -1 (an
        unguarded call) past ``MAX_SEQ``."""
        counter = self._seqs.get(index)
        if counter is None:
            with self._seq_lock:
                counter = self._seqs.get(index)
                if counter is None:
                    counter = self._seqs[index] = itertools.count()
                    for old in [i for i in self._seqs if i < index - 2]:  # bounded: recent only
                        del self._seqs[old]
        seq = next(counter)
        if seq >= MAX_SEQ:
            _stats.count("ledger.redis.cap-unguarded")
            return -1
        return seq

    def _drop_locked(self, n: int, reason: str) -> None:
        self.local.ledger.note_dropped(n, reason)
        self._unsent_dropped[reason] = self._unsent_dropped.get(reason, 0) + n
        _stats.count(f"ledger.redis.dropped.{reason}", n)

    def note_dropped(self, n: int, reason: str) -> None:
        """Count arrivals lost before :meth:`record` (shown locally, and shared at the next
        flush)."""
        with self._lock:
            self._drop_locked(n, reason)

    # --- flushing ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # the flusher must outlive a bug anywhere in one flush
                _stats.count("ledger.redis.flush-error")
                log.exception("askonce: ledger flush failed")

    def flush(self) -> bool:
        """Send the buffered arrivals now; False if Redis did not take them (they stay buffered)."""
        with self._flush_lock:
            with self._lock:
                batch, self._buffer = self._buffer, []
                self._held_n += len(batch)  # in flight: still takes room until Redis has it
            try:
                calls, expired, invalid = self._writer.prepare(batch)
            # A bug, not bad input (prepare counts that): lose this batch visibly, go on.
            except Exception:
                log.exception("askonce: ledger flush could not prepare %d arrivals", len(batch))
                with self._lock:
                    self._held_n -= len(batch)
                    self._drop_locked(len(batch), "flush-error")
                return False
            if expired:  # as the core forgets windows older than windows_kept: not a loss
                _stats.count("ledger.redis.expired", expired)
            with self._lock:
                if invalid:
                    self._drop_locked(invalid, "invalid")
                dropped, self._unsent_dropped = self._unsent_dropped, {}
            if dropped:
                if any(call[0] == "dropped" for call in self._held):
                    # One held drop count at a time: a call per flush would grow for as long as
                    # Redis is away. The held one cannot take more (it may have run already):
                    # these wait their turn.
                    with self._lock:
                        for reason, n in dropped.items():
                            self._unsent_dropped[reason] = self._unsent_dropped.get(reason, 0) + n
                else:
                    calls.append(self._writer.dropped_call(dropped))
            calls = self._held + calls
            if not calls:
                with self._lock:
                    self._held_n = 0
                return True
            if self._health.usable():
                try:
                    self._writer.send(calls, self._replicas, self._replica_wait_ms)
                except Exception as exc:
                    if isinstance(exc, lr.NotReplicated):
                        _stats.count("ledger.redis.not-replicated")
                    self._health.failed("flush", exc)
                else:
                    self._health.succeeded()
                    with self._lock:
                        self._held, self._held_n = [], 0
                    return True
            # Kept whole (chunk ids and all), so a late success is not counted twice.
            with self._lock:
                self._held, self._held_n = calls, sum(c[3] for c in calls)
            return False

    def close(self, timeout: float = 5.0) -> None:
        """Stop the flusher after a last flush (bounded by ``timeout`` and the client timeouts)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.flush()

    def __enter__(self) -> RedisLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reports ----------------------------------------------------------------------------------

    def report(self, now: float) -> Report:
        """The figures of every replica, read from Redis after flushing this one's buffer.

        Raises :class:`LedgerUnavailable` if Redis cannot be read (:meth:`local_report` still
        answers).
        """
        self.flush()
        return read_report(self.reader, now, prefix=self.space.prefix, policy=self.policy)

    def local_report(self, now: float) -> Report:
        """This replica's own figures, with what it dropped (also those Redis has not heard of
        yet)."""
        return self.local.report(now)

    @property
    def buffered(self) -> int:
        """Arrivals waiting to be sent (including a batch Redis did not take)."""
        return len(self._buffer) + self._held_n


def read_report(client: redis.Redis | redis.RedisCluster, now: float, *, prefix: str = "askonce",
                policy: LedgerPolicy | None = None) -> Report:
    """The shared figures under ``prefix`` at wall-clock ``now``. Without ``policy``, the one the
    replicas published (window and bounds); raises :class:`LedgerUnavailable` if Redis cannot be
    read."""
    try:
        return lr.read(client, now, prefix, policy)
    except LookupError:
        raise
    except Exception as exc:
        _stats.count("ledger.redis.report-error")
        raise LedgerUnavailable(f"cannot read the shared ledger from Redis: {exc!r}") from exc
