"""ratequeue: rate limiting whose queue wait is explicit, bounded, fair and measured.

The engine is a lock-free Rust core (``ratequeue._ratequeue``); this package re-exports
its types and adds thin Python adapters.
"""

from __future__ import annotations

import os as _os

from ._errors import CostTooLarge, Overloaded, RateQueueError, WaitTimeout
from ._ratequeue import (
    Acquiring,
    Concurrency,
    Histogram,
    KeyedConcurrency,
    KeyedLimiter,
    Limiter,
    ManualClock,
    MonotonicClock,
    Permit,
    Policy,
    PolicyPermit,
    Rate,
    Reservation,
    __version__,
)
from .pool import Pool, PoolOverloaded, Provider

# Fork safety: no queue is copied into a child while another thread changes it, and a
# child drops the waiters it inherited (their threads and loops are not there).
if hasattr(_os, "register_at_fork"):
    from ._ratequeue import _after_fork, _after_fork_parent, _before_fork

    _os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork
    )

__all__ = [
    "Acquiring",
    "Concurrency",
    "CostTooLarge",
    "Histogram",
    "KeyedConcurrency",
    "KeyedLimiter",
    "Limiter",
    "ManualClock",
    "MonotonicClock",
    "Overloaded",
    "Permit",
    "Policy",
    "PolicyPermit",
    "Pool",
    "PoolOverloaded",
    "Provider",
    "Rate",
    "RateQueueError",
    "Reservation",
    "WaitTimeout",
    "__version__",
]
