"""Controllers: from one interval's signals to the next limit.

Each controller keeps its own estimate (a float, so small steps accumulate) and is
asked once per control interval for the next limit. The published formulas:

* :class:`AIMD` -- loss based (TCP Reno): add ``increase`` while nothing is dropped and
  the limit is in use, multiply by ``backoff`` on a drop or a latency past ``timeout``.
* :class:`Vegas` -- delay based (TCP Vegas, as in Netflix concurrency-limits): the
  queue the limit builds is ``limit * (1 - rtt_noload / rtt)``; grow while it is small,
  shrink while it is large, keep it between ``alpha`` and ``beta``.
* :class:`Gradient2` -- Netflix concurrency-limits' Gradient2: the gradient of a long
  exponential average of the latency over the current one, clamped to [0.5, 1], scales
  the limit, plus a fixed ``queue_size`` of headroom, smoothed.
* :class:`QueueDepth` -- the backend's queue depth fraction q decides: q >= 0.5 asks
  for a scale-out once per episode, q >= 0.8 holds the limit at what the backend drains
  (excess waits in the bounded queue in front of it instead of being refused), and only
  while q keeps rising after the scale-out failed or timed out are classes refused,
  lowest priority first; when q is low again the limit climbs back smoothly.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ._window import Window

__all__ = [
    "AIMD",
    "Controller",
    "Decision",
    "Gradient2",
    "QueueDepth",
    "ScaleOut",
    "Vegas",
]

_log = logging.getLogger("ratequeue.adaptive")


def _real(name: str, v: object, *, low: float | None = None, high: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}={v!r} must be a number")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name}={v!r} must be finite")
    if low is not None and f < low:
        raise ValueError(f"{name}={v!r} must be >= {low:g}")
    if high is not None and f > high:
        raise ValueError(f"{name}={v!r} must be <= {high:g}")
    return f


def _count(name: str, v: object, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}={v!r} must be an integer")
    if v < low:
        raise ValueError(f"{name}={v!r} must be >= {low}")
    return v


class Decision(NamedTuple):
    """The next limit and why: ``reason`` is a short code (empty: unchanged)."""

    limit: float
    reason: str = ""
    detail: str = ""


class Controller(ABC):
    """Turns each interval's :class:`Window` into the next limit, within bounds."""

    name: str = "controller"

    def __init__(self) -> None:
        self._limit = 1.0
        self._lo = 0.0
        self._hi = math.inf
        self._classes: tuple[str, ...] = ()

    def reset(
        self,
        limit: float,
        *,
        min_limit: float = 0.0,
        max_limit: float = math.inf,
        classes: Sequence[str] = (),
    ) -> None:
        """Start from ``limit`` (the level's own), within ``[min_limit, max_limit]``;
        ``classes`` lowest priority first."""
        self._lo = float(min_limit)
        self._hi = float(max_limit)
        self._limit = self._clamp(float(limit))
        self._classes = tuple(classes)

    @property
    def estimate(self) -> float:
        """The controller's current estimate of the limit (before rounding)."""
        return self._limit

    def _clamp(self, v: float) -> float:
        return min(self._hi, max(self._lo, v))

    def _set(self, v: float, reason: str, detail: str = "") -> Decision:
        self._limit = self._clamp(v)
        return Decision(self._limit, reason, detail)

    @abstractmethod
    def update(self, w: Window) -> Decision:
        """The limit for the next interval, given what the last one saw."""

    @property
    def shed(self) -> tuple[str, ...]:
        """Classes refused at once for now (only :class:`QueueDepth` refuses classes)."""
        return ()

    def describe(self) -> dict[str, object]:
        """Parameters and state, as plain data."""
        return {"controller": self.name, "estimate": self._limit}


