"""The shared ledger's life in Redis: key layout, the Lua scripts, batched writes, reading it back.

Keys of one window share the hash tag ``{<prefix>:ledger:<window seconds>:<window index>}`` (one
Redis Cluster slot per window, so each script touches one slot; the load moves to another slot every
window):

* ``<tag>:ops`` - the set of operation names in the window, at most ``max_operations`` (then
  ``~other``);
* ``<tag>:<op>:c`` - counters: ``a`` arrivals, ``t`` attributable, ``m`` re-minted, ``u`` unkeyed,
  ``x`` malformed, ``f`` refused, ``e`` cap unenforced, ``v`` set once keys spilled past the exact
  bound;
* ``<tag>:<op>:k`` - arrivals per (kind, principal, key), at most ``max_exact_keys`` fields; the
  cap's atomic counter is this hash's field;
* ``<tag>:<op>:p`` - arrivals per (kind, principal, key, path digest), for undeclared retries, at
  most ``max_exact_keys * max_paths_per_key`` fields;
* ``<tag>:<op>:h`` - a HyperLogLog of the attributable keys beyond the exact bound (PFADD/PFCOUNT);
* ``<tag>:<op>:r`` / ``:o`` - retries per layer, re-mints per origin (``max_names``, then
  ``~other``);
* ``<tag>:done:<id>`` - a flushed chunk's id, so that a chunk sent again after a timeout counts
  once;
* ``<tag>:seen:<replica>`` - a bitmap of the replica's capped arrivals in the window, one bit per
  arrival by its sequence number: the cap script and the flush each claim an arrival's bit before
  counting it, so that an arrival whose cap call timed out (it may or may not have run) is counted
  exactly once, whichever of the two runs first.

``<op>`` is a 64-bit digest of the operation name. ``{<prefix>:ledger}:meta`` holds the policy the
replicas run (``askonce report`` reads it), ``{<prefix>:ledger}:dropped`` the shared count of
arrivals lost by any replica, per reason. Every key expires ``windows_kept + 2`` windows after its
last write.
"""

from __future__ import annotations

import math
import struct
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from askonce.core.ledger import LedgerPolicy, OperationReport, Report
from askonce.core.ledger.sketch import Frequent, HyperLogLog, digest64
from askonce.core.ledger.state import OperationState, Seen, summarize

if TYPE_CHECKING:
    import redis

# Buffer entry flags: the arrival's per-key count is already in Redis (the cap script made it);
# it was refused; its cap call failed, so the script may have counted it or not: the flush claims
# its bit in the replica's ``seen`` bitmap, at the sequence number held in the bits above.
COUNTED = 1
REFUSED = 2
UNCERTAIN = 4
SEQ_SHIFT = 3
MAX_SEQ = 2**32  # SETBIT's offsets: capped arrivals per replica and window guarded
CHUNK = 1000  # keys per script call: a long script would stall every other client (the cap's 50 ms)
_PATH_CACHE = 4096
_COUNTERS = ("a", "t", "m", "u", "x", "f")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_KEY_TAIL = struct.Struct(">IBH")
_UNCERTAIN_TAIL = struct.Struct(">IB")

