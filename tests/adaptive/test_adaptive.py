"""Adaptive limits: controllers' step responses, the queue-depth policy, signals, metrics."""

from __future__ import annotations

import asyncio
import http.server
import logging
import math
import threading
import time
from collections.abc import Iterator

import pytest
import ratequeue as rq
from forking import check_child, fork_child
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from ratequeue.adaptive import (
    AIMD,
    Adaptive,
    Controller,
    Gradient2,
    PrometheusGauges,
    QueueDepth,
    ScaleOut,
    Vegas,
    Window,
    parse_prometheus_text,
)
from ratequeue.adaptive.metrics import AdaptiveCollector
from ratequeue.lab.engine import VirtualTime

# -- step responses -----------------------------------------------------------------------
#
# A backend of capacity C holders: a latency of 1 s up to C in flight, growing in
# proportion beyond (a queue), and refusing (503) what exceeds C by more than 8 %. The
# client always has work (every free permit is taken), so the load is the limit.


def _concurrency_step(ctrl: Controller, c0: int, c1: int, n0: int, n1: int) -> list[int]:
    clock = rq.ManualClock()
    sem = rq.Concurrency(c0, clock=clock)
    a = Adaptive(sem, ctrl, interval=1.0, clock=clock)
    held: list[rq.Permit] = []
    trace: list[int] = []
    for i in range(n0 + n1):
        cap = c0 if i < n0 else c1
        for p in held:
            p.release()
        held = []
        while (p := sem.try_acquire()) is not None:
            held.append(p)
        load = sem.in_use
        rtt = max(1.0, load / cap)
        served = min(load, cap + int(cap * 0.08))
        for _ in range(round(served / rtt)):
            a.observe(rtt)
        for _ in range(load - served):
            a.report(503)
        clock.advance(1.0)
        a.step()
        trace.append(sem.limit)
    return trace


def _settled(trace: list[float], target: float) -> int | None:
    """The first index from which every value stays within 10 % of ``target``."""
    ok = [abs(x - target) <= 0.1 * target for x in trace]
    return next((k for k in range(len(ok)) if all(ok[k:])), None)


@pytest.mark.parametrize(
    ("make", "c1", "settle", "low", "high"),
    [
        (AIMD, 600, 106, 540, 649),
        (AIMD, 200, 6, 195, 217),
        (Vegas, 600, 7, 541, 609),
        (Vegas, 200, 76, 211, 220),
        (Gradient2, 600, 161, 540, 612),
        (Gradient2, 200, 13, 211, 219),
    ],
)
def test_each_controller_settles_within_10_percent_after_a_50_percent_step(
    make: type[Controller], c1: int, settle: int, low: int, high: int
) -> None:
    trace = _concurrency_step(make(), 400, c1, 300, 500)
    after = trace[300:]
    assert _settled(after, c1) == settle
    assert (min(after[settle:]), max(after[settle:])) == (low, high)
    # And it had settled on the old capacity before the step.
    assert _settled(trace[:300], 400) is not None


def _rate_step(c0: float, c1: float) -> list[float]:
    """A Limiter in front of a backend draining C requests/s, whose queue counts as
    full at one second of work; demand is twice the old capacity."""
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(3 * c0, per="second"), clock=clock)
    a = Adaptive(lim, QueueDepth(scale_out=lambda r: False), clock=clock)
    depth = 0.0
    trace: list[float] = []
    for i in range(400):
        cap = c0 if i < 200 else c1
        inflow = min(a.limit, 2.0 * c0)
        served = min(cap, depth + inflow)
        depth += inflow - served
        for _ in range(round(served)):
            a.observe(1.0)
        a.set_gauges(queue_depth=depth, queue_capacity=cap)
        clock.advance(1.0)
        a.step()
        trace.append(a.limit)
    return trace


@pytest.mark.parametrize(("c1", "settle"), [(150.0, 3), (50.0, 8)])
def test_queue_depth_settles_within_10_percent_after_a_50_percent_step(
    c1: float, settle: int
) -> None:
    trace = _rate_step(100.0, c1)
    assert _settled(trace[200:], c1) == settle
    assert _settled(trace[:200], 100.0) is not None


