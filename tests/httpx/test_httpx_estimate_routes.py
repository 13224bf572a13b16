"""Calls that spend few or no model tokens: a call with no body (a GET, a DELETE, an
empty POST) is settled to nothing when its response reports no usage (before, a model
list kept ``default_output_tokens``, 1,024, for good); an API that produces no output
(embeddings, moderations) is charged its prompt and no default output; the batch, file
and fine-tuning APIs and token counts spend none (a batch's usage, an Anthropic batch's
prompts are not the model's per-minute tokens)."""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue._ratequeue import (
    _FREE_CALLS,
    _MANAGEMENT,
    _MANAGEMENT_ACTIONS,
    _MODEL_CALLS,
    _NO_TEXT_ROUTES,
    _NO_TOKEN_ROUTES,
    _emits_no_tokens,
    _spends_no_tokens,
)
from ratequeue.httpx import Estimate, RateLimitedTransport, TokenEstimator, chars_estimate
from ratequeue.httpx._caps import route_of

MODS = ["httpx", "httpx2"]
BURST = 100_000


def answer(request: Any) -> Any:
    mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
    path = request.url.path
    if request.method == "GET" or request.method == "DELETE":
        return mod.Response(200, json={"object": "list", "data": [{"id": "gpt-4o"}]})
    if path.endswith("/embeddings"):
        usage = {"prompt_tokens": 2, "total_tokens": 2}
        return mod.Response(200, json={"data": [{"embedding": [0.5]}], "usage": usage})
    return mod.Response(200, json={"id": "x"})  # no usage: the estimate stays charged


def setup(mod: Any, native: bool, estimator: Any = None) -> tuple[Any, Any, Any]:
    kw = {} if estimator is None else {"estimator": estimator}
    return through(mod, native, answer, timeout=None, **kw)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/v1/chat/completions"), ("GET", "/v1/models")]
)
def test_a_call_without_a_body_nor_usage_settles_to_nothing(
    modname: str, native: bool, method: str, path: str
) -> None:
    """Held at the default output while it runs (a GET may stream a generation), then
    nothing: its whole answer, a JSON object, reports no usage, and it had nothing to
    generate from."""
    mod = importlib.import_module(modname)
    _t, client, lim = setup(mod, native)
    for _ in range(3):
        r = client.request(method, "http://p" + path, content=b"")
    rec = r.extensions["ratequeue"]
    assert rec._bodyless and not rec._tokenless
    assert rec.estimate == Estimate(0, 1024)
    assert rec.settled and rec.usage == (0, 0)
    assert lim.available("tokens") == BURST


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_an_unread_body_keeps_the_default_output(modname: str, native: bool) -> None:
    """A body the transport cannot read (a stream) may be a prompt: it is charged the
    default output, as before."""
    mod = importlib.import_module(modname)
    _t, client, _lim = setup(mod, native)
    r = client.post("http://p/v1/chat/completions", content=iter([b'{"model": "m"}']))
    r.read()
    assert r.extensions["ratequeue"].estimate == Estimate(0, 1024)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    "path",
    [
        "/v1/embeddings",
        "/openai/deployments/emb/embeddings",
        "/v1/moderations",
        "/v1beta/models/text-embedding-004:embedContent",
        "/v1beta/models/text-embedding-004:batchEmbedContents",
        "/model/amazon.titan-embed-text-v2:0/invoke",
        "/model/cohere.embed-english-v3/invoke",
        "/V1/Embeddings/",
        "/v1//embeddings;x=1",
    ],
)
def test_an_api_that_produces_no_tokens_is_charged_its_prompt_only(
    modname: str, native: bool, path: str
) -> None:
    mod = importlib.import_module(modname)
    _t, client, _lim = setup(mod, native)
    body = {"model": "text-embedding-3-small", "input": "x" * 40}
    r = client.post("http://p" + path, json=body)
    est = r.extensions["ratequeue"].estimate
    assert est == Estimate(14, 0)  # ceil(40 / 4) + 4; no output
    assert est == TokenEstimator(None)(body, path)
    assert est == chars_estimate(body, path)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/images/generations",  # gpt-image-1 reports output (image) tokens
        "/v1/audio/transcriptions",  # gpt-4o-transcribe reports output tokens
        "/model/amazon.nova-lite-v1:0/invoke",
        "/v1/embeddings/x",  # not the route's end
        "/v1/my_embeddings_generator",
    ],
)
def test_other_apis_keep_the_default_output(modname: str, native: bool, path: str) -> None:
    mod = importlib.import_module(modname)
    _t, client, _lim = setup(mod, native)
    body = {"model": "m", "input": "x" * 40}
    r = client.post("http://p" + path, json=body)
    assert r.extensions["ratequeue"].estimate == Estimate(14, 1024)


