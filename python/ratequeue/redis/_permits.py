"""What a Redis limiter grants: permits, reservations (and their give-back), the asyncio
acquire, the single sleep until a grant, and leases served from a local bucket."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Generic, TypeVar

from .._cancel import cancel_requests, swallowed
from .._errors import CostTooLarge
from .._ratequeue import Limiter, ManualClock, Permit, PolicyPermit, Rate, Reservation
from ._args import _cost
from ._connection import _text
from ._engine import _Down, _Engine
from ._script import _Bucket, _Clock, _gen_key, _Take

T = TypeVar("T")


class _Held:
    """A grant's debits in Redis, given back (or charged) by the one undo rule.

    Per bucket: the value the debit left (``after``; '' when it is no longer the
    bucket's latest change or is not known), the value before it ('' = full, '-' =
    unknown), the bucket's generation then, the slot of a grant scheduled ahead, and what
    the debit holds now (``held``, microseconds). A grant of the fast path has only its
    grant time: it gives back by the refund rule alone, capped from that time. A grant
    served from a lease (``refunds=False``) is only charged: its lease gives back what
    it did not use.
    """

    __slots__ = (
        "_costs",
        "_refunds",
        "_take",
        "afters",
        "befores",
        "buckets",
        "debited",
        "done",
        "engine",
        "gens",
        "helds",
        "keys",
        "slots",
        "start",
    )

    def __init__(
        self,
        engine: _Engine,
        keys: Sequence[bytes],
        buckets: Sequence[_Bucket],
        costs: Sequence[int],
        take: _Take | None = None,
        *,
        refunds: bool = True,
    ) -> None:
        # Kept as given: most grants are never settled nor cancelled (see ``_open``).
        self._refunds = refunds
        self.engine = engine
        self.keys = keys
        self.buckets = buckets
        self._costs: Sequence[int] | None = costs
        self._take = take
        self.done = False

    def _open(self) -> None:
        """Builds the per-bucket record from the script's reply, on first use."""
        costs = self._costs
        if costs is None:
            return
        self._costs = None
        take, n = self._take, len(self.keys)
        mask = take.mask if take is not None else 0
        # A shadow level that would have refused was counted, not debited.
        self.debited = [not mask >> i & 1 for i in range(n)]
        self.helds = [
            b.inc(c) if d else 0 for b, c, d in zip(self.buckets, costs, self.debited, strict=True)
        ]
        rec = take.undo if take is not None else []
        self.start = take.start if take is not None else ""
        if take is not None and rec:
            self.befores = rec[0::3]
            self.afters = rec[1::3]
            self.gens = rec[2::3]
            self.slots = [a if take.wait_us > 0 else "" for a in self.afters]
        else:
            self.befores = ["-"] * n
            self.afters = [""] * n
            self.gens = [""] * n
            self.slots = [""] * n

    def cmd(self, deltas: Sequence[int]) -> tuple[Any, ...]:
        """The script call giving back ``deltas`` (microseconds; < 0 charges) per bucket."""
        self._open()
        clock = self.engine.clock
        args: list[Any] = ["g", clock.now_arg(), clock.keep_ms, 0, 0]
        for i, b in enumerate(self.buckets):
            args += (
                self.afters[i],
                self.befores[i],
                self.gens[i],
                self.slots[i],
                self.start,
                self.helds[i],
                deltas[i],
                b.tau,
            )
        n = len(self.keys)
        return (*self.engine.head(2 * n), *self.keys, *map(_gen_key, self.keys), *args)

    def update(self, reply: Sequence[Any], deltas: Sequence[int]) -> bool:
        """Takes the script's answer in; True when capacity came back."""
        gave = False
        for i, d in enumerate(deltas):
            status, new = _text(reply[2 * i]), _text(reply[2 * i + 1])
            self.helds[i] -= d
            if status == "x":
                self.afters[i] = new
                gave = gave or d > 0
            elif status == "k":
                self.befores[i] = "-"
            elif status == "c":
                self.afters[i] = new
            else:
                self.afters[i] = ""
                gave = gave or status == "r"
        return gave

    def everything(self) -> list[int]:
        """What the grant holds per bucket (to give all of it back)."""
        self._open()
        return list(self.helds)

    def costs_deltas(self, actual: Mapping[str, int]) -> list[int]:
        """What to give back per bucket for the costs to become ``actual``."""
        self._open()
        out = [
            h - b.inc(actual[b.unit]) if d else 0
            for b, h, d in zip(self.buckets, self.helds, self.debited, strict=True)
        ]
        return out if self._refunds else [min(x, 0) for x in out]

    def run(self, deltas: Sequence[int]) -> bool:
        if self.done or not any(deltas):
            return False
        try:
            reply = self.engine.run(self.cmd(deltas))
        except _Down:
            return False
        return self.update(reply, deltas)

    async def arun(self, deltas: Sequence[int]) -> bool:
        if self.done or not any(deltas):
            return False
        asked = cancel_requests()
        try:
            reply = await self.engine.arun(self.cmd(deltas), keep_cancel=True)
        except _Down:
            return False
        gave = self.update(reply, deltas)
        if swallowed(asked):  # given back and counted; then the caller's cancel
            raise asyncio.CancelledError()
        return gave


