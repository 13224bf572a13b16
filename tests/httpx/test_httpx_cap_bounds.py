"""The five cap evasions review20 left open (caps22): choices multiplying output (``n``,
``best_of``), nested bounds (Gemini, Bedrock Converse), model globs by case, ``;`` path
parameters, and multipart form fields naming a bound. Natively and by the Python
reference, every request a cap matches reaches the inner transport with a total output
bound at most the cap, or is refused (``CapNotApplied``) before anything is acquired,
charged or sent."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import ratequeue as rq
from ratequeue._ratequeue import _spends_no_tokens
from ratequeue.httpx import CallBudget, Cap, CapNotApplied, RateLimitedTransport, TokenEstimator

CHAT = "http://p/v1/chat/completions"
GEMINI = "http://p/v1beta/models/gemini-2.0-flash:generateContent"
CONVERSE = "http://p/model/anthropic.claude-3/converse"
# Bedrock InvokeModel with an Amazon Nova model: its own body, bounded in `inferenceConfig`
# (`maxTokens`; older bodies `max_new_tokens`).
NOVA = "http://p/model/us.amazon.nova-lite-v1:0/invoke"


def _setup(
    modname: str, caps: list[Cap], native: bool, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> tuple[Any, list[Any], rq.Limiter, RateLimitedTransport]:
    from ratequeue.httpx import _prepare

    if not native:
        monkeypatch.setattr(_prepare, "_cap_output", lambda *a: False)
    mod = importlib.import_module(modname)
    sent: list[Any] = []
    lim = rq.Limiter(
        rq.Rate(1000, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )

    def handler(r: Any) -> Any:
        sent.append(mod.Request(r.method, r.url, headers=r.headers, content=b"".join(r.stream)))
        return mod.Response(200, json={})

    kw.setdefault("estimator", TokenEstimator(None))
    t = RateLimitedTransport(mod.MockTransport(handler), lim, caps=caps, max_body=1024, **kw)
    return mod, sent, lim, t


def _untouched(lim: rq.Limiter, sent: list[Any]) -> None:
    assert sent == []
    assert lim.available("requests") == 1000 and lim.available("tokens") == 10**6


both = pytest.mark.parametrize("native", [True, False])


def _bound_values(data: bytes) -> list[Any]:
    """Every value of a bound key, at any depth, repeated keys included."""
    vals: list[Any] = []

    def hook(p: list[tuple[str, Any]]) -> dict[str, Any]:
        names = ("maxOutputTokens", "max_output_tokens", "maxTokens", "max_tokens")
        vals.extend(v for k, v in p if k in names)
        return dict(p)

    json.loads(data, object_pairs_hook=hook)
    return vals


# -- 1. n / best_of multiply output --------------------------------------------------------


@both
@pytest.mark.parametrize(
    ("body", "field", "per_choice"),
    [
        (b'{"model":"m","n":4,"max_completion_tokens":5000}', "max_completion_tokens", 25),
        (b'{"model":"m","n":3,"max_tokens":5000}', "max_tokens", 33),
        (b'{"model":"m","n":1,"n":4,"max_tokens":5000}', "max_tokens", 25),  # first-wins: 1
        (b'{"model":"m","n":4,"n":1,"max_tokens":5000}', "max_tokens", 25),
        (b'{"model":"m","n":4,"max_tokens":30}', "max_tokens", 25),  # 4 x 30 > 100
        (b'{"model":"m","n":4}', "max_completion_tokens", 25),  # added
        (b'{"model":"m","best_of":5,"n":2,"max_tokens":1000}', "max_tokens", 20),
    ],
)
def test_choices_share_the_cap(
    body: bytes, field: str, per_choice: int, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, _, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    r = mod.Client(transport=t).post(CHAT, content=body)
    out = json.loads(sent[-1].content)
    assert out[field] == per_choice
    rec = r.extensions["ratequeue"]
    assert rec.capped.field == field and rec.capped.sent == per_choice
    choices = max(out.get("n", 1), out.get("best_of", 1))
    assert rec.estimate.output_tokens == per_choice * choices <= 100
    if native and b"5000" in body:  # the one number rewritten, every other byte kept
        assert sent[-1].content == body.replace(b"5000", str(per_choice).encode())


@both
def test_null_choices_are_the_default_one(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenAI: "n: integer or null, defaults to 1"; a client may send the null.
    mod, sent, _, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    body = b'{"model":"m","n":null,"best_of":null,"max_tokens":5000}'
    r = mod.Client(transport=t).post(CHAT, content=body)
    out = json.loads(sent[-1].content)
    assert out["max_tokens"] == 100 and out["n"] is None
    rec = r.extensions["ratequeue"]
    assert rec.capped.sent == 100 and rec.estimate.output_tokens == 100


@both
def test_choices_within_the_cap_are_left_alone(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, _, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    body = b'{"model":"m","n":4,"max_tokens":25}'
    r = mod.Client(transport=t).post(CHAT, content=body)
    assert sent[-1].content == body and r.extensions["ratequeue"].capped is None
    assert r.extensions["ratequeue"].estimate.output_tokens == 100


@both
@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","n":128,"max_completion_tokens":100}',  # 100 // 128 == 0
        b'{"model":"m","n":101}',
        b'{"model":"m","best_of":200,"max_tokens":1}',
        b'{"model":"m","n":0,"max_tokens":5000}',
        b'{"model":"m","n":-1,"max_tokens":5}',
        b'{"model":"m","n":1.5,"max_tokens":5}',
        b'{"model":"m","n":2.0,"max_tokens":5}',
        b'{"model":"m","n":"4","max_tokens":5}',
        b'{"model":"m","n":true,"max_tokens":5}',
        b'{"model":"m","n":[4],"max_tokens":5}',
        b'{"model":"m","n":99999999999999999999999,"max_tokens":5}',
        b'{"model":"m","n":4,"n":"x","max_tokens":5}',
        b'{"model":"m","best_of":0,"max_tokens":5}',
        b'{"model":"m","\\u006e":128,"max_tokens":5}',
    ],
)
def test_choices_the_cap_cannot_share_are_refused(
    body: bytes, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, lim, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    with CallBudget(calls=5, tokens=10**6) as b, pytest.raises(CapNotApplied) as e:
        mod.Client(transport=t).post(CHAT, content=body)
    assert e.value.retry_after == float("inf")
    _untouched(lim, sent)
    assert b.calls_used == 0 and b.usage == []
    assert t.wait_histogram.count == 0 and t.http_histogram.count == 0


@pytest.mark.parametrize(
    ("body", "output"),
    [
        ({"n": 3, "max_tokens": 10}, 30),
        ({"best_of": 4, "n": 2, "max_tokens": 10}, 40),
        ({"n": 3}, 3 * 1024),
        ({"n": 0, "max_tokens": 10}, 10),  # not a count of choices: one
        ({"n": True, "max_tokens": 10}, 10),
        ({"n": "3", "max_tokens": 10}, 10),
    ],
)
def test_the_estimate_counts_every_choice(body: dict[str, Any], output: int) -> None:
    from ratequeue._ratequeue import _read_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    assert TokenEstimator(None)(body, "/v1/chat/completions").output_tokens == output
    got = _read_request(json.dumps(body).encode(), 4, 1024)
    assert got is not False and got[3] == output
    # Through the transport (the native reader, no caps): what acquire takes.
    mod = importlib.import_module("httpx")
    lim = rq.Limiter(rq.Rate(10**6, per="minute", unit="tokens"), clock=rq.ManualClock())
    t = RateLimitedTransport(
        mod.MockTransport(lambda r: mod.Response(200)), lim, estimator=TokenEstimator(None)
    )
    r = mod.Client(transport=t).post(CHAT, json=body)
    est = r.extensions["ratequeue"].estimate
    assert est.output_tokens == output
    assert lim.available("tokens") == 10**6 - est.input_tokens - output


# -- 2. nested bounds -----------------------------------------------------------------------

NESTED = [
    (GEMINI, "generationConfig", "maxOutputTokens"),
    (GEMINI, "generation_config", "max_output_tokens"),
    (GEMINI, "generationConfig", "max_output_tokens"),  # proto3 JSON takes either name
    (GEMINI, "generation_config", "maxOutputTokens"),
    (CONVERSE, "inferenceConfig", "maxTokens"),
    (NOVA, "inferenceConfig", "max_new_tokens"),
]


@both
@pytest.mark.parametrize(("url", "outer", "inner"), NESTED)
def test_a_nested_bound_is_capped_in_place(
    url: str, outer: str, inner: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, _, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    body = b'{"contents":[{"parts":[{"text":"hi"}]}],"%s":{"temperature":0.5,"%s":5000}}' % (
        outer.encode(),
        inner.encode(),
    )
    r = mod.Client(transport=t).post(url, content=body)
    assert json.loads(sent[-1].content)[outer][inner] == 100
    assert "max_tokens" not in json.loads(sent[-1].content)
    if native:
        assert sent[-1].content == body.replace(b"5000", b"100")
    rec = r.extensions["ratequeue"]
    assert (rec.capped.field, rec.capped.requested, rec.capped.sent) == (
        f"{outer}.{inner}",
        5000,
        100,
    )
    assert rec.estimate.output_tokens == 100


@both
def test_a_nested_bound_repeated_or_beside_a_top_level_one_is_capped_everywhere(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, lim, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    c = mod.Client(transport=t)
    # A container named twice: a first-wins and a last-wins parser read other bounds.
    for body in (
        b'{"generationConfig":{"maxOutputTokens":5000},"generationConfig":{"maxOutputTokens":5}}',
        b'{"generationConfig":{"maxOutputTokens":5},"generation_config":{}}',
        b'{"inferenceConfig":{"maxTokens":5},"inferenceConfig":null}',
    ):
        with pytest.raises(CapNotApplied, match="twice"):
            c.post(GEMINI, content=body)
    _untouched(lim, sent)
    for body in (
        b'{"generationConfig":{"maxOutputTokens":5,"maxOutputTokens":5000}}',
        b'{"generationConfig":{"maxOutputTokens":5,"max_output_tokens":5000}}',
        b'{"generationConfig":{"maxOutputTokens":5},"max_tokens":5000,"inferenceConfig":{}}',
        b'{"max_tokens":5,"generationConfig":{"maxOutputTokens":5000}}',
        b'{"generationConfig":{"maxOutputTokens":"5000"},"inferenceConfig":{"maxTokens":-1}}',
    ):
        c.post(GEMINI, content=body)
        vals = _bound_values(sent[-1].content)
        assert vals and all(type(v) is int and 0 <= v <= 100 for v in vals), sent[-1].content


@both
@pytest.mark.parametrize(
    ("url", "body", "want"),
    [
        (GEMINI, b'{"contents":[]}', {"generationConfig": {"maxOutputTokens": 100}}),
        (
            GEMINI,
            b'{"contents":[],"generationConfig":{"temperature":1}}',
            {"generationConfig": {"temperature": 1, "maxOutputTokens": 100}},
        ),
        (
            GEMINI,
            b'{"contents":[],"generation_config":{}}',
            {"generation_config": {"max_output_tokens": 100}},
        ),
        (CONVERSE, b'{"messages":[]}', {"inferenceConfig": {"maxTokens": 100}}),
        (
            "http://p/model/x/converse-stream",
            b'{"messages":[],"inferenceConfig":{"topP":1}}',
            {"inferenceConfig": {"topP": 1, "maxTokens": 100}},
        ),
        # Nova's InvokeModel body: in inferenceConfig, not a top-level max_tokens.
        (NOVA, b'{"messages":[]}', {"inferenceConfig": {"maxTokens": 100}}),
        (
            "http://p/model/amazon.nova-pro-v1:0/invoke-with-response-stream",
            b'{"messages":[],"inferenceConfig":{"topP":1}}',
            {"inferenceConfig": {"topP": 1, "maxTokens": 100}},
        ),
    ],
)
def test_a_missing_bound_is_added_where_the_api_reads_it(
    url: str, body: bytes, want: dict[str, Any], native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, _, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    r = mod.Client(transport=t).post(url, content=body)
    out = json.loads(sent[-1].content)
    for k, v in want.items():
        assert out[k] == v
    assert "max_tokens" not in out and "max_completion_tokens" not in out
    assert r.extensions["ratequeue"].estimate.output_tokens == 100


@pytest.mark.parametrize(("url", "outer", "inner"), NESTED)
def test_the_estimate_reads_a_nested_bound(url: str, outer: str, inner: str) -> None:
    from ratequeue._ratequeue import _read_request

    body = {"contents": [], outer: {inner: 77}}
    assert TokenEstimator(None)(body, url).output_tokens == 77
    got = _read_request(json.dumps(body).encode(), 4, 1024)
    assert got is not False and got[3] == 77


# -- 3. model globs by case -----------------------------------------------------------------


@both
@pytest.mark.parametrize("model", ["GPT-4o", "gpt-4O-mini", "Gpt-4o-2024-08-06"])
def test_a_model_glob_matches_any_case(
    model: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, _, t = _setup("httpx", [Cap(100, model="gpt-4o*")], native, monkeypatch)
    body = json.dumps({"model": model, "max_tokens": 5000}).encode()
    mod.Client(transport=t).post(CHAT, content=body)
    assert json.loads(sent[-1].content)["max_tokens"] == 100


def test_an_exact_model_matches_any_case() -> None:
    assert Cap(5, model="GPT-4o").matches("/x", "gpt-4o", None)
    assert Cap(5, model="claude-[3]*").matches("/x", "CLAUDE-3-opus", None)
    assert not Cap(5, model="gpt-4o*").matches("/x", "gpt-4", None)


# -- 4. ; path parameters -------------------------------------------------------------------


@both
@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions;x=1",
        "/v1/chat;a=b/completions",
        "/v1/chat/completions;",
        "/v1;v=2/chat/completions;jsessionid=1/",
        "/v1/chat/completions/.",
        "/v1/chat/x/../completions",
    ],
)
def test_path_parameters_do_not_escape_a_route_cap(
    path: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, lim, t = _setup("httpx", [Cap(100, route="/chat/completions")], native, monkeypatch)
    body = b'{"model":"m","max_completion_tokens":5000}'
    try:
        mod.Client(transport=t).post("http://p" + path, content=body)
    except CapNotApplied:
        _untouched(lim, sent)
        return
    assert json.loads(sent[-1].content)["max_completion_tokens"] == 100


def test_route_of_drops_path_parameters_and_dot_segments() -> None:
    from ratequeue.httpx._caps import output_field, route_of

    assert route_of("/v1;v=2/Chat/completions;x=1//") == "/v1/chat/completions"
    assert route_of("/a/./b/../c") == "/a/c"
    assert output_field("/v1/chat/completions;x") == "max_completion_tokens"
    assert output_field("/v1/responses;x") == "max_output_tokens"


# -- 5. multipart form fields naming a bound ------------------------------------------------


@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
@pytest.mark.parametrize(
    "field", ["max_tokens", "max_completion_tokens", "n", "generationConfig[maxOutputTokens]"]
)
def test_a_multipart_body_naming_a_bound_is_refused(
    modname: str, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, sent, lim, t = _setup(modname, [Cap(100)], True, monkeypatch)
    c = mod.Client(transport=t)
    files = {"file": ("a.wav", b"x" * 10)}
    with pytest.raises(CapNotApplied, match="multipart"):
        c.post(CHAT, files=files, data={field: "5000"})  # httpx's multipart stream
    with pytest.raises(CapNotApplied, match="multipart"):
        c.post(CHAT, files={"file": ("a.wav", b"x" * 4096)}, data={field: "5000"})
    raw = (
        b'--b\r\nContent-Disposition: form-data; NAME="%s"\r\n\r\n5000\r\n--b--\r\n'
        % field.encode()
    )
    with pytest.raises(CapNotApplied, match="multipart"):  # bytes, within max_body
        c.post(CHAT, content=raw, headers={"content-type": "multipart/form-data; boundary=b"})
    _untouched(lim, sent)
    # Uploads naming no bound pass; uncapped="send" sends these as they are.
    c.post(CHAT, files=files, data={"model": "whisper-1", "max_tokens_note": "x"})
    c.post(
        CHAT,
        content=raw.replace(field.encode(), b"prompt"),
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert len(sent) == 2
    mod, sent, lim, t = _setup(modname, [Cap(100)], True, monkeypatch, uncapped="send")
    mod.Client(transport=t).post(CHAT, files=files, data={field: "5000"})
    assert len(sent) == 1


NO_OUTPUT = [
    ("http://p/v1/embeddings", {"model": "text-embedding-3-small", "input": "hi"}),
    ("http://p/v1/images/generations", {"model": "dall-e-3", "prompt": "a cat"}),
    ("http://p/v1/audio/speech", {"model": "tts-1", "input": "hi", "voice": "alloy"}),
    ("http://p/v1/moderations", {"input": "hi"}),
    ("http://p/v1/messages/count_tokens", {"model": "claude-x", "messages": []}),
    ("http://p/v1beta/models/text-embedding-004:embedContent", {"content": {"parts": []}}),
    ("http://p/v1beta/models/gemini-2.0-flash:countTokens", {"contents": []}),
    ("http://p/model/amazon.titan-embed-text-v2:0/invoke", {"inputText": "hi"}),
    ("http://p/model/cohere.embed-english-v3/invoke", {"texts": ["hi"]}),
    (
        "http://p/model/amazon.nova-canvas-v1:0/invoke",
        {"taskType": "TEXT_IMAGE", "textToImageParams": {"text": "a cat"}},
    ),
]


@both
@pytest.mark.parametrize(("url", "body"), NO_OUTPUT)
def test_an_api_that_produces_no_text_gets_no_bound_added(
    url: str, body: dict[str, Any], native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catch-all cap sends an embeddings, image, audio or token-count body as it is (its
    server would refuse a max_tokens it does not know)."""
    mod, sent, _, t = _setup("httpx", [Cap(100)], native, monkeypatch)
    data = json.dumps(body).encode()
    r = mod.Client(transport=t).post(url, content=data)
    assert sent[-1].content == data
    assert r.extensions["ratequeue"].capped is None
    # A bound such a body does carry is still capped (the cap never raises one), but on
    # a token count: it spends no tokens, caps do not apply to it.
    r = mod.Client(transport=t).post(url, json={**body, "max_tokens": 5000})
    free = _spends_no_tokens(url.removeprefix("http://p"))
    assert json.loads(sent[-1].content)["max_tokens"] == (5000 if free else 100)
