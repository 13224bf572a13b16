"""The quota ledger: per-account usage against a plan, idempotent per request id.

``SqliteLedger`` (one file, stdlib ``sqlite3``) and ``RedisLedger`` (several machines;
it lives in ``ratequeue.redis`` and is re-exported here, imported on first use so that
this package needs no redis-py) offer the same calls: ``charge``,
``hold``/``settle``/``release``, queries, warnings
through an outbox (``Notifier`` delivers them in the background), and compensation
campaigns; a ``QuotaLevel`` makes an account a level of ``rq.Policy`` (which is then a
``LedgerPolicy``), or of any policy-like object through ``QuotaPolicy``. Periods are in
UTC unless a plan's period names a time zone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import QuotaExceeded
from ._base import LedgerBase
from ._model import (
    UNITS,
    Balance,
    CampaignReport,
    Charge,
    Daily,
    Every,
    Hold,
    IdempotencyConflict,
    LedgerError,
    Monthly,
    Notice,
    Page,
    Period,
    Plan,
    RequestUsage,
    Span,
    Totals,
    UnknownAccount,
    UnknownRequest,
)
from ._notifier import Notifier
from ._policy import LedgerPolicy, QuotaAcquiring, QuotaLevel, QuotaPermit, QuotaPolicy
from ._protocol import LedgerLike
from ._sqlite import SqliteLedger

__all__ = [
    "UNITS",
    "Balance",
    "CampaignReport",
    "Charge",
    "Daily",
    "Every",
    "Hold",
    "IdempotencyConflict",
    "LedgerBase",
    "LedgerError",
    "LedgerLike",
    "LedgerPolicy",
    "Monthly",
    "Notice",
    "Notifier",
    "Page",
    "Period",
    "Plan",
    "QuotaAcquiring",
    "QuotaExceeded",
    "QuotaLevel",
    "QuotaPermit",
    "QuotaPolicy",
    "RedisLedger",
    "RequestUsage",
    "Span",
    "SqliteLedger",
    "Totals",
    "UnknownAccount",
    "UnknownRequest",
]

if TYPE_CHECKING:
    from ..redis._ledger import RedisLedger


def __getattr__(name: str) -> Any:
    if name == "RedisLedger":
        from ..redis._ledger import RedisLedger

        return RedisLedger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
