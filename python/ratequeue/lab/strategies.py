"""Client strategies compared on the same arrivals, each run in virtual time.

Every strategy talks to the same kind of far side, a :class:`~.engine.SimProvider` that
enforces its own limit and answers 429, and every call it makes is counted:

* :class:`NaiveRetry` -- no client-side limit: call, and on 429 sleep with exponential
  backoff and full jitter, then call again (the common Python pattern). The wait is
  hidden inside the call, every retry is an extra call, and order is lost.
* :class:`Queue` -- a ratequeue token bucket with a queue in front of the provider:
  grants in FIFO order at the bucket's pace, so the provider never has to say 429.
  ``max_wait=None`` is an unbounded queue; with ``max_wait`` a request that would wait
  longer is refused at once (shed).
* :class:`Priority` -- the same queue with weighted classes (interactive 8 : batch 1).
* :class:`PoolStrategy` -- a :class:`ratequeue.Pool` of ``k`` providers, each with its own
  limiter and its own far side; the pool routes to the shortest predicted wait, and a 429
  (e.g. during an :class:`~.engine.Outage`) puts a provider in cooldown.

A request's queue wait runs from its arrival to the start of the call that succeeds; its
latency adds the service (generation) time.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._errors import Overloaded
from .._ratequeue import Limiter, Rate
from ..pool import Pool, Provider
from .engine import Outage, SimProvider, VirtualTime
from .results import Request, Row, StrategyRun, Workload

__all__ = [
    "NaiveRetry",
    "PoolStrategy",
    "Priority",
    "ProviderLimit",
    "Queue",
    "Strategy",
    "default_strategies",
]


#: The shortest retry delay of a simulated client (seconds of virtual time): about a
#: network round trip, so that virtual time always moves on between two calls.
_MIN_RETRY = 1e-3


@dataclass(frozen=True)
class ProviderLimit:
    """The provider's own limit: ``rpm`` requests per minute, bucket ``burst``."""

    rpm: float = 100.0
    burst: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.rpm, bool) or not isinstance(self.rpm, (int, float)):
            raise TypeError(f"rpm={self.rpm!r} must be a number")
        if not (math.isfinite(self.rpm) and self.rpm > 0):
            raise ValueError(f"rpm={self.rpm!r} must be a finite number > 0")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ValueError(f"burst={self.burst!r} must be an integer >= 1")

    @property
    def mu(self) -> float:
        """Service rate of the queue, requests per second."""
        return self.rpm / 60.0

    def rate(self) -> Rate:
        return Rate(self.rpm, per="minute", burst=self.burst)


class Strategy(ABC):
    """A way for a client to live with a rate limit."""

    key: str = "strategy"

    @property
    @abstractmethod
    def label(self) -> str:
        """Row label in tables and plots."""

    @abstractmethod
    def run(self, workload: Workload, limit: ProviderLimit, rng: random.Random) -> StrategyRun:
        """Simulate the workload in virtual time; ``rng`` is this strategy's own."""


@dataclass
class _Tally:
    """Calls made for one request so far."""

    calls: int = 0
    rejected: int = 0