@pytest.mark.parametrize("native", [True, False])
def test_a_bound_in_a_no_token_api_body_is_still_read(native: bool) -> None:
    mod = importlib.import_module("httpx")
    _t, client, _lim = setup(mod, native)
    body = {"model": "m", "input": "x" * 40, "max_tokens": 9}
    r = client.post("http://p/v1/embeddings", json=body)
    assert r.extensions["ratequeue"].estimate == Estimate(14, 9)


def test_the_usage_settles_an_embedding_call_to_its_prompt() -> None:
    mod = importlib.import_module("httpx")
    _t, client, lim = setup(mod, True)
    r = client.post("http://p/v1/embeddings", json={"model": "m", "input": "hello"})
    assert r.extensions["ratequeue"].usage == (2, 0)
    assert lim.available("tokens") == BURST - 2


def test_a_user_estimator_is_asked_about_an_empty_call() -> None:
    seen: list[Any] = []

    def est(body: Any, path: str) -> Estimate:
        seen.append((body, path))
        return Estimate(50, 50)

    mod = importlib.import_module("httpx")
    _t, client, lim = setup(mod, True, est)
    r = client.get("http://p/v1/models")
    assert r.extensions["ratequeue"].estimate == Estimate(50, 50)
    assert seen == [(None, "/v1/models")]
    assert lim.available("tokens") == BURST  # settled to nothing
    r = client.post("http://p/v1/embeddings", json={"input": "hi"})
    assert seen[1] == ({"input": "hi"}, "/v1/embeddings")
    assert r.extensions["ratequeue"].estimate == Estimate(50, 50)
    assert lim.available("tokens") == BURST - 2  # settled to the usage reported


@pytest.mark.parametrize(
    "path",
    [
        "/v1/embeddings",
        "/V1/EMBEDDINGS",
        "/v1/embeddings/",
        "/v1/embeddings;v=2",
        "/v1//embeddings",
        "/v1/x/../embeddings",
        "/v1/./embeddings",
        "/v1/embeddings/..",
        "/v1/messages/count_tokens",
        "/m:countTokens",
        "/model/x.embed-v1/invoke-with-response-stream",
        "/model/x.embed-v1/converse",
        "/model/embed/x/invoke",
        "/model//invoke",
        "/model/",
        "",
        "/",
        "/embeddingsx",
        "/v1/chat/completions",
        "/İ/embeddings",
        "/\u212a:counttokens",
        "/v1/messages/batches",
        "/v1/messages/batches/",
        "/V1/Batches",
        "/v1/batches/b1/cancel",
        "/v1/files",
        "/upload/v1beta/files",
        "/v1/uploads/u1/parts",
        "/v1/fine_tuning/jobs",
        "/v1/vector_stores/vs1/files",
        "/m:batchGenerateContent",
        "/openai/deployments/files/chat/completions",
        "/openai/deployments/batches/responses",
        "/v1/files/../chat/completions",
        "/v1/batches;x=1",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses/input_tokens",
        "/v1/files/x:countTokens",
        "/v1/responses/resp_1",
        "/v1/responses/RESP_1/Cancel",
        "/v1/responses/RESP_1/Input_Items",
        "/v1/chat/completions/chatcmpl-1:generateContent",
        "/v1/chat/completions/CHATCMPL-A_b-1",
        "/v1/responses/resp_1/input_items",
        "/v1/responses/resp_1/x",
        "/v1/responses/compact",
        "/v1/chat/completions/chatcmpl-1/messages",
        "/v1/chat/completions/chatcmpl_1",
        "/model-invocation-job/j1/stop",
        "/model-invocation-jobs",
        "/v1/projects/p/locations/l/batchPredictionJobs/1:cancel",
        "/locations/l/batchPredictionJobs",
        "/v1/batch/jobs/b1/cancel",
        "/v1/batch/x",
        "/",
        "",
    ],
)
def test_the_native_route_rules_are_the_python_ones_on_examples(path: str) -> None:
    assert _emits_no_tokens(path) == _reference(path)
    assert _spends_no_tokens(path) == _management(path)


