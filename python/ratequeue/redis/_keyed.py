"""RedisKeyedLimiter and AsyncRedisKeyedLimiter: one Redis bucket per key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._cancel import cancel_requests
from .._errors import CostTooLarge, Overloaded
from .._ratequeue import KeyedLimiter, ManualClock, Rate
from ._args import Key, _cost, _key_bytes, _max_wait_us, _overloaded, _scaled
from ._breaker import CircuitBreaker
from ._connection import _arg_bytes, _bulk
from ._engine import OnFailure, _Down, _Named
from ._permits import (
    RedisPermit,
    RedisReservation,
    _AsyncAcquire,
    _await_wait,
    _Held,
    _reserved,
    _wait,
)
from ._script import _Bucket, _gen_key, _peek_args, _Take, _take_args


class _KeyedBase(_Named):
    _aio = False

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
        self.tag = tag
        self._bucket = _Bucket(rate)
        self._buckets = [self._bucket]
        self._head = self._engine.head(1)
        self._undo_head = self._engine.head(2)
        self._pre = f"{prefix}:".encode()
        self._mid = f":{name}:".encode()
        self._tagged = f"{prefix}:{{{tag}}}:{name}:".encode() if tag is not None else None
        # A try_acquire of cost 1, packed once but for its key.
        self._fast_tail: bytes | None = None
        self._fast_args: list[Any] = []
        self._fast_pre = b""
        if clock is None:
            self._fast_args = _take_args(self._engine.clock, self._buckets, [1], None, 0, False)
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
        """The rate of every key's bucket."""
        return self._bucket.rate

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker this limiter reports to (shared if one was given)."""
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
        k = self.key(key)
        args = _take_args(self._engine.clock, self._buckets, [c], None, mw, undo)
        if undo:
            return (*self._undo_head, k, _gen_key(k), *args)
        return (*self._head, k, *args)

    def _peek_cmd(self, key: Key, c: int) -> tuple[Any, ...]:
        return (*self._head, self.key(key), *_peek_args(self._engine.clock, self._buckets, [c]))

    def _tried(self, reply: Sequence[Any] | int) -> bool:
        ok = reply <= 0 if isinstance(reply, int) else int(reply[0]) == 1
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

    def _reservation(self, key: Key, reply: Sequence[Any], c: int, mw: int) -> RedisReservation:
        take = _Take(reply)
        if not take.ok:
            self._refused += 1
            raise _overloaded(take.wait_us, mw)
        self._admitted += 1
        held = _Held(self._engine, [self.key(key)], self._buckets, [c], take)
        permit = RedisPermit(take.wait_us / 1e6, {self._bucket.unit: c}, held, aio=self._aio)
        return RedisReservation(permit.delay, permit)

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
        return RedisReservation(0.0, RedisPermit(0.0, named, None))

    def stats(self) -> dict[str, Any]:
        """Counters: Redis calls, failures, fallback decisions, admitted, refused."""
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
        """Admits ``key`` now or returns False; never waits (one round trip)."""
        c = self._cost(cost)
        try:
            reply = self._engine.run(self._take_cmd(key, c, 0, False))
        except _Down:
            return self._fallback_try(key, c)
        return self._tried(reply)

    def reserve(
        self, key: Key, cost: int = 1, *, max_wait: float | None = None
    ) -> RedisReservation:
        """Reserves in ``key``'s schedule inside Redis; Overloaded beyond ``max_wait``."""
        c = self._cost(cost)
        mw = _max_wait_us(max_wait)
        try:
            reply = self._engine.run(self._take_cmd(key, c, mw, True))
        except _Down:
            return self._fallback_reserve(key, c)
        return self._reservation(key, reply, c, mw)

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
            r = self._reservation(key, reply, c, mw)
        _wait(e.clock, r, start)
        return r.permit

    def retry_after(self, key: Key, cost: int = 1) -> float:
        """Seconds until ``key`` would admit ``cost`` (0.0 = now); changes nothing."""
        c = self._cost(cost)
        try:
            reply = self._engine.run(self._peek_cmd(key, c))
        except _Down:
            return self._fallback_retry_after(key, c)
        return int(reply[0]) / 1e6

    def available(self, key: Key) -> float:
        """Units ``key``'s bucket could admit now."""
        try:
            reply = self._engine.run(self._peek_cmd(key, 0))
        except _Down:
            return self._fallback_available(key)
        b = self._bucket
        return (b.tau - int(reply[1])) / b.interval

    def reset(self, key: Key) -> None:
        """Deletes ``key``'s bucket: it is full again."""
        k = self.key(key)
        self._engine.client.delete(k, _gen_key(k))


