"""asyncio adapter: the queued path of ``acquire_async`` (Policy's included).

Each event loop gets one native ``Channel``, which owns its wake-up descriptor (an
eventfd on Linux, a pipe elsewhere). The native driver thread puts outcomes in the
channel and signals the descriptor; the loop's reader drains the channel and resolves
the waiting futures. No polling, one wake per waiter, no GIL needed by the driver.

Every wait is native: awaiting an ``Acquiring`` (a policy's too, through
:func:`_policy_wait`) submits and yields one future of the running loop, kept in the
loop's ``_LoopWaiters``, and the reader resolves a whole batch of those futures in one
native call. The lifecycle of each wait (its states, and the leave rule below) is the
core's (``wait/awaiting.rs``), tested there on a ManualClock.

Every end of a queued wait other than its outcome (cancellation, GeneratorExit from a
closed or collected coroutine, KeyboardInterrupt or SystemExit thrown into the task)
removes the waiter or gives back the grant that raced it, exactly once. When a loop goes
(closed, or collected without being closed) its channel is closed and every ticket still
pending on it is cancelled in its queue; a grant that reaches a closed channel goes back
to its queue in the core. The channel closes its descriptor only when no writer is left,
so nothing is ever written to a closed (and possibly reused) descriptor number.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._ratequeue import Channel, _LoopWaiters, _use_aio, _wait_left, _wait_policy

if TYPE_CHECKING:
    from ._ratequeue import PolicyAcquiring, PolicyPermit

__all__: list[str] = []

# What a closed channel core points at: no descriptor, closed, so its own is released.
_CLOSED = Channel()
_CLOSED.close()


class _Core:
    """The native channel of one event loop and what its pending waits hold.

    Refers to nothing of the loop (no loop, no future), so the registry and the loop's
    finalizer can keep it without keeping the loop alive. The channel's table of native
    waits is settled by whoever takes a ticket out (the reader, the waiter leaving, or
    :meth:`close`).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.channel = Channel(wakeup=True)
        self.closed = False
        self.loop_part: weakref.ref[_LoopChannel] | None = None

    @property
    def pending(self) -> int:
        """How many native waits on this channel still expect an outcome."""
        return self.channel.pending

    def close(self) -> None:
        """The loop is gone: cancel every pending ticket, give back what it holds."""
        if self.closed:
            return
        self.closed = True
        channel, self.channel = self.channel, _CLOSED
        if self.pid != os.getpid():
            # Inherited across fork: those waiters belong to the parent, and the native
            # channel signals nothing in this process.
            return
        # Settles every native wait on it (a delivered grant goes back, a pending wait
        # leaves its queue); no other ticket waits on an asyncio loop's channel.
        channel.close()


class _LoopChannel:
    """The loop's side: the reader and the futures (in ``waiters``), reachable only from
    the loop (its reader callback) and its tasks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.core = _Core()
        self.core.loop_part = weakref.ref(self)
        self.waiters = _LoopWaiters(self.core.channel)
        loop.add_reader(self.core.channel.fileno(), self.waiters._resolve)


_channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Core] = weakref.WeakKeyDictionary()
_observed: set[type] = set()
_wrappers: set[Callable[..., None]] = set()
_registry_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A thread of the parent may have held the registry's lock at fork: a fresh one;
    and the parent's channels are not this process's."""
    global _registry_lock, _last
    _registry_lock = threading.Lock()
    _last = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: The last loop asked for and its channel (weak), so a task's wait finds it at once.
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], weakref.ref[_LoopChannel]] | None = None
_get_running_loop = asyncio.get_running_loop


def _running_waiters() -> tuple[asyncio.AbstractEventLoop, _LoopWaiters]:
    """The running loop and its table of native waits (made on first use)."""
    loop = _get_running_loop()
    last = _last
    if last is not None and last[0]() is loop:
        lc = last[1]()
        if lc is not None and not lc.core.closed:
            return loop, lc.waiters
    return loop, _channel_for(loop).waiters


def _channel_for(loop: asyncio.AbstractEventLoop) -> _LoopChannel:
    global _last
    core = _channels.get(loop)
    if core is not None and core.pid == os.getpid() and core.loop_part is not None:
        lc = core.loop_part()
        if lc is not None:
            _last = (weakref.ref(loop), weakref.ref(lc))
            return lc
    lc = _new_channel(loop)
    _last = (weakref.ref(loop), weakref.ref(lc))
    return lc


def _new_channel(loop: asyncio.AbstractEventLoop) -> _LoopChannel:
    with _registry_lock:
        old = _channels.get(loop)
        if old is not None and old.pid == os.getpid() and old.loop_part is not None:
            lc = old.loop_part()
            if lc is not None:
                return lc
        if old is not None:
            old.close()  # a loop inherited across fork: a fresh channel for this process
        # Loops whose close could not be observed (a class that cannot be changed) are
        # caught here once closed, else when collected.
        for other, core in list(_channels.items()):
            if other.is_closed():
                core.close()
        lc = _LoopChannel(loop)
        _channels[loop] = lc.core
        weakref.finalize(loop, lc.core.close).atexit = False
        _observe_close(loop)
    return lc


def _observe_close(loop: asyncio.AbstractEventLoop) -> None:
    """Makes ``close()`` of the loop's class close the loop's channel once it succeeds.

    Wraps the method on the class (once per class), so the loop is passed as ``self``
    even from ``__del__``; a class that cannot be changed is left to the sweep in
    :func:`_new_channel` and to the finalizer.
    """
    cls = type(loop)
    if cls in _observed:
        return
    _observed.add(cls)
    orig = cls.close
    if orig in _wrappers:
        return

    @functools.wraps(orig)
    def close(self: asyncio.AbstractEventLoop) -> None:
        try:
            orig(self)
        finally:
            if self.is_closed():
                core = _channels.get(self)
                if core is not None:
                    core.close()

    _wrappers.add(close)
    with contextlib.suppress(TypeError, AttributeError):
        setattr(cls, "close", close)  # noqa: B010


async def _policy_wait(acq: PolicyAcquiring) -> PolicyPermit:
    """Bridges a policy acquire to the running loop: the core decides each step (wait
    in a level's queue, or hold every level) and awaits it natively. Then sleeps until
    the rate levels' common time (never on a ManualClock)."""
    permit: PolicyPermit = await _wait_policy(acq)
    left = _wait_left(acq)
    if left > 0:
        try:
            await asyncio.sleep(left)
        except BaseException:
            permit.cancel()
            raise
    return permit


_use_aio(_policy_wait, _running_waiters)
