"""A Ctrl-C held back while a settle's steps run (found by review of 8b10616, 94a6d0b and
ebdf7c0, stop 42): it is raised whatever a later step raised, what an asyncio caller would
have paid after goes to the worker threads, a poll's creation is not paid inline on a
ledger given up on, and the count of creations waiting does not drift. Each test's
docstring tells its defect as it was before the fix."""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest
from background_helpers import Provider, create, through
from ratequeue.httpx import CallBudget, RateLimitedTransport
from ratequeue.httpx._background import Background
from ratequeue.httpx._unclosed import DROPPED
from test_httpx_interrupt_windows import _swap_once_first_time
from test_httpx_interrupted_settle import (
    _CHAT,
    IdempotentLedger,
    _assert_released,
    _interrupt_after_once,
    _interrupt_once,
    _refusing,
)


class _DownLedger(IdempotentLedger):
    """Holds; its settle and release fail (the ledger went down after the hold)."""

    down = True

    def settle(self, request_id: str, **kw: Any) -> None:
        if self.down:
            raise RuntimeError("ledger down")
        super().settle(request_id, **kw)

    def release(self, request_id: str) -> None:
        if self.down:
            raise RuntimeError("ledger down")
        super().release(request_id)


# -- the deferred Ctrl-C is dropped when a later step raises an Exception ---------------


def test_a_ctrl_c_as_the_settles_pop_returns_is_not_swallowed_by_a_ledger_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8b10616 ``_settle_one``: the Ctrl-C caught at the pop is kept in a local and raised
    only if every step returns; the ledger's settle failing (an Exception) propagates
    instead and the Ctrl-C is gone (not even its ``__context__``). An SDK's retry loop
    (``except Exception``) then retries: the user's Ctrl-C did nothing."""
    mod = importlib.import_module("httpx")
    _, client, _ = through(mod, True, Provider(), ledger=_DownLedger())
    _swap_once_first_time(monkeypatch, "_settle_one")
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)


def test_a_ctrl_c_as_the_unwinds_clear_returns_is_not_swallowed_by_a_ledger_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8b10616 ``_unwind``: the same for the release of a call the queue refused."""
    mod = importlib.import_module("httpx")
    _, client = _refusing(mod, _DownLedger())
    _swap_once_first_time(monkeypatch, "_unwind")
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)


def test_a_ctrl_c_after_a_poll_took_its_creation_is_not_swallowed_by_a_ledger_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ebdf7c0 ``_polled``: the Ctrl-C raised in ``take`` is deferred past the poll's
    settle; the ledger failing there drops it."""
    mod = importlib.import_module("httpx")
    ledger = _DownLedger()
    ledger.down = False
    _, client, _ = through(mod, True, Provider(done=1), ledger=ledger)
    create(client)
    ledger.down = True
    monkeypatch.setattr(Background, "_settled", _interrupt_after_once(Background._settled))
    with pytest.raises(KeyboardInterrupt):
        client.get("http://p/v1/responses/resp_1")


def test_a_ctrl_c_while_the_ledger_answers_a_poll_is_not_replaced_by_its_creations_pay() -> None:
    """``_pay``: the poll's ledger call interrupted (handed off, then raised), its
    ``finally`` pays the linked creation inline on the same ledger; that failing replaces
    the Ctrl-C with the ledger's error."""
    mod = importlib.import_module("httpx")
    creation_id: list[str] = []

    class Ledger(IdempotentLedger):
        def settle(self, request_id: str, **kw: Any) -> None:
            if creation_id and request_id == creation_id[0]:
                raise RuntimeError("ledger down")
            super().settle(request_id, **kw)

    ledger = Ledger()
    _, client, _ = through(mod, True, Provider(done=1), ledger=ledger)
    creation_id.append(create(client).extensions["ratequeue"].request_id)
    ledger.interrupt.add("settle")  # the poll's own settle, the first after this
    with pytest.raises(KeyboardInterrupt):
        client.get("http://p/v1/responses/resp_1")
    DROPPED.flush(10)


# -- Background._waiting drifts ------------------------------------------------------