# -- controllers one interval at a time ----------------------------------------------------


def _w(**kw: object) -> Window:
    base: dict[str, object] = {"start": 0.0, "end": 1.0, "kind": "rate", "limit": 10.0}
    base.update(kw)
    return Window(**base)  # type: ignore[arg-type]


def test_aimd_formula() -> None:
    c = AIMD(increase=2.0, backoff=0.5, timeout=3.0)
    c.reset(10.0, min_limit=1.0, max_limit=13.0)
    assert c.update(_w(inflight=5.0)) == (12.0, "increase", "")
    assert c.update(_w(inflight=1.0)).limit == 12.0  # idle: no growth
    assert c.update(_w(inflight=12.0)).limit == 13.0  # max_limit
    assert c.update(_w(drops=1)).limit == 6.5
    assert c.update(_w(samples=3, rtt_mean=3.5, inflight=9.0)).reason == "timeout"
    assert c.estimate == 3.25
    for _ in range(10):
        c.update(_w(drops=1))
    assert c.estimate == 1.0  # min_limit
    with pytest.raises(ValueError):
        AIMD(backoff=1.0)
    with pytest.raises(TypeError):
        AIMD(increase="1")  # type: ignore[arg-type]


def test_vegas_formula() -> None:
    c = Vegas()
    c.reset(100.0)
    # The first samples set rtt_noload = 1.0.
    assert c.update(_w(samples=5, rtt_mean=1.0, rtt_min=1.0, inflight=100.0)).limit == 112.0
    # queue = ceil(112 * (1 - 1/1.1)) = 11: between alpha*2.05 and beta*2.05: hold.
    d = c.update(_w(samples=5, rtt_mean=1.1, rtt_min=1.1, inflight=112.0))
    assert d.limit == 112.0
    # queue = ceil(112 * (1 - 1/1.5)) = 38 > beta*log10(112): shrink by log10(112).
    d = c.update(_w(samples=5, rtt_mean=1.5, rtt_min=1.5, inflight=112.0))
    assert d.limit == pytest.approx(112.0 - math.log10(112.0))
    assert d.reason == "queueing"


def test_gradient2_formula() -> None:
    c = Gradient2(smoothing=0.5, queue_size=4.0, warmup=1, long_window=9)
    c.reset(20.0, max_limit=1000.0)
    # long = 1.0 (warm-up mean), short = 1.0: gradient 1, new = 20 + 4, smoothed 22.
    assert c.update(_w(samples=1, rtt_mean=1.0, inflight=20.0)).limit == 22.0
    # long = 1.0*0.8 + 2.0*0.2 = 1.2; gradient = 0.6; new = 22*0.6 + 4 = 17.2; -> 19.6
    d = c.update(_w(samples=1, rtt_mean=2.0, inflight=22.0))
    assert c.long_rtt == pytest.approx(1.2)
    assert d.limit == pytest.approx(19.6)
    assert d.reason == "queueing"
    # App-limited: no change, but the long average still moves.
    assert c.update(_w(samples=1, rtt_mean=1.0, inflight=1.0)).limit == pytest.approx(19.6)


# -- the queue-depth policy ---------------------------------------------------------------


def _qd(**kw: object) -> tuple[QueueDepth, list[ScaleOut]]:
    calls: list[ScaleOut] = []
    result = kw.pop("result", True)

    def hook(req: ScaleOut) -> bool:
        calls.append(req)
        return bool(result)

    c = QueueDepth(scale_out=hook, **kw)  # type: ignore[arg-type]
    c.reset(100.0, min_limit=1.0, classes=("batch", "interactive"))
    return c, calls


def _q(q: float, t: float, samples: int = 50, **kw: object) -> Window:
    return _w(
        start=t - 1.0,
        end=t,
        limit=100.0,
        samples=samples,
        rtt_mean=1.0,
        gauges={"queue_depth": q * 100.0, "queue_capacity": 100.0},
        **kw,
    )


