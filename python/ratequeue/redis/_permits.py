"""What a Redis limiter grants: permits, reservations (and their give-back), the asyncio
acquire, the single sleep until a grant, and leases served from a local bucket."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from types import TracebackType
from typing import Any, Final, Generic, TypeVar

from .._errors import CostTooLarge
from .._ratequeue import Limiter, ManualClock, Permit, PolicyPermit, Rate, Reservation
from ._args import _cost
from ._engine import _Down, _Engine
from ._script import _Bucket, _Clock

T = TypeVar("T")


class RedisPermit:
    """What a Redis limiter granted: ``waited`` seconds; ``settle`` corrects the costs.

    A context manager for symmetry with ``rq.Permit`` (rates hold nothing to release).
    """

    __slots__ = ("_adjust", "_costs", "_local", "delay")

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
        self._local = local

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
        if self._local is not None:
            self._local.settle(**actual)
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
        if self._local is not None:
            self._local.settle(**actual)
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


_MAX_LOCAL_PERIOD: Final = 86_400.0


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


def _wait(clock: _Clock, r: RedisReservation, start_ns: int) -> None:
    """Sleeps once until the grant (a manual clock is moved there instead)."""
    if r.delay <= 0:
        return
    if clock.manual is not None:
        clock.sleep_target(start_ns, round(r.delay * 1e6))
        return
    try:
        time.sleep(r.delay)
    except BaseException:
        r.cancel()
        raise


async def _await_wait(clock: _Clock, r: RedisReservation, start_ns: int) -> None:
    """One asyncio.sleep until the grant; a cancellation gives the reservation back."""
    if r.delay <= 0:
        return
    if clock.manual is not None:
        clock.sleep_target(start_ns, round(r.delay * 1e6))
        return
    try:
        await asyncio.sleep(r.delay)
    except BaseException:
        await asyncio.shield(r.cancel_async())
        raise
