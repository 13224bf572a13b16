"""``LedgerLike``: the calls a caller of a quota ledger needs (hold, settle, release),
as a protocol that ``LedgerBase`` and any other ledger satisfy without inheriting."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

__all__ = ["LedgerLike"]


class LedgerLike(Protocol):
    """A quota ledger as callers use it: holds an estimate, then settles the real usage
    or releases the hold, each idempotent by request id.

    Asyncio callers (``ratequeue.httpx``) also use ``hold_async`` / ``settle_async`` /
    ``release_async`` twins when the ledger has them (``LedgerBase`` does).
    """

    def hold(
        self,
        request_id: str,
        account: str,
        *,
        input_tokens: int = 0,
        output_tokens: int = 0,
        calls: int = 1,
        model: str | None = None,
        parent_id: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Any: ...

    def settle(
        self,
        request_id: str,
        *,
        input_tokens: int,
        output_tokens: int,
        calls: int = 1,
        model: str | None = None,
    ) -> Any: ...

    def release(self, request_id: str) -> Any: ...


if TYPE_CHECKING:
    from ._base import LedgerBase

    def _base_is_ledger_like(ledger: LedgerBase) -> LedgerLike:
        return ledger  # mypy checks that LedgerBase satisfies the protocol
