"""Issue 11: every input gets a clear answer and every number printed is the truth
(Prometheus export of every limit type, the lab, the CLI, the load test, the pool and the
mock provider)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ratequeue as rq
from prometheus_client import CollectorRegistry, Counter, generate_latest
from ratequeue import lab
from ratequeue.cli.loadtest import LoadTestConfig, _make_limiter
from ratequeue.prometheus import RateQueueCollector
from ratequeue.testing import MockProvider

# -- Prometheus -------------------------------------------------------------------------


def test_collector_exports_keyed_limits_and_policies_without_breaking_the_scrape() -> None:
    registry = CollectorRegistry()
    other = Counter("other_total", "another collector's metric", registry=registry)
    other.inc()
    keyed = rq.KeyedLimiter(rq.Rate(10, burst=2), name="users")
    tenants = rq.KeyedConcurrency(2, name="tenants")
    cluster = rq.Limiter(rq.Rate(100, burst=10), name="cluster")
    policy = rq.Policy({"user": keyed, "tenant": tenants, "cluster": cluster})
    RateQueueCollector(keyed, tenants, policy, registry=registry)
    permit = policy.try_acquire(user="alice", tenant="acme")
    assert permit is not None
    permit.release()
    keyed.try_acquire("alice")
    keyed.try_acquire("alice")  # the bucket of 2 is empty now (the policy took one)
    text = generate_latest(registry).decode()
    assert "other_total 1.0" in text
    assert 'ratequeue_keys{limiter="users"} 1.0' in text
    assert 'ratequeue_decisions_total{limiter="users",outcome="tried_refused"} 1.0' in text
    assert 'ratequeue_policy_admitted_total{policy="policy2"} 1.0' in text
    assert 'ratequeue_policy_refused_total{level="user",policy="policy2",shadow="false"}' in text
    assert 'ratequeue_limit{limiter="tenants"} 2.0' in text


@pytest.mark.parametrize("source", [object(), "limiter", None, rq.Histogram()])
def test_collector_refuses_what_it_cannot_export_when_added(source: object) -> None:
    with pytest.raises(TypeError, match="RateQueueCollector exports"):
        RateQueueCollector(source)  # type: ignore[arg-type]
    collector = RateQueueCollector()
    with pytest.raises(TypeError, match="RateQueueCollector exports"):
        collector.add(source)  # type: ignore[arg-type]


# -- the lab ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"base": 0.0}, {"cap": 0.0}, {"base": -1.0}, {"cap": math.inf}, {"base": math.nan}],
)
def test_naive_retry_refuses_backoffs_that_would_stop_virtual_time(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        lab.NaiveRetry(**kwargs)


def test_naive_retry_with_a_tiny_backoff_still_finishes() -> None:
    # A backoff of 1 ns: each retry still moves virtual time on (by a round trip, 1 ms).
    sc = lab.Scenario(
        requests=100,
        rhos=(0.5,),
        strategies=(lab.NaiveRetry(base=1e-9, cap=1e-9),),
        burst=0,
    )
    level = lab.run_level(sc, 0.5)
    [row] = level.rows
    assert row.shed == 0 and row.served == row.requests > 0


@pytest.mark.parametrize(
    "spec", ["foo", "onoff:60", "poisson:3", "constant:1", "burst:0", "batches:0", "onoff:a:b"]
)
def test_bad_arrival_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="arriv"):
        lab.parse_arrivals(spec)


def test_good_arrival_specs_parse() -> None:
    from ratequeue.lab.arrivals import Batches, Burst, OnOff

    assert lab.parse_arrivals("onoff:30:10") == OnOff(30.0, 10.0)
    assert lab.parse_arrivals("onoff:30:0") == OnOff(30.0, 0.0)
    assert lab.parse_arrivals("burst:7") == Burst(7)
    assert lab.parse_arrivals("batches:3") == Batches(3)


def _trace(tmp_path: Path, per_minute: float, n: int) -> Path:
    path = tmp_path / "trace.csv"
    gap = 60.0 / per_minute
    path.write_text("t\n" + "".join(f"{i * gap}\n" for i in range(n)))
    return path


def test_replay_raw_reports_the_trace_rate_and_no_theory(tmp_path: Path) -> None:
    trace = _trace(tmp_path, per_minute=120.0, n=400)
    sc = lab.Scenario(
        limit=lab.ProviderLimit(100.0, 1),
        requests=300,
        arrivals=lab.parse_arrivals(f"replay-raw:{trace}"),
        strategies=(lab.Queue(),),
        burst=0,
        warmup=0.0,
    )
    report = lab.run_scenario(sc, progress=False)
    [level] = report.levels  # the trace's own load: one level, whatever rhos say
    assert level.arrivals == 300  # --requests is honoured: the first 300 arrivals
    assert level.rate * 60 == pytest.approx(120.0)
    assert level.rho == pytest.approx(1.2)
    assert level.theory == {}
    text = lab.format_report(report)
    assert "rho = 1.2 (the trace's own): 120.0 requests/min" in text
    assert "M/D/1 theory" not in text


def test_theory_is_shown_only_for_poisson_arrivals() -> None:
    poisson = lab.run_level(lab.Scenario(requests=200, strategies=(lab.Queue(),), burst=0), 0.5)
    constant = lab.run_level(
        lab.Scenario(
            requests=200,
            strategies=(lab.Queue(),),
            burst=0,
            arrivals=lab.parse_arrivals("constant"),
        ),
        0.5,
    )
    assert poisson.theory and constant.theory == {}


# -- the command line -----------------------------------------------------------------------


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ratequeue", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["lab", "--rho", "0"],
        ["lab", "--requests", "0"],
        ["lab", "--rpm", "0"],
        ["lab", "--rpm", "nan"],
        ["lab", "--arrivals", "foo"],
        ["lab", "--arrivals", "replay:/no/such/file.csv"],
        ["lab", "--arrivals", "onoff:60"],
        ["lab", "--arrivals", "poisson:3"],
        ["lab", "--arrivals", "burst:0"],
        ["lab", "--burst-requests", "-5"],
        ["lab", "--formats", "xyz"],
        ["lab", "--strategies", "naive", "--backoff-base", "0"],
        ["lab", "--strategies", "naive", "--backoff-cap", "0"],
        ["lab", "--strategies", "naive", "--backoff-base", "-1"],
        ["lab", "--strategies", "nope"],
        ["lab", "--interactive-share", "2"],
        ["demo", "--rpm", "0"],
        ["demo", "--burst", "-1"],
        ["mock-provider", "--rpm", "60", "--port", "99999"],
        ["mock-provider", "--rpm", "0"],
        ["loadtest", "/no/such/config.json"],
    ],
)
def test_cli_bad_input_is_a_usage_error_not_a_traceback(args: list[str]) -> None:
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "error:" in r.stderr


def test_cli_lab_with_a_raw_replay_runs(tmp_path: Path) -> None:
    trace = _trace(tmp_path, per_minute=120.0, n=50)
    r = _cli(
        "lab",
        "--arrivals",
        f"replay-raw:{trace}",
        "--strategies",
        "queue",
        "--formats",
        "",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert "the trace's own" in r.stdout


# -- the load test config -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"endpoint": "mock", "limits": {"rpmm": 60}}, "rpmm"),
        ({"endpoint": "mock", "mock": {"rpmm": 60}}, "rpmm"),
        ({"endpoint": "mock", "retry_429": -1}, "retry_429"),
        ({"endpoint": "mock", "concurrency": 1.5}, "concurrency"),
        ({"endpoint": "mock", "concurrency": True}, "concurrency"),
        ({"endpoint": "mock", "limits": {"rpm": 0}}, "limits.rpm"),
        ({"endpoint": "mock", "limits": {"rpm": -5}}, "limits.rpm"),
        ({"endpoint": "mock", "limits": {"rpm": 60, "burst": 0}}, "limits.burst"),
        ({"endpoint": "mock", "limits": {"rpm": 60, "max_wait": -1}}, "limits.max_wait"),
        ({"endpoint": "mock", "mock": {"rpm": 0}}, "mock.rpm"),
        ({"endpoint": "mock", "rps": "fast"}, "rps"),
        ({"endpoint": "mock", "duration": math.inf}, "duration"),
    ],
)
def test_loadtest_config_mistakes_are_refused(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        LoadTestConfig.from_dict(config)


def test_loadtest_client_burst_defaults_to_the_providers() -> None:
    cfg = LoadTestConfig.from_dict(
        {"endpoint": "mock", "mock": {"rpm": 120, "burst": 2}, "limits": {"rpm": 120}}
    )
    limiter, _ = _make_limiter(cfg)
    assert limiter is not None
    assert limiter.rates[0].burst == 2
    cfg = LoadTestConfig.from_dict({"endpoint": "mock", "limits": {"rpm": 600}})
    limiter, _ = _make_limiter(cfg)
    assert limiter is not None
    assert limiter.rates[0].burst == 10  # one second's worth, as the mock's own default


# -- the pool ---------------------------------------------------------------------------


def _pool(**kw: object) -> rq.Pool:
    clock = rq.ManualClock()
    return rq.Pool(
        [rq.Provider("a", rpm=60, clock=clock), rq.Provider("b", rpm=60, clock=clock)], **kw
    )


def test_an_infinite_retry_after_is_capped_by_max_cooldown() -> None:
    pool = _pool(max_cooldown=120.0)
    assert pool.report("a", status=429, retry_after="inf") == 120.0
    assert pool.report("b", status=429, retry_after=math.inf) == 120.0
    assert pool.cooldown_remaining("a") == 120.0


@pytest.mark.parametrize("status", [0, -1, 99, 600, 1000])
def test_a_status_that_is_not_http_is_refused(status: int) -> None:
    with pytest.raises(ValueError, match="status"):
        _pool().report("a", status=status)


def test_an_infinite_max_wait_means_no_bound() -> None:
    pool = _pool(max_wait=math.inf)
    assert pool.max_wait is None
    provider, _ = pool.acquire()
    assert provider.name in ("a", "b")
    provider, _ = pool.acquire(timeout=math.inf)
    with pytest.raises(ValueError, match="max_wait"):
        _pool(max_wait=-1.0)
    with pytest.raises(TypeError, match="max_wait"):
        _pool(max_wait="5")


# -- the mock provider ----------------------------------------------------------------------


def test_mock_provider_answers_only_completions_as_completions() -> None:
    with MockProvider(6000, gen_time=0.0) as mock:
        base = mock.base_url

        def status(path: str, method: str, body: bytes | None = None) -> int:
            req = urllib.request.Request(base + path, data=body, method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return int(resp.status)
            except urllib.error.HTTPError as e:
                return int(e.code)

        assert status("/v1/chat/completions", "POST", b"{}") == 200
        assert status("/v1/chat/completions", "GET") == 405
        assert status("/v1/other", "POST", b"{}") == 404
        assert status("/", "GET") == 404
        assert status("/v1/chat/completions", "DELETE") == 405
        assert status("/stats", "GET") == 200
        stats = json.loads(urllib.request.urlopen(base + "/stats", timeout=10).read())
        assert stats["requests"] == 1  # only the one real completion was counted


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"rpm": 0}, ValueError), ({"rpm": "60"}, TypeError), ({"rpm": 60, "burst": 0}, ValueError)],
)
def test_mock_provider_refuses_bad_settings(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        MockProvider(**kwargs)


# -- Redis ------------------------------------------------------------------------------


def test_redis_refusal_keeps_its_cause() -> None:
    from ratequeue.redis import RedisLimiter, RedisUnavailable, connect
    from redis_server import free_port

    client = connect(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    lim = RedisLimiter(client, rq.Rate(10), name="cause")
    with pytest.raises(RedisUnavailable) as info:
        lim.acquire()
    assert info.value.__cause__ is not None
    assert "ConnectionError" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"client": None}, TypeError, "client"),
        ({"client": "redis://localhost"}, TypeError, "client"),
        ({"max_wait": -1}, ValueError, "max_wait"),
        ({"max_wait": "5"}, TypeError, "max_wait"),
        ({"max_wait": math.nan}, ValueError, "max_wait"),
    ],
)
def test_redis_limiters_check_their_settings_at_construction(
    kwargs: dict, error: type[Exception], match: str
) -> None:
    import redis as redis_py
    from ratequeue.redis import RedisKeyedLimiter, RedisLimiter, RedisPolicy

    client = redis_py.Redis()  # never used: construction must fail first
    args = {"client": client, **kwargs}
    with pytest.raises(error, match=match):
        RedisLimiter(args.pop("client"), rq.Rate(10), name="x", **args)
    args = {"client": client, **kwargs}
    with pytest.raises(error, match=match):
        RedisKeyedLimiter(args.pop("client"), rq.Rate(10), name="x", **args)
    args = {"client": client, **kwargs}
    with pytest.raises(error, match=match):
        RedisPolicy(args.pop("client"), {"a": rq.Rate(10)}, name="x", **args)


# -- the bindings: one rule per kind of argument ------------------------------------------


@pytest.mark.parametrize("cost", [-1, 2**64, 2**70, 1.5, True, "1", np.int64(-3)])
def test_keyed_costs_follow_the_limiter_rule(cost: object) -> None:
    clock = rq.ManualClock()
    keyed = rq.KeyedLimiter(rq.Rate(10, burst=5), clock=clock)
    single = rq.Limiter(rq.Rate(10, burst=5), clock=clock)
    for call in (
        lambda: keyed.try_acquire("k", cost),
        lambda: keyed.retry_after("k", cost),
        lambda: keyed.acquire("k", cost, timeout=0),
    ):
        with pytest.raises((ValueError, TypeError, rq.RateQueueError)) as info:
            call()
        assert not isinstance(info.value, OverflowError)
        with pytest.raises(type(info.value)):
            single.try_acquire(cost)
        if not isinstance(info.value, rq.CostTooLarge):
            assert "cost" in str(info.value)


def test_a_cost_beyond_64_bits_is_shown_as_given() -> None:
    keyed = rq.KeyedLimiter(rq.Rate(10, burst=5), clock=rq.ManualClock())
    with pytest.raises(rq.CostTooLarge, match=str(2**70)):
        keyed.try_acquire("k", 2**70)
    with pytest.raises(rq.CostTooLarge, match="burst of 5"):
        keyed.try_acquire("k", 2**64)


@pytest.mark.parametrize("n", [0, True, False, -1, 1.0])
def test_keyed_permits_follow_the_concurrency_rule(n: object) -> None:
    kc = rq.KeyedConcurrency(3, clock=rq.ManualClock())
    conc = rq.Concurrency(3, clock=rq.ManualClock())
    with pytest.raises((ValueError, TypeError)) as info:
        kc.try_acquire("k", n)
    assert "n" in str(info.value)
    with pytest.raises(type(info.value)):
        conc.try_acquire(n)
    assert kc.in_use("k") == 0


def test_numpy_integers_are_costs_and_numbers_are_seconds() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=5), clock=clock)
    assert lim.try_acquire(np.int64(2))
    assert rq.KeyedLimiter(rq.Rate(10, burst=5), clock=clock).try_acquire("k", np.uint8(3))
    assert rq.KeyedConcurrency(3, clock=clock).try_acquire("k", np.int32(2)) is not None
    assert clock.advance(np.float32(0.5)) == 0.5
    with pytest.raises(TypeError, match="seconds"):
        clock.advance(np.bool_(True))


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: rq.Rate(10, unit=5), "unit"),
        (lambda: rq.Limiter(rq.Rate(10), name=5), "name"),
        (lambda: rq.Limiter(rq.Rate(10)).acquire(priority=1), "priority"),
        (lambda: rq.Limiter(rq.Rate(10)).available(0), "unit"),
        (lambda: rq.Policy([]), "levels"),  # type: ignore[arg-type]
        (lambda: rq.Policy({"a": rq.Limiter(rq.Rate(1))}, shadow=1), "shadow"),
        (lambda: rq.Histogram().percentile("50"), "q"),
        (lambda: rq.Histogram().percentile(101), "q"),
        (lambda: rq.Histogram().percentiles("50"), "qs"),
        (lambda: rq.Histogram().count_le(None), "le"),
        (lambda: rq.Histogram().cumulative(1.0), "les"),
        (lambda: rq.Histogram().record("1"), "seconds"),
        (lambda: rq.Histogram().record_many(1.0), "values"),
        (lambda: rq.KeyedLimiter(rq.Rate(10)).try_acquire_many(5), "keys"),
    ],
)
def test_each_kind_of_argument_is_named_in_its_error(make: Any, name: str) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert name in str(info.value)


def test_record_many_converts_integer_float32_arrays_and_sequences() -> None:
    h = rq.Histogram()
    h.record_many(np.array([1.5, 2.5], dtype=np.float32))
    h.record_many(np.array([1, 2], dtype=np.int64))
    h.record_many([0.5, 3])
    h.record_many(np.arange(6, dtype=np.float64)[::2])
    assert h.count == 9
    assert h.sum == pytest.approx(1.5 + 2.5 + 1 + 2 + 0.5 + 3 + 0 + 2 + 4)


# -- Policy set-ups that can never work -------------------------------------------------


@pytest.mark.parametrize("name", ["timeout", "max_wait", "tokens"])
def test_policy_refuses_a_level_named_like_a_keyword_or_a_unit(name: str) -> None:
    clock = rq.ManualClock()
    levels = {
        name: rq.KeyedLimiter(rq.Rate(10), clock=clock),
        "cluster": rq.Limiter(rq.Rate(1000, unit="tokens"), clock=clock),
    }
    with pytest.raises(ValueError, match=f"level {name!r}".replace("'", '"')):
        rq.Policy(levels)


# -- rough edges ----------------------------------------------------------------------------


def test_messages_show_the_value_as_given() -> None:
    with pytest.raises(ValueError, match=f"burst={2**64}"):
        rq.Rate(10, burst=2**64)
    with pytest.raises(ValueError, match=r"start=1000000000000\.0 "):
        rq.ManualClock(1e12)
    with pytest.raises(ValueError, match=r'classes\["a"\]=-1 must be a finite number > 0'):
        rq.Limiter(rq.Rate(10), classes={"a": -1})
    with pytest.raises(ValueError, match=f"max_keys={2**64}"):
        rq.KeyedLimiter(rq.Rate(10), max_keys=2**64)


def test_a_per_call_timeout_is_called_timeout() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert lim.try_acquire()
    with pytest.raises(rq.Overloaded, match=r"exceeds timeout=0\.01"):
        lim.acquire(timeout=0.01)


def test_histogram_pickles_and_copies() -> None:
    import copy
    import pickle

    h = rq.Histogram()
    for v in (0.001, 0.5, 2.0):
        h.record(v)
    for c in (pickle.loads(pickle.dumps(h)), copy.copy(h), copy.deepcopy(h)):
        assert c is not h
        assert (c.count, c.sum, c.max) == (h.count, h.sum, h.max)
        c.record(1.0)
        assert h.count == 3


def test_set_rate_needs_which_when_rates_share_a_unit() -> None:
    lim = rq.Limiter(rq.Rate(10), rq.Rate(100, per="minute"), clock=rq.ManualClock())
    with pytest.raises(ValueError, match="which="):
        lim.set_rate(20)
    with pytest.raises(ValueError, match="which="):
        lim.set_burst(3)
    lim.set_rate(20, which=1)
    assert lim.rates[1].amount == 20 and lim.rates[0].amount == 10


def test_timeout_zero_fails_at_once_on_a_manual_clock() -> None:
    import threading

    conc = rq.Concurrency(1, clock=rq.ManualClock())
    held = conc.acquire()
    box: list[BaseException | None] = []

    def wait() -> None:
        try:
            conc.acquire(timeout=0)
        except BaseException as e:
            box.append(e)
        else:
            box.append(None)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive(), "acquire(timeout=0) waited for the clock to move"
    assert isinstance(box[0], rq.WaitTimeout)
    assert conc.waiting == 0
    held.release()


def test_max_keys_beyond_the_supported_range_is_refused_not_wrapped() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        rq.KeyedLimiter(rq.Rate(10), max_keys=2**64)
    assert rq.KeyedLimiter(rq.Rate(10), max_keys=2**40).max_keys >= 2**40


def test_acquire_async_works_with_create_task() -> None:
    import asyncio

    async def main() -> tuple[int, int]:
        clock = rq.ManualClock()
        lim = rq.Limiter(rq.Rate(100, burst=1), clock=clock)
        first = asyncio.create_task(lim.acquire_async())  # the fast path
        queued = asyncio.create_task(lim.acquire_async())  # waits in the queue
        left = asyncio.create_task(lim.acquire_async())
        assert isinstance(await first, rq.Permit)
        await asyncio.sleep(0)
        waiting = lim.waiting
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        clock.advance(0.01)
        lim.poll()
        permit = await asyncio.wait_for(queued, 5.0)
        assert permit.waited == pytest.approx(0.01)
        return waiting, lim.waiting

    assert asyncio.run(main()) == (2, 0)


def test_from_bytes_says_what_is_wrong_with_an_extra_byte() -> None:
    h = rq.Histogram()
    h.record(1.0)
    data = h.to_bytes()
    with pytest.raises(
        ValueError, match=r"ends with 1 byte\(s\) that are not a whole bucket entry"
    ):
        rq.Histogram.from_bytes(data + b"\x00")
    with pytest.raises(ValueError, match="not a whole bucket entry"):
        rq.Histogram.from_bytes(data[:-1])


def test_policy_acquire_async_checks_its_timeout_like_acquire() -> None:
    policy = rq.Policy({"a": rq.Limiter(rq.Rate(1), clock=rq.ManualClock())})
    for bad, error in ((-1, ValueError), ("1", TypeError), (math.nan, ValueError)):
        with pytest.raises(error, match="timeout"):
            policy.acquire(timeout=bad)
        with pytest.raises(error, match="timeout"):
            policy.acquire_async(timeout=bad)