def _reference(path: str) -> bool:
    """The rule of ``_emits_no_tokens`` over the Python ``route_of`` (the tables are the
    core's)."""
    p = route_of(path)
    if p.endswith(_NO_TOKEN_ROUTES):
        return True
    if p.endswith(("/invoke", "/invoke-with-response-stream")) and "/model/" in p:
        return "embed" in p[p.index("/model/") + 7 : p.rindex("/")]
    return False


def test_the_estimate_rule_is_documented_json_safe() -> None:
    # The estimator is still a plain function of (body, path): None is an unread body.
    assert TokenEstimator(None)(None, "/v1/embeddings") == Estimate(0, 0)
    assert TokenEstimator(None)(None, "/v1/chat/completions") == Estimate(0, 1024)
    assert json.loads(json.dumps(TokenEstimator(None)({"input": "ab"}, "/v1/embeddings"))) == [5, 0]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
def test_a_stream_claiming_no_length_is_not_taken_for_empty(modname: str, native: bool) -> None:
    """Only bytes read and empty make a call bodiless: a header claiming so does not."""
    mod = importlib.import_module(modname)
    t, _client, _lim = setup(mod, native)
    req = mod.Request(
        "POST",
        "http://p/v1/chat/completions",
        headers={"content-length": "0"},
        content=iter([b'{"model": "m"}']),
    )
    call = t._prepare(req, False)
    assert call.estimate == Estimate(0, 1024)


# -- a call without a body is charged nothing, whatever usage its response reports ------------

BATCH = {
    "id": "batch_1",
    "object": "batch",
    "status": "completed",
    # The batch's own usage (charged to the batch quota, not to this call).
    "usage": {"input_tokens": 90_000, "output_tokens": 40_000, "total_tokens": 130_000},
}
RESPONSE = {"id": "resp_1", "object": "response", "usage": {"input_tokens": 7, "output_tokens": 9}}


def retrieving(request: Any) -> Any:
    mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
    path = request.url.path
    if "/batches" in path:
        return mod.Response(200, json=BATCH)
    if "/responses/" in path:
        return mod.Response(200, json=RESPONSE)
    return mod.Response(200, json={"usage": {"prompt_tokens": 3, "completion_tokens": 4}})