def test_scale_out_is_asked_once_per_episode_with_hysteresis() -> None:
    c, calls = _qd(scale_out_timeout=5.0)
    for t, q in enumerate([0.2, 0.51, 0.49, 0.55, 0.25, 0.6, 0.35, 0.52], start=1):
        d = c.update(_q(q, t))
        assert d.limit == 100.0  # below 0.8 nothing is held
        # While the scale-out is pending (5 s), even q < 0.3 does not end the episode.
        if t >= 2:
            assert c.episode and c.scale_out_state == ("pending" if t < 7 else "done")
    assert [r.time for r in calls] == [2.0]
    assert calls[0].q == 0.51 and calls[0].throughput == 50.0
    c.update(_q(0.29, 9.0))  # below reset_below: the episode ends
    assert not c.episode
    c.update(_q(0.5, 10.0))
    assert [r.time for r in calls] == [2.0, 10.0]
    assert [e for _, e, _ in c.events] == [
        "episode_start",
        "scale_out",
        "episode_end",
        "episode_start",
        "scale_out",
    ]


def test_queue_depth_thresholds_scale_out_then_queue_then_shed() -> None:
    c, calls = _qd(result=False)
    # q = 0.6: scale-out asked (it fails), nothing held, nothing shed.
    assert c.update(_q(0.6, 1.0)) == (100.0, "", "")
    assert c.scale_out_state == "failed" and len(calls) == 1
    # q = 0.85: held at hold x drained (50/s) = 47.5; nothing refused yet.
    d = c.update(_q(0.85, 2.0))
    assert d.reason == "queue" and d.limit == pytest.approx(47.5)
    assert c.shed == ()
    # q = 1.7: beyond capacity the hold is divided by q (EMA of drained still 50).
    assert c.update(_q(1.7, 3.0)).limit == pytest.approx(47.5 / 1.7)
    # Rising on 3 intervals >= 0.8 after the failed scale-out: refuse the lowest class.
    d = c.update(_q(1.8, 4.0))
    assert d.reason == "shed" and c.shed == ("batch",)
    # Never the last class: past it, back off.
    before = c.estimate
    d = c.update(_q(1.9, 5.0))
    assert d.reason == "backoff" and c.shed == ("batch",)
    assert d.limit == pytest.approx(min(before * 0.9, 47.5 / 1.9))
    # Falling: no more shedding; below 0.5, re-admit first, then recover smoothly.
    assert c.update(_q(0.9, 6.0)).reason in ("", "queue")
    assert c.update(_q(0.4, 7.0)).reason == "admit" and c.shed == ()
    held = c.estimate
    d = c.update(_q(0.35, 8.0))
    assert d.reason == "recover" and d.limit == pytest.approx(held * 1.1)
    for t in range(9, 80):
        c.update(_q(0.0, float(t)))
    assert c.estimate == 100.0  # nominal


def test_queue_depth_does_not_shed_while_scale_out_is_pending() -> None:
    c, calls = _qd(scale_out_timeout=10.0)
    for t, q in enumerate([0.9, 1.0, 1.1, 1.2, 1.3], start=1):
        c.update(_q(q, float(t)))
    assert c.shed == () and c.scale_out_state == "pending"
    # Timed out: q still >= 0.5 ten seconds after the request, and still rising.
    for t, q in enumerate([1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0], start=6):
        c.update(_q(q, float(t)))
    assert c.scale_out_state == "timed_out"
    assert c.counts["timed_out"] == 1
    assert c.shed == ("batch",)
    assert len(calls) == 1


def test_queue_depth_without_gauges_holds_still_and_a_raising_hook_counts_as_failed() -> None:
    c, _ = _qd()
    assert c.update(_w(samples=5, rtt_mean=1.0)) == (100.0, "", "")

    def broken(req: ScaleOut) -> bool:
        raise RuntimeError("autoscaler down")

    c = QueueDepth(scale_out=broken, capacity=10.0)
    c.reset(100.0)
    c.update(_w(gauges={"queue_depth": 6.0}))  # capacity from the controller: q = 0.6
    assert c.scale_out_state == "failed" and c.counts["error"] == 1
    with pytest.raises(ValueError):
        QueueDepth(queue_at=0.4)  # below scale_out_at
    with pytest.raises(TypeError):
        QueueDepth(scale_out=42)  # type: ignore[arg-type]


