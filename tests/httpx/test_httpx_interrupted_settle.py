"""A Ctrl-C that lands inside a settle's own bookkeeping (after the call is taken to be
settled) must not leave part of it undone: the ledger's part is paid, a Policy's slot
given back, whatever step the interrupt stopped. Each case injects the KeyboardInterrupt
at one step and checks every other step still ran."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import ratequeue as rq
from background_helpers import BURST, Provider, through, through_policy
from ratequeue.httpx import CallBudget, RateLimitedTransport
from ratequeue.httpx import _transport as transport_module
from ratequeue.httpx._unclosed import DROPPED

_CHAT = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}


class IdempotentLedger:
    """A ledger as the real ones are: a settle or release repeated for the same request
    id changes nothing (the real ones answer a replay). ``interrupt`` names calls that
    raise KeyboardInterrupt once, before they do anything."""

    def __init__(self, interrupt: tuple[str, ...] = ()) -> None:
        self.held: dict[str, tuple[int, int]] = {}
        self.settled: dict[str, tuple[int, int]] = {}
        self.interrupt = set(interrupt)

    def _maybe_interrupt(self, name: str) -> None:
        if name in self.interrupt:
            self.interrupt.discard(name)
            raise KeyboardInterrupt

    def hold(self, request_id: str, account: str, **kw: Any) -> None:
        self.held[request_id] = (kw["input_tokens"], kw["output_tokens"])

    def settle(self, request_id: str, **kw: Any) -> None:
        self._maybe_interrupt("settle")
        assert request_id in self.held
        self.settled.setdefault(request_id, (kw["input_tokens"], kw["output_tokens"]))

    def release(self, request_id: str) -> None:
        self._maybe_interrupt("release")
        assert request_id in self.held
        self.settled.setdefault(request_id, (0, 0))


def _interrupt_once(real: Any) -> Any:
    fired = []

    def step(*args: Any, **kw: Any) -> Any:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return real(*args, **kw)

    return step


def _interrupt_after_once(real: Any) -> Any:
    """``real`` run, then a KeyboardInterrupt the first time (a Ctrl-C as it returns)."""
    fired = []

    def step(*args: Any, **kw: Any) -> Any:
        got = real(*args, **kw)
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return got

    step.fired = fired  # type: ignore[attr-defined]
    return step


def _refusing(mod: Any, ledger: Any, is_async: bool = False) -> tuple[Any, Any]:
    """A transport whose limiter refuses at once (timeout 0): the call is unwound."""
    lim = rq.Limiter(rq.Rate(1, per="minute", burst=1), clock=rq.ManualClock())
    lim.try_acquire()
    inner = mod.MockTransport(Provider())
    t = RateLimitedTransport(inner, lim, timeout=0.0, ledger=ledger)
    client = mod.AsyncClient(transport=t) if is_async else mod.Client(transport=t)
    return t, client


def _assert_released(ledger: IdempotentLedger) -> None:
    """The one hold released (nothing used), by the caller or the worker threads."""
    DROPPED.flush(10)
    (rid,) = ledger.held
    assert ledger.settled == {rid: (0, 0)}


@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
def test_a_ctrl_c_in_the_budgets_settle_still_pays_the_ledger(
    modname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in stop 42: the ledger's part was set and paid after the budget's settle, in
    the same ``finally``; a Ctrl-C inside the budget's settle skipped it, and the hold
    stayed held until it expired (charged nothing)."""
    mod = importlib.import_module(modname)
    ledger = IdempotentLedger()
    _, client, _ = through(mod, True, Provider(), ledger=ledger)
    budget_module = transport_module._budget
    monkeypatch.setattr(budget_module, "settle", _interrupt_once(budget_module.settle))
    with CallBudget(calls=10), pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    assert len(ledger.held) == 1
    assert ledger.settled == {rid: (1, 1) for rid in ledger.held}


