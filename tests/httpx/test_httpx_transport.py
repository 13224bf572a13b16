"""RateLimitedTransport over httpx and httpx2 MockTransports: every step of a call."""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import (
    BudgetExceeded,
    CallBudget,
    CallRecord,
    Cap,
    Estimate,
    RateLimitedTransport,
    TokenEstimator,
    apply_caps,
    chars_estimate,
    using,
)

pytestmark = pytest.mark.timeout(60)

MODULES = ["httpx", "httpx2"]
CHAT = "/v1/chat/completions"


def usage_body(i: int = 5, o: int = 7) -> dict[str, Any]:
    return {"usage": {"prompt_tokens": i, "completion_tokens": o}}


class Recorder:
    """A MockTransport handler that records what was sent and answers as told."""

    def __init__(self, mod: Any, answer: Callable[[Any], Any] | None = None) -> None:
        self.mod = mod
        self.sent: list[Any] = []
        self.answer = answer or (lambda req: mod.Response(200, json=usage_body()))

    def __call__(self, request: Any) -> Any:
        self.sent.append(request)
        return self.answer(request)

    def body(self, i: int = -1) -> dict[str, Any]:
        return dict(json.loads(self.sent[i].content))


@pytest.fixture(params=MODULES)
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def limiter(clock: rq.ManualClock | None = None, burst: int = 5, **kw: Any) -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(60, per="minute", burst=burst),
        rq.Rate(60_000, per="minute", burst=10_000, unit="tokens"),
        clock=clock or rq.ManualClock(),
        **kw,
    )


def client(mod: Any, rec: Recorder, limit: Any, **kw: Any) -> Any:
    t = RateLimitedTransport(mod.MockTransport(rec), limit, **kw)
    return mod.Client(transport=t, base_url="http://provider")


def chat(c: Any, content: str = "hello", headers: dict[str, str] | None = None, **body: Any) -> Any:
    msgs = [{"role": "user", "content": content}]
    return c.post(CHAT, json={"model": "gpt-x", "messages": msgs, **body}, headers=headers)


# -- import -----------------------------------------------------------------------------------


def test_import_ratequeue_imports_neither_httpx() -> None:
    code = (
        "import sys, ratequeue, ratequeue.httpx; "
        "assert 'httpx' not in sys.modules and 'httpx2' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- estimate and caps --------------------------------------------------------------------------


def test_chars_fallback_estimate() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 100}
    assert chars_estimate(body, CHAT) == Estimate(10 + 4, 100)
    # images as data URLs and the model name are not prompt text
    body2 = {
        "model": "m" * 50,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + "A" * 10_000},
                    },
                    {"type": "text", "text": "abcd"},
                ],
            }
        ],
    }
    assert chars_estimate(body2, CHAT) == Estimate(1 + 4, 1024)
    assert chars_estimate(None, CHAT) == Estimate(0, 1024)


def test_tiktoken_path_with_a_real_encoding() -> None:
    tiktoken = importlib.import_module("tiktoken")
    # A byte-level encoding built locally: the real tiktoken code path, no download.
    enc = tiktoken.Encoding(
        name="bytes",
        pat_str=r"[\s\S]",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={},
    )
    est = TokenEstimator(enc)
    assert est.encoding is enc
    assert est.count("hello") == 5
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    assert est(body, CHAT) == Estimate(5 + 4, 3)
    assert est.count("héllo") == 6  # bytes, not characters: the encoding decides


def test_unloadable_tiktoken_encoding_falls_back_to_chars() -> None:
    est = TokenEstimator("no-such-encoding-anywhere")
    assert est.encoding is None  # never waits: the fallback until loaded
    assert est.load(timeout=60) is False
    assert est.encoding is None
    assert est.count("x" * 9) == 3


def test_user_estimator_wins(mod: Any) -> None:
    rec = Recorder(mod)
    seen: list[Any] = []

    def mine(body: dict[str, Any] | None, path: str) -> Estimate:
        seen.append((body, path))
        return Estimate(111, 222)

    lim = limiter()
    r = chat(client(mod, rec, lim, estimator=mine))
    record: CallRecord = r.extensions["ratequeue"]
    assert record.estimate == Estimate(111, 222)
    assert seen[0][1] == CHAT


