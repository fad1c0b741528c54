"""What lives in Redis: the Lua scripts, the key layout, and how their answers read.

Both scripts are ports of the pure core (``core.bucket.TokenBucket``, ``core.breaker.Breaker``) run
atomically by the server on its own clock (``TIME``), so that every process sharing a target sees
one state. Keys are ``{<prefix>:<target>}:<kind>:<policy digest>``; the ``{...}`` hash tag puts all
of a target's keys in one Redis Cluster slot, which multi-key scripts need. The breaker's window has
a key of its own (``...:w``): for a count window a string of one flags byte per call (``SETRANGE``),
for a time window a hash of per-second buckets. Every script refreshes a TTL on every key it
touches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy

__all__ = ["HEARTBEAT", "LUA_ADMISSION", "LUA_BREAKER", "LUA_BUCKET", "MEMBER_EXPIRY",
           "AdmissionReply", "BreakerReply", "BucketReply", "admission_args", "breaker_args",
           "bucket_args", "policy_digest", "target_tag"]

# KEYS[1] = bucket hash[, KEYS[2] = members]. ARGV = ratio, floor, max_tokens, deposits, take
# (0|1), ttl_ms[, now[, member, member_expiry]]. The same arithmetic as core.bucket.TokenBucket, on
# the server's clock. Returns {granted, tokens, earned, floor tokens, members}.
# Both scripts take an optional ``now`` instead of TIME: only the tests pass it, to play the same
# script against the core with an injected clock; handles pass '' (TIME). A handle passes its
# member id (at most every HEARTBEAT seconds): the script counts it in the members sorted set
# (score: the time it was last seen), drops members not seen for ``member_expiry`` seconds and
# returns how many are left, the N of the fallback's 1/N share (core.fallback); 0 when not asked.
LUA_BUCKET = """
local ratio, floor, max_e = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n, take, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(ARGV[7]) or tonumber(t[1]) + tonumber(t[2]) / 1000000
local s = redis.call('HMGET', KEYS[1], 'e', 'f', 'u')
local fcap = 0
if floor > 0 then fcap = math.max(1, floor) end
-- Another writer may have left anything (tonumber reads 'inf' and 'nan'):
-- keep what the core can hold.
local function num(x, d)
  local v = tonumber(x)
  if v == nil or v ~= v or v == math.huge or v == -math.huge then return d end
  return v
end
local e = math.max(0, math.min(max_e, num(s[1], 0)))
local f = math.max(0, math.min(fcap, num(s[2], fcap)))
local u = num(s[3], now)
if n > 0 then e = math.min(max_e, e + n * ratio) end
if now > u then f = math.min(fcap, f + (now - u) * floor); u = now end
local ok = 0
if take > 0 then
  if e >= 1 then e = e - 1; ok = 1 elseif f >= 1 then f = f - 1; ok = 1 end
end
redis.call('HSET', KEYS[1], 'e', string.format('%.17g', e), 'f', string.format('%.17g', f),
  'u', string.format('%.6f', u))
redis.call('PEXPIRE', KEYS[1], ttl)
local members = 0
if KEYS[2] and ARGV[8] and ARGV[8] ~= '' then
  local kind = redis.call('TYPE', KEYS[2])['ok']
  if kind ~= 'zset' and kind ~= 'none' then redis.call('DEL', KEYS[2]) end  -- another writer's
  redis.call('ZADD', KEYS[2], now, ARGV[8])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[9]))
  redis.call('PEXPIRE', KEYS[2], ttl)
  members = redis.call('ZCARD', KEYS[2])
end
return {ok, string.format('%.17g', e + f), string.format('%.17g', e), string.format('%.17g', f),
  members}
"""

# KEYS[1] = breaker state hash, KEYS[2] = window (count: a string of one flags byte per call; time:
# a hash of per-second buckets)[, KEYS[3] = members]. ARGV = op, window, window_size,
# minimum_calls, failure_rate, slow_call_rate, slow_call_duration (< 0: not judged), open_for,
# half_open_probes, ttl_ms, success, duration[, now[, member, member_expiry]]. A port of
# core.breaker.Breaker (same states, windows, reasons); returns {state, allowed, retry_at, now,
# leased, members, old1, new1, at1, reason1, ...}. States: 0 closed 1 open 2 half. Members: as the
# bucket's.
LUA_BREAKER = """
local sk, wk, op, timewin = KEYS[1], KEYS[2], ARGV[1], ARGV[2] == 'time'
local size, minc = tonumber(ARGV[3]), tonumber(ARGV[4])
local frate, srate, sdur = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local open_for, probes, ttl = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local success, duration = ARGV[11] == '1', tonumber(ARGV[12])
local function fmt(x) return string.format('%.6f', x) end
local t = redis.call('TIME')
local now = tonumber(ARGV[13]) or tonumber(t[1]) + tonumber(t[2]) / 1000000
local h = redis.call('HMGET', sk, 'st', 'now', 'oa', 'pa', 'ps', 'c', 'f', 's', 'nx', 'fl', 'hd',
  'gen', 'ho')
