"""rq.Canary: routing, KPIs, gates, shadow traffic, the Pool and httpx adapters."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import threading
import time
from typing import Any

import httpx
import pytest
import ratequeue as rq
from forking import check_child, fork_child
from hypothesis import given
from hypothesis import strategies as st
from ratequeue.canary import (
    DEFAULT_GATES,
    Canary,
    Decision,
    Gate,
    PoolArm,
    Reply,
    current_request,
)
from ratequeue.canary._kpi import ArmStats
from ratequeue.canary._stats import (
    mean_bounds,
    order_ranks,
    quantile_bounds,
    wilson_bounds,
    z_of,
)
from ratequeue.canary.transport import AsyncCanaryTransport, CanaryTransport


def aio(fn: Any) -> Any:
    """Run an async test on a fresh event loop."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


def reply(tokens: int, calls: int = 1) -> Any:
    return lambda request: Reply(request, tokens=tokens, calls=calls)


def drive(canary: Canary, clock: rq.ManualClock, n: int, dt: float = 1.0, start: int = 0) -> None:
    """n requests from distinct users, dt seconds apart."""
    for i in range(start, start + n):
        canary.call(f"user-{i}", i)
        clock.advance(dt)


TOKENS_GATE = (Gate("tokens_per_valid_answer", min_sample=20),)


# -- routing -------------------------------------------------------------------------------


def test_the_hash_is_stable_across_instances_and_depends_on_the_salt() -> None:
    a = Canary(reply(1), reply(1), salt="s")
    b = Canary(reply(1), reply(1), salt="s")
    c = Canary(reply(1), reply(1), salt="other")
    keys = [f"u{i}" for i in range(200)] + [b"bytes-key", 12345]
    assert [a.bucket(k) for k in keys] == [b.bucket(k) for k in keys]
    assert [a.bucket(k) for k in keys] != [c.bucket(k) for k in keys]
    assert all(0.0 <= a.bucket(k) < 1.0 for k in keys)
    assert a.bucket(7) != a.bucket("7")  # an int and its text are different users


def test_a_user_stays_on_one_arm_and_the_share_matches_the_stage(clock: rq.ManualClock) -> None:
    canary = Canary(reply(1), reply(1), stages=(0.2, 1.0), clock=clock)
    users = [f"u{i}" for i in range(20_000)]
    arms = {u: canary.arm_for(u) for u in users}
    assert all(canary.arm_for(u) == arms[u] for u in users[:2000])
    share = sum(a == "candidate" for a in arms.values()) / len(users)
    assert 0.18 < share < 0.22