def test_caps_lower_add_and_never_raise(mod: Any) -> None:
    rec = Recorder(mod)
    caps = [
        Cap(100, route="/chat/completions"),
        Cap(20, model="gpt-x*", task="summary"),
        Cap(5, route="/v1/messages"),
    ]
    c = client(mod, rec, limiter(burst=20), caps=caps)
    r = chat(c, max_completion_tokens=4000)
    assert rec.body()["max_completion_tokens"] == 100
    rec_ = r.extensions["ratequeue"]
    assert (rec_.capped.field, rec_.capped.requested, rec_.capped.sent) == (
        "max_completion_tokens",
        4000,
        100,
    )
    assert rec_.estimate.output_tokens == 100
    chat(c)
    assert rec.body()["max_completion_tokens"] == 100  # added where none was asked
    r = chat(c, max_tokens=10)
    assert (
        rec.body()["max_tokens"] == 10 and r.extensions["ratequeue"].capped is None
    )  # never raised
    chat(c, max_tokens=50, headers={"x-ratequeue-task": "summary"})
    assert rec.body()["max_tokens"] == 20
    assert "x-ratequeue-task" not in rec.sent[-1].headers
    with using(task="summary"):
        chat(c, max_tokens=50)
    assert rec.body()["max_tokens"] == 20
    assert int(rec.sent[-1].headers["content-length"]) == len(rec.sent[-1].content)
    c.post("/v1/responses", json={"model": "o", "input": "hi"})
    assert "max_output_tokens" not in rec.body()  # no cap matches this route


def test_cap_rules_are_checked() -> None:
    with pytest.raises(ValueError):
        Cap(0)
    with pytest.raises(TypeError):
        Cap(10.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Cap(10, model=3)  # type: ignore[arg-type]


# -- settle -------------------------------------------------------------------------------------


def test_settles_real_usage_from_json(mod: Any) -> None:
    rec = Recorder(
        mod,
        lambda req: mod.Response(200, json={"usage": {"input_tokens": 30, "output_tokens": 12}}),
    )
    lim = limiter()
    r = chat(client(mod, rec, lim), max_tokens=5_000)
    record = r.extensions["ratequeue"]
    assert record.usage == (30, 12) and record.settled
    assert lim.available("tokens") == pytest.approx(10_000 - 42)
    assert lim.available() == pytest.approx(4)


def test_estimate_larger_than_the_burst_is_clamped_and_settled(mod: Any) -> None:
    rec = Recorder(mod)
    lim = limiter()
    chat(client(mod, rec, lim), max_tokens=1_000_000)  # would be CostTooLarge unclamped
    assert lim.available("tokens") == pytest.approx(10_000 - 12)


def test_sse_passes_through_unbuffered_and_settles_at_the_usage_event(mod: Any) -> None:
    produced: list[int] = []
    lim = limiter()

    def events() -> Iterator[bytes]:
        for i in range(3):
            produced.append(i)
            yield b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
        produced.append(3)
        yield b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}\n\n'
        produced.append(4)
        yield b"data: [DONE]\n\n"

    rec = Recorder(
        mod,
        lambda req: mod.Response(
            200, headers={"content-type": "text/event-stream"}, stream=SyncStream(mod, events())
        ),
    )
    c = client(mod, rec, lim)
    with c.stream(
        "POST", CHAT, json={"model": "m", "messages": [], "stream": True, "max_tokens": 500}
    ) as r:
        assert rec.body()["stream_options"] == {"include_usage": True}
        it = r.iter_raw()
        first = next(it)
        assert first.startswith(b"data:") and produced == [0]  # nothing read ahead
        record = r.extensions["ratequeue"]
        assert not record.settled
        for _ in it:
            if produced[-1] == 3:
                assert record.settled and record.usage == (9, 3)
    assert lim.available("tokens") == pytest.approx(10_000 - 12)


def SyncStream(mod: Any, it: Iterator[bytes]) -> Any:
    class S(mod.SyncByteStream):  # type: ignore[misc,name-defined]
        def __iter__(self) -> Iterator[bytes]:
            yield from it

    return S()


def test_stream_closed_early_keeps_the_estimate(mod: Any) -> None:
    def events() -> Iterator[bytes]:
        while True:
            yield b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'

    lim = limiter()
    rec = Recorder(
        mod,
        lambda req: mod.Response(
            200, headers={"content-type": "text/event-stream"}, stream=SyncStream(mod, events())
        ),
    )
    c = client(mod, rec, lim)
    with c.stream(
        "POST", CHAT, json={"model": "m", "messages": [], "stream": True, "max_tokens": 500}
    ) as r:
        next(r.iter_raw())
    record = r.extensions["ratequeue"]
    assert record.settled and record.usage is None
    est = record.estimate.tokens
    assert lim.available("tokens") == pytest.approx(10_000 - est)


