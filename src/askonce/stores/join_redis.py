"""Joins shared by a fleet of replicas: a question runs once whichever replica it reaches.

``RedisJoinStore(url)`` is given to ``JoinASGIMiddleware(store=...)`` or
``JoinWSGIMiddleware(store=...)``. Per question (principal, operation, key) three Redis keys,
hash-tagged into one Cluster slot: ``lease`` (who runs it, with the request's digest),
``answer`` (the kept answer, with its digest, for the policy's ``ttl``) and ``done`` (a one-item
list the holder pushes its answer onto when it finishes, for the waiters).

* An arrival is one Lua script (``LUA_ARRIVE``): a kept answer is replayed; a live lease makes it
  wait; otherwise it takes the lease (``SET ... PX lease``) and runs. The same key with another
  digest conflicts (422), whether the question is running or answered.
* The holder renews its lease every third of ``lease`` seconds (one thread per store renews all
  it holds), so a long run keeps it and a crashed holder loses it within ``lease`` seconds.
* Finishing (``LUA_FINISH``, only while the lease is still its own) keeps the answer if it may be
  replayed, pushes it onto ``done`` and frees the lease. Waiters block on ``done`` with
  ``BLMOVE done done`` (which leaves the answer there for the next waiter): no polling. Every
  ``lease / 2`` seconds a waiter checks that the lease is still held; if the holder died (the
  lease expired with no answer), the waiter arrives again and takes the question over: it runs
  the handler. A run that ended without an answer (it raised) pushes an empty item: its waiters
  arrive again at once.
* Redis down (any error, ``op_timeout`` per operation): the request runs unjoined, as when the
  memory table is full (``server.join.bypass``), counted ``server.join.redis.error.<kind>``;
  Redis is then left alone for ``retry_after`` seconds (``server.join.redis.down`` per request
  that skipped it). Waiters are bounded by ``max_waiters`` per process (past it they run
  unjoined, ``server.join.redis.waiters-full``): each holds a blocking connection. Status
  GETs' long-polls hold at most a quarter of them (past it a GET is answered at once,
  ``server.join.redis.polls-full``).

* Async mode (``Prefer: respond-async``): the status GET at any replica reads the kept answer
  (:meth:`RedisJoinStore.look`; a long-poll waits on ``done`` as a waiter does), under the GET's
  own principal (the principal is part of the question's keys).

What is not shared: the waiter's budget accounting against the run's (a waiter in another process
cannot see the run's account: its reply states its own).
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from askonce import _stats
from askonce.core import is_real
from askonce.core.join import Answer, JoinPolicy, Verdict, decode_answer, encode_answer, keeps
from askonce.stores._pool import kept_cancel, pooled

__all__ = ["LUA_ARRIVE", "LUA_FINISH", "LUA_RENEW", "TIMED_OUT", "RedisJoinStore"]

Scope = tuple[str, str, str]
TIMED_OUT = Answer(503, (), b"")  # the waiter's own deadline passed (the outer layer answers it)

# KEYS lease, answer, done; ARGV token, digest, lease ms, may run (1/0). Token and digest are
# 32 hex characters each; the lease holds token..digest, the answer digest..encoded answer.
LUA_ARRIVE = """
local a = redis.call('GET', KEYS[2])
if a then
  if string.sub(a, 1, 32) ~= ARGV[2] then return {'conflict'} end
  return {'replay', string.sub(a, 33)}
end
local l = redis.call('GET', KEYS[1])
if l then
  if string.sub(l, 33) ~= ARGV[2] then return {'conflict'} end
  return {'wait'}