class RedisPermit:
    """What a Redis limiter granted: ``waited`` seconds; ``settle`` corrects the costs.

    A context manager for symmetry with ``rq.Permit`` (rates hold nothing to release).
    """

    __slots__ = ("_aio", "_costs", "_held", "_local", "delay")

    def __init__(
        self,
        delay: float,
        costs: dict[str, int],
        held: _Held | None,
        local: Permit | PolicyPermit | None = None,
        *,
        aio: bool = False,
    ) -> None:
        self.delay = delay
        self._costs = costs
        self._held = held
        self._local = local
        self._aio = aio

    @property
    def waited(self) -> float:
        """Seconds from the request to the grant (the reservation's delay)."""
        return self.delay

    @property
    def costs(self) -> dict[str, int]:
        """The costs this permit stands for (per unit), as settled last."""
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
        """Corrects estimated costs to actual ones: a charge, or a give-back by the undo rule."""
        actual = self._settle_args(costs)
        if actual is None:
            return
        if self._aio and self._local is None:
            raise TypeError("a permit of an asyncio limiter: use await permit.settle_async()")
        if self._local is not None:
            self._local.settle(**actual)
        elif self._held is not None:
            self._held.run(self._held.costs_deltas(actual))
        self._costs = actual

    async def settle_async(self, **costs: int) -> None:
        """``settle`` for the asyncio limiters."""
        actual = self._settle_args(costs)
        if actual is None:
            return
        if self._local is not None:
            self._local.settle(**actual)
        elif self._held is not None:
            await self._held.arun(self._held.costs_deltas(actual))
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

    ``cancel()`` gives the grant's debits back by the core's one undo rule, at any time:
    exact while a debit is its bucket's latest change, otherwise a refund only while no
    grant is scheduled in the future, of at most what it still holds; ``cancel_async()``
    for the asyncio limiters.
    """

    __slots__ = ("_cancelled", "_local", "delay", "permit")

    def __init__(
        self,
        delay: float,
        permit: RedisPermit,
        local: Reservation | PolicyPermit | None = None,
    ) -> None:
        self.delay = delay
        self.permit = permit
        self._local = local
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        """True once ``cancel`` was called (whatever it gave back)."""
        return self._cancelled

    def _held(self) -> _Held | None:
        if self._cancelled:
            return None
        self._cancelled = True
        held = self.permit._held
        if held is None or held.done:
            return None
        return held

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
        """Gives the capacity back by the undo rule; True if anything was returned."""
        if self._local is not None:
            return self._cancel_local()
        held = self._held()
        if held is None:
            return False
        gave = held.run(held.everything())
        held.done = True
        return gave

    async def cancel_async(self) -> bool:
        """``cancel`` for the asyncio limiters."""
        if self._local is not None:
            return self._cancel_local()
        held = self._held()
        if held is None:
            return False
        gave = await held.arun(held.everything())
        held.done = True
        return gave

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


async def _reserved(asked: int, make: Callable[[], RedisReservation]) -> RedisReservation:
    """``make()``: the reservation from a take's reply (``arun(..., keep_cancel=True)``),
    unless the client swallowed a cancel meanwhile (``asked``: the task's cancel requests
    before the take; see ``ratequeue._cancel``): then what was reserved is given back
    and the cancel raised (a refusal, which reserved nothing, raises it too)."""
    if not swallowed(asked):
        return make()
    try:
        r = make()
        await asyncio.shield(r.cancel_async())
    except Exception as e:
        raise asyncio.CancelledError() from e
    raise asyncio.CancelledError()


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
