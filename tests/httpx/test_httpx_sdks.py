"""The real openai and anthropic SDKs through RateLimitedTransport to the loopback mock."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
import ratequeue as rq
from ratequeue.httpx import BudgetExceeded, CallBudget, RateLimitedTransport
from ratequeue.testing import MockProvider

pytestmark = pytest.mark.timeout(120)

MSG = [{"role": "user", "content": "say ok " * 10}]


@pytest.fixture
def mock() -> Iterator[MockProvider]:
    with MockProvider(60_000, tpm=10_000_000, gen_time=0.0, output_tokens=3) as m:
        yield m


def big_limiter() -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(60_000, per="minute", burst=100),
        rq.Rate(1_000_000, per="minute", burst=100_000, unit="tokens"),
        clock=rq.ManualClock(),  # nothing refills: what is charged stays visible
    )


def real_limiter() -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(60_000, per="minute", burst=100), rq.Rate(10**7, per="minute", unit="tokens")
    )


def oa(mock: MockProvider, t: RateLimitedTransport | None, **kw: Any) -> openai.OpenAI:
    http = httpx2.Client(transport=t) if t is not None else httpx2.Client()
    return openai.OpenAI(api_key="k", base_url=mock.base_url + "/v1", http_client=http, **kw)


def an(mock: MockProvider, t: RateLimitedTransport, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="k", base_url=mock.base_url, http_client=httpx2.Client(transport=t), **kw
    )


def test_openai_sync_chat_and_responses_settle_real_usage(mock: MockProvider) -> None:
    lim = big_limiter()
    t = RateLimitedTransport(httpx2.HTTPTransport(), lim)
    client = oa(mock, t)
    with CallBudget(calls=4) as b:
        r = client.chat.completions.create(model="gpt", messages=MSG, max_completion_tokens=500)
        stream = client.chat.completions.create(model="gpt", messages=MSG, stream=True)
        chunks = list(stream)
        resp = client.responses.create(model="gpt", input="hello there", max_output_tokens=200)
        events = [ev.type for ev in client.responses.create(model="gpt", input="hi", stream=True)]
    assert r.usage is not None and resp.usage is not None
    assert chunks[-1].usage is not None  # the transport asked for the usage chunk
    assert events[-1] == "response.completed"
    used = [(s.input_tokens, s.output_tokens) for s in b.usage]
    assert used[0] == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert used[1] == (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)
    assert used[2] == (resp.usage.input_tokens, resp.usage.output_tokens)
    assert all(s.settled and s.status == 200 for s in b.usage)
    assert lim.available("tokens") == pytest.approx(100_000 - sum(map(sum, used)), abs=5)
    assert mock.stats()["requests"] == 4


def test_openai_over_legacy_httpx_client(mock: MockProvider) -> None:
    t = RateLimitedTransport(httpx.HTTPTransport(), big_limiter())
    client = openai.OpenAI(
        api_key="k", base_url=mock.base_url + "/v1", http_client=httpx.Client(transport=t)
    )
    with CallBudget() as b:
        client.chat.completions.create(model="gpt", messages=MSG)
        list(client.chat.completions.create(model="gpt", messages=MSG, stream=True))
    assert [s.output_tokens for s in b.usage] == [3, 3]


def test_anthropic_sync_messages_and_stream(mock: MockProvider) -> None:
    lim = big_limiter()
    client = an(mock, RateLimitedTransport(httpx2.HTTPTransport(), lim))
    with CallBudget() as b:
        m = client.messages.create(model="claude", max_tokens=100, messages=MSG)
        with client.messages.stream(model="claude", max_tokens=100, messages=MSG) as s:
            final = s.get_final_message()
    assert [(x.input_tokens, x.output_tokens) for x in b.usage] == [
        (m.usage.input_tokens, m.usage.output_tokens),
        (final.usage.input_tokens, final.usage.output_tokens),
    ]


@pytest.mark.parametrize("http", ["httpx", "httpx2"])
def test_a_break_out_of_an_sdk_stream_gives_its_slot_back(mock: MockProvider, http: str) -> None:
    """``for chunk in stream: break``, the stream never closed: once it is collected its
    call is settled (the SDK's next call is let into the Policy's one slot)."""
    import gc

    from ratequeue.httpx._unclosed import DROPPED

    lim = big_limiter()
    policy = rq.Policy({"conc": rq.Concurrency(1), "cluster": lim})
    mod = httpx if http == "httpx" else httpx2
    t = RateLimitedTransport(
        mod.HTTPTransport(), policy, upstream=lim, units=["requests", "tokens"], timeout=0.0
    )
    o = openai.OpenAI(
        api_key="k", base_url=mock.base_url + "/v1", http_client=mod.Client(transport=t)
    )
    with CallBudget() as b:
        for _ in o.chat.completions.create(model="gpt", messages=MSG, stream=True):
            break
        gc.collect()
        assert DROPPED.flush(10)
        if http == "httpx2":  # the anthropic SDK takes only an httpx2 client
            a = anthropic.Anthropic(
                api_key="k", base_url=mock.base_url, http_client=mod.Client(transport=t)
            )
            for _ in a.messages.create(model="claude", max_tokens=50, messages=MSG, stream=True):
                break
            gc.collect()
            assert DROPPED.flush(10)
        r = o.chat.completions.create(model="gpt", messages=MSG)
    dropped = 1 + (http == "httpx2")
    assert r.usage is not None
    assert len(b.usage) == dropped + 1 and all(s.settled for s in b.usage)
    # httpx2 closes a response as its iterator goes (settled then, or by the settling
    # thread when the iterator goes in a garbage collection); httpx never does.
    assert (http == "httpx") <= t.stats()["unclosed"] <= dropped


def test_async_sdks_stream_and_settle(mock: MockProvider) -> None:
    lim = big_limiter()

    async def main() -> CallBudget:
        t = RateLimitedTransport(httpx2.AsyncHTTPTransport(), lim)
        http = httpx2.AsyncClient(transport=t)
        o = openai.AsyncOpenAI(api_key="k", base_url=mock.base_url + "/v1", http_client=http)
        a = anthropic.AsyncAnthropic(api_key="k", base_url=mock.base_url, http_client=http)
        async with CallBudget(calls=4) as b:
            await o.chat.completions.create(model="gpt", messages=MSG)
            async for _ in await o.chat.completions.create(model="gpt", messages=MSG, stream=True):
                pass
            await a.messages.create(model="claude", max_tokens=50, messages=MSG)
            async for _ in await a.messages.create(
                model="claude", max_tokens=50, messages=MSG, stream=True
            ):
                pass
            with pytest.raises(BudgetExceeded):
                await o.chat.completions.create(model="gpt", messages=MSG)
        await http.aclose()
        return b

    b = asyncio.run(main())
    assert len(b.usage) == 4 and all(s.settled and s.output_tokens == 3 for s in b.usage)
    assert mock.stats()["requests"] == 4  # the fifth call was never sent


def test_openai_background_responses_are_charged_once(mock: MockProvider) -> None:
    """``background=True``: created queued, retrieved until completed, or cancelled; each
    response's usage is charged once, on its creation, and the polls nothing."""
    lim = big_limiter()
    t = RateLimitedTransport(httpx2.HTTPTransport(), lim)
    client = oa(mock, t)
    with CallBudget(calls=10) as b:
        first = client.responses.create(model="gpt", input="hello there", background=True)
        assert first.status == "queued" and first.usage is None
        assert t.stats()["background"] == 1
        done = client.responses.retrieve(first.id)
        while done.status != "completed":
            done = client.responses.retrieve(done.id)
        second = client.responses.create(model="gpt", input="and again", background=True)
        cancelled = client.responses.cancel(second.id)
        client.responses.retrieve(first.id)  # once more: nothing
    assert done.usage is not None and cancelled.usage is not None
    used = [(s.input_tokens, s.output_tokens) for s in b.usage]
    first_used = (done.usage.input_tokens, done.usage.output_tokens)
    second_used = (cancelled.usage.input_tokens, cancelled.usage.output_tokens)
    assert used == [first_used, (0, 0), (0, 0), second_used, (0, 0), (0, 0)]
    assert all(s.settled for s in b.usage) and t.stats()["background"] == 0
    assert lim.available("tokens") == 100_000 - sum(first_used) - sum(second_used)