-- Another writer may have left anything (tonumber reads 'inf' and 'nan'). Every clamp below is a
-- no-op on a state this script wrote; it keeps a foreign one from wedging the breaker or breaking
-- the reply.
local function num(x)
  local v = tonumber(x)
  if v ~= v or v == math.huge or v == -math.huge then return nil end
  return v
end
local st = num(h[1]) or 0
local last = num(h[2])
if last and now < last and last - now < 86400 then now = last end
local oa, pa, ps = num(h[3]), num(h[4]) or 0, num(h[5]) or 0
local calls, fails, slow = num(h[6]) or 0, num(h[7]) or 0, num(h[8]) or 0
local nx, fl, hd = num(h[9]) or 0, num(h[10]) or 0, num(h[11])
local gen, ho = num(h[12]) or 0, num(h[13])
if st ~= 0 and st ~= 1 and st ~= 2 then
  st, calls, fails, slow, nx, fl, hd = 0, 0, 0, 0, 0, 0, nil
end
if oa and oa > now then oa = now end
if st == 1 and not oa then oa = now end
if ho and ho > now then ho = now end
pa = math.max(0, math.min(probes, math.floor(pa)))
ps = math.max(0, math.min(pa, math.floor(ps)))
calls = math.max(0, calls)
fails, slow = math.max(0, math.min(calls, fails)), math.max(0, math.min(calls, slow))
if nx ~= math.floor(nx) or nx < 0 or nx >= size then nx = 0 end
fl = math.max(0, math.min(size, math.floor(fl)))
if hd and hd > math.floor(now) then hd = nil end
local moves, leased = {}, 0

local function bucket(i)
  local b = redis.call('HMGET', wk, 'S' .. i, 'g' .. i, 'c' .. i, 'f' .. i, 'w' .. i)
  return tonumber(b[1]), tonumber(b[2]), tonumber(b[3]) or 0, tonumber(b[4]) or 0,
    tonumber(b[5]) or 0
end
local function roll(sec)
  if hd ~= nil and sec <= hd then return end
  if hd == nil or sec - hd >= size then
    calls, fails, slow = 0, 0, 0
  else
    for s = hd + 1, sec do
      local bs, bg, bc, bf, bw = bucket(s % size)
      if bg == gen and bs == s - size then
        calls, fails, slow = calls - bc, fails - bf, slow - bw
      end
    end
  end
  hd = sec
end
local function add(flags)
  local failed, isslow = flags % 2, math.floor(flags / 2)
  if timewin then
    local sec = math.floor(now)
    roll(sec)
    local i = sec % size
    local bs, bg, bc, bf, bw = bucket(i)
    if bs ~= sec or bg ~= gen then bc, bf, bw = 0, 0, 0 end
    redis.call('HSET', wk, 'S' .. i, sec, 'g' .. i, gen, 'c' .. i, bc + 1, 'f' .. i, bf + failed,
      'w' .. i, bw + isslow)
  else
    if fl == size then
      local old = string.byte(redis.call('GETRANGE', wk, nx, nx)) or 0
      calls, fails, slow = calls - 1, fails - old % 2, slow - math.floor(old / 2)
    else
      fl = fl + 1
    end
    redis.call('SETRANGE', wk, nx, string.char(flags))
    nx = (nx + 1) % size
  end
  calls, fails, slow = calls + 1, fails + failed, slow + isslow
end
local function reset()
  calls, fails, slow, nx, fl, gen = 0, 0, 0, 0, 0, gen + 1