def through(
    mod: Any, native: bool, provider: Any = None, timeout: float | None = 0.0, **kw: Any
) -> tuple[Any, Any, Any]:
    """A transport to ``provider`` (``retrieving``) over requests and tokens on the manual
    clock; ``native`` False: the Python reference reads and settles every call. A call
    the limiter cannot grant at once fails with ``timeout=0`` (the clock never moves)."""
    lim = rq.Limiter(
        rq.Rate(1000, per="second", burst=1000),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    inner = mod.MockTransport(provider or retrieving)
    t = RateLimitedTransport(inner, lim, timeout=timeout, **kw)
    if not native:
        t._reader = None
        t._native_settle = False
    return t, mod.Client(transport=t), lim


def charged_nothing(modname: str, native: bool, method: str, path: str) -> None:
    """Three calls on ``path``, each estimated and settled to nothing: no token spent,
    whatever usage the response reports."""
    mod = importlib.import_module(modname)
    _t, client, lim = through(mod, native)
    for _ in range(3):
        r = client.request(method, "http://p" + path)
    rec = r.extensions["ratequeue"]
    assert rec._tokenless
    assert rec.estimate == Estimate(0, 0)
    assert rec.settled and rec.usage is None
    assert lim.available("tokens") == BURST


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/batches/batch_1"),  # polled until done: the batch's usage, not ours
        ("POST", "/v1/batches/batch_1/cancel"),
        ("GET", "/v1/files/file-abc"),
        ("DELETE", "/v1/files/file-abc"),
    ],
)
def test_a_management_call_is_charged_no_usage_its_response_reports(
    modname: str, native: bool, method: str, path: str
) -> None:
    charged_nothing(modname, native, method, path)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    ("path", "used"),
    [
        ("/v1/chat/completions/chatcmpl_1", 7),  # not a stored completion's id
        ("/v1/responses/compact", 16),
        ("/v1/responses/resp_1/x", 16),  # not one of a stored response's actions
        # A response polled: a background one reports there what it used.
        ("/v1/responses/resp_1", 16),
        ("/v1/gen?q=hi", 7),
    ],
)
def test_a_call_without_a_body_is_charged_the_usage_it_reports(
    modname: str, native: bool, path: str, used: int
) -> None:
    """A GET may generate (its prompt in its query), or report a background response's
    usage: the usage it reports is charged."""
    mod = importlib.import_module(modname)
    _t, client, lim = through(mod, native)
    r = client.get("http://p" + path)
    rec = r.extensions["ratequeue"]
    assert rec._bodyless and rec.usage is not None
    assert lim.available("tokens") == BURST - used


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_1/input_items"),
        ("GET", "/v1/chat/completions/chatcmpl-1"),
        ("DELETE", "/v1/chat/completions/chatcmpl-1"),
        ("GET", "/v1/chat/completions/chatcmpl-1/messages"),
        ("POST", "/v1/chat/completions/chatcmpl-1"),  # its metadata updated
    ],
)
def test_a_stored_model_call_is_not_charged_again(
    modname: str, native: bool, method: str, path: str
) -> None:
    """Its usage was charged when it was made: reading it back (as often as a poll does)
    charges nothing, whatever usage the stored object reports."""
    charged_nothing(modname, native, method, path)


