"""Closing a transport: what it still owes settled first (its streams dropped unclosed,
its background responses waiting), then its inner transport closed."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Self

from ._unclosed import (
    DROPPED,
    FLUSH_TIMEOUT,
    collecting,
    settle_closed,
    settle_unclosed,
    settle_unclosed_async,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from ._background import Background
    from ._record import _Call

__all__ = ["_Closing"]


class _Closing:
    """The transport's ``close`` / ``aclose`` and context managers."""

    if TYPE_CHECKING:
        inner: Any
        _background: Background
        _at_estimate: Callable[[_Call], None]
        _pay_async: Callable[[_Call], Coroutine[Any, Any, None]]

        def _drain_background(
            self, blocking: bool = True, pay: Callable[[_Call], object] | None = None
        ) -> None: ...

    def close(self) -> None:
        """Close the inner transport; first the streams dropped unclosed are settled (in
        this thread; those being settled by the settling thread waited for, at most
        ``FLUSH_TIMEOUT`` s), then background responses still waiting for their usage at
        their estimate (each, whatever fails: the first error is raised after; an
        interrupt of one step still runs the next). Inside a garbage collection (an SDK
        client's ``__del__``), whose thread may hold the transport's locks, the settling
        thread does both (at interpreter exit, where it cannot run: here)."""
        try:
            if collecting() and DROPPED.running and not sys.is_finalizing():
                DROPPED.put(lambda: settle_closed(self))
            else:
                try:
                    settle_unclosed(self, FLUSH_TIMEOUT)
                finally:
                    self._drain_background(blocking=not collecting())
        finally:
            if hasattr(self.inner, "close"):
                self.inner.close()

    async def aclose(self) -> None:
        """Close the inner async transport; first the streams dropped unclosed are
        settled (their ledger parts off the event loop; those being settled by the
        settling thread waited for off it), then background responses still waiting for
        their usage at their estimate (their ledger parts off the loop, each whatever
        fails: the first error is raised after; a cancel of one step still runs the
        next)."""
        try:
            await settle_unclosed_async(self, FLUSH_TIMEOUT)
        finally:
            error: BaseException | None = None
            try:
                for c in self._background.drain() or ():
                    try:
                        try:
                            self._at_estimate(c)
                        finally:
                            await self._pay_async(c)
                    except BaseException as e:  # the others are settled all the same
                        error = error or e
            finally:
                try:
                    if hasattr(self.inner, "aclose"):
                        await self.inner.aclose()
                finally:
                    if error is not None:
                        raise error

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
