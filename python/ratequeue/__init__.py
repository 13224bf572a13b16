"""ratequeue: rate limiting whose queue wait is explicit, bounded, fair and measured.

The engine is a lock-free Rust core (``ratequeue._ratequeue``); this package re-exports
its types and adds thin Python adapters.
"""

# Imported first: ratequeue.aio hands the policy's asyncio wait to the native module.
from . import aio as aio
from ._errors import CostTooLarge, Overloaded, QuotaExceeded, RateQueueError, WaitTimeout
from ._policy import Policy
from ._ratequeue import (
    Acquiring,
    Channel,
    Concurrency,
    Histogram,
    KeyedConcurrency,
    KeyedLimiter,
    Limiter,
    ManualClock,
    MonotonicClock,
    Permit,
    PolicyAcquiring,
    PolicyPermit,
    Rate,
    Reservation,
    __version__,
)
from .adaptive import AIMD, Adaptive, Gradient2, QueueDepth, Vegas
from .canary import Canary
from .httpx._budget import BudgetExceeded, CallBudget
from .pool import Pool, PoolAcquiring, PoolOverloaded, Provider

# Fork safety needs no Python hook: the core takes and releases its locks in
# pthread_atfork handlers, and a child drops the waiters it inherited.

__all__ = [
    "AIMD",
    "Acquiring",
    "Adaptive",
    "BudgetExceeded",
    "CallBudget",
    "Canary",
    "Channel",
    "Concurrency",
    "CostTooLarge",
    "Gradient2",
    "Histogram",
    "KeyedConcurrency",
    "KeyedLimiter",
    "Limiter",
    "ManualClock",
    "MonotonicClock",
    "Overloaded",
    "Permit",
    "Policy",
    "PolicyAcquiring",
    "PolicyPermit",
    "Pool",
    "PoolAcquiring",
    "PoolOverloaded",
    "Provider",
    "QueueDepth",
    "QuotaExceeded",
    "Rate",
    "RateQueueError",
    "Reservation",
    "Vegas",
    "WaitTimeout",
    "__version__",
]
