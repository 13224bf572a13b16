"""The Adaptive wrapper: a level, its signals and a controller, stepped once per interval."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from .._errors import Overloaded, RateQueueError
from .._ratequeue import Acquiring, Concurrency, Limiter, ManualClock, MonotonicClock, Permit
from .._threads import AfterFork
from ._window import Window
from .controllers import Controller, Decision

if TYPE_CHECKING:
    from ..pool import Pool

__all__ = ["Adaptive", "Change"]

_log = logging.getLogger("ratequeue.adaptive")

Clock = ManualClock | MonotonicClock
Gauges = Callable[[], Mapping[str, float]]

#: Pushed gauges kept at most (names are caller-chosen: bounded).
_MAX_GAUGES = 64
#: HTTP statuses that count as a drop: rate limited, unavailable, gateway timeout.
_DROP_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class Change:
    """One change made by the controller: when, the limit before and after, and why
    (``reason`` a short code such as ``drop``, ``queue``, ``shed``; ``detail`` text)."""

    time: float
    old: float
    new: float
    reason: str
    detail: str = ""
    shed: tuple[str, ...] = ()


def _seconds(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}={v!r} must be a number of seconds")
    f = float(v)
    if not (math.isfinite(f) and f >= 0.0):
        raise ValueError(f"{name}={v!r} must be a finite number of seconds >= 0")
    return f


class _Accumulator:
    """Signals of the interval in progress: O(1) memory whatever the traffic."""

    __slots__ = ("arrivals", "drops", "peak", "rtt_max", "rtt_min", "rtt_sum", "samples")

    def __init__(self) -> None:
        self.samples = 0
        self.rtt_sum = 0.0
        self.rtt_min = math.inf
        self.rtt_max = 0.0
        self.drops = 0
        self.arrivals = 0
        self.peak = 0


#: Every Adaptive: a forked child renews its locks (before its driver starts again).
_all = AfterFork("_new_locks")
#: Running drivers: a forked child starts its own.
_running = AfterFork("_after_fork")


class Adaptive:
    """Adjusts a Limiter's rate or a Concurrency's limit at run time from backend signals.

    Every ``interval`` seconds (:meth:`step`, or the driver of :meth:`start` /
    :meth:`run`) the signals of the interval -- latency samples and drops from
    :meth:`observe`/:meth:`report` or the timed :meth:`acquire` wrappers, the level's own
    counters, backend gauges pushed with :meth:`set_gauges` or read from ``gauges`` (a
    callable such as :class:`~ratequeue.adaptive.PrometheusGauges`) -- go to the
    ``controller``, and its limit, kept within ``[min_limit, max_limit]``, is applied
    with ``set_rate``/``set_limit`` (waiters are rescheduled by the core; grants stay
    exact across the change). Every change is logged (logger ``ratequeue.adaptive``),
    kept in :attr:`changes` (the last ``history``) and counted for metrics.

    For a Limiter the limit is the amount of rate ``which`` (default: the first) per its
    own period; the burst is kept. For a Concurrency it is the number of holders
    (an integer >= 1). ``shed_order`` lists classes lowest priority first (default:
    the level's classes by ascending weight when ``weights`` are given, else as listed).
    ``clock`` times the intervals: by default a Limiter's own clock; a Concurrency does
    not expose its clock, so pass the ManualClock it runs on (else the real clock).
    """

    def __init__(
        self,
        level: Limiter | Concurrency,
        controller: Controller,
        *,
        interval: float = 1.0,
        min_limit: float = 1.0,
        max_limit: float | None = None,
        which: int | str | None = None,
        gauges: Gauges | None = None,
        shed_order: Sequence[str] | None = None,
        weights: Mapping[str, float] | None = None,
        clock: Clock | None = None,
        history: int = 1000,
        name: str | None = None,
    ) -> None:
        if isinstance(level, Limiter):
            self._kind: Literal["rate", "concurrency"] = "rate"
            rates = level.rates
            if which is None:
                idx = 0
            elif isinstance(which, str):
                units = [r.unit for r in rates]
                if which not in units:
                    raise ValueError(f"which={which!r}: the limiter's units are {units}")
                idx = units.index(which)
            elif isinstance(which, int) and not isinstance(which, bool):
                if not 0 <= which < len(rates):
                    raise ValueError(f"which={which!r}: the limiter has {len(rates)} rates")
                idx = which
            else:
                raise TypeError(f"which={which!r} must be a rate index or unit name")
            self._which = idx
            self._per = rates[idx].per
            level_clock: Clock | None = level.clock
        elif isinstance(level, Concurrency):
            if which is not None:
                raise ValueError("which= applies to a Limiter's rates only")
            self._kind = "concurrency"
            self._which = 0
            self._per = 1.0
            level_clock = None
        else:
            raise TypeError(f"level must be a Limiter or a Concurrency, got {type(level).__name__}")
        if not isinstance(controller, Controller):
            raise TypeError(f"controller must be a Controller, got {type(controller).__name__}")
        self.level = level
        self.controller = controller
        self.interval = _seconds("interval", interval)
        if not self.interval > 0:
            raise ValueError("interval must be > 0")
        self.min_limit = _seconds("min_limit", min_limit)
        if not self.min_limit > 0:
            raise ValueError("min_limit must be > 0")
        self.max_limit = math.inf if max_limit is None else _seconds("max_limit", max_limit)
        if self.max_limit < self.min_limit:
            raise ValueError(f"max_limit={max_limit!r} is below min_limit={min_limit!r}")
        if gauges is not None and not callable(gauges):
            raise TypeError("gauges must be a callable returning a mapping of readings")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r} must be an integer >= 1")
        self.clock: Clock = clock if clock is not None else (level_clock or MonotonicClock())
        self.name = name if name is not None else (level.name or controller.name)
        self._gauges_fn = gauges
        classes = list(level.classes)
        if shed_order is not None:
            order = list(shed_order)
            unknown = [c for c in order if c not in classes]
            if unknown:
                raise ValueError(f"shed_order: unknown classes {unknown} (the level has {classes})")
        elif weights is not None:
            order = sorted(classes, key=lambda c: (float(weights.get(c, 1.0)), classes.index(c)))
        else:
            order = classes
        self.shed_order: tuple[str, ...] = tuple(order)
        self._new_locks()
        _all.add(self)
        self._acc = _Accumulator()
        self._pushed: dict[str, float] = {}
        self._start = self.clock.now()
        self._counters = self._level_counters()
        self._applied = self.limit
        controller.reset(
            self._applied,
            min_limit=self.min_limit,
            max_limit=self.max_limit,
            classes=self.shed_order,
        )
        self.changes: deque[Change] = deque(maxlen=history)
        self.reasons: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.gauge_errors = 0
        self.last_window: Window | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the level ----------------------------------------------------------------------

    @property
    def kind(self) -> Literal["rate", "concurrency"]:
        """``"rate"`` for a Limiter, ``"concurrency"`` for a Concurrency."""
        return self._kind

    @property
    def limit(self) -> float:
        """The level's limit now (the rate's amount per its period, or the holders)."""
        if isinstance(self.level, Limiter):
            return float(self.level.rates[self._which].amount)
        return float(self.level.limit)

    def _apply(self, value: float) -> float:
        if isinstance(self.level, Limiter):
            self.level.set_rate(value, self._per, which=self._which)
        else:
            self.level.set_limit(int(value))
        return self.limit

    def _level_counters(self) -> tuple[int, int]:
        """(admitted, refused) so far, from the level's own counters."""
        s = self.level.stats()
        admitted = int(s["tried_admitted"]) + int(s["immediate"]) + int(s["queued_grants"])
        refused = (
            int(s["tried_refused"])
            + int(s["refused_full"])
            + int(s["refused_deadline"])
            + int(s["timed_out"])
        )
        return admitted, refused

    @property
    def shed(self) -> tuple[str, ...]:
        """Classes refused at once for now (queue-depth policy, lowest priority first)."""
        return self.controller.shed

    def admits(self, priority: str | None = None) -> bool:
        """False while class ``priority`` is being shed."""
        return priority is None or priority not in self.controller.shed

    def check(self, priority: str | None = None) -> None:
        """Raise Overloaded (retry after one interval) while ``priority`` is shed."""
        if not self.admits(priority):
            with self._lock:
                self.refused[str(priority)] += 1
            raise Overloaded(
                f"class {priority!r} is shed while the backend queue keeps growing",
                self.interval,
            )

    # -- signals ------------------------------------------------------------------------

    def observe(self, latency: float | None = None, *, dropped: bool = False) -> None:
        """Record one completed call: its latency in seconds, and whether it was dropped
        (429/503/timeout). Any thread; O(1) memory."""
        if latency is not None and not (type(latency) is float and 0.0 <= latency < math.inf):
            latency = _seconds("latency", latency)
        inflight = self.level.in_use if self._kind == "concurrency" else 0  # type: ignore[union-attr]
        with self._lock:
            acc = self._acc
            if latency is not None:
                acc.samples += 1
                acc.rtt_sum += latency
                if latency < acc.rtt_min:
                    acc.rtt_min = latency
                if latency > acc.rtt_max:
                    acc.rtt_max = latency
            if dropped:
                acc.drops += 1
            if inflight > acc.peak:
                acc.peak = inflight

    def report(self, status: int | None = None, *, ok: bool | None = None) -> None:
        """Record a call's outcome as a Pool would: 429, 502, 503, 504 or ``ok=False``
        (a timeout, a failure) count as drops; anything else is not a signal."""
        if status is not None and (isinstance(status, bool) or not isinstance(status, int)):
            raise TypeError(f"status must be an int HTTP status, got {status!r}")
        if status is not None and not 100 <= status <= 599:
            raise ValueError(f"status={status!r} is not an HTTP status (100..599)")
        if ok is False or status in _DROP_STATUSES:
            self.observe(None, dropped=True)

    def follow(self, pool: Pool, provider: str | None = None) -> Callable[[], None]:
        """Take drops from ``pool``'s reports (of ``provider`` only, when given): every
        429, 5xx or failure a caller or the httpx transport reports to the pool counts
        as a drop here. Returns a function that stops following."""

        def on_report(name: str, status: int | None, failed: bool) -> None:
            if failed and (provider is None or name == provider):
                self.observe(None, dropped=True)

        pool.subscribe(on_report)
        return lambda: pool.unsubscribe(on_report)

    def note_arrival(self) -> None:
        """Count one request asking (the demand the scale-out hook is told about)."""
        with self._lock:
            self._acc.arrivals += 1

    def set_gauges(self, **values: float) -> None:
        """Push backend readings (``queue_depth=12, queue_capacity=64, kv_cache=0.7``)."""
        clean: dict[str, float] = {}
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"gauge {k}={v!r} must be a number")
            if not math.isfinite(v):
                raise ValueError(f"gauge {k}={v!r} must be finite")
            clean[k] = float(v)
        with self._lock:
            if len(set(self._pushed) | set(clean)) > _MAX_GAUGES:
                raise ValueError(f"at most {_MAX_GAUGES} gauges")
            self._pushed.update(clean)

    def _read_gauges(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._pushed)
        if self._gauges_fn is not None:
            try:
                got = self._gauges_fn()
                for k, v in list(got.items())[:_MAX_GAUGES]:
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        out[str(k)] = float(v)
            except Exception as e:  # a failing gauge source leaves the limit unchanged
                self.gauge_errors += 1
                _log.warning("adaptive %s: gauges failed: %r", self.name, e)
        return out

    # -- control ------------------------------------------------------------------------

    def step(self, *, force: bool = False) -> Change | None:
        """Close the interval if ``interval`` seconds have passed (or ``force``), ask the
        controller and apply its limit; returns the Change made, if any."""
        with self._step_lock:
            return self._step(force)

    def _step(self, force: bool) -> Change | None:
        now = self.clock.now()
        with self._lock:
            if not force and now - self._start < self.interval:
                return None
            acc, self._acc = self._acc, _Accumulator()
            start, self._start = self._start, now
        gauges = self._read_gauges()
        admitted, refused = self._level_counters()
        d_admitted = admitted - self._counters[0]
        d_refused = refused - self._counters[1]
        self._counters = (admitted, refused)
        waiting = self.level.waiting
        current = self.limit
        if current != self._applied:
            # Someone else set the limit: start from theirs.
            self.controller.reset(
                current, min_limit=self.min_limit, max_limit=self.max_limit, classes=self.shed_order
            )
            self._applied = current
        duration = max(now - start, 1e-9)
        if isinstance(self.level, Concurrency):
            inflight = float(max(acc.peak, self.level.in_use + waiting))
        else:
            inflight = d_admitted / duration * self._per
            if waiting or d_refused:
                inflight = max(inflight, current)
        w = Window(
            start=start,
            end=now,
            kind=self._kind,
            limit=current,
            per=self._per,
            samples=acc.samples,
            rtt_mean=acc.rtt_sum / acc.samples if acc.samples else math.nan,
            rtt_min=acc.rtt_min if acc.samples else math.nan,
            rtt_max=acc.rtt_max if acc.samples else math.nan,
            drops=acc.drops,
            inflight=inflight,
            arrivals=acc.arrivals,
            waiting=waiting,
            gauges=gauges,
        )
        self.last_window = w
        shed_before = self.controller.shed
        decision: Decision = self.controller.update(w)
        target = min(self.max_limit, max(self.min_limit, decision.limit))
        if self._kind == "concurrency":
            target = float(max(1, int(target)))
        new = current
        if target != current:
            try:
                new = self._apply(target)
            except ValueError as e:  # beyond what the level accepts: keep the limit
                _log.warning("adaptive %s: cannot set the limit to %g: %s", self.name, target, e)
                self.controller.reset(
                    current,
                    min_limit=self.min_limit,
                    max_limit=self.max_limit,
                    classes=self.shed_order,
                )
            self._applied = new
        shed_after = self.controller.shed
        if new == current and shed_after == shed_before:
            return None
        change = Change(now, current, new, decision.reason or "adjust", decision.detail, shed_after)
        self.changes.append(change)
        self.reasons[change.reason] += 1
        _log.info(
            "adaptive %s: limit %g -> %g (%s%s)",
            self.name,
            current,
            new,
            change.reason,
            f": {change.detail}" if change.detail else "",
        )
        return change

    # -- drivers ------------------------------------------------------------------------

    def start(self) -> Adaptive:
        """Step every ``interval`` on a daemon thread until :meth:`close` (real clocks)."""
        if isinstance(self.clock, ManualClock):
            raise ValueError("on a ManualClock, call step() as virtual time moves")
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, name=f"ratequeue-adaptive-{self.name}", daemon=True
        )
        self._thread.start()
        _running.add(self)
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.step()
            except Exception:  # the loop outlives one bad interval; the next one retries
                _log.exception("adaptive %s: step failed", self.name)

    def _new_locks(self) -> None:
        """Free locks (made again in a forked child: a parent thread may have held one
        at the fork, stepped or not)."""
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()

    def _after_fork(self) -> None:
        self._stop = threading.Event()
        self._thread = None
        self.start()

    def close(self) -> None:
        """Stop the driver thread (idempotent); the limit stays where it is."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self._thread = None
        _running.discard(self)

    def __enter__(self) -> Adaptive:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def run(self) -> None:
        """Step every ``interval`` in this event loop until cancelled (gauges read in a
        worker thread, so a slow endpoint never blocks the loop)."""
        while True:
            await asyncio.sleep(self.interval)
            if self._gauges_fn is not None:
                await asyncio.to_thread(self.step)
            else:
                self.step()

    # -- timed acquires -----------------------------------------------------------------

    def acquire(
        self,
        n: int | None = None,
        /,
        *,
        priority: str | None = None,
        timeout: float | None = None,
        **costs: int,
    ) -> _Timed:
        """The level's ``acquire`` as a context manager that also records the call's
        latency (grant to exit) and a drop when the body raises TimeoutError."""
        return _Timed(self, n, priority, timeout, costs)

    def acquire_async(
        self,
        n: int | None = None,
        /,
        *,
        priority: str | None = None,
        timeout: float | None = None,
        **costs: int,
    ) -> _TimedAsync:
        """``async with`` twin of :meth:`acquire`."""
        return _TimedAsync(self, n, priority, timeout, costs)

    def _call(
        self,
        method: str,
        n: int | None,
        priority: str | None,
        timeout: float | None,
        costs: dict[str, int],
    ) -> Any:
        with self._lock:
            self._acc.arrivals += 1
        if priority is not None and priority in self.controller.shed:
            self.check(priority)
        fn = getattr(self.level, method)
        try:
            if costs:
                if self._kind == "concurrency":
                    raise TypeError(f"a Concurrency takes no costs, got {sorted(costs)}")
                return fn(n, priority=priority, timeout=timeout, **costs)
            return fn(n, priority=priority, timeout=timeout)
        except RateQueueError:
            with self._lock:
                self.refused[str(priority)] += 1
            raise

    def _finish(self, started: float, exc: BaseException | None) -> None:
        if exc is None:
            latency = self.clock.now() - started
            self.observe(latency if latency > 0.0 else 0.0)
        elif isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            self.observe(None, dropped=True)

    def stats(self) -> dict[str, Any]:
        """Limit, bounds, counters by reason and class, the last window's signals, and
        the controller's state."""
        w = self.last_window
        with self._lock:
            refused = dict(self.refused)
        return {
            "name": self.name,
            "kind": self._kind,
            "limit": self.limit,
            "min_limit": self.min_limit,
            "max_limit": self.max_limit,
            "changes": sum(self.reasons.values()),
            "reasons": dict(self.reasons),
            "refused": refused,
            "shed": list(self.shed),
            "gauge_errors": self.gauge_errors,
            "signals": {}
            if w is None
            else {
                "samples": w.samples,
                "rtt_mean": w.rtt_mean,
                "rtt_min": w.rtt_min,
                "drops": w.drops,
                "inflight": w.inflight,
                "throughput": w.throughput,
                "demand": w.demand,
                "waiting": w.waiting,
                **{f"gauge_{k}": v for k, v in w.gauges.items()},
            },
            "controller": self.controller.describe(),
        }

    def __repr__(self) -> str:
        return f"Adaptive({self.name!r}, {self.controller.name}, limit={self.limit:g})"