end
if ARGV[4] ~= '1' then return {'none'} end
redis.call('SET', KEYS[1], ARGV[1] .. ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[3])
return {'run'}
"""

# KEYS lease, answer, done; ARGV token..digest, digest, keep (1/0), ttl ms, payload, done ttl ms.
LUA_FINISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[3] == '1' then redis.call('SET', KEYS[2], ARGV[2] .. ARGV[5], 'PX', ARGV[4]) end
redis.call('DEL', KEYS[3])
redis.call('RPUSH', KEYS[3], ARGV[5])
redis.call('PEXPIRE', KEYS[3], ARGV[6])
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS lease; ARGV token..digest, lease ms.
LUA_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

_VERDICTS = {b"run": Verdict.RUN, b"wait": Verdict.WAIT, b"replay": Verdict.REPLAY,
             b"conflict": Verdict.CONFLICT}


class RedisJoinStore:
    """See the module docstring. ``lease``: seconds a holder that stopped renewing keeps the
    question (its waiters take it over after that)."""

    TIMED_OUT = TIMED_OUT

    def __init__(self, url: str, *, lease: float = 10.0, op_timeout: float = 0.2,
                 retry_after: float = 1.0, max_waiters: int = 1000,
                 prefix: str = "askonce") -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must be a redis:// URL, got {url!r}")
        for name, value, top in (("lease", lease, 3600), ("op_timeout", op_timeout, 60),
                                 ("retry_after", retry_after, 3600)):
            if not is_real(value) or not 0 < value <= top:
                raise ValueError(f"{name} must be seconds within (0, {top}], got {value!r}")
        if not isinstance(max_waiters, int) or not 0 <= max_waiters <= 1_000_000:
            raise ValueError(f"max_waiters must be an int within 0..1000000, got {max_waiters!r}")
        if not isinstance(prefix, str) or not prefix or "}" in prefix:
            raise ValueError(f"prefix must be a non-empty string without '}}', got {prefix!r}")
        self.url, self.lease, self.prefix = url, float(lease), prefix
        self.op_timeout, self.retry_after, self.max_waiters = op_timeout, retry_after, max_waiters
        kw: dict[str, Any] = {"socket_connect_timeout": op_timeout, "retry": Retry(NoBackoff(), 0)}
        self._ops = pooled(redis, url, timeout=op_timeout, socket_timeout=op_timeout, **kw)
        # a connection per waiter (BLMOVE holds it), so as many as there may be waiters
        self._block: Any = pooled(redis, url, timeout=op_timeout, socket_timeout=self.lease + 1.0,
                                  max_connections=max_waiters + 16, **kw)
        self._aops: Any = None  # made on first async use, in the serving event loop
        self._ablock: Any = None
        self._scripts = [self._ops.register_script(s) for s in (LUA_ARRIVE, LUA_FINISH,
                                                                 LUA_RENEW)]
        self._ascripts: list[Any] = []
        self._lock = threading.Lock()
        self._held: dict[bytes, bytes] = {}  # lease key -> token..digest, renewed by the thread
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self._waiters = 0
        self._polls = 0  # of the waiters, status GETs holding a long-poll
        self._down_until = 0.0

    # --- what both the sync and the async forms share ------------------------------------------

    def _keys(self, scope: Scope) -> list[bytes]:
        h = hashlib.blake2b("\x00".join(scope).encode("utf-8", "replace"), digest_size=16)
        tag = f"{{{self.prefix}:join:{h.hexdigest()}}}"
        return [f"{tag}:{part}".encode() for part in ("lease", "answer", "done")]

    def _skip(self) -> bool:
        if _stats.monotonic() < self._down_until:
            _stats.count("server.join.redis.down")
            return True
        return False

    def _failed(self, exc: BaseException) -> None:
        kind = ("timeout" if isinstance(exc, redis.TimeoutError) else "connection"
                if isinstance(exc, redis.ConnectionError) else "response"
                if isinstance(exc, redis.ResponseError) else "other")
        _stats.count(f"server.join.redis.error.{kind}")
        self._down_until = _stats.monotonic() + self.retry_after

    def _arrival(self, scope: Scope, digest: bytes, may_run: bool
                 ) -> tuple[list[bytes], list[bytes]]:
        token = os.urandom(16).hex().encode()
        argv = [token, digest.hex().encode(), str(int(self.lease * 1000)).encode(),
                b"1" if may_run else b"0"]
        return self._keys(scope), argv

    def _arrived(self, keys: list[bytes], argv: list[bytes], out: Any, policy: JoinPolicy
                 ) -> tuple[Verdict, Answer | None]:
        verdict = _VERDICTS.get(bytes(out[0]), Verdict.BYPASS)  # 'none': nothing to join
        if verdict is Verdict.RUN:
            self._hold(keys[0], argv[0] + argv[1])
        elif verdict is Verdict.REPLAY:
            answer = decode_answer(bytes(out[1]), policy.max_body)
            if answer is None:
                _stats.count("server.join.redis.bad-answer")
                return Verdict.BYPASS, None
            return verdict, answer
        elif verdict is Verdict.WAIT and not self._admit():
            return Verdict.BYPASS, None
        return verdict, None

    def _admit(self, poll: bool = False) -> bool:
        """Take a waiter's slot (each holds a blocking connection while it waits). A status
        GET's long-poll (``poll``) may hold at most a quarter of them, so polls held open cannot
        take the slots that repeated arrivals need to join (and not run again)."""
        with self._lock:
            if self._waiters >= self.max_waiters:
                _stats.count("server.join.redis.waiters-full")
                return False
            if poll and self._polls >= self.max_waiters // 4:
                _stats.count("server.join.redis.polls-full")
                return False
            self._waiters += 1
            self._polls += poll
            return True

    def _unpoll(self) -> None:
        with self._lock:
            self._polls -= 1

    def unwait(self) -> None:
        """A ``WAIT`` verdict that is not followed by :meth:`wait` or :meth:`await_answer` (an
        async-mode arrival answered 202) gives its waiter's slot back."""
        with self._lock:
            self._waiters -= 1

    def _looked(self, out: Any, policy: JoinPolicy) -> tuple[str, Answer | None]:
        raw, leased = out
        if raw:
            answer = decode_answer(bytes(raw)[32:], policy.max_body)
            if answer is None:
                _stats.count("server.join.redis.bad-answer")
                return "none", None
            return "answer", answer
        return ("running", None) if leased else ("none", None)

    def _finishing(self, scope: Scope, token: bytes, answer: Answer | None, policy: JoinPolicy
                   ) -> tuple[list[bytes], list[bytes]]:
        keys = self._keys(scope)
        with self._lock:
            self._held.pop(keys[0], None)
        fits = answer is not None and len(answer.body) <= policy.max_body
        payload = encode_answer(answer) if answer is not None and fits else b""
        keep = answer is not None and keeps(policy, answer)
        ttl = max(1, int(policy.ttl * 1000))
        return keys, [token, token[32:], b"1" if keep else b"0", str(ttl).encode(), payload,
                      str(max(1000, int(self.lease * 1000))).encode()]

    def _hold(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._held[key] = value
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, daemon=True,
                                                 name="askonce-join-lease")
                self._renewer.start()

    def _renew(self) -> None:
        ms = str(int(self.lease * 1000)).encode()
        while not self._stop.wait(self.lease / 3):
            with self._lock:
                held = list(self._held.items())
            for key, value in held:
                try:
                    if not self._scripts[2](keys=[key], args=[value, ms]):
                        _stats.count("server.join.redis.lease-lost")
                        with self._lock:
                            self._held.pop(key, None)
                except redis.RedisError as exc:
                    self._failed(exc)
                except Exception:  # anything else must not end the renewing of every lease
                    _stats.count("server.join.redis.renew-error")

    def _got(self, raw: Any, policy: JoinPolicy) -> Answer | None:
        if not raw:
            return None  # the run ended without an answer: arrive again
        answer = decode_answer(bytes(raw), policy.max_body)
        if answer is None:
            _stats.count("server.join.redis.bad-answer")
        return answer

    def close(self) -> None:
        """Stop renewing (held leases then expire) and close the sync connections."""
        self._stop.set()
        self._ops.close()
        self._block.close()

    # --- sync (WSGI) ---------------------------------------------------------------------------

    def arrive(self, scope: Scope, digest: bytes, policy: JoinPolicy, *, may_run: bool = True
               ) -> tuple[Verdict, Answer | None, bytes | None]:
        """The verdict, the answer to replay, and (``RUN``) the token to finish with. ``WAIT``
        must be followed by :meth:`wait`. Nothing to join and ``may_run`` false: ``BYPASS``."""
        if self._skip():
            return Verdict.BYPASS, None, None
        keys, argv = self._arrival(scope, digest, may_run)
        try:
            out = self._scripts[0](keys=keys, args=argv)
        except redis.RedisError as exc:
            self._failed(exc)
            return Verdict.BYPASS, None, None
        verdict, answer = self._arrived(keys, argv, out, policy)
        return verdict, answer, argv[0] + argv[1] if verdict is Verdict.RUN else None

    def finish(self, scope: Scope, token: bytes, answer: Answer | None, policy: JoinPolicy
               ) -> None:
        """The run holding ``token`` answered (``None``: it ended without an answer)."""
        keys, argv = self._finishing(scope, token, answer, policy)
        try:
            if not self._scripts[1](keys=keys, args=argv):
                _stats.count("server.join.redis.lease-lost")  # another took it over
        except redis.RedisError as exc:
            self._failed(exc)  # the waiters take over when the lease expires

    def wait(self, scope: Scope, left: float, policy: JoinPolicy) -> Answer | None:
        """The answer of the run in flight, ``None`` to arrive again, or ``TIMED_OUT``."""
        lease, done = self._keys(scope)[0], self._keys(scope)[2]
        end = _stats.monotonic() + left
        try:
            while (left := end - _stats.monotonic()) > 0:
                raw = self._block.execute_command("BLMOVE", done, done, "LEFT", "LEFT",
                                                  min(left, self.lease / 2))
                if raw is not None:
                    return self._got(raw, policy)
                if not self._ops.exists(lease):
                    # Finished just now (the answer may have landed after the wait), or its
                    # holder died: a last look before arriving again.
                    raw = self._ops.lindex(done, 0)
                    return None if raw is None else self._got(raw, policy)
            return TIMED_OUT
        except redis.RedisError as exc:
            self._failed(exc)
            return None
        finally:
            with self._lock:
                self._waiters -= 1

    def look(self, scope: Scope, policy: JoinPolicy, wait: float = 0.0
             ) -> tuple[str, Answer | None]:
        """An async-mode status GET: ``("answer", kept answer)``, ``("running", None)`` (after
        waiting up to ``wait`` seconds for it to end, without polling), ``("none", None)``, or
        ``("down", None)`` when Redis cannot be asked."""
        if self._skip():
            return "down", None
        keys = self._keys(scope)
        try:
            state = self._looked(self._peek(keys), policy)
            if state[0] == "running" and wait > 0 and self._admit(poll=True):
                try:
                    self.wait(scope, wait, policy)
                finally:
                    self._unpoll()
                state = self._looked(self._peek(keys), policy)
        except redis.RedisError as exc:
            self._failed(exc)
            return "down", None
        return state

    def _peek(self, keys: list[bytes]) -> Any:
        pipe: Any = self._ops.pipeline(transaction=False)
        pipe.get(keys[1])
        pipe.exists(keys[0])
        return pipe.execute()

    # --- async (ASGI): the same on redis.asyncio, in the serving loop ---------------------------

    async def alook(self, scope: Scope, policy: JoinPolicy, wait: float = 0.0
                    ) -> tuple[str, Answer | None]:
        """:meth:`look`, async."""
        if self._skip():
            return "down", None
        self._async()
        keys = self._keys(scope)
        try:
            state = self._looked(await self._apeek(keys), policy)
            if state[0] == "running" and wait > 0 and self._admit(poll=True):
                try:
                    await self.await_answer(scope, wait, policy)
                finally:
                    self._unpoll()
                state = self._looked(await self._apeek(keys), policy)
        except redis.RedisError as exc:
            self._failed(exc)
            return "down", None
        return state

    async def _apeek(self, keys: list[bytes]) -> Any:
        """:meth:`_peek`, async."""
        pipe: Any = self._aops.pipeline(transaction=False)
        return await kept_cancel(pipe.get(keys[1]).exists(keys[0]).execute())

    def _async(self) -> None:
        if self._aops is None:
            kw: dict[str, Any] = {"socket_connect_timeout": self.op_timeout,
                                  "retry": redis.asyncio.retry.Retry(NoBackoff(), 0)}
            self._aops = pooled(redis.asyncio, self.url, timeout=self.op_timeout,
                                socket_timeout=self.op_timeout, **kw)
            self._ablock = pooled(redis.asyncio, self.url, timeout=self.op_timeout,
                                  socket_timeout=self.lease + 1.0,
                                  max_connections=self.max_waiters + 16, **kw)
            self._ascripts = [self._aops.register_script(s) for s in (LUA_ARRIVE, LUA_FINISH)]

    async def aarrive(self, scope: Scope, digest: bytes, policy: JoinPolicy, *,
                      may_run: bool = True) -> tuple[Verdict, Answer | None, bytes | None]:
        """:meth:`arrive`, async."""
        if self._skip():
            return Verdict.BYPASS, None, None
        self._async()
        keys, argv = self._arrival(scope, digest, may_run)
        try:
            out = await kept_cancel(self._ascripts[0](keys=keys, args=argv))
        except redis.RedisError as exc:
            self._failed(exc)
            return Verdict.BYPASS, None, None
        verdict, answer = self._arrived(keys, argv, out, policy)
        return verdict, answer, argv[0] + argv[1] if verdict is Verdict.RUN else None

    async def afinish(self, scope: Scope, token: bytes, answer: Answer | None,
                      policy: JoinPolicy) -> None:
        """:meth:`finish`, async."""
        self._async()
        keys, argv = self._finishing(scope, token, answer, policy)
        try:
            if not await kept_cancel(self._ascripts[1](keys=keys, args=argv)):
                _stats.count("server.join.redis.lease-lost")
        except redis.RedisError as exc:
            self._failed(exc)

    async def await_answer(self, scope: Scope, left: float, policy: JoinPolicy
                           ) -> Answer | None:
        """:meth:`wait`, async."""
        self._async()
        lease, done = self._keys(scope)[0], self._keys(scope)[2]
        end = _stats.monotonic() + left
        try:
            while (left := end - _stats.monotonic()) > 0:
                raw = await kept_cancel(self._ablock.execute_command(
                    "BLMOVE", done, done, "LEFT", "LEFT", min(left, self.lease / 2)))
                if raw is not None:
                    return self._got(raw, policy)
                if not await kept_cancel(self._aops.exists(lease)):
                    raw = await kept_cancel(self._aops.lindex(done, 0))
                    return None if raw is None else self._got(raw, policy)
            return TIMED_OUT
        except redis.RedisError as exc:
            self._failed(exc)
            return None
        finally:
            with self._lock:
                self._waiters -= 1
