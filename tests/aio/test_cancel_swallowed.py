"""``ratequeue._cancel``: a cancel that lands the moment an awaited call finishes is
noticed (``swallowed``) and never lost by our own deadlines (``within``), where
``asyncio.wait_for`` of Python 3.10/3.11 returns the result and drops it."""

from __future__ import annotations

import asyncio
import sys

import pytest
from ratequeue._cancel import HAS_TIMEOUT, cancel_requests, swallowed, within


async def finishes_as_cancelled(task_box: list[asyncio.Task[object]]) -> str:
    """Cancels the awaiting task as its last act, then returns."""
    task_box[0].cancel()
    return "done"


def run_outer(bound: float | None, wrap: str) -> tuple[str, int]:
    """An outer task awaits ``finishes_as_cancelled`` (through ``within`` or
    ``wait_for``), then reports what ``swallowed`` says and yields once."""
    box: list[asyncio.Task[object]] = []

    async def outer() -> object:
        before = cancel_requests()
        inner = asyncio.ensure_future(finishes_as_cancelled(box))
        if wrap == "within":
            r = await within(inner, bound)
        else:
            r = await asyncio.wait_for(inner, bound)
        seen = swallowed(before)
        await asyncio.sleep(0)  # a cancel still pending is delivered here
        return (r, seen)

    async def main() -> tuple[str, int]:
        t = asyncio.ensure_future(outer())
        box.append(t)
        try:
            r, seen = await t  # type: ignore[misc]
        except asyncio.CancelledError:
            return "cancelled", 0
        return r, int(seen)

    return asyncio.run(main())


@pytest.mark.parametrize("bound", [None, 5.0])
def test_within_never_loses_the_cancel(bound: float | None) -> None:
    assert run_outer(bound, "within")[0] == "cancelled"


def test_wait_for_swallows_before_3_12_and_swallowed_sees_it() -> None:
    # the CPython behaviour the module exists for; swallowed() is how callers notice it
    r, seen = run_outer(5.0, "wait_for")
    if sys.version_info >= (3, 12):
        assert r == "cancelled"
    else:
        assert r == "done" and seen == int(HAS_TIMEOUT)


def test_within_times_out() -> None:
    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(10), 0.01)
        assert await within(asyncio.sleep(0, "x"), 1.0) == "x"
        assert cancel_requests() == 0

    asyncio.run(main())
