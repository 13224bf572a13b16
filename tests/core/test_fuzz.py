"""The public surface, fuzzed: every constructor and method of ``ratequeue`` and
``ratequeue.lab`` (``ratequeue.redis`` in test_fuzz_redis.py), called with ill-typed and
extreme arguments, either works or raises the documented error naming the argument —
never OverflowError, AttributeError, ZeroDivisionError, a panic or a hang. Every CLI
subcommand with fuzzed options exits 0 or 2 with a usage message, never a traceback.

The single-argument sweep is exhaustive (every call x every argument x every bad value);
hypothesis then mixes several bad arguments at once. ``RATEQUEUE_FUZZ_EXAMPLES`` sets how
many mixed examples run (``make stress`` runs more).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import ratequeue as rq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ratequeue import lab
from ratequeue._errors import RateQueueError

#: Values no argument of the API should turn into anything but a clear answer.
BAD: list[Any] = [
    0,
    -1,
    1,
    2**31,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    2**200,
    -(2**200),
    0.0,
    -0.0,
    -1.5,
    0.5,
    1e-320,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    True,
    False,
    np.int64(3),
    np.int64(-3),
    np.uint64(2**64 - 1),
    np.float32(1.5),
    np.float64(math.nan),
    "",
    "x",
    "requests",
    "1",
    b"x",
    None,
    [],
    [1, 2],
    (1,),
    {},
    {"a": 1.0},
    object(),
]

ALLOWED = (ValueError, TypeError, RateQueueError)
FORBIDDEN_NAMES = ("PanicException",)


@dataclass
class Call:
    """``fn(*pos, **kw)`` with valid arguments; each argument in ``fuzz`` gets bad ones."""

    label: str
    fn: Callable[..., Any]
    kw: dict[str, Any] = field(default_factory=dict)
    pos: list[Any] = field(default_factory=list)
    fuzz: list[str] = field(default_factory=list)
    #: The name an error should mention per argument (default: the argument's own).
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def run(self, bad: dict[str, Any]) -> Any:
        pos = list(self.pos)
        kw = dict(self.kw)
        for k, v in bad.items():
            if k.startswith("#"):
                pos[int(k[1:])] = v
            else:
                kw[k] = v
        return self.fn(*pos, **kw)


def _clock() -> rq.ManualClock:
    return rq.ManualClock()


def _limiter(**kw: Any) -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(10, per="second", burst=5),
        rq.Rate(1000, per="second", unit="tokens"),
        clock=_clock(),
        classes={"hi": 4, "lo": 1},
        **kw,
    )


def _calls() -> list[Call]:
    L = _limiter
    kl = lambda: rq.KeyedLimiter(rq.Rate(10, burst=5), clock=_clock())  # noqa: E731
    kc = lambda: rq.KeyedConcurrency(3, clock=_clock())  # noqa: E731
    conc = lambda: rq.Concurrency(3, clock=_clock())  # noqa: E731
    hist = rq.Histogram
    rate_names = {"#0": ("amount",)}
    calls = [
        Call(
            "Rate",
            rq.Rate,
            {"per": "second", "burst": 3, "unit": "tokens"},
            [10],
            ["#0", "per", "burst", "unit"],
            rate_names,
        ),
        Call("ManualClock", rq.ManualClock, {"start": 5.0}, [], ["start"]),
        Call(
            "ManualClock.advance",
            lambda s: _clock().advance(s),
            {},
            [1.0],
            ["#0"],
            {"#0": ("seconds",)},
        ),
        Call("ManualClock.set", lambda s: _clock().set(s), {}, [1.0], ["#0"], {"#0": ("seconds",)}),
        Call(
            "Limiter",
            lambda **kw: rq.Limiter(rq.Rate(10), clock=_clock(), **kw),
            {"max_wait": 1.0, "max_queue": 10, "classes": {"a": 1.0}, "name": "x"},
            [],
            ["max_wait", "max_queue", "classes", "name"],
        ),
        Call(
            "Limiter(rates)",
            lambda r: rq.Limiter(r),
            {},
            [rq.Rate(1)],
            ["#0"],
            {"#0": ("rate", "Rate")},
        ),
        Call(
            "Limiter.try_acquire",
            lambda *a, **k: L().try_acquire(*a, **k),
            {"tokens": 5},
            [1],
            ["#0", "tokens"],
            {"#0": ("n", "cost", "requests")},
        ),
        Call(
            "Limiter.retry_after",
            lambda *a, **k: L().retry_after(*a, **k),
            {"tokens": 5},
            [1],
            ["#0", "tokens"],
            {"#0": ("n", "cost", "requests")},
        ),
        Call(
            "Limiter.predicted_wait",
            lambda *a, **k: L().predicted_wait(*a, **k),
            {"tokens": 5},
            [1],
            ["#0", "tokens"],
            {"#0": ("n", "cost", "requests")},
        ),
        Call(
            "Limiter.predicted_wait(priority)",
            lambda *a, **k: L().predicted_wait(*a, **k),
            {"tokens": 5, "priority": "lo"},
            [1],
            ["priority"],
        ),
        Call(
            "Limiter.acquire_async",
            lambda *a, **k: L().acquire_async(*a, **k),
            {"tokens": 5, "timeout": 0.0, "priority": "hi"},
            [1],
            ["#0", "tokens", "timeout", "priority"],
            {"#0": ("n", "cost", "requests")},
        ),
        Call(
            "Limiter.reserve",
            lambda *a, **k: L().reserve(*a, **k),
            {"tokens": 5, "max_wait": 1.0},
            [1],
            ["#0", "tokens", "max_wait"],
            {"#0": ("n", "cost", "requests")},
        ),
        Call(
            "Limiter.acquire",
            lambda *a, **k: L().acquire(*a, **k),
            {"tokens": 5, "timeout": 0.0, "priority": "hi"},
            [1],
            ["#0", "tokens", "timeout", "priority"],
            {"#0": ("n", "cost", "requests")},
        ),
        Call(
            "Limiter.available",
            lambda *a: L().available(*a),
            {},
            ["tokens"],
            ["#0"],
            {"#0": ("unit",)},
        ),
        Call(
            "Limiter.set_rate",
            lambda *a, **k: L().set_rate(*a, **k),
            {"burst": 3, "which": 0},
            [20, "second"],
            ["#0", "#1", "burst", "which"],
            {"#0": ("amount",), "#1": ("per",)},
        ),
        Call(
            "Limiter.set_burst",
            lambda *a, **k: L().set_burst(*a, **k),
            {"which": "tokens"},
            [3],
            ["#0", "which"],
            {"#0": ("burst",)},
        ),
        Call(
            "Limiter.pause",
            lambda *a, **k: L().pause(*a, **k),
            {"unit": "tokens"},
            [2.5],
            ["#0", "unit"],
            {"#0": ("seconds",)},
        ),
        Call(
            "Limiter.wait_histogram",
            lambda *a: L().wait_histogram(*a),
            {},
            ["hi"],
            ["#0"],
            {"#0": ("priority",)},
        ),
        Call(
            "Limiter.run_until", lambda *a: L().run_until(*a), {}, [1.0], ["#0"], {"#0": ("until",)}
        ),
        Call(
            "Concurrency",
            lambda *a, **k: rq.Concurrency(*a, clock=_clock(), **k),
            {"max_wait": 1.0, "max_queue": 3},
            [3],
            ["#0", "max_wait", "max_queue"],
            {"#0": ("limit",)},
        ),
        Call(
            "Concurrency.try_acquire",
            lambda *a: conc().try_acquire(*a),
            {},
            [1],
            ["#0"],
            {"#0": ("n",)},
        ),
        Call(
            "Concurrency.acquire",
            lambda *a, **k: conc().acquire(*a, **k),
            {"timeout": 0.0},
            [1],
            ["#0", "timeout"],
            {"#0": ("n",)},
        ),
        Call(
            "Concurrency.set_limit",
            lambda *a: conc().set_limit(*a),
            {},
            [2],
            ["#0"],
            {"#0": ("limit",)},
        ),
        Call(
            "Concurrency.give_back",
            lambda *a: conc().give_back(*a),
            {},
            [1],
            ["#0"],
            {"#0": ("n",)},
        ),
        Call(
            "KeyedLimiter",
            lambda *a, **k: rq.KeyedLimiter(*a, clock=_clock(), **k),
            {"max_keys": 100, "max_wait": 1.0, "max_queue": 5},
            [rq.Rate(10)],
            ["#0", "max_keys", "max_wait", "max_queue"],
            {"#0": ("rate", "Rate")},
        ),
        Call(
            "KeyedLimiter.try_acquire",
            lambda *a: kl().try_acquire(*a),
            {},
            ["k", 1],
            ["#0", "#1"],
            {"#0": ("key",), "#1": ("cost",)},
        ),
        Call(
            "KeyedLimiter.retry_after",
            lambda *a: kl().retry_after(*a),
            {},
            ["k", 1],
            ["#0", "#1"],
            {"#0": ("key",), "#1": ("cost",)},
        ),
        Call(
            "KeyedLimiter.available",
            lambda *a: kl().available(*a),
            {},
            ["k"],
            ["#0"],
            {"#0": ("key",)},
        ),
        Call(
            "KeyedLimiter.acquire",
            lambda *a, **k: kl().acquire(*a, **k),
            {"timeout": 0.0},
            ["k", 1],
            ["#0", "#1", "timeout"],
            {"#0": ("key",), "#1": ("cost",)},
        ),
        Call(
            "KeyedLimiter.try_acquire_many",
            lambda *a: kl().try_acquire_many(*a),
            {},
            [np.arange(4, dtype=np.uint64), None],
            ["#0", "#1"],
            {"#0": ("keys",), "#1": ("costs",)},
        ),
        Call(
            "KeyedConcurrency",
            lambda *a, **k: rq.KeyedConcurrency(*a, clock=_clock(), **k),
            {"max_wait": 1.0},
            [3],
            ["#0", "max_wait"],
            {"#0": ("limit",)},
        ),
        Call(
            "KeyedConcurrency.try_acquire",
            lambda *a: kc().try_acquire(*a),
            {},
            ["k", 1],
            ["#0", "#1"],
            {"#0": ("key",), "#1": ("n",)},
        ),
        Call(
            "KeyedConcurrency.acquire",
            lambda *a, **k: kc().acquire(*a, **k),
            {"timeout": 0.0},
            ["k", 1],
            ["#0", "#1", "timeout"],
            {"#0": ("key",), "#1": ("n",)},
        ),
        Call(
            "KeyedLimiter.acquire_async",
            lambda *a, **k: kl().acquire_async(*a, **k),
            {"timeout": 0.0},
            ["k", 1],
            ["#0", "#1", "timeout"],
            {"#0": ("key",), "#1": ("cost",)},
        ),
        Call(
            "Concurrency.wait_histogram",
            lambda *a: rq.Concurrency(2, classes={"a": 1.0}).wait_histogram(*a),
            {},
            ["a"],
            ["#0"],
            {"#0": ("priority",)},
        ),
        Call(
            "KeyedConcurrency.in_use",
            lambda *a: kc().in_use(*a),
            {},
            ["k"],
            ["#0"],
            {"#0": ("key",)},
        ),
        Call(
            "Policy",
            lambda *a, **k: rq.Policy(*a, **k),
            {"shadow": None},
            [{"l": rq.Limiter(rq.Rate(10), clock=_clock())}],
            ["#0", "shadow"],
            {"#0": ("levels",)},
        ),
        Call(
            "Policy.try_acquire",
            lambda **k: rq.Policy({"user": kl(), "rate": L()}).try_acquire(**k),
            {"user": "alice", "tokens": 5},
            [],
            ["user", "tokens"],
        ),
        Call(
            "Policy.reserve",
            lambda **k: rq.Policy({"user": kl(), "rate": L()}).reserve(**k),
            {"user": "alice", "tokens": 5, "max_wait": 1.0},
            [],
            ["user", "tokens", "max_wait"],
        ),
        Call(
            "Histogram.record",
            lambda *a: hist().record(*a),
            {},
            [1.0],
            ["#0"],
            {"#0": ("seconds", "value")},
        ),
        Call(
            "Histogram.record_many",
            lambda *a: hist().record_many(*a),
            {},
            [np.ones(3)],
            ["#0"],
            {"#0": ("values",)},
        ),
        Call(
            "Histogram.percentile",
            lambda *a: _filled().percentile(*a),
            {},
            [50.0],
            ["#0"],
            {"#0": ("q",)},
        ),
        Call(
            "Histogram.percentiles",
            lambda *a: _filled().percentiles(*a),
            {},
            [[50.0]],
            ["#0"],
            {"#0": ("qs", "q")},
        ),
        Call(
            "Histogram.count_le",
            lambda *a: _filled().count_le(*a),
            {},
            [1.0],
            ["#0"],
            {"#0": ("le",)},
        ),
        Call(
            "Histogram.cumulative",
            lambda *a: _filled().cumulative(*a),
            {},
            [[1.0]],
            ["#0"],
            {"#0": ("les", "le")},
        ),
        Call(
            "Histogram.from_bytes",
            rq.Histogram.from_bytes,
            {},
            [rq.Histogram().to_bytes()],
            ["#0"],
            {"#0": ("data", "bytes")},
        ),
        Call(
            "Histogram.merge",
            lambda *a: hist().merge(*a),
            {},
            [rq.Histogram()],
            ["#0"],
            {"#0": ("other", "Histogram")},
        ),
        Call(
            "Pool",
            lambda *a, **k: rq.Pool(*a, **k),
            {"max_wait": 1.0, "cooldown": 1.0, "max_cooldown": 10.0, "tie": 0.0},
            [[rq.Provider("a", rpm=60, clock=_clock())]],
            ["#0", "max_wait", "cooldown", "max_cooldown", "tie"],
            {"#0": ("providers", "Provider")},
        ),
        Call(
            "Provider",
            lambda *a, **k: rq.Provider(*a, clock=_clock(), **k),
            {"rpm": 60, "tpm": 1000, "weight": 1.0, "burst": 2, "token_burst": 10, "max_queue": 5},
            ["a"],
            ["#0", "rpm", "tpm", "weight", "burst", "token_burst", "max_queue"],
            {"#0": ("name",)},
        ),
        Call(
            "Pool.report",
            lambda *a, **k: _pool().report(*a, **k),
            {"status": 429, "retry_after": 1.0},
            ["a"],
            ["#0", "status", "retry_after"],
            {"#0": ("provider",)},
        ),
        Call(
            "lab.ProviderLimit", lab.ProviderLimit, {"rpm": 60.0, "burst": 1}, [], ["rpm", "burst"]
        ),
        Call(
            "lab.NaiveRetry",
            lab.NaiveRetry,
            {"base": 1.0, "cap": 10.0, "max_attempts": 3},
            [],
            ["base", "cap", "max_attempts"],
        ),
        Call(
            "lab.Scenario",
            lab.Scenario,
            {"rhos": (0.5,), "requests": 10, "burst": 0, "warmup": 0.0, "interactive_share": 0.2},
            [],
            ["rhos", "requests", "burst", "warmup", "interactive_share"],
        ),
        Call(
            "lab.parse_arrivals",
            lab.parse_arrivals,
            {},
            ["poisson"],
            ["#0"],
            {"#0": ("arrival", "spec")},
        ),
        Call(
            "lab.parse_service",
            lab.parse_service,
            {},
            ["constant:1"],
            ["#0"],
            {"#0": ("service", "spec")},
        ),
    ]
    return calls


def _filled() -> rq.Histogram:
    h = rq.Histogram()
    for v in (0.001, 0.01, 0.1, 1.0):
        h.record(v)
    return h


def _pool() -> rq.Pool:
    c = _clock()
    return rq.Pool([rq.Provider("a", rpm=60, clock=c), rq.Provider("b", rpm=60, clock=c)])


CALLS = _calls()

#: Seconds a single call may take before it counts as a hang.
HANG = 10.0


def _outcome(call: Call, bad: dict[str, Any]) -> BaseException | None:
    """Runs the call in a thread (a hang is a failure, not a stuck test)."""
    box: list[BaseException | None] = []

    def target() -> None:
        try:
            call.run(bad)
        except BaseException as e:
            box.append(e)
        else:
            box.append(None)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG)
    if t.is_alive():
        raise AssertionError(f"{call.label} with {bad!r} hung for {HANG} s")
    return box[0]


def _check(call: Call, bad: dict[str, Any]) -> None:
    e = _outcome(call, bad)
    if e is None:
        return
    where = f"{call.label} with {bad!r}"
    assert type(e).__name__ not in FORBIDDEN_NAMES, f"{where}: panic {e!r}"
    assert isinstance(e, ALLOWED), f"{where}: {type(e).__name__}: {e}"
    if isinstance(e, RateQueueError) or len(bad) != 1:
        return
    [(arg, _)] = bad.items()
    names = call.names.get(arg, (arg,))
    text = str(e)
    assert any(n in text for n in names), f"{where}: the error does not name {names}: {e!r}"


SWEEP = [(c, a, v) for c in CALLS for a in c.fuzz for v in BAD]


@pytest.mark.parametrize(
    "call",
    CALLS,
    ids=[c.label for c in CALLS],
)
def test_every_call_works_with_valid_arguments(call: Call) -> None:
    assert _outcome(call, {}) is None, call.label


@pytest.mark.parametrize("call", CALLS, ids=[c.label for c in CALLS])
def test_each_argument_alone_gets_a_clear_answer(call: Call) -> None:
    failures = []
    for arg in call.fuzz:
        for v in BAD:
            try:
                _check(call, {arg: v})
            except AssertionError as e:
                failures.append(str(e).splitlines()[0])
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures[:40])


EXAMPLES = int(os.environ.get("RATEQUEUE_FUZZ_EXAMPLES", "300"))


@st.composite
def _mixed(draw: st.DrawFn) -> tuple[Call, dict[str, Any]]:
    call = draw(st.sampled_from([c for c in CALLS if c.fuzz]))
    args = draw(st.lists(st.sampled_from(call.fuzz), min_size=1, unique=True))
    values = [draw(st.sampled_from(BAD)) for _ in args]
    return call, dict(zip(args, values, strict=True))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_mixed())
def test_several_bad_arguments_at_once_get_a_clear_answer(
    case: tuple[Call, dict[str, Any]],
) -> None:
    call, bad = case
    _check(call, bad)


# -- the command line -----------------------------------------------------------------------

#: Each subcommand's options and the values they are fuzzed with (small runs only).
CLI_OPTIONS: dict[str, dict[str, list[str]]] = {
    "lab": {
        "--rpm": ["0", "-1", "nan", "inf", "1e309", "x", "600"],
        "--burst": ["0", "-2", "1.5", "x", "3"],
        "--rho": ["0", "-1", "nan", "0.5,x", "", "0.5"],
        "--requests": ["0", "-1", "1.5", "50"],
        "--arrivals": ["foo", "onoff:1", "burst:0", "batches:-1", "replay:/nonexistent", "poisson"],
        "--service": ["foo", "constant:-1", "lognormal:0:0", "exponential:x", "constant:0.1"],
        "--strategies": ["", "nope", "naive", "queue,bounded"],
        "--max-wait": ["-1", "nan", "inf", "1"],
        "--backoff-base": ["0", "-1", "nan", "0.5"],
        "--backoff-cap": ["0", "-1", "inf", "5"],
        "--max-attempts": ["0", "-1", "x", "3"],
        "--warmup": ["-0.1", "1", "2", "0.1"],
        "--interactive-share": ["-1", "2", "nan", "0.5"],
        "--pool": ["0", "-1", "x", "2"],
        "--burst-requests": ["-5", "x", "3"],
        "--formats": ["xyz", "json,xyz", ""],
    },
    "demo": {
        "--requests": ["0", "-1", "x", "20"],
        "--rpm": ["0", "nan", "600"],
        "--burst": ["0", "-1", "2"],
        "--max-wait": ["-1", "x", "1"],
        "--per-level": ["0", "-3", "200"],
        "--rho": ["0", "x", "0.5"],
    },
    "mock-provider": {
        "--rpm": ["0", "-1", "nan", "x"],
        "--port": ["99999", "-1", "x"],
        "--gen-time": ["-1", "nan", "x"],
        "--burst": ["0", "-1", "x"],
        "--duration": ["0", "-1", "x"],
    },
}

#: Keeps a valid run short.
CLI_BASE: dict[str, list[str]] = {
    "lab": ["--requests", "50", "--rho", "0.5", "--formats", "", "--no-progress"],
    "demo": ["--burst-only", "--requests", "20"],
    "mock-provider": ["--rpm", "60", "--port", "0", "--duration", "0.01"],
}


@st.composite
def _cli_case(draw: st.DrawFn) -> list[str]:
    cmd = draw(st.sampled_from(sorted(CLI_OPTIONS)))
    opts = CLI_OPTIONS[cmd]
    chosen = draw(st.lists(st.sampled_from(sorted(opts)), min_size=1, max_size=3, unique=True))
    argv = [cmd, *CLI_BASE[cmd]]
    for o in chosen:
        argv += [o, draw(st.sampled_from(opts[o]))]
    return argv


@settings(
    max_examples=int(os.environ.get("RATEQUEUE_FUZZ_CLI", "25")), deadline=None, derandomize=True
)
@given(_cli_case())
def test_cli_with_fuzzed_options_exits_0_or_2_without_a_traceback(argv: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ratequeue", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.environ.get("TMPDIR", "/tmp"),
    )
    assert r.returncode in (0, 2), f"{argv}: exit {r.returncode}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, f"{argv}:\n{r.stderr[-2000:]}"
    if r.returncode == 2:
        assert "error:" in r.stderr, f"{argv}: no usage message\n{r.stderr[-2000:]}"
