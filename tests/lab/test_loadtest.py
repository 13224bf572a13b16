"""Real-time load test against the in-process mock provider (loopback only, a few seconds)."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import pytest
from ratequeue.cli import loadtest
from ratequeue.cli.main import main as cli
from ratequeue.testing import MockProvider

GEN = 0.1  # the mock's generation time, seconds


def config(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "endpoint": "mock",
        "mock": {"rpm": 120, "burst": 2, "gen_time": GEN},
        "rps": 6,
        "concurrency": [4],
        "duration": 2.0,
        "arrivals": "constant",
        "drain": 3.0,
        "request_timeout": 5.0,
    }
    base.update(over)
    return base


def test_mock_provider_enforces_its_limit_with_retry_after() -> None:
    with MockProvider(rpm=60, burst=1, gen_time=0.0) as mock:
        conn = http.client.HTTPConnection("127.0.0.1", mock.port, timeout=5)
        statuses = []
        for _ in range(3):
            conn.request("POST", "/v1/chat/completions", body=b"{}")
            resp = conn.getresponse()
            body = json.loads(resp.read())
            statuses.append(resp.status)
            if resp.status == 429:
                assert 1 <= int(resp.getheader("Retry-After") or 0) <= 1
                assert 0 < int(resp.getheader("retry-after-ms") or 0) <= 1000
                assert body["error"]["type"] == "rate_limit_exceeded"
            else:
                assert body["usage"]["total_tokens"] > 0
        conn.request("GET", "/stats")
        stats = json.loads(conn.getresponse().read())
        conn.close()
    assert statuses == [200, 429, 429]
    assert (stats["ok"], stats["rate_limited"]) == (1, 2)


def test_mock_provider_is_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback"):
        MockProvider(rpm=60, host="0.0.0.0")


def test_queue_wait_and_http_time_are_measured_apart() -> None:
    # The client limits itself well below the mock (a margin for a loaded machine's
    # scheduling jitter between the client's grant and the mock's arrival), queues up to
    # 1 s, and never makes the mock answer 429.
    results = loadtest.run_loadtest(config(limits={"rpm": 80, "burst": 2, "max_wait": 1.0}))
    [lv] = results["levels"]
    assert lv["arrivals"] == 12
    assert lv["rate_limited"] == 0 and lv["errors"] == 0 and lv["cancelled"] == 0
    assert lv["ok"] + lv["shed"] == 12
    # burst 2, then one every 60/80 s, for about 2 s of arrivals plus 1 s of queue.
    assert 5 <= lv["ok"] <= 9
    assert lv["shed"] >= 2
    q, h, total = lv["queue_wait_s"], lv["http_time_s"], lv["total_latency_s"]
    assert q["count"] == lv["ok"]
    assert q["p50"] > 0.1  # waited in the queue...
    assert q["max"] <= 1.0 + 0.25  # ...but never much beyond max_wait
    assert GEN * 0.9 <= h["p50"] <= GEN + 0.3  # HTTP time is the generation, not the wait
    assert h["max"] < 0.6
    assert total["p50"] == pytest.approx(q["p50"] + h["p50"], abs=0.3)
    assert lv["limiter_wait_s"]["max"] <= 1.0 + 1e-6  # the limiter's own (schedule) waits
    assert results["mock"]["rate_limited"] == 0


def test_without_a_client_limit_the_mock_says_429(tmp_path: Path) -> None:
    cfg = tmp_path / "lt.json"
    out = tmp_path / "out.json"
    cfg.write_text(json.dumps(config(limits=None)))
    assert cli(["loadtest", str(cfg), "--out", str(out), "--quiet"]) == 0
    results = json.loads(out.read_text())
    [lv] = results["levels"]
    assert lv["arrivals"] == 12
    assert lv["ok"] + lv["rate_limited"] == 12
    # What the mock allows in ~2 s: its burst of 2, then 2 per second.
    assert 4 <= lv["ok"] <= 8
    assert lv["rate_limited"] >= 4
    assert results["mock"]["ok"] == lv["ok"]
    assert lv["queue_wait_s"]["p99"] < 0.1  # nothing queued on the client side
    assert lv["ok_per_second"] == pytest.approx(2.0, rel=0.5)


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="loopback"):
        loadtest.LoadTestConfig.from_dict({"endpoint": "http://192.0.2.1/v1"})
    with pytest.raises(ValueError, match="unknown config keys"):
        loadtest.LoadTestConfig.from_dict({"endpoint": "mock", "rsp": 3})
    with pytest.raises(ValueError, match="endpoint"):
        loadtest.LoadTestConfig.from_dict({"rps": 3})
    with pytest.raises(ValueError):
        loadtest.LoadTestConfig.from_dict({"endpoint": "mock", "rps": [0]})
    with pytest.raises(ValueError, match="limits"):
        loadtest.LoadTestConfig.from_dict({"endpoint": "mock", "limits": {"max_wait": 1}})
    ok = loadtest.LoadTestConfig.from_dict(
        {"endpoint": "http://127.0.0.1:9/x", "rps": 2, "concurrency": 3}
    )
    assert (ok.rps, ok.concurrency) == ([2.0], [3])