def test_a_ctrl_c_between_take_and_settled_leaves_no_waiting_count_drift(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ebdf7c0 ``Background.take``: ``_waiting`` is decremented and the creation put in
    ``taken``, then ``self._settled(key)`` is called; a Ctrl-C raised as ``append``
    returns or on entry to ``_settled`` (both eval-breaker checks) leaves the settled
    creation in the map as waiting. The next final poll of the id takes it again and
    decrements ``_waiting`` a second time: ``stats()["background"]`` is -1 and the
    bound admits one creation more than ``limit``."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    t, client, _ = through(mod, True, Provider(done=1), ledger=ledger)
    with CallBudget(calls=10):
        create(client)
        assert t.stats()["background"] == 1
        real = Background._settled
        fired: list[bool] = []

        def settled(self: Any, key: Any) -> None:
            if not fired:
                fired.append(True)
                raise KeyboardInterrupt  # on entry (RESUME), before the map changes
            real(self, key)

        monkeypatch.setattr(Background, "_settled", settled)
        with pytest.raises(KeyboardInterrupt):
            client.get("http://p/v1/responses/resp_1")
        monkeypatch.undo()
        client.get("http://p/v1/responses/resp_1")  # polled again after the Ctrl-C
    assert fired
    assert t.stats()["background"] == 0


# -- asyncio: the deferred Ctrl-C skips the caller's pay -----------------------------


def _post_interrupted(client: Any) -> None:
    """An asyncio POST through ``client`` on a loop without asyncio.run's SIGINT handler
    (a Ctrl-C is raised in the task, not turned into a cancel): it raises the Ctrl-C."""

    async def go() -> None:
        await client.post("http://p/v1/chat/completions", json=_CHAT)

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(go())
    finally:
        loop.close()


def test_asyncio_a_ctrl_c_as_the_unwinds_clear_returns_still_releases_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8b10616 ``_unwind`` on the asyncio path: the release is left owed for the caller
    (``_acquire_async``) to await, but the Ctrl-C raised after the unwind propagates out
    of ``_refused`` and skips that ``_pay_async``; nothing else pays it (the hold stays
    until it expires). The sync path pays inline, the claim says it is released."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    _, client = _refusing(mod, ledger, is_async=True)
    _swap_once_first_time(monkeypatch, "_unwind")
    _post_interrupted(client)
    monkeypatch.undo()
    _assert_released(ledger)


def test_asyncio_a_ctrl_c_as_a_failed_calls_settle_pops_still_releases_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8b10616 ``_settle_one`` on the asyncio path: a call sent with no response
    (``_failed``) settles, the Ctrl-C is raised after, out of ``_failed``, and
    handle_async_request's ``_pay_async`` after it is skipped: the release is never
    made."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()

    def provider(request: Any) -> Any:
        raise mod.ConnectError("refused")

    t, _, _ = through(mod, True, provider, ledger=ledger)
    client = mod.AsyncClient(transport=t)
    _swap_once_first_time(monkeypatch, "_settle_one")
    _post_interrupted(client)
    monkeypatch.undo()
    _assert_released(ledger)


# -- after a Ctrl-C while the ledger answers, the same ledger is called inline again ---


def test_a_ctrl_c_while_the_ledger_answers_a_poll_leaves_its_creation_to_the_workers() -> None:
    """``_pay`` (8b10616's docstring: "has the worker threads pay it once more ...; the
    creation's part too"): after the poll's ledger call is interrupted, its ``finally``
    pays the linked creation inline, in the interrupted thread, on the ledger the user
    just gave up waiting for (``_hold`` hands its release off for exactly that reason).
    A hung ledger takes a second Ctrl-C to get out."""
    import threading

    mod = importlib.import_module("httpx")
    creation_id: list[str] = []
    threads: list[int] = []

    class Ledger(IdempotentLedger):
        def settle(self, request_id: str, **kw: Any) -> None:
            if creation_id and request_id == creation_id[0]:
                threads.append(threading.get_ident())
            super().settle(request_id, **kw)

    ledger = Ledger()
    _, client, _ = through(mod, True, Provider(done=1), ledger=ledger)
    creation_id.append(create(client).extensions["ratequeue"].request_id)
    ledger.interrupt.add("settle")  # the poll's own settle
    with pytest.raises(KeyboardInterrupt):
        client.get("http://p/v1/responses/resp_1")
    DROPPED.flush(10)
    assert set(ledger.settled) == set(ledger.held)
    assert threads and threading.get_ident() not in threads


def test_a_ctrl_c_on_entry_to_settle_linked_after_take_still_settles_the_creation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review of def8c62 (stop 42): ``take`` returned normally (the creation out
    of the map, counted out), then a Ctrl-C on entry to ``_settle_linked``: the creation
    was referenced by nothing (not in the map, so ``close()``'s drain did not see it):
    its hold was never settled."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    t, client, _ = through(mod, True, Provider(done=1), ledger=ledger)
    creation = create(client).extensions["ratequeue"]
    monkeypatch.setattr(
        RateLimitedTransport,
        "_settle_linked",
        _interrupt_once(RateLimitedTransport._settle_linked),
    )
    with pytest.raises(KeyboardInterrupt):
        client.get("http://p/v1/responses/resp_1")
    monkeypatch.undo()
    t.close()
    DROPPED.flush(10)
    assert creation.request_id in ledger.held
    assert set(ledger.settled) == set(ledger.held)


def test_a_ctrl_c_on_entry_to_a_twins_settle_still_settles_the_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same window in ``_keep``: a second creation named like one waiting takes that
    twin from the map to settle it at its estimate; a Ctrl-C on the way into that settle
    lost the twin."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()

    def provider(request: Any) -> Any:  # every creation answers the same id
        return mod.Response(200, json={"id": "resp_1", "status": "queued", "usage": None})

    t, client, _ = through(mod, True, provider, ledger=ledger)
    first = create(client).extensions["ratequeue"]
    monkeypatch.setattr(
        RateLimitedTransport,
        "_settle_linked",
        _interrupt_once(RateLimitedTransport._settle_linked),
    )
    with pytest.raises(KeyboardInterrupt):
        create(client)
    monkeypatch.undo()
    assert first.settled and t.stats()["background"] == 0
    assert len(ledger.held) == 2 and set(ledger.settled) == set(ledger.held)
