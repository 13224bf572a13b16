"""A Ctrl-C before the send (found by review, stop 42): on the way into the functions
that start a call's unwind or its failed settle, or as the permit's acquire returns. Each
case injects the KeyboardInterrupt where CPython's eval breaker may raise it (a function's
``RESUME``, a ``CALL``'s return) and checks nothing the call holds is lost. Each test's
docstring tells its defect as it was before the fix."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from background_helpers import Provider, through_policy
from ratequeue.httpx import CallBudget, RateLimitedTransport
from test_httpx_interrupted_settle import (
    _CHAT,
    IdempotentLedger,
    _assert_released,
    _interrupt_after_once,
    _interrupt_once,
    _refusing,
)


def test_a_ctrl_c_on_the_way_into_the_unwind_still_releases_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_refused`` calls ``_unwind``; a Ctrl-C at ``_unwind``'s entry (before its
    ``clear``) left the call unwound by nothing: ``_acquire`` re-raised, and
    handle_request had no handler past ``RateQueueError``: the hold stayed until it
    expired and the budget kept the call counted. Now handle_request abandons it."""
    ledger = IdempotentLedger()
    _, client = _refusing(importlib.import_module("httpx"), ledger)
    monkeypatch.setattr(
        RateLimitedTransport, "_unwind", _interrupt_once(RateLimitedTransport._unwind)
    )
    with CallBudget(calls=10) as budget, pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    monkeypatch.undo()
    _assert_released(ledger)
    assert all(s.settled for s in budget.usage)


def test_a_ctrl_c_on_the_way_into_a_failed_calls_settle_gives_everything_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inner transport raised (a connection error): handle_request calls
    ``_failed``, which calls ``_settle``; a Ctrl-C at ``_settle``'s entry left the call
    settled by nothing: the Policy's slot was never given back and the hold stayed until
    it expired. Now the settle runs again in a ``finally``."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    failing = [True]

    def provider(request: Any) -> Any:
        if failing:
            failing.clear()
            raise mod.ConnectError("down", request=request)
        return Provider()(request)

    client, _ = through_policy(mod, provider, slots=1, ledger=ledger)
    monkeypatch.setattr(
        RateLimitedTransport, "_settle", _interrupt_once(RateLimitedTransport._settle)
    )
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    monkeypatch.undo()
    (rid,) = ledger.held
    assert ledger.settled == {rid: (0, 0)}
    client.post("http://p/v1/chat/completions", json=_CHAT)  # the one slot free again


def test_a_ctrl_c_as_the_policys_acquire_returns_gives_the_slot_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``grant = self.limit.acquire(...)``: a Ctrl-C as acquire returns (it waited, GIL
    released, and the signal came as it was granted) goes to ``_refused`` with the
    grant never bound: the call is unwound and the Policy's permit dropped unreleased,
    which lost its concurrency slot for good. Now a dropped permit gives its slots back."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    client, _ = through_policy(mod, Provider(), slots=1, ledger=ledger)
    t = client._transport
    policy = t.limit

    class Wrapped:
        def __init__(self) -> None:
            self.acquire = _interrupt_after_once(policy.acquire)

        def __getattr__(self, name: str) -> Any:
            return getattr(policy, name)

    t.__dict__["limit"] = Wrapped()  # fixed attribute: set past __setattr__
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    t.__dict__["limit"] = policy
    _assert_released(ledger)
    client.post("http://p/v1/chat/completions", json=_CHAT)  # the one slot free again
