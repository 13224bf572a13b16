"""Real-time open-loop load against an HTTP endpoint, queue wait measured apart.

``python -m ratequeue loadtest config.json`` reads a JSON config, and for each pair of
(requests per second, concurrency level) sends an open-loop stream of requests for
``duration`` seconds: arrivals follow their own schedule (Poisson or constant), however
slow the answers. Each request first waits in the client's queues (a ratequeue
:class:`~ratequeue.Limiter` with the configured limits, if any, then a
:class:`~ratequeue.Concurrency` of the level's size), then makes its HTTP call in a
worker thread (stdlib ``http.client``, one keep-alive connection per thread). Queue wait
(arrival to the start of the first call) and HTTP time (each call) are measured apart,
in ratequeue Histograms, with the 429s, errors and requests shed by ``max_wait``.

Config (all keys but ``endpoint`` optional)::

    {
      "endpoint": "mock",            # or "http://127.0.0.1:8000/v1/chat/completions"
      "mock": {"rpm": 120, "burst": 2, "gen_time": 0.5},   # the in-process mock provider
      "rps": [1.5, 2.5],             # arrival rates to try (one number or a list)
      "concurrency": [8],            # in-flight limits to try
      "duration": 20,                # seconds of arrivals per level
      "arrivals": "poisson",         # or "constant"
      "limits": {"rpm": 120, "burst": 2, "max_wait": 10},  # client limiter; null: none
      "retry_429": 0,                # retries after a 429 (honouring Retry-After)
      "method": "POST", "body": {...}, "headers": {...},
      "request_timeout": 30, "drain": 30, "max_requests": 10000, "pause": 0,
      "seed": 1, "out": "lab-out/loadtest.json"
    }

Every loop is bounded: at most ``max_requests`` arrivals per level, arrivals stop after
``duration``, and what is still queued or in flight ``drain`` seconds later is cancelled.
Only loopback addresses are accepted unless ``"allow_remote": true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ipaddress
import json
import math
import random
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import Overloaded, WaitTimeout
from .._ratequeue import Concurrency, Histogram, Limiter, Rate
from ..pool import parse_retry_after
from ..testing._mock_provider import MockProvider, default_burst

__all__ = ["LevelReport", "LoadTestConfig", "format_results", "main", "run_loadtest"]

QS = (50.0, 95.0, 99.0)


def _int(name: str, v: Any, low: int) -> int:
    """``v`` as an int >= ``low``: a JSON integer (or a float with an integral value)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v % 1:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if v < low or not math.isfinite(v):
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    return int(v)


