"""The httpx transport with a real ledger: a call holds its estimate, settles the usage
the provider reported, a refused quota sends nothing, a retried request counts once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport
from ratequeue.ledger import Plan, SqliteLedger

CHAT = "/v1/chat/completions"


def provider(sent: list[Any], status: int = 200) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        usage = {"prompt_tokens": 12, "completion_tokens": 30}
        return httpx.Response(status, json={"usage": usage} if status == 200 else {})

    return httpx.MockTransport(answer)


def limiter() -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(600, per="minute", burst=50),
        rq.Rate(600_000, per="minute", burst=100_000, unit="tokens"),
        clock=rq.ManualClock(),
    )


def chat(c: httpx.Client, key: str, max_tokens: int = 100) -> httpx.Response:
    msgs = [{"role": "user", "content": "hello"}]
    return c.post(
        CHAT,
        json={"model": "gpt-x", "messages": msgs, "max_tokens": max_tokens},
        headers={"Idempotency-Key": key},
    )


def test_the_transport_holds_and_settles_in_a_real_ledger(tmp_path: Path) -> None:
    led = SqliteLedger(tmp_path / "q.db")
    led.set_plan("acme", Plan("pro", tokens=1_000))
    sent: list[Any] = []
    t = RateLimitedTransport(provider(sent), limiter(), ledger=led, account="acme")
    with httpx.Client(transport=t, base_url="http://provider") as c:
        assert chat(c, "req-1").status_code == 200
        b = led.balance("acme")
        assert b.used == {"tokens": 42} and b.held == {"tokens": 0}
        row = led.request_usage("acme", "req-1").rows[0]
        assert (row.input_tokens, row.output_tokens, row.model) == (12, 30, "gpt-x")
        # the same idempotency key again: the ledger counts it once
        chat(c, "req-1")
        assert led.balance("acme").used == {"tokens": 42}
        # an estimate beyond the quota is refused before anything is sent
        before = len(sent)
        with pytest.raises(rq.QuotaExceeded):
            chat(c, "req-2", max_tokens=5_000)
        assert len(sent) == before and led.balance("acme").used == {"tokens": 42}
    led.close()


def test_a_429_gives_the_hold_back(tmp_path: Path) -> None:
    led = SqliteLedger(tmp_path / "q.db")
    led.set_plan("acme", Plan("pro", tokens=1_000))
    t = RateLimitedTransport(provider([], status=429), limiter(), ledger=led, account="acme")
    with httpx.Client(transport=t, base_url="http://provider") as c:
        chat(c, "req-1")
    assert led.balance("acme").used == {"tokens": 0}
    led.close()
