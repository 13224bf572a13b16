"""RedisLimiter and AsyncRedisLimiter: several rates in one Redis round trip, or leases."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from .._cancel import cancel_requests
from .._errors import CostTooLarge
from .._ratequeue import Limiter, ManualClock, Rate, _LimiterKeywords
from .._threads import AfterFork
from ._args import _max_wait_us, _overloaded, _scaled, _units_of
from ._breaker import CircuitBreaker
from ._connection import _pack, _text
from ._engine import OnFailure, _Down, _Named
from ._permits import (
    _MAX_LOCAL_PERIOD,
    RedisPermit,
    RedisReservation,
    _AsyncAcquire,
    _await_wait,
    _Held,
    _Lease,
    _reserved,
    _wait,
)
from ._script import _Bucket, _gen_key, _peek_args, _Take, _take_args


class _LimiterBase(_Named):
    """Everything of a Redis limiter but the I/O."""

    _aio = False

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
        self._init_named(
            client,
            name=name,
            prefix=prefix,
            max_wait=max_wait,
            on_failure=on_failure,
            local_fraction=local_fraction,
            breaker=breaker,
            clock=clock,
        )
        self.tag = tag if tag is not None else name
        self._buckets = [_Bucket(r) for r in rates]
        self._units = _units_of(rates)
        self._bucket_unit = [self._units.index(b.unit) for b in self._buckets]
        self.keys = [f"{prefix}:{{{self.tag}}}:{name}:{i}".encode() for i in range(len(rates))]
        self._head = self._engine.head(len(self.keys))
        # One generation key per bucket: exact undos and lease give-backs check it.
        self._gen_keys = [_gen_key(k) for k in self.keys]
        self._undo_head = self._engine.head(2 * len(self.keys))
        self._keywords = _LimiterKeywords(self._units)
        try:
            self._default: list[int] | None = self._keywords.parse()
        except TypeError:
            self._default = None
        self._fast: tuple[Any, ...] | bytes | None = None
        if self._default is not None and clock is None:
            # The whole command of a default try_acquire, encoded once.
            fast = (
                *self._head,
                *self.keys,
                *_take_args(
                    self._engine.clock,
                    self._buckets,
                    self._per_bucket(self._default),
                    None,
                    0,
                    False,
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
        """The rates decided in Redis, in the order given."""
        return [b.rate for b in self._buckets]

    @property
    def units(self) -> list[str]:
        """The units the costs are named by, first one first."""
        return list(self._units)

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker this limiter reports to (shared if one was given)."""
        return self._engine.breaker

    @property
    def on_failure(self) -> OnFailure:
        """What a decision does while Redis is unreachable."""
        return self._engine.on_failure

    def _costs(self, n: int | None, kw: Mapping[str, object]) -> list[int]:
        if n is None and not kw and self._default is not None:
            return self._default
        return self._keywords.parse(n, kw)

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
        args = _take_args(self._engine.clock, self._buckets, per, None, max_wait_us, undo)
        if undo:
            return (*self._undo_head, *self.keys, *self._gen_keys, *args)
        return (*self._head, *self.keys, *args)

    def _peek_cmd(self, costs: list[int]) -> tuple[Any, ...]:
        per = self._per_bucket(costs)
        return (*self._head, *self.keys, *_peek_args(self._engine.clock, self._buckets, per))

    # -- outcomes

    def _tried(self, reply: Sequence[Any] | int) -> bool:
        ok = reply <= 0 if isinstance(reply, int) else int(reply[0]) == 1
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

    def _permit(self, costs: list[int], take: _Take | None) -> RedisPermit:
        """A permit of Redis's decision, holding its debits (``take``: the script's record;
        None: served from the lease, whose unused part the lease gives back itself)."""
        per = self._per_bucket(costs)
        held = _Held(self._engine, self.keys, self._buckets, per, take, refunds=take is not None)
        delay = take.wait_us / 1e6 if take is not None else 0.0
        return RedisPermit(delay, self._named(costs), held, aio=self._aio)

    def _reservation(self, reply: Sequence[Any], costs: list[int], mw: int) -> RedisReservation:
        take = _Take(reply)
        if not take.ok:
            self._refused += 1
            raise _overloaded(take.wait_us, mw)
        self._admitted += 1
        permit = self._permit(costs, take)
        return RedisReservation(permit.delay, permit)

    def _fallback_reserve(self, costs: list[int], max_wait: float | None) -> RedisReservation:
        e = self._engine
        e.fallbacks += 1
        named = self._named(costs)
        if e.on_failure == "fail_open":
            return RedisReservation(0.0, RedisPermit(0.0, named, None))
        if e.on_failure == "fail_closed" or self._local is None:
            raise e.unavailable(f"limiter {self.name!r}")
        r = self._local.reserve(max_wait=max_wait, **named)
        return RedisReservation(r.delay, RedisPermit(r.delay, named, None), local=r)

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
        return (*self._engine.head(2 * len(self.keys)), *self.keys, *self._gen_keys, *args)

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
        """Counters: Redis calls, failures, fallback decisions, admitted, refused, leases."""
        s = self._engine.stats()
        s.update(admitted=self._admitted, refused=self._refused, leases=self._leases)
        return s

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rates={self.rates!r})"