class AIMD(Controller):
    """Additive increase, multiplicative decrease (loss based).

    Per interval: on a drop (a 429/503/timeout reported) or a mean latency above
    ``timeout`` seconds the limit becomes ``limit * backoff`` (``backoff`` in [0.5, 1));
    otherwise, if the limit was in use (load >= half of it), it grows by ``increase``;
    else it stays (an idle client does not learn a limit it never tried). Defaults as
    in Netflix concurrency-limits: ``backoff=0.9``, ``timeout=5.0``, ``increase=1``.
    """

    name = "aimd"

    def __init__(self, *, increase: float = 1.0, backoff: float = 0.9, timeout: float = 5.0):
        super().__init__()
        self.increase = _real("increase", increase, low=0.0)
        self.backoff = _real("backoff", backoff, low=0.5)
        if not self.backoff < 1.0:
            raise ValueError(f"backoff={backoff!r} must be in [0.5, 1)")
        self.timeout = _real("timeout", timeout, low=0.0)

    def update(self, w: Window) -> Decision:
        limit = self._limit
        if w.drops > 0:
            return self._set(limit * self.backoff, "drop", f"{w.drops} dropped")
        if w.samples and w.rtt_mean > self.timeout:
            return self._set(limit * self.backoff, "timeout", f"latency {w.rtt_mean:.3g} s")
        if w.inflight * 2 >= limit:
            return self._set(limit + self.increase, "increase")
        return Decision(limit)

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "increase": self.increase,
            "backoff": self.backoff,
            "timeout": self.timeout,
        }


def _log10(limit: float) -> float:
    return max(1.0, math.log10(max(limit, 1.0)))


class Vegas(Controller):
    """TCP Vegas on latency: keep the queue the limit builds between alpha and beta.

    With ``rtt_noload`` the lowest latency seen (re-probed every ``probe_multiplier *
    limit`` intervals with samples: one update per interval, as Netflix's windowed
    limit feeds it) and ``rtt`` the interval's mean, the queue is ``ceil(limit * (1 -
    rtt_noload / rtt))``. With ``l = max(1, log10(limit))``: queue <= ``threshold * l``:
    grow by ``beta * l``; queue < ``alpha * l``: grow by ``l``; queue > ``beta * l``:
    shrink by ``l``; else hold. A drop shrinks by ``l``. The step is smoothed:
    ``limit + smoothing * (new - limit)``. Defaults (Netflix concurrency-limits):
    ``alpha=3``, ``beta=6``, ``threshold=1``, ``smoothing=1``, ``probe_multiplier=30``.
    """

    name = "vegas"

    def __init__(
        self,
        *,
        alpha: float = 3.0,
        beta: float = 6.0,
        threshold: float = 1.0,
        smoothing: float = 1.0,
        probe_multiplier: int = 30,
    ) -> None:
        super().__init__()
        self.alpha = _real("alpha", alpha, low=0.0)
        self.beta = _real("beta", beta, low=self.alpha)
        self.threshold = _real("threshold", threshold, low=0.0)
        self.smoothing = _real("smoothing", smoothing, low=0.0, high=1.0)
        self.probe_multiplier = _count("probe_multiplier", probe_multiplier, 1)
        self.rtt_noload = math.nan
        self._since_probe = 0

    def update(self, w: Window) -> Decision:
        limit = self._limit
        if w.samples:
            self._since_probe += 1
            if self._since_probe >= self.probe_multiplier * limit:
                self._since_probe = 0
                self.rtt_noload = w.rtt_mean
                return Decision(limit, "", "probe: rtt_noload reset")
            if math.isnan(self.rtt_noload) or w.rtt_min < self.rtt_noload:
                self.rtt_noload = w.rtt_min
        l10 = _log10(limit)
        if w.drops > 0:
            new, reason = limit - l10, "drop"
        elif not w.samples or math.isnan(self.rtt_noload) or w.inflight * 2 < limit:
            return Decision(limit)
        else:
            queue = math.ceil(limit * (1.0 - self.rtt_noload / w.rtt_mean))
            if queue <= self.threshold * l10:
                new, reason = limit + self.beta * l10, "no queue"
            elif queue < self.alpha * l10:
                new, reason = limit + l10, "small queue"
            elif queue > self.beta * l10:
                new, reason = limit - l10, "queueing"
            else:
                return Decision(limit)
        new = max(1.0, new)
        return self._set(limit + self.smoothing * (new - limit), reason)

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "alpha": self.alpha,
            "beta": self.beta,
            "threshold": self.threshold,
            "smoothing": self.smoothing,
            "rtt_noload": self.rtt_noload,
        }