# -- the Adaptive wrapper -----------------------------------------------------------------


def test_rate_changes_reschedule_waiters_and_grants_stay_exact() -> None:
    vt = VirtualTime()
    lim = vt.limiter(rq.Rate(1, per="second", burst=1))
    a = Adaptive(lim, AIMD(increase=1.0), clock=vt.clock)
    grants: list[float] = []
    for _ in range(8):
        vt.submit(lim, lambda ok, _w: grants.append(vt.now))
    vt.at(2.5, lambda: a.step(force=True))
    vt.run()
    # 1/s until 2.5 s, then 2/s: the half token still owed at 2.5 costs 0.25 s.
    assert grants == [0.0, 1.0, 2.0, 2.75, 3.25, 3.75, 4.25, 4.75]
    assert a.limit == 2.0
    (change,) = a.changes
    assert (change.time, change.old, change.new, change.reason) == (2.5, 1.0, 2.0, "increase")


def test_every_change_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, per="second"), clock=clock, name="llm")
    a = Adaptive(lim, AIMD(), interval=2.0, history=2)
    with caplog.at_level(logging.INFO, logger="ratequeue.adaptive"):
        clock.advance(1.0)
        assert a.step() is None  # the interval is not over
        clock.advance(1.0)
        a.report(503)
        change = a.step()
        assert change is not None and change.new == 9.0 and change.reason == "drop"
        for _ in range(3):
            clock.advance(2.0)
            a.observe(None, dropped=True)
            a.step()
    assert "adaptive llm: limit 10 -> 9 (drop: 1 dropped)" in caplog.text
    assert len(a.changes) == 2  # history bound
    assert a.reasons["drop"] == 4
    assert lim.rates[0].amount == pytest.approx(10 * 0.9**4)


def test_an_outside_change_of_the_limit_is_adopted() -> None:
    clock = rq.ManualClock()
    sem = rq.Concurrency(10, clock=clock)
    a = Adaptive(sem, AIMD(), clock=clock)
    sem.set_limit(40)
    held = [sem.try_acquire() for _ in range(30)]
    clock.advance(1.0)
    a.observe(0.1)
    assert a.step() is not None
    assert sem.limit == 41
    for p in held:
        assert p is not None
        p.release()


def test_min_and_max_limits_and_concurrency_rounding() -> None:
    clock = rq.ManualClock()
    sem = rq.Concurrency(3, clock=clock)
    a = Adaptive(sem, AIMD(backoff=0.5), clock=clock, min_limit=2, max_limit=4)
    for _ in range(3):
        clock.advance(1.0)
        a.report(429)
        a.step()
    assert sem.limit == 2
    assert a.controller.estimate == 2.0
    with pytest.raises(ValueError):
        Adaptive(sem, AIMD(), min_limit=5, max_limit=4)


