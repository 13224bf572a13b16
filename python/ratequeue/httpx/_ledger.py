"""The transport's side of a quota ledger: what it calls, and how an asyncio caller calls
it without blocking the event loop (the ledger's ``*_async`` twins when it has them, a
worker thread otherwise)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .._threads import ProcessThreads

__all__ = ["Ledger"]


class Ledger(Protocol):
    """A quota ledger (e.g. ``ratequeue.ledger``): holds, settles or releases a call.

    Async clients use its ``hold_async`` / ``settle_async`` / ``release_async`` twins
    when it has them (``ratequeue.ledger`` does; a ``hold_async`` cancelled while it runs
    gives its hold back, as theirs do), else run these methods on a worker thread: the
    event loop never waits on the ledger's storage.
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


_threads = ProcessThreads("ratequeue-httpx-ledger", 8)


def _worker() -> concurrent.futures.ThreadPoolExecutor:
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