def _num(name: str, v: Any, *, positive: bool = False) -> float:
    """``v`` as a finite float >= 0 (> 0 with ``positive``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(
            f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}"
        )
    return float(v)


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list) else [x]


def _check_keys(where: str, d: Any, known: set[str]) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object, got {d!r}")
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown keys in {where}: {sorted(unknown)}; known: {sorted(known)}")


@dataclass
class LoadTestConfig:
    """What to run; see the module docstring for the JSON form."""

    endpoint: str
    rps: list[float] = field(default_factory=lambda: [1.0])
    concurrency: list[int] = field(default_factory=lambda: [8])
    duration: float = 10.0
    arrivals: str = "poisson"
    limits: dict[str, float] | None = None
    retry_429: int = 0
    method: str = "POST"
    body: Any = field(
        default_factory=lambda: {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}
    )
    headers: dict[str, str] = field(default_factory=dict)
    request_timeout: float = 30.0
    drain: float = 30.0
    max_requests: int = 10_000
    pause: float = 0.0
    seed: int = 1
    mock: dict[str, float] | None = None
    allow_remote: bool = False
    out: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadTestConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(known)}")
        if "endpoint" not in d:
            raise ValueError('the config needs "endpoint" (a URL, or "mock")')
        kw = dict(d)
        if "rps" in kw:
            kw["rps"] = [_num("rps", r, positive=True) for r in _as_list(kw["rps"])]
        if "concurrency" in kw:
            kw["concurrency"] = [_int("concurrency", c, 1) for c in _as_list(kw["concurrency"])]
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> LoadTestConfig:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config must be a JSON object")
        return cls.from_dict(data)

    def validate(self) -> None:
        if not self.rps:
            raise ValueError("rps must hold at least one rate")
        for r in self.rps:
            _num("rps", r, positive=True)
        if not self.concurrency:
            raise ValueError("concurrency must hold at least one level")
        for c in self.concurrency:
            _int("concurrency", c, 1)
        for name in ("duration", "request_timeout", "drain", "pause"):
            _num(name, getattr(self, name))
        if self.arrivals not in ("poisson", "constant"):
            raise ValueError(f'arrivals must be "poisson" or "constant", got {self.arrivals!r}')
        _int("max_requests", self.max_requests, 1)
        _int("retry_429", self.retry_429, 0)
        if self.limits is not None:
            lim = self.limits
            _check_keys("limits", lim, {"rpm", "burst", "tpm", "tokens", "max_wait", "max_queue"})
            if "rpm" not in lim and "tpm" not in lim:
                raise ValueError('limits needs "rpm" and/or "tpm"')
            for name in ("rpm", "tpm"):
                if name in lim:
                    _num(f"limits.{name}", lim[name], positive=True)
            for name, low in (("burst", 1), ("tokens", 1), ("max_queue", 1)):
                if lim.get(name) is not None:
                    _int(f"limits.{name}", lim[name], low)
            if lim.get("max_wait") is not None:
                _num("limits.max_wait", lim["max_wait"])
        if self.mock is not None:
            _check_keys("mock", self.mock, {"rpm", "burst", "gen_time"})
            if "rpm" in self.mock:
                _num("mock.rpm", self.mock["rpm"], positive=True)
            if self.mock.get("burst") is not None:
                _int("mock.burst", self.mock["burst"], 1)
            if "gen_time" in self.mock:
                _num("mock.gen_time", self.mock["gen_time"])
        if self.endpoint != "mock":
            _check_target(self.endpoint, self.allow_remote)


def _check_target(url: str, allow_remote: bool) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint must be an http(s) URL, got {url!r}")
    if allow_remote:
        return
    host = parts.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to load-test {host!r}: only loopback addresses unless the config "
            'says "allow_remote": true'
        )


def _hist_summary(h: Histogram) -> dict[str, float | int | None]:
    if not h.count:
        return {"count": 0, **{f"p{q:g}": None for q in QS}, "max": None, "mean": None}
    ps = h.percentiles(list(QS))
    return {
        "count": h.count,
        **{f"p{q:g}": v for q, v in zip(QS, ps, strict=True)},
        "max": h.max,
        "mean": h.mean,
    }


@dataclass
class LevelReport:
    """One (rps, concurrency) run."""

    rps: float
    concurrency: int
    duration: float
    arrivals: int = 0
    calls: int = 0
    ok: int = 0
    rate_limited: int = 0
    errors: int = 0
    shed: int = 0
    cancelled: int = 0
    retries: int = 0
    elapsed: float = 0.0
    first_ok: float | None = None
    last_ok: float | None = None
    max_lateness: float = 0.0
    queue_wait: Histogram = field(default_factory=Histogram)
    limiter_wait: Histogram = field(default_factory=Histogram)
    http_time: Histogram = field(default_factory=Histogram)
    total: Histogram = field(default_factory=Histogram)
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def ok_per_second(self) -> float:
        """Successful calls per second between the first and the last one."""
        if self.first_ok is None or self.last_ok is None or self.ok < 2:
            return 0.0
        span = self.last_ok - self.first_ok
        return (self.ok - 1) / span if span > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "rps": self.rps,
            "concurrency": self.concurrency,
            "duration_s": self.duration,
            "arrivals": self.arrivals,
            "calls": self.calls,
            "ok": self.ok,
            "rate_limited": self.rate_limited,
            "errors": self.errors,
            "shed": self.shed,
            "cancelled": self.cancelled,
            "retries": self.retries,
            "ok_per_second": self.ok_per_second,
            "elapsed_s": self.elapsed,
            "max_lateness_s": self.max_lateness,
            "statuses": dict(self.statuses),
            "queue_wait_s": _hist_summary(self.queue_wait),
            "limiter_wait_s": _hist_summary(self.limiter_wait),
            "http_time_s": _hist_summary(self.http_time),
            "total_latency_s": _hist_summary(self.total),
        }


class _Http:
    """One keep-alive connection per worker thread; all closed at the end."""

    def __init__(self, cfg: LoadTestConfig, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.method = cfg.method
        self.timeout = cfg.request_timeout
        self.body = None if cfg.body is None else json.dumps(cfg.body).encode()
        self.headers = {"Content-Type": "application/json", **cfg.headers}
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = cls(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def call(self) -> tuple[int, float | None, float]:
        """(status, Retry-After seconds or None, seconds); status 0 on a network error."""
        start = time.monotonic()
        for attempt in range(2):
            conn = self._conn()
            try:
                conn.request(self.method, self.path, body=self.body, headers=self.headers)
                resp = conn.getresponse()
                resp.read()
                ms = resp.getheader("retry-after-ms")
                retry = (
                    float(ms) / 1000.0 if ms else parse_retry_after(resp.getheader("Retry-After"))
                )
                return resp.status, retry, time.monotonic() - start
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 1 or time.monotonic() - start > self.timeout:
                    break
        return 0, None, time.monotonic() - start

    def close(self) -> None:
        with self._lock:
            for c in self._all:
                c.close()
            self._all.clear()


def _schedule(cfg: LoadTestConfig, rps: float, level: int) -> list[float]:
    rng = random.Random(f"{cfg.seed}/{level}/{rps}")
    out: list[float] = []
    t = 0.0 if cfg.arrivals == "constant" else rng.expovariate(rps)
    while t < cfg.duration and len(out) < cfg.max_requests:
        out.append(t)
        t += 1.0 / rps if cfg.arrivals == "constant" else rng.expovariate(rps)
    return out


def _make_limiter(cfg: LoadTestConfig) -> tuple[Limiter | None, int | None]:
    """The client limiter of the config, and the tokens per request (None: no TPM)."""
    lim = cfg.limits
    if lim is None:
        return None, None
    rates = []
    if "rpm" in lim:
        burst = lim.get("burst")
        if burst is None:
            # The provider's own default (one second's worth, at least 1), or the mock's
            # burst: a client bucket deeper than the provider's would only earn 429s.
            mock_burst = (cfg.mock or {}).get("burst") if cfg.endpoint == "mock" else None
            burst = mock_burst if mock_burst is not None else default_burst(lim["rpm"])
        rates.append(Rate(lim["rpm"], per="minute", burst=int(burst)))
    if "tpm" in lim:
        rates.append(Rate(lim["tpm"], per="minute", unit="tokens"))
    max_wait = lim.get("max_wait")
    max_queue = lim.get("max_queue")
    limiter = Limiter(
        *rates,
        max_wait=None if max_wait is None else float(max_wait),
        max_queue=None if max_queue is None else int(max_queue),
        name="loadtest",
    )
    tokens = int(lim.get("tokens", 1)) if "tpm" in lim else None
    return limiter, tokens


async def _run_level(
    cfg: LoadTestConfig,
    url: str,
    rps: float,
    concurrency: int,
    index: int,
    say: Callable[[str], None],
) -> LevelReport:
    loop = asyncio.get_running_loop()
    report = LevelReport(rps, concurrency, cfg.duration)
    limiter, tokens = _make_limiter(cfg)
    gate = Concurrency(concurrency)
    http_ = _Http(cfg, url)
    executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="loadtest")
    schedule = _schedule(cfg, rps, index)
    report.arrivals = len(schedule)

    def count(status: int) -> None:
        key = str(status) if status else "error"
        report.statuses[key] = report.statuses.get(key, 0) + 1

    async def one(arrived: float) -> None:
        first_start: float | None = None
        for attempt in range(cfg.retry_429 + 1):
            try:
                if limiter is not None:
                    if tokens is None:
                        permit = await limiter.acquire_async()
                    else:
                        permit = await limiter.acquire_async(tokens=tokens)
                    if attempt == 0:
                        report.limiter_wait.record(permit.waited)
                async with gate.acquire_async():
                    began = time.monotonic()
                    if first_start is None:
                        first_start = began
                        report.queue_wait.record(began - arrived)
                    report.calls += 1
                    status, retry, took = await loop.run_in_executor(executor, http_.call)
            except (Overloaded, WaitTimeout):
                report.shed += 1
                return
            report.http_time.record(took)
            count(status)
            if status == 429:
                report.rate_limited += 1
                if attempt < cfg.retry_429:
                    report.retries += 1
                    await asyncio.sleep(retry if retry is not None else 1.0)
                    continue
                return
            if status == 0 or status >= 400:
                report.errors += 1
                return
            report.ok += 1
            done = time.monotonic()
            report.first_ok = began if report.first_ok is None else report.first_ok
            report.last_ok = began
            report.total.record(done - arrived)
            return

    start = loop.time() + 0.05
    hard_stop = start + cfg.duration + cfg.drain
    tasks: list[asyncio.Task[None]] = []
    try:
        for t in schedule:
            due = start + t
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            now = loop.time()
            if now > hard_stop:
                break
            report.max_lateness = max(report.max_lateness, now - due)
            tasks.append(asyncio.ensure_future(one(time.monotonic())))
        if tasks:
            remaining = max(0.0, hard_stop - loop.time())
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            report.cancelled = len(pending)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        http_.close()
    report.elapsed = loop.time() - start
    say(
        f"rps {rps:g} x concurrency {concurrency}: {report.arrivals} arrivals, {report.ok} ok, "
        f"{report.rate_limited} x 429, {report.shed} shed, {report.errors} errors"
    )
    return report


@contextlib.contextmanager
def _target(cfg: LoadTestConfig) -> Iterator[tuple[str, MockProvider | None]]:
    if cfg.endpoint != "mock":
        yield cfg.endpoint, None
        return
    m = cfg.mock or {}
    burst = m.get("burst")
    mock = MockProvider(
        float(m.get("rpm", 60.0)),
        gen_time=float(m.get("gen_time", 0.5)),
        burst=None if burst is None else int(burst),
    )
    with mock:
        yield mock.url, mock


def run_loadtest(
    config: LoadTestConfig | dict[str, Any], *, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every level; returns the results as plain data (see :func:`format_results`)."""
    cfg = config if isinstance(config, LoadTestConfig) else LoadTestConfig.from_dict(config)
    cfg.validate()
    speak = say if say is not None else (lambda _msg: None)
    levels: list[LevelReport] = []
    with _target(cfg) as (url, mock):
        index = 0
        for rps in cfg.rps:
            for conc in cfg.concurrency:
                if index and cfg.pause:
                    time.sleep(cfg.pause)
                levels.append(asyncio.run(_run_level(cfg, url, rps, conc, index, speak)))
                index += 1
        mock_stats = None if mock is None else mock.stats()
    return {
        "endpoint": cfg.endpoint if mock is None else f"mock ({url})",
        "limits": cfg.limits,
        "arrivals": cfg.arrivals,
        "mock": mock_stats,
        "levels": [lv.to_dict() for lv in levels],
    }