def test_users_on_the_candidate_stay_there_as_the_stages_grow(clock: rq.ManualClock) -> None:
    canary = Canary(
        reply(100),
        reply(100),
        stages=(0.05, 0.2, 0.5, 1.0),
        min_stage_time=10,
        clock=clock,
        gates=TOKENS_GATE,
    )
    users = [f"u{i}" for i in range(3000)]
    seen: set[str] = set()
    fractions = []
    i = 0
    while canary.state == "running":
        on = {u for u in users if canary.arm_for(u) == "candidate"}
        assert seen <= on
        seen = on
        fractions.append(canary.fraction)
        drive(canary, clock, 100, 0.1, start=i)  # 10 s: at most one stage per round
        i += 100
    assert canary.state == "complete"
    assert sorted(set(fractions)) == [0.05, 0.2, 0.5, 1.0]
    assert all(canary.arm_for(u) == "candidate" for u in users)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        Canary(reply(1), reply(1), stages=(0.5, 0.2))
    with pytest.raises(ValueError):
        Canary(reply(1), reply(1), stages=(0.0, 1.0))
    with pytest.raises(ValueError):
        Canary(reply(1), reply(1), stages=())
    with pytest.raises(TypeError):
        Canary(reply(1), reply(1), stages=(True,))
    with pytest.raises(ValueError):
        Canary(reply(1), reply(1), min_stage_time=-1)
    with pytest.raises(TypeError):
        Canary(reply(1), "not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Canary(reply(1), reply(1)).bucket(1.5)
    with pytest.raises(ValueError):
        Gate("no_such_kpi")
    with pytest.raises(ValueError):
        Gate("latency_p50", confidence=1.0)
    with pytest.raises(ValueError):
        Gate("latency_p50", min_sample=0)
    with pytest.raises(ValueError):
        Reply(None, tokens=-1)
    with pytest.raises(TypeError):
        Canary(reply(1), reply(1)).request("u").call(tokens=1.5)  # type: ignore[arg-type]


# -- statistics ----------------------------------------------------------------------------


def test_quantile_bounds_are_order_statistics_of_the_sample() -> None:
    rng = random.Random(3)
    values = sorted(rng.lognormvariate(6, 0.5) for _ in range(1000))
    h = rq.Histogram()
    h.record_many(values)
    z = z_of(0.99)
    e = quantile_bounds(h, 0.5, z)
    # n = 1000, q = 0.5: spread = 2.326 * sqrt(250) = 36.8 -> ranks 463 and 538.
    assert e.n == 1000
    assert e.lo == pytest.approx(values[462], rel=0.01)
    assert e.hi == pytest.approx(values[537], rel=0.01)
    assert e.value == pytest.approx(values[499], rel=0.01)
    # Too few samples for a p99 upper rank: the bound is +inf, so it can never trip.
    assert quantile_bounds(h, 0.999, z).hi == float("inf")
    assert quantile_bounds(rq.Histogram(), 0.5, z).n == 0


def test_mean_and_share_bounds() -> None:
    z = z_of(0.975)
    m = mean_bounds(4, 10.0, 30.0, z)  # 1, 2, 3, 4: mean 2.5, s^2 = 5/3
    assert m.value == 2.5
    assert m.hi - m.value == pytest.approx(1.95996 * (5 / 3 / 4) ** 0.5, rel=1e-4)
    w = wilson_bounds(0, 100, z)
    assert w.value == 0.0 and w.lo == 0.0 and 0.03 < w.hi < 0.04
    w = wilson_bounds(50, 100, z)
    assert w.lo == pytest.approx(0.4038, abs=1e-3) and w.hi == pytest.approx(0.5962, abs=1e-3)


def _arm(name: str, tokens: list[int]) -> ArmStats:
    s = ArmStats(name)
    for t in tokens:
        s.record(latency=1.0, tokens=t, calls=1, rate_limited=0, error=False, valid=True)
    return s


@pytest.mark.parametrize(
    ("factor", "n", "verdict"),
    [
        (1.0, 200, "pass"),
        (1.1, 200, "pass"),
        (1.5, 200, "rollback"),
        (1.55, 30, "hold"),  # likely worse by > 20 %, not yet provably so on 30 samples
        (3.0, 10, "hold"),  # far worse, but below min_sample
    ],
)
def test_gate_verdicts_on_seeded_data(factor: float, n: int, verdict: str) -> None:
    rng = random.Random(11)
    stable = _arm("stable", [round(rng.lognormvariate(6.5, 0.4)) for _ in range(2000)])
    candidate = _arm("candidate", [round(factor * rng.lognormvariate(6.5, 0.4)) for _ in range(n)])
    g = Gate("tokens_per_valid_answer", min_sample=20).check(stable, candidate)
    assert g.verdict == verdict, g.reason
    assert g.stable.n == 2000 and g.candidate.n == n
    if n != 30:
        mean = Gate("tokens_per_valid_answer_mean", min_sample=20).check(stable, candidate)
        assert mean.verdict == verdict, mean.reason


# -- the rollout ---------------------------------------------------------------------------


def test_a_bad_candidate_rolls_back_at_once_with_evidence_and_hook(clock: rq.ManualClock) -> None:
    rolled: list[Decision] = []
    advanced: list[Decision] = []
    canary = Canary(
        reply(100),
        reply(150),
        stages=(0.2, 1.0),
        min_stage_time=1800,
        clock=clock,
        gates=TOKENS_GATE,
        on_rollback=rolled.append,
        on_advance=advanced.append,
    )
    drive(canary, clock, 400, 1.0)
    assert canary.state == "rolled_back" and canary.fraction == 0.0
    assert clock.now() < 1800  # before the stage's minimum time: rollback does not wait
    (d,) = rolled
    assert not advanced
    assert d.action == "rollback" and d.fraction_before == 0.2 and d.fraction_after == 0.0
    (g,) = d.evidence
    assert g.kpi == "tokens_per_valid_answer" and g.verdict == "rollback"
    assert g.candidate.n == 20  # the first check with min_sample on both arms
    assert g.candidate.lo == pytest.approx(150, rel=0.01)
    assert g.stable.hi == pytest.approx(100, rel=0.01)
    assert d.kpis["candidate"].tokens_per_valid_answer == pytest.approx(150, rel=0.01)
    assert canary.decisions[-1] is d
    json.dumps(d.to_dict())
    # Everyone is back on stable; the rollout is over.
    assert {canary.arm_for(f"user-{i}") for i in range(1000)} == {"stable"}
    assert canary.evaluate() is None


def test_advance_waits_for_min_stage_time_and_every_gate(clock: rq.ManualClock) -> None:
    advanced: list[Decision] = []
    canary = Canary(
        reply(100),
        reply(105),
        stages=(0.5, 1.0),
        min_stage_time=600,
        clock=clock,
        gates=TOKENS_GATE,
        on_advance=advanced.append,
    )
    drive(canary, clock, 599, 1.0)
    assert canary.stage == 0 and not advanced
    drive(canary, clock, 2, 1.0, start=599)
    assert [d.action for d in advanced] == ["advance"]
    assert advanced[0].at == pytest.approx(600.0)
    assert canary.fraction == 1.0
    drive(canary, clock, 601, 1.0, start=601)
    assert [d.action for d in advanced] == ["advance", "complete"]
    assert canary.state == "complete"


def test_too_few_samples_hold_the_stage_and_the_hold_is_logged(clock: rq.ManualClock) -> None:
    canary = Canary(
        reply(100),
        reply(100),
        stages=(0.01, 1.0),
        min_stage_time=10,
        clock=clock,
        gates=(Gate("tokens_per_valid_answer", min_sample=50),),
    )
    drive(canary, clock, 500, 1.0)
    assert canary.stage == 0 and canary.state == "running"
    holds = [d for d in canary.decisions if d.action == "hold"]
    assert len(holds) == 1  # logged once while what it waits for does not change
    assert "sample" in holds[0].reason and holds[0].evidence[0].verdict == "hold"


def test_error_and_rate_limited_shares(clock: rq.ManualClock) -> None:
    def flaky(request: int) -> Reply:
        if request % 2:
            raise RuntimeError("candidate broke")
        return Reply(request, tokens=100)

    canary = Canary(
        reply(100),
        flaky,
        stages=(0.5,),
        clock=clock,
        gates=(Gate("error_share", min_sample=20, slack=0.01),),
    )
    for i in range(200):
        with contextlib.suppress(RuntimeError):
            canary.call(f"u{i}", i)
        clock.advance(1)
    assert canary.state == "rolled_back"
    k = canary.kpis()["candidate"]
    assert k.errors > 0 and k.error_share == pytest.approx(k.errors / k.requests)

    def limited(request: int) -> Reply:
        raise rq.Overloaded("queue full", 1.0)

    canary = Canary(
        reply(100),
        limited,
        stages=(0.5,),
        clock=clock,
        gates=(Gate("rate_limited_share", min_sample=20, slack=0.01),),
    )
    for i in range(200):
        if canary.arm_for(f"u{i}") == "candidate":
            with pytest.raises(rq.Overloaded):
                canary.call(f"u{i}", i)
        else:
            canary.call(f"u{i}", i)
        clock.advance(1)
    k = canary.kpis()["candidate"]
    assert k.rate_limited_share == 1.0 and k.errors == 0 and k.valid == 0
    assert canary.state == "rolled_back"


def test_valid_predicate_and_usage_extraction(clock: rq.ManualClock) -> None:
    def answer(request: int) -> dict[str, Any]:
        return {"text": "" if request % 4 == 0 else "fine", "usage": {"total_tokens": 40}}

    canary = Canary(answer, answer, stages=(0.5,), clock=clock, valid=lambda r: bool(r["text"]))
    for i in range(400):
        assert canary.call(f"u{i}", i)["usage"]["total_tokens"] == 40
    k = canary.kpis()
    total = k["stable"].requests + k["candidate"].requests
    assert total == 400
    assert k["stable"].invalid + k["candidate"].invalid == 100
    assert k["stable"].tokens_per_valid_answer == pytest.approx(40, rel=0.01)
    assert k["stable"].quota_per_valid_answer == pytest.approx(40 * 4 / 3, rel=0.05)


def test_a_request_block_counts_every_call(clock: rq.ManualClock) -> None:
    canary = Canary(reply(1), reply(1), stages=(1.0,), clock=clock)
    with canary.request("u1") as req:
        assert current_request() is req and req.arm == "candidate"
        for _ in range(4):
            req.call(tokens=250)
            clock.advance(0.5)
    assert current_request() is None
    k = canary.kpis()["candidate"]
    assert (k.requests, k.calls, k.tokens, k.calls_per_request) == (1, 4, 1000, 4.0)
    assert k.latency_p50 == pytest.approx(2.0, rel=0.01)
    assert k.tokens_per_valid_answer == pytest.approx(1000, rel=0.01)
    assert not req.finish()  # once only


def test_the_log_is_bounded_and_hooks_that_raise_are_contained(clock: rq.ManualClock) -> None:
    def boom(d: Decision) -> None:
        raise RuntimeError("hook")

    canary = Canary(reply(1), reply(1), clock=clock, max_log=3, on_rollback=boom)
    for i in range(10):
        canary._log.append(Decision(float(i), "hold", 0, 0.01, 0.01, str(i)))
    assert [d.reason for d in canary.decisions] == ["7", "8", "9"]
    d = canary.rollback("operator")
    assert d is not None and d.reason == "operator" and canary.state == "rolled_back"
    assert canary.rollback() is None


def test_default_gates_cover_every_kpi() -> None:
    assert {g.kpi for g in DEFAULT_GATES} == {
        "tokens_per_valid_answer",
        "tokens_per_valid_answer_mean",
        "calls_per_request",
        "error_share",
        "rate_limited_share",
        "latency_p50",
        "latency_p99",
    }


# -- shadow --------------------------------------------------------------------------------


def _wait_for(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_shadow_returns_stable_and_books_the_copy_apart() -> None:
    canary = Canary(reply(100), reply(300, calls=3), stages=(1.0,), shadow=True, gates=())
    for i in range(50):
        assert canary.call(f"u{i}", i) == i
    _wait_for(lambda: canary.kpis()["candidate"].requests == 50)
    k = canary.kpis()
    assert k["stable"].tokens == 50 * 100 and k["stable"].calls == 50
    assert k["candidate"].tokens == 50 * 300 and k["candidate"].calls == 150
    assert canary.arm_for("u1") == "stable"


def test_shadow_errors_and_hangs_never_reach_or_delay_the_caller() -> None:
    release = threading.Event()

    def hanging(request: int) -> Reply:
        if request % 2:
            raise RuntimeError("candidate failed")
        release.wait(30)
        return Reply(request, tokens=1)

    canary = Canary(
        reply(1), hanging, stages=(1.0,), shadow=True, gates=(), shadow_workers=2, max_shadow=4
    )
    t0 = time.monotonic()
    for i in range(40):
        assert canary.call(f"u{i}", i) == i
    assert time.monotonic() - t0 < 5.0  # 40 calls while the candidate hangs (wide bound)
    assert canary.shadow_dropped > 0  # a bounded number of copies wait; the rest are dropped
    release.set()
    _wait_for(lambda: canary._runner.pending == 0)
    k = canary.kpis()["candidate"]
    assert k.errors >= 1
    assert k.requests + canary.shadow_dropped == 40


@aio
async def test_async_shadow_with_a_timeout_books_an_error() -> None:
    async def stable(request: int) -> Reply:
        return Reply(request, tokens=10)

    async def slow(request: int) -> Reply:
        await asyncio.sleep(30)
        return Reply(request, tokens=10)

    canary = Canary(stable, slow, stages=(1.0,), shadow=True, gates=(), shadow_timeout=0.05)
    t0 = time.monotonic()
    assert [await canary.call_async(f"u{i}", i) for i in range(5)] == list(range(5))
    assert time.monotonic() - t0 < 5.0
    await asyncio.wait_for(asyncio.gather(*canary._tasks), 10)
    k = canary.kpis()["candidate"]
    assert k.requests == 5 and k.errors == 5
    assert canary.kpis()["stable"].errors == 0


# -- asyncio and threads -------------------------------------------------------------------


@aio
async def test_call_async_routes_and_books() -> None:
    async def arm(request: int) -> Reply:
        await asyncio.sleep(0)
        return Reply(request, tokens=7, calls=2)

    canary = Canary(arm, arm, stages=(0.5,), gates=())
    results = await asyncio.gather(*(canary.call_async(f"u{i}", i) for i in range(200)))
    assert results == list(range(200))
    k = canary.kpis()
    assert k["stable"].requests + k["candidate"].requests == 200
    assert k["stable"].calls + k["candidate"].calls == 400
    with pytest.raises(TypeError):
        canary.call("u1", 1)  # an async arm needs call_async


def test_threads_book_every_request_once() -> None:
    canary = Canary(reply(3), reply(5), stages=(0.3,), gates=DEFAULT_GATES, check_every=0.0)

    def worker(t: int) -> None:
        for i in range(500):
            canary.call(f"t{t}-{i}", i)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    k = canary.kpis()
    assert k["stable"].requests + k["candidate"].requests == 4000
    assert k["stable"].tokens == 3 * k["stable"].requests
    assert k["candidate"].tokens == 5 * k["candidate"].requests
    assert canary.state == "rolled_back"  # 5/3 tokens per answer: the gate tripped


# -- the pool ------------------------------------------------------------------------------


def test_a_pool_arm_settles_reports_and_counts_refusals(clock: rq.ManualClock) -> None:
    pool = rq.Pool(
        [rq.Provider("a", rpm=60, tpm=10_000, burst=2, clock=clock)], max_wait=0.0, clock=clock
    )
    statuses = iter([200, 429, 200])

    def send(provider: rq.Provider, request: int) -> Reply:
        status = next(statuses)
        return Reply(request, tokens=300 if status == 200 else 0, status=status, retry_after=30)

    arm = PoolArm(pool, send, tokens=1000)
    canary = Canary(reply(1), arm, stages=(1.0,), clock=clock, gates=())
    assert canary.call("u1", 1) == 1
    assert pool["a"].limiter.available("tokens") == pytest.approx(10_000 - 300, abs=1)
    assert canary.call("u2", 2) == 2  # a 429 answer
    assert pool.in_cooldown("a") and pool.cooldown_remaining("a") == pytest.approx(30)
    with pytest.raises(rq.PoolOverloaded):
        canary.call("u3", 3)  # the only provider cools down: refused, rate limited
    k = canary.kpis()["candidate"]
    assert (k.requests, k.calls, k.rate_limited_calls, k.errors, k.valid) == (3, 3, 2, 0, 1)


@aio
async def test_a_pool_arm_with_an_async_send(clock: rq.ManualClock) -> None:
    pool = rq.Pool([rq.Provider("b", rpm=600, clock=clock)], clock=clock)

    async def send(provider: rq.Provider, request: int) -> dict[str, Any]:
        return {"model": provider.name, "usage": {"total_tokens": 12}}

    canary = Canary(reply(1), PoolArm(pool, send), stages=(1.0,), clock=clock, gates=())
    assert (await canary.call_async("u", 1))["model"] == "b"
    assert canary.kpis()["candidate"].tokens == 12
    assert pool.stats()["b"]["ok"] == 1


# -- httpx ---------------------------------------------------------------------------------


def _model(name: str, tokens: int, seen: list[str]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(name)
        return httpx.Response(200, json={"model": name, "usage": {"total_tokens": tokens}})

    return httpx.MockTransport(handler)


def test_the_transport_routes_by_user_header_and_books_usage(clock: rq.ManualClock) -> None:
    seen: list[str] = []
    canary = Canary(reply(0), reply(0), stages=(0.3,), clock=clock, gates=())
    transport = CanaryTransport(canary, _model("a", 10, seen), _model("b", 40, seen))
    with httpx.Client(transport=transport, base_url="http://llm") as client:
        for i in range(300):
            user = f"u{i % 50}"
            r = client.post("/v1/chat", json={}, headers={"x-user-id": user})
            want = "b" if canary.arm_for(user) == "candidate" else "a"
            assert r.json()["model"] == want
    k = canary.kpis()
    assert k["stable"].requests + k["candidate"].requests == 300
    assert k["candidate"].tokens == 40 * k["candidate"].requests
    assert k["stable"].tokens_per_valid_answer == pytest.approx(10, rel=0.01)


def test_the_transport_books_calls_onto_the_enclosing_request(clock: rq.ManualClock) -> None:
    seen: list[str] = []
    canary = Canary(reply(0), reply(0), stages=(1.0,), clock=clock, gates=())
    transport = CanaryTransport(canary, _model("a", 10, seen), _model("b", 40, seen))
    with httpx.Client(transport=transport) as client, canary.request("u1") as req:
        for _ in range(3):
            client.post("http://llm/v1/chat", json={})
    assert seen == ["b"] * 3 and req.calls == 3
    k = canary.kpis()["candidate"]
    assert (k.requests, k.calls, k.tokens) == (1, 3, 120)


def test_the_transport_shadow_returns_stable_and_isolates_candidate_failures() -> None:
    seen: list[str] = []

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("candidate down")

    canary = Canary(reply(0), reply(0), stages=(1.0,), shadow=True, gates=())
    transport = CanaryTransport(canary, _model("a", 10, seen), httpx.MockTransport(broken))
    with httpx.Client(transport=transport) as client:
        for i in range(20):
            r = client.post("http://llm/v1/chat", json={"i": i}, headers={"x-user-id": f"u{i}"})
            assert r.json()["model"] == "a"
    _wait_for(lambda: canary.kpis()["candidate"].requests == 20)
    assert canary.kpis()["candidate"].errors == 20
    assert canary.kpis()["stable"].errors == 0


@aio
async def test_the_async_transport_with_shadow_copies() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        model = "cand" if request.url.host == "cand" else "stable"
        return httpx.Response(200, json={"echo": body, "usage": {"total_tokens": 5}, "m": model})

    canary = Canary(reply(0), reply(0), stages=(1.0,), shadow=True, gates=())
    transport = AsyncCanaryTransport(
        canary, httpx.MockTransport(handler), httpx.MockTransport(handler), key="x-user"
    )
    async with httpx.AsyncClient(transport=transport) as client:
        for i in range(10):
            r = await client.post("http://llm/", json={"i": i}, headers={"x-user": f"u{i}"})
            assert r.json()["echo"] == {"i": i}
        await asyncio.wait_for(asyncio.gather(*transport._tasks), 10)
    k = canary.kpis()
    assert k["stable"].requests == 10 and k["candidate"].requests == 10
    assert k["candidate"].tokens == 50


def test_a_forked_child_runs_shadow_copies_on_its_own_threads() -> None:
    canary = Canary(reply(1), reply(2), stages=(1.0,), shadow=True, gates=())
    canary.call("u0", 0)  # the parent's shadow thread exists
    _wait_for(lambda: canary.kpis()["candidate"].requests == 1)

    def child() -> None:
        canary.call("u1", 1)
        deadline = time.monotonic() + 10
        while canary.kpis()["candidate"].requests < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert canary.kpis()["candidate"].requests == 2

    check_child(fork_child(child, 20), 20)


@aio
async def test_an_async_pool_arm_is_shadowed_as_a_task(clock: rq.ManualClock) -> None:
    pool = rq.Pool([rq.Provider("c", rpm=6000, clock=clock)], clock=clock)
    loops: list[object] = []

    async def send(provider: rq.Provider, request: int) -> Reply:
        loops.append(asyncio.get_running_loop())
        return Reply(request, tokens=9)

    async def stable(request: int) -> int:
        return request

    canary = Canary(stable, PoolArm(pool, send), stages=(1.0,), shadow=True, clock=clock, gates=())
    assert await canary.call_async("u", 5) == 5
    await asyncio.wait_for(asyncio.gather(*canary._tasks), 10)
    assert loops == [asyncio.get_running_loop()]  # on the caller's loop, not a thread
    assert canary.kpis()["candidate"].tokens == 9


def test_the_transport_counts_429_and_reads_no_oversized_or_streamed_body(
    clock: rq.ManualClock,
) -> None:
    big = b'{"usage": {"total_tokens": 5}, "pad": "' + b"x" * 5000 + b'"}'

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/limited":
            return httpx.Response(429, headers={"retry-after": "1"}, json={"error": "slow down"})
        if path == "/big":
            return httpx.Response(200, content=big, headers={"content-type": "application/json"})
        if path == "/stream":
            return httpx.Response(200, stream=httpx.ByteStream(b'{"usage":{"total_tokens":5}}'))
        return httpx.Response(500, json={"error": "boom"})

    canary = Canary(reply(0), reply(0), stages=(1.0,), clock=clock, gates=())
    mock = httpx.MockTransport(handler)
    transport = CanaryTransport(canary, mock, mock, max_body=1000)
    with httpx.Client(transport=transport, base_url="http://llm") as client:
        assert client.post("/limited", headers={"x-user-id": "a"}).status_code == 429
        assert client.post("/big", headers={"x-user-id": "b"}).content == big
        assert client.post("/stream", headers={"x-user-id": "c"}).json()["usage"]
        assert client.post("/error", headers={"x-user-id": "d"}).status_code == 500
    k = canary.kpis()["candidate"]
    assert (k.requests, k.calls, k.rate_limited_calls, k.errors) == (4, 4, 1, 1)
    assert k.tokens == 0  # the big and the streamed answers were not parsed
    assert k.valid == 2 and k.invalid == 1


def test_the_transport_inside_an_arm_books_onto_the_canary_request(clock: rq.ManualClock) -> None:
    seen: list[str] = []
    canary = Canary(reply(0), reply(0), stages=(1.0,), clock=clock, gates=())
    transport = CanaryTransport(canary, _model("a", 10, seen), _model("b", 40, seen))
    client = httpx.Client(transport=transport, base_url="http://llm")

    def agent(task: int) -> str:  # an arm making two HTTP calls per task
        client.post("/v1/chat", json={})
        return str(client.post("/v1/chat", json={}).json()["model"])

    canary = Canary(agent, agent, stages=(0.5,), clock=clock, gates=())
    transport.canary = canary
    arms = [canary.call(f"u{i}", i) for i in range(40)]
    k = canary.kpis()
    on_b = arms.count("b")
    assert (k["candidate"].requests, k["candidate"].calls) == (on_b, 2 * on_b)
    assert k["candidate"].tokens == 80 * on_b
    assert k["stable"].calls_per_request == 2.0
    # Without a user key a request goes to stable.
    canary2 = Canary(reply(0), reply(0), stages=(1.0,), clock=clock, gates=())
    transport.canary = canary2
    assert client.post("/v1/chat", json={}).json()["model"] == "a"
    assert canary2.kpis()["stable"].requests == 1
    client.close()


def test_the_public_names() -> None:
    import ratequeue.canary as canary_pkg

    assert rq.Canary is Canary and "Canary" in rq.__all__
    for name in canary_pkg.__all__:
        assert getattr(canary_pkg, name) is not None
    public = {n for n in vars(canary_pkg) if not n.startswith("_")} - {"annotations"}
    modules = {"transport"}
    assert public - modules - set(canary_pkg.__all__) == set()


# -- invariants ----------------------------------------------------------------------------


@given(
    keys=st.lists(
        st.one_of(st.text(max_size=40), st.binary(max_size=40), st.integers()),
        min_size=1,
        max_size=50,
    ),
    fractions=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=6, unique=True),
    salt=st.text(max_size=20),
)
def test_routing_is_monotone_in_the_stage(
    keys: list[Any], fractions: list[float], salt: str
) -> None:
    stages = sorted(fractions)
    canary = Canary(reply(1), reply(1), stages=stages, salt=salt, gates=())
    previous: set[int] = set()
    for f in stages:
        canary._fraction = f
        on = {i for i, k in enumerate(keys) if canary.arm_for(k) == "candidate"}
        assert previous <= on
        assert all((canary.bucket(keys[i]) < f) == (i in on) for i in range(len(keys)))
        previous = on


@given(
    values=st.lists(st.floats(1e-3, 1e6), min_size=1, max_size=300),
    q=st.sampled_from([0.5, 0.9, 0.99]),
    confidence=st.floats(0.6, 0.999),
)
def test_bounds_bracket_the_estimate(values: list[float], q: float, confidence: float) -> None:
    h = rq.Histogram()
    h.record_many(values)
    z = z_of(confidence)
    e = quantile_bounds(h, q, z)
    assert e.lo <= e.value <= e.hi and e.n == len(values)
    total, sq = sum(values), sum(v * v for v in values)
    m = mean_bounds(len(values), total, sq, z)
    assert m.lo <= m.value <= m.hi
    hits = sum(v > 100 for v in values)
    w = wilson_bounds(hits, len(values), z)
    assert 0.0 <= w.lo <= w.value <= w.hi <= 1.0


def test_threads_with_shadow_copies_account_for_every_copy() -> None:
    canary = Canary(reply(1), reply(2), stages=(1.0,), shadow=True, gates=(), max_shadow=8)

    def worker(t: int) -> None:
        for i in range(300):
            assert canary.call(f"t{t}-{i}", i) == i

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _wait_for(lambda: canary._runner.pending == 0)
    k = canary.kpis()
    assert k["stable"].requests == 1800 and k["stable"].tokens == 1800
    assert k["candidate"].requests + canary.shadow_dropped == 1800
    assert k["candidate"].tokens == 2 * k["candidate"].requests


def test_prometheus_export(clock: rq.ManualClock) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from ratequeue.canary.metrics import CanaryCollector

    canary = Canary(
        reply(100), reply(150), stages=(0.5,), clock=clock, gates=TOKENS_GATE, name="gpt-next"
    )
    drive(canary, clock, 200, 1.0)
    registry = CollectorRegistry()
    CanaryCollector(canary, registry=registry)
    text = generate_latest(registry).decode()
    assert 'ratequeue_canary_state{name="gpt-next",state="rolled_back"} 1.0' in text
    assert 'ratequeue_canary_decisions_total{action="rollback",name="gpt-next"} 1.0' in text
    k = canary.kpis()["candidate"]
    assert (
        f'ratequeue_canary_requests_total{{arm="candidate",name="gpt-next"}} {k.requests}.0' in text
    )
    assert 'kpi="tokens_per_valid_answer",name="gpt-next"} 150' in text
    assert 'ratequeue_canary_fraction{name="gpt-next"} 0.0' in text
    with pytest.raises(TypeError):
        CanaryCollector(object())  # type: ignore[arg-type]


def test_shadow_copies_skip_streamed_or_large_bodies_and_read_bounded_answers() -> None:
    seen: list[int] = []

    def candidate(request: httpx.Request) -> httpx.Response:
        seen.append(len(request.content))
        return httpx.Response(200, content=b"x" * 10_000)  # too big to read for usage

    def stable(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"usage": {"total_tokens": 1}})

    canary = Canary(reply(0), reply(0), stages=(1.0,), shadow=True, gates=())
    transport = CanaryTransport(
        canary, httpx.MockTransport(stable), httpx.MockTransport(candidate), max_body=1000
    )
    with httpx.Client(transport=transport, base_url="http://llm") as client:
        h = {"x-user-id": "u"}
        assert client.post("/", content=b"a" * 100, headers=h).status_code == 200
        assert client.post("/", content=b"a" * 5000, headers=h).status_code == 200
        assert client.post("/", content=iter([b"a", b"b"]), headers=h).status_code == 200
    _wait_for(lambda: canary.kpis()["candidate"].requests == 1)
    assert seen == [100] and canary.shadow_dropped == 2
    assert canary.kpis()["candidate"].tokens == 0


@pytest.mark.parametrize(("n", "q"), [(5, 0.5), (30, 0.5), (57, 0.5), (200, 0.99), (400, 0.9)])
def test_order_ranks_are_the_exact_binomial_ranks(n: int, q: float) -> None:
    from math import comb

    c = 0.99
    cdf = []
    total = 0.0
    for j in range(n + 1):
        total += comb(n, j) * q**j * (1 - q) ** (n - j)
        cdf.append(total)  # P(Bin <= j)
    # Lower rank: the largest k with P(Bin >= k) = 1 - P(Bin <= k - 1) >= c; upper: the
    # smallest k with P(Bin <= k - 1) >= c (0 and n + 1 when there is none).
    want_lo = max([k for k in range(1, n + 1) if 1 - cdf[k - 1] >= c], default=0)
    want_hi = min([k for k in range(1, n + 1) if cdf[k - 1] >= c], default=n + 1)
    assert order_ranks(n, q, z_of(c)) == (want_lo, want_hi)


def test_the_transport_sends_the_candidate_to_another_endpoint_over_loopback(
    clock: rq.ManualClock,
) -> None:
    from ratequeue.canary.transport import to_endpoint
    from ratequeue.testing import MockProvider

    with MockProvider(6000, gen_time=0.0) as old, MockProvider(6000, gen_time=0.0) as new:
        canary = Canary(reply(0), reply(0), stages=(0.5,), clock=clock, gates=())
        transport = CanaryTransport(
            canary,
            httpx.HTTPTransport(),
            httpx.HTTPTransport(),
            candidate_request=to_endpoint(new.base_url),
        )
        users = [f"u{i}" for i in range(40)]
        used = {"stable": 0, "candidate": 0}
        with httpx.Client(transport=transport, timeout=10) as client:
            for u in users:
                r = client.post(old.url, json={"model": "m"}, headers={"x-user-id": u})
                assert r.status_code == 200
                used[canary.arm_for(u)] += r.json()["usage"]["total_tokens"]
        on_new = sum(canary.arm_for(u) == "candidate" for u in users)
        assert 0 < on_new < 40
        assert (old.stats()["requests"], new.stats()["requests"]) == (40 - on_new, on_new)
        k = canary.kpis()  # the mock's usage, read from each answer
        assert (k["stable"].tokens, k["candidate"].tokens) == (used["stable"], used["candidate"])
        assert used["candidate"] > 0


def test_with_model_rewrites_the_json_body_for_the_candidate_only(clock: rq.ManualClock) -> None:
    from ratequeue.canary.transport import to_endpoint, with_model

    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, json.loads(request.content)["model"]))
        return httpx.Response(200, json={"usage": {"total_tokens": 1}})

    canary = Canary(reply(0), reply(0), stages=(1.0,), shadow=True, clock=clock, gates=())
    mock = httpx.MockTransport(handler)
    rewrite = with_model("next", then=to_endpoint("http://candidate.internal"))
    transport = CanaryTransport(canary, mock, mock, candidate_request=rewrite)
    with httpx.Client(transport=transport) as client:
        client.post(
            "http://api/v1/chat", json={"model": "current", "x": 1}, headers={"x-user-id": "u"}
        )
    _wait_for(lambda: len(seen) == 2)
    assert sorted(seen) == [("api", "current"), ("candidate.internal", "next")]
    with pytest.raises(ValueError):
        with_model("")
    with pytest.raises(ValueError):
        to_endpoint("/relative")