@dataclass(frozen=True)
class NaiveRetry(Strategy):
    """Call; on 429 sleep ``uniform(0, min(cap, base * 2**attempt))`` and call again.

    ``max_attempts=None`` retries forever (a request given up counts as shed);
    ``honour_retry_after`` sleeps at least the provider's Retry-After.
    """

    base: float = 1.0
    cap: float = 60.0
    max_attempts: int | None = None
    honour_retry_after: bool = False
    key: str = "naive"

    def __post_init__(self) -> None:
        for name in ("base", "cap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name}={v!r} must be a number of seconds")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be a finite number of seconds > 0")
        if self.max_attempts is not None and (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ValueError(f"max_attempts={self.max_attempts!r} must be an integer >= 1 or None")

    @property
    def label(self) -> str:
        return "naive retry on 429"

    def run(self, workload: Workload, limit: ProviderLimit, rng: random.Random) -> StrategyRun:
        vt = VirtualTime()
        provider = SimProvider(vt.clock, limit.rpm, limit.burst)
        row = Row(self.key, self.label)

        def attempt(req: Request, tally: _Tally) -> None:
            status, retry_after = provider.call()
            tally.calls += 1
            measured = workload.measured(req)
            if status == 200:
                if measured:
                    wait = vt.now - req.t
                    row.record_served(wait, wait + req.service, tally.calls, tally.rejected)
                return
            tally.rejected += 1
            if self.max_attempts is not None and tally.calls >= self.max_attempts:
                if measured:
                    row.record_shed(tally.calls, tally.rejected)
                return
            exponent = min(tally.calls - 1, 60)
            delay = rng.uniform(0.0, min(self.cap, self.base * 2.0**exponent))
            if self.honour_retry_after:
                delay = max(delay, retry_after)
            # Virtual time must advance between two calls of one request (a zero draw
            # would retry at the same instant, against a provider that cannot change).
            delay = max(delay, _MIN_RETRY)
            vt.after(delay, partial(attempt, req, tally))

        for req in workload.requests:
            vt.at(req.t, partial(attempt, req, _Tally()))
        vt.run()
        return StrategyRun(
            [row], {"provider_calls": provider.calls, "provider_429": provider.rejected}
        )


class _Queued(Strategy):
    """Shared by the strategies that queue in a ratequeue limiter before calling."""

    max_wait: float | None

    def _rows(self) -> dict[str, Row]:
        return {"": Row(self.key, self.label)}

    def _row_for(self, rows: dict[str, Row], req: Request) -> Row:
        return rows[""]

    def _limiter(self, vt: VirtualTime, limit: ProviderLimit, n: int) -> Limiter:
        return vt.limiter(limit.rate(), max_wait=self.max_wait, max_queue=n + 1)

    def _priority(self, req: Request) -> str | None:
        return None

    def run(self, workload: Workload, limit: ProviderLimit, rng: random.Random) -> StrategyRun:
        vt = VirtualTime()
        provider = SimProvider(vt.clock, limit.rpm, limit.burst)
        lim = self._limiter(vt, limit, len(workload.requests))
        rows = self._rows()
        grants_off_schedule = 0

        def shed(req: Request, tally: _Tally) -> None:
            if workload.measured(req):
                self._row_for(rows, req).record_shed(tally.calls, tally.rejected)

        def arrive(req: Request, tally: _Tally) -> None:
            timeout = None
            if self.max_wait is not None:
                timeout = self.max_wait - (vt.now - req.t)
                if timeout < 0:
                    shed(req, tally)
                    return
            try:
                vt.submit(
                    lim,
                    partial(outcome, req, tally),
                    priority=self._priority(req),
                    timeout=timeout,
                )
            except Overloaded:
                shed(req, tally)

        def outcome(req: Request, tally: _Tally, granted: bool, waited: float) -> None:
            nonlocal grants_off_schedule
            if not granted:
                shed(req, tally)
                return
            if tally.calls == 0 and abs(vt.now - (req.t + waited)) > 1e-6:
                grants_off_schedule += 1
            status, retry_after = provider.call()
            tally.calls += 1
            if status == 200:
                if workload.measured(req):
                    wait = vt.now - req.t
                    self._row_for(rows, req).record_served(
                        wait, wait + req.service, tally.calls, tally.rejected
                    )
                return
            tally.rejected += 1  # our limit disagrees with the provider's: queue again
            vt.after(retry_after, partial(arrive, req, tally))

        for req in workload.requests:
            vt.at(req.t, partial(arrive, req, _Tally()))
        vt.run()
        info: dict[str, Any] = {
            "provider_calls": provider.calls,
            "provider_429": provider.rejected,
            "grants_off_schedule": grants_off_schedule,
            "limiter_stats": {
                k: v for k, v in lim.stats().items() if isinstance(v, (int, float, str))
            },
        }
        return StrategyRun(list(rows.values()), info)


@dataclass(frozen=True)
class Queue(_Queued):
    """A ratequeue token bucket with a FIFO queue; ``max_wait`` bounds the wait."""

    max_wait: float | None = None
    key: str = "queue"

    @property
    def label(self) -> str:
        if self.max_wait is None:
            return "token bucket, unbounded queue"
        return f"bounded wait, max_wait={self.max_wait:g} s"


@dataclass(frozen=True)
class Priority(_Queued):
    """A queue with weighted classes; each request's class comes from the workload."""

    classes: tuple[tuple[str, float], ...] = (("interactive", 8.0), ("batch", 1.0))
    max_wait: float | None = None
    key: str = "priority"

    @property
    def label(self) -> str:
        weights = ":".join(f"{w:g}" for _, w in self.classes)
        return f"priority classes {weights}"

    def _rows(self) -> dict[str, Row]:
        return {c: Row(f"{self.key}/{c}", f"priority: {c}") for c, _ in self.classes}

    def _row_for(self, rows: dict[str, Row], req: Request) -> Row:
        return rows[req.cls]

    def _limiter(self, vt: VirtualTime, limit: ProviderLimit, n: int) -> Limiter:
        return vt.limiter(
            limit.rate(), max_wait=self.max_wait, max_queue=n + 1, classes=dict(self.classes)
        )

    def _priority(self, req: Request) -> str | None:
        return req.cls


@dataclass(frozen=True)
class PoolStrategy(Strategy):
    """A :class:`ratequeue.Pool` of ``k`` providers of ``rpm`` each (default: the
    scenario's limit), routed by shortest predicted wait, bounded by ``max_wait``.

    ``outages`` make providers answer 429 for a while; the pool cools them down.
    With ``trace=True`` the run's info holds every call (time, provider) and every
    cooldown (provider, start, end), to check that no call went to a cooling provider.
    """

    k: int = 2
    rpm: float | None = None
    max_wait: float | None = 5.0
    outages: tuple[Outage, ...] = ()
    weights: tuple[float, ...] = ()
    trace: bool = False
    key: str = "pool"

    @property
    def label(self) -> str:
        bound = "" if self.max_wait is None else f", max_wait={self.max_wait:g} s"
        each = "limit" if self.rpm is None else f"{self.rpm:g}/min"
        return f"pool {self.k}x {each}{bound}"

    def run(self, workload: Workload, limit: ProviderLimit, rng: random.Random) -> StrategyRun:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k!r}")
        vt = VirtualTime()
        rpm = limit.rpm if self.rpm is None else self.rpm
        names = [f"p{i + 1}" for i in range(self.k)]
        weights = list(self.weights) + [1.0] * (self.k - len(self.weights))
        providers = [
            Provider(n, rpm=rpm, burst=limit.burst, weight=w, clock=vt.clock, max_queue=10**7)
            for n, w in zip(names, weights, strict=True)
        ]
        for p in providers:
            vt.watch(p.limiter)
        # Outages are honoured for as long as the provider's Retry-After says (an hour at
        # most), as a client of a real provider would.
        pool = Pool(providers, max_wait=self.max_wait, max_cooldown=3600.0, clock=vt.clock)
        far: dict[str, SimProvider] = {
            n: SimProvider(
                vt.clock,
                rpm,
                limit.burst,
                name=n,
                outages=[(o.start, o.end, o.retry_after) for o in self.outages if o.provider == i],
            )
            for i, n in enumerate(names)
        }
        row = Row(self.key, self.label)
        calls_log: list[tuple[float, str]] = []
        cooldowns: list[tuple[str, float, float]] = []
        reroutes = 0

        def shed(req: Request, tally: _Tally) -> None:
            if workload.measured(req):
                row.record_shed(tally.calls, tally.rejected)

        def arrive(req: Request, tally: _Tally) -> None:
            timeout = None
            if self.max_wait is not None:
                timeout = self.max_wait - (vt.now - req.t)
                if timeout < 0:
                    shed(req, tally)
                    return
            try:
                provider, r = pool.acquire_async(timeout=timeout)._submit(vt.channel)
            except Overloaded as e:
                # Every provider is cooling down or too far behind: come back when one
                # can serve, if the deadline allows; else give up.
                if math.isfinite(e.retry_after) and (timeout is None or e.retry_after <= timeout):
                    vt.after(max(e.retry_after, 1e-6), partial(arrive, req, tally))
                else:
                    shed(req, tally)
                return
            if isinstance(r, int):
                vt.expect(r, partial(outcome, req, tally, provider))
            else:
                send(req, tally, provider)

        def outcome(
            req: Request, tally: _Tally, provider: Provider, granted: bool, waited: float
        ) -> None:
            nonlocal reroutes
            if not granted:
                shed(req, tally)
            elif pool.on_grant(provider):
                send(req, tally, provider)
            else:
                reroutes += 1  # its provider went into cooldown while it waited
                arrive(req, tally)

        def send(req: Request, tally: _Tally, provider: Provider) -> None:
            if self.trace:
                calls_log.append((vt.now, provider.name))
            status, retry_after = far[provider.name].call()
            tally.calls += 1
            if status == 200:
                if workload.measured(req):
                    wait = vt.now - req.t
                    row.record_served(wait, wait + req.service, tally.calls, tally.rejected)
                vt.after(req.service, partial(pool.report, provider, 200))
                return
            tally.rejected += 1
            pause = pool.report(provider, status, retry_after=retry_after)
            if self.trace:
                cooldowns.append((provider.name, vt.now, vt.now + pause))
            arrive(req, tally)

        for req in workload.requests:
            vt.at(req.t, partial(arrive, req, _Tally()))
        vt.run()
        info: dict[str, Any] = {
            "provider_calls": sum(f.calls for f in far.values()),
            "provider_429": sum(f.rejected for f in far.values()),
            "reroutes": reroutes,
            "pool": pool.stats(),
        }
        if self.trace:
            info["calls"] = calls_log
            info["cooldowns"] = cooldowns
        return StrategyRun([row], info)


def default_strategies(
    max_wait: float = 5.0, pool_size: int = 2, outages: Sequence[Outage] = ()
) -> tuple[Strategy, ...]:
    """The demo's line-up: naive retry, unbounded queue, bounded wait, priority, pool."""
    return (
        NaiveRetry(),
        Queue(),
        Queue(max_wait=max_wait, key="bounded"),
        Priority(),
        PoolStrategy(k=pool_size, max_wait=max_wait, outages=tuple(outages)),
    )