# KEYS: ops set, then c k p h r o of the operation, then of '~other', then the chunk's done-marker,
# then the replica's seen bitmap. ARGV: op, max_operations, max_exact_keys, max_pairs, max_names,
# ttl_ms, cap set (0|1), six counters (a t m u x f), then nr (layer n)*, no (origin n)*, the number
# of keys and the packed keys, the number of uncertain arrivals and their packed (field, seq, edge).
LUA_FLUSH = """
local ttl = tonumber(ARGV[6])
if not redis.call('SET', KEYS[14], '1', 'NX', 'PX', ttl) then return -1 end
local b = 1
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then
  if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[2]) then redis.call('SADD', KEYS[1], ARGV[1])
  else b = 7; redis.call('SADD', KEYS[1], '~other') end
end
local c, k, p, h, r, o =
  KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4], KEYS[b + 5], KEYS[b + 6]
local names = {'a', 't', 'm', 'u', 'x', 'f'}
for i = 1, 6 do
  local n = tonumber(ARGV[7 + i])
  if n > 0 then redis.call('HINCRBY', c, names[i], n) end
end
local limit = tonumber(ARGV[5])
local i = 14
for _, hash in ipairs({r, o}) do
  local count = tonumber(ARGV[i]); i = i + 1
  for _ = 1, count do
    local name = ARGV[i]
    if redis.call('HEXISTS', hash, name) == 0 and redis.call('HLEN', hash) >= limit then
      name = '~other'
    end
    redis.call('HINCRBY', hash, name, tonumber(ARGV[i + 1])); i = i + 2
  end
end
-- Keys and their paths come packed in one string (one argument, not six per arrival: building
-- those costs the client most): per key '>H' length, the field, '>I4' arrivals not yet counted,
-- '>B' edge, '>H' paths, then per path its 17-byte suffix and '>I4' arrivals. The exact bounds are
-- checked against lengths read once and kept up to date (HINCRBY returning exactly n: a new field).
local maxk, maxp, cap, unenforced, spilled =
  tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[7] == '1', 0, false
local klen, plen = redis.call('HLEN', k), redis.call('HLEN', p)
local function count(f, n, edge)
  if klen < maxk then
    if redis.call('HINCRBY', k, f, n) == n then klen = klen + 1 end
  elseif redis.call('HEXISTS', k, f) == 1 then
    redis.call('HINCRBY', k, f, n)
  else
    spilled = true
    if edge == 1 then redis.call('PFADD', h, f) end
    if cap then unenforced = unenforced + n end
    return false
  end
  return true
end
-- Arrivals whose cap call failed: counted unless the cap script claimed them first.
local nu, ublob, upos = tonumber(ARGV[i + 2]), ARGV[i + 3], 1
for _ = 1, nu do
  local f, seq, edge
  f, seq, edge, upos = struct.unpack('>Hc0I4B', ublob, upos)
  if redis.call('SETBIT', KEYS[15], seq, 1) == 0 then count(f, 1, edge) end
end
if nu > 0 then redis.call('PEXPIRE', KEYS[15], ttl) end
local blob, pos = ARGV[i + 1], 1
for _ = 1, tonumber(ARGV[i]) do
  local f, n, edge, np
  f, n, edge, np, pos = struct.unpack('>Hc0I4BH', blob, pos)
  -- n == 0: every arrival was counted by the cap script, which counts only exact keys
  local exact = n == 0 or count(f, n, edge)
  for _ = 1, np do
    local suffix, m
    suffix, m, pos = struct.unpack('>c17I4', blob, pos)
    if exact then
      local pf = f .. suffix
      if plen < maxp then
        if redis.call('HINCRBY', p, pf, m) == m then plen = plen + 1 end
      elseif redis.call('HEXISTS', p, pf) == 1 then
        redis.call('HINCRBY', p, pf, m)
      end
    end
  end
end
if spilled then redis.call('HSET', c, 'v', 1) end
if unenforced > 0 then redis.call('HINCRBY', c, 'e', unenforced) end
for _, key in ipairs({KEYS[1], c, k, p, h, r, o}) do redis.call('PEXPIRE', key, ttl) end
return b
"""

# KEYS: ops set, the operation's per-key hash, '~other''s, the replica's seen bitmap. ARGV: op,
# max_operations, max_exact_keys, ttl_ms, field, the arrival's sequence number (-1: unguarded).
# Returns the key's arrivals in the window counting this one; 0 beyond the exact bound (the flush
# counts it); -1 if a flush already counted it (its reply had been given up for lost).
LUA_CAP = """
local k, seq = KEYS[2], tonumber(ARGV[6])
if seq >= 0 and redis.call('GETBIT', KEYS[4], seq) == 1 then return -1 end
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then
  if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[2]) then redis.call('SADD', KEYS[1], ARGV[1])
  else k = KEYS[3]; redis.call('SADD', KEYS[1], '~other') end
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
if redis.call('HEXISTS', k, ARGV[5]) == 1 or redis.call('HLEN', k) < tonumber(ARGV[3]) then
  local n = redis.call('HINCRBY', k, ARGV[5], 1)
  redis.call('PEXPIRE', k, ARGV[4])
  if seq >= 0 then
    redis.call('SETBIT', KEYS[4], seq, 1)
    redis.call('PEXPIRE', KEYS[4], ARGV[4])
  end
  return n
end
return 0
"""

# KEYS: the dropped hash, the done-marker. ARGV: ttl_ms, then (reason n)*.
LUA_DROPPED = """
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return -1 end
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], tonumber(ARGV[i + 1])) end
redis.call('PEXPIRE', KEYS[1], 30 * 86400000)
return 1
"""

