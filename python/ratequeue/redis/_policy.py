"""RedisPolicy and AsyncRedisPolicy: several levels (rates, keyed rates) in one round trip."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, cast

from .._cancel import cancel_requests
from .._errors import CostTooLarge, Overloaded
from .._ratequeue import (
    KeyedLimiter,
    Limiter,
    ManualClock,
    Policy,
    Rate,
    _PolicyKeywords,
)
from ._args import _key_bytes, _max_wait_us, _scaled, _units_of
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
from ._script import _Bucket, _gen_key, _Take, _take_args

# A cost the bindings read above 2**64 - 1 (no burst holds it): shown as given.
_SATURATED = 2**64 - 1

PolicyLevel: TypeAlias = Limiter | KeyedLimiter | Rate | Sequence[Rate]


class _Level:
    __slots__ = ("buckets", "key_prefix", "keyed", "name", "seg", "shadow", "units", "where")

    def __init__(self, name: str, spec: object, shadow: bool) -> None:
        self.name = name
        # The name's segment of Redis key names: ":" escaped, so that a keyed level's
        # key never spells another level's name (level "u" key 0 vs level "u:i").
        self.seg = name.replace("\\", "\\\\").replace(":", "\\:")
        self.shadow = shadow
        self.where = f" (level {name!r})"
        self.key_prefix = b""  # a keyed level's Redis key names, less the key (set by the policy)
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


class _PolicyBase(_Named):
    _aio = False

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
        self._levels = [_Level(n, spec, n in shadow) for n, spec in levels.items()]
        # How a call's keywords address each level, for the bindings' parser.
        self._keywords = _PolicyKeywords([(lv.name, lv.keyed, lv.units) for lv in self._levels])
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
        self._undo_head = self._engine.head(2 * len(self._flat))
        # Per Redis key: its fixed name, or the prefix its level's key is appended to.
        tagged = f"{prefix}:{{{self.tag}}}:"
        for lv in self._levels:
            lv.key_prefix = f"{tagged}{lv.seg}:".encode()
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
                fast = _take_args(
                    self._engine.clock, self._buckets, self._default_costs, None, 0, False
                )
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
        """The level names, in order."""
        return [lv.name for lv in self._levels]

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker this policy reports to (shared if one was given)."""
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
        given, units = self._keywords.parse(kw)
        if _SATURATED in units.values():  # shown as given by CostTooLarge
            units = {u: kw[u] if c == _SATURATED else c for u, c in units.items()}
        levels = self._levels
        # Every key before any cost, as the local Policy reads them: a key of the wrong
        # type is a TypeError whatever the costs.
        keys: list[bytes] = []
        for (li, _), static in zip(self._flat, self._static, strict=True):
            lv = levels[li]
            key = given[li]
            keys.append(static if static is not None else lv.key_prefix + _key_bytes(key, lv.name))  # type: ignore[arg-type]
        costs: list[int] = []
        for li, bi in self._flat:
            lv = levels[li]
            b = lv.buckets[bi]
            c = units[b.unit]
            b.check(c, lv.where)
            costs.append(c)
        return keys, costs, units

    def _take_cmd(
        self, keys: list[bytes], costs: list[int], mw: int, undo: bool
    ) -> tuple[Any, ...] | bytes:
        if costs is self._default_costs and self._fast_tail is not None and mw == 0 and not undo:
            return self._fast_pre + b"".join(_bulk(k) for k in keys) + self._fast_tail
        shadow = self._shadow if self._any_shadow else None
        args = _take_args(self._engine.clock, self._buckets, costs, shadow, mw, undo)
        if undo:
            return (*self._undo_head, *keys, *map(_gen_key, keys), *args)
        return (*self._head, *keys, *args)

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
        self, take: _Take, units: dict[str, int], keys: list[bytes], costs: list[int]
    ) -> RedisPermit:
        held = _Held(self._engine, keys, self._buckets, costs, take)
        return RedisPermit(take.wait_us / 1e6, dict(units), held, aio=self._aio)

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
            return RedisReservation(0.0, RedisPermit(0.0, costs, None))
        if e.on_failure == "fail_closed" or self._local is None:
            raise e.unavailable(f"policy {self.name!r}")
        p = self._local.reserve(max_wait=max_wait, **kw)
        return RedisReservation(p.delay, RedisPermit(p.delay, costs, None, local=p), local=p)

    def stats(self) -> dict[str, Any]:
        """Counters: Redis calls, failures, fallbacks, admitted, and refusals per level."""
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
        """Admits on every level now, or on none: a RedisPermit, or None when refused."""
        keys, costs, named = self._args(kw)
        try:
            reply = self._engine.run(self._take_cmd(keys, costs, 0, False))
        except _Down:
            return self._fallback_try(kw, named)
        take = _Take(reply)
        self._count(take)
        return self._permit(take, named, keys, costs) if take.ok else None

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
        permit = self._permit(take, named, keys, costs)
        return RedisReservation(permit.delay, permit)

    def acquire(self, *, timeout: float | None = None, **kw: Any) -> RedisPermit:
        """Reserve every level in one round trip, then sleep once for the latest of them."""
        limit = timeout if timeout is not None else self.max_wait
        e = self._engine
        start = e.start_ns()
        r = self.reserve(max_wait=limit, **kw)
        _wait(e.clock, r, start)
        return r.permit


class AsyncRedisPolicy(_PolicyBase):
    """:class:`RedisPolicy` for ``redis.asyncio`` clients."""

    _aio = True

    async def try_acquire(self, **kw: Any) -> RedisPermit | None:
        """Admits on every level now, or on none: a RedisPermit, or None when refused."""
        keys, costs, named = self._args(kw)
        try:
            reply = await self._engine.arun(self._take_cmd(keys, costs, 0, False))
        except _Down:
            return self._fallback_try(kw, named)
        take = _Take(reply)
        self._count(take)
        return self._permit(take, named, keys, costs) if take.ok else None

    async def reserve(self, *, max_wait: float | None = None, **kw: Any) -> RedisReservation:
        """Reserves every level for one grant at the latest time any of them needs."""
        keys, costs, named = self._args(kw)
        mw = _max_wait_us(max_wait)
        asked = cancel_requests()
        try:
            reply = await self._engine.arun(self._take_cmd(keys, costs, mw, True), keep_cancel=True)
        except _Down:
            return self._fallback_reserve(kw, named, max_wait)

        def reservation() -> RedisReservation:
            take = _Take(reply)
            self._count(take)
            if not take.ok:
                raise self._refusal(take, mw)
            permit = self._permit(take, named, keys, costs)
            return RedisReservation(permit.delay, permit)

        return await _reserved(asked, reservation)

    def acquire(self, *, timeout: float | None = None, **kw: Any) -> _AsyncAcquire[RedisPermit]:
        """Reserves every level in one round trip, then sleeps once for the latest of them."""
        return _AsyncAcquire(lambda: self._acquire(timeout, kw))

    acquire_async = acquire

    async def _acquire(self, timeout: float | None, kw: dict[str, Any]) -> RedisPermit:
        limit = timeout if timeout is not None else self.max_wait
        e = self._engine
        start = e.start_ns()
        r = await self.reserve(max_wait=limit, **kw)
        await _await_wait(e.clock, r, start)
        return r.permit