def test_arms_behind_ratequeue_rate_limited_transports(clock: rq.ManualClock) -> None:
    from ratequeue.httpx import RateLimitedTransport

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"usage": {"total_tokens": 7}})

    mock = httpx.MockTransport(handler)
    # Each model behind its own limits: the candidate's key allows 2 requests at once.
    stable = RateLimitedTransport(mock, rq.Limiter(rq.Rate(600, per="minute"), clock=clock))
    cand_limit = rq.Limiter(rq.Rate(1, per="hour", burst=2), clock=clock)
    candidate = RateLimitedTransport(mock, cand_limit, timeout=0)
    canary = Canary(reply(0), reply(0), stages=(1.0,), clock=clock, gates=())
    with httpx.Client(transport=CanaryTransport(canary, stable, candidate)) as client:
        ok = refused = 0
        for i in range(5):
            try:
                client.post(
                    "http://llm/v1/chat/completions",
                    json={"model": "m"},
                    headers={"x-user-id": f"u{i}"},
                )
                ok += 1
            except rq.Overloaded:
                refused += 1
    assert (ok, refused) == (2, 3)
    k = canary.kpis()["candidate"]
    assert (k.requests, k.calls, k.rate_limited_calls, k.errors, k.valid) == (5, 5, 3, 0, 2)
    assert k.tokens == 14


