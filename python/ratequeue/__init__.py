"""ratequeue: rate limiting whose queue wait is explicit, bounded, fair and measured.

The engine is a lock-free Rust core (``ratequeue._ratequeue``); this package re-exports
its types and adds thin Python adapters.
"""

from __future__ import annotations

from ._errors import CostTooLarge, Overloaded, RateQueueError, WaitTimeout
from ._ratequeue import (
    Acquiring,
    Concurrency,
    Histogram,
    Limiter,
    ManualClock,
    MonotonicClock,
    Permit,
    Rate,
    Reservation,
    __version__,
)

__all__ = [
    "Acquiring",
    "Concurrency",
    "CostTooLarge",
    "Histogram",
    "Limiter",
    "ManualClock",
    "MonotonicClock",
    "Overloaded",
    "Permit",
    "Rate",
    "RateQueueError",
    "Reservation",
    "WaitTimeout",
    "__version__",
]
