"""asyncio adapter: the queued path of ``acquire_async``.

Each event loop gets one pipe and one native ``Channel``. The native driver thread puts
outcomes in the channel and writes one byte to the pipe; the loop's reader drains the
channel and resolves the waiting futures. No polling, one wake per waiter, no GIL
needed by the driver. Cancellation is exact: a waiter still queued is removed; a grant
that raced the cancel is given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from typing import TYPE_CHECKING, Any

from ._ratequeue import Channel

if TYPE_CHECKING:
    from ._ratequeue import Acquiring, Permit, Policy, PolicyPermit

__all__ = ["PolicyAcquire"]


class _LoopChannel:
    """The pipe, native channel and pending futures of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # No reference to the loop here: the registry maps loop -> channel weakly, and a
        # value that held its key would keep every loop (and its pipe) alive forever.
        self.pid = os.getpid()
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.channel = Channel(self.wfd)
        self.pending: dict[int, tuple[asyncio.Future[Permit], Acquiring]] = {}
        loop.add_reader(self.rfd, self._drain)
        weakref.finalize(loop, _close_fds, self.rfd, self.wfd)

    def _drain(self) -> None:
        try:
            while os.read(self.rfd, 4096):
                pass
        except BlockingIOError:
            pass
        for ticket, granted, waited_ns, token in self.channel.drain_tokens():
            entry = self.pending.pop(ticket, None)
            if entry is None:
                continue
            fut, acq = entry
            if fut.done():
                # Cancelled while the grant was on its way: give it back, exactly once.
                if granted:
                    acq._give_back(token)
                continue
            if granted:
                fut.set_result(acq._granted(waited_ns, token))
            else:
                fut.set_exception(acq._timeout_error(waited_ns))


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


_channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopChannel] = (
    weakref.WeakKeyDictionary()
)


def _channel_for(loop: asyncio.AbstractEventLoop) -> _LoopChannel:
    ch = _channels.get(loop)
    if ch is None or ch.pid != os.getpid():
        # New loop, or a loop inherited across fork: a fresh pipe for this process.
        ch = _LoopChannel(loop)
        _channels[loop] = ch
    return ch


async def _wait(acq: Acquiring) -> Any:
    """Queue ``acq`` on the running loop's channel and wait for its one wake-up."""
    loop = asyncio.get_running_loop()
    ch = _channel_for(loop)
    ticket = acq._submit(ch.channel)
    if not isinstance(ticket, int):
        return ticket  # granted at once
    fut: asyncio.Future[Permit] = loop.create_future()
    ch.pending[ticket] = (fut, acq)
    try:
        return await fut
    except asyncio.CancelledError:
        if acq._cancel(ticket):
            ch.pending.pop(ticket, None)
        elif fut.done() and not fut.cancelled() and fut.exception() is None:
            # Granted, but the task was cancelled before it resumed: give it back once.
            acq._abandon(fut.result())
        # Otherwise the outcome is still in the channel: _drain gives a grant back.
        raise


class PolicyAcquire:
    """What ``Policy.acquire_async`` returns: await it, or use ``async with``.

    Waits in the queue of each concurrency level in order, then for the latest rate
    level, all within ``timeout``; on cancellation or error everything taken is given
    back.
    """

    def __init__(self, policy: Policy, timeout: float | None, kw: dict[str, Any]) -> None:
        self._policy = policy
        self._timeout = timeout
        self._kw = kw
        self._permit: PolicyPermit | None = None

    def __await__(self) -> Any:
        return self._run().__await__()

    async def _run(self) -> PolicyPermit:
        loop = asyncio.get_running_loop()
        start = loop.time()

        def left() -> float | None:
            if self._timeout is None:
                return None
            return max(0.0, self._timeout - (loop.time() - start))

        held: list[Permit] = []
        try:
            for level, key in self._policy._concurrency_steps(**self._kw):
                if key is None:
                    held.append(await level.acquire_async(timeout=left()))
                else:
                    held.append(await level.acquire_async(key, timeout=left()))
        except BaseException:
            for p in held:
                p.release()
            raise
        permit = self._policy._reserve_rates(held, left(), **self._kw)
        if permit.delay > 0 and not self._policy._manual:
            try:
                await asyncio.sleep(permit.delay)
            except BaseException:
                permit.cancel()
                raise
        self._permit = permit
        return permit

    async def __aenter__(self) -> PolicyPermit:
        return await self._run()

    async def __aexit__(self, *exc: object) -> bool:
        if self._permit is not None:
            self._permit.release()
        return False
