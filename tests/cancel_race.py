"""A cancel that lands the moment an asyncio Redis call's command is written (the window
in which ``asyncio.wait_for`` of Python 3.10/3.11 swallows it; see
``ratequeue._cancel``), made deterministic for the tests of every async Redis caller."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest


def cancel_when_written(
    monkeypatch: pytest.MonkeyPatch,
    make_call: Callable[[], Coroutine[Any, Any, Any]],
    armed: Callable[[], bool] = lambda: True,
) -> float:
    """Runs the call; the moment its EVALSHA is written to the socket the call's task is
    cancelled (with writes paused, so the reply would only come after the pause).
    Returns how long the task took to end after the cancel; fails unless it ended with
    ``CancelledError``. Only a command written while ``armed()`` counts."""
    state: dict[str, Any] = {}
    cancel_at_evalsha(monkeypatch, state, armed)

    async def main() -> None:
        task = asyncio.ensure_future(make_call())
        state["task"] = task
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert "at" in state, "the call never wrote its EVALSHA"
    return time.monotonic() - state["at"]


def cancel_at_evalsha(
    monkeypatch: pytest.MonkeyPatch,
    state: dict[str, Any],
    armed: Callable[[], bool] = lambda: True,
) -> None:
    """From now on, the first EVALSHA written while ``armed()`` cancels ``state["task"]``
    (once; ``state["at"]`` says when)."""
    real = asyncio.StreamWriter.writelines

    def writelines(self: asyncio.StreamWriter, data: Any) -> None:
        chunks = list(data)
        real(self, chunks)
        task = state.get("task")
        if task is not None and armed() and any(b"EVALSHA" in bytes(c).upper() for c in chunks):
            state["task"] = None
            state["at"] = time.monotonic()
            task.cancel()

    monkeypatch.setattr(asyncio.StreamWriter, "writelines", writelines)
