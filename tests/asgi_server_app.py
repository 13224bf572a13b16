"""The Starlette app that tests/asgi/test_asgi_server.py serves under a real uvicorn."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import ratequeue as rq
from ratequeue.asgi import OpenAITokens, RateLimitMiddleware, Rule, client_ip, header
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

USAGE = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}


def create() -> RateLimitMiddleware:
    state = {"started": False}
    release = asyncio.Event()
    hold = asyncio.Event()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["started"] = True
        yield

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    async def started(request: Request) -> JSONResponse:
        return JSONResponse(state)

    async def slow(request: Request) -> PlainTextResponse:
        await asyncio.sleep(0.3)
        return PlainTextResponse("slow")

    async def held(request: Request) -> PlainTextResponse:
        await hold.wait()
        hold.clear()
        return PlainTextResponse("held")

    async def unhold(request: Request) -> PlainTextResponse:
        hold.set()
        return PlainTextResponse("unheld")

    async def free(request: Request) -> PlainTextResponse:
        release.set()
        return PlainTextResponse("released")

    async def chat(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"choices": [], "usage": USAGE})

        async def events() -> AsyncIterator[bytes]:
            first = {"choices": [{"delta": {"content": "hi"}}], "usage": None}
            yield b"data: " + json.dumps(first).encode() + b"\n\n"
            await release.wait()  # the client reads the first event before this ends
            release.clear()
            yield b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(
        routes=[
            Route("/hello", hello),
            Route("/started", started),
            Route("/slow", slow),
            Route("/paced", hello),
            Route("/held", held),
            Route("/unhold", unhold),
            Route("/release", free),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    users = rq.KeyedLimiter(rq.Rate(3, per="minute", burst=3), name="user")
    slots = rq.Concurrency(1, name="slow")
    paced = rq.Limiter(rq.Rate(2, per="second", burst=1), name="paced")
    tokens = rq.Limiter(
        rq.Rate(600, per="minute"), rq.Rate(100_000, per="minute", unit="tokens"), name="llm"
    )
    return RateLimitMiddleware(
        app,
        levels={"user": users, "slow": slots, "llm": tokens, "paced": paced},
        keys={"user": client_ip(["127.0.0.1"])},
        rules=[
            Rule("/started", levels=[]),
            Rule("/release", levels=[]),
            Rule("/slow", levels=["slow"], max_wait=30.0),
            Rule("/held", levels=["slow"], max_wait=30.0),
            Rule("/unhold", levels=[]),
            Rule("/paced", levels=["paced"], max_wait=3.0),
            Rule("/v1/chat/completions", methods=["POST"], levels=["llm"], tokens=OpenAITokens()),
            Rule("/hello", levels=["user"]),
        ],
        legacy_headers=True,
        partition_keys=True,
        metrics_path="/metrics",
        class_header=None,
    )


__all__ = ["create", "header"]