def test_counts_beyond_2_53_are_refused_or_ignored(clock: rq.ManualClock) -> None:
    canary = Canary(reply(1), reply(1), stages=(1.0,), clock=clock, gates=())
    with pytest.raises(ValueError):
        canary.request("u").call(tokens=2**60)
    with pytest.raises(ValueError):
        Reply(None, tokens=2**60)

    def handler(request: httpx.Request) -> httpx.Response:  # a provider claiming nonsense
        return httpx.Response(200, content=b'{"usage": {"total_tokens": 1' + b"0" * 400 + b"}}")

    transport = CanaryTransport(canary, httpx.MockTransport(handler), httpx.MockTransport(handler))
    with httpx.Client(transport=transport) as client:
        assert client.post("http://llm/", headers={"x-user-id": "u"}).status_code == 200
    k = canary.kpis()["candidate"]
    assert (k.requests, k.tokens) == (1, 0)


def test_a_request_is_booked_once_when_threads_race_to_finish(clock: rq.ManualClock) -> None:
    canary = Canary(reply(1), reply(1), stages=(1.0,), clock=clock, gates=())
    for _ in range(50):
        req = canary.request("u")
        barrier = threading.Barrier(4)
        won: list[bool] = []

        def finish(r: Any = req, b: threading.Barrier = barrier, out: list[bool] = won) -> None:
            b.wait()
            out.append(r.finish())

        threads = [threading.Thread(target=finish) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert sorted(won) == [False, False, False, True]
    assert canary.kpis()["candidate"].requests == 50


def test_deeply_nested_bodies_are_not_json_never_an_error() -> None:
    # A body nested deeper than the JSON parser allows (from a caller, or from the remote
    # candidate provider) is "not JSON": no RecursionError reaches the caller.
    from ratequeue.canary.transport import _tokens, with_model

    deep = b"[" * 100_000 + b"]" * 100_000
    req = httpx.Request("POST", "http://x/v1/chat", content=deep)
    assert with_model("m2")(req).read() == deep
    resp = httpx.Response(
        200,
        content=deep,
        headers={"content-type": "application/json", "content-length": str(len(deep))},
    )
    resp.read()
    assert _tokens(resp, 10**7) == 0