_POLICY_INTS = ("windows_kept", "max_exact_keys", "heavy_keys", "max_operations",
                "max_paths_per_key", "max_names")


def check_prefix(prefix: str) -> None:
    if (not isinstance(prefix, str) or not prefix or not prefix.isprintable()
            or any(c in prefix for c in "{}")):
        raise ValueError(
            f"prefix must be a non-empty printable name without braces, got {prefix!r}")


def clients(url: str, op_timeout: float, read_timeout: float) -> tuple[redis.Redis, redis.Redis]:
    """A client for the request path (``op_timeout``) and one for flushes and reports; no client
    retries: they would stretch a 50 ms bound into seconds."""
    import redis

    from askonce.stores.redis import no_retry

    def make(timeout: float) -> redis.Redis:
        return redis.Redis.from_url(url, socket_timeout=timeout,
                                    socket_connect_timeout=min(timeout, 1.0), retry=no_retry())

    return make(op_timeout), make(read_timeout)


def field(kind: bytes, principal: str, key: str) -> bytes:
    """A per-key hash field: kind (``a`` attributable, ``r`` re-minted), then the principal
    length-prefixed."""
    p = principal.encode("utf-8", "surrogatepass")
    return b"%s%d:%s%s" % (kind, len(p), p, key.encode("utf-8", "surrogatepass"))


def unfield(f: bytes) -> tuple[bytes, str, str]:
    colon = f.index(b":", 1)
    start = colon + 1
    end = start + int(f[1:colon])
    return (f[:1], f[start:end].decode("utf-8", "surrogatepass"),
            f[end:].decode("utf-8", "surrogatepass"))


class Space:
    """Key names and script arguments for one prefix and policy."""

    def __init__(self, prefix: str, policy: LedgerPolicy) -> None:
        self.prefix = prefix
        self.policy = policy
        self.ttl_ms = int(1000 * policy.window * (policy.windows_kept + 2)) + 60_000
        self.meta = f"{{{prefix}:ledger}}:meta"
        self.dropped = f"{{{prefix}:ledger}}:dropped"
        self._stem = f"{prefix}:ledger:{float(policy.window)!r}"
        self._ids: dict[str, str] = {}

    def tag(self, window: int) -> str:
        return f"{{{self._stem}:{window}}}"

    def op_id(self, operation: str) -> str:
        found = self._ids.get(operation)
        if found is None:
            found = f"{digest64(operation, person=b'askonce-op'):016x}"
            if len(self._ids) < 4096:
                self._ids[operation] = found
        return found

    def op_keys(self, window: int, operation: str) -> list[str]:
        tag = self.tag(window)
        out = [f"{tag}:ops"]
        for name in (operation, "~other"):
            stem = f"{tag}:{self.op_id(name)}"
            out += [f"{stem}:{s}" for s in ("c", "k", "p", "h", "r", "o")]
        return out

    def seen(self, window: int, replica: str) -> str:
        return f"{self.tag(window)}:seen:{replica}"

    def cap_call(self, window: int, operation: str, edge: bool, principal: str,
                 key: str, replica: str, seq: int) -> tuple[list[str], list[Any]]:
        keys = self.op_keys(window, operation)
        p = self.policy
        return ([keys[0], keys[2], keys[8], self.seen(window, replica)],
                [operation, p.max_operations, p.max_exact_keys, self.ttl_ms,
                 field(b"a" if edge else b"r", principal, key), seq])

    def meta_fields(self) -> dict[Any, Any]:
        p = self.policy
        out: dict[Any, Any] = {name: str(getattr(p, name)) for name in _POLICY_INTS}
        out["window"] = repr(float(p.window))
        out["cap"] = "" if p.cap is None else str(p.cap)
        return out


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else value


def policy_from(meta: dict[Any, Any]) -> LedgerPolicy:
    text = {_text(k): _text(v) for k, v in meta.items()}
    cap = text.get("cap", "")
    return LedgerPolicy(window=float(text["window"]), cap=int(cap) if cap else None,
                        **{name: int(text[name]) for name in _POLICY_INTS if name in text})


