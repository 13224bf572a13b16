"""ratequeue.asgi under a real uvicorn on loopback, with a real httpx client.

Header syntax is checked with http-sfv on every response; the stream test proves the
middleware passes the response through without buffering (the app only finishes its
stream after the client has read the first event and asked for the rest).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from asgi_helpers import Server, check_fields
from ratequeue.asgi import PROBLEM_TYPE


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("asgi_server_app:create") as s:
        yield s


def test_lifespan_reaches_the_app(server: Server) -> None:
    r = httpx.get(server.url + "/started")
    assert r.json() == {"started": True}
    assert "ratelimit" not in r.headers  # an exempt rule


def test_fields_on_every_response_and_429_per_forwarded_client(server: Server) -> None:
    with httpx.Client(base_url=server.url) as c:
        # uvicorn's peer is 127.0.0.1, a trusted proxy: the forwarded client is the key.
        replies = [c.get("/hello", headers={"x-forwarded-for": "198.51.100.1"}) for _ in range(4)]
        other = c.get("/hello", headers={"x-forwarded-for": "198.51.100.2"})
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    assert other.status_code == 200
    for r in [*replies, other]:
        policies, _limits = check_fields(r.headers.get)
        assert policies["user"]["q"] == 3 and policies["user"]["w"] == 60
        assert isinstance(policies["user"]["pk"], bytes)
    assert [check_fields(r.headers.get)[1]["user"]["r"] for r in replies] == [2, 1, 0, 0]
    refused = replies[3]
    assert refused.headers["content-type"] == "application/problem+json"
    assert 1 <= int(refused.headers["retry-after"]) <= 20
    assert refused.json()["type"] == PROBLEM_TYPE
    assert refused.json()["violated-policies"] == ["user"]
    assert refused.headers["x-ratelimit-remaining"] == "0"
    assert (
        check_fields(other.headers.get)[0]["user"]["pk"]
        != check_fields(refused.headers.get)[0]["user"]["pk"]
    )


def metric(server: Server, prefix: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith(prefix)).split()[-1])


def wait_for(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_concurrent_requests_queue_instead_of_failing(server: Server) -> None:
    out: dict[str, httpx.Response] = {}
    in_use = 'ratequeue_in_use{limiter="slow"}'
    depth = 'ratequeue_queue_depth{class="default",limiter="slow"}'

    def get(name: str) -> None:
        out[name] = httpx.get(server.url + "/held", timeout=60)

    first = threading.Thread(target=get, args=("first",))
    first.start()
    wait_for(lambda: metric(server, in_use) == 1)
    second = threading.Thread(target=get, args=("second",))
    second.start()
    wait_for(lambda: metric(server, depth) == 1)  # one slot: the second waits its turn
    httpx.get(server.url + "/unhold")
    first.join()
    wait_for(lambda: metric(server, depth) == 0 and metric(server, in_use) == 1)
    httpx.get(server.url + "/unhold")
    second.join()
    assert out["first"].status_code == out["second"].status_code == 200
    assert float(out["second"].headers["server-timing"].split("dur=")[1]) > 0
    for r in out.values():
        policies, _ = check_fields(r.headers.get)
        assert policies["slow"] == {"q": 1, "qu": "concurrent-requests"}


def test_a_client_that_hangs_up_while_queued_leaves_the_queue(server: Server) -> None:
    gone = 'ratequeue_http_requests_total{outcome="gone",rule="/held"}'
    in_use = 'ratequeue_in_use{limiter="slow"}'
    depth = 'ratequeue_queue_depth{class="default",limiter="slow"}'
    before = metric(server, gone)
    holder = threading.Thread(target=lambda: httpx.get(server.url + "/held", timeout=60))
    holder.start()
    wait_for(lambda: metric(server, in_use) == 1)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /held HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(lambda: metric(server, depth) == 1)  # queued behind the holder
    wait_for(lambda: metric(server, gone) == before + 1)
    assert metric(server, depth) == 0
    assert httpx.get(server.url + "/unhold").status_code == 200
    holder.join()
    wait_for(lambda: metric(server, in_use) == 0)  # the departed request took nothing


def test_requests_over_a_rate_are_paced_then_refused_beyond_max_wait(server: Server) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return list(await asyncio.gather(*(c.get("/paced") for _ in range(3))))

    out = asyncio.run(burst())
    ok = [r for r in out if r.status_code == 200]
    # 2/s, burst 1, max_wait 3 s: the first at once, the others 0.5 s apart (whatever
    # arrives within 0.5 s of another must wait for its slot rather than get a 429).
    assert len(ok) >= 2 and all(r.status_code in (200, 429) for r in out)
    waits = sorted(float(r.headers["server-timing"].split("dur=")[1]) for r in ok)
    assert waits[-1] >= 100
    for r in out:
        check_fields(r.headers.get)
        if r.status_code == 429:
            assert r.json()["violated-policies"] == ["paced"]


def test_streamed_completion_passes_through_unbuffered_and_settles(server: Server) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            policies, _limits = check_fields(r.headers.get)
            assert policies["llm-tokens"]["qu"] == "tokens"
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: "))["usage"] is None
            assert c.get("/release").status_code == 200  # only now does the app go on
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        metrics = c.get("/metrics").text
    assert 'ratequeue_available{limiter="llm",unit="tokens"}' in metrics
    # 100,000 - the estimate (4 + 1 + 1024) + settle to 25 -> about 99,975 (refill caps it).
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith('ratequeue_available{limiter="llm",unit="tokens"}')
    )
    assert float(line.split()[-1]) > 100_000 - 1029 + 500


def test_non_streamed_completion_and_metrics(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 10})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 25
        check_fields(r.headers.get)
        text = c.get("/metrics").text
    assert 'ratequeue_http_requests_total{outcome="admitted",rule="/v1/chat/completions"}' in text