def test_error_status_and_connection_error_charge_no_tokens(mod: Any) -> None:
    lim = limiter()
    rec = Recorder(mod, lambda req: mod.Response(400, json={"error": "bad"}))
    r = chat(client(mod, rec, lim), max_tokens=100)
    assert r.status_code == 400 and r.extensions["ratequeue"].settled
    assert lim.available("tokens") == pytest.approx(10_000)

    def boom(req: Any) -> Any:
        raise mod.ConnectError("down", request=req)

    with pytest.raises(mod.ConnectError):
        chat(client(mod, Recorder(mod, boom), lim), max_tokens=100)
    assert lim.available("tokens") == pytest.approx(10_000)
    assert lim.available() == pytest.approx(3)  # both requests stay counted


# -- 429, calibration, headers -----------------------------------------------------------------


def test_429_puts_the_limiter_in_debt_until_the_reset(mod: Any) -> None:
    clock = rq.ManualClock()
    lim = limiter(clock)
    rec = Recorder(mod, lambda req: mod.Response(429, headers={"retry-after": "30"}, json={}))
    r = chat(client(mod, rec, lim))
    assert r.status_code == 429
    # The SDK is told to retry at once: its retry waits in the queue instead.
    assert r.headers["retry-after-ms"] == "1" and r.headers["x-should-retry"] == "true"
    assert r.headers["x-ratequeue-original-retry-after"] == "30"
    assert not lim.try_acquire(tokens=1)
    assert lim.retry_after(tokens=1) == pytest.approx(30, abs=1e-6)
    clock.advance(29.9)
    assert not lim.try_acquire(tokens=1)
    clock.advance(0.1)
    assert lim.try_acquire(tokens=1)
    assert lim.available("tokens") == pytest.approx(10_000 - 1)  # tokens were refunded


def test_429_then_a_bounded_wait_refuses_at_once(mod: Any) -> None:
    lim = limiter()
    rec = Recorder(mod, lambda req: mod.Response(429, headers={"retry-after-ms": "5000"}, json={}))
    c = client(mod, rec, lim, timeout=1.0)
    chat(c)
    with pytest.raises(rq.Overloaded) as e:
        chat(c)
    assert e.value.retry_after == pytest.approx(4.0, abs=0.01)
    assert len(rec.sent) == 1  # the second call was never sent


def test_429_without_headers_pauses_default_and_caps_hostile_resets(mod: Any) -> None:
    clock = rq.ManualClock()
    lim = limiter(clock)
    c = client(mod, Recorder(mod, lambda req: mod.Response(429, json={})), lim, default_pause=2.0)
    chat(c)
    assert lim.retry_after(tokens=1) == pytest.approx(2.0, abs=1e-6)
    lim2 = limiter(clock)
    hostile = Recorder(mod, lambda req: mod.Response(429, headers={"retry-after": "1e9"}, json={}))
    chat(client(mod, hostile, lim2, max_pause=60.0))
    assert lim2.retry_after(tokens=1) == pytest.approx(60.0, abs=1e-6)


def test_exhausted_quota_pauses_its_unit(mod: Any) -> None:
    clock = rq.ManualClock()
    lim = limiter(clock)
    headers = {
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "10s",
        "x-ratelimit-remaining-requests": "40",
    }
    rec = Recorder(mod, lambda req: mod.Response(200, headers=headers, json=usage_body()))
    chat(client(mod, rec, lim))
    assert lim.available() > 0
    assert lim.available("tokens") < 0
    assert not lim.try_acquire(tokens=1)
    clock.advance(10)
    assert lim.try_acquire(tokens=1)


def test_calibration_only_when_asked(mod: Any) -> None:
    headers = {"x-ratelimit-limit-requests": "30", "x-ratelimit-limit-tokens": "9000"}
    rec = Recorder(mod, lambda req: mod.Response(200, headers=headers, json=usage_body()))
    lim = limiter()
    chat(client(mod, rec, lim))
    assert [r.amount for r in lim.rates] == [60, 60_000]
    t = RateLimitedTransport(mod.MockTransport(rec), lim, calibrate=True)
    c = mod.Client(transport=t, base_url="http://provider")
    chat(c)
    chat(c)
    assert [(r.amount, r.per) for r in lim.rates] == [(30, 60), (9000, 60)]
    assert t.stats()["calibrated"] == 2  # set once, not on every response


