"""A Ctrl-C at the edges of a settle's steps (found by review of a33bce6, stop 42).

CPython raises a pending KeyboardInterrupt at the eval-breaker checks: on entry to a
Python function (``RESUME``) and right after a call returns (``CALL``), not only inside
the callee's body. Each case below injects the KeyboardInterrupt at one such point in
the settle (the way the commit's own tests inject it on entry to ``_budget.settle``)
and checks the ledger's hold is still settled or released. Each test's docstring tells its
defect as it was before the fix."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from background_helpers import Provider, _Once, create, poll_until_done, through
from ratequeue.httpx import CallBudget, RateLimitedTransport
from ratequeue.httpx._unclosed import DROPPED
from test_httpx_interrupted_settle import (
    _CHAT,
    IdempotentLedger,
    _assert_released,
    _interrupt_after_once,
    _interrupt_once,
    _refusing,
)


class _PopThenInterrupt(list):  # type: ignore[type-arg]
    """A ``_once`` whose ``pop`` / ``clear`` does its work, then the Ctrl-C arrives as the
    call returns (the eval breaker's check after ``CALL``)."""

    def pop(self, *a: Any) -> Any:
        super().pop(*a)
        raise KeyboardInterrupt

    def clear(self) -> None:
        super().clear()
        raise KeyboardInterrupt


class _PopOnceThenInterrupt(list):  # type: ignore[type-arg]
    """``_PopThenInterrupt`` for the first pop only."""

    fired = False

    def pop(self, *a: Any) -> Any:
        got = super().pop(*a)
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return got


def _swap_once_first_time(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    real = getattr(RateLimitedTransport, name)
    fired: list[bool] = []

    def step(self: Any, call: Any, *a: Any, **kw: Any) -> Any:
        if not fired:
            fired.append(True)
            call._once = _PopThenInterrupt(call._once)
        return real(self, call, *a, **kw)

    monkeypatch.setattr(RateLimitedTransport, name, step)


def test_a_ctrl_c_as_the_ledger_call_starts_still_pays_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_pay`` takes ``call._owed`` then calls ``_pay_owed``; a Ctrl-C on entry to
    ``_pay_owed`` (before its ``try``) loses the part: not paid, not handed off, and
    ``_owed`` is None so handle_request's own ``_pay`` pays nothing either."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    _, client, _ = through(mod, True, Provider(), ledger=ledger)
    monkeypatch.setattr(
        RateLimitedTransport, "_pay_owed", _interrupt_once(RateLimitedTransport._pay_owed)
    )
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    monkeypatch.undo()
    DROPPED.flush(10)
    (rid,) = ledger.held
    assert ledger.settled == {rid: (1, 1)}


def test_a_ctrl_c_as_the_settle_takes_the_call_still_settles_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_settle_one``: a Ctrl-C as ``call._once.pop()`` returns (before ``_owed`` is set
    and before the first ``try``) skips every step; ``_once`` is empty, so
    handle_request's ``_unsettled`` settles nothing, and ``_pay`` finds nothing owed."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    _, client, _ = through(mod, True, Provider(), ledger=ledger)
    _swap_once_first_time(monkeypatch, "_settle_one")
    with CallBudget(calls=10) as budget, pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    monkeypatch.undo()
    DROPPED.flush(10)
    (rid,) = ledger.held
    assert set(ledger.settled) == {rid}
    (sub,) = budget.usage
    assert sub.settled


def test_a_ctrl_c_as_the_unwind_takes_the_call_still_releases_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_unwind``: the same window after ``call._once.clear()`` returns: neither the
    budget's give-back nor the ledger's release runs."""
    ledger = IdempotentLedger()
    _, client = _refusing(importlib.import_module("httpx"), ledger)
    _swap_once_first_time(monkeypatch, "_unwind")
    with CallBudget(calls=10), pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    monkeypatch.undo()
    _assert_released(ledger)


def test_a_ctrl_c_as_a_streams_settle_starts_paying_still_pays_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streamed body settled at its end: ``_settle_one``'s last ``finally`` calls
    ``_pay``; a Ctrl-C on entry to ``_pay`` leaves ``call._owed`` set, and on the stream
    path nothing pays it later (its close finishes nothing, its reader is finished, so a
    drop hands nothing over; ``close()`` does not look)."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    data = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()

    def provider(request: Any) -> Any:
        headers = {"content-type": "application/json"}
        return mod.Response(200, headers=headers, stream=_Once(mod, data))

    _, client, _ = through(mod, True, provider, ledger=ledger)
    monkeypatch.setattr(RateLimitedTransport, "_pay", _interrupt_once(RateLimitedTransport._pay))
    with (
        client.stream("POST", "http://p/v1/chat/completions", json=_CHAT) as r,
        pytest.raises(KeyboardInterrupt),
    ):
        r.read()
    monkeypatch.undo()
    client.close()
    DROPPED.flush(10)
    (rid,) = ledger.held
    assert ledger.settled == {rid: (3, 4)}


def test_a_ctrl_c_as_a_polls_linked_creation_starts_paying_still_pays_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_pay``'s ``finally`` takes ``call._linked`` then calls ``_pay(linked)``; a Ctrl-C
    on entry there leaves the creation's part owed on a call nothing references any more
    (taken from the background map, unlinked from its poll): its hold is never settled."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    t, client, _ = through(mod, True, Provider(done=2), ledger=ledger)
    creation = create(client).extensions["ratequeue"]
    real = RateLimitedTransport._pay
    fired: list[bool] = []

    def pay(self: Any, call: Any, *a: Any, **kw: Any) -> Any:
        if call.request_id == creation.request_id and not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return real(self, call, *a, **kw)

    monkeypatch.setattr(RateLimitedTransport, "_pay", pay)
    with pytest.raises(KeyboardInterrupt):
        poll_until_done(client, "resp_1")
    monkeypatch.undo()
    assert fired
    t.close()
    DROPPED.flush(10)
    assert creation.request_id in ledger.held
    assert set(ledger.settled) == set(ledger.held)


def test_a_ctrl_c_while_the_ledger_answers_a_hold_gives_the_hold_back() -> None:
    """Not this commit's change, its twin left as it was: a Ctrl-C while the ledger
    answers ``hold`` (the hold made, its answer not read yet) unwinds the call with
    ``_held`` still False, so nothing releases the hold (it stays until it expires);
    ``hold_async`` gives back a hold made after its caller left, ``settle``/``release``
    now get a second try from the workers, the sync hold gets neither."""
    mod = importlib.import_module("httpx")

    class HeldThenInterrupted(IdempotentLedger):
        def hold(self, request_id: str, account: str, **kw: Any) -> None:
            super().hold(request_id, account, **kw)
            raise KeyboardInterrupt  # the hold is made; its answer is being read

    ledger = HeldThenInterrupted()
    _, client, _ = through(mod, True, Provider(), ledger=ledger)
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    DROPPED.flush(10)
    (rid,) = ledger.held
    assert ledger.settled == {rid: (0, 0)}


def test_a_ctrl_c_as_a_stream_end_takes_its_finish_token_is_settled_by_the_close() -> None:
    """``_Reader.finish``: a Ctrl-C as its token's pop returns left the reader neither
    finished nor able to finish (its token gone): its close and its drop settled nothing,
    and the hold stayed until it expired."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()  # a ledger's calls take the Python reader
    data = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()

    def provider(request: Any) -> Any:
        headers = {"content-type": "application/json"}
        return mod.Response(200, headers=headers, stream=_Once(mod, data))

    _, client, _ = through(mod, True, provider, ledger=ledger)
    r = client.send(
        client.build_request("POST", "http://p/v1/chat/completions", json=_CHAT), stream=True
    )
    reader = r.stream._stream._reader  # httpx's BoundSyncStream over the transport's
    reader._unfinished = _PopOnceThenInterrupt(reader._unfinished)
    with pytest.raises(KeyboardInterrupt):
        r.read()
    record = r.extensions["ratequeue"]
    assert not record.settled
    r.close()
    assert record.settled
    (rid,) = ledger.held
    assert ledger.settled == {rid: (3, 4)}


def test_a_ctrl_c_as_a_poll_takes_its_creation_still_settles_the_creation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_polled``: a Ctrl-C after the kept creation was taken from the background map
    (here as ``_settled`` returns, under the lock) lost it: taken, never settled, its
    hold never settled, its budget sub-call never either."""
    from ratequeue.httpx._background import Background

    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    t, client, _ = through(mod, True, Provider(done=1), ledger=ledger)
    with CallBudget(calls=10) as budget:
        creation = create(client).extensions["ratequeue"]
        settled = _interrupt_after_once(Background._settled)
        monkeypatch.setattr(Background, "_settled", settled)
        with pytest.raises(KeyboardInterrupt):
            client.get("http://p/v1/responses/resp_1")
        monkeypatch.undo()
    assert settled.fired and creation.settled and creation.usage is not None
    assert t.stats()["background"] == 0
    assert set(ledger.settled) == set(ledger.held) and len(ledger.held) == 2
    assert all(s.settled for s in budget.usage)