@pytest.mark.parametrize("modname", MODS)
def test_a_streamed_body_of_a_management_call_is_not_charged(modname: str) -> None:
    """The response of a batch poll read as a stream (as over the network)."""
    mod = importlib.import_module(modname)

    def streamed(request: Any) -> Any:
        body = json.dumps(BATCH).encode()
        return mod.Response(200, headers={"content-type": "application/json"}, stream=once(body))

    class once(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, body: bytes) -> None:
            self.body = body

        def __iter__(self) -> Any:
            yield self.body

    lim = rq.Limiter(
        rq.Rate(1000, per="second", burst=1000),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    t = RateLimitedTransport(mod.MockTransport(streamed), lim, timeout=0.0)
    client = mod.Client(transport=t)
    with client.stream("GET", "http://p/v1/batches/b") as r:
        assert json.loads(r.read())["id"] == "batch_1"
    assert r.extensions["ratequeue"].settled
    assert lim.available("tokens") == BURST


@pytest.mark.parametrize("native", [True, False])
def test_a_tokenless_call_in_a_budget_and_ledger_counts_no_tokens(native: bool) -> None:
    from ratequeue.httpx import CallBudget

    class Ledger:
        def __init__(self) -> None:
            self.ops: list[tuple[str, int, int]] = []

        def hold(self, request_id: str, account: str, **kw: Any) -> None:
            self.ops.append(("hold", kw["input_tokens"], kw["output_tokens"]))

        def settle(self, request_id: str, **kw: Any) -> None:
            self.ops.append(("settle", kw["input_tokens"], kw["output_tokens"]))

        def release(self, request_id: str) -> None:
            self.ops.append(("release", 0, 0))

    mod = importlib.import_module("httpx")
    ledger = Ledger()
    _t, client, _lim = through(mod, native, ledger=ledger)
    with CallBudget(calls=5, tokens=1_000) as budget:
        for _ in range(2):
            client.get("http://p/v1/batches/batch_1")
    assert budget.tokens_used == 0
    assert [s.tokens for s in budget.usage] == [0, 0]
    assert all(s.settled for s in budget.usage)
    assert ledger.ops == [("hold", 0, 0), ("settle", 0, 0)] * 2


@pytest.mark.parametrize("native", [True, False])
def test_a_post_with_a_body_still_settles_to_its_usage(native: bool) -> None:
    mod = importlib.import_module("httpx")
    _t, client, lim = through(mod, native)
    r = client.post("http://p/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.extensions["ratequeue"].usage == (3, 4)
    assert lim.available("tokens") == BURST - 7


# -- batch, file and fine-tuning management spends no tokens of the model's rate ------------

ANTHROPIC_BATCH = {
    "requests": [
        {
            "custom_id": f"r{i}",
            "params": {
                "model": "claude-sonnet-4-5",
                "max_tokens": 1024,
                "messages": [{"role": "user", "content": "x" * 4000}],
            },
        }
        for i in range(50)
    ]
}


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages/batches", ANTHROPIC_BATCH),  # 50 prompts: batch limits, not ITPM
        ("/v1/batches", {"input_file_id": "file-1", "endpoint": "/v1/responses"}),
        ("/v1/fine_tuning/jobs", {"model": "gpt-4o-mini", "training_file": "file-1"}),
        ("/v1/vector_stores", {"name": "docs"}),
        ("/v1/uploads", {"filename": "a.jsonl", "purpose": "batch", "bytes": 9}),
        ("/v1beta/models/gemini-2.5-flash:batchGenerateContent", {"batch": {"x": "y" * 99}}),
        ("/openai/batches", {"input_file_id": "file-1"}),
        # Token counts: their own rate limits, not the model's tokens.
        ("/v1/messages/count_tokens", ANTHROPIC_BATCH["requests"][0]["params"]),
        ("/v1/responses/input_tokens", {"model": "m", "input": "x" * 999}),
        ("/v1beta/models/gemini-2.0-flash:countTokens", {"contents": [{"parts": ["x"]}]}),
    ],
)
def test_management_calls_spend_no_tokens(
    modname: str, native: bool, path: str, body: dict[str, Any]
) -> None:
    mod = importlib.import_module(modname)
    _t, client, lim = through(mod, native)
    r = client.post("http://p" + path, json=body)
    rec = r.extensions["ratequeue"]
    assert rec.estimate == Estimate(0, 0)
    assert rec.usage is None
    assert lim.available("tokens") == BURST


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "path",
    [
        "/openai/deployments/files/chat/completions",  # a deployment named like an API
        "/openai/deployments/batches/embeddings",
        "/v1/threads/runs",
        "/v1/files-like/chat/completions",
        "/v1/projects/batches/locations/l/publishers/anthropic/models/m:rawPredict",
        "/workspaces/uploads/chat",
        "/v1/fine_tuning/alpha/graders/run",  # runs a model grader
        "/v1/vector_stores/vs_1/search",
        "/v1/files/../chat",
        "/v1//files",
    ],
)
def test_a_model_call_is_never_taken_for_management(native: bool, path: str) -> None:
    mod = importlib.import_module("httpx")
    _t, client, _lim = through(mod, native)
    r = client.post("http://p" + path, json={"model": "m", "input": "x" * 40})
    assert r.extensions["ratequeue"].estimate.input_tokens == 14


