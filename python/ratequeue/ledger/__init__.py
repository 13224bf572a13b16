"""The quota ledger: per-account usage against a plan, idempotent per request id.

``SqliteLedger`` (one file, stdlib ``sqlite3``) and ``RedisLedger`` (several machines)
offer the same calls: ``charge``, ``hold``/``settle``/``release``, queries, warnings
through an outbox (``Notifier`` delivers them in the background), and compensation
campaigns; ``QuotaPolicy`` makes an account a level of a ``Policy``. Periods are in UTC
unless a plan's period names a time zone.
"""

from __future__ import annotations

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
from ._policy import QuotaLevel, QuotaPermit, QuotaPolicy
from ._redis import RedisLedger
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
    "Monthly",
    "Notice",
    "Notifier",
    "Page",
    "Period",
    "Plan",
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