end
local function move(new, at, reason)
  moves[#moves + 1] = st; moves[#moves + 1] = new
  moves[#moves + 1] = fmt(at); moves[#moves + 1] = reason
  st, pa, ps = new, 0, 0
  ho = nil
  if new == 1 then oa = at; reset() elseif new == 0 then oa = nil end
end

if st == 1 and oa then
  if now >= oa + open_for then move(2, oa + open_for, 'open-elapsed') end
elseif st == 0 and timewin then
  roll(math.floor(now))
end
local allowed = 0
if op == 'allow' then
  if st == 0 then
    allowed = 1
  elseif st == 2 then
    if pa >= probes and ps < probes and ho and now >= ho + open_for then
      pa, ps, leased = 0, 0, 1
    end
    if pa < probes then pa, ho, allowed = pa + 1, now, 1 end
  end
elseif op == 'record' then
  local isslow = sdur >= 0 and duration >= sdur
  if st == 0 then
    add((success and 0 or 1) + (isslow and 2 or 0))
    if calls >= minc then
      if fails / calls >= frate then move(1, now, 'failure-rate')
      elseif sdur >= 0 and slow / calls >= srate then move(1, now, 'slow-call-rate') end
    end
  elseif st == 2 and pa > ps then
    if not success then move(1, now, 'probe-failed')
    elseif isslow then move(1, now, 'probe-slow')
    else
      ps = ps + 1
      if ps >= probes then move(0, now, 'probes-succeeded') end
    end
  end
elseif op == 'release' then
  if st == 2 and pa > ps then pa = pa - 1 end
elseif op == 'force_open' then
  if st == 1 then oa = now else move(1, now, 'forced') end
elseif op == 'force_closed' then
  if st == 0 then reset() else move(0, now, 'forced') end
end
redis.call('HSET', sk, 'st', st, 'now', fmt(now), 'oa', oa and fmt(oa) or '', 'pa', pa, 'ps', ps,
  'c', calls, 'f', fails, 's', slow, 'nx', nx, 'fl', fl, 'hd', hd or '', 'gen', gen,
  'ho', ho and fmt(ho) or '')
redis.call('PEXPIRE', sk, ttl)
redis.call('PEXPIRE', wk, ttl)
local members = 0
if KEYS[3] and ARGV[14] and ARGV[14] ~= '' then
  local kind = redis.call('TYPE', KEYS[3])['ok']
  if kind ~= 'zset' and kind ~= 'none' then redis.call('DEL', KEYS[3]) end  -- another writer's
  redis.call('ZADD', KEYS[3], now, ARGV[14])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[15]))
  redis.call('PEXPIRE', KEYS[3], ttl)
  members = redis.call('ZCARD', KEYS[3])
end
local out = {st, allowed, (st == 1 and oa) and fmt(oa + open_for) or '', fmt(now), leased,
  members}
for i = 1, #moves do out[#out + 1] = moves[i] end
return out
"""

# KEYS[1] = admission hash: per-second buckets ('r<i>', 'c<i>', 's<i>': requests, calls, successes
# of the second i = sec % window), the running totals 'R' 'C' 'S' over the window, the head second
# 'hd' and the latest time 'now'. ARGV = window, min_success, max_reject, min_requests,
# count_rejected (0|1), ttl_ms, then the deltas to add to the current second: requests, calls,
# successes[, now]. A port of core.admission.Admission (the same roll and formula, on the server's
# clock); returns {p, requests, calls, successes} over the window, deltas included.
LUA_ADMISSION = """
local w, ms, mr, mq = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local byreq, ttl = ARGV[5] == '1', tonumber(ARGV[6])
local dr, dc, ds = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local t = redis.call('TIME')
local now = tonumber(ARGV[10]) or tonumber(t[1]) + tonumber(t[2]) / 1000000
local k = KEYS[1]
-- Another writer may have left anything: keep what the core can hold.
local function num(x)
  local v = tonumber(x)
  if v == nil or v ~= v or v == math.huge or v == -math.huge then return nil end
  return v
end
local h = redis.call('HMGET', k, 'hd', 'now', 'R', 'C', 'S')
local last = num(h[2])
if last and now < last and last - now < 86400 then now = last end
local sec = math.floor(now)
local hd = num(h[1])
if hd and (hd ~= math.floor(hd) or hd > sec) then hd = nil end
local R, C, S = num(h[3]) or 0, num(h[4]) or 0, num(h[5]) or 0
R, C, S = math.max(0, R), math.max(0, C), math.max(0, S)
if hd == nil or sec - hd >= w then
  redis.call('DEL', k)
  R, C, S = 0, 0, 0
elseif sec > hd then
  for s = hd + 1, sec do
    local i = s % w
    local b = redis.call('HMGET', k, 'r' .. i, 'c' .. i, 's' .. i)
    R, C, S = R - (num(b[1]) or 0), C - (num(b[2]) or 0), S - (num(b[3]) or 0)
    redis.call('HDEL', k, 'r' .. i, 'c' .. i, 's' .. i)
  end
  R, C, S = math.max(0, R), math.max(0, C), math.max(0, S)
