"""Delivery of threshold notices from the outbox to a callback, in the background."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType

from ._base import LedgerBase
from ._model import Notice, check_seconds

log = logging.getLogger("ratequeue.ledger")


class Notifier:
    """A thread handing the ledger's notices to ``callback`` (sync or async) at least once:
    woken as soon as this process records a notice, and every ``interval`` seconds for
    those other processes recorded. A callback that raises leaves its notice in the
    outbox for the next round (logged)."""

    def __init__(
        self,
        ledger: LedgerBase,
        callback: Callable[[Notice], Awaitable[None] | None],
        *,
        interval: float = 5.0,
    ) -> None:
        if not isinstance(ledger, LedgerBase):
            raise TypeError(f"ledger must be a ledger, got {type(ledger).__name__}")
        if not callable(callback):
            raise TypeError("callback must be callable")
        self.ledger = ledger
        self.callback = callback
        self.interval = check_seconds("interval", interval)
        self.delivered = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _call(self, notice: Notice) -> None:
        r = self.callback(notice)
        if inspect.isawaitable(r):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(_wait(r))

    def deliver_now(self) -> int:
        """Delivers what is pending now, in this thread; returns how many."""
        try:
            n = self.ledger.deliver(self._call)
        except Exception:
            self.failures += 1
            log.exception("ledger notice delivery failed; the notice stays in the outbox")
            return 0
        self.delivered += n
        return n

    def _run(self) -> None:
        event = self.ledger._notice_event
        try:
            while not self._stop.is_set():
                event.clear()
                while self.deliver_now() and not self._stop.is_set():
                    pass
                event.wait(self.interval)
        finally:
            if self._loop is not None:
                self._loop.close()
                self._loop = None

    def start(self) -> Notifier:
        """Starts the background thread (a daemon)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="ratequeue-ledger-notifier", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stops the thread after its current delivery."""
        self._stop.set()
        self.ledger._notice_event.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> Notifier:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


async def _wait(r: Awaitable[None]) -> None:
    await r