class Gradient2(Controller):
    """Netflix concurrency-limits' Gradient2 on latency.

    ``short`` is the interval's mean latency; ``long`` its exponential average over
    ``long_window`` intervals (a plain mean over the first ``warmup`` ones), cut by 10 %
    per interval while it is more than twice ``short`` (recovery after a long overload).
    ``gradient = clamp(long / short, 0.5, 1)``; ``new = limit * gradient + queue_size``;
    the limit moves by ``smoothing`` of the way there. It does not grow while less than
    half of it is in use. Defaults as published: ``smoothing=0.2``, ``queue_size=4``,
    ``long_window=600``, ``warmup=10``.
    """

    name = "gradient2"

    def __init__(
        self,
        *,
        smoothing: float = 0.2,
        queue_size: float = 4.0,
        long_window: int = 600,
        warmup: int = 10,
    ) -> None:
        super().__init__()
        self.smoothing = _real("smoothing", smoothing, low=0.0, high=1.0)
        self.queue_size = _real("queue_size", queue_size, low=0.0)
        self.long_window = _count("long_window", long_window, 1)
        self.warmup = _count("warmup", warmup, 0)
        self.long_rtt = math.nan
        self.short_rtt = math.nan
        self._n = 0
        self._sum = 0.0

    def _add_long(self, rtt: float) -> float:
        if self._n < self.warmup:
            self._n += 1
            self._sum += rtt
            self.long_rtt = self._sum / self._n
        else:
            factor = 2.0 / (self.long_window + 1)
            self.long_rtt = self.long_rtt * (1.0 - factor) + rtt * factor
        return self.long_rtt

    def update(self, w: Window) -> Decision:
        limit = self._limit
        if not w.samples or not w.rtt_mean > 0:
            return Decision(limit)
        short = self.short_rtt = w.rtt_mean
        long = self._add_long(short)
        if long / short > 2.0:
            self.long_rtt = long = long * 0.9
        if w.inflight < limit / 2:
            return Decision(limit)
        gradient = max(0.5, min(1.0, long / short))
        new = limit * gradient + self.queue_size
        new = limit * (1.0 - self.smoothing) + new * self.smoothing
        if new == limit:
            return Decision(limit)
        reason = "queueing" if gradient < 1.0 else "headroom"
        return self._set(new, reason, f"gradient {gradient:.3f}")

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "smoothing": self.smoothing,
            "queue_size": self.queue_size,
            "long_window": self.long_window,
            "long_rtt": self.long_rtt,
            "short_rtt": self.short_rtt,
        }


@dataclass(frozen=True)
class ScaleOut:
    """What the scale-out hook is told: when, the depth fraction, the demand and the
    backend's throughput over the last interval (per second), and the limit."""

    time: float
    q: float
    demand: float
    throughput: float
    limit: float


ScaleOutHook = Callable[[ScaleOut], "bool | None"]