end
local i = sec % w
if dr > 0 then redis.call('HINCRBY', k, 'r' .. i, dr) end
if dc > 0 then redis.call('HINCRBY', k, 'c' .. i, dc) end
if ds > 0 then redis.call('HINCRBY', k, 's' .. i, ds) end
R, C, S = R + dr, C + dc, S + ds
redis.call('HSET', k, 'hd', sec, 'now', string.format('%.6f', now), 'R', R, 'C', C, 'S', S)
redis.call('PEXPIRE', k, ttl)
local p = 0
if R >= mq then
  local n = C
  if byreq then n = R end
  p = (n - S / ms) / (n + 1)
  if p <= 0 then p = 0 elseif p > mr then p = mr end
end
return {string.format('%.17g', p), R, C, S}
"""

_STATES = (State.CLOSED, State.OPEN, State.HALF_OPEN)
HEARTBEAT = 1.0  # seconds: how often a handle has itself counted as a member
MEMBER_EXPIRY = 30.0  # seconds: a member not seen for this long is no longer counted
_MAX_TARGET = 120


def target_tag(prefix: str, target: str) -> str:
    """The hash-tagged key stem of a target: ``{prefix:target}``.

    The target is hashed if its name could break the tag.
    """
    if len(target) > _MAX_TARGET or not target.isprintable() or any(c in target for c in "{}#"):
        target = "#" + hashlib.sha1(target.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{{{prefix}:{target}}}"


def policy_digest(policy: BucketPolicy | BreakerPolicy | AdmissionPolicy) -> str:
    return hashlib.sha1(repr(policy).encode()).hexdigest()[:10]


def bucket_args(policy: BucketPolicy, deposits: int, take: bool, ttl_ms: int) -> list[str]:
    return [repr(float(policy.ratio)), repr(float(policy.floor)), repr(float(policy.max_tokens)),
            str(deposits), "1" if take else "0", str(ttl_ms)]


def breaker_args(policy: BreakerPolicy, ttl: float) -> list[str]:
    """The breaker script's policy arguments; op, success and duration are added per call."""
    # The state must outlive an open period and a time window, or a quiet fleet forgets it is open.
    ttl_ms = int(1000 * max(ttl, 2 * policy.open_for
                            + (policy.window_size if policy.window == "time" else 0)))
    slow = -1.0 if policy.slow_call_duration is None else float(policy.slow_call_duration)
    return [policy.window, str(policy.window_size), str(policy.minimum_calls),
            repr(float(policy.failure_rate)), repr(float(policy.slow_call_rate)), repr(slow),
            repr(float(policy.open_for)), str(policy.half_open_probes), str(ttl_ms)]


def admission_args(policy: AdmissionPolicy, ttl: float) -> list[str]:
    """The admission script's policy arguments; the three deltas are added per call."""
    ttl_ms = int(1000 * max(ttl, 2 * policy.window))  # a quiet fleet must not forget its window
    return [str(policy.window), repr(float(policy.min_success)), repr(float(policy.max_reject)),
            str(policy.min_requests), "1" if policy.count_rejected else "0", str(ttl_ms)]


class AdmissionReply:
    """An admission script's answer: the fleet's reject probability and window counters."""

    __slots__ = ("calls", "p", "requests", "successes")

    def __init__(self, raw: Sequence[Any]) -> None:
        p = float(text(raw[0]))
        if not 0 <= p < 1:  # a reply that does not read is Redis' failure (the caller falls back)
            raise ValueError(f"admission script answered p={p!r}")
        self.p = p
        self.requests, self.calls, self.successes = int(raw[1]), int(raw[2]), int(raw[3])


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class BreakerReply:
    """A breaker script's answer, on the caller's clock."""

    __slots__ = ("allowed", "leased", "members", "retry_at", "state", "transitions")

    def __init__(self, raw: Sequence[Any], now: float) -> None:
        offset = now - float(text(raw[3]))
        self.state = _STATES[int(raw[0])]
        self.allowed = int(raw[1]) == 1
        retry_at = text(raw[2])
        self.retry_at = float(retry_at) + offset if retry_at else None
        self.leased = int(raw[4]) == 1
        self.members = int(raw[5])  # 0: not counted on this call
        self.transitions = [
            Transition(_STATES[int(raw[i])], _STATES[int(raw[i + 1])],
                       float(text(raw[i + 2])) + offset, text(raw[i + 3]))
            for i in range(6, len(raw) - 3, 4)
        ]


class BucketReply:
    """A bucket script's answer: granted, and the shared level (the fallback's seed)."""

    __slots__ = ("earned", "floor_tokens", "granted", "members", "tokens")

    def __init__(self, raw: Sequence[Any]) -> None:
        self.granted = int(raw[0]) == 1
        self.tokens = float(text(raw[1]))
        self.earned = float(text(raw[2]))
        self.floor_tokens = float(text(raw[3]))
        self.members = int(raw[4])  # 0: not counted on this call
