"""A ledger's writes held back on purpose, for the tests that queue or cancel calls
behind them: SQLite's writer kept in a transaction of another thread, or Redis writes
paused with ``CLIENT PAUSE WRITE`` on the real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

#: Redis: the pause outlasts every wait of these tests (UNPAUSE ends it), and the
#: clients' socket timeout outlasts the pause, so a slow (loaded) machine never turns
#: the wait behind the pause into a read timeout before the test cancels the call.
PAUSE_MS = 60_000
CLIENT_TIMEOUT = 2 * PAUSE_MS / 1000


@contextlib.contextmanager
def sqlite_writer_blocked(led: Any, seconds: float = 30.0) -> Iterator[None]:
    """Holds a SqliteLedger's writer in a transaction of another thread until the block
    exits: calls made meanwhile queue behind it (``led._queue``)."""
    gate, started = threading.Event(), threading.Event()

    def slow(_conn: Any) -> None:
        started.set()
        gate.wait(seconds)

    blocker = threading.Thread(target=led._run, args=(slow,))
    blocker.start()
    assert started.wait(seconds)
    try:
        yield
    finally:
        gate.set()
        blocker.join(seconds)


@contextlib.contextmanager
def writes_blocked(led: Any, backend: str) -> Iterator[Callable[[], bool]]:
    """Blocks the ledger's writes until the block exits; yields "is a call of ours
    waiting behind the block now?"."""
    if backend == "sqlite":
        with sqlite_writer_blocked(led):
            yield lambda: bool(led._queue)
        return
    admin = led.client
    admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")

    def waiting() -> bool:
        clients = admin.execute_command("CLIENT", "LIST")
        text = clients.decode() if isinstance(clients, bytes) else str(clients)
        # a client held by the pause is flagged b, with the command it waits to run
        return any(" flags=b " in c and " cmd=evalsha " in c for c in text.splitlines())

    try:
        yield waiting
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")


async def until_waiting(waiting: Callable[[], bool], seconds: float = 10.0) -> None:
    """Returns once a call waits behind the block (fails after ``seconds``)."""
    end = time.monotonic() + seconds
    while not waiting() and time.monotonic() < end:
        await asyncio.sleep(0.005)
    assert waiting(), "the call never reached the blocked writer"


def cancel_while_blocked(
    led: Any, backend: str, make_call: Callable[[], Coroutine[Any, Any, Any]]
) -> None:
    """Starts the call on a loop, waits until it is queued behind the blocked writer,
    cancels it, then lets the writer go (the loop is already closed by then)."""
    with writes_blocked(led, backend) as waiting:

        async def main() -> None:
            task = asyncio.ensure_future(make_call())
            await until_waiting(waiting)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())


def eventually(check: Callable[[], bool], seconds: float = 20.0) -> bool:
    """True once ``check()`` is (the call finishes on a worker, in real time)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.01)
    return check()


def given_back(led: Any, backend: str, account: str, request_id: str) -> bool:
    """True once a cancelled hold's ending has run: SQLite, after any undo queued behind
    the blocked writer; Redis, once the record says released (the ending runs on a
    worker thread, so a balance read before it may see nothing held yet)."""
    if backend == "sqlite":
        led._run(lambda conn: None)
        return True

    def released() -> bool:
        raw = led.client.get(led._pfx(account) + "r:" + request_id)
        return raw is not None and raw.split(b"\x1f")[1] == b"released"

    return eventually(released)