def test_bad_arguments_are_refused() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10), rq.Rate(100, unit="tokens"), clock=clock)
    with pytest.raises(TypeError):
        Adaptive(object(), AIMD())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Adaptive(lim, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Adaptive(lim, AIMD(), interval=0)
    with pytest.raises(ValueError):
        Adaptive(lim, AIMD(), which="dollars")
    with pytest.raises(ValueError):
        Adaptive(lim, AIMD(), which=2)
    with pytest.raises(ValueError):
        Adaptive(lim, AIMD(), shed_order=["vip"])
    a = Adaptive(lim, AIMD(), which="tokens")
    assert a.limit == 100.0
    with pytest.raises(ValueError):
        a.observe(-1.0)
    with pytest.raises(ValueError):
        a.observe(math.nan)
    with pytest.raises(TypeError):
        a.observe("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        a.report(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        a.report(99)
    with pytest.raises(ValueError):
        a.set_gauges(queue_depth=math.inf)
    with pytest.raises(ValueError):
        a.set_gauges(**{f"g{i}": 1.0 for i in range(65)})
    with pytest.raises(ValueError):
        a.start()  # a ManualClock is driven by step()


def test_gauges_from_a_callback_and_a_failing_callback() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(100, per="second"), clock=clock)
    readings: list[dict[str, float]] = [{"queue_depth": 90.0, "queue_capacity": 100.0}]

    def gauges() -> dict[str, float]:
        if not readings:
            raise OSError("endpoint down")
        return readings[-1]

    calls: list[ScaleOut] = []
    a = Adaptive(lim, QueueDepth(scale_out=lambda r: calls.append(r) is None), gauges=gauges)
    a.note_arrival()
    clock.advance(1.0)
    a.step()
    assert len(calls) == 1 and calls[0].demand == 1.0
    assert a.last_window is not None and a.last_window.queue_fraction == 0.9
    readings.clear()
    clock.advance(1.0)
    assert a.step() is None
    assert a.gauge_errors == 1


def test_timed_acquire_records_latency_drops_and_shedding() -> None:
    clock = rq.ManualClock()
    sem = rq.Concurrency(4, clock=clock, classes={"interactive": 8, "batch": 1})
    a = Adaptive(sem, QueueDepth(scale_out=lambda r: False), clock=clock)
    assert a.shed_order == ("interactive", "batch")
    a = Adaptive(
        sem, QueueDepth(scale_out=lambda r: False), clock=clock, weights={"interactive": 8}
    )
    assert a.shed_order == ("batch", "interactive")
    with a.acquire(priority="batch") as permit:
        assert sem.in_use == 1
        clock.advance(0.25)
    assert permit.released
    with pytest.raises(TimeoutError), a.acquire(priority="interactive"):
        raise TimeoutError
    clock.advance(0.75)
    a.step()
    w = a.last_window
    assert w is not None
    assert (w.samples, w.rtt_mean, w.drops, w.arrivals, w.inflight) == (1, 0.25, 1, 2, 1.0)
    # Shed "batch": the wrapper refuses it at once and counts it.
    for t, q in enumerate([0.9, 1.0, 1.1, 1.2], start=2):
        a.set_gauges(queue_depth=q * 10, queue_capacity=10)
        a.observe(1.0)
        clock.set(float(t))
        a.step()
    assert a.shed == ("batch",)
    assert not a.admits("batch") and a.admits("interactive") and a.admits(None)
    with pytest.raises(rq.Overloaded) as e, a.acquire(priority="batch"):
        pass
    assert e.value.retry_after == 1.0
    assert a.stats()["refused"] == {"batch": 1}
    with pytest.raises(TypeError), a.acquire(tokens=3):
        pass


def test_timed_acquire_async() -> None:
    async def main() -> Adaptive:
        lim = rq.Limiter(rq.Rate(100, per="second"), classes={"interactive": 8, "batch": 1})
        a = Adaptive(lim, Gradient2())
        async with a.acquire_async(priority="interactive"):
            await asyncio.sleep(0)
        with pytest.raises(asyncio.TimeoutError):
            async with a.acquire_async(priority="batch"):
                raise asyncio.TimeoutError
        return a

    a = asyncio.run(main())
    a.step(force=True)
    w = a.last_window
    assert w is not None and (w.samples, w.drops, w.arrivals) == (1, 1, 2)


def test_the_driver_thread_steps_on_a_real_clock_and_stops() -> None:
    lim = rq.Limiter(rq.Rate(10, per="second"))
    a = Adaptive(lim, AIMD(), interval=0.02)
    with a:
        deadline = time.monotonic() + 10.0
        while a.reasons["drop"] < 2 and time.monotonic() < deadline:
            a.report(503)
            time.sleep(0.01)
    assert a.reasons["drop"] >= 2
    assert a._thread is None
    a.close()  # idempotent


def test_run_in_an_event_loop_until_cancelled() -> None:
    async def main() -> int:
        lim = rq.Limiter(rq.Rate(10, per="second"))
        a = Adaptive(lim, AIMD(), interval=0.01, gauges=dict)
        task = asyncio.create_task(a.run())
        for _ in range(1000):
            a.report(503)
            await asyncio.sleep(0.005)
            if a.reasons["drop"] >= 2:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return a.reasons["drop"]

    assert asyncio.run(main()) >= 2


# -- Prometheus text ----------------------------------------------------------------------

VLLM = """\
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama",engine="0"} 7.0
vllm:num_requests_waiting{model_name="llama",engine="1"} 5
vllm:num_requests_waiting{model_name="other"} 100
vllm:gpu_cache_usage_perc{model_name="llama"} 0.73 1712000000000
escaped{path="a\\"b\\\\c\\nd", x="}"} +Inf
nan_metric NaN
"""


def test_prometheus_text_is_parsed_with_labels_escapes_and_special_values() -> None:
    parsed = parse_prometheus_text(VLLM)
    assert parsed.malformed == 0
    assert parsed.value("vllm:num_requests_waiting") == 112.0
    assert parsed.value("vllm:num_requests_waiting", {"model_name": "llama"}) == 12.0
    assert parsed.value("vllm:gpu_cache_usage_perc") == 0.73
    (esc,) = [s for s in parsed.samples if s.name == "escaped"]
    assert esc.labels == {"path": 'a"b\\c\nd', "x": "}"} and esc.value == math.inf
    assert math.isnan(parsed.value("nan_metric") or 0.0)
    assert parsed.value("absent") is None
    only = parse_prometheus_text(VLLM.encode(), names=["vllm:gpu_cache_usage_perc"])
    assert [s.name for s in only.samples] == ["vllm:gpu_cache_usage_perc"]


@pytest.mark.parametrize(
    "line",
    [
        "no_value",
        "bad value",
        "1bad 2",
        'm{a="x"',
        "m{a=x} 1",
        'm{a="x} 1',
        'm{9a="x"} 1',
        'm{a="x"}} 1',
        "m 1 2 3",
        "m 1 notatimestamp",
        "m 0x10",
        "m{" + ",".join(f'l{i}="v"' for i in range(70)) + "} 1",
    ],
)
def test_malformed_lines_are_counted_and_skipped(line: str) -> None:
    parsed = parse_prometheus_text(f"ok 1\n{line}\nalso_ok 2\n")
    assert parsed.malformed == 1
    assert [s.name for s in parsed.samples] == ["ok", "also_ok"]


def test_huge_input_is_bounded() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        parse_prometheus_text("m 1\n" * 10, max_bytes=16)
    with pytest.raises(ValueError, match="max_bytes"):
        parse_prometheus_text(b"m 1\n" * 10, max_bytes=16)
    with pytest.raises(TypeError):
        parse_prometheus_text(42)  # type: ignore[arg-type]
    long_line = 'm{a="' + "x" * 20_000 + '"} 1\nok 1\n'
    parsed = parse_prometheus_text(long_line)
    assert parsed.malformed == 1 and len(parsed.samples) == 1
    many = parse_prometheus_text("m 1\n" * 1000, max_samples=10)
    assert len(many.samples) == 10 and many.dropped == 990


def test_prometheus_gauges_scrape_at_an_interval_and_expire() -> None:
    now = [0.0]
    bodies: list[bytes | Exception] = []
    fetched: list[str] = []

    def fetch(url: str, timeout: float, max_bytes: int) -> bytes:
        fetched.append(url)
        b = bodies.pop(0)
        if isinstance(b, Exception):
            raise b
        return b

    g = PrometheusGauges(
        "http://engine:8000/metrics",
        {
            "queue_depth": ("vllm:num_requests_waiting", {"model_name": "llama"}),
            "kv_cache": "vllm:gpu_cache_usage_perc",
        },
        interval=5.0,
        constants={"queue_capacity": 64},
        fetch=fetch,
        clock=lambda: now[0],
    )
    bodies.append(VLLM.encode())
    assert g() == {"queue_depth": 12.0, "kv_cache": 0.73, "queue_capacity": 64.0}
    now[0] = 4.0
    assert g()["queue_depth"] == 12.0 and len(fetched) == 1  # cached
    now[0] = 5.0
    bodies.append(OSError("refused"))
    assert g()["queue_depth"] == 12.0  # still fresh enough
    assert g.errors == 1 and g.last_error == "OSError: refused"
    now[0] = 16.0
    bodies.append(ValueError("too large"))
    assert g() == {}  # older than max_age (3 intervals): no stale readings
    with pytest.raises(ValueError):
        PrometheusGauges("file:///etc/passwd", {"q": "m"})
    with pytest.raises(ValueError):
        PrometheusGauges("http://x/metrics", {"q": "not a name"})
    with pytest.raises(ValueError):
        PrometheusGauges("http://x/metrics", {})


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, list[bytes]]]:
    bodies = [VLLM.encode()]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies[0]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_prometheus_gauges_over_http_with_a_bounded_body(
    metrics_server: tuple[str, list[bytes]],
) -> None:
    url, bodies = metrics_server
    g = PrometheusGauges(url, {"queue_depth": "vllm:num_requests_waiting"}, max_bytes=4096)
    assert g.scrape() == {"queue_depth": 112.0}
    bodies[0] = b"m 1\n" * 5000
    with pytest.raises(ValueError, match="max_bytes"):
        g.scrape()


