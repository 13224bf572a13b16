"""``ratequeue.httpx``: an httpx / httpx2 transport for LLM SDKs that queues every call.

``RateLimitedTransport(inner, limit)`` wraps a transport: each call waits in
ratequeue's queue (bounded, by priority), is charged what it really used (from the JSON
body or the SSE stream, read as it passes), and the limiter follows the provider's
rate-limit headers (a 429 puts it in debt until the provider's reset). ``CallBudget``
caps the model calls and tokens of one user request; ``Cap`` rules cap output tokens per
route, model or task. Neither httpx nor httpx2 is imported by ``import ratequeue``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._budget import BudgetExceeded, CallBudget, SubCall, current_budget
from ._caps import Cap, CapNotApplied, Capped, apply_caps
from ._context import CallOptions, current_options, using
from ._estimate import Estimate, Estimator, TokenEstimator, chars_estimate
from ._headers import (
    Quota,
    RateLimitHeaders,
    parse_duration,
    parse_instant,
    parse_rate_limit_headers,
    parse_retry_after,
)
from ._transport import (
    ACCOUNT_HEADER,
    PRIORITY_HEADER,
    TASK_HEADER,
    CallRecord,
    RateLimitedTransport,
)
from ._usage import SSEUsage, Usage, usage_from_json

__all__ = [
    "ACCOUNT_HEADER",
    "PRIORITY_HEADER",
    "TASK_HEADER",
    "BudgetExceeded",
    "CallBudget",
    "CallOptions",
    "CallRecord",
    "Cap",
    "CapNotApplied",
    "Capped",
    "Estimate",
    "Estimator",
    "Ledger",
    "Quota",
    "RateLimitHeaders",
    "RateLimitedTransport",
    "SSEUsage",
    "SubCall",
    "TokenEstimator",
    "Usage",
    "apply_caps",
    "chars_estimate",
    "current_budget",
    "current_options",
    "parse_duration",
    "parse_instant",
    "parse_rate_limit_headers",
    "parse_retry_after",
    "usage_from_json",
    "using",
]

if TYPE_CHECKING:
    from ..ledger._protocol import LedgerLike as Ledger


def __getattr__(name: str) -> Any:
    # ``Ledger`` is ``ratequeue.ledger.LedgerLike``, imported when first named (the
    # transport itself needs no ledger package).
    if name == "Ledger":
        from ..ledger._protocol import LedgerLike

        return LedgerLike
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
