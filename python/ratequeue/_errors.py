"""The exception hierarchy of ratequeue; every refusal carries ``retry_after``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["CostTooLarge", "Overloaded", "QuotaExceeded", "RateQueueError", "WaitTimeout"]


class RateQueueError(Exception):
    """Base of every error ratequeue raises on purpose.

    ``retry_after`` is the number of seconds after which the same request could be
    admitted (``inf`` when it never can, ``0.0`` when unknown).
    """

    retry_after: float

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = float(retry_after)


class Overloaded(RateQueueError):
    """Refused at once: the queue is full or the deadline cannot be met. Nothing was consumed.

    ``retry_after`` (no new arrivals assumed): for a full queue, when everyone queued
    and this request will have been served (a ``try_acquire`` then is admitted); for a
    predicted deadline miss, when the same request with the same deadline is accepted.
    """


class WaitTimeout(RateQueueError):
    """Waited until the deadline without being granted. Nothing was consumed.

    ``retry_after``: on a rate, when everyone still queued and this request will have
    been served (a ``try_acquire`` then is admitted); ``0.0`` on a concurrency limit,
    where it depends on releases.
    """


class CostTooLarge(RateQueueError, ValueError):
    """The cost exceeds the burst of a rate, so it could never be admitted; never queued."""

    def __init__(self, message: str, retry_after: float = float("inf")) -> None:
        super().__init__(message, retry_after)


class QuotaExceeded(RateQueueError):
    """A quota ledger refused: the account's period quota (and bonus) cannot cover the cost.

    Nothing was charged. ``reset_at`` is the Unix time the period renews; ``retry_after``
    the seconds until then; ``account`` and ``unit`` name what ran out.
    """

    def __init__(
        self,
        message: str,
        retry_after: float = 0.0,
        *,
        account: str = "",
        unit: str = "",
        reset_at: float = 0.0,
    ) -> None:
        super().__init__(message, retry_after)
        self.account = account
        self.unit = unit
        self.reset_at = float(reset_at)


def _hand_over() -> None:
    """Gives the native module the classes its errors map onto (no import on error paths)."""
    from ._ratequeue import _use_errors

    _use_errors(Overloaded, WaitTimeout, CostTooLarge)


_hand_over()


def each(items: Iterable[T], fn: Callable[[T], object]) -> None:
    """``fn`` on every item, whatever one raises: the first error is raised after (the
    others are dropped)."""
    first: BaseException | None = None
    for item in items:
        try:
            fn(item)
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first