# -- metrics ------------------------------------------------------------------------------


def test_metrics_export_limit_changes_shedding_and_scale_outs() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(
        rq.Rate(100, per="second"), clock=clock, classes={"interactive": 8, "batch": 1}
    )
    a = Adaptive(
        lim,
        QueueDepth(scale_out=lambda r: False),
        clock=clock,
        name="cluster",
        shed_order=("batch", "interactive"),
    )
    for t, q in enumerate([0.9, 1.0, 1.1, 1.2], start=1):
        a.set_gauges(queue_depth=q * 10, queue_capacity=10, kv_cache=0.5)
        a.observe(0.5)
        clock.set(float(t))
        a.step()
    registry = CollectorRegistry()
    AdaptiveCollector(a, registry=registry)
    text = generate_latest(registry).decode()
    assert 'ratequeue_adaptive_limit{name="cluster"}' in text
    assert 'ratequeue_adaptive_changes_total{name="cluster",reason="queue"} 1.0' in text
    assert 'ratequeue_adaptive_changes_total{name="cluster",reason="shed"} 1.0' in text
    assert 'ratequeue_adaptive_shed{class="batch",name="cluster"} 1.0' in text
    assert 'ratequeue_adaptive_shed{class="interactive",name="cluster"} 0.0' in text
    assert 'ratequeue_adaptive_scale_out_total{name="cluster",outcome="failed"} 1.0' in text
    assert 'ratequeue_adaptive_signal{name="cluster",signal="gauge_kv_cache"} 0.5' in text
    assert not any(line.startswith("ratequeue_adaptive_max_limit{") for line in text.split("\n"))
    with pytest.raises(TypeError):
        AdaptiveCollector(lim)  # type: ignore[arg-type]


