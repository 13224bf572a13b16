"""Distributed limits in Redis: the same GCRA decisions as the core, shared by every process.

``RedisLimiter``, ``RedisKeyedLimiter`` and ``RedisPolicy`` (and their asyncio twins
``AsyncRedisLimiter``, ``AsyncRedisKeyedLimiter``, ``AsyncRedisPolicy``) decide inside
Redis, atomically, in one round trip: one Lua script (run by EVALSHA, loaded once and
again after a NOSCRIPT reply) checks and debits every rate, unit and level of a request,
all or nothing, on the server's clock (``TIME``), never a client's.

Storage: a bucket is one string key holding its theoretical arrival time (TAT) in
integer microseconds since the Unix epoch of the server's clock. About 1.8e15 today,
that is exact in a Lua double (below 2**53). Every write sets ``PX`` to the time until
the bucket is full again, and a full bucket has no key: idle keys cost no memory and
dropping one changes no decision. Debits are ``round(cost * T)`` microseconds with
``T = per / amount``: exact (and equal, decision for decision, to the Rust core) when
``T`` is a whole number of microseconds; otherwise each debit is rounded to the
nearest microsecond (an error of at most 0.5 us per request, not a drift of the rate
definition).

Key names: ``{prefix}:{{tag}}:{name}:{i}`` for rate ``i`` of a limiter (``tag``
defaults to ``name``), ``{prefix}:{{tag}}:{name}:{key}`` for a keyed limiter (``tag``
defaults to the key, spreading keys over a cluster), and for a policy the same names
with the policy's tag (default: its name) so that all keys of one policy share a Redis
Cluster slot and one script can touch them all. A key is written with its kind, so that
keys are told apart as locally: ``s:<utf-8>`` (str), ``b:<bytes>`` (bytes), ``i:<decimal>``
(int, bool, numpy integer).

Leases (``RedisLimiter(..., lease=0.05)``): a process takes a slice of each rate's
burst from Redis in one call and serves it from a local Rust bucket (``rq.Limiter``),
then gives back the unused part that is still ahead. Over any window of length ``d``
the units admitted by all processes stay within ``burst + rate * d + N * L`` (``N``
processes holding leases of at most ``L`` units); over a run that starts from a full
bucket they stay within ``burst + rate * d``.

Failures: ``on_failure="fail_closed"`` (refuse; the default), ``"fail_open"`` (admit)
or ``"local"`` (decide on a local ``rq.Limiter`` at ``local_fraction`` of the rate).
A :class:`CircuitBreaker` stops calling a dead or slow Redis: after a failure, calls
take the failure path at once until ``retry_interval`` has passed, then one call probes
Redis; so a dead server costs at most one timeout per interval. Give the client short
timeouts and no retries (see :func:`connect`).

Test clocks: ``clock=rq.ManualClock()`` makes the scripts decide at that clock's time
(passed to the script, in microseconds) instead of ``TIME``; it is meant for tests that
compare Redis with the core call by call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import math
import operator
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Generic, Literal, SupportsIndex, TypeAlias, TypeVar, cast

import redis
import redis.asyncio
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from ._errors import CostTooLarge, Overloaded
from ._ratequeue import (
    KeyedLimiter,
    Limiter,
    ManualClock,
    Permit,
    Policy,
    PolicyPermit,
    Rate,
    Reservation,
)

__all__ = [
    "GCRA_LUA",
    "GCRA_SHA",
    "AsyncRedisKeyedLimiter",
    "AsyncRedisLimiter",
    "AsyncRedisPolicy",
    "CircuitBreaker",
    "OnFailure",
    "RedisKeyedLimiter",
    "RedisLimiter",
    "RedisPermit",
    "RedisPolicy",
    "RedisReservation",
    "RedisUnavailable",
    "connect",
    "connect_async",
]

log = logging.getLogger("ratequeue.redis")

OnFailure: TypeAlias = Literal["fail_closed", "fail_open", "local"]
Key: TypeAlias = str | bytes | int | SupportsIndex
T = TypeVar("T")

GCRA_LUA: Final = r"""
-- ratequeue: GCRA buckets in Redis; one script, several operations, one round trip.
--
-- A bucket is a string key holding its TAT (theoretical arrival time) in integer
-- microseconds since the Unix epoch of the server's clock (about 1.8e15, exact in a Lua
-- double below 2^53). No key means a full bucket: every write sets PX to the time until
-- the bucket is full again, so idle keys cost no memory.
--
-- T (take now, on TIME): ARGV[2..] per key: inc, tau -> 0, or wait * 64 + first refusing key
-- Other ops: ARGV[1] op; ARGV[2] now: '' = the server's TIME, else microseconds (test
-- clocks only); ARGV[3] ms added to every expiry, ARGV[4], ARGV[5] per op, then per key:
-- t  take:   max_wait (-1: none), undo (1/0) | inc, tau, shadow -> {ok, wait, key|mask, undo..}
-- p  peek:   -, -  | inc, tau                                   -> {wait, used...}
-- a  adjust: -, -  | delta (signed)                             -> 1
-- u  undo:   -, -  | expected TAT, previous TAT ('' = full)     -> how many undone
-- l  lease:  -, -  | T, tau, units, need, give back from, to, version
--                                               -> {ok, wait, (k, start, debit, version)..}
local op = ARGV[1]
local now
if op == 'T' or ARGV[2] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[2])
end
local n = #KEYS

-- max(TAT, now) and the stored value ('' when absent or already full).
local function tat(key)
  local v = redis.call('GET', key)
  if v then
    local x = tonumber(v)
    if x > now then return x, v end
  end
  return now, ''
end

if op == 'T' then
  -- The fast path of try_acquire: one integer back, 0 = admitted, else
  -- wait * 64 + the first refusing key (at most 63).
  local ys = {}
  for i = 1, n do
    local y = tat(KEYS[i]) + ARGV[2 * i]
    local w = y - ARGV[2 * i + 1] - now
    if w > 0 then
      -- Refused: the wait is the latest any bucket needs; nothing is written.
      for k = i + 1, n do
        local z = tat(KEYS[k]) + ARGV[2 * k] - ARGV[2 * k + 1] - now
        if z > w then w = z end
      end
      if i > 63 then i = 63 end
      return w * 64 + i
    end
    ys[i] = y
  end
  for i = 1, n do
    local y = ys[i]
    if y > now then redis.call('SET', KEYS[i], y, 'PX', math.ceil((y - now) / 1000)) end
  end
  return 0
end

local keep = tonumber(ARGV[3])

-- Writes TAT x with its expiry; a full bucket is no key. Returns the stored value.
local function store(key, x)
  if x <= now then
    redis.call('DEL', key)
    return ''
  end
  redis.call('SET', key, x, 'PX', math.ceil((x - now) / 1000) + keep)
  return string.format('%d', x)
end

