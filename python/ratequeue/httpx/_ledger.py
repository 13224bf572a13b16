"""The transport's side of a quota ledger: what it calls, and how an asyncio caller calls
it without blocking the event loop (the ledger's ``*_async`` twins when it has them, a
worker thread otherwise). ``Ledger`` is ``ratequeue.ledger.LedgerLike``."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._threads import DaemonThreads, ProcessThreads

if TYPE_CHECKING:
    from ..ledger._protocol import LedgerLike as Ledger

__all__ = ["Ledger"]


def __getattr__(name: str) -> Any:
    # ``ratequeue.ledger``'s protocol, imported when first named: the transport itself
    # needs no ledger package.
    if name == "Ledger":
        from ..ledger._protocol import LedgerLike

        return LedgerLike
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_threads = ProcessThreads("ratequeue-httpx-ledger", 8)


def _worker() -> DaemonThreads:
    """Threads for ledgers without asyncio twins (made again in a forked child)."""
    return _threads.get()


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()  # seen: an op whose caller left logs nothing at shutdown


async def call_async(ledger: Any, name: str, *args: Any, **kw: Any) -> Any:
    """``ledger.<name>(*args, **kw)`` off the event loop; it runs to its end even when
    the caller is cancelled meanwhile (the cancellation is raised after it started)."""
    twin: Callable[..., Awaitable[Any]] | None = getattr(ledger, name + "_async", None)
    fut: asyncio.Future[Any]
    if twin is not None:
        fut = asyncio.ensure_future(twin(*args, **kw))
    else:
        fut = asyncio.wrap_future(_worker().submit(getattr(ledger, name), *args, **kw))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_retrieve)
        raise


async def hold_async(ledger: Any, request_id: str, account: str, **kw: Any) -> None:
    """``ledger.hold`` off the event loop; cancelled meanwhile, the hold is given back
    once it is made (the ledger's own ``hold_async`` does that itself)."""
    twin: Callable[..., Awaitable[Any]] | None = getattr(ledger, "hold_async", None)
    if twin is not None:
        await twin(request_id, account, **kw)
        return
    cf = _worker().submit(ledger.hold, request_id, account, **kw)
    try:
        await asyncio.shield(asyncio.wrap_future(cf))
    except asyncio.CancelledError:

        def undo(f: concurrent.futures.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                ledger.release(request_id)

        cf.add_done_callback(undo)  # runs in the worker thread: needs no event loop
        raise
