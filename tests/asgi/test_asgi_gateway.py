"""End to end: the real openai SDK -> examples/gateway under uvicorn (forwarding through
ratequeue.httpx) -> the mock provider, JSON and streamed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from asgi_helpers import Server, check_fields
from ratequeue.asgi import PROBLEM_TYPE
from ratequeue.testing import MockProvider

GATEWAY_DIR = str(Path(__file__).resolve().parents[2] / "examples" / "gateway")
MESSAGES = [{"role": "user", "content": "Say ok."}]


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, MockProvider]]:
    with MockProvider(rpm=6000, gen_time=0.0) as mock:
        env = {
            "GATEWAY_UPSTREAM": mock.base_url,
            "GATEWAY_USER_RPM": "30",  # burst 3
            "GATEWAY_MAX_WAIT": "0.5",
        }
        with Server("gateway:create", env=env, app_dir=GATEWAY_DIR) as gw:
            yield gw.url, mock


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=key, default_headers={"x-tenant": "acme"}, max_retries=0
    )


def test_the_sdk_gets_completions_with_the_ratelimit_fields(
    gateway: tuple[str, MockProvider],
) -> None:
    url, mock = gateway
    c = client(url, "user-a")
    raw = c.chat.completions.with_raw_response.create(
        model="mock", messages=MESSAGES, max_tokens=20
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "ok"
    usage = completion.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.total_tokens > 0
    policies, limits = check_fields(raw.headers.get)
    assert set(policies) == {"user", "tenant", "cluster", "cluster-tokens"}
    assert policies["tenant"]["qu"] == "concurrent-requests"
    assert limits["user"]["r"] == 2
    assert raw.headers["server-timing"].startswith("queue;dur=")
    assert mock.ok >= 1


def test_over_its_rate_a_user_gets_a_429_the_sdk_understands(
    gateway: tuple[str, MockProvider],
) -> None:
    url, mock = gateway
    c = client(url, "user-b")
    sent = mock.requests
    for _ in range(3):
        c.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=5)
    resp = info.value.response
    assert resp.status_code == 429
    assert resp.headers["content-type"] == "application/problem+json"
    assert int(resp.headers["retry-after"]) >= 1
    problem = resp.json()
    assert problem["type"] == PROBLEM_TYPE and problem["violated-policies"] == ["user"]
    check_fields(resp.headers.get)
    assert mock.requests == sent + 3  # the refused call never reached the upstream
    # Another user is served meanwhile.
    other = client(url, "user-c").chat.completions.create(model="mock", messages=MESSAGES)
    assert other.choices[0].message.content == "ok"


def test_cluster_tokens_are_settled_from_the_upstream_usage(
    gateway: tuple[str, MockProvider],
) -> None:
    url, _ = gateway
    client(url, "user-d").chat.completions.create(model="mock", messages=MESSAGES, max_tokens=2000)
    metrics = httpx.get(url + "/metrics").text
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith('ratequeue_available{limiter="cluster",unit="tokens"}')
    )
    # An estimate of 2000+ tokens was settled to the mock's few: the bucket is nearly full.
    assert float(line.split()[-1]) > 90_000 - 200
    assert httpx.get(url + "/healthz").json() == {"ok": True}


def test_a_streamed_completion_reaches_the_sdk_and_settles(
    gateway: tuple[str, MockProvider],
) -> None:
    url, _ = gateway
    stream = client(url, "user-e").chat.completions.create(
        model="mock",
        messages=MESSAGES,
        max_tokens=3000,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].total_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    metrics = httpx.get(url + "/metrics").text
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith('ratequeue_available{limiter="cluster",unit="tokens"}')
    )
    # The 3000-token estimate was settled to the stream's usage as it passed.
    assert float(line.split()[-1]) > 90_000 - 500


def test_a_tenant_over_its_monthly_ledger_quota_gets_quota_exceeded(tmp_path: Path) -> None:
    from ratequeue.ledger import SqliteLedger

    db = str(tmp_path / "quota.db")
    with MockProvider(rpm=6000, gen_time=0.0) as mock:
        env = {
            "GATEWAY_UPSTREAM": mock.base_url,
            "GATEWAY_MAX_WAIT": "0.5",
            "GATEWAY_LEDGER": db,
            "GATEWAY_TENANT_TOKENS_MONTH": "400",
        }
        with Server("gateway:create", env=env, app_dir=GATEWAY_DIR) as gw:
            c = client(gw.url, "user-a")
            # each call is held at its estimate (prompt + max_tokens) and settled with
            # its real usage, once per request id
            done = c.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=50)
            used = done.usage.total_tokens if done.usage else 0
            assert used > 0
            with pytest.raises(openai.RateLimitError) as e:
                c.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=500)
            assert e.value.response.headers["content-type"].startswith("application/problem+json")
            assert e.value.response.json()["type"] == "quota-exceeded"
            assert int(e.value.response.headers["retry-after"]) >= 1
            sent = mock.ok
    ledger = SqliteLedger(db)
    assert ledger.balance("acme").used["tokens"] == used
    assert sent == 1  # the refused call never reached the provider