class AsyncRedisKeyedLimiter(_KeyedBase):
    """:class:`RedisKeyedLimiter` for ``redis.asyncio`` clients."""

    _aio = True

    async def try_acquire(self, key: Key, cost: int = 1) -> bool:
        """Admits ``key`` now or returns False; never waits (one round trip)."""
        c = self._cost(cost)
        try:
            reply = await self._engine.arun(self._take_cmd(key, c, 0, False))
        except _Down:
            return self._fallback_try(key, c)
        return self._tried(reply)

    async def reserve(
        self, key: Key, cost: int = 1, *, max_wait: float | None = None
    ) -> RedisReservation:
        """Reserves in ``key``'s schedule inside Redis; Overloaded beyond ``max_wait``."""
        c = self._cost(cost)
        mw = _max_wait_us(max_wait)
        asked = cancel_requests()
        try:
            reply = await self._engine.arun(self._take_cmd(key, c, mw, True), keep_cancel=True)
        except _Down:
            return self._fallback_reserve(key, c)
        return await _reserved(asked, lambda: self._reservation(key, reply, c, mw))

    def acquire(
        self, key: Key, cost: int = 1, *, timeout: float | None = None
    ) -> _AsyncAcquire[RedisPermit]:
        """Reserves inside Redis and sleeps once; Overloaded when the wait exceeds ``timeout``."""
        c = self._cost(cost)
        return _AsyncAcquire(lambda: self._acquire(key, c, timeout))

    acquire_async = acquire

    async def _acquire(self, key: Key, c: int, timeout: float | None) -> RedisPermit:
        limit = timeout if timeout is not None else self.max_wait
        mw = _max_wait_us(limit)
        e = self._engine
        asked = cancel_requests()
        start = e.start_ns()
        try:
            reply = await e.arun(self._take_cmd(key, c, mw, True), keep_cancel=True)
        except _Down:
            if self._local is not None and e.clock.manual is None:
                e.fallbacks += 1
                p = await self._local.acquire_async(key, c, timeout=limit)
                return RedisPermit(p.waited, {self._bucket.unit: c}, None, local=p)
            r = self._fallback_reserve(key, c)
        else:
            r = await _reserved(asked, lambda: self._reservation(key, reply, c, mw))
        await _await_wait(e.clock, r, start)
        return r.permit

    async def retry_after(self, key: Key, cost: int = 1) -> float:
        """Seconds until ``key`` would admit ``cost`` (0.0 = now); changes nothing."""
        c = self._cost(cost)
        try:
            reply = await self._engine.arun(self._peek_cmd(key, c))
        except _Down:
            return self._fallback_retry_after(key, c)
        return int(reply[0]) / 1e6

    async def available(self, key: Key) -> float:
        """Units ``key``'s bucket could admit now."""
        try:
            reply = await self._engine.arun(self._peek_cmd(key, 0))
        except _Down:
            return self._fallback_available(key)
        b = self._bucket
        return (b.tau - int(reply[1])) / b.interval

    async def reset(self, key: Key) -> None:
        """Deletes ``key``'s bucket: it is full again."""
        k = self.key(key)
        await self._engine.client.delete(k, _gen_key(k))