def test_async_openai_background_response_is_charged_once(mock: MockProvider) -> None:
    lim = big_limiter()

    async def main() -> tuple[Any, RateLimitedTransport]:
        t = RateLimitedTransport(httpx2.AsyncHTTPTransport(), lim)
        async with httpx2.AsyncClient(transport=t) as http:
            o = openai.AsyncOpenAI(api_key="k", base_url=mock.base_url + "/v1", http_client=http)
            r = await o.responses.create(model="gpt", input="hello there", background=True)
            while r.status != "completed":
                r = await o.responses.retrieve(r.id)
        return r, t

    r, t = asyncio.run(main())
    assert r.usage is not None and t.stats()["background"] == 0
    assert lim.available("tokens") == 100_000 - r.usage.input_tokens - r.usage.output_tokens


def test_budget_exceeded_comes_out_of_the_sdks_unwrapped(mock: MockProvider) -> None:
    t = RateLimitedTransport(httpx2.HTTPTransport(), big_limiter())
    o, a = oa(mock, t), an(mock, t)
    with CallBudget(calls=1):
        o.chat.completions.create(model="gpt", messages=MSG)
        with pytest.raises(BudgetExceeded):
            o.chat.completions.create(model="gpt", messages=MSG)
        with pytest.raises(BudgetExceeded):
            a.messages.create(model="claude", max_tokens=5, messages=MSG)
    assert mock.stats()["requests"] == 1


