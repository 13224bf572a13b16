"""An OpenAI-compatible gateway: ratequeue.asgi in front of an upstream provider.

Each chat completion passes three levels, all or nothing: the user's bucket (keyed by
the bearer API key), the tenant's concurrency (``x-tenant`` header) and the cluster's
requests and tokens (estimated from the body, settled from the upstream's ``usage``,
streams included). Over a level it queues up to ``GATEWAY_MAX_WAIT`` seconds, then
answers 429 with ``Retry-After`` and the RateLimit fields; ``/metrics`` is Prometheus.

    GATEWAY_UPSTREAM=http://127.0.0.1:8000 uvicorn --factory gateway:create --port 8080

Forwarding goes through ``ratequeue.httpx``: the provider's own limits (calibrated from
its rate-limit headers, paused on its 429s) in a second queue, streamed, never buffered.
With ``GATEWAY_LEDGER=/path/quota.db`` each tenant also has a monthly token quota
(``GATEWAY_TENANT_TOKENS_MONTH``) in a ``ratequeue.ledger`` SQLite ledger: each upstream
call is held at its estimate, settled with its real usage and counted once per request
id; a tenant out of quota gets a 429 ``quota-exceeded`` until its period renews.
The tenant header is trusted as sent: put the gateway behind a proxy that sets it from
the caller's credentials (or derive the tenant from the API key in ``keys=``).
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import ratequeue as rq
from ratequeue.asgi import OpenAITokens, RateLimitMiddleware, Rule, bearer_token, header
from ratequeue.httpx import RateLimitedTransport
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

#: Request headers passed upstream (the gateway's own credentials would go here).
FORWARD = ("content-type", "accept", "openai-organization", "openai-project")
#: Response headers never copied back: hop-by-hop, recomputed, or the upstream's quota.
DROP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
DROP |= {"ratelimit", "ratelimit-policy"}


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def create(upstream: str | None = None) -> RateLimitMiddleware:
    """The gateway app; ``upstream`` defaults to ``$GATEWAY_UPSTREAM``."""
    base = upstream or os.environ["GATEWAY_UPSTREAM"]
    max_wait = _env("GATEWAY_MAX_WAIT", 5.0)
    provider = rq.Limiter(
        rq.Rate(_env("UPSTREAM_RPM", 10_000), per="minute"),
        rq.Rate(_env("UPSTREAM_TPM", 2_000_000), per="minute", unit="tokens"),
        name="upstream",
    )
    ledger = None
    if os.environ.get("GATEWAY_LEDGER"):
        from ratequeue.ledger import Monthly, Plan, SqliteLedger

        month = int(_env("GATEWAY_TENANT_TOKENS_MONTH", 10_000_000))
        plan = Plan("tenant", tokens=month, period=Monthly())
        ledger = SqliteLedger(os.environ["GATEWAY_LEDGER"], default_plan=plan)
    transport = RateLimitedTransport(
        httpx.AsyncHTTPTransport(), provider, timeout=max_wait, calibrate=True, ledger=ledger
    )
    client = httpx.AsyncClient(base_url=base, transport=transport, timeout=600)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    async def forward(request: Request) -> Response:
        body = await request.body()  # the middleware capped it and read it already
        headers = {k: v for k, v in request.headers.items() if k in FORWARD}
        headers["accept-encoding"] = "identity"  # usage stays readable for settling
        headers["x-ratequeue-account"] = request.headers.get("x-tenant", "default")
        up = client.build_request(request.method, request.url.path, content=body, headers=headers)
        try:
            resp = await client.send(up, stream=True)
        except rq.QuotaExceeded as e:  # the tenant's monthly quota
            retry = {"retry-after": str(max(1, math.ceil(e.retry_after)))}
            problem = {"type": "quota-exceeded", "title": str(e), "account": e.account}
            return JSONResponse(problem, 429, retry, media_type="application/problem+json")
        except rq.RateQueueError as e:  # the provider's own queue would miss max_wait
            retry = {"retry-after": str(max(1, math.ceil(e.retry_after)))}
            return JSONResponse({"error": {"type": "upstream_busy"}}, 503, retry)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"type": "upstream", "message": str(e)}}, 502)
        out = {k: v for k, v in resp.headers.items() if k.lower() not in DROP}
        return StreamingResponse(
            resp.aiter_raw(), resp.status_code, out, background=BackgroundTask(resp.aclose)
        )

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "mock", "object": "model"}]})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", forward, methods=["POST"]),
            Route("/v1/completions", forward, methods=["POST"]),
            Route("/v1/models", models),
            Route("/healthz", healthz),
        ],
        lifespan=lifespan,
    )
    rpm = _env("GATEWAY_USER_RPM", 60)
    users = rq.KeyedLimiter(rq.Rate(rpm, per="minute", burst=max(1, int(rpm // 10))), name="user")
    tenants = rq.KeyedConcurrency(int(_env("GATEWAY_TENANT_CONCURRENCY", 8)), name="tenant")
    cluster = rq.Limiter(
        rq.Rate(_env("GATEWAY_CLUSTER_RPM", 500), per="minute"),
        rq.Rate(_env("GATEWAY_CLUSTER_TPM", 90_000), per="minute", unit="tokens"),
        name="cluster",
    )
    completion = OpenAITokens(max_body=4 * 1024 * 1024)
    return RateLimitMiddleware(
        app,
        levels={"user": users, "tenant": tenants, "cluster": cluster},
        keys={"user": bearer_token(), "tenant": header("x-tenant")},
        rules=[
            Rule("/healthz", levels=[]),
            Rule("/v1/chat/completions", methods=["POST"], tokens=completion),
            Rule("/v1/completions", methods=["POST"], tokens=completion),
            Rule("/v1/**", levels=["user"]),
        ],
        max_wait=max_wait,
        partition_keys=True,
        metrics_path="/metrics",
    )