@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize(
    "path", ["/v1/messages/batches", "/v1/batches", "/v1/fine_tuning/jobs", "/v1/vector_stores"]
)
def test_a_catch_all_cap_adds_no_bound_to_a_management_call(modname: str, path: str) -> None:
    from ratequeue.httpx import Cap

    mod = importlib.import_module(modname)
    sent: list[bytes] = []

    def keep(request: Any) -> Any:
        sent.append(request.content)
        return mod.Response(200, json={"id": "x"})

    lim = rq.Limiter(rq.Rate(1000, per="second"), clock=rq.ManualClock())
    t = RateLimitedTransport(mod.MockTransport(keep), lim, caps=[Cap(100)])
    body = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "max_tokens": 900}
    client = mod.Client(transport=t)
    client.post("http://p" + path, json=body)
    assert json.loads(sent[0]) == body  # no output to bound: caps do not apply
    client.post("http://p" + path, content=b"not json")  # nor refuse what they cannot read
    assert sent[1] == b"not json"


def _management(path: str) -> bool:
    """The rule of ``_spends_no_tokens``: only a path read as it is (any case)."""
    if not path.isascii() or ";" in path or "//" in path or "/." in path or path.endswith("/"):
        return False
    p = path.lower()
    if p.endswith(_FREE_CALLS):
        return True
    # A stored chat completion (or its messages), a response's input items, by id.
    if re.search(r"/responses/resp_[a-z0-9_-]+/input_items\Z", p) or re.search(
        r"/chat/completions/chatcmpl-[a-z0-9_-]+(/messages)?\Z", p
    ):
        return True
    if p.endswith(_MODEL_CALLS + _NO_TEXT_ROUTES):
        return False
    # Bedrock's and Vertex AI's batch jobs.
    if re.search(
        r"/model-invocation-job(/[^/]+(/stop)?)?\Z|/model-invocation-jobs\Z"
        r"|/locations/[^/]*/batchpredictionjobs(/[^/]+)?\Z",
        p,
    ):
        return True
    segs = p.split("/")
    for i, seg in enumerate(segs):
        if i and seg in _MANAGEMENT:
            before = segs[i - 2] if segs[i - 1] == "messages" and i > 1 else segs[i - 1]
            if before == "openai" or re.fullmatch("v[0-9][a-z0-9]*", before):
                rest = segs[i:]
                collections = {"fine_tuning": ("jobs", "checkpoints"), "batch": ("jobs",)}
                if seg in collections:
                    if len(rest) < 2 or rest[1] not in collections[seg]:
                        continue
                    rest = rest[1:]
                if len(rest) <= 5 and all(
                    k % 2 == 1 or a in _MANAGEMENT_ACTIONS for k, a in enumerate(rest) if k
                ):
                    return True
    return False


# -- from the review: what makes a call bodyless is the stream it sends ----------------------

