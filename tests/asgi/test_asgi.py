"""ratequeue.asgi in process: keys, rules, fields, queueing, refusals, token settling.

Timing behaviour runs on a ManualClock (a Policy's rate wait is then its reservation's
delay, reported without sleeping); concurrency waits use real events, no timing asserted.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
import ratequeue as rq
from asgi_helpers import Reply, call, check_fields, scope
from hypothesis import given
from hypothesis import strategies as st
from ratequeue.asgi import (
    PROBLEM_TYPE,
    OpenAITokens,
    RateLimitMiddleware,
    Rule,
    UsageScanner,
    api_key,
    bearer_subject,
    bearer_token,
    client_ip,
    content_length,
    first_of,
    header,
)

USAGE = {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-app", b"1")]})
    await send({"type": "http.response.body", "body": b"ok"})


def json_app(payload: dict[str, Any], status: int = 200) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        msg = await receive()
        assert msg["type"] == "http.request"
        body = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body[:7], "more_body": True})
        await send({"type": "http.response.body", "body": body[7:]})

    return app


def user_mw(clock: rq.ManualClock, **kw: Any) -> RateLimitMiddleware:
    users = rq.KeyedLimiter(rq.Rate(2, per="second", burst=2), clock=clock)
    return RateLimitMiddleware(ok_app, levels={"user": users}, keys={"user": client_ip()}, **kw)


# -- pass-through and rules ------------------------------------------------------------


def test_lifespan_and_websocket_scopes_pass_through_untouched(clock: rq.ManualClock) -> None:
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((scope, receive, send))

    mw = user_mw(clock)
    for s in ({"type": "lifespan"}, {"type": "websocket", "path": "/ws", "headers": []}):

        async def receive() -> dict[str, Any]:
            return {}

        async def send(m: dict[str, Any]) -> None:
            pass

        mw.app = app
        run(mw(s, receive, send))
        assert seen[-1] == (s, receive, send)


def test_no_matching_rule_and_exempt_rules_pass_untouched(clock: rq.ManualClock) -> None:
    users = rq.KeyedLimiter(rq.Rate(1, per="second", burst=1), clock=clock)
    mw = RateLimitMiddleware(
        ok_app,
        levels={"user": users},
        keys={"user": client_ip()},
        rules=[Rule("/health", levels=[]), Rule("/api/**", methods=["POST"])],
    )
    for _ in range(5):
        r = run(call(mw, "GET", "/health"))
        assert r.status == 200 and r.get("ratelimit") is None
        r = run(call(mw, "GET", "/api/x"))  # GET matches no rule
        assert r.status == 200 and r.get("ratelimit") is None
    assert run(call(mw, "POST", "/api/x")).status == 200
    assert run(call(mw, "POST", "/api/x/y")).status == 429


def test_rule_paths_match_segments_and_rests() -> None:
    r = Rule("/users/{id}/items/*")
    assert r.matches("GET", "/users/7/items/3")
    assert not r.matches("GET", "/users/7/items/3/4")
    assert not r.matches("GET", "/users//items/3")
    assert Rule("/v1/**").matches("GET", "/v1/a/b/c")
    assert Rule("/a.b").matches("GET", "/a.b") and not Rule("/a.b").matches("GET", "/axb")
    assert not Rule("/x", methods=["post"]).matches("GET", "/x")


def test_set_up_errors_are_clear(clock: rq.ManualClock) -> None:
    users = rq.KeyedLimiter(rq.Rate(2, per="second"), clock=clock)
    tokens = rq.Limiter(rq.Rate(1000, per="minute", unit="tokens"), clock=clock)
    with pytest.raises(ValueError, match="needs a key function"):
        RateLimitMiddleware(ok_app, levels={"user": users})
    with pytest.raises(ValueError, match="not one"):
        RateLimitMiddleware(
            ok_app, levels={"user": users}, keys={"user": client_ip()}, rules=[Rule(levels=["x"])]
        )
    with pytest.raises(ValueError, match="no cost for unit"):
        RateLimitMiddleware(ok_app, levels={"t": tokens})
    with pytest.raises(ValueError, match="not in classes"):
        RateLimitMiddleware(
            ok_app, levels={"t": tokens}, rules=[Rule(cost={"tokens": 1}, priority="x")]
        )
    with pytest.raises(ValueError, match="max_wait"):
        RateLimitMiddleware(ok_app, levels={"t": tokens}, max_wait=-1)
    with pytest.raises(TypeError):
        Rule(methods="GET")
    with pytest.raises(ValueError, match="printable ASCII"):
        RateLimitMiddleware(ok_app, levels={"zürich": tokens}, rules=[Rule(cost={"tokens": 1})])
    with pytest.raises(ValueError, match="bearer_subject needs"):
        bearer_subject()


# -- fields ------------------------------------------------------------------------------


def test_every_response_carries_valid_fields_and_429_is_a_quota_exceeded_problem(
    clock: rq.ManualClock,
) -> None:
    mw = user_mw(clock, legacy_headers=True)
    replies = [run(call(mw)) for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 429]
    for i, r in enumerate(replies):
        policies, limits = check_fields(r.get)
        assert policies == {"user": {"q": 2, "w": 1}}
        assert limits["user"]["r"] == max(0, 1 - i)
    assert replies[0].get("x-app") == "1"
    refused = replies[2]
    assert refused.get("content-type") == "application/problem+json"
    assert refused.get("retry-after") == "1"
    assert int(refused.get("retry-after") or 0) >= check_fields(refused.get)[1]["user"]["t"]
    problem = refused.json()
    assert problem["type"] == PROBLEM_TYPE
    assert problem["status"] == 429
    assert problem["violated-policies"] == ["user"]
    assert refused.get("x-ratelimit-remaining") == "0"
    assert refused.get("x-ratelimit-limit") == "2"
    clock.advance(0.5)
    assert run(call(mw)).status == 200


def test_fields_of_several_levels_units_and_partition_keys(clock: rq.ManualClock) -> None:
    users = rq.KeyedLimiter(rq.Rate(60, per="minute", burst=5), clock=clock)
    tenants = rq.KeyedConcurrency(8)
    upload = rq.Limiter(rq.Rate(1_000_000, per="hour", unit="bytes"), clock=clock)
    cluster = rq.Limiter(
        rq.Rate(0.5, per="second"), rq.Rate(90_000, per="minute", unit="tokens"), clock=clock
    )
    mw = RateLimitMiddleware(
        ok_app,
        levels={"user": users, "tenant": tenants, "upload": upload, "cluster": cluster},
        keys={"user": api_key(), "tenant": header("x-tenant")},
        rules=[Rule(cost={"tokens": 100, "bytes": 10}, name="all")],
        partition_keys=True,
        pk_secret=b"s",
    )
    with pytest.raises(ValueError, match="bytes"):
        # content-bytes has no cost in that rule
        RateLimitMiddleware(ok_app, levels={"upload": upload}, rules=[Rule(cost={})])
    hdrs = [("x-api-key", "k1"), ("x-tenant", "acme")]
    r = run(call(mw, "POST", "/", hdrs))
    assert r.status == 200
    policies, limits = check_fields(r.get)
    assert policies["user"]["q"] == 60 and policies["user"]["w"] == 60
    assert policies["tenant"] == {
        "q": 8,
        "qu": "concurrent-requests",
        "pk": policies["tenant"]["pk"],
    }
    assert policies["cluster"]["q"] == 1 and policies["cluster"]["w"] == 2  # 0.5/s: 1 per 2 s
    assert policies["cluster-tokens"]["qu"] == "tokens"
    assert "pk" not in policies["cluster"]
    assert limits["user"]["r"] == 4 and limits["tenant"]["r"] == 7  # this request holds one
    assert limits["cluster-tokens"]["r"] == 90_000 - 100
    # The partition key is a keyed hash, never the key, and the same for the same key.
    pk = policies["user"]["pk"]
    assert b"k1" not in pk and len(pk) == 12
    r2 = run(call(mw, "POST", "/", hdrs))
    assert check_fields(r2.get)[0]["user"]["pk"] == pk
    r3 = run(call(mw, "POST", "/", [("x-api-key", "k2"), ("x-tenant", "acme")]))
    assert r3.status == 429  # the cluster's 1 request per 2 s is spent
    assert check_fields(r3.get)[0]["user"]["pk"] != pk
    assert r3.json()["violated-policies"] == ["cluster"]


def test_content_bytes_costs_the_request_length(clock: rq.ManualClock) -> None:
    upload = rq.Limiter(rq.Rate(1000, per="minute", unit="bytes"), clock=clock)
    mw = RateLimitMiddleware(ok_app, levels={"upload": upload}, rules=[Rule(cost=content_length())])
    r = run(call(mw, "POST", "/", [("content-length", "600")], b"x" * 600))
    assert r.status == 200
    policies, limits = check_fields(r.get)
    assert policies["upload"]["qu"] == "content-bytes" and limits["upload"]["r"] == 400
    r = run(call(mw, "POST", "/", [("content-length", "600")], b"x" * 600))
    assert r.status == 429 and r.json()["violated-policies"] == ["upload"]


# -- queueing before refusing -------------------------------------------------------------


def test_a_request_over_its_rate_queues_up_to_max_wait_then_is_refused_at_once(
    clock: rq.ManualClock,
) -> None:
    cluster = rq.Limiter(rq.Rate(1, per="second", burst=1), clock=clock)
    mw = RateLimitMiddleware(ok_app, levels={"cluster": cluster}, max_wait=1.5)
    a, b, c = (run(call(mw)) for _ in range(3))
    assert (a.status, b.status) == (200, 200)
    assert (
        a.get("server-timing") == "queue;dur=0.000"
        or float((a.get("server-timing") or "").split("dur=")[1]) < 500
    )
    assert b.get("server-timing") == "queue;dur=1000.000"  # waited its slot, 1 s later
    # The third would wait 2 s > max_wait: refused at once, holding nothing.
    assert c.status == 429
    assert int(c.get("retry-after") or 0) >= 1
    assert c.json()["violated-policies"] == ["cluster"]


def test_classes_by_header_choose_the_wait(clock: rq.ManualClock) -> None:
    cluster = rq.Limiter(rq.Rate(1, per="second", burst=1), clock=clock)
    mw = RateLimitMiddleware(
        ok_app,
        levels={"cluster": cluster},
        classes={"interactive": 0.0, "batch": 30.0},
        class_header="x-priority",
        rules=[Rule(priority="interactive")],
    )
    assert run(call(mw)).status == 200
    assert run(call(mw, headers=[("x-priority", "interactive")])).status == 429
    assert run(call(mw, headers=[("x-priority", "nonsense")])).status == 429  # rule's class
    batch = run(call(mw, headers=[("x-priority", "batch")]))
    assert batch.status == 200 and batch.get("server-timing") == "queue;dur=1000.000"


def test_concurrency_waits_for_a_release_and_reports_the_wait() -> None:
    async def main() -> tuple[Reply, Reply, Reply, int]:
        gate = asyncio.Event()
        entered = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["path"] == "/hold":
                entered.set()
                await gate.wait()
            await ok_app(scope, receive, send)

        tenants = rq.KeyedConcurrency(1)
        mw = RateLimitMiddleware(
            app, levels={"tenant": tenants}, keys={"tenant": header("x-tenant")}, max_wait=30
        )
        hdr = [("x-tenant", "acme")]
        held = asyncio.create_task(call(mw, "GET", "/hold", hdr))
        await entered.wait()
        queued = asyncio.create_task(call(mw, "GET", "/", hdr))
        other = await call(mw, "GET", "/", [("x-tenant", "other")])  # its own key: no wait
        await asyncio.sleep(0.05)
        assert not queued.done()
        gate.set()
        return await held, await queued, other, tenants.in_use("acme")

    held, queued, other, in_use = run(main())
    assert (held.status, queued.status, other.status) == (200, 200, 200)
    assert in_use == 0
    assert float((queued.get("server-timing") or "").split("dur=")[1]) > 0
    assert check_fields(held.get)[1]["tenant"]["r"] == 0


def test_concurrency_refuses_at_once_without_max_wait_and_frees_on_errors() -> None:
    async def main() -> None:
        sem = rq.Concurrency(1)
        gate = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["path"] == "/boom":
                raise RuntimeError("app failed")
            await gate.wait()
            await ok_app(scope, receive, send)

        mw = RateLimitMiddleware(app, levels={"sem": sem})
        held = asyncio.create_task(call(mw))
        await asyncio.sleep(0.02)
        refused = await call(mw)
        assert refused.status == 429
        assert refused.json()["violated-policies"] == ["sem"]
        assert refused.get("retry-after") == "1"
        check_fields(refused.get)
        gate.set()
        await held
        assert sem.in_use == 0
        with pytest.raises(RuntimeError):
            await call(mw, path="/boom")
        assert sem.in_use == 0
        # A request cancelled while the app runs (the client went away) frees its permit.
        gate.clear()
        task = asyncio.create_task(call(mw))
        await asyncio.sleep(0.02)
        assert sem.in_use == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sem.in_use == 0

    run(main())


# -- keys ---------------------------------------------------------------------------------


def test_client_ip_trusts_forwarding_headers_only_from_trusted_proxies() -> None:
    key = client_ip(["10.0.0.0/8", "192.0.2.1"])
    xff = [("x-forwarded-for", "1.1.1.1, 198.51.100.7, 10.0.0.9")]
    assert key(scope(headers=xff, client=("10.1.2.3", 1))) == "ip:198.51.100.7"
    # The same header from an untrusted peer is ignored: a client cannot pick its key.
    assert key(scope(headers=xff, client=("203.0.113.9", 1))) == "ip:203.0.113.9"
    # Several header lines are one list, read from the right.
    two = [("x-forwarded-for", "1.1.1.1"), ("x-forwarded-for", "10.0.0.8")]
    assert key(scope(headers=two, client=("192.0.2.1", 1))) == "ip:1.1.1.1"
    # Only the last max_hops entries are read; all trusted: the leftmost read.
    many = [("x-forwarded-for", ", ".join(["10.0.0.1"] * 100))]
    assert key(scope(headers=many, client=("10.0.0.2", 1))) == "ip:10.0.0.1"
    # Garbage stops the walk at the last trusted hop.
    bad = [("x-forwarded-for", "1.1.1.1, nonsense, 10.0.0.5")]
    assert key(scope(headers=bad, client=("10.0.0.2", 1))) == "ip:10.0.0.5"
    huge = [("x-forwarded-for", "1.1.1.1," * 2000)]
    assert key(scope(headers=huge, client=("10.0.0.2", 1))) == "ip:10.0.0.2"
    assert key(scope(client=None)) is None


def test_client_ip_reads_forwarded_and_groups_ipv6_by_prefix() -> None:
    key = client_ip(["127.0.0.1"], header="forwarded")
    fwd = [("forwarded", 'for="[2001:db8:cafe::17]:4711";proto=https, for=127.0.0.1')]
    assert key(scope(headers=fwd, client=("127.0.0.1", 1))) == "ip:2001:db8:cafe::/64"
    fwd4 = [("forwarded", "for=192.0.2.60;proto=http;by=203.0.113.43")]
    assert key(scope(headers=fwd4, client=("127.0.0.1", 1))) == "ip:192.0.2.60"
    exact = client_ip(ipv6_prefix=128)
    assert exact(scope(client=("2001:db8::1", 1))) == "ip:2001:db8::1"
    assert client_ip()(scope(client=("::ffff:192.0.2.1", 1))) == "ip:192.0.2.1"
    with pytest.raises(ValueError):
        client_ip(header="x-real-ip")


def test_header_api_key_and_bearer_keys() -> None:
    tok = "h." + base64.urlsafe_b64encode(b'{"sub":"alice"}').decode().rstrip("=") + ".sig"
    s = scope(headers=[("authorization", f"Bearer {tok}"), ("x-api-key", "K"), ("x-t", "acme")])
    assert header("X-T")(s) == "acme"
    assert api_key()(s) == "apikey:K"
    assert bearer_token()(s) == "bearer:" + tok
    assert bearer_subject(unverified=True)(s) == "sub:alice"

    def verify(token: str) -> dict[str, Any]:
        raise ValueError("bad signature")

    assert bearer_subject(verify)(s) is None
    assert bearer_subject(lambda t: {"sub": 42})(s) == "sub:42"
    assert header("x-t", max_length=3)(s) is None
    assert first_of(header("x-none"), api_key())(s) == "apikey:K"
    assert bearer_token()(scope(headers=[("authorization", "Basic abc")])) is None
    deep = "h." + base64.urlsafe_b64encode(b"[" * 6000).decode() + ".s"
    assert (
        bearer_subject(unverified=True)(scope(headers=[("authorization", "Bearer " + deep)]))
        is None
    )


def test_requests_without_a_key_share_the_anonymous_key(clock: rq.ManualClock) -> None:
    users = rq.KeyedLimiter(rq.Rate(1, per="second", burst=1), clock=clock)
    mw = RateLimitMiddleware(ok_app, levels={"user": users}, keys={"user": api_key()})
    assert run(call(mw)).status == 200
    assert run(call(mw)).status == 429
    assert run(call(mw, headers=[("x-api-key", "a")])).status == 200


# -- token routes -------------------------------------------------------------------------


def token_mw(clock: rq.ManualClock, app: Any, **tok: Any) -> tuple[RateLimitMiddleware, rq.Limiter]:
    cluster = rq.Limiter(
        rq.Rate(100, per="minute"), rq.Rate(10_000, per="minute", unit="tokens"), clock=clock
    )
    mw = RateLimitMiddleware(
        app,
        levels={"cluster": cluster},
        rules=[Rule("/v1/chat/completions", methods=["POST"], tokens=OpenAITokens(**tok))],
    )
    return mw, cluster


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 500}


def test_estimate_is_prompt_plus_maximum_output() -> None:
    est = OpenAITokens()
    assert est.estimate(json.dumps(CHAT).encode()) == 4 + 100 + 500
    assert est.estimate(json.dumps({**CHAT, "n": 2}).encode()) == 104 + 1000
    no_max = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}
    assert est.estimate(json.dumps(no_max).encode()) == 4 + 1 + 1024
    assert est.estimate(json.dumps({"input": "x" * 40}).encode()) == 10  # embeddings
    assert est.estimate(b"not json") >= 1024
    assert est.estimate(b"[" * 200_000) >= 1024  # nested past the JSON parser's depth
    with pytest.raises(ValueError):
        OpenAITokens(max_body=-1)


def test_tokens_are_estimated_then_settled_from_the_json_usage(clock: rq.ManualClock) -> None:
    mw, cluster = token_mw(clock, json_app({"choices": [], "usage": USAGE}))
    r = run(call(mw, "POST", "/v1/chat/completions", body=json.dumps(CHAT).encode()))
    assert r.status == 200
    # Headers went out with the estimate debited; the usage settled it afterwards.
    assert check_fields(r.get)[1]["cluster-tokens"]["r"] == 10_000 - 604
    assert cluster.available("tokens") == pytest.approx(10_000 - 42)


def sse_app(events: list[bytes], usage_split: int) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        stream = b"".join(events)
        for i in range(0, len(stream), usage_split):
            await send(
                {
                    "type": "http.response.body",
                    "body": stream[i : i + usage_split],
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b""})

    return app


def sse_events(content: str) -> list[bytes]:
    chunk = {"choices": [{"delta": {"content": content}}], "usage": None}
    last = {"choices": [], "usage": USAGE}
    return [
        b"data: " + json.dumps(chunk).encode() + b"\n\n",
        b"data: " + json.dumps(last).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]


@pytest.mark.parametrize("split", [1, 3, 17, 10_000])
def test_streamed_usage_settles_whatever_the_chunking(clock: rq.ManualClock, split: int) -> None:
    # The model's own text mentions a usage object: escaped in JSON, it is not the usage.
    events = sse_events('"usage": {"total_tokens": 9999}')
    mw, cluster = token_mw(clock, sse_app(events, split))
    r = run(call(mw, "POST", "/v1/chat/completions", body=json.dumps(CHAT).encode()))
    assert r.status == 200 and r.body == b"".join(events)
    assert len(r.bodies) > 1 or split == 10_000  # passed through as sent, not buffered
    assert cluster.available("tokens") == pytest.approx(10_000 - 42)


def test_response_chunks_go_out_before_the_app_finishes(clock: rq.ManualClock) -> None:
    async def main() -> None:
        gate = asyncio.Event()
        got: list[bytes] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await gate.wait()
            await send({"type": "http.response.body", "body": b""})

        mw, _ = token_mw(clock, app)

        async def send(m: dict[str, Any]) -> None:
            if m["type"] == "http.response.body":
                got.append(m["body"])

        incoming = [{"type": "http.request", "body": json.dumps(CHAT).encode()}]

        async def receive() -> dict[str, Any]:
            return incoming.pop() if incoming else {"type": "http.disconnect"}

        task = asyncio.create_task(mw(scope("POST", "/v1/chat/completions"), receive, send))
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == [b"data: 1\n\n"] and not task.done()
        gate.set()
        await task

    run(main())


def test_an_error_without_usage_refunds_and_an_unknown_outcome_keeps_the_estimate(
    clock: rq.ManualClock,
) -> None:
    mw, cluster = token_mw(clock, json_app({"error": "upstream down"}, status=502))
    assert (
        run(call(mw, "POST", "/v1/chat/completions", body=json.dumps(CHAT).encode())).status == 502
    )
    assert cluster.available("tokens") == pytest.approx(10_000)
    mw, cluster = token_mw(clock, json_app({"choices": []}))
    run(call(mw, "POST", "/v1/chat/completions", body=json.dumps(CHAT).encode()))
    assert cluster.available("tokens") == pytest.approx(10_000 - 604)


def test_request_bodies_are_read_only_up_to_the_cap(clock: rq.ManualClock) -> None:
    called: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        called.append(1)
        await ok_app(scope, receive, send)

    mw, cluster = token_mw(clock, app, max_body=1000)
    chunks = [b"x" * 600] * 50
    r = run(call(mw, "POST", "/v1/chat/completions", body=chunks))
    assert r.status == 413 and r.get("content-type") == "application/problem+json"
    r = run(call(mw, "POST", "/v1/chat/completions", [("content-length", "5000000")], b""))
    assert r.status == 413
    check_fields(r.get)
    r = run(call(mw, "POST", "/v1/chat/completions", [("content-length", "9" * 5000)], b""))
    assert r.status == 413
    assert not called and cluster.available("tokens") == pytest.approx(10_000)
    # The body read for the estimate is handed to the app whole.
    seen: list[bytes] = []

    async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
        msg = await receive()
        seen.append(msg["body"])
        await ok_app(scope, receive, send)

    mw, _ = token_mw(clock, echo)
    body = json.dumps(CHAT).encode()
    assert run(call(mw, "POST", "/v1/chat/completions", body=[body[:10], body[10:]])).status == 200
    assert seen == [body]


def test_a_cost_above_the_burst_is_413_naming_the_policy(clock: rq.ManualClock) -> None:
    mw, cluster = token_mw(clock, ok_app)
    big = {**CHAT, "max_tokens": 50_000}
    r = run(call(mw, "POST", "/v1/chat/completions", body=json.dumps(big).encode()))
    assert r.status == 413 and r.json()["violated-policies"] == ["cluster-tokens"]
    assert cluster.available("tokens") == pytest.approx(10_000)


@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.binary(max_size=300))
def test_usage_scanner_finds_the_last_usage_whatever_the_chunking(
    cuts: list[int], noise: bytes
) -> None:
    body = (
        b'{"a":"\\"usage\\": {\\"total_tokens\\": 5}",'
        + b'"usage":{"prompt_tokens":1,"completion_tokens":2,"details":{"x":{"y":1}}},'
        + b'"z":"'
        + base64.b64encode(noise)
        + b'","usage":{"total_tokens":77}}'
    )
    s = UsageScanner()
    pos = 0
    for c in cuts:
        s.feed(body[pos : pos + c])
        pos += c
    s.feed(body[pos:])
    assert s.total == 77
    s2 = UsageScanner()
    s2.feed(b'{"usage":{"input_tokens":3,"output_tokens":4}}')
    assert s2.total == 7
    s2.feed(b'{"usage":{"a":' + b"[" * 4000 + b"]" * 4000 + b"}}")
    assert s2.total == 7


def test_usage_of_a_stream_that_counts_input_first_and_output_last() -> None:
    # Anthropic's messages stream: input tokens in message_start, output in message_delta.
    s = UsageScanner()
    s.feed(b'event: message_start\ndata: {"type":"message_start","message":{"usage":')
    s.feed(b'{"input_tokens":25,"output_tokens":1}}}\n\n')
    assert s.total == 26
    s.feed(b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":15}}')
    assert s.total == 40


# -- metrics ------------------------------------------------------------------------------


def test_prometheus_endpoint_exports_levels_and_outcomes(clock: rq.ManualClock) -> None:
    mw = user_mw(clock, metrics_path="/metrics")
    for _ in range(3):
        run(call(mw))
    r = run(call(mw, "GET", "/metrics"))
    assert r.status == 200
    text = r.body.decode()
    assert 'ratequeue_http_requests_total{outcome="refused",rule="/**"} 1.0' in text
    assert 'ratequeue_http_requests_total{outcome="admitted",rule="/**"} 2.0' in text
    assert "ratequeue_http_queue_wait_seconds_count 2.0" in text
    assert "ratequeue_policy_admitted_total" in text


def test_a_client_that_leaves_while_queued_leaves_the_queue_holding_nothing() -> None:
    async def main() -> None:
        sem = rq.Concurrency(1)
        gate = asyncio.Event()
        calls: list[Any] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            calls.append(scope["path"])
            if scope["path"] == "/hold":
                await gate.wait()
            if scope["path"] == "/echo":
                calls.append((await receive())["body"])
            await ok_app(scope, receive, send)

        mw = RateLimitMiddleware(app, levels={"sem": sem}, max_wait=60)
        held = asyncio.create_task(call(mw, path="/hold"))
        await asyncio.sleep(0.02)
        left = asyncio.Event()
        sent: list[Any] = []

        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:  # a GET: its empty body first, then only the disconnect
                body_sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(m: dict[str, Any]) -> None:
            sent.append(m)

        gone = asyncio.create_task(mw(scope(path="/gone"), receive, send))
        for _ in range(100):
            if sem.waiting:
                break
            await asyncio.sleep(0.01)
        assert sem.waiting == 1
        left.set()
        await asyncio.wait_for(gone, 10)
        assert sem.waiting == 0 and sent == [] and calls == ["/hold"]
        gate.set()
        await held
        assert sem.in_use == 0
        # A queued request whose body arrived meanwhile gets it replayed whole.
        gate.clear()
        held = asyncio.create_task(call(mw, path="/hold"))
        await asyncio.sleep(0.02)
        queued = asyncio.create_task(call(mw, "POST", "/echo", body=b"payload"))
        await asyncio.sleep(0.05)
        gate.set()
        assert (await held).status == 200 and (await queued).status == 200
        assert calls[-2:] == ["/echo", b"payload"]
        assert sem.in_use == 0 and sem.waiting == 0

    run(main())


_header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=300)


@given(
    xff=_header_text,
    fwd=_header_text,
    auth=_header_text,
    peer=st.sampled_from(["10.0.0.1", "::1", "203.0.113.1", "not-an-ip", "fe80::1%eth0"]),
)
def test_key_functions_never_raise_on_what_a_client_sends(
    xff: str, fwd: str, auth: str, peer: str
) -> None:
    s = scope(
        headers=[("x-forwarded-for", xff), ("forwarded", fwd), ("authorization", auth)],
        client=(peer, 1),
    )
    funcs = [
        client_ip(["10.0.0.0/8", "::1"]),
        client_ip(["10.0.0.0/8", "::1"], header="forwarded"),
        bearer_token(),
        bearer_subject(unverified=True),
        api_key("authorization"),
    ]
    for f in funcs:
        k = f(s)
        assert k is None or (isinstance(k, str) and len(k) <= 8200)


def test_shadow_levels_are_evaluated_not_enforced_nor_advertised(clock: rq.ManualClock) -> None:
    users = rq.KeyedLimiter(rq.Rate(1, per="minute", burst=1), clock=clock)
    cluster = rq.Limiter(rq.Rate(100, per="second"), clock=clock)
    mw = RateLimitMiddleware(
        ok_app,
        levels={"user": users, "cluster": cluster},
        keys={"user": api_key()},
        shadow=["user"],
    )
    replies = [run(call(mw, headers=[("x-api-key", "a")])) for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 200]
    assert set(check_fields(replies[0].get)[0]) == {"cluster"}
    policy = mw.policies[0]
    assert policy.stats()["levels"]["user"]["shadow_refused"] == 2
    assert mw.stats()["/**"]["admitted"] == 3


def test_all_lists_exactly_the_public_names() -> None:
    import ratequeue.asgi as pkg

    public = {n for n in dir(pkg) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(pkg, n)).__name__ == "module"}
    assert set(pkg.__all__) == public - modules - {"annotations"}


def test_starlette_add_middleware_takes_it_as_is(clock: rq.ManualClock) -> None:
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def hello(request: Any) -> PlainTextResponse:
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/", hello)])
    users = rq.KeyedLimiter(rq.Rate(1, per="second", burst=1), clock=clock)
    app.add_middleware(RateLimitMiddleware, levels={"user": users}, keys={"user": client_ip()})

    async def two() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.get("/"), await c.get("/")]

    first, second = run(two())
    assert (first.status_code, second.status_code) == (200, 429)
    assert first.text == "hi" and second.headers["retry-after"] == "1"


def test_usage_is_read_only_from_json_or_event_streams(clock: rq.ManualClock) -> None:
    async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive())["body"]  # a text body echoing what the client wrote
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    mw, cluster = token_mw(clock, echo)
    sneaky = {**CHAT, "note": 'x"usage":{"total_tokens":0}'}
    raw = json.dumps(sneaky).replace('\\"', '"').encode()  # unescaped, as text
    assert b'"usage":{"total_tokens":0}' in raw
    assert run(call(mw, "POST", "/v1/chat/completions", body=raw)).status == 200
    assert cluster.available("tokens") < 10_000 - 500  # the estimate stays charged

    async def gz(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps({"usage": USAGE}).encode()})

    mw, cluster = token_mw(clock, gz)
    run(call(mw, "POST", "/v1/chat/completions", body=json.dumps(CHAT).encode()))
    assert cluster.available("tokens") == pytest.approx(10_000 - 604)


def test_a_request_cancelled_while_queued_leaves_the_queue_holding_nothing() -> None:
    async def main() -> None:
        sem = rq.Concurrency(1)
        gate = asyncio.Event()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await gate.wait()
            await ok_app(scope, receive, send)

        mw = RateLimitMiddleware(app, levels={"sem": sem}, max_wait=60)
        held = asyncio.create_task(call(mw))
        await asyncio.sleep(0.02)
        queued = asyncio.create_task(call(mw))
        for _ in range(100):
            if sem.waiting:
                break
            await asyncio.sleep(0.01)
        assert sem.waiting == 1
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert sem.waiting == 0
        gate.set()
        assert (await held).status == 200
        assert sem.in_use == 0

    run(main())