class _Group:
    __slots__ = ("counters", "keys", "origins", "retries", "uncertain")

    def __init__(self) -> None:
        self.counters = [0, 0, 0, 0, 0, 0]  # as _COUNTERS
        self.retries: dict[str, int] = {}
        self.origins: dict[str, int] = {}
        # field -> [uncounted arrivals, edge, {path suffix: n}]
        self.keys: dict[bytes, list[Any]] = {}
        self.uncertain: list[tuple[bytes, int, bool]] = []  # (field, seq, edge)


Call = tuple[str, list[str], list[Any], int]  # script, keys, args, arrivals it carries


class Writer:
    """Turns buffered arrivals into script calls (aggregated per window and operation) and sends
    them."""

    def __init__(self, space: Space, client: redis.Redis | redis.RedisCluster,
                 replica: str = "") -> None:
        self.space = space
        self.replica = replica  # whose seen bitmap the flush claims uncertain arrivals in
        self.client = client
        self.scripts = {"flush": client.register_script(LUA_FLUSH),
                        "dropped": client.register_script(LUA_DROPPED)}
        self._paths: dict[Any, tuple[bytes, tuple[str, ...]]] = {}

    def path_info(self, path: Any) -> tuple[bytes, tuple[str, ...]]:
        """The path's digest and the layers it says retried: the core's rule (the last hop of a
        layer has attempt > 1), restated here because the core keeps it private."""
        info = self._paths.get(path)
        if info is None:
            last: dict[str, int] = {}
            parts: list[str] = []
            for layer, attempt in path:
                last[layer] = attempt
                parts += (layer, str(attempt))
            retried = tuple(layer for layer, a in last.items() if isinstance(a, int) and a > 1)
            info = (b"|%016x" % digest64(*parts, person=b"askonce-path"), retried)
            if len(self._paths) >= _PATH_CACHE:
                self._paths.clear()
            self._paths[path] = info
        return info

    def prepare(self, batch: Iterable[tuple[Any, ...]]) -> tuple[list[Call], int, int]:
        """Script calls for ``batch``; also how many arrivals were too old to matter, and how many
        could not be encoded (a key that is not a string: the signature forbids it, a caller
        ignoring types could still send one, and it must not take the batch down with it)."""
        window = self.space.policy.window
        groups: dict[tuple[int, str], _Group] = {}
        arrivals = list(batch)
        # Only times some window holds set the horizon: one too far out (1e308 s) is invalid on its
        # own below, and must not take the batch down with it.
        newest = max((q for a in arrivals if math.isfinite(q := a[0] / window)), default=0.0)
        horizon = math.floor(newest) - self.space.policy.windows_kept
        expired = invalid = 0
        paths = self._paths
        heads: dict[tuple[bool, str], bytes] = {}  # (edge, principal) -> the field's head
        for now, operation, key, edge, origin, path, principal, malformed, flag in arrivals:
            keyed = key is not None and not malformed
            try:  # everything that can fail comes first, before anything is counted
                index = math.floor(now / window)
                info = paths.get(path)
                if info is None:
                    info = self.path_info(path)
                f = b""
                if keyed:
                    head = heads.get((edge, principal))
                    if head is None:
                        head = heads[(edge, principal)] = field(b"a" if edge else b"r",
                                                                principal, "")
                    f = head + key.encode("utf-8", "surrogatepass")
                    if len(f) > 65_535:
                        raise ValueError("key too long to pack")
                g = groups.get((index, operation))
            except Exception:
                invalid += 1
                continue
            if index < horizon:  # its window has left every report: sending it would only cost
                expired += 1
                continue
            if g is None:
                g = groups[(index, operation)] = _Group()
            counters = g.counters
            counters[0] += 1
            for layer in info[1]:
                g.retries[layer] = g.retries.get(layer, 0) + 1
            if not keyed:
                counters[4 if malformed else 3] += 1
                continue
            if edge:
                counters[1] += 1
            else:
                counters[2] += 1
                name = "~unknown" if origin is None else origin
                g.origins[name] = g.origins.get(name, 0) + 1
            if flag & REFUSED:
                counters[5] += 1
            entry = g.keys.get(f)
            if entry is None:
                entry = g.keys[f] = [0, edge, {}]
            if flag & UNCERTAIN:
                g.uncertain.append((f, flag >> SEQ_SHIFT, edge))
            elif not flag & COUNTED:
                entry[0] += 1
            pairs = entry[2]
            suffix = info[0]
            if suffix in pairs:
                pairs[suffix] += 1
            # The packed count's limit; beyond it the arrival's path is untracked.
            elif len(pairs) < 65_535:
                pairs[suffix] = 1
        calls = [c for (index, operation), g in groups.items()
                 for c in self._calls(index, operation, g)]
        return calls, expired, invalid

    def dropped_call(self, dropped: dict[str, int]) -> Call:
        args: list[Any] = [self.space.ttl_ms]
        for reason, n in dropped.items():
            args += [reason, n]
        return "dropped", [self.space.dropped,
                           f"{{{self.space.prefix}:ledger}}:done:{uuid.uuid4().hex}"], args, 0

    def _calls(self, index: int, operation: str, g: _Group) -> list[Call]:
        p = self.space.policy
        keys = self.space.op_keys(index, operation)
        head: list[Any] = [operation, p.max_operations, p.max_exact_keys,
                           p.max_exact_keys * p.max_paths_per_key,
                           p.max_names, self.space.ttl_ms, 0 if p.cap is None else 1]
        items = list(g.keys.items())
        seen = self.space.seen(index, self.replica)
        out: list[Call] = []
        for start in range(0, max(1, len(items), len(g.uncertain)), CHUNK):
            chunk = items[start:start + CHUNK]
            first = start == 0
            args = head + (g.counters if first else [0] * 6)
            for names in (g.retries, g.origins):
                args.append(len(names) if first else 0)
                if first:
                    for name, n in names.items():
                        args += [name, n]
            blob = bytearray()
            for f, (n, edge, pairs) in chunk:
                blob += _U16.pack(len(f))
                blob += f
                blob += _KEY_TAIL.pack(n, 1 if edge else 0, len(pairs))
                for suffix, m in pairs.items():
                    blob += suffix
                    blob += _U32.pack(m)
            args += [len(chunk), bytes(blob)]
            uncertain = g.uncertain[start:start + CHUNK]
            blob = bytearray()
            for f, seq, edge in uncertain:
                blob += _U16.pack(len(f))
                blob += f
                blob += _UNCERTAIN_TAIL.pack(seq, 1 if edge else 0)
            args += [len(uncertain), bytes(blob)]
            done = f"{self.space.tag(index)}:done:{uuid.uuid4().hex}"
            out.append(("flush", [*keys, done, seen], args, g.counters[0] if first else 0))
        return out

    def send(self, calls: list[Call], replicas: int = 0, wait_ms: int = 100) -> None:
        """Run ``calls`` in one pipelined round trip (one call at a time on a Redis Cluster); a
        chunk that already ran (sent again after a timeout) is skipped by its done-marker, so
        nothing is counted twice. With ``replicas``, raise :class:`NotReplicated` unless that many
        replicas acknowledged the writes within ``wait_ms`` (``WAIT``): the caller sends the calls
        again, so that a failover that lost them on the way loses nothing."""
        pipe = batch(self.client)
        if pipe is None:
            self._send_one_by_one(calls, replicas, wait_ms)
            return
        for script, keys, args, _ in calls:
            self.scripts[script](keys=keys, args=args, client=pipe)
        pipe.hset(self.space.meta, mapping=self.space.meta_fields())
        pipe.pexpire(self.space.meta, 30 * 86_400_000)
        if replicas:
            pipe.execute_command("WAIT", replicas, wait_ms)  # on the connection that wrote
        out = pipe.execute()
        if replicas and int(out[-1]) < replicas:
            raise NotReplicated(f"{out[-1]} of {replicas} replicas acknowledged a flush")

    def _send_one_by_one(self, calls: list[Call], replicas: int, wait_ms: int) -> None:
        # On a cluster each script runs on its own: its NOSCRIPT (a promoted replica has an empty
        # script cache) is answered by loading it, which a cluster pipeline cannot do.
        client: Any = self.client
        for script, keys, args, _ in calls:
            self.scripts[script](keys=keys, args=args, client=client)
        client.hset(self.space.meta, mapping=self.space.meta_fields())
        client.pexpire(self.space.meta, 30 * 86_400_000)
        if replicas:
            nodes = {client.get_node_from_key(keys[0]).name: client.get_node_from_key(keys[0])
                     for _, keys, _, _ in calls}
            nodes[""] = client.get_node_from_key(self.space.meta)
            for node in nodes.values():
                acked = int(client.execute_command("WAIT", replicas, wait_ms, target_nodes=node))
                if acked < replicas:
                    raise NotReplicated(f"{acked} of {replicas} replicas of {node.name} "
                                        "acknowledged a flush")


