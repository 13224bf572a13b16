"""A call whose estimate is above what the limiter can ever grant is charged at most that,
also when its body reports no usage; the record says which units were clamped."""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport

CHAT = "https://api.example.com/v1/chat/completions"
BIG = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5_000}


@pytest.fixture(params=["httpx", "httpx2"])
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def limiter() -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(100, per="minute"),
        rq.Rate(60_000, per="minute", burst=1_000, unit="tokens"),
        clock=rq.ManualClock(),
    )


@pytest.mark.parametrize("answer", [b"{}", b'{"usage": null}', b"not json", b""])
def test_estimate_above_the_burst_without_usage_is_charged_the_burst(
    mod: Any, answer: bytes
) -> None:
    llm = limiter()
    t = RateLimitedTransport(mod.MockTransport(lambda r: mod.Response(200, content=answer)), llm)
    r = mod.Client(transport=t).post(CHAT, json=BIG)
    rec = r.extensions["ratequeue"]
    assert rec.estimate.tokens > 1_000
    assert rec.usage is None
    assert llm.available("tokens") == 0.0  # the burst, not the estimate: no debt
    assert rec.charged == {"requests": 1, "tokens": 1_000}
    assert rec.clamped == ("tokens",)


def test_estimate_within_the_burst_is_not_clamped(mod: Any) -> None:
    llm = limiter()
    t = RateLimitedTransport(mod.MockTransport(lambda r: mod.Response(200, content=b"{}")), llm)
    body = {**BIG, "max_tokens": 100}
    rec = mod.Client(transport=t).post(CHAT, json=body).extensions["ratequeue"]
    assert rec.clamped == ()
    assert rec.charged == {"requests": 1, "tokens": rec.estimate.tokens}
    assert llm.available("tokens") == 1_000 - rec.estimate.tokens


def test_reported_usage_above_the_burst_is_charged_as_reported(mod: Any) -> None:
    """The provider's own count is what was used: it is charged (a debt the clock repays),
    never clamped."""
    llm = limiter()
    usage = b'{"usage": {"prompt_tokens": 900, "completion_tokens": 600}}'
    t = RateLimitedTransport(mod.MockTransport(lambda r: mod.Response(200, content=usage)), llm)
    rec = mod.Client(transport=t).post(CHAT, json=BIG).extensions["ratequeue"]
    assert rec.usage == (900, 600)
    assert rec.charged == {"requests": 1, "tokens": 1_500}
    assert rec.clamped == ()
    assert llm.available("tokens") == -500.0


def test_async_estimate_above_the_burst_without_usage(mod: Any) -> None:
    llm = limiter()
    t = RateLimitedTransport(mod.MockTransport(lambda r: mod.Response(200, content=b"{}")), llm)

    async def main() -> Any:
        async with mod.AsyncClient(transport=t) as c:
            return await c.post(CHAT, json=BIG)

    r = asyncio.run(main())
    assert llm.available("tokens") == 0.0
    assert r.extensions["ratequeue"].clamped == ("tokens",)
