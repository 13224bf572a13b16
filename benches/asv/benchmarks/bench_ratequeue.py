"""asv benchmarks of ratequeue's hot paths, against the installed package.

Every limiter here admits every call (rates far above what one Python thread reaches)
unless the benchmark is about queueing, so the figures are the price of a decision.
"""

from __future__ import annotations

import ratequeue as rq
from ratequeue._ratequeue import Channel

HUGE = 10**9


class TryAcquire:
    """``Limiter.try_acquire``: one lock-free decision."""

    def setup(self) -> None:
        self.one = rq.Limiter(rq.Rate(HUGE, per="second"))
        self.two = rq.Limiter(
            rq.Rate(HUGE, per="second"), rq.Rate(HUGE, per="second", unit="tokens")
        )

    def time_try_acquire(self) -> None:
        self.one.try_acquire()

    def time_try_acquire_requests_and_tokens(self) -> None:
        self.two.try_acquire(tokens=1_200)


class AcquireUncontended:
    """``Limiter.acquire`` and ``Concurrency`` when nobody waits (the fast path)."""

    def setup(self) -> None:
        self.lim = rq.Limiter(rq.Rate(HUGE, per="second"))
        self.sem = rq.Concurrency(HUGE)

    def time_acquire(self) -> None:
        self.lim.acquire()

    def time_concurrency_acquire_release(self) -> None:
        with self.sem.acquire():
            pass


class HistogramRecord:
    """``Histogram.record`` one value, and ``record_many`` from numpy."""

    def setup(self) -> None:
        self.h = rq.Histogram()
        try:
            import numpy as np
        except ImportError:  # pragma: no cover
            self.values = None
        else:
            self.values = np.random.default_rng(1).lognormal(-3.0, 1.5, 100_000)

    def time_record(self) -> None:
        self.h.record(0.0123)

    def time_record_many_100k(self) -> None:
        if self.values is not None:
            self.h.record_many(self.values)


class SubmitRunUntil:
    """1,000 requests queued with ``submit`` and granted by ``run_until`` (virtual time)."""

    number = 1
    repeat = (5, 20, 10.0)

    def setup(self) -> None:
        self.clock = rq.ManualClock()
        self.lim = rq.Limiter(
            rq.Rate(1_000, per="second", burst=1), clock=self.clock, max_queue=10_000
        )
        self.channel = Channel()

    def time_submit_1000_then_run_until(self) -> None:
        for _ in range(1_000):
            self.lim.submit(self.channel)
        self.lim.run_until(self.clock.now() + 2.0)
        self.channel.drain()


class PoolChoose:
    """``Pool.choose``: the routing decision over four providers."""

    def setup(self) -> None:
        clock = rq.ManualClock()
        self.pool = rq.Pool(
            [rq.Provider(f"p{i}", rpm=HUGE, clock=clock, weight=i + 1) for i in range(4)],
            clock=clock,
        )

    def time_choose(self) -> None:
        self.pool.choose()


class Lab:
    """The virtual-time lab: simulated seconds per real second (higher is better)."""

    timeout = 120.0

    def setup(self) -> None:
        from ratequeue import lab

        self.lab = lab
        self.scenario = lab.Scenario(rhos=(0.9,), requests=5_000, burst=0)

    def track_simulated_seconds_per_second(self) -> float:
        report = self.lab.run_scenario(self.scenario, progress=False)
        return report.simulated / report.elapsed

    track_simulated_seconds_per_second.unit = "simulated s/s"  # type: ignore[attr-defined]

    def time_queue_level_5000_requests(self) -> None:
        self.lab.run_level(
            self.lab.Scenario(requests=5_000, strategies=(self.lab.Queue(),), burst=0), 0.9
        )
