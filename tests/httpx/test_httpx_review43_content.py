"""Review of 216e363 (a body read ahead becomes the response's ``_content``): what a user
of httpx / httpx2 / the SDKs sees differ from a bare transport (and from before the
change, whose replay was read through httpx's own read and so closed the response).

Every test compares against what a bare ``HTTPTransport`` does for the same call; each
fails on the read-ahead path only (2xx JSON with one Content-Length, native settle)."""

from __future__ import annotations

import asyncio
import gc
import importlib
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from opentelemetry.trace import StatusCode
from ratequeue.httpx import RateLimitedTransport
from ratequeue.testing import MockProvider
from test_httpx_read_ahead import roomy, socket_mock

pytestmark = pytest.mark.timeout(30)

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 7}
LIBS = ["httpx", "httpx2"]


limiter = roomy


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    yield from socket_mock()


def _transport(mod: Any, is_async: bool) -> RateLimitedTransport:
    inner = mod.AsyncHTTPTransport() if is_async else mod.HTTPTransport()
    return RateLimitedTransport(inner, limiter())


# -- 1. a response sent without stream mode is left open and "unconsumed" ----------------


@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("is_async", [False, True])
def test_a_non_stream_response_is_closed_and_consumed(
    mock: MockProvider, name: str, is_async: bool
) -> None:
    """httpx's ``send(stream=False)`` reads the body through ``iter_raw``, which closes the
    response: ``is_closed`` and ``is_stream_consumed`` are True (bare transport, and this
    transport before 216e363). Now ``read()`` returns the preset ``_content`` at once and
    nothing closes the response: both stay False."""
    mod = importlib.import_module(name)
    t = _transport(mod, is_async)

    async def go() -> Any:
        async with mod.AsyncClient(transport=t) as c:
            return await c.post(mock.url, json=BODY)

    if is_async:
        r = asyncio.run(go())
    else:
        with mod.Client(transport=t) as c:
            r = c.post(mock.url, json=BODY)
    assert r.extensions["ratequeue"].settled
    assert (r.is_closed, r.is_stream_consumed) == (True, True)


# -- 2. stream mode: reading to the end no longer closes the response ---------------------


@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("way", ["iter_bytes", "iter_text", "iter_lines", "read"])
def test_stream_mode_read_to_its_end_closes_the_response(
    mock: MockProvider, name: str, way: str
) -> None:
    """httpx: ``close()`` is "automatically called if the response body is read to
    completion". With ``_content`` preset, ``iter_bytes`` / ``iter_text`` / ``iter_lines``
    / ``read`` serve it from memory and never reach ``iter_raw``'s closing ``finally``: a
    ``send(stream=True)`` response read whole stays open (and, httpx, its ``elapsed`` is
    then timed by whatever later close, not the end of the read)."""
    mod = importlib.import_module(name)
    with mod.Client(transport=_transport(mod, False)) as c:
        r = c.send(c.build_request("POST", mock.url, json=BODY), stream=True)
        try:
            got = getattr(r, way)()
            if way != "read":
                list(got)
            assert r.is_closed
        finally:
            r.close()


@pytest.mark.parametrize("name", LIBS)
def test_async_stream_mode_aread_closes_the_response(mock: MockProvider, name: str) -> None:
    """The asyncio form of the test above (``aread`` in stream mode)."""
    mod = importlib.import_module(name)

    async def go() -> bool:
        async with mod.AsyncClient(transport=_transport(mod, True)) as c:
            r = await c.send(c.build_request("POST", mock.url, json=BODY), stream=True)
            try:
                await r.aread()
                return bool(r.is_closed)
            finally:
                await r.aclose()

    assert asyncio.run(go())


# -- 3. num_bytes_downloaded: httpx's download-progress idiom shows nothing ---------------


@pytest.mark.parametrize("name", LIBS)
def test_stream_mode_download_progress_counts_the_body(mock: MockProvider, name: str) -> None:
    """httpx's documented progress idiom (``num_bytes_downloaded`` sampled before and
    during ``iter_bytes``) sums to the body's size with a bare transport. The read-ahead now
    presets ``_num_bytes_downloaded`` to the whole length before the consumer reads, and
    ``iter_bytes`` over ``_content`` never updates it: the progress made is 0."""
    mod = importlib.import_module(name)
    with (
        mod.Client(transport=_transport(mod, False)) as c,
        c.stream("POST", mock.url, json=BODY) as r,
    ):
        total = int(r.headers["content-length"])
        seen = r.num_bytes_downloaded
        progress = 0
        for _chunk in r.iter_bytes(chunk_size=16):
            progress += r.num_bytes_downloaded - seen
            seen = r.num_bytes_downloaded
    assert progress == total


# -- 4. elapsed ----------------------------------------------------------------------------


@pytest.mark.parametrize("is_async", [False, True])
def test_httpx_elapsed_is_not_changed_by_a_later_close(mock: MockProvider, is_async: bool) -> None:
    """httpx (0.x): a non-stream response is closed by the client's read, so a later
    ``close()`` is a no-op and ``elapsed`` stays what it was. Left open now, a later close
    runs ``BoundSyncStream.close``, which overwrites ``elapsed`` with the time up to that
    close (here +0.3 s): ``elapsed`` changes after the call returned."""
    mod = importlib.import_module("httpx")
    t = _transport(mod, is_async)

    async def go() -> tuple[float, float]:
        async with mod.AsyncClient(transport=t) as c:
            r = await c.post(mock.url, json=BODY)
            before = r.elapsed.total_seconds()
            await asyncio.sleep(0.3)
            await r.aclose()
            return before, r.elapsed.total_seconds()

    if is_async:
        before, after = asyncio.run(go())
    else:
        with mod.Client(transport=t) as c:
            r = c.post(mock.url, json=BODY)
            before = r.elapsed.total_seconds()
            time.sleep(0.3)
            r.close()
            after = r.elapsed.total_seconds()
    assert after == before