def test_ietf_policy_calibrates_requests(mod: Any) -> None:
    headers = {"RateLimit-Policy": '"default";q=10;w=1', "RateLimit": '"default";r=9;t=1'}
    rec = Recorder(mod, lambda req: mod.Response(200, headers=headers, json=usage_body()))
    lim = limiter()
    chat(client(mod, rec, lim, calibrate=True))
    assert (lim.rates[0].amount, lim.rates[0].per) == (10, 1)


def test_malformed_headers_are_not_fatal(mod: Any) -> None:
    headers = {
        "retry-after": "soon",
        "x-ratelimit-reset-requests": "forever",
        "anthropic-ratelimit-tokens-reset": "x" * 100_000,
        "RateLimit": ";;;",
    }
    rec = Recorder(mod, lambda req: mod.Response(429, headers=headers, json={}))
    lim = limiter()
    assert chat(client(mod, rec, lim, default_pause=1.0)).status_code == 429
    assert lim.retry_after(tokens=1) == pytest.approx(1.0, abs=1e-6)


# -- queue, priority, bounded wait -----------------------------------------------------------


def test_priority_from_header_or_context(mod: Any) -> None:
    lim = limiter(classes={"interactive": 8, "batch": 1})
    rec = Recorder(mod)
    c = client(mod, rec, lim)
    chat(c, headers={"x-ratequeue-priority": "batch"})
    assert "x-ratequeue-priority" not in rec.sent[-1].headers
    with using(priority="interactive"):
        r = chat(c)
    assert r.extensions["ratequeue"].priority == "interactive"
    assert lim.wait_histogram("batch").count == 1  # each call went to its class
    assert lim.wait_histogram("interactive").count == 1
    t = c._transport
    assert t.wait_histogram.count == 2 and t.http_histogram.count == 2


def test_full_limiter_with_no_wait_sends_nothing(mod: Any) -> None:
    lim = limiter()
    assert lim.try_acquire(5, tokens=1)
    rec = Recorder(mod)
    ledger = FakeLedger()
    c = client(mod, rec, lim, timeout=0, ledger=ledger)
    with CallBudget(calls=1) as b:
        with pytest.raises(rq.Overloaded):
            chat(c)
        assert b.calls_used == 0 and b.tokens_used == 0  # given back: nothing was sent
    assert rec.sent == [] and ledger.released == [ledger.held[0][0]]


def test_a_waiting_call_is_granted_later_and_records_its_wait(mod: Any) -> None:
    # Real time (the record measures it): a 0.5 s wait, with room for a loaded machine.
    lim = rq.Limiter(rq.Rate(2, per="second", burst=1))
    rec = Recorder(mod)
    c = client(mod, rec, lim)
    chat(c)
    r = chat(c)
    assert 0.1 < r.extensions["ratequeue"].waited < 5
    assert c._transport.http_histogram.count == 2


# -- budgets ----------------------------------------------------------------------------------


def test_budget_counts_calls_and_refuses_before_sending(mod: Any) -> None:
    rec = Recorder(mod)
    c = client(mod, rec, limiter())
    with CallBudget(calls=2) as b:
        chat(c)
        chat(c)
        with pytest.raises(BudgetExceeded) as e:
            chat(c)
    assert e.value.budget is b and len(rec.sent) == 2
    assert [s.tokens for s in b.usage] == [12, 12] and b.calls_used == 2


def test_budget_tokens_reserve_the_estimate_then_settle(mod: Any) -> None:
    rec = Recorder(mod)
    c = client(mod, rec, limiter())
    with CallBudget(tokens=1_000) as b:
        chat(c, max_tokens=900)  # estimate ~ 906, real 12
        assert b.tokens_used == 12
        with pytest.raises(BudgetExceeded):
            chat(c, max_tokens=990)
        chat(c, max_tokens=100)
    assert len(rec.sent) == 2