def _fmt(x: float | int | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def format_results(results: dict[str, Any]) -> str:
    """A table: per level, queue wait and HTTP time percentiles, outcomes."""
    lines = [
        f"load test of {results['endpoint']}; client limits: {results['limits']}; "
        f"arrivals: {results['arrivals']}",
        "",
        f"{'rps':>6}{'conc':>6}{'arrived':>8}{'ok':>6}{'429':>6}{'shed':>6}{'err':>5}"
        f"{'ok/s':>7}   {'queue wait p50/p95/p99/max (s)':<32}"
        f"{'HTTP time p50/p95/p99/max (s)':<32}",
    ]
    for lv in results["levels"]:
        q = lv["queue_wait_s"]
        h = lv["http_time_s"]
        qs = "/".join(_fmt(q[k]) for k in ("p50", "p95", "p99", "max"))
        hs = "/".join(_fmt(h[k]) for k in ("p50", "p95", "p99", "max"))
        lines.append(
            f"{lv['rps']:>6g}{lv['concurrency']:>6}{lv['arrivals']:>8}{lv['ok']:>6}"
            f"{lv['rate_limited']:>6}{lv['shed']:>6}{lv['errors']:>5}{lv['ok_per_second']:>7.2f}"
            f"   {qs:<32}{hs:<32}"
        )
    if results.get("mock"):
        m = results["mock"]
        lines.append(
            f"\nmock provider: {m['rpm']:g} requests/minute (burst {m['burst']}), generation "
            f"{m['gen_time']:g} s; it answered {m['ok']} ok and {m['rate_limited']} x 429"
        )
    return "\n".join(lines)


def main(path: str | Path, *, out: str | Path | None = None, quiet: bool = False) -> int:
    """``python -m ratequeue loadtest CONFIG``: run, print the table, write JSON."""
    cfg = LoadTestConfig.load(path)

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    results = run_loadtest(cfg, say=say)
    print(format_results(results))
    target = out if out is not None else cfg.out
    if target is not None:
        p = Path(target)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {p}")
    return 0