class NotReplicated(Exception):
    """Fewer replicas than asked for acknowledged a flush: it is sent again."""


def batch(client: Any) -> Any:
    """A pipeline of ``client``, or None for a Redis Cluster client (a cluster pipeline refuses
    scripts and PFCOUNT: commands go one at a time, each to its slot's node)."""
    if hasattr(client, "get_node_from_key"):  # redis.cluster.RedisCluster, without importing it
        return None
    return client.pipeline(transaction=False)


class _Now:
    """The read pipeline's shape over a cluster client: each command runs at once."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._out: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        command = getattr(self._client, name)
        return lambda *args, **kwargs: self._out.append(command(*args, **kwargs))

    def execute(self) -> list[Any]:
        out, self._out = self._out, []
        return out


class _Known(HyperLogLog):
    """Redis' PFCOUNT in the shape the core's summary reads (it only calls ``estimate``)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        super().__init__(4)
        self.n = n

    def estimate(self) -> float:
        return float(self.n)


def _ints(raw: dict[Any, Any]) -> dict[str, int]:
    return {_text(k): int(v) for k, v in raw.items()}


def _operation(name: str, start: float, current: bool, raw: list[Any],
               policy: LedgerPolicy) -> OperationReport:
    c, k, p, h, r, o = raw
    counts = _ints(c)
    op = OperationState()
    op.arrivals, op.attributable, op.reminted, op.unkeyed, op.malformed, op.refused = (
        counts.get(n, 0) for n in _COUNTERS)
    op.cap_unenforced = counts.get("e", 0)
    op.overflowed = "v" in counts
    op.retries_by = _ints(r)
    op.reminted_by = _ints(o)
    covered: dict[bytes, list[int]] = {}
    for pf, n in p.items():
        seen = covered.setdefault(pf[:-17], [0, 0])
        seen[0] += 1
        seen[1] += int(n)
    for f, n_raw in k.items():
        kind, principal, key = unfield(f)
        n = int(n_raw)
        paths, tracked = covered.get(f, (0, 0))
        table = op.attr if kind == b"a" else op.remint
        # Arrivals whose (key, path) pair Redis could not hold are the core's "untracked" paths.
        table.setdefault(principal, {})[key] = Seen(n, tuple(range(paths)), max(0, n - tracked))
    op.exact = len(k)
    if h:
        op.hll, op.heavy = _Known(int(h)), Frequent(1)
    return summarize(op, name, start, start + policy.window, current, policy.heavy_keys)