@pytest.mark.parametrize("retry_style", ["both", "seconds", "ms", "date"])
def test_sdk_retry_after_429_waits_in_the_queue(retry_style: str) -> None:
    with MockProvider(60_000, gen_time=0.0, retry_style=retry_style) as mock:
        t = RateLimitedTransport(httpx2.HTTPTransport(), real_limiter())
        mock.fail_next(1, retry_after=0.4)
        t0 = time.monotonic()
        r = oa(mock, t, max_retries=3).chat.completions.create(model="gpt", messages=MSG)
        took = time.monotonic() - t0
        stats = mock.stats()
    assert r.choices[0].message.content == "ok"
    assert (stats["requests"], stats["ok"], stats["retried"]) == (2, 1, 1)
    # the provider's wait (0.4 s; whole seconds where only Retry-After says it) was spent
    # in the queue, not in the SDK's sleep
    assert took >= 0.35
    assert t.wait_histogram.max >= 0.3
    assert t.stats()["paused"] == 1


def test_calls_during_the_pause_wait_in_the_queue_instead_of_sending() -> None:
    with MockProvider(60_000, gen_time=0.0, dialect="anthropic") as mock:
        t = RateLimitedTransport(httpx2.HTTPTransport(), real_limiter())
        client = an(mock, t, max_retries=3)
        mock.fail_next(1, retry_after=0.5)
        client.messages.create(model="c", max_tokens=5, messages=MSG)  # 429, then queued retry
        errors: list[BaseException] = []

        def call() -> None:
            try:
                client.messages.create(model="c", max_tokens=5, messages=MSG)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        mock.fail_next(1, retry_after=0.5)
        threads = [threading.Thread(target=call) for _ in range(6)]
        threads[0].start()
        time.sleep(0.2)  # the first call got its 429: the limiter is paused
        for th in threads[1:]:
            th.start()
        for th in threads:
            th.join()
        stats = mock.stats()
    assert not errors
    # 7 successes, 2 refusals injected: nothing else was sent during the pauses
    assert (stats["ok"], stats["rate_limited"]) == (7, 2)


def _burst(mock: MockProvider, transport: Any, n: int) -> tuple[int, int, float]:
    """n concurrent SDK calls; (requests the provider saw, successes, p99 latency)."""
    client = openai.OpenAI(
        api_key="k",
        base_url=mock.base_url + "/v1",
        max_retries=50,
        http_client=httpx2.Client(transport=transport),
    )
    lat: list[float] = []
    lock = threading.Lock()

    def call() -> None:
        t0 = time.monotonic()
        client.chat.completions.create(model="gpt", messages=MSG)
        with lock:
            lat.append(time.monotonic() - t0)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = mock.stats()
    lat.sort()
    return s["requests"], s["ok"], lat[-1]


def test_queue_sends_fewer_calls_per_success_than_the_sdk_retry_loop() -> None:
    n = 8
    with MockProvider(600, burst=1, gen_time=0.0) as mock:
        sent, ok, _ = _burst(mock, httpx2.HTTPTransport(), n)
        sdk_ratio = sent / ok
    with MockProvider(600, burst=1, gen_time=0.0) as mock:
        # at half the provider's rate (200 against 100 ms apart): a wide real-time
        # tolerance (at 540/min, 11 ms of margin, it failed once in CI on a loaded machine;
        # at 400/min, 50 ms, once with both cores busy: a request held up that long reaches
        # the provider too close to the next)
        lim = rq.Limiter(rq.Rate(300, per="minute", burst=1))
        t = RateLimitedTransport(httpx2.HTTPTransport(), lim)
        sent, ok, _ = _burst(mock, t, n)
        queue_ratio = sent / ok
    assert ok == n
    assert sdk_ratio > 1.5  # the SDK alone: every waiter retries blind
    assert queue_ratio <= 1.25 < sdk_ratio


def test_calibration_from_the_providers_headers_learns_its_rate() -> None:
    with MockProvider(600, burst=1, gen_time=0.0) as mock:
        lim = rq.Limiter(rq.Rate(60_000, per="minute", burst=50))  # far too generous
        t = RateLimitedTransport(httpx2.HTTPTransport(), lim, calibrate=True)
        _, ok, _ = _burst(mock, t, 8)
    assert (lim.rates[0].amount, lim.rates[0].burst) == (600, 50)  # burst kept (<= the limit)
    assert ok == 8


def test_a_real_stream_passes_through_as_it_comes() -> None:
    with MockProvider(60_000, gen_time=0.0, stream_delay=0.3) as mock:
        lim = big_limiter()
        t = RateLimitedTransport(httpx2.HTTPTransport(), lim)
        with httpx2.Client(transport=t) as http:
            body = {"model": "c", "max_tokens": 50, "messages": MSG, "stream": True}
            t0 = time.monotonic()
            arrivals = []
            with http.stream("POST", mock.base_url + "/v1/messages", json=body) as r:
                for _ in r.iter_raw():
                    arrivals.append(time.monotonic() - t0)
            record = r.extensions["ratequeue"]
    # six events 0.3 s apart: the first reached the caller long before the last was sent
    assert arrivals[0] < arrivals[-1] - 0.6
    assert record.settled and record.usage == (record.usage.input_tokens, 2)