def test_budgets_nest_and_cross_tasks_and_threads(mod: Any) -> None:
    rec = Recorder(mod)
    c = client(mod, rec, limiter())
    with CallBudget(calls=3) as outer:
        with CallBudget(calls=5) as inner:
            assert inner.parent is outer
            chat(c)
            ctx = contextvars.copy_context()
            th = threading.Thread(target=ctx.run, args=(chat, c))
            th.start()
            th.join()
            chat(c)
            with pytest.raises(BudgetExceeded) as e:
                chat(c)
            assert e.value.budget is outer
        assert inner.calls_used == 3 and outer.calls_used == 3
    assert len(rec.sent) == 3


def test_budget_across_asyncio_tasks(mod: Any) -> None:
    rec = Recorder(mod)
    lim = limiter()

    async def main() -> tuple[list[Any], CallBudget]:
        t = RateLimitedTransport(mod.MockTransport(rec), lim)
        async with mod.AsyncClient(transport=t, base_url="http://p") as c, CallBudget(calls=3) as b:
            body = {"model": "m", "messages": []}
            out = await asyncio.gather(
                *(c.post(CHAT, json=body) for _ in range(4)), return_exceptions=True
            )
        return out, b

    out, b = asyncio.run(main())
    assert sum(isinstance(x, BudgetExceeded) for x in out) == 1
    assert b.calls_used == 3 and len(rec.sent) == 3


def test_429_does_not_use_the_budget(mod: Any) -> None:
    rec = Recorder(mod, lambda req: mod.Response(429, headers={"retry-after-ms": "1"}, json={}))
    c = client(mod, rec, limiter())
    with CallBudget(calls=1) as b:
        chat(c)
        assert b.calls_used == 0


# -- ledger -----------------------------------------------------------------------------------


class FakeLedger:
    def __init__(self) -> None:
        self.held: list[tuple[str, str, dict[str, Any]]] = []
        self.settled: list[tuple[str, dict[str, Any]]] = []
        self.released: list[str] = []

    def hold(self, request_id: str, account: str, **kw: Any) -> None:
        self.held.append((request_id, account, kw))

    def settle(self, request_id: str, **kw: Any) -> None:
        self.settled.append((request_id, kw))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def test_ledger_holds_then_settles_with_the_idempotency_key(mod: Any) -> None:
    ledger = FakeLedger()
    rec = Recorder(mod)
    c = client(mod, rec, limiter(), ledger=ledger, account="acme")
    with CallBudget(id="task-1"):
        chat(c, headers={"Idempotency-Key": "req-42"}, max_tokens=50)
    rid, account, kw = ledger.held[0]
    assert (rid, account) == ("req-42", "acme")
    assert kw["parent_id"] == "task-1" and kw["output_tokens"] == 50 and kw["calls"] == 1
    assert kw["model"] == "gpt-x"
    assert ledger.settled == [
        ("req-42", {"input_tokens": 5, "output_tokens": 7, "calls": 1, "model": "gpt-x"})
    ]
    with using(account="other"):
        chat(c)
    assert ledger.held[1][1] == "other" and ledger.held[1][0].startswith("rq-")  # generated


def test_ledger_released_on_429_and_errors(mod: Any) -> None:
    ledger = FakeLedger()
    rec = Recorder(mod, lambda req: mod.Response(429, json={}))
    chat(client(mod, rec, limiter(), ledger=ledger))
    assert ledger.released == [ledger.held[0][0]] and ledger.settled == []


def test_ledger_refusal_sends_nothing_and_gives_back(mod: Any) -> None:
    class Refusing(FakeLedger):
        def hold(self, request_id: str, account: str, **kw: Any) -> None:
            raise RuntimeError("quota exhausted")

    rec = Recorder(mod)
    lim = limiter()
    with CallBudget(calls=1) as b:
        with pytest.raises(RuntimeError, match="quota"):
            chat(client(mod, rec, lim, ledger=Refusing()))
        assert b.calls_used == 0
    assert rec.sent == [] and lim.available() == 5


# -- Policy and Pool ---------------------------------------------------------------------------


def test_policy_with_keys_and_upstream(mod: Any) -> None:
    clock = rq.ManualClock()
    cluster = limiter(clock)
    policy = rq.Policy(
        {"user": rq.KeyedLimiter(rq.Rate(2, per="minute"), clock=clock), "cluster": cluster}
    )
    rec = Recorder(
        mod, lambda req: mod.Response(200, headers={"retry-after": "5"}, json=usage_body())
    )
    c = client(mod, rec, policy, upstream=cluster, timeout=0)
    with using(keys={"user": "alice"}):
        chat(c)
        chat(c)
        with pytest.raises(rq.Overloaded):
            chat(c)
    assert len(rec.sent) == 2
    assert cluster.available("tokens") == pytest.approx(10_000 - 24)


