"""review30: the native settle (``_settle_response``) against the Python reference on
settings the reference accepted before it: the response is answered, the permit settled."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport

CHAT = "http://p/v1/chat/completions"


def test_a_max_body_past_64_bits_still_settles() -> None:
    """``max_body`` is any int >= 0 (the transport checks no upper bound, and the request
    reader falls back to Python past 64 bits): a 2xx answer is settled, not an
    OverflowError from the native settle's argument."""
    answer = json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    llm = rq.Limiter(
        rq.Rate(1000, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )
    inner = httpx.MockTransport(lambda r: httpx.Response(200, content=answer))
    t: Any = RateLimitedTransport(inner, llm, max_body=2**64)
    with httpx.Client(transport=t) as c:
        r = c.post(CHAT, json={"model": "m", "max_tokens": 100})
    rec = r.extensions["ratequeue"]
    assert rec.settled
    assert rec.charged == {"requests": 1, "tokens": 7}
    assert llm.available("tokens") == 10**6 - 7
