"""Adversarial requests against the output caps (review20): every request a cap matches
reaches the inner transport with a bound at most the cap, or is refused
(``CapNotApplied``) before anything is acquired, charged or sent."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.httpx import CallBudget, Cap, CapNotApplied, RateLimitedTransport

MODS = ["httpx", "httpx2"]
BOUNDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
BIG = b'{"model":"m","max_tokens":5000,"pad":"' + b"x" * 4096 + b'"}'


def _setup(
    modname: str, caps: list[Cap], **kw: Any
) -> tuple[Any, list[Any], rq.Limiter, RateLimitedTransport]:
    mod = importlib.import_module(modname)
    sent: list[Any] = []
    lim = rq.Limiter(
        rq.Rate(1000, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )

    def handler(r: Any) -> Any:
        if r.url.path.endswith("/moved"):
            return mod.Response(307, headers={"location": "/v1/chat/completions"})
        # What a real transport sends: the stream's bytes (``content`` may be stale).
        sent.append(mod.Request(r.method, r.url, headers=r.headers, content=b"".join(r.stream)))
        return mod.Response(200, json={})

    t = RateLimitedTransport(mod.MockTransport(handler), lim, caps=caps, max_body=1024, **kw)
    return mod, sent, lim, t


def _pairs(data: bytes) -> list[tuple[str, Any]]:
    """Every top-level member, repeated keys included."""
    out: list[tuple[str, Any]] = []
    json.loads(data, object_pairs_hook=lambda p: out.extend(p) or dict(p))
    return out  # nested objects' members come first; the bounds are top-level ints


def _within(data: bytes, cap: int) -> None:
    """Every occurrence of every bound is a count at most the cap, and one is there."""
    top: list[tuple[str, Any]] = []

    def hook(p: list[tuple[str, Any]]) -> dict[str, Any]:
        top[:] = p
        return dict(p)

    json.loads(data, object_pairs_hook=hook)
    bounds = [v for k, v in top if k in BOUNDS]
    assert bounds, data
    assert all(type(v) is int and 0 <= v <= cap for v in bounds), data


def _untouched(lim: rq.Limiter, sent: list[Any]) -> None:
    assert sent == []
    assert lim.available("requests") == 1000 and lim.available("tokens") == 10**6


def _capped_or_refused(c: Any, sent: list[Any], lim: rq.Limiter, cap: int, **kw: Any) -> None:
    """The request is refused untouched, or sent with its bound within the cap."""
    try:
        c.request(**kw)
    except CapNotApplied:
        _untouched(lim, sent)
        return
    assert len(sent) == 1
    _within(sent[0].content, cap)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions/",  # Express (strict routing off), Starlette redirects
        "/v1/chat/completions//",
        "/v1/Chat/Completions",  # Express and ASP.NET route case-insensitively
        "/v1/chat/completions%2F",
    ],
)
def test_a_route_spelled_another_way_is_still_capped(
    modname: str, path: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratequeue.httpx import _prepare

    if not native:
        monkeypatch.setattr(_prepare, "_cap_output", lambda *a: False)
    mod, sent, lim, t = _setup(modname, [Cap(100, route="/chat/completions")])
    body = b'{"model":"m","max_completion_tokens":5000}'
    url = "http://p" + path
    c = mod.Client(transport=t)
    _capped_or_refused(c, sent, lim, 100, method="POST", url=url, content=body)


@pytest.mark.parametrize("method", ["GET", "DELETE", "OPTIONS", "post"])
@pytest.mark.parametrize("modname", MODS)
def test_a_body_on_another_method_is_capped_or_refused(modname: str, method: str) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100)])
    body = b'{"model":"m","max_tokens":5000}'
    c = mod.Client(transport=t)
    _capped_or_refused(
        c, sent, lim, 100, method=method, url="http://p/v1/chat/completions", content=body
    )
    sent.clear()
    c.get("http://p/v1/models")  # no body: nothing to cap
    assert len(sent) == 1


@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    "ctype", ["multipart/form-data; boundary=x", "MULTIPART/form-data", "multipart/mixed"]
)
def test_a_json_body_labelled_multipart_is_not_waved_through(modname: str, ctype: str) -> None:
    # llama.cpp's server parses the body as JSON whatever its Content-Type says.
    mod, sent, lim, t = _setup(modname, [Cap(100)])
    c = mod.Client(transport=t)
    with pytest.raises(CapNotApplied):
        c.post("http://p/v1/chat/completions", content=BIG, headers={"content-type": ctype})

    def chunks() -> Iterator[bytes]:
        yield BIG

    with pytest.raises(CapNotApplied):
        c.post("http://p/v1/chat/completions", content=chunks(), headers={"content-type": ctype})
    _untouched(lim, sent)
    # A real upload still passes, over max_body or not.
    c.post("http://p/v1/files", files={"file": ("a.jsonl", b"x" * 4096)})
    c.post("http://p/v1/files", files={"file": ("a.jsonl", b"x")}, data={"purpose": "batch"})
    assert len(sent) == 2


@pytest.mark.parametrize("modname", MODS)
def test_a_stream_claiming_an_empty_length_is_refused(modname: str) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100)])

    def chunks() -> Iterator[bytes]:
        yield b'{"model":"m","max_tokens":5000}'

    with pytest.raises(CapNotApplied):
        mod.Client(transport=t).post(
            "http://p/v1/chat/completions", content=chunks(), headers={"content-length": "0"}
        )
    _untouched(lim, sent)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"gpt-4o","model":"cheap","max_tokens":5000}',  # a first-wins parser: gpt-4o
        b'{"model":"cheap","model":"gpt-4o","max_tokens":5000}',
        b'{"model":"gpt-4o","messages":[],"model":"cheap"}',
    ],
)
def test_a_repeated_model_is_capped_as_every_model_it_names(
    body: bytes, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratequeue.httpx import _prepare

    if not native:
        monkeypatch.setattr(_prepare, "_cap_output", lambda *a: False)
    mod, sent, lim, t = _setup("httpx", [Cap(100, model="gpt-4o*")])
    _capped_or_refused(
        mod.Client(transport=t),
        sent,
        lim,
        100,
        method="POST",
        url="http://p/v1/chat/completions",
        content=body,
    )


def test_a_refusal_leaks_nothing() -> None:
    mod, sent, lim, t = _setup("httpx", [Cap(100)])
    c = mod.Client(transport=t)
    with CallBudget(calls=5, tokens=10**6) as b:
        for _ in range(3):
            with pytest.raises(CapNotApplied):
                c.post("http://p/v1/chat/completions", content=BIG)
    _untouched(lim, sent)
    assert b.calls_used == 0 and b.usage == [] and b.tokens_used == 0
    assert t.wait_histogram.count == 0 and t.http_histogram.count == 0


@pytest.mark.timeout(120)
def test_the_sdks_get_the_refusal_unwrapped_and_do_not_retry() -> None:
    import anthropic
    import httpx2
    import openai
    from ratequeue.testing import MockProvider

    msg = [{"role": "user", "content": "hi " * 50}]
    with MockProvider(60_000, tpm=10**7, gen_time=0.0, output_tokens=3) as m:
        lim = rq.Limiter(rq.Rate(60_000, per="minute"), clock=rq.ManualClock())
        t = RateLimitedTransport(httpx2.HTTPTransport(), lim, caps=[Cap(100)], max_body=64)
        http = httpx2.Client(transport=t)
        o = openai.OpenAI(api_key="k", base_url=m.base_url + "/v1", http_client=http, max_retries=3)
        a = anthropic.Anthropic(api_key="k", base_url=m.base_url, http_client=http, max_retries=3)
        with pytest.raises(CapNotApplied):
            o.chat.completions.create(model="gpt", messages=msg, max_tokens=5000)  # type: ignore[arg-type]
        with pytest.raises(CapNotApplied):
            a.messages.create(model="claude", max_tokens=5000, messages=msg)  # type: ignore[arg-type]
        assert m.stats()["requests"] == 0
        assert lim.available("requests") == 60_000


@pytest.mark.parametrize("modname", MODS)
def test_a_stream_swapped_by_an_event_hook_is_what_gets_capped(modname: str) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100)])

    def hook(request: Any) -> None:  # a hook rewriting the body leaves ``content`` stale
        new = b'{"model":"m","max_tokens":5000}'
        request.stream = mod.ByteStream(new)
        request.headers["content-length"] = str(len(new))

    c = mod.Client(transport=t, event_hooks={"request": [hook]})
    body = b'{"model":"m","max_tokens":50}'
    _capped_or_refused(
        c, sent, lim, 100, method="POST", url="http://p/v1/chat/completions", content=body
    )


@pytest.mark.parametrize("modname", MODS)
def test_a_307_redirect_of_a_capped_call_is_capped_again(modname: str) -> None:
    mod, sent, _, t = _setup(modname, [Cap(100)])
    c = mod.Client(transport=t, follow_redirects=True)
    r = c.post("http://p/v1/moved", content=b'{"model":"m","max_tokens":5000}')
    assert r.status_code == 200 and len(sent) == 1
    _within(sent[0].content, 100)