class QueueDepth(Controller):
    """The backend's queue depth decides: scale out, then queue, then shed.

    ``q`` is ``queue_depth / queue_capacity`` from the gauges (``capacity`` stands in
    for a missing ``queue_capacity`` gauge). Each interval:

    * q >= ``scale_out_at`` (0.5) starts an *episode*: ``scale_out(ScaleOut)`` is called
      once; it returns False (or raises) when it cannot add capacity. A scale-out is
      pending for ``scale_out_timeout`` seconds (300): then it is done if q is below
      ``scale_out_at``, else it timed out (counts as failed). The episode ends when q
      falls below ``reset_below`` (0.3) with no scale-out pending: hysteresis, so a q
      hovering around 0.5, or dipping while new capacity starts, asks once.
    * q >= ``queue_at`` (0.8): the limit is held at ``hold * drained / max(1, q)``,
      where ``drained`` is what the backend completes (per the rate's period; for a
      concurrency limit, the completion rate times the mean latency), an exponential
      average over intervals with weight ``smoothing`` (0.3): the backend queue drains
      back below ``queue_at`` while excess requests wait in the bounded queue in front
      of it instead of being refused.
    * only while q keeps rising despite the hold (>= ``queue_at`` and up on each of the
      last ``patience`` (3) intervals) after the scale-out failed or timed out: one more
      class is refused per interval, lowest priority first (never the highest: past
      that the limit is multiplied by ``backoff``).
    * q < ``scale_out_at``: one refused class is re-admitted per interval while q does
      not rise, and the limit climbs back by ``recovery`` (a share of itself) per interval
      up to ``nominal`` (default: the level's limit when the Adaptive was made).
    """

    name = "queue-depth"

    def __init__(
        self,
        *,
        scale_out: ScaleOutHook | None = None,
        capacity: float | None = None,
        scale_out_at: float = 0.5,
        queue_at: float = 0.8,
        reset_below: float = 0.3,
        scale_out_timeout: float = 300.0,
        hold: float = 0.95,
        backoff: float = 0.9,
        recovery: float = 0.1,
        smoothing: float = 0.3,
        patience: int = 3,
        nominal: float | None = None,
    ) -> None:
        super().__init__()
        if scale_out is not None and not callable(scale_out):
            raise TypeError(f"scale_out={scale_out!r} must be callable")
        self.scale_out = scale_out
        self.capacity = None if capacity is None else _real("capacity", capacity, low=0.0)
        if self.capacity == 0.0:
            raise ValueError("capacity must be > 0")
        self.scale_out_at = _real("scale_out_at", scale_out_at, low=0.0)
        self.queue_at = _real("queue_at", queue_at, low=self.scale_out_at)
        self.reset_below = _real("reset_below", reset_below, low=0.0, high=self.scale_out_at)
        self.scale_out_timeout = _real("scale_out_timeout", scale_out_timeout, low=0.0)
        self.hold = _real("hold", hold, low=0.0, high=1.0)
        if not self.hold > 0.0:
            raise ValueError("hold must be in (0, 1]")
        self.backoff = _real("backoff", backoff, low=0.0, high=1.0)
        self.recovery = _real("recovery", recovery, low=0.0)
        self.smoothing = _real("smoothing", smoothing, low=0.0, high=1.0)
        if not self.smoothing > 0.0:
            raise ValueError("smoothing must be in (0, 1]")
        self._drained: float | None = None
        self.patience = _count("patience", patience, 1)
        self._rises = 0
        self.nominal = None if nominal is None else _real("nominal", nominal, low=0.0)
        self.q: float | None = None
        self.episode = False
        #: idle, pending (asked, waiting for capacity), done, failed, timed_out
        self.scale_out_state = "idle"
        self._asked_at = -math.inf
        self._shed = 0
        #: Scale-out outcomes: requested, failed, error, timed_out.
        self.counts: Counter[str] = Counter()
        #: (time, event, detail) of every episode start/end and scale-out outcome.
        self.events: deque[tuple[float, str, str]] = deque(maxlen=1000)

    def reset(
        self,
        limit: float,
        *,
        min_limit: float = 0.0,
        max_limit: float = math.inf,
        classes: Sequence[str] = (),
    ) -> None:
        super().reset(limit, min_limit=min_limit, max_limit=max_limit, classes=classes)
        if self.nominal is None:
            self.nominal = self._limit

    @property
    def shed(self) -> tuple[str, ...]:
        return self._classes[: self._shed]

    def _q(self, w: Window) -> float | None:
        q = w.queue_fraction
        if q is None and self.capacity is not None and "queue_depth" in w.gauges:
            q = w.gauges["queue_depth"] / self.capacity
        return q

    def _ask(self, w: Window, q: float) -> None:
        self._asked_at = w.end
        self.counts["requested"] += 1
        if self.scale_out is None:
            self.scale_out_state = "failed"
            self.events.append((w.end, "scale_out_failed", "no scale_out hook"))
            return
        req = ScaleOut(w.end, q, w.demand, w.throughput, self._limit)
        try:
            ok = self.scale_out(req)
        except Exception as e:  # a broken hook must not stop the control loop
            _log.warning("scale_out hook raised %r", e)
            self.counts["error"] += 1
            ok = False
        if ok is False:
            self.counts["failed"] += 1
            self.scale_out_state = "failed"
            self.events.append((w.end, "scale_out_failed", f"q={q:.3f}"))
        else:
            self.scale_out_state = "pending"
            self.events.append((w.end, "scale_out", f"q={q:.3f}"))

    def update(self, w: Window) -> Decision:
        limit = self._limit
        q = self._q(w)
        if q is None or not math.isfinite(q):
            return Decision(limit)
        if w.samples:
            now_drained = w.throughput * (w.per if w.kind == "rate" else w.rtt_mean)
            if math.isfinite(now_drained):
                d = self._drained
                a = self.smoothing
                self._drained = now_drained if d is None else d + a * (now_drained - d)
        prev, self.q = self.q, q
        rising = prev is not None and q > prev
        self._rises = self._rises + 1 if rising and q >= self.queue_at else 0
        if self.scale_out_state == "pending" and w.end - self._asked_at >= self.scale_out_timeout:
            if q >= self.scale_out_at:
                self.scale_out_state = "timed_out"
                self.counts["timed_out"] += 1
                self.events.append((w.end, "scale_out_timed_out", f"q={q:.3f}"))
            else:
                self.scale_out_state = "done"
        if not self.episode and q >= self.scale_out_at:
            self.episode = True
            self.events.append((w.end, "episode_start", f"q={q:.3f}"))
            self._ask(w, q)
        elif self.episode and q < self.reset_below and self.scale_out_state != "pending":
            self.episode = False
            self.scale_out_state = "idle"
            self.events.append((w.end, "episode_end", f"q={q:.3f}"))
        failed = self.scale_out_state in ("failed", "timed_out")

        if q >= self.queue_at:
            new, reason, detail = limit, "", ""
            drained = self._drained if self._drained is not None else math.nan
            target = self.hold * drained / max(1.0, q)
            if math.isfinite(target) and target < limit:
                new, reason = target, "queue"
                detail = f"q={q:.3f}: hold at {target:.4g} (drained {drained:.4g})"
            if failed and self._rises >= self.patience:
                if self._shed < len(self._classes) - 1:
                    self._shed += 1
                    cls = self._classes[self._shed - 1]
                    reason, detail = "shed", f"q={q:.3f} rising: refuse {cls!r}"
                else:
                    new, reason = min(new, limit * self.backoff), "backoff"
                    detail = f"q={q:.3f} rising, nothing left to shed"
            if reason:
                return self._set(new, reason, detail)
            return Decision(limit)
        if q >= self.scale_out_at:
            if self._shed and not rising:
                self._shed -= 1
                return Decision(limit, "admit", f"q={q:.3f}: admit {self._classes[self._shed]!r}")
            return Decision(limit)
        if self._shed and not rising:
            self._shed -= 1
            return Decision(limit, "admit", f"q={q:.3f}: admit {self._classes[self._shed]!r}")
        nominal = self.nominal if self.nominal is not None else self._hi
        if limit < nominal and not rising:
            return self._set(min(nominal, limit * (1.0 + self.recovery)), "recover", f"q={q:.3f}")
        return Decision(limit)

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "q": self.q,
            "episode": self.episode,
            "scale_out_state": self.scale_out_state,
            "shed": list(self.shed),
            "nominal": self.nominal,
            "scale_out_at": self.scale_out_at,
            "queue_at": self.queue_at,
            "reset_below": self.reset_below,
        }