def test_pool_routes_and_cools_down_on_429(mod: Any) -> None:
    clock = rq.ManualClock()
    pool = rq.Pool(
        [rq.Provider("a", rpm=60, clock=clock), rq.Provider("b", rpm=60, clock=clock)], clock=clock
    )

    def answer(req: Any) -> Any:
        if req.url.host == "a.example":
            return mod.Response(429, headers={"retry-after": "20"}, json={})
        return mod.Response(200, json=usage_body())

    rec = Recorder(mod, answer)
    c = client(mod, rec, pool, urls={"a": "http://a.example", "b": "http://b.example/base"})
    hosts = []
    for _ in range(3):
        r = chat(c)
        hosts.append((r.extensions["ratequeue"].provider, r.status_code))
    assert hosts[0] == ("a", 429) and all(h == ("b", 200) for h in hosts[1:])
    assert pool.cooldown_remaining("a") == pytest.approx(20)
    assert rec.sent[1].url.path == "/base" + CHAT
    assert rec.sent[0].headers["host"] == "a.example" and rec.sent[1].headers["host"] == "b.example"


# -- async ------------------------------------------------------------------------------------


def test_async_cancel_while_queued_gives_everything_back(mod: Any) -> None:
    lim = rq.Limiter(rq.Rate(1, per="minute", burst=1))
    ledger = FakeLedger()
    rec = Recorder(mod)

    async def main() -> CallBudget:
        t = RateLimitedTransport(mod.MockTransport(rec), lim, ledger=ledger)
        async with mod.AsyncClient(transport=t, base_url="http://p") as c, CallBudget() as b:
            await c.post(CHAT, json={})
            task = asyncio.create_task(c.post(CHAT, json={}))
            await asyncio.sleep(0.05)
            assert lim.waiting == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert lim.waiting == 0
        return b

    b = asyncio.run(main())
    assert len(rec.sent) == 1 and b.calls_used == 1 and len(ledger.released) == 1


def test_async_sse_settles(mod: Any) -> None:
    lim = limiter()

    class AStream(mod.AsyncByteStream):  # type: ignore[misc,name-defined]
        async def __aiter__(self) -> Any:
            start = {"type": "message_start", "message": {"usage": {"input_tokens": 20}}}
            yield b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n"
            delta = {"type": "message_delta", "usage": {"output_tokens": 9}}
            yield b"event: message_delta\ndata: " + json.dumps(delta).encode() + b"\n\n"
            yield b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

    rec = Recorder(
        mod,
        lambda req: mod.Response(
            200, headers={"content-type": "text/event-stream"}, stream=AStream()
        ),
    )

    async def main() -> Any:
        t = RateLimitedTransport(mod.MockTransport(rec), lim)
        async with mod.AsyncClient(transport=t, base_url="http://p") as c:
            r = await c.post(
                "/v1/messages",
                json={"model": "c", "max_tokens": 300, "messages": [], "stream": True},
            )
            return r.extensions["ratequeue"]

    record = asyncio.run(main())
    assert record.usage == (20, 9)
    assert lim.available("tokens") == pytest.approx(10_000 - 29)


def test_bad_arguments() -> None:
    import httpx

    lim = limiter()
    with pytest.raises(TypeError):
        RateLimitedTransport(object(), lim)
    with pytest.raises(TypeError):
        RateLimitedTransport(httpx.MockTransport(lambda r: None), "limiter")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RateLimitedTransport(httpx.MockTransport(lambda r: None), lim, timeout=-1)
    with pytest.raises(ValueError):
        RateLimitedTransport(httpx.MockTransport(lambda r: None), lim, urls={"a": "http://x"})
    with pytest.raises(TypeError):
        CallBudget(calls="3")  # type: ignore[arg-type]


def test_policy_concurrency_slot_is_held_until_the_body_is_read(mod: Any) -> None:
    clock = rq.ManualClock()
    cluster = limiter(clock)
    policy = rq.Policy({"inflight": rq.Concurrency(1, clock=clock), "cluster": cluster})
    event = b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    rec = Recorder(
        mod,
        lambda req: mod.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=SyncStream(mod, iter([event])),
        ),
    )
    c = client(mod, rec, policy, upstream=cluster, timeout=0)
    with c.stream("POST", CHAT, json={}) as r:
        with pytest.raises(rq.RateQueueError):
            chat(c)  # the slot is held while the first body is open
        r.read()
    chat(c)  # read and closed: the slot came back
    assert len(rec.sent) == 2