def test_exported_from_the_package() -> None:
    for name in ("Adaptive", "AIMD", "Vegas", "Gradient2", "QueueDepth"):
        assert name in rq.__all__
        assert getattr(rq, name) is getattr(rq.adaptive, name)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_the_driver_thread_restarts_in_a_forked_child() -> None:
    lim = rq.Limiter(rq.Rate(10, per="second"))
    a = Adaptive(lim, AIMD(), interval=0.02).start()

    def child() -> None:  # a new driver thread steps on its own
        deadline = time.monotonic() + 10.0
        while a.reasons["drop"] < 1 and time.monotonic() < deadline:
            a.report(503)
            time.sleep(0.01)
        assert a.reasons["drop"] >= 1
        assert a._thread is not None and a._thread.is_alive()
        a.close()

    try:
        check_child(fork_child(child, 20), 20)
    finally:
        a.close()


# -- invariants over random signals --------------------------------------------------------

_windows = st.lists(
    st.tuples(
        st.integers(0, 50),  # samples
        st.floats(0.001, 100.0),  # mean latency
        st.integers(0, 5),  # drops
        st.floats(0.0, 3.0),  # q
    ),
    max_size=60,
)


@given(
    kind=st.sampled_from(["aimd", "vegas", "gradient2", "queue-depth"]),
    windows=_windows,
    hook=st.booleans(),
)
def test_any_signals_keep_the_limit_within_bounds_and_the_top_class_admitted(
    kind: str, windows: list[tuple[int, float, int, float]], hook: bool
) -> None:
    ctrl: Controller = {
        "aimd": AIMD,
        "vegas": Vegas,
        "gradient2": Gradient2,
        "queue-depth": lambda: QueueDepth(scale_out=lambda r: hook),
    }[kind]()
    clock = rq.ManualClock()
    lim = rq.Limiter(
        rq.Rate(100, per="second"), clock=clock, classes={"interactive": 8, "batch": 1}
    )
    a = Adaptive(
        lim, ctrl, clock=clock, min_limit=5, max_limit=300, shed_order=("batch", "interactive")
    )
    for samples, rtt, drops, q in windows:
        for _ in range(samples):
            a.observe(rtt)
        for _ in range(drops):
            a.report(503)
        a.set_gauges(queue_depth=q * 10, queue_capacity=10)
        clock.advance(1.0)
        a.step()
        assert 5.0 <= a.limit <= 300.0
        assert a.admits("interactive")
        assert lim.rates[0].amount == a.limit
    assert len(a.changes) <= len(windows)