PROMPT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}).encode()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("swap", ["bytes", "iterator"])
def test_a_body_swapped_in_by_a_hook_is_charged(modname: str, native: bool, swap: str) -> None:
    """A request built empty whose stream a hook fills (``_content`` left b"") sends a
    prompt: it is a model call, charged what it used (before, it passed for bodyless and
    was never charged: a way around the token limit)."""
    mod = importlib.import_module(modname)

    def answer(request: Any) -> Any:
        assert b"".join(request.stream) == PROMPT  # the prompt went out
        usage = {"prompt_tokens": 10_000, "completion_tokens": 40_000}
        return mod.Response(200, json={"usage": usage})

    lim = rq.Limiter(
        rq.Rate(1000, per="second", burst=1000),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    t = RateLimitedTransport(mod.MockTransport(answer), lim, timeout=0.0)
    if not native:
        t._reader = None
        t._native_settle = False

    def hook(request: Any) -> None:
        request.stream = mod.ByteStream(PROMPT) if swap == "bytes" else _chunks(mod, PROMPT)

    client = mod.Client(transport=t, event_hooks={"request": [hook]})
    r = client.post("http://p/v1/chat/completions", content=b"")
    assert not r.extensions["ratequeue"]._tokenless
    assert not r.extensions["ratequeue"]._bodyless
    assert r.extensions["ratequeue"].usage == (10_000, 40_000)
    assert lim.available("tokens") == BURST - 50_000
    client.post("http://p/v1/chat/completions", content=b"")
    with pytest.raises(rq.RateQueueError):  # the bucket is spent
        client.post("http://p/v1/chat/completions", content=b"")


def _chunks(mod: Any, body: bytes) -> Any:
    class Chunks(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __iter__(self) -> Any:
            yield body

    return Chunks()


@pytest.mark.parametrize("modname", MODS)
def test_a_streamed_answer_to_a_bodyless_call_holds_its_concurrency_slot(modname: str) -> None:
    """Settled (and its Policy's slot given back) when its body ends, not at its headers:
    a second stream under Concurrency(1) waits meanwhile."""
    mod = importlib.import_module(modname)

    class Events(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __iter__(self) -> Any:
            yield b'event: response.output_text.delta\ndata: {"delta":"x"}\n\n'

    def answer(request: Any) -> Any:
        return mod.Response(200, headers={"content-type": "text/event-stream"}, stream=Events())

    lim = rq.Limiter(
        rq.Rate(100, per="second", burst=100),
        rq.Rate(10**6, per="minute", burst=10**6, unit="tokens"),
        clock=rq.ManualClock(),
    )
    policy = rq.Policy({"conc": rq.Concurrency(1), "cluster": lim})
    t = RateLimitedTransport(
        mod.MockTransport(answer), policy, upstream=lim, units=["requests", "tokens"], timeout=0.0
    )
    client = mod.Client(transport=t)
    url = "http://p/v1/generate?stream=true"
    with client.stream("GET", url) as first:
        assert first.extensions["ratequeue"]._bodyless
        assert not first.extensions["ratequeue"].settled
        with pytest.raises(rq.RateQueueError), client.stream("GET", url):
            pass
        first.read()
        assert first.extensions["ratequeue"].settled
    with client.stream("GET", url) as again:  # the slot is free again
        again.read()
    # An event stream without a usage may have generated: each keeps its estimate.
    assert lim.available("tokens") == 10**6 - 2 * 1024


@pytest.mark.parametrize("native", [True, False])
def test_a_management_call_is_the_same_without_a_token_unit(native: bool) -> None:
    """Whether anything needs the estimate or not: no estimator asked, no usage kept."""
    mod = importlib.import_module("httpx")
    lim = rq.Limiter(rq.Rate(1000, per="second"), clock=rq.ManualClock())
    t = RateLimitedTransport(mod.MockTransport(retrieving), lim)
    if not native:
        t._reader = None
        t._native_settle = False
    r = mod.Client(transport=t).get("http://p/v1/batches/b")
    rec = r.extensions["ratequeue"]
    assert rec._tokenless
    assert rec.estimate == Estimate(0, 0)
    assert rec.usage is None


def test_the_estimator_takes_any_path() -> None:
    est = TokenEstimator(None)
    assert est({"input": "ab"}, None) == Estimate(5, 1024)  # type: ignore[arg-type]
    assert est(None, b"/v1/embeddings") == Estimate(0, 1024)  # type: ignore[arg-type]


_SEGMENTS = st.sampled_from(
    [
        "v1",
        "V1",
        "embeddings",
        "EMBEDDİNGS",
        "moderations",
        "count_tokens",
        "count_to\u212aens",
        "m:countTokens",
        "m:embedContent",
        "m:batchGenerateContent",
        "model",
        "a.embed-1",
        "invoke",
        "chat",
        "completions",
        "responses",
        "input_tokens",
        "messages",
        "batches",
        "Files",
        "jobs",
        "cancel",
        "content",
        "graders",
        "run",
        "search",
        "uploads",
        "fine_tuning",
        "vector_stores",
        "resp_1",
        "chatcmpl-1",
        "chatcmpl-1:x",
        "input_items",
        "batch",
        "model-invocation-job",
        "model-invocation-jobs",
        "stop",
        "locations",
        "batchPredictionJobs",
        ".",
        "..",
        "",
        ";x",
        "x;y=1",
        "\u00e9",
        "\u03a3",
        "\udc80",
    ]
)


@settings(max_examples=2000, deadline=None)
@given(st.lists(_SEGMENTS, max_size=7), st.booleans(), st.booleans())
def test_the_native_route_rules_are_the_python_ones(
    segments: list[str], lead: bool, trail: bool
) -> None:
    path = ("/" if lead else "") + "/".join(segments) + ("/" if trail else "")
    assert _emits_no_tokens(path) == _reference(path)
    assert _spends_no_tokens(path) == _management(path)


# -- from the third review: only a whole JSON answer settles a bodyless call to nothing ------


def _sse(mod: Any, n: int) -> Any:
    class Events(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __iter__(self) -> Any:
            for _ in range(n):
                yield b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'

    return Events()


def _halves(mod: Any) -> Any:
    """A JSON object (no usage) in two chunks."""

    class Halves(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __iter__(self) -> Any:
            yield b'{"object": "list", "da'
            yield b'ta": []}'

    return Halves()


@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("how", ["cut", "no-usage-event", "cut-json", "undecodable"])
def test_a_bodyless_call_that_may_have_generated_keeps_its_estimate(modname: str, how: str) -> None:
    """A GET event stream closed early or never reporting its usage, a JSON body cut
    short, a body it cannot decode: it may have generated, so its estimate stays."""
    mod = importlib.import_module(modname)

    def answer(request: Any) -> Any:
        if how == "undecodable":
            headers = {"content-type": "application/json", "content-encoding": "x-custom"}
            return mod.Response(200, headers=headers, stream=_halves(mod))
        if how == "cut-json":
            return mod.Response(
                200, headers={"content-type": "application/json"}, stream=_halves(mod)
            )
        return mod.Response(200, headers={"content-type": "text/event-stream"}, stream=_sse(mod, 5))

    _t, client, lim = through(mod, True, answer, timeout=None)
    with client.stream("GET", "http://p/v1/gen?q=hi") as r:
        if how in ("cut", "cut-json"):
            next(r.iter_raw())  # one chunk, then closed
        else:
            r.read()
    rec = r.extensions["ratequeue"]
    assert rec._bodyless and rec.settled
    assert lim.available("tokens") == BURST - 1024


@pytest.mark.parametrize("modname", MODS)
def test_a_whole_streamed_json_answer_to_a_bodyless_call_settles_to_nothing(modname: str) -> None:
    mod = importlib.import_module(modname)

    def answer(request: Any) -> Any:
        return mod.Response(200, headers={"content-type": "application/json"}, stream=_halves(mod))

    _t, client, lim = through(mod, True, answer, timeout=None)
    with client.stream("GET", "http://p/v1/models") as r:
        r.read()
    assert r.extensions["ratequeue"].usage == (0, 0)
    assert lim.available("tokens") == BURST


@pytest.mark.parametrize("modname", MODS)
def test_an_async_whole_json_answer_to_a_bodyless_call_settles_to_nothing(modname: str) -> None:
    mod = importlib.import_module(modname)

    class Half(mod.AsyncByteStream):  # type: ignore[name-defined,misc]
        async def __aiter__(self) -> Any:
            yield b'{"object": "list", '
            yield b'"data": []}'

    def answer(request: Any) -> Any:
        return mod.Response(200, headers={"content-type": "application/json"}, stream=Half())

    lim = rq.Limiter(
        rq.Rate(1000, per="second", burst=1000),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    t = RateLimitedTransport(mod.MockTransport(answer), lim)

    async def go() -> Any:
        async with mod.AsyncClient(transport=t) as client:
            async with client.stream("GET", "http://p/v1/models") as r:
                await r.aread()
            return r

    import asyncio

    r = asyncio.run(go())
    assert r.extensions["ratequeue"].usage == (0, 0)
    assert lim.available("tokens") == BURST
