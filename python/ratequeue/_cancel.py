"""Cancels that a library below us swallowed.

On Python 3.10 and 3.11, ``asyncio.wait_for`` returns the inner result when the task is
cancelled just as the inner awaitable finishes, and the cancel is gone (fixed in 3.12).
redis-py's asyncio connection sends each command through ``wait_for`` whenever the client
has a ``socket_timeout``, so an awaited Redis call cancelled at that moment runs on to its
reply and returns to a task that was told to stop. ``Task.cancelling()`` (3.11+) still
counts the request: a call that compares it before and after notices the swallow and
raises ``CancelledError`` itself, after putting right what the call did.

``within`` is ``wait_for`` without the swallow, for our own deadlines; the Redis clients
ratequeue makes send without it (``ratequeue.redis._connection.cancel_safe``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

#: True where ``Task.cancelling`` exists (Python 3.11+).
HAS_CANCELLING = sys.version_info >= (3, 11)
#: True where ``asyncio.timeout`` never turns an outstanding cancel into its own expiry
#: (3.11.3+, the version from which redis-py itself uses it).
HAS_TIMEOUT = sys.version_info >= (3, 11, 3)


def cancel_requests() -> int:
    """The cancel requests the running task has not taken back (0 where Python cannot
    tell: before 3.11, or outside a task)."""
    task = asyncio.current_task()
    return task.cancelling() if HAS_CANCELLING and task is not None else 0


def swallowed(before: int) -> bool:
    """True when the running task was asked to cancel since ``before`` (a count from
    ``cancel_requests``) while the awaited call still returned normally."""
    return cancel_requests() > before


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """``asyncio.wait_for(aw, seconds)`` that never swallows the caller's cancel: on
    Python 3.11.3+ ``aw`` runs in the caller's task under ``asyncio.timeout`` (raising
    ``TimeoutError`` past the deadline); no bound for ``None``."""
    if seconds is None:
        return await aw
    if not HAS_TIMEOUT:
        return await asyncio.wait_for(aw, seconds)
    async with asyncio.timeout(seconds):  # type: ignore[attr-defined,unused-ignore]
        return await aw
