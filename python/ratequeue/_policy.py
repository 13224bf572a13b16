"""``ratequeue.Policy``: the native policy, whose levels may also include one quota level
of a ledger (``ratequeue.ledger.QuotaLevel``); such a policy is a
``ratequeue.ledger.LedgerPolicy``, the native policy of the other levels plus the
ledger's hold, taken and given back all or nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ._ratequeue import Policy as _NativePolicy

if TYPE_CHECKING:
    from ._ratequeue import Level
    from .ledger._policy import QuotaLevel

__all__ = ["Policy"]


class Policy(_NativePolicy):
    """Several limits at once (user -> tenant -> cluster -> monthly quota), all or nothing.

    ``levels``: an ordered dict of name -> Limiter | KeyedLimiter | Concurrency |
    KeyedConcurrency, and at most one ``ratequeue.ledger.QuotaLevel`` (then the policy is
    a ``ratequeue.ledger.LedgerPolicy``: its permits carry the ledger's hold). Keyed
    levels take their key from the keyword named like the level; costs are keywords per
    unit; ``shadow`` levels are evaluated and counted, never enforced.
    """

    __slots__ = ()

    def __new__(
        cls,
        levels: Mapping[str, Level | QuotaLevel],
        *,
        shadow: Sequence[str] | None = None,
    ) -> Policy:
        if cls is Policy and isinstance(levels, dict):
            for v in levels.values():
                if getattr(type(v), "_policy_level", None) == "quota":
                    from .ledger._policy import LedgerPolicy

                    return LedgerPolicy(levels, shadow=shadow)
        return super().__new__(cls, levels, shadow=shadow)  # type: ignore[arg-type,return-value]


Policy.__module__ = "ratequeue"
