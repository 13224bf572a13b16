"""Adversarial output-cap bodies (review19): through the transport, natively and by the
Python reference, the body the inner transport receives is valid JSON whose bound is at
most the cap under any duplicate-key rule, and its Content-Length is its length."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import Cap, RateLimitedTransport, TokenEstimator

CAP = 100
CHAT = "/v1/chat/completions"

BODIES = [
    b"{}",
    b" { } ",
    b'{"model":"m"}',
    b'{"max_tokens":5000}',
    b'{"max_tokens":1e3}',
    b'{"max_tokens":1.0}',
    b'{"max_tokens":-0}',
    b'{"max_tokens":null}',
    b'{"max_tokens":true}',
    b'{"max_tokens":"5000"}',
    b'{"max_tokens":NaN}',
    b'{"max_tokens":Infinity}',
    b'{"max_tokens":99999999999999999999999999}',
    b'{"max_tokens":' + b"9" * 700 + b"}",
    b'{"max_tokens":18446744073709551616}',
    b'{"max_tokens":18446744073709551615}',
    b'{"max\\u005ftokens":5000}',
    b'{"max_tokens":5,"max_tokens":5000}',
    b'{"max_tokens":5000,"max\\u005ftokens":5}',
    b'{"a":{"max_tokens":5000}}',
    b'{"a":[{"max_tokens":5000}]}',
    b'{"a":"\\"max_tokens\\":5000"}',
    b'\n{"max_tokens" :\t5000 }\r\n',
    b'{"max_tokens":5000,"max_completion_tokens":3,"max_output_tokens":7000}',
    b'{"model":"\xc3\xbc","max_tokens":5000}',
]


def _transport(mod: Any, sent: list[Any]) -> Any:
    lim = rq.Limiter(
        rq.Rate(10**6, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )
    return RateLimitedTransport(
        mod.MockTransport(lambda r: sent.append(r) or mod.Response(200, json={})),
        lim,
        estimator=TokenEstimator(None),
        caps=[Cap(CAP)],
    )


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
@pytest.mark.parametrize("data", BODIES)
def test_the_sent_body_is_capped_json(
    data: bytes, modname: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratequeue.httpx import _prepare

    if not native:
        monkeypatch.setattr(_prepare, "_cap_output", lambda *a: False)
    mod = importlib.import_module(modname)
    sent: list[Any] = []
    c = mod.Client(transport=_transport(mod, sent))
    c.post("http://p" + CHAT, content=data)
    out = sent[-1].content
    assert int(sent[-1].headers["content-length"]) == len(out)
    for hook in (None, _first_wins):
        body = json.loads(out, object_pairs_hook=hook)
        assert isinstance(body, dict)
        bounds = [
            body[f]
            for f in ("max_completion_tokens", "max_output_tokens", "max_tokens")
            if f in body
        ]
        assert bounds, out
        for v in bounds:
            assert type(v) is int and 0 <= v <= CAP, (out, hook)


@pytest.mark.parametrize("native", [True, False])
def test_a_negative_bound_is_replaced(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A negative bound is no count (llama.cpp-style servers read -1 as "no limit"): the
    cap is written, as for any bound that is not a count."""
    from ratequeue.httpx import _prepare

    if not native:
        monkeypatch.setattr(_prepare, "_cap_output", lambda *a: False)
    mod = importlib.import_module("httpx")
    sent: list[Any] = []
    c = mod.Client(transport=_transport(mod, sent))
    r = c.post("http://p" + CHAT, content=b'{"max_tokens":-1}')
    assert sent[-1].content == b'{"max_tokens":100}'
    assert r.extensions["ratequeue"].capped.requested is None
    assert tuple(r.extensions["ratequeue"].estimate)[1] == CAP