def read(client: redis.Redis | redis.RedisCluster, now: float, prefix: str,
         policy: LedgerPolicy | None) -> Report:
    check_prefix(prefix)
    if not math.isfinite(now):
        raise ValueError(f"report time must be finite, got {now!r}")
    space = Space(prefix, policy or LedgerPolicy())
    if policy is None:
        meta = client.hgetall(space.meta)
        if not meta:
            raise LookupError(f"no askonce ledger in Redis under prefix {prefix!r} "
                              "(nothing flushed yet?)")
        policy = policy_from(meta)
        space = Space(prefix, policy)
    current = math.floor(now / policy.window)
    indexes = range(current - policy.windows_kept, current + 1)
    pipe = batch(client) or _Now(client)
    for index in indexes:
        pipe.smembers(f"{space.tag(index)}:ops")
    pipe.hgetall(space.dropped)
    *members, dropped = pipe.execute()
    wanted = [(index, name.decode("utf-8", "surrogatepass"))
              for index, names in zip(indexes, members, strict=True) for name in names]
    wanted.sort()
    pipe = batch(client) or _Now(client)
    for index, name in wanted:
        c, k, p, h, r, o = space.op_keys(index, name)[1:7]
        pipe.hgetall(c)
        pipe.hgetall(k)
        pipe.hgetall(p)
        pipe.pfcount(h)
        pipe.hgetall(r)
        pipe.hgetall(o)
    raw = pipe.execute() if wanted else []
    ops = tuple(_operation(name, index * policy.window, index == current, raw[6 * i:6 * i + 6],
                           policy)
                for i, (index, name) in enumerate(wanted))
    return Report(generated_at=now, window=policy.window, operations=ops, dropped=_ints(dropped))