def test_a_huge_body_is_not_kept_and_keeps_the_estimate(mod: Any) -> None:
    big = (
        b'{"pad": "'
        + b"x" * (3 << 20)
        + b'", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
    )

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    lim = limiter()
    rec = Recorder(mod, lambda req: mod.Response(200, stream=SyncStream(mod, chunks())))
    c = client(mod, rec, lim, max_body=1 << 20)
    with c.stream("POST", CHAT, json={"messages": [], "max_tokens": 100}) as r:
        for _ in r.iter_raw():
            pass
    record = r.extensions["ratequeue"]
    assert record.settled and record.usage is None  # too big to read: the estimate stays
    assert lim.available("tokens") == pytest.approx(10_000 - record.estimate.tokens)


def test_budget_is_exact_under_threads(mod: Any) -> None:
    rec = Recorder(mod)
    c = client(mod, rec, limiter(burst=1_000))
    refused = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(10):
            try:
                chat(c)
            except BudgetExceeded:
                with lock:
                    refused.append(1)

    with CallBudget(calls=50) as b:
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(worker,))
            for _ in range(8)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert (b.calls_used, len(rec.sent), len(refused)) == (50, 50, 30)


@settings(max_examples=200, deadline=None)
@given(
    asked=st.one_of(st.none(), st.integers(0, 10**6), st.text(max_size=3), st.booleans()),
    cap=st.integers(1, 10**5),
    field=st.sampled_from(["max_tokens", "max_completion_tokens", "max_output_tokens"]),
)
def test_caps_never_raise_and_always_bound(asked: Any, cap: int, field: str) -> None:
    body: dict[str, Any] = {"model": "m"} if asked is None else {"model": "m", field: asked}
    done = apply_caps([Cap(cap)], body, "/v1/chat/completions", None)
    sent = [
        body[f] for f in ("max_tokens", "max_completion_tokens", "max_output_tokens") if f in body
    ]
    assert sent and all(isinstance(v, int) and v <= cap for v in sent)
    if isinstance(asked, int) and not isinstance(asked, bool) and asked <= cap:
        assert body[field] == asked and done is None  # a smaller value is never raised


def test_a_burst_lowered_since_is_clamped_again(mod: Any) -> None:
    lim = limiter()
    c = client(mod, Recorder(mod), lim)
    lim.set_rate(60_000, per="minute", burst=500, which="tokens")  # by hand, after the transport
    r = chat(c, max_tokens=5_000)  # the estimate would exceed the new burst
    assert r.status_code == 200
    assert lim.available("tokens") == pytest.approx(500 - 12)


def test_calibration_lowers_the_clamp_with_the_burst(mod: Any) -> None:
    headers = {"x-ratelimit-limit-tokens": "900"}
    rec = Recorder(mod, lambda req: mod.Response(200, headers=headers, json=usage_body()))
    lim = limiter(burst=100)
    c = client(mod, rec, lim, calibrate=True, timeout=0)
    chat(c)
    assert lim.rates[1].burst == 900
    with pytest.raises(rq.Overloaded):  # clamped to 900, 888 left: waits (not CostTooLarge)
        chat(c, max_tokens=5_000)


def test_a_stream_cut_before_its_final_usage_keeps_the_estimate(mod: Any) -> None:
    start = {
        "type": "message_start",
        "message": {"usage": {"input_tokens": 20, "output_tokens": 1}},
    }
    events = [
        b"data: " + json.dumps(start).encode() + b"\n\n",
        b'data: {"type":"content_block_delta"}\n\n',
    ]
    lim = limiter()
    rec = Recorder(
        mod,
        lambda req: mod.Response(
            200, headers={"content-type": "text/event-stream"}, stream=SyncStream(mod, iter(events))
        ),
    )
    r = client(mod, rec, lim).post("/v1/messages", json={"messages": [], "max_tokens": 300})
    record = r.extensions["ratequeue"]
    assert record.settled and record.usage is None
    assert lim.available("tokens") == pytest.approx(10_000 - record.estimate.tokens)