class _Timed:
    """``with adaptive.acquire(...) as permit``: the level's permit, timed."""

    def __init__(
        self,
        owner: Adaptive,
        n: int | None,
        priority: str | None,
        timeout: float | None,
        costs: dict[str, int],
    ) -> None:
        self._owner = owner
        self._args = (n, priority, timeout, costs)
        self._permit: Permit | None = None
        self._started = 0.0

    def __enter__(self) -> Permit:
        n, priority, timeout, costs = self._args
        permit: Permit = self._owner._call("acquire", n, priority, timeout, costs)
        self._permit = permit
        self._started = self._owner.clock.now()
        return permit

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        permit, self._permit = self._permit, None
        try:
            self._owner._finish(self._started, exc)
        finally:
            if permit is not None:
                permit.__exit__(exc_type, exc, tb)


class _TimedAsync:
    """``async with adaptive.acquire_async(...) as permit``: the level's permit, timed."""

    def __init__(
        self,
        owner: Adaptive,
        n: int | None,
        priority: str | None,
        timeout: float | None,
        costs: dict[str, int],
    ) -> None:
        self._owner = owner
        self._args = (n, priority, timeout, costs)
        self._permit: Permit | None = None
        self._started = 0.0

    async def __aenter__(self) -> Permit:
        n, priority, timeout, costs = self._args
        acquiring: Acquiring = self._owner._call("acquire_async", n, priority, timeout, costs)
        try:
            permit = await acquiring
        except RateQueueError:
            with self._owner._lock:
                self._owner.refused[str(priority)] += 1
            raise
        self._permit = permit
        self._started = self._owner.clock.now()
        return permit

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        permit, self._permit = self._permit, None
        try:
            self._owner._finish(self._started, exc)
        finally:
            if permit is not None:
                permit.__exit__(exc_type, exc, tb)
