"""Virtual time: real limiters, queues and pools driven on one ManualClock.

:class:`VirtualTime` keeps a heap of timed events (arrivals, retries, completions) and
the limiters of a scenario. It always handles the earliest thing next: either a
limiter's next due time (``Limiter.run_until`` grants or expires at exactly that time,
and the outcomes are drained from the channel) or the next event (the clock is set to
its time first). So every grant, every call to a provider and every 429 happens at its
own time, as it would in real time, through the library's own queue code.

:class:`SimProvider` is the far side of the wire: a provider enforcing its own limit
with its own bucket, answering 429 with a ``Retry-After`` (or during an outage).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._ratequeue import Channel, Limiter, ManualClock, Permit, Rate

__all__ = ["Outage", "SimProvider", "VirtualTime"]

Outcome = Callable[[bool, float], None]


class VirtualTime:
    """Event loop over a :class:`~ratequeue.ManualClock`.

    ``at(t, fn)`` runs ``fn()`` with the clock at ``t``; ``submit(limiter, on_outcome,
    ...)`` submits to a watched limiter and calls ``on_outcome(granted, waited)`` when
    the request is granted (at its schedule time) or leaves at its deadline.
    """

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock if clock is not None else ManualClock()
        self.channel = Channel()
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._limiters: list[Limiter] = []
        self._pending: dict[int, Outcome] = {}
        self.events = 0
        self.wakes = 0

    @property
    def now(self) -> float:
        return self.clock.now()

    def limiter(self, *rates: Rate, **options: Any) -> Limiter:
        """A new limiter on this clock, watched by this loop."""
        lim = Limiter(*rates, clock=self.clock, **options)
        self.watch(lim)
        return lim

    def watch(self, limiter: Limiter) -> None:
        """Drive ``limiter``'s queue (it must use this loop's clock)."""
        if limiter not in self._limiters:
            self._limiters.append(limiter)

    def at(self, t: float, fn: Callable[[], object]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], object]) -> None:
        self.at(self.clock.now() + max(0.0, delay), fn)

    def expect(self, ticket: int, on_outcome: Outcome) -> None:
        """Call ``on_outcome`` when ``ticket`` (from a submit on :attr:`channel`) ends."""
        self._pending[ticket] = on_outcome

    def submit(self, limiter: Limiter, on_outcome: Outcome, **kwargs: Any) -> bool:
        """``limiter.submit`` on this loop's channel. Granted at once: ``on_outcome(True,
        0.0)`` is called now and True returned; queued: False. Refusals raise."""
        r = limiter.submit(self.channel, **kwargs)
        if isinstance(r, Permit):
            on_outcome(True, r.waited)
            return True
        self._pending[r] = on_outcome
        return False

    def _dispatch(self) -> None:
        for ticket, granted, waited_ns in self.channel.drain():
            cb = self._pending.pop(ticket, None)
            if cb is not None:
                cb(granted, waited_ns / 1e9)

    def run(self, until: float = math.inf) -> None:
        """Handle everything due up to ``until`` (default: until nothing is left)."""
        heap = self._heap
        lims = self._limiters
        clock = self.clock
        while True:
            te = heap[0][0] if heap else math.inf
            tw = math.inf
            due: Limiter | None = None
            for lim in lims:
                w = lim.next_wake()
                if w is not None and w < tw:
                    tw, due = w, lim
            if due is not None and tw <= te:
                if tw > until:
                    break
                due.run_until(tw)
                self.wakes += 1
                self._dispatch()
                continue
            if not heap or te > until:
                break
            t, _, fn = heapq.heappop(heap)
            if t > clock.now():
                clock.set(t)
            self.events += 1
            fn()
            self._dispatch()
        if math.isfinite(until) and until > clock.now():
            clock.set(until)

    @property
    def pending(self) -> int:
        """Requests still queued in watched limiters."""
        return sum(lim.waiting for lim in self._limiters)


@dataclass(frozen=True)
class Outage:
    """Provider ``provider`` (index) answers 429 from ``start`` to ``end`` (seconds),
    with ``Retry-After`` = ``retry_after`` or, when None, the time left in the outage."""

    provider: int
    start: float
    end: float
    retry_after: float | None = None


class SimProvider:
    """A provider that enforces its own limit: 200 if its bucket admits, else 429.

    The limit is a GCRA bucket of ``rpm`` requests per minute and ``burst``; a refused
    call consumes nothing (the charitable model: some real providers count refused
    calls against the limit too). ``Retry-After`` is the bucket's own retry time.
    """

    def __init__(
        self,
        clock: ManualClock,
        rpm: float,
        burst: int = 1,
        *,
        name: str = "provider",
        outages: Sequence[tuple[float, float, float | None]] = (),
        trace: bool = False,
    ) -> None:
        self.name = name
        self.clock = clock
        self.bucket = Limiter(Rate(rpm, per="minute", burst=burst), clock=clock)
        self.outages = tuple(outages)
        self.calls = 0
        self.ok = 0
        self.rejected = 0
        self.trace = trace
        self.accepted_at: list[float] = []

    def call(self) -> tuple[int, float]:
        """One call now: ``(200, 0.0)`` or ``(429, retry_after_seconds)``."""
        self.calls += 1
        now = self.clock.now()
        for start, end, retry_after in self.outages:
            if start <= now < end:
                self.rejected += 1
                return 429, (end - now) if retry_after is None else retry_after
        if self.bucket.try_acquire():
            self.ok += 1
            if self.trace:
                self.accepted_at.append(now)
            return 200, 0.0
        self.rejected += 1
        return 429, self.bucket.retry_after()