def test_httpx2_stream_mode_elapsed_is_timed_by_the_close(mock: MockProvider) -> None:
    """httpx2 reads ``elapsed`` from the bound stream (timed at the close) unless the
    response has ``_elapsed`` of its own. The read ahead now sets ``_elapsed``, so in
    stream mode a response held open 0.3 s before its close reports the read-ahead time
    (~ms) instead: httpx2 differs from httpx (whose close overwrites it) and from a bare
    transport, contrary to the commit's own "in stream mode ... the close times it"."""
    mod = importlib.import_module("httpx2")
    with (
        mod.Client(transport=_transport(mod, False)) as c,
        c.stream("POST", mock.url, json=BODY) as r,
    ):
        time.sleep(0.3)
    assert r.elapsed.total_seconds() >= 0.3


# -- 5. SDKs: code that branches on is_closed ----------------------------------------------


def _fake_tracer_provider() -> Any:
    """A minimal recording OpenTelemetry TracerProvider (the API only is installed)."""
    from opentelemetry.trace import Span, SpanContext, TraceFlags, Tracer, TracerProvider

    class FakeSpan(Span):
        def __init__(self, name: str, attributes: Any = None) -> None:
            self.name, self.attributes = name, dict(attributes or {})
            self.status: Any = None
            self.ended = False
            self._ctx = SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(1))

        def end(self, end_time: Any = None) -> None:
            self.ended = True

        def get_span_context(self) -> Any:
            return self._ctx

        def set_attributes(self, attributes: Any) -> None:
            self.attributes.update(attributes)

        def set_attribute(self, key: str, value: Any) -> None:
            self.attributes[key] = value

        def add_event(self, name: str, attributes: Any = None, timestamp: Any = None) -> None:
            pass

        def update_name(self, name: str) -> None:
            self.name = name

        def is_recording(self) -> bool:
            return not self.ended

        def set_status(self, status: Any, description: Any = None) -> None:
            self.status = status

        def record_exception(self, *a: Any, **k: Any) -> None:
            pass

    class FakeTracer(Tracer):
        def __init__(self) -> None:
            self.spans: list[FakeSpan] = []

        def start_span(self, name: str, *a: Any, attributes: Any = None, **k: Any) -> Any:
            s = FakeSpan(name, attributes)
            self.spans.append(s)
            return s

        def start_as_current_span(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError

    class FakeProvider(TracerProvider):
        def __init__(self) -> None:
            self.tracer = FakeTracer()

        def get_tracer(self, *a: Any, **k: Any) -> Any:
            return self.tracer

    return FakeProvider()


@pytest.mark.parametrize("raw", [False, True], ids=["create", "with_raw_response"])
@pytest.mark.parametrize("is_async", [False, True])
def test_anthropic_tracing_span_ends_ok_with_the_response(
    mock: MockProvider, raw: bool, is_async: bool
) -> None:
    """anthropic's OpenTelemetry tracing ends a call's span at once with status OK and the
    response's attributes when ``response.is_closed`` (the body was read); otherwise it
    wraps the body's stream and waits for a read/close/drop that never sets OK. Under the
    transport a read-ahead response is left open: ``messages.create``'s span ends (on the
    response's garbage collection) with status UNSET; ``with_raw_response``'s stays open
    after the call returns and lacks ``gen_ai.response.id`` and the usage attributes."""

    prov = _fake_tracer_provider()
    kw = {"model": "m", "max_tokens": 7, "messages": [{"role": "user", "content": "hi"}]}

    def check(keep: Any) -> None:
        gc.collect()
        span = prov.tracer.spans[-1]
        assert span.ended, "the call's span is still open after the call returned"
        assert span.status is not None and span.status.status_code == StatusCode.OK
        assert span.attributes.get("gen_ai.response.id", "").startswith("msg_")
        assert span.attributes.get("gen_ai.usage.output_tokens") == 5

    if is_async:

        async def go() -> None:
            t = _transport(httpx2, True)
            async with httpx2.AsyncClient(transport=t) as hc:
                client = anthropic.AsyncAnthropic(
                    api_key="k",
                    base_url=mock.base_url,
                    http_client=hc,
                    open_telemetry={"tracer_provider": prov},
                    max_retries=0,
                )
                m = client.messages
                got = await (m.with_raw_response.create(**kw) if raw else m.create(**kw))
                check(got)

        asyncio.run(go())
    else:
        t = _transport(httpx2, False)
        with httpx2.Client(transport=t) as hc:
            client = anthropic.Anthropic(
                api_key="k",
                base_url=mock.base_url,
                http_client=hc,
                open_telemetry={"tracer_provider": prov},
                max_retries=0,
            )
            m = client.messages
            got = m.with_raw_response.create(**kw) if raw else m.create(**kw)
            check(got)


def test_openai_raw_response_reports_its_body_read(mock: MockProvider) -> None:
    """openai's ``LegacyAPIResponse.is_closed``: "If this is False then there is response
    data that has not been read yet. You must either fully consume the response body or
    call ``.close()``". A ``with_raw_response`` call (sent without stream mode, its body
    read) says True with a bare transport; under the transport it says False."""
    with httpx2.Client(transport=_transport(httpx2, False)) as hc:
        client = openai.OpenAI(
            api_key="k", base_url=mock.base_url + "/v1", http_client=hc, max_retries=0
        )
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=7
        )
        assert raw.parse().usage.completion_tokens == 5
        assert raw.is_closed