#: Limiters that lease: a forked child forgets the parent's lease.
_LEASED = AfterFork("_forget_lease")


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
        return self._reservation(reply, c, mw)

    def acquire(
        self, n: int | None = None, /, *, timeout: float | None = None, **costs: int
    ) -> RedisPermit:
        """Reserve inside Redis (the script returns the wait) and sleep once.

        ``timeout`` (default: the limiter's ``max_wait``; None waits as long as needed):
        a request whose wait would exceed it is refused at once with Overloaded.
        """
        c = self._costs(n, costs)
        if self._lease_units and self._lease_fast(c):
            return self._permit(c, None)
        limit = timeout if timeout is not None else self.max_wait
        mw = _max_wait_us(limit)
        e = self._engine
        start = e.start_ns()
        try:
            reply = e.run(self._take_cmd(c, mw, True))
        except _Down:
            r = self._fallback_reserve(c, limit)
        else:
            r = self._reservation(reply, c, mw)
        _wait(e.clock, r, start)
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
        self._engine.client.delete(*self.keys, *self._gen_keys)

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

    _aio = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._alock: asyncio.Lock | None = None

    async def try_acquire(self, n: int | None = None, /, **costs: int) -> bool:
        """Admits now or returns False; never waits (one round trip, or none from a lease)."""
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

    async def reserve(
        self, n: int | None = None, /, *, max_wait: float | None = None, **costs: int
    ) -> RedisReservation:
        """Reserves in arrival order inside Redis; Overloaded beyond ``max_wait`` (nothing held)."""
        return await self._reserve(self._costs(n, costs), max_wait)

    async def _reserve(self, c: list[int], max_wait: float | None) -> RedisReservation:
        mw = _max_wait_us(max_wait)
        asked = cancel_requests()
        try:
            reply = await self._engine.arun(self._take_cmd(c, mw, True), keep_cancel=True)
        except _Down:
            return self._fallback_reserve(c, max_wait)
        return await _reserved(asked, lambda: self._reservation(reply, c, mw))

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
            return self._permit(c, None)
        limit = timeout if timeout is not None else self.max_wait
        e = self._engine
        start = e.start_ns()
        r = await self._reserve(c, limit)
        await _await_wait(e.clock, r, start)
        return r.permit

    async def retry_after(self, n: int | None = None, /, **costs: int) -> float:
        """Seconds until the costs would be admitted (0.0 = now); changes nothing."""
        c = self._costs(n, costs)
        try:
            reply = await self._engine.arun(self._peek_cmd(c))
        except _Down:
            return self._fallback_retry_after(c)
        return self._peeked(reply)[0]

    async def available(self, unit: str | None = None) -> float:
        """Units of ``unit`` (default: the first) that could be admitted now."""
        zero = [0] * len(self._units)
        try:
            reply = await self._engine.arun(self._peek_cmd(zero))
        except _Down:
            return self._fallback_available(unit)
        return self._available_of(self._peeked(reply)[1], unit)

    async def reset(self) -> None:
        """Deletes this limiter's keys: every bucket is full again."""
        await self._engine.client.delete(*self.keys, *self._gen_keys)

    async def close(self) -> None:
        """Gives the unused part of the current lease back to Redis."""
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