@given(st.text(max_size=2000) | st.binary(max_size=2000).map(lambda b: b.decode("latin-1")))
def test_the_parser_never_raises_on_junk_within_bounds(text: str) -> None:
    parsed = parse_prometheus_text(text)
    lines = [x for x in text.split("\n") if x.strip() and not x.strip().startswith("#")]
    assert len(parsed.samples) + parsed.malformed == len(lines)


def test_a_limit_the_level_refuses_leaves_it_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10**9 - 1, per="second", burst=1), clock=clock)
    a = Adaptive(lim, AIMD(increase=10.0**9), clock=clock)
    assert lim.try_acquire() and not lim.try_acquire()  # in use: AIMD wants to grow
    with caplog.at_level(logging.WARNING, logger="ratequeue.adaptive"):
        clock.advance(1.0)
        assert a.step() is None
    assert "cannot set the limit" in caplog.text
    assert a.limit == 10**9 - 1 and a.controller.estimate == 10**9 - 1


def test_follow_takes_drops_from_the_pools_reports() -> None:
    clock = rq.ManualClock()
    a_lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    b_lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    pool = rq.Pool([rq.Provider("a", limiter=a_lim), rq.Provider("b", limiter=b_lim)], clock=clock)
    ad = rq.Adaptive(a_lim, rq.AIMD(), interval=1.0, clock=clock)
    stop = ad.follow(pool, provider="a")
    pool.report("a", 429)
    pool.report("a", 503)
    pool.report("a", 200)
    pool.report("b", 429)  # another provider: not ours
    pool.report("a", 404)  # the caller's fault: no drop
    assert ad._acc.drops == 2
    stop()
    pool.report("a", 429)
    assert ad._acc.drops == 2


def test_a_failing_pool_listener_never_reaches_the_reporter(caplog) -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    pool = rq.Pool([rq.Provider("a", limiter=lim)], clock=clock)
    seen = []

    def bad(name, status, failed):
        raise RuntimeError("listener bug")

    pool.subscribe(bad)
    pool.subscribe(lambda *a: seen.append(a))
    assert pool.report("a", 429, retry_after=2) == 2.0
    assert seen == [("a", 429, True)]
    assert "listener bug" in caplog.text
    with pytest.raises(TypeError):
        pool.subscribe(42)
