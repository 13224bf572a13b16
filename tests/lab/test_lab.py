"""The queueing lab: arrivals, service times, theory, strategies in virtual time, output."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import random
from pathlib import Path

import pytest
import ratequeue as rq
from ratequeue import lab
from ratequeue.cli.main import main as cli
from ratequeue.lab import arrivals as arr
from ratequeue.lab import service as svc
from ratequeue.lab import theory

MU = 100 / 60  # 100 requests/minute, per second


# -- arrivals and service times ---------------------------------------------------------


@pytest.mark.parametrize(
    "process",
    [arr.Poisson(), arr.Constant(), arr.Batches(5), arr.OnOff(30, 30), arr.Batches(4, True)],
)
def test_arrivals_are_seeded_sorted_and_keep_the_mean_rate(process: lab.Arrivals) -> None:
    a = process.times(2.0, 5_000.0, random.Random(7))
    b = process.times(2.0, 5_000.0, random.Random(7))
    assert a == b
    assert a == sorted(a)
    assert all(0.0 <= t < 5_000.0 for t in a)
    assert len(a) / 5_000.0 == pytest.approx(2.0, rel=0.05)


def test_on_off_is_silent_when_off() -> None:
    times = arr.OnOff(on=10, off=20).times(1.0, 300, random.Random(1))
    assert all((t % 30) < 10 for t in times)


def test_burst_and_replay(tmp_path: Path) -> None:
    assert arr.Burst(5, at=2.0).times(1.0, 0.0, random.Random(0)) == [2.0] * 5
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp\n# recorded\n100.0\n101.0\n101.5\n103.0\n104.0\n")
    replay = arr.Replay.from_file(trace)
    assert replay.stamps == (0.0, 1.0, 1.5, 3.0, 4.0)
    assert replay.natural_rate == 1.0
    assert replay.times(2.0, 100, random.Random(0)) == [0.0, 0.5, 0.75, 1.5, 2.0]  # squeezed
    raw = arr.Replay.from_file(trace, scale=False)
    assert raw.times(2.0, 3.2, random.Random(0)) == [0.0, 1.0, 1.5, 3.0]
    iso = tmp_path / "iso.txt"
    iso.write_text("2026-01-01T00:00:00Z\n2026-01-01T00:00:02Z\n")
    assert arr.Replay.from_file(iso, scale=False).stamps == (0.0, 2.0)
    assert isinstance(lab.parse_arrivals(f"replay:{trace}"), arr.Replay)
    assert lab.parse_arrivals("onoff:5:10") == arr.OnOff(5, 10)
    assert lab.parse_arrivals("batches:3") == arr.Batches(3)
    with pytest.raises(ValueError):
        lab.parse_arrivals("fractal")


@pytest.mark.parametrize("dist", [svc.Constant(2.0), svc.Exponential(2.0), svc.LogNormal(2.0, 0.5)])
def test_service_times_have_their_mean(dist: svc.ServiceTime) -> None:
    rng = random.Random(3)
    xs = [dist.sample(rng) for _ in range(40_000)]
    assert min(xs) >= 0
    assert sum(xs) / len(xs) == pytest.approx(dist.mean, rel=0.03)
    assert lab.parse_service("lognormal:2:0.5") == svc.LogNormal(2.0, 0.5)
    assert lab.parse_service("exp:3") == svc.Exponential(3.0)
    assert lab.parse_service("constant:1.5") == svc.Constant(1.5)


# -- theory -----------------------------------------------------------------------------


def test_mm1_formulas_with_units() -> None:
    # The design page's numbers: r = 100/min, p99 at rho = 0.8 about 13 s, at 0.95 about 55 s.
    assert theory.mm1_wait_quantile(0.8, MU, 0.99) == pytest.approx(13.15, abs=0.01)
    assert theory.mm1_wait_quantile(0.95, MU, 0.99) == pytest.approx(54.65, abs=0.01)
    assert theory.mm1_wait_quantile(0.5, MU, 0.5) == 0.0  # P(W = 0) = 1 - rho
    assert theory.mm1_mean_wait(0.8, MU) == pytest.approx(0.8 / (MU * 0.2))


def test_md1_distribution_against_the_lindley_recursion() -> None:
    assert theory.md1_mean_wait(0.8, MU) == pytest.approx(0.8 / (2 * MU * 0.2))
    assert theory.md1_wait_cdf(0.0, 0.8, MU) == pytest.approx(0.2)
    rng = random.Random(11)
    w, waits, d = 0.0, [], 1 / MU
    for _ in range(200_000):
        waits.append(w)
        w = max(0.0, w + d - rng.expovariate(0.8 * MU))
    waits.sort()
    for p in (0.5, 0.9, 0.99):
        measured = waits[int(p * len(waits))]
        assert theory.md1_wait_quantile(0.8, MU, p) == pytest.approx(measured, rel=0.06)
    # The CDF's mean is the closed form (numerically, on a grid).
    grid = [i * 0.05 for i in range(1200)]
    tail = sum(1 - theory.md1_wait_cdf(t, 0.8, MU) for t in grid) * 0.05
    assert tail == pytest.approx(theory.md1_mean_wait(0.8, MU), rel=0.02)


def test_the_bucket_burst_shifts_md1_down_exactly() -> None:
    for p in (0.9, 0.99):
        plain = theory.md1_wait_quantile(0.9, MU, p)
        assert theory.md1_wait_quantile(0.9, MU, p, burst=5) == pytest.approx(plain - 4 / MU)
    assert theory.md1_wait_quantile(0.5, MU, 0.99, burst=5) == 0.0
    assert 0 < theory.md1_mean_wait(0.9, MU, burst=5) < theory.md1_mean_wait(0.9, MU)


# -- virtual time -----------------------------------------------------------------------


def workload(times: list[float], service: float = 1.0, cls: str = "batch") -> lab.Workload:
    reqs = tuple(lab.Request(i, t, service, cls) for i, t in enumerate(times))
    return lab.Workload(reqs, rate=1.0, duration=max(times, default=0.0))


def test_virtual_time_grants_at_schedule_times() -> None:
    vt = lab.VirtualTime()
    lim = vt.limiter(rq.Rate(60, per="minute", burst=1))
    seen: list[tuple[float, float]] = []
    for t in (0.0, 0.0, 0.0, 5.0):
        vt.at(t, lambda: vt.submit(lim, lambda ok, waited: seen.append((vt.now, waited))))
    vt.run()
    assert seen == [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0), (5.0, 0.0)]


def test_naive_retry_really_issues_every_extra_call() -> None:
    # Ten at once against 60/min, burst 1: one call succeeds per second at best, and
    # every refused call is a real call that the provider counted and answered 429.
    w = workload([0.0] * 10)
    run = lab.NaiveRetry(base=1.0, cap=8.0).run(w, lab.ProviderLimit(60, 1), random.Random(5))
    [row] = run.rows
    assert row.served == 10
    assert row.calls == run.info["provider_calls"]
    assert row.rejected_calls == run.info["provider_429"]
    assert row.calls - row.served == row.rejected_calls > 10
    assert row.wait.max >= 9.0  # the tenth success cannot start before t = 9 s
    # Same seed, same story.
    again = lab.NaiveRetry(base=1.0, cap=8.0).run(w, lab.ProviderLimit(60, 1), random.Random(5))
    assert again.rows[0].summary() == row.summary()
    # A bounded number of attempts sheds what is left.
    capped = lab.NaiveRetry(max_attempts=2).run(w, lab.ProviderLimit(60, 1), random.Random(5))
    assert capped.rows[0].shed > 0
    assert capped.rows[0].calls <= 20


def test_the_queue_never_gets_a_429_and_matches_md1() -> None:
    sc = lab.Scenario(rhos=(0.8,), requests=20_000, strategies=(lab.Queue(),), burst=0, seed=3)
    level = lab.run_level(sc, 0.8)
    [row] = level.rows
    info = level.info["queue"]
    assert info["provider_429"] == 0
    assert info["grants_off_schedule"] == 0
    assert row.calls == row.requests == row.served
    s = row.summary()
    assert s["wait_p50"] == pytest.approx(level.theory["md1_p50"], rel=0.15)
    assert s["wait_p95"] == pytest.approx(level.theory["md1_p95"], rel=0.15)
    assert s["wait_p99"] == pytest.approx(level.theory["md1_p99"], rel=0.2)


def test_bounded_priority_and_pool_behave() -> None:
    strategies = (
        lab.Queue(max_wait=3.0, key="bounded"),
        lab.Priority(),
        lab.PoolStrategy(k=2, max_wait=3.0),
    )
    sc = lab.Scenario(requests=6_000, strategies=strategies, burst=0, interactive_share=0.3)
    level = lab.run_level(sc, 0.97)
    rows = {r.strategy: r for r in level.rows}
    bounded = rows["bounded"]
    assert bounded.shed > 0
    assert bounded.wait.max <= 3.0 + 1e-6
    inter, batch = rows["priority/interactive"], rows["priority/batch"]
    assert inter.summary()["wait_p99"] < batch.summary()["wait_p99"] / 3
    assert rows["pool"].shed == 0 and rows["pool"].summary()["wait_p99"] < 2.0


def test_the_pool_never_sends_to_a_provider_in_cooldown() -> None:
    # p1 answers 429 (Retry-After: the rest of its outage) from t = 600 s to 1,800 s.
    outage = lab.Outage(provider=0, start=600.0, end=1_800.0)
    strategy = lab.PoolStrategy(k=2, max_wait=20.0, outages=(outage,), trace=True)
    sc = lab.Scenario(requests=4_000, strategies=(strategy,), burst=0, warmup=0.0)
    level = lab.run_level(sc, 0.9)
    info = level.info["pool"]
    assert info["provider_429"] >= 1
    cooldowns = info["cooldowns"]
    assert cooldowns and all(end - start >= 0 for _, start, end in cooldowns)
    for name, start, end in cooldowns:
        inside = [t for t, n in info["calls"] if n == name and start < t < end]
        assert inside == [], f"{name} was called during its cooldown {start}..{end}"
    # During the outage everything went to p2; after it, p1 is used again.
    during = {n for t, n in info["calls"] if 700 < t < 1_700}
    after = {n for t, n in info["calls"] if t > 1_900}
    assert during == {"p2"} and after == {"p1", "p2"}
    [row] = level.rows
    assert row.calls == row.served + row.rejected_calls  # every 429 was a counted call


def test_a_scenario_is_deterministic_for_a_seed() -> None:
    sc = lab.Scenario(rhos=(0.6, 0.95), requests=1_500, burst=50, seed=42)
    a = lab.run_scenario(sc, progress=False).to_dict()
    b = lab.run_scenario(sc, progress=False).to_dict()
    for d in (a, b):
        d.pop("elapsed_s")
        for lv in [*d["levels"], d["burst"]]:
            lv.pop("elapsed_s")
    assert a == b
    c = lab.run_scenario(lab.Scenario(rhos=(0.6,), requests=1_500, burst=0, seed=43))
    assert c.levels[0].rows[0].summary() != a["levels"][0]["rows"][0]


def test_outputs_table_json_csv_plot(tmp_path: Path) -> None:
    sc = lab.Scenario(rhos=(0.5, 0.9), requests=800, burst=20)
    report = lab.run_scenario(sc, progress=False)
    text = lab.format_report(report)
    for needle in ("rho = 0.9", "M/M/1 theory", "M/D/1 theory", "naive retry", "burst of 20"):
        assert needle in text
    data = json.loads(lab.write_json(report, tmp_path / "r.json").read_text())
    assert [lv["rho"] for lv in data["levels"]] == [0.5, 0.9]
    assert data["levels"][1]["theory"]["md1_mean"] == pytest.approx(0.9 / (2 * MU * 0.1))
    with lab.write_csv(report, tmp_path / "r.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 6  # two levels and the burst, six rows each
    assert {"wait_p99", "latency_p99", "shed_share", "theory_mm1_p99"} <= set(rows[0])
    if os.environ.get("CI", "").lower() != "true":  # in CI (test extra) it must be there
        pytest.importorskip("matplotlib")
    png = lab.plot(report, tmp_path / "knee.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar() -> None:
    out = io.StringIO()
    with lab.Progress(10, "work", enabled=True, stream=out) as bar:
        bar.advance(5)
        bar.advance(5)
    assert "100.0%" in out.getvalue() and "[" in out.getvalue()
    quiet = io.StringIO()
    lab.Progress(10, enabled=None, stream=quiet).advance(3)  # not a terminal: silent
    assert quiet.getvalue() == ""


def test_cli_lab_and_burst_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["lab", "--rho", "0.7", "--requests", "300", "--out", str(tmp_path), "--no-progress"]
    assert cli([*argv, "--formats", "json,csv", "--strategies", "queue,naive"]) == 0
    out = capsys.readouterr().out
    assert "rho = 0.7" in out and (tmp_path / "lab.json").exists()
    assert cli(["demo", "--burst-only"]) == 0
    assert "unbounded queue" in capsys.readouterr().out


def test_scenario_validation() -> None:
    with pytest.raises(ValueError):
        lab.Scenario(rhos=(), burst=0)
    with pytest.raises(ValueError):
        lab.Scenario(rhos=(-1.0,))
    assert math.isnan(lab.theory_at(1.2, lab.ProviderLimit())["md1_p99"])


def test_lab_demo_writes_its_files(tmp_path: Path) -> None:
    from ratequeue.cli import demo

    text = demo.lab_demo(
        per_level=400, rhos=(0.8,), burst_requests=30, out=tmp_path, plot=False, progress=False
    )
    assert "rho = 0.8" in text and "burst of 30 at once" in text
    assert "M/D/1, burst 5 (exact)" in text  # the demo's provider has a burst of 5
    assert (tmp_path / "demo.json").exists() and (tmp_path / "demo.csv").exists()