@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
def test_a_ctrl_c_in_the_budgets_settle_still_gives_back_the_policy_slot(
    modname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = importlib.import_module(modname)
    ledger = IdempotentLedger()
    client, _ = through_policy(mod, Provider(), slots=1, ledger=ledger)
    budget_module = transport_module._budget
    monkeypatch.setattr(budget_module, "settle", _interrupt_once(budget_module.settle))
    with CallBudget(calls=10), pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    with CallBudget(calls=10):  # the one slot is free again (timeout 0: no wait)
        client.post("http://p/v1/chat/completions", json=_CHAT)
    assert len(ledger.held) == 2 and set(ledger.settled) == set(ledger.held)


@pytest.mark.parametrize("op", ["settle", "release"])
def test_a_ctrl_c_while_the_ledger_answers_is_paid_by_the_worker_threads(op: str) -> None:
    """Found in stop 42: the ledger's part was taken, then the ledger call interrupted (a
    Ctrl-C while Redis answers): nothing paid it again, and the hold stayed held until it
    expired. The ledger's calls are idempotent per request id, so it is paid again."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger(interrupt=(op,))

    def provider(request: Any) -> Any:
        if op == "release":  # an error status settles the call with nothing used
            return mod.Response(500, json={"error": "down"})
        return mod.Response(200, json={"usage": {"prompt_tokens": 3, "completion_tokens": 4}})

    _, client, _ = through(mod, True, provider, ledger=ledger)
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    assert DROPPED.flush(10)
    (rid,) = ledger.held
    assert ledger.settled == {rid: (3, 4) if op == "settle" else (0, 0)}


def test_a_ctrl_c_in_the_budgets_give_back_still_releases_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing sent (the wait refused): the budget's give-back and the ledger's release
    are both done whichever the Ctrl-C stops."""
    ledger = IdempotentLedger()
    _, client = _refusing(importlib.import_module("httpx"), ledger)
    budget_module = transport_module._budget
    monkeypatch.setattr(budget_module, "uncount", _interrupt_once(budget_module.uncount))
    with CallBudget(calls=10), pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    _assert_released(ledger)


def test_a_settle_interrupted_after_the_permits_settle_keeps_the_usage_everywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The permit corrected to the usage, then a Ctrl-C in the Policy's release: budget
    and ledger still get the same usage."""
    mod = importlib.import_module("httpx")
    ledger = IdempotentLedger()
    client, lim = through_policy(mod, Provider(), slots=2, ledger=ledger)
    with CallBudget(calls=10) as budget:
        monkeypatch.setattr(
            rq.PolicyPermit, "release", _interrupt_once(rq.PolicyPermit.release), raising=True
        )
        with pytest.raises(KeyboardInterrupt):
            client.post("http://p/v1/chat/completions", json=_CHAT)
    (sub,) = budget.usage
    assert sub.settled and (sub.input_tokens, sub.output_tokens) == (1, 1)
    assert ledger.settled == {rid: (1, 1) for rid in ledger.held}
    assert lim.available("tokens") == BURST - 2


def test_a_ledger_that_always_raises_an_interrupt_is_paid_once_more_only() -> None:
    """Found by this stop's own test run: the worker's second try, interrupted too, was
    handed off again, and again (a ledger call always pending at exit)."""
    mod = importlib.import_module("httpx")
    calls: list[str] = []

    class Interrupting(IdempotentLedger):
        def settle(self, request_id: str, **kw: Any) -> None:
            calls.append(request_id)
            raise KeyboardInterrupt

    ledger = Interrupting()
    _, client, _ = through(mod, True, Provider(), ledger=ledger)
    with pytest.raises(KeyboardInterrupt):
        client.post("http://p/v1/chat/completions", json=_CHAT)
    assert DROPPED.flush(10)
    (rid,) = ledger.held
    assert calls == [rid, rid], calls
    assert not DROPPED.paying