if op == 't' then
  local max_wait, undo = tonumber(ARGV[4]), ARGV[5] == '1'
  local xs, olds = {}, {}
  local s, slow, first = now, 0, 0
  for i = 1, n do
    local j = 3 * i + 3
    local x, v = tat(KEYS[i])
    xs[i] = x
    olds[i] = v
    if ARGV[j + 2] == '0' then
      local g = x + ARGV[j] - ARGV[j + 1]
      if g > now and first == 0 then first = i end
      if g > s then
        s = g
        slow = i
      end
    end
  end
  local wait = s - now
  if max_wait >= 0 and wait > max_wait then
    if max_wait == 0 then slow = first end
    return {0, wait, slow}
  end
  -- Granted at s: every bucket is debited at s (TAT = max(TAT, s) + inc).
  local out = {1, wait, 0}
  local mask = 0
  for i = 1, n do
    local j = 3 * i + 3
    local x = xs[i]
    if x < s then x = s end
    local y = x + ARGV[j]
    if ARGV[j + 2] == '1' and y - ARGV[j + 1] > s then
      -- A shadow level that would refuse: counted, not debited.
      mask = mask + 2 ^ (i - 1)
      if undo then
        out[#out + 1] = ''
        out[#out + 1] = ''
      end
    else
      local v = store(KEYS[i], y)
      if undo then
        out[#out + 1] = olds[i]
        out[#out + 1] = v
      end
    end
  end
  out[3] = mask
  return out
elseif op == 'p' then
  local out = {0}
  local w = 0
  for i = 1, n do
    local j = 2 * i + 4
    local x = tat(KEYS[i])
    local g = x + ARGV[j] - ARGV[j + 1] - now
    if g > w then w = g end
    out[i + 1] = x - now
  end
  out[1] = w
  return out
elseif op == 'a' then
  for i = 1, n do
    local d = tonumber(ARGV[5 + i])
    if d ~= 0 then store(KEYS[i], tat(KEYS[i]) + d) end
  end
  return 1
elseif op == 'u' then
  -- Takes a debit back while it is still the bucket's latest (nothing came after it).
  local c = 0
  for i = 1, n do
    local j = 2 * i + 4
    local e = ARGV[j]
    if e ~= '' and redis.call('GET', KEYS[i]) == e then
      local o = ARGV[j + 1]
      if o == '' then
        redis.call('DEL', KEYS[i])
      else
        store(KEYS[i], tonumber(o))
      end
      c = c + 1
    end
  end
  return c
elseif op == 'l' then
  -- KEYS: the buckets, then one version key per bucket (the last give-back, or none).
  local m = n / 2
  local xs, dirty = {}, {}
  local wait = 0
  for i = 1, m do
    local j = 7 * i - 1
    local x = tat(KEYS[i])
    if ARGV[j + 5] ~= '' and x > now then
      -- Give back the unused part of the previous lease that is still ahead. Its
      -- recorded place is exact only while no other give-back moved the schedule
      -- (same version); otherwise nothing is given back (never more than was taken).
      local v = redis.call('GET', KEYS[m + i]) or ''
      local h, l = tonumber(ARGV[j + 5]), tonumber(ARGV[j + 4])
      if l < now then l = now end
      if v == ARGV[j + 6] and h > l then
        local nv = now
        if v ~= '' and tonumber(v) >= now then nv = tonumber(v) + 1 end
        redis.call('SET', KEYS[m + i], nv, 'PX', math.ceil((x - now) / 1000) + keep)
        x = x - (h - l)
        if x < now then x = now end
        dirty[i] = true
      end
    end
    xs[i] = x
    local g = x + math.floor(ARGV[j + 3] * ARGV[j] + 0.5) - ARGV[j + 1] - now
    if g > wait then wait = g end
  end
  if wait > 0 then
    for i = 1, m do
      if dirty[i] then store(KEYS[i], xs[i]) end
    end
    return {0, wait}
  end
  local out = {1, 0}
  for i = 1, m do
    local j = 7 * i - 1
    local x, t, tau = xs[i], tonumber(ARGV[j]), tonumber(ARGV[j + 1])
    local want, need = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3])
    local k = math.floor((tau - (x - now)) / t)
    if k > want then k = want end
    local d = math.floor(k * t + 0.5)
    while k > need and x + d - tau > now do
      k = k - 1
      d = math.floor(k * t + 0.5)
    end
    if k < need then
      k = need
      d = math.floor(k * t + 0.5)
    end
    if d > 0 or dirty[i] then store(KEYS[i], x + d) end
    out[#out + 1] = k
    out[#out + 1] = x
    out[#out + 1] = d
    out[#out + 1] = redis.call('GET', KEYS[m + i]) or ''
  end
  return out
end
return redis.error_reply('ratequeue: unknown op ' .. tostring(op))
"""
GCRA_SHA: Final = hashlib.sha1(GCRA_LUA.encode()).hexdigest()

# A manual clock's time is not the server's: its keys live this much longer (ms).
_TEST_KEEP_MS: Final = 3_600_000
# Replies that mean "Redis cannot serve now" rather than "this request is wrong".
_DOWN_REPLIES: Final = frozenset(
    {"LOADING", "BUSY", "MASTERDOWN", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "NOREPLICAS"}
)
_DOWN_ERRORS: Final = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
)
_CONFIG_ERRORS: Final = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
)
_MAX_LOCAL_PERIOD: Final = 86_400.0


def connect(url: str = "redis://127.0.0.1:6379/0", *, timeout: float = 0.1) -> redis.Redis:
    """A client fit for a limiter: socket timeouts of ``timeout`` s and no retries.

    redis-py retries failed commands 3 times with a backoff of up to seconds by
    default; a limiter would rather take its failure path at once (the circuit breaker
    then spares the following calls).
    """
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


def connect_async(
    url: str = "redis://127.0.0.1:6379/0", *, timeout: float = 0.1
) -> redis.asyncio.Redis:
    """The asyncio version of :func:`connect`."""
    from redis.asyncio.retry import Retry as AsyncRetry

    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=AsyncRetry(NoBackoff(), 0),
    )


class RedisUnavailable(Overloaded):
    """Refused because Redis is unreachable or slow and the limiter fails closed.

    ``retry_after`` is the time until the circuit breaker lets a call try Redis again.
    """


class CircuitBreaker:
    """Stops calling Redis after a failure, for ``retry_interval`` seconds.

    States: ``closed`` (calls go to Redis), ``open`` (calls take the failure path at
    once) and ``half-open`` (one call probes Redis; the others still take the failure
    path). A success closes it, a failure opens it again. Share one breaker between
    limiters that use the same server so that they learn of an outage together.
    """

    def __init__(self, retry_interval: float = 1.0) -> None:
        if not (retry_interval >= 0 and math.isfinite(retry_interval)):
            raise ValueError(f"retry_interval={retry_interval!r} must be >= 0 seconds")
        self.retry_interval = float(retry_interval)
        self._lock = threading.Lock()
        self._open_until: float | None = None
        self._probing = False
        self.failures = 0
        self.opened = 0
        self.last_error: BaseException | None = None

    @property
    def state(self) -> str:
        if self._open_until is None:
            return "closed"
        return "half-open" if self._probing else "open"

    def retry_after(self) -> float:
        """Seconds until a call may probe Redis again (0.0 when closed)."""
        until = self._open_until
        return 0.0 if until is None else max(0.0, until - time.monotonic())

    def allow(self) -> bool:
        """True when this call may use Redis (when open: true for one probe per interval)."""
        if self._open_until is None:
            return True
        now = time.monotonic()
        with self._lock:
            until = self._open_until
            if until is None:
                return True
            if now >= until and not self._probing:
                self._probing = True
                return True
            return False

    def success(self) -> None:
        if self._open_until is None:
            return
        with self._lock:
            if self._open_until is not None:
                self._open_until = None
                self._probing = False
                log.warning("ratequeue: Redis is reachable again; circuit closed")

    def failure(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self.last_error = exc
            if self._open_until is None:
                self.opened += 1
                log.warning(
                    "ratequeue: Redis failed (%s: %s); circuit open, next try in %.3g s",
                    type(exc).__name__,
                    exc,
                    self.retry_interval,
                )
            self._open_until = time.monotonic() + self.retry_interval
            self._probing = False

    def abandon(self) -> None:
        """A probe ended without an answer (cancelled): let another call probe."""
        with self._lock:
            self._probing = False

    def stats(self) -> dict[str, Any]:
        return {"state": self.state, "failures": self.failures, "opened": self.opened}


class _Down(Exception):
    """Redis could not answer (or the breaker did not let the call try)."""


def _is_down_reply(e: redis.exceptions.ResponseError) -> bool:
    head = str(e).split(" ", 1)[0].upper()
    return head in _DOWN_REPLIES or isinstance(e, redis.exceptions.ReadOnlyError)


def _key_bytes(k: Key, name: str = "key") -> bytes:
    """A key's identity in Redis key names: its kind and exact value (``s:``, ``b:``, ``i:``)."""
    if isinstance(k, str):
        return b"s:" + k.encode()
    if isinstance(k, bytes):
        return b"b:" + k
    try:
        return b"i:%d" % operator.index(k)
    except TypeError:
        raise TypeError(f"{name} must be a str, bytes or int, got {type(k).__name__}") from None


def _cost(name: str, v: object) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        c = operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None
    if c < 0:
        raise ValueError(f"{name}={c} must be >= 0")
    return c


def _arg_bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _pack(args: Sequence[Any]) -> bytes:
    """A command in RESP, as redis-py would send it."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(_arg_bytes(a)) for a in args)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _Bucket:
    """One rate as the script sees it: the interval T and tolerance tau in microseconds."""

    __slots__ = ("burst", "inc1", "interval", "rate", "tau", "unit")

    def __init__(self, rate: Rate) -> None:
        self.rate = rate
        self.unit = rate.unit
        self.burst = rate.burst
        self.interval = rate.per * 1e6 / rate.amount
        self.tau = round(rate.burst * self.interval)
        self.inc1 = max(1, round(self.interval))

    def inc(self, cost: int) -> int:
        """The debit of ``cost`` in whole microseconds: round(cost * T), at least 1 us."""
        if cost == 1:
            return self.inc1
        return max(1, round(cost * self.interval)) if cost else 0

    def check(self, cost: int, where: str = "") -> None:
        if cost > self.burst:
            raise CostTooLarge(
                f"cost {cost} {self.unit} exceeds the burst of {self.burst} {self.unit}"
                f"{where} and can never be admitted"
            )


def _scaled(rate: Rate, fraction: float) -> Rate:
    return Rate(
        rate.amount * fraction,
        per=rate.per,
        burst=max(1, math.ceil(rate.burst * fraction)),
        unit=rate.unit,
    )


def _units_of(rates: Sequence[Rate]) -> list[str]:
    units: list[str] = []
    for r in rates:
        if r.unit not in units:
            units.append(r.unit)
    return units


def _parse_costs(units: Sequence[str], n: int | None, kw: Mapping[str, object]) -> list[int]:
    """Costs per unit, with the rules of ``rq.Limiter``."""
    costs: list[int | None] = [None] * len(units)
    if n is not None:
        costs[0] = _cost(units[0], n)
    for k, v in kw.items():
        try:
            i = units.index(k)
        except ValueError:
            shown = ", ".join(f'"{u}"' for u in units)
            raise TypeError(
                f'unexpected keyword "{k}": this limiter counts units [{shown}]'
            ) from None
        if costs[i] is not None:
            raise TypeError(f'cost for unit "{k}" given twice')
        costs[i] = _cost(k, v)
    out: list[int] = []
    for u, c in zip(units, costs, strict=True):
        if c is None:
            if u == "requests" or len(units) == 1:
                c = 1
            else:
                raise TypeError(f'missing cost for unit "{u}" (pass {u}=...)')
        out.append(c)
    return out


class _Clock:
    """Where a limiter reads time: real (the server's TIME) or a test ManualClock."""

    __slots__ = ("manual",)

    def __init__(self, clock: ManualClock | None) -> None:
        if clock is not None and not isinstance(clock, ManualClock):
            raise TypeError(
                "clock must be a ratequeue.ManualClock (tests only); "
                "Redis limiters otherwise use the server's TIME"
            )
        self.manual = clock

    def now_arg(self) -> str:
        return "" if self.manual is None else str(self.manual.now_ns() // 1000)

    @property
    def keep_ms(self) -> int:
        return 0 if self.manual is None else _TEST_KEEP_MS

    def monotonic(self) -> float:
        return time.monotonic() if self.manual is None else self.manual.now()

    def sleep_target(self, start_ns: int, wait_us: int) -> None:
        """On a manual clock, waiting moves the clock to the grant time."""
        m = self.manual
        assert m is not None
        target = start_ns + wait_us * 1000
        now = m.now_ns()
        if target > now:
            m.advance((target - now) / 1e9)


class _Engine:
    """Shared state of every Redis limiter: client, breaker, failure policy, counters."""

    def __init__(
        self,
        client: Any,
        *,
        on_failure: OnFailure,
        local_fraction: float,
        breaker: CircuitBreaker | None,
        clock: ManualClock | None,
    ) -> None:
        if on_failure not in ("fail_closed", "fail_open", "local"):
            raise ValueError(
                f"on_failure={on_failure!r} must be 'fail_closed', 'fail_open' or 'local'"
            )
        if not (0 < local_fraction <= 1):
            raise ValueError(f"local_fraction={local_fraction!r} must be in (0, 1]")
        self.client = client
        self.on_failure: OnFailure = on_failure
        self.local_fraction = float(local_fraction)
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.clock = _Clock(clock)
        self.calls = 0
        self.failures = 0
        self.fallbacks = 0
        # A plain sync client with a pool: the hot paths send commands packed once, on a
        # pooled connection, without redis-py's per-command packing and retry wrapper.
        pool = getattr(client, "connection_pool", None)
        self.raw = (
            type(client) is redis.Redis
            and getattr(client, "connection", None) is None
            and isinstance(pool, redis.ConnectionPool)
        )
        self._conn_args: tuple[str, ...] = ()
        if self.raw and pool is not None:
            params = list(inspect.signature(pool.get_connection).parameters.values())
            if params and params[0].default is inspect.Parameter.empty:
                self._conn_args = ("EVALSHA",)

    def head(self, nkeys: int) -> tuple[Any, ...]:
        return ("EVALSHA", GCRA_SHA, nkeys)

    def _send(self, cmd: tuple[Any, ...] | bytes) -> Any:
        if type(cmd) is not bytes:
            return self.client.execute_command(*cmd)
        pool = self.client.connection_pool
        conn = pool.get_connection(*self._conn_args)
        try:
            conn.send_packed_command([cmd])
            return conn.read_response()
        finally:
            pool.release(conn)

    def run(self, cmd: tuple[Any, ...] | bytes) -> Any:
        """Runs the script (loading it on NOSCRIPT); raises _Down when Redis can't answer.

        ``cmd``: the arguments of EVALSHA, or (when ``raw``) the command packed in RESP.
        """
        br = self.breaker
        if not br.allow():
            raise _Down()
        self.calls += 1
        try:
            try:
                r = self._send(cmd)
            except redis.exceptions.NoScriptError:
                self.client.script_load(GCRA_LUA)
                r = self._send(cmd)
        except _CONFIG_ERRORS:
            br.abandon()
            raise  # a wrong password or ACL is a mistake to see, not an outage
        except _DOWN_ERRORS as e:
            self.failures += 1
            br.failure(e)
            raise _Down() from e
        except redis.exceptions.ResponseError as e:
            if not _is_down_reply(e):
                br.success()
                raise
            self.failures += 1
            br.failure(e)
            raise _Down() from e
        except BaseException:
            br.abandon()
            raise
        br.success()
        return r

    async def arun(self, cmd: tuple[Any, ...] | bytes) -> Any:
        assert type(cmd) is not bytes, "asyncio clients take argument tuples"
        br = self.breaker
        if not br.allow():
            raise _Down()
        self.calls += 1
        try:
            try:
                r = await self.client.execute_command(*cmd)
            except redis.exceptions.NoScriptError:
                await self.client.script_load(GCRA_LUA)
                r = await self.client.execute_command(*cmd)
        except _CONFIG_ERRORS:
            br.abandon()
            raise  # a wrong password or ACL is a mistake to see, not an outage
        except _DOWN_ERRORS as e:
            self.failures += 1
            br.failure(e)
            raise _Down() from e
        except redis.exceptions.ResponseError as e:
            if not _is_down_reply(e):
                br.success()
                raise
            self.failures += 1
            br.failure(e)
            raise _Down() from e
        except BaseException:
            br.abandon()
            raise
        br.success()
        return r

    def start_ns(self) -> int:
        m = self.clock.manual
        return 0 if m is None else m.now_ns()

    def wait(self, r: RedisReservation, start_ns: int) -> None:
        """Sleeps once until the grant (a manual clock is moved there instead)."""
        if r.delay <= 0:
            return
        if self.clock.manual is not None:
            self.clock.sleep_target(start_ns, round(r.delay * 1e6))
            return
        try:
            time.sleep(r.delay)
        except BaseException:
            r.cancel()
            raise

    async def await_wait(self, r: RedisReservation, start_ns: int) -> None:
        """One asyncio.sleep until the grant; a cancellation gives the reservation back."""
        if r.delay <= 0:
            return
        if self.clock.manual is not None:
            self.clock.sleep_target(start_ns, round(r.delay * 1e6))
            return
        try:
            await asyncio.sleep(r.delay)
        except BaseException:
            await asyncio.shield(r.cancel_async())
            raise

    def unavailable(self, what: str) -> RedisUnavailable:
        return RedisUnavailable(
            f"overloaded: Redis is unavailable and {what} fails closed",
            self.breaker.retry_after(),
        )

    def stats(self) -> dict[str, Any]:
        return {
            "redis_calls": self.calls,
            "redis_failures": self.failures,
            "fallback_decisions": self.fallbacks,
            "on_failure": self.on_failure,
            "breaker": self.breaker.stats(),
        }


# --------------------------------------------------------------------------------------
# Grants


class RedisPermit:
    """What a Redis limiter granted: ``waited`` seconds; ``settle`` corrects the costs.

    A context manager for symmetry with ``rq.Permit`` (rates hold nothing to release).
    """

    __slots__ = ("_adjust", "_costs", "delay", "local")

    def __init__(
        self,
        delay: float,
        costs: dict[str, int],
        adjust: Callable[[dict[str, int], dict[str, int]], Any] | None,
        local: Permit | PolicyPermit | None = None,
    ) -> None:
        self.delay = delay
        self._costs = costs
        self._adjust = adjust
        self.local = local

    @property
    def waited(self) -> float:
        """Seconds from the request to the grant (the reservation's delay)."""
        return self.delay

    @property
    def costs(self) -> dict[str, int]:
        return dict(self._costs)

    def _settle_args(self, costs: dict[str, Any]) -> dict[str, int] | None:
        actual = dict(self._costs)
        for k, v in costs.items():
            if k not in actual:
                raise TypeError(f'unexpected keyword "{k}": this permit holds {sorted(actual)}')
            actual[k] = _cost(k, v)
        if actual == self._costs:
            return None
        return actual

    def settle(self, **costs: int) -> None:
        """Correct estimated costs to actual ones: refund the difference or charge it."""
        actual = self._settle_args(costs)
        if actual is None:
            return
        if self.local is not None:
            self.local.settle(**actual)
        elif self._adjust is not None:
            r = self._adjust(self._costs, actual)
            if isinstance(r, Coroutine):
                r.close()
                raise TypeError("a permit of an asyncio limiter: use await permit.settle_async()")
        self._costs = actual

    async def settle_async(self, **costs: int) -> None:
        """``settle`` for the asyncio limiters."""
        actual = self._settle_args(costs)
        if actual is None:
            return
        if self.local is not None:
            self.local.settle(**actual)
        elif self._adjust is not None:
            r = self._adjust(self._costs, actual)
            if isinstance(r, Awaitable):
                await r
        self._costs = actual

    def __enter__(self) -> RedisPermit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def __repr__(self) -> str:
        return f"RedisPermit(delay={self.delay:.6f}, costs={self._costs})"


class RedisReservation:
    """A place in a Redis schedule: proceed after ``delay`` seconds.

    ``cancel()`` before the grant time gives the cost back on each bucket where no later
    debit was made (the refund rule of ``rq.Reservation``); ``cancel_async()`` for the
    asyncio limiters.
    """

    __slots__ = ("_at", "_cancelled", "_engine", "_keys", "_local", "_undo", "delay", "permit")

    def __init__(
        self,
        delay: float,
        permit: RedisPermit,
        engine: _Engine | None,
        keys: Sequence[bytes] = (),
        undo: Sequence[str] = (),
        local: Reservation | PolicyPermit | None = None,
    ) -> None:
        self.delay = delay
        self.permit = permit
        self._engine = engine
        self._keys = list(keys)
        self._undo = list(undo)
        self._local = local
        self._cancelled = False
        self._at = (engine.clock.monotonic() if engine else time.monotonic()) + delay

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _cmd(self) -> tuple[Any, ...] | None:
        if self._cancelled or self._engine is None:
            return None
        self._cancelled = True
        if self._engine.clock.monotonic() >= self._at or not self._keys:
            return None
        e = self._engine
        pairs: list[str] = []
        for i in range(0, len(self._undo), 2):
            # The script reported (before, after); undo wants (expected, previous).
            pairs += (self._undo[i + 1], self._undo[i])
        return (
            *e.head(len(self._keys)),
            *self._keys,
            "u",
            e.clock.now_arg(),
            e.clock.keep_ms,
            0,
            0,
            *pairs,
        )

    def _cancel_local(self) -> bool:
        if self._local is None or self._cancelled:
            return False
        self._cancelled = True
        loc = self._local
        if isinstance(loc, Reservation):
            return loc.cancel()
        loc.cancel()
        return True

    def cancel(self) -> bool:
        """Gives the capacity back if still possible; True if anything was returned."""
        if self._local is not None:
            return self._cancel_local()
        cmd = self._cmd()
        if cmd is None or self._engine is None:
            return False
        try:
            return int(self._engine.run(cmd)) > 0
        except _Down:
            return False

    async def cancel_async(self) -> bool:
        if self._local is not None:
            return self._cancel_local()
        cmd = self._cmd()
        if cmd is None or self._engine is None:
            return False
        try:
            return int(await self._engine.arun(cmd)) > 0
        except _Down:
            return False

    def __repr__(self) -> str:
        return f"RedisReservation(delay={self.delay:.6f}, cancelled={self._cancelled})"


class _AsyncAcquire(Generic[T]):
    """An awaitable that is also an async context manager (like ``rq.Acquiring``)."""

    __slots__ = ("_factory", "_value")

    def __init__(self, factory: Callable[[], Awaitable[T]]) -> None:
        self._factory = factory
        self._value: T | None = None

    def __await__(self) -> Generator[Any, None, T]:
        return self._await().__await__()

    async def _await(self) -> T:
        return await self._factory()

    async def __aenter__(self) -> T:
        self._value = await self._factory()
        return self._value

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


# --------------------------------------------------------------------------------------
# Reply handling shared by every limiter


class _Take:
    """A parsed reply of the take script."""

    __slots__ = ("level", "mask", "ok", "undo", "wait_us")

    def __init__(self, reply: Sequence[Any] | int) -> None:
        if isinstance(reply, int):  # the fast path's one integer
            self.ok = reply == 0
            self.wait_us = reply >> 6
            self.level = reply & 63
            self.mask = 0
            self.undo: list[str] = []
            return
        self.ok = int(reply[0]) == 1
        self.wait_us = int(reply[1])
        v = int(reply[2]) if len(reply) > 2 else 0
        self.level = 0 if self.ok else v
        self.mask = v if self.ok else 0
        self.undo = [_text(x) for x in reply[3:]]


def _take_args(
    engine: _Engine,
    buckets: Sequence[_Bucket],
    costs: Sequence[int],
    shadow: Sequence[bool] | None,
    max_wait_us: int,
    undo: bool,
) -> list[Any]:
    """ARGV of a take: the fast 'T' form when possible."""
    if (
        max_wait_us == 0
        and not undo
        and engine.clock.manual is None
        and not (shadow and any(shadow))
    ):
        args: list[Any] = [b"T"]
        for b, c in zip(buckets, costs, strict=True):
            args.append(b.inc(c))
            args.append(b.tau)
        return args
    args = ["t", engine.clock.now_arg(), engine.clock.keep_ms, max_wait_us, 1 if undo else 0]
    for i, (b, c) in enumerate(zip(buckets, costs, strict=True)):
        args.append(b.inc(c))
        args.append(b.tau)
        args.append("1" if shadow and shadow[i] else "0")
    return args


def _peek_args(engine: _Engine, buckets: Sequence[_Bucket], costs: Sequence[int]) -> list[Any]:
    args: list[Any] = ["p", engine.clock.now_arg(), engine.clock.keep_ms, 0, 0]
    for b, c in zip(buckets, costs, strict=True):
        args.append(b.inc(c))
        args.append(b.tau)
    return args


def _adjust_args(engine: _Engine, deltas: Sequence[int]) -> list[Any]:
    return ["a", engine.clock.now_arg(), engine.clock.keep_ms, 0, 0, *deltas]


def _max_wait_us(max_wait: float | None) -> int:
    if max_wait is None:
        return -1
    if not (max_wait >= 0):
        raise ValueError(f"max_wait={max_wait!r} must be >= 0 seconds")
    if math.isinf(max_wait):
        return -1
    return round(max_wait * 1e6)


def _overloaded(wait_us: int, max_wait_us: int, reason: str = "") -> Overloaded:
    wait = wait_us / 1e6
    mw = max_wait_us / 1e6
    what = reason or f"the wait of {wait:.6f} s exceeds max_wait={mw:.6f} s"
    return Overloaded(f"overloaded: {what}", max(0.0, wait - mw))


# --------------------------------------------------------------------------------------
# Limiter


class _Lease:
    """A slice of a Redis bucket served by a local Rust bucket (no refill within its life)."""

    __slots__ = (
        "deadline",
        "debits",
        "granted",
        "local",
        "names",
        "single",
        "starts",
        "versions",
    )

    def __init__(
        self,
        granted: list[int],
        starts: list[int],
        debits: list[int],
        versions: list[str],
        deadline: float,
        clock: ManualClock | None,
    ) -> None:
        self.granted = granted
        self.starts = starts
        self.debits = debits
        self.versions = versions
        self.deadline = deadline
        self.names = [f"r{i}" for i in range(len(granted))]
        top = max(max(granted), 1)
        # One unit per `per` seconds: never a whole unit within the lease's life.
        per = min(_MAX_LOCAL_PERIOD, 3.0e7 / top)
        rates = [
            Rate(1, per=per, burst=max(k, 1), unit=n)
            for k, n in zip(granted, self.names, strict=True)
        ]
        self.local = Limiter(*rates) if clock is None else Limiter(*rates, clock=clock)
        self.single = len(granted) == 1
        if any(k == 0 for k in granted):
            self.local.try_acquire(
                **{n: 1 if k == 0 else 0 for k, n in zip(granted, self.names, strict=True)}
            )

    def try_take(self, costs: Sequence[int], bucket_unit: Sequence[int]) -> bool:
        try:
            if self.single:
                return self.local.try_acquire(costs[bucket_unit[0]])
            return self.local.try_acquire(
                **{n: costs[u] for n, u in zip(self.names, bucket_unit, strict=True)}
            )
        except CostTooLarge:  # more than this lease holds: a new lease is needed
            return False

    def drain(self) -> list[int]:
        """Takes whatever is left (so no other thread can use it) and returns it per rate."""
        for _ in range(1000):
            rem = [max(0, math.floor(self.local.available(n) + 1e-9)) for n in self.names]
            rem = [min(r, k) for r, k in zip(rem, self.granted, strict=True)]
            if not any(rem) or self.local.try_acquire(**dict(zip(self.names, rem, strict=True))):
                return rem
        return [0] * len(self.names)

    def give_back(
        self, rem: Sequence[int], buckets: Sequence[_Bucket]
    ) -> list[tuple[str, str, str]]:
        """(from, to, version): the unused, latest part of each debit, in microseconds."""
        out = []
        for r, a, d, v, b in zip(
            rem, self.starts, self.debits, self.versions, buckets, strict=True
        ):
            hi = a + d
            lo = hi - min(d, round(r * b.interval))
            out.append((str(lo), str(hi), v) if r > 0 and hi > lo else ("", "", ""))
        return out


class _LimiterBase:
    """Everything of a Redis limiter but the I/O."""

    def __init__(
        self,
        client: Any,
        *rates: Rate,
        name: str,
        tag: str | None = None,
        prefix: str = "rq",
        max_wait: float | None = None,
        on_failure: OnFailure = "fail_closed",
        local_fraction: float = 1.0,
        breaker: CircuitBreaker | None = None,
        lease: float | None = None,
        lease_ttl: float = 1.0,
        clock: ManualClock | None = None,
    ) -> None:
        if not rates:
            raise TypeError("at least one Rate is needed")
        for r in rates:
            if not isinstance(r, Rate):
                raise TypeError(f"rates must be ratequeue.Rate, got {type(r).__name__}")
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty string (it names the Redis keys)")
        self._engine = _Engine(
            client,
            on_failure=on_failure,
            local_fraction=local_fraction,
            breaker=breaker,
            clock=clock,
        )
        self.name = name
        self.tag = tag if tag is not None else name
        self.prefix = prefix
        self.max_wait = max_wait
        self._buckets = [_Bucket(r) for r in rates]
        self._units = _units_of(rates)
        self._bucket_unit = [self._units.index(b.unit) for b in self._buckets]
        self.keys = [f"{prefix}:{{{self.tag}}}:{name}:{i}".encode() for i in range(len(rates))]
        self._version_keys = [k + b":v" for k in self.keys]
        self._head = self._engine.head(len(self.keys))
        try:
            self._default: list[int] | None = _parse_costs(self._units, None, {})
        except TypeError:
            self._default = None
        self._fast: tuple[Any, ...] | bytes | None = None
        if self._default is not None and clock is None:
            # The whole command of a default try_acquire, encoded once.
            fast = (
                *self._head,
                *self.keys,
                *_take_args(
                    self._engine, self._buckets, self._per_bucket(self._default), None, 0, False
                ),
            )
            self._fast = _pack(fast) if self._engine.raw else fast
        self._local: Limiter | None = None
        if on_failure == "local":
            scaled = [_scaled(r, local_fraction) for r in rates]
            self._local = Limiter(*scaled) if clock is None else Limiter(*scaled, clock=clock)
        # Leases.
        if lease is not None and not (0 < lease <= 1):
            raise ValueError(f"lease={lease!r} must be a fraction of the burst in (0, 1]")
        if not (lease_ttl > 0):
            raise ValueError(f"lease_ttl={lease_ttl!r} must be > 0 seconds")
        self.lease = lease
        self.lease_ttl = float(lease_ttl)
        self._lease_units = (
            [max(1, math.floor(b.burst * lease)) for b in self._buckets] if lease else []
        )
        self._lease_grain = [(k + 1) // 2 for k in self._lease_units]
        if self._lease_units:
            top = max(self._lease_units)
            if min(_MAX_LOCAL_PERIOD, 3.0e7 / top) < 2 * lease_ttl:
                raise ValueError(
                    f"lease of {top} units is too large for lease_ttl={lease_ttl} s "
                    "(the local bucket could refill within the lease's life)"
                )
        self._lease: _Lease | None = None
        if self._lease_units:
            _LEASED.add(self)
        # A refused renewal: refuse costs at least these until then (no round trip).
        self._dry_until = -math.inf
        self._dry_costs: list[int] = []
        self._leases = 0
        self._lease_lock = threading.Lock()
        self._admitted = 0
        self._refused = 0

    # -- arguments

    @property
    def rates(self) -> list[Rate]:
        return [b.rate for b in self._buckets]

    @property
    def units(self) -> list[str]:
        return list(self._units)

    @property
    def breaker(self) -> CircuitBreaker:
        return self._engine.breaker

    @property
    def on_failure(self) -> OnFailure:
        return self._engine.on_failure

    def _costs(self, n: int | None, kw: Mapping[str, object]) -> list[int]:
        if n is None and not kw and self._default is not None:
            return self._default
        return _parse_costs(self._units, n, kw)

    def _per_bucket(self, costs: Sequence[int]) -> list[int]:
        out = [costs[u] for u in self._bucket_unit]
        for b, c in zip(self._buckets, out, strict=True):
            b.check(c)
        return out

    def _named(self, costs: Sequence[int]) -> dict[str, int]:
        return dict(zip(self._units, costs, strict=True))

    def _take_cmd(self, costs: list[int], max_wait_us: int, undo: bool) -> tuple[Any, ...] | bytes:
        if costs is self._default and self._fast is not None and max_wait_us == 0 and not undo:
            return self._fast
        per = self._per_bucket(costs)
        return (
            *self._head,
            *self.keys,
            *_take_args(self._engine, self._buckets, per, None, max_wait_us, undo),
        )

    def _peek_cmd(self, costs: list[int]) -> tuple[Any, ...]:
        per = self._per_bucket(costs)
        return (*self._head, *self.keys, *_peek_args(self._engine, self._buckets, per))

    def _adjust_cmd(self, est: dict[str, int], actual: dict[str, int]) -> tuple[Any, ...]:
        deltas = [b.inc(actual[b.unit]) - b.inc(est[b.unit]) for b in self._buckets]
        return (*self._head, *self.keys, *_adjust_args(self._engine, deltas))

    # -- outcomes

    def _tried(self, reply: Sequence[Any] | int) -> bool:
        ok = reply == 0 if isinstance(reply, int) else int(reply[0]) == 1
        if ok:
            self._admitted += 1
        else:
            self._refused += 1
        return ok

    def _fallback_try(self, costs: list[int]) -> bool:
        e = self._engine
        e.fallbacks += 1
        if e.on_failure == "fail_open":
            return True
        if e.on_failure == "fail_closed" or self._local is None:
            return False
        try:
            return self._local.try_acquire(**self._named(costs))
        except CostTooLarge:
            return False

    def _granted(self, take: _Take, costs: list[int], adjust: Callable[..., Any]) -> RedisPermit:
        self._admitted += 1
        return RedisPermit(take.wait_us / 1e6, self._named(costs), adjust)

    def _reservation(
        self, reply: Sequence[Any], costs: list[int], mw: int, adjust: Callable[..., Any]
    ) -> RedisReservation:
        take = _Take(reply)
        if not take.ok:
            self._refused += 1
            raise _overloaded(take.wait_us, mw)
        permit = self._granted(take, costs, adjust)
        return RedisReservation(permit.delay, permit, self._engine, self.keys, take.undo)

    def _fallback_reserve(self, costs: list[int], max_wait: float | None) -> RedisReservation:
        e = self._engine
        e.fallbacks += 1
        named = self._named(costs)
        if e.on_failure == "fail_open":
            return RedisReservation(0.0, RedisPermit(0.0, named, None), None)
        if e.on_failure == "fail_closed" or self._local is None:
            raise e.unavailable(f"limiter {self.name!r}")
        r = self._local.reserve(max_wait=max_wait, **named)
        return RedisReservation(r.delay, RedisPermit(r.delay, named, None), None, local=r)

    def _peeked(self, reply: Sequence[Any]) -> tuple[float, list[int]]:
        return int(reply[0]) / 1e6, [int(x) for x in reply[1:]]

    def _available_of(self, used: Sequence[int], unit: str | None) -> float:
        u = self._unit(unit)
        best = math.inf
        for b, x in zip(self._buckets, used, strict=True):
            if b.unit == u:
                best = min(best, (b.tau - x) / b.interval)
        return best

    def _unit(self, unit: str | None) -> str:
        if unit is None:
            return self._units[0]
        if unit not in self._units:
            raise ValueError(f"unit={unit!r} is not one of {self._units}")
        return unit

    def _fallback_available(self, unit: str | None) -> float:
        e = self._engine
        u = self._unit(unit)
        if e.on_failure == "fail_open":
            return float(min(b.burst for b in self._buckets if b.unit == u))
        if e.on_failure == "fail_closed" or self._local is None:
            return 0.0
        return self._local.available(u)

    def _fallback_retry_after(self, costs: list[int]) -> float:
        e = self._engine
        if e.on_failure == "fail_open":
            return 0.0
        if e.on_failure == "fail_closed" or self._local is None:
            return e.breaker.retry_after()
        return self._local.retry_after(**self._named(costs))

    # -- leases

    def _lease_cmd(
        self, costs: Sequence[int], back: Sequence[tuple[str, str, str]]
    ) -> tuple[Any, ...]:
        """Give back the previous lease (``back``) and take a new one for ``costs``."""
        e = self._engine
        args: list[Any] = ["l", e.clock.now_arg(), e.clock.keep_ms, 0, 0]
        for i, b in enumerate(self._buckets):
            # At least half a lease per renewal (or the cost): under contention a renewal
            # waits for half a lease rather than taking the units one by one.
            need = max(costs[self._bucket_unit[i]], self._lease_grain[i]) if costs else 0
            want = max(self._lease_units[i], need) if costs else 0
            lo, hi, v = back[i] if back else ("", "", "")
            args += [repr(b.interval), b.tau, want, need, lo, hi, v]
        return (*self._engine.head(2 * len(self.keys)), *self.keys, *self._version_keys, *args)

    def _lease_from(self, reply: Sequence[Any]) -> _Lease | None:
        if int(reply[0]) != 1:
            return None
        vals = list(reply[2:])
        self._leases += 1
        clock = self._engine.clock
        return _Lease(
            [int(x) for x in vals[0::4]],
            [int(x) for x in vals[1::4]],
            [int(x) for x in vals[2::4]],
            [_text(x) for x in vals[3::4]],
            clock.monotonic() + self.lease_ttl,
            clock.manual,
        )

    def _lease_fast(self, costs: list[int]) -> bool:
        lease = self._lease
        return (
            lease is not None
            and self._engine.clock.monotonic() < lease.deadline
            and lease.try_take(costs, self._bucket_unit)
        )

    def _dry(self, c: list[int]) -> bool:
        """True when a renewal for ``c`` was refused and its retry time has not come."""
        if self._engine.clock.monotonic() >= self._dry_until:
            return False
        if all(x >= y for x, y in zip(c, self._dry_costs, strict=True)):
            self._refused += 1
            return True
        return False

    def _renewed(self, reply: Sequence[Any], c: list[int]) -> bool:
        lease = self._lease_from(reply)
        if lease is None:
            self._refused += 1
            self._dry_until = self._engine.clock.monotonic() + int(reply[1]) / 1e6
            self._dry_costs = list(c)
            return False
        self._dry_until = -math.inf
        self._lease = lease
        ok = lease.try_take(c, self._bucket_unit)
        if ok:
            self._admitted += 1
        return ok

    def _forget_lease(self) -> None:
        """In a forked child: the parent's lease is the parent's (using it would spend it
        twice), so the child starts without one."""
        self._lease = None
        self._dry_until = -math.inf
        self._lease_lock = threading.Lock()

    def _lease_prepare(self) -> list[tuple[str, str, str]]:
        """Drains the current lease; returns what to give back."""
        old = self._lease
        self._lease = None
        if old is None:
            return []
        return old.give_back(old.drain(), self._buckets)

    def stats(self) -> dict[str, Any]:
        s = self._engine.stats()
        s.update(admitted=self._admitted, refused=self._refused, leases=self._leases)
        return s

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rates={self.rates!r})"


_LEASED: weakref.WeakSet[_LimiterBase] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lim in list(_LEASED):
        lim._forget_lease()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class RedisLimiter(_LimiterBase):
    """A rate limiter over one or more rates, decided in Redis (a sync redis-py client).

    ``RedisLimiter(client, *rates, name=...)``: the rates of ``rq.Limiter`` (several units,
    all or nothing), shared by every process using the same ``name`` (and ``tag``,
    ``prefix``). Options: ``max_wait`` (default deadline of ``acquire``), ``on_failure``
    and ``local_fraction``, ``breaker``, ``lease`` (a fraction of each burst taken per
    lease) and ``lease_ttl``, ``clock`` (tests only).
    """

    def _run(self, cmd: tuple[Any, ...]) -> Any:
        return self._engine.run(cmd)

    def try_acquire(self, n: int | None = None, /, **costs: int) -> bool:
        """Admit now or return False; never waits (one round trip, or none in lease mode)."""
        c = self._costs(n, costs)
        if self._lease_units:
            return self._lease_fast(c) or self._lease_slow(c)
        try:
            reply = self._engine.run(self._take_cmd(c, 0, False))
        except _Down:
            return self._fallback_try(c)
        return self._tried(reply)

    def _lease_slow(self, c: list[int]) -> bool:
        with self._lease_lock:
            if self._lease_fast(c):
                return True
            self._per_bucket(c)
            if self._dry(c):
                return False
            back = self._lease_prepare()
            try:
                reply = self._engine.run(self._lease_cmd(c, back))
            except _Down:
                return self._fallback_try(c)
            return self._renewed(reply, c)

    def _adjust(self, est: dict[str, int], actual: dict[str, int]) -> None:
        with contextlib.suppress(_Down):
            self._engine.run(self._adjust_cmd(est, actual))

    def reserve(
        self, n: int | None = None, /, *, max_wait: float | None = None, **costs: int
    ) -> RedisReservation:
        """Reserves in arrival order inside Redis; Overloaded beyond ``max_wait`` (nothing held)."""
        c = self._costs(n, costs)
        mw = _max_wait_us(max_wait)
        try:
            reply = self._engine.run(self._take_cmd(c, mw, True))
        except _Down:
            return self._fallback_reserve(c, max_wait)
        return self._reservation(reply, c, mw, self._adjust)

    def acquire(
        self, n: int | None = None, /, *, timeout: float | None = None, **costs: int
    ) -> RedisPermit:
        """Reserve inside Redis (the script returns the wait) and sleep once.

        ``timeout`` (default: the limiter's ``max_wait``; None waits as long as needed):
        a request whose wait would exceed it is refused at once with Overloaded.
        """
        c = self._costs(n, costs)
        if self._lease_units and self._lease_fast(c):
            return RedisPermit(0.0, self._named(c), self._adjust)
        limit = timeout if timeout is not None else self.max_wait
        mw = _max_wait_us(limit)
        e = self._engine
        start = e.start_ns()
        try:
            reply = e.run(self._take_cmd(c, mw, True))
        except _Down:
            r = self._fallback_reserve(c, limit)
        else:
            r = self._reservation(reply, c, mw, self._adjust)
        e.wait(r, start)
        return r.permit

    def retry_after(self, n: int | None = None, /, **costs: int) -> float:
        """Seconds until the costs would be admitted (0.0 = now); changes nothing."""
        c = self._costs(n, costs)
        try:
            reply = self._engine.run(self._peek_cmd(c))
        except _Down:
            return self._fallback_retry_after(c)
        return self._peeked(reply)[0]

    def available(self, unit: str | None = None) -> float:
        """Units of ``unit`` (default: the first) that could be admitted now."""
        zero = [0] * len(self._units)
        try:
            reply = self._engine.run(self._peek_cmd(zero))
        except _Down:
            return self._fallback_available(unit)
        return self._available_of(self._peeked(reply)[1], unit)

    def reset(self) -> None:
        """Deletes this limiter's keys: every bucket is full again."""
        self._engine.client.delete(*self.keys, *self._version_keys)

    def close(self) -> None:
        """Gives the unused part of the current lease back to Redis."""
        if not self._lease_units:
            return
        with self._lease_lock:
            back = self._lease_prepare()
            if back:
                with contextlib.suppress(_Down):
                    self._engine.run(self._lease_cmd([], back))

    def __enter__(self) -> RedisLimiter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncRedisLimiter(_LimiterBase):
    """:class:`RedisLimiter` for ``redis.asyncio`` clients: the same arguments, awaited."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._alock: asyncio.Lock | None = None

    async def try_acquire(self, n: int | None = None, /, **costs: int) -> bool:
        c = self._costs(n, costs)
        if self._lease_units:
            return self._lease_fast(c) or await self._lease_slow(c)
        try:
            reply = await self._engine.arun(self._take_cmd(c, 0, False))
        except _Down:
            return self._fallback_try(c)
        return self._tried(reply)

    def _lock(self) -> asyncio.Lock:
        if self._alock is None:
            self._alock = asyncio.Lock()
        return self._alock

    async def _lease_slow(self, c: list[int]) -> bool:
        async with self._lock():
            if self._lease_fast(c):
                return True
            self._per_bucket(c)
            if self._dry(c):
                return False
            back = self._lease_prepare()
            try:
                reply = await self._engine.arun(self._lease_cmd(c, back))
            except _Down:
                return self._fallback_try(c)
            return self._renewed(reply, c)

    async def _adjust(self, est: dict[str, int], actual: dict[str, int]) -> None:
        with contextlib.suppress(_Down):
            await self._engine.arun(self._adjust_cmd(est, actual))

    async def reserve(
        self, n: int | None = None, /, *, max_wait: float | None = None, **costs: int
    ) -> RedisReservation:
        c = self._costs(n, costs)
        mw = _max_wait_us(max_wait)
        try:
            reply = await self._engine.arun(self._take_cmd(c, mw, True))
        except _Down:
            return self._fallback_reserve(c, max_wait)
        return self._reservation(reply, c, mw, self._adjust)

    def acquire(
        self, n: int | None = None, /, *, timeout: float | None = None, **costs: int
    ) -> _AsyncAcquire[RedisPermit]:
        """Awaitable (and async context manager): reserve in Redis, then one asyncio.sleep.

        A cancellation while sleeping gives the reservation back (refund rule).
        """
        c = self._costs(n, costs)
        return _AsyncAcquire(lambda: self._acquire(c, timeout))

    acquire_async = acquire

    async def _acquire(self, c: list[int], timeout: float | None) -> RedisPermit:
        if self._lease_units and self._lease_fast(c):
            return RedisPermit(0.0, self._named(c), self._adjust)
        limit = timeout if timeout is not None else self.max_wait
        mw = _max_wait_us(limit)
        e = self._engine
        start = e.start_ns()
        try:
            reply = await e.arun(self._take_cmd(c, mw, True))
        except _Down:
            r = self._fallback_reserve(c, limit)
        else:
            r = self._reservation(reply, c, mw, self._adjust)
        await e.await_wait(r, start)
        return r.permit

    async def retry_after(self, n: int | None = None, /, **costs: int) -> float:
        c = self._costs(n, costs)
        try:
            reply = await self._engine.arun(self._peek_cmd(c))
        except _Down:
            return self._fallback_retry_after(c)
        return self._peeked(reply)[0]

    async def available(self, unit: str | None = None) -> float:
        zero = [0] * len(self._units)
        try:
            reply = await self._engine.arun(self._peek_cmd(zero))
        except _Down:
            return self._fallback_available(unit)
        return self._available_of(self._peeked(reply)[1], unit)

    async def reset(self) -> None:
        await self._engine.client.delete(*self.keys, *self._version_keys)

    async def close(self) -> None:
        if not self._lease_units:
            return
        async with self._lock():
            back = self._lease_prepare()
            if back:
                with contextlib.suppress(_Down):
                    await self._engine.arun(self._lease_cmd([], back))

    async def __aenter__(self) -> AsyncRedisLimiter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


# --------------------------------------------------------------------------------------
# Keyed limiter


class _KeyedBase:
    def __init__(
        self,
        client: Any,
        rate: Rate,
        *,
        name: str,
        tag: str | None = None,
        prefix: str = "rq",
        max_wait: float | None = None,
        on_failure: OnFailure = "fail_closed",
        local_fraction: float = 1.0,
        breaker: CircuitBreaker | None = None,
        max_keys: int | None = None,
        clock: ManualClock | None = None,
    ) -> None:
        if not isinstance(rate, Rate):
            raise TypeError(f"rate must be a ratequeue.Rate, got {type(rate).__name__}")
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty string (it names the Redis keys)")
        self._engine = _Engine(
            client,
            on_failure=on_failure,
            local_fraction=local_fraction,
            breaker=breaker,
            clock=clock,
        )
        self.name = name
        self.tag = tag
        self.prefix = prefix
        self.max_wait = max_wait
        self._bucket = _Bucket(rate)
        self._buckets = [self._bucket]
        self._head = self._engine.head(1)
        self._pre = f"{prefix}:".encode()
        self._mid = f":{name}:".encode()
        self._tagged = f"{prefix}:{{{tag}}}:{name}:".encode() if tag is not None else None
        # A try_acquire of cost 1, packed once but for its key.
        self._fast_tail: bytes | None = None
        self._fast_args: list[Any] = []
        self._fast_pre = b""
        if clock is None:
            self._fast_args = _take_args(self._engine, self._buckets, [1], None, 0, False)
            n = len(self._head) + 1 + len(self._fast_args)
            self._fast_pre = b"*%d\r\n" % n + b"".join(_bulk(_arg_bytes(a)) for a in self._head)
            self._fast_tail = b"".join(_bulk(_arg_bytes(a)) for a in self._fast_args)
        self._local: KeyedLimiter | None = None
        if on_failure == "local":
            s = _scaled(rate, local_fraction)
            kw: dict[str, Any] = {}
            if max_keys is not None:
                kw["max_keys"] = max_keys
            if clock is not None:
                kw["clock"] = clock
            self._local = KeyedLimiter(s, **kw)
        self._admitted = 0
        self._refused = 0

    @property
    def rate(self) -> Rate:
        return self._bucket.rate

    @property
    def breaker(self) -> CircuitBreaker:
        return self._engine.breaker

    def key(self, key: Key) -> bytes:
        """The Redis key of ``key``'s bucket."""
        k = _key_bytes(key)
        if self._tagged is not None:
            return self._tagged + k
        return self._pre + b"{" + k + b"}" + self._mid + k

    def _cost(self, cost: int) -> int:
        c = _cost("cost", cost)
        self._bucket.check(c)
        return c

    def _take_cmd(self, key: Key, c: int, mw: int, undo: bool) -> tuple[Any, ...] | bytes:
        if c == 1 and mw == 0 and not undo and self._fast_tail is not None:
            k = self.key(key)
            if self._engine.raw:
                return self._fast_pre + _bulk(k) + self._fast_tail
            return (*self._head, k, *self._fast_args)
        return (
            *self._head,
            self.key(key),
            *_take_args(self._engine, self._buckets, [c], None, mw, undo),
        )

    def _peek_cmd(self, key: Key, c: int) -> tuple[Any, ...]:
        return (*self._head, self.key(key), *_peek_args(self._engine, self._buckets, [c]))

    def _adjust_cmd(self, key: Key, est: int, actual: int) -> tuple[Any, ...]:
        b = self._bucket
        return (
            *self._head,
            self.key(key),
            *_adjust_args(self._engine, [b.inc(actual) - b.inc(est)]),
        )

    def _tried(self, reply: Sequence[Any] | int) -> bool:
        ok = reply == 0 if isinstance(reply, int) else int(reply[0]) == 1
        if ok:
            self._admitted += 1
        else:
            self._refused += 1
        return ok

    def _fallback_try(self, key: Key, c: int) -> bool:
        e = self._engine
        e.fallbacks += 1
        if e.on_failure == "fail_open":
            return True
        if e.on_failure == "fail_closed" or self._local is None:
            return False
        try:
            return self._local.try_acquire(key, c)
        except CostTooLarge:
            return False

    def _fallback_retry_after(self, key: Key, c: int) -> float:
        e = self._engine
        if e.on_failure == "fail_open":
            return 0.0
        if e.on_failure == "fail_closed" or self._local is None:
            return e.breaker.retry_after()
        return self._local.retry_after(key, c)

    def _fallback_available(self, key: Key) -> float:
        e = self._engine
        if e.on_failure == "fail_open":
            return float(self._bucket.burst)
        if e.on_failure == "fail_closed" or self._local is None:
            return 0.0
        return self._local.available(key)

    def _reservation(
        self, key: Key, reply: Sequence[Any], c: int, mw: int, adjust: Callable[..., Any]
    ) -> RedisReservation:
        take = _Take(reply)
        if not take.ok:
            self._refused += 1
            raise _overloaded(take.wait_us, mw)
        self._admitted += 1
        u = self._bucket.unit
        permit = RedisPermit(take.wait_us / 1e6, {u: c}, adjust)
        return RedisReservation(permit.delay, permit, self._engine, [self.key(key)], take.undo)

    def _fallback_reserve(self, key: Key, c: int) -> RedisReservation:
        """Without Redis: admit (fail_open), refuse (fail_closed) or decide locally now."""
        e = self._engine
        named = {self._bucket.unit: c}
        if e.on_failure == "fail_closed" or (e.on_failure == "local" and self._local is None):
            e.fallbacks += 1
            raise e.unavailable(f"keyed limiter {self.name!r}")
        if not self._fallback_try(key, c):
            assert self._local is not None
            raise Overloaded(
                "overloaded: refused by the local fallback", self._local.retry_after(key, c)
            )
        return RedisReservation(0.0, RedisPermit(0.0, named, None), None)

    def stats(self) -> dict[str, Any]:
        s = self._engine.stats()
        s.update(admitted=self._admitted, refused=self._refused)
        return s

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rate={self.rate!r})"


class RedisKeyedLimiter(_KeyedBase):
    """One Redis bucket per key (user, API key, tenant), like ``rq.KeyedLimiter``.

    Keys are hash-tagged by themselves (spread over a cluster) unless ``tag`` is given.
    ``on_failure="local"`` falls back to an ``rq.KeyedLimiter`` at ``local_fraction``.
    """

    def try_acquire(self, key: Key, cost: int = 1) -> bool:
        c = self._cost(cost)
        try:
            reply = self._engine.run(self._take_cmd(key, c, 0, False))
        except _Down:
            return self._fallback_try(key, c)
        return self._tried(reply)

    def _adjuster(self, key: Key) -> Callable[[dict[str, int], dict[str, int]], None]:
        u = self._bucket.unit

        def adjust(est: dict[str, int], actual: dict[str, int]) -> None:
            with contextlib.suppress(_Down):
                self._engine.run(self._adjust_cmd(key, est[u], actual[u]))

        return adjust

    def reserve(
        self, key: Key, cost: int = 1, *, max_wait: float | None = None
    ) -> RedisReservation:
        c = self._cost(cost)
        mw = _max_wait_us(max_wait)
        try:
            reply = self._engine.run(self._take_cmd(key, c, mw, True))
        except _Down:
            return self._fallback_reserve(key, c)
        return self._reservation(key, reply, c, mw, self._adjuster(key))

    def acquire(self, key: Key, cost: int = 1, *, timeout: float | None = None) -> RedisPermit:
        """Reserve inside Redis and sleep once; Overloaded when the wait exceeds ``timeout``."""
        c = self._cost(cost)
        limit = timeout if timeout is not None else self.max_wait
        mw = _max_wait_us(limit)
        e = self._engine
        start = e.start_ns()
        try:
            reply = e.run(self._take_cmd(key, c, mw, True))
        except _Down:
            if self._local is not None and e.clock.manual is None:
                e.fallbacks += 1
                p = self._local.acquire(key, c, timeout=limit)
                return RedisPermit(p.waited, {self._bucket.unit: c}, None, local=p)
            r = self._fallback_reserve(key, c)
        else:
            r = self._reservation(key, reply, c, mw, self._adjuster(key))
        e.wait(r, start)
        return r.permit

    def retry_after(self, key: Key, cost: int = 1) -> float:
        c = self._cost(cost)
        try:
            reply = self._engine.run(self._peek_cmd(key, c))
        except _Down:
            return self._fallback_retry_after(key, c)
        return int(reply[0]) / 1e6

    def available(self, key: Key) -> float:
        try:
            reply = self._engine.run(self._peek_cmd(key, 0))
        except _Down:
            return self._fallback_available(key)
        b = self._bucket
        return (b.tau - int(reply[1])) / b.interval

    def reset(self, key: Key) -> None:
        self._engine.client.delete(self.key(key))


class AsyncRedisKeyedLimiter(_KeyedBase):
    """:class:`RedisKeyedLimiter` for ``redis.asyncio`` clients."""

    async def try_acquire(self, key: Key, cost: int = 1) -> bool:
        c = self._cost(cost)
        try:
            reply = await self._engine.arun(self._take_cmd(key, c, 0, False))
        except _Down:
            return self._fallback_try(key, c)
        return self._tried(reply)

    def _adjuster(self, key: Key) -> Callable[[dict[str, int], dict[str, int]], Awaitable[None]]:
        u = self._bucket.unit

        async def adjust(est: dict[str, int], actual: dict[str, int]) -> None:
            with contextlib.suppress(_Down):
                await self._engine.arun(self._adjust_cmd(key, est[u], actual[u]))

        return adjust

    async def reserve(
        self, key: Key, cost: int = 1, *, max_wait: float | None = None
    ) -> RedisReservation:
        c = self._cost(cost)
        mw = _max_wait_us(max_wait)
        try:
            reply = await self._engine.arun(self._take_cmd(key, c, mw, True))
        except _Down:
            return self._fallback_reserve(key, c)
        return self._reservation(key, reply, c, mw, self._adjuster(key))

    def acquire(
        self, key: Key, cost: int = 1, *, timeout: float | None = None
    ) -> _AsyncAcquire[RedisPermit]:
        c = self._cost(cost)
        return _AsyncAcquire(lambda: self._acquire(key, c, timeout))

    acquire_async = acquire

    async def _acquire(self, key: Key, c: int, timeout: float | None) -> RedisPermit:
        limit = timeout if timeout is not None else self.max_wait
        mw = _max_wait_us(limit)
        e = self._engine
        start = e.start_ns()
        try:
            reply = await e.arun(self._take_cmd(key, c, mw, True))
        except _Down:
            if self._local is not None and e.clock.manual is None:
                e.fallbacks += 1
                p = await self._local.acquire_async(key, c, timeout=limit)
                return RedisPermit(p.waited, {self._bucket.unit: c}, None, local=p)
            r = self._fallback_reserve(key, c)
        else:
            r = self._reservation(key, reply, c, mw, self._adjuster(key))
        await e.await_wait(r, start)
        return r.permit

    async def retry_after(self, key: Key, cost: int = 1) -> float:
        c = self._cost(cost)
        try:
            reply = await self._engine.arun(self._peek_cmd(key, c))
        except _Down:
            return self._fallback_retry_after(key, c)
        return int(reply[0]) / 1e6

    async def available(self, key: Key) -> float:
        try:
            reply = await self._engine.arun(self._peek_cmd(key, 0))
        except _Down:
            return self._fallback_available(key)
        b = self._bucket
        return (b.tau - int(reply[1])) / b.interval

    async def reset(self, key: Key) -> None:
        await self._engine.client.delete(self.key(key))


# --------------------------------------------------------------------------------------
# Policy


PolicyLevel: TypeAlias = Limiter | KeyedLimiter | Rate | Sequence[Rate]


class _Level:
    __slots__ = ("buckets", "keyed", "name", "seg", "shadow", "units", "where")

    def __init__(self, name: str, spec: object, shadow: bool) -> None:
        self.name = name
        # The name's segment of Redis key names: ":" escaped, so that a keyed level's
        # key never spells another level's name (level "u" key 0 vs level "u:i").
        self.seg = name.replace("\\", "\\\\").replace(":", "\\:")
        self.shadow = shadow
        self.where = f" (level {name!r})"
        if isinstance(spec, KeyedLimiter):
            self.keyed = True
            rates = [spec.rate]
        elif isinstance(spec, Limiter):
            self.keyed = False
            rates = spec.rates
        elif isinstance(spec, Rate):
            self.keyed = False
            rates = [spec]
        elif isinstance(spec, Sequence) and spec and all(isinstance(r, Rate) for r in spec):
            self.keyed = False
            rates = list(spec)
        else:
            raise TypeError(
                f"level {name!r}: expected a Limiter, KeyedLimiter, Rate or list of Rates "
                f"(concurrency levels are not supported in Redis), got {type(spec).__name__}"
            )
        self.buckets = [_Bucket(r) for r in rates]
        self.units = _units_of(rates)


class _PolicyBase:
    def __init__(
        self,
        client: Any,
        levels: Mapping[str, PolicyLevel],
        *,
        name: str,
        shadow: Sequence[str] = (),
        tag: str | None = None,
        prefix: str = "rq",
        max_wait: float | None = None,
        on_failure: OnFailure = "fail_closed",
        local_fraction: float = 1.0,
        breaker: CircuitBreaker | None = None,
        clock: ManualClock | None = None,
    ) -> None:
        if not levels:
            raise ValueError("levels must hold at least one level")
        if isinstance(shadow, str):
            raise TypeError("shadow must be a collection of level names, not a str")
        for s in shadow:
            if s not in levels:
                raise ValueError(f"shadow level {s!r} is not one of {list(levels)}")
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty string (it names the Redis keys)")
        self._engine = _Engine(
            client,
            on_failure=on_failure,
            local_fraction=local_fraction,
            breaker=breaker,
            clock=clock,
        )
        self.name = name
        self.tag = tag if tag is not None else name
        self.prefix = prefix
        self.max_wait = max_wait
        self._levels = [_Level(n, spec, n in shadow) for n, spec in levels.items()]
        self._flat: list[tuple[int, int]] = []  # (level, bucket) per Redis key
        self._static: list[bytes | None] = []
        for li, lv in enumerate(self._levels):
            for bi in range(len(lv.buckets)):
                self._flat.append((li, bi))
                self._static.append(
                    None if lv.keyed else f"{prefix}:{{{self.tag}}}:{lv.seg}:{bi}".encode()
                )
        self._buckets = [self._levels[li].buckets[bi] for li, bi in self._flat]
        self._shadow = [self._levels[li].shadow for li, _ in self._flat]
        self._any_shadow = any(self._shadow)
        self._head = self._engine.head(len(self._flat))
        # Per Redis key: its fixed name, or the prefix its level's key is appended to.
        tagged = f"{prefix}:{{{self.tag}}}:"
        self._key_parts: list[tuple[bytes, str | None]] = [
            (f"{tagged}{self._levels[li].seg}:".encode(), self._levels[li].name)
            if self._levels[li].keyed
            else (cast(bytes, self._static[j]), None)
            for j, (li, _) in enumerate(self._flat)
        ]
        # The common call names only the keys (every unit is "requests", costing 1):
        # its costs and, on a plain client, its packed command are computed once.
        self._keyed_names = frozenset(lv.name for lv in self._levels if lv.keyed)
        self._default_units: dict[str, int] | None = None
        self._default_costs: list[int] = []
        self._fast_pre = b""
        self._fast_tail: bytes | None = None
        if all(u == "requests" for lv in self._levels for u in lv.units):
            self._default_units = {"requests": 1}
            self._default_costs = [1] * len(self._flat)
            for b in self._buckets:
                b.check(1)
            if clock is None and not self._any_shadow and self._engine.raw:
                fast = _take_args(self._engine, self._buckets, self._default_costs, None, 0, False)
                n = len(self._head) + len(self._flat) + len(fast)
                self._fast_pre = b"*%d\r\n" % n + b"".join(_bulk(_arg_bytes(a)) for a in self._head)
                self._fast_tail = b"".join(_bulk(_arg_bytes(a)) for a in fast)
        self._local: Policy | None = None
        if on_failure == "local":
            loc: dict[str, Any] = {}
            for lv in self._levels:
                scaled = [_scaled(b.rate, local_fraction) for b in lv.buckets]
                kw: dict[str, Any] = {} if clock is None else {"clock": clock}
                loc[lv.name] = KeyedLimiter(scaled[0], **kw) if lv.keyed else Limiter(*scaled, **kw)
            self._local = Policy(loc, shadow=list(shadow))
        self._admitted = 0
        self._refused = [0] * len(self._levels)
        self._shadow_refused = [0] * len(self._levels)

    @property
    def levels(self) -> list[str]:
        return [lv.name for lv in self._levels]

    @property
    def breaker(self) -> CircuitBreaker:
        return self._engine.breaker

    def _args(self, kw: Mapping[str, Any]) -> tuple[list[bytes], list[int], dict[str, int]]:
        """Redis keys and costs per bucket, and the costs per unit (for settle)."""
        if self._default_units is not None and kw.keys() == self._keyed_names:
            return (
                [
                    pre if name is None else pre + _key_bytes(kw[name], name)
                    for pre, name in self._key_parts
                ],
                self._default_costs,
                self._default_units,
            )
        used: set[str] = set()
        units: dict[str, int] = {}
        tagged = f"{self.prefix}:{{{self.tag}}}:".encode()
        level_keys: list[bytes | None] = []
        for lv in self._levels:
            k: bytes | None = None
            if lv.keyed:
                if lv.name not in kw:
                    raise TypeError(f"missing key for level {lv.name!r}: pass {lv.name}=...")
                used.add(lv.name)
                k = tagged + lv.seg.encode() + b":" + _key_bytes(kw[lv.name], lv.name)
            level_keys.append(k)
            for u in lv.units:
                if u in units:
                    continue
                if u in kw:
                    used.add(u)
                    units[u] = _cost(u, kw[u])
                elif u == "requests":
                    units[u] = 1
                else:
                    raise TypeError(
                        f'missing cost for unit "{u}" (level {lv.name!r}): pass {u}=...'
                    )
        for k2 in kw:
            if k2 not in used:
                raise TypeError(
                    f'unexpected keyword "{k2}": not a keyed level\'s name nor a unit of any level'
                )
        keys: list[bytes] = []
        costs: list[int] = []
        for j, (li, bi) in enumerate(self._flat):
            lv = self._levels[li]
            b = lv.buckets[bi]
            c = units[b.unit]
            b.check(c, lv.where)
            costs.append(c)
            static = self._static[j]
            lk = level_keys[li]
            keys.append(static if static is not None else lk if lk is not None else b"")
        return keys, costs, units

    def _take_cmd(
        self, keys: list[bytes], costs: list[int], mw: int, undo: bool
    ) -> tuple[Any, ...] | bytes:
        if costs is self._default_costs and self._fast_tail is not None and mw == 0 and not undo:
            return self._fast_pre + b"".join(_bulk(k) for k in keys) + self._fast_tail
        shadow = self._shadow if self._any_shadow else None
        return (
            *self._head,
            *keys,
            *_take_args(self._engine, self._buckets, costs, shadow, mw, undo),
        )

    def _adjust_cmd(
        self, keys: list[bytes], est: dict[str, int], actual: dict[str, int]
    ) -> tuple[Any, ...]:
        deltas = [b.inc(actual[b.unit]) - b.inc(est[b.unit]) for b in self._buckets]
        return (*self._head, *keys, *_adjust_args(self._engine, deltas))

    def _count(self, take: _Take) -> None:
        if take.ok:
            self._admitted += 1
            m = take.mask
            if m:
                for j, (li, _) in enumerate(self._flat):
                    if m >> j & 1:
                        self._shadow_refused[li] += 1
        elif take.level:
            self._refused[self._flat[take.level - 1][0]] += 1

    def _refusal(self, take: _Take, mw: int) -> Overloaded:
        lv = self._levels[self._flat[take.level - 1][0]].name if take.level else "?"
        return Overloaded(
            f"overloaded: refused by level {lv!r}",
            max(0.0, (take.wait_us - max(mw, 0)) / 1e6),
        )

    def _permit(
        self, take: _Take, units: dict[str, int], adjust: Callable[..., Any]
    ) -> RedisPermit:
        return RedisPermit(take.wait_us / 1e6, dict(units), adjust)

    def _fallback_try(self, kw: dict[str, Any], costs: dict[str, int]) -> RedisPermit | None:
        e = self._engine
        e.fallbacks += 1
        if e.on_failure == "fail_open":
            return RedisPermit(0.0, costs, None)
        if e.on_failure == "fail_closed" or self._local is None:
            return None
        try:
            p = self._local.try_acquire(**kw)
        except CostTooLarge:
            return None
        return None if p is None else RedisPermit(0.0, costs, None, local=p)

    def _fallback_reserve(
        self, kw: dict[str, Any], costs: dict[str, int], max_wait: float | None
    ) -> RedisReservation:
        e = self._engine
        e.fallbacks += 1
        if e.on_failure == "fail_open":
            return RedisReservation(0.0, RedisPermit(0.0, costs, None), None)
        if e.on_failure == "fail_closed" or self._local is None:
            raise e.unavailable(f"policy {self.name!r}")
        p = self._local.reserve(max_wait=max_wait, **kw)
        return RedisReservation(p.delay, RedisPermit(p.delay, costs, None, local=p), None, local=p)

    def stats(self) -> dict[str, Any]:
        s = self._engine.stats()
        s["admitted"] = self._admitted
        s["levels"] = {
            lv.name: {
                "refused": self._refused[i],
                "shadow_refused": self._shadow_refused[i],
                "shadow": lv.shadow,
            }
            for i, lv in enumerate(self._levels)
        }
        return s

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, levels={self.levels!r})"


class RedisPolicy(_PolicyBase):
    """Several limits in one round trip, all or nothing (like ``rq.Policy``), in Redis.

    ``levels``: name -> ``rq.Limiter`` | ``rq.KeyedLimiter`` | ``rq.Rate`` | list of
    Rates (only their rates are used: the buckets live in Redis). Keyed levels take their
    key from the keyword named like the level; costs are keywords per unit; ``shadow``
    levels are evaluated and counted, never enforced. Every key of the policy carries the
    hash tag ``{tag}`` (default: ``name``), so a policy lives in one cluster slot.
    """

    def try_acquire(self, **kw: Any) -> RedisPermit | None:
        keys, costs, named = self._args(kw)
        try:
            reply = self._engine.run(self._take_cmd(keys, costs, 0, False))
        except _Down:
            return self._fallback_try(kw, named)
        take = _Take(reply)
        self._count(take)
        return self._permit(take, named, self._adjuster(keys)) if take.ok else None

    def _adjuster(self, keys: list[bytes]) -> Callable[[dict[str, Any], dict[str, Any]], None]:
        def adjust(est: dict[str, Any], actual: dict[str, Any]) -> None:
            with contextlib.suppress(_Down):
                self._engine.run(self._adjust_cmd(keys, est, actual))

        return adjust

    def reserve(self, *, max_wait: float | None = None, **kw: Any) -> RedisReservation:
        """Reserves every level for one grant at the latest time any of them needs."""
        keys, costs, named = self._args(kw)
        mw = _max_wait_us(max_wait)
        try:
            reply = self._engine.run(self._take_cmd(keys, costs, mw, True))
        except _Down:
            return self._fallback_reserve(kw, named, max_wait)
        take = _Take(reply)
        self._count(take)
        if not take.ok:
            raise self._refusal(take, mw)
        permit = self._permit(take, named, self._adjuster(keys))
        return RedisReservation(permit.delay, permit, self._engine, keys, take.undo)

    def acquire(self, *, timeout: float | None = None, **kw: Any) -> RedisPermit:
        """Reserve every level in one round trip, then sleep once for the latest of them."""
        limit = timeout if timeout is not None else self.max_wait
        e = self._engine
        start = e.start_ns()
        r = self.reserve(max_wait=limit, **kw)
        e.wait(r, start)
        return r.permit


class AsyncRedisPolicy(_PolicyBase):
    """:class:`RedisPolicy` for ``redis.asyncio`` clients."""

    async def try_acquire(self, **kw: Any) -> RedisPermit | None:
        keys, costs, named = self._args(kw)
        try:
            reply = await self._engine.arun(self._take_cmd(keys, costs, 0, False))
        except _Down:
            return self._fallback_try(kw, named)
        take = _Take(reply)
        self._count(take)
        return self._permit(take, named, self._adjuster(keys)) if take.ok else None

    def _adjuster(
        self, keys: list[bytes]
    ) -> Callable[[dict[str, Any], dict[str, Any]], Awaitable[None]]:
        async def adjust(est: dict[str, Any], actual: dict[str, Any]) -> None:
            with contextlib.suppress(_Down):
                await self._engine.arun(self._adjust_cmd(keys, est, actual))

        return adjust

    async def reserve(self, *, max_wait: float | None = None, **kw: Any) -> RedisReservation:
        keys, costs, named = self._args(kw)
        mw = _max_wait_us(max_wait)
        try:
            reply = await self._engine.arun(self._take_cmd(keys, costs, mw, True))
        except _Down:
            return self._fallback_reserve(kw, named, max_wait)
        take = _Take(reply)
        self._count(take)
        if not take.ok:
            raise self._refusal(take, mw)
        permit = self._permit(take, named, self._adjuster(keys))
        return RedisReservation(permit.delay, permit, self._engine, keys, take.undo)

    def acquire(self, *, timeout: float | None = None, **kw: Any) -> _AsyncAcquire[RedisPermit]:
        return _AsyncAcquire(lambda: self._acquire(timeout, kw))

    acquire_async = acquire

    async def _acquire(self, timeout: float | None, kw: dict[str, Any]) -> RedisPermit:
        limit = timeout if timeout is not None else self.max_wait
        e = self._engine
        start = e.start_ns()
        r = await self.reserve(max_wait=limit, **kw)
        await e.await_wait(r, start)
        return r.permit
