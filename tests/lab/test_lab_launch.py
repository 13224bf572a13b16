"""The lab's inference cluster and the launch-day scenario, in virtual time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ratequeue import lab
from ratequeue.cli.main import main as cli
from ratequeue.lab import launch
from ratequeue.lab.cluster import ClusterSpec, InferenceCluster, Job, ReplicaSpec
from ratequeue.lab.engine import VirtualTime

# -- the cluster ---------------------------------------------------------------------------


class _Log:
    def __init__(self) -> None:
        self.first: list[float] = []
        self.done: list[float] = []
        self.failed: list[int] = []

    def job(self, vt: VirtualTime, prompt: int = 100, output: int = 10) -> Job:
        return Job(
            prompt,
            output,
            self.first.append,
            lambda: self.done.append(vt.now),
            self.failed.append,
        )


def test_batches_form_in_the_window_and_time_to_first_token_grows_with_the_batch() -> None:
    vt = VirtualTime()
    rs = ReplicaSpec(max_batch=4, batch_window=0.5, ttft_base=1.0, ttft_per_request=0.5)
    c = InferenceCluster(vt, ClusterSpec(replicas=1, max_replicas=1, replica=rs))
    log = _Log()
    vt.at(0.0, lambda: c.submit(log.job(vt)))
    vt.at(0.2, lambda: c.submit(log.job(vt)))
    vt.at(10.0, lambda: c.submit(log.job(vt)))
    vt.run()
    # Two requests in one batch at 0.5 s: ttft = 1 + 0.5*2; alone at 10.5: 1 + 0.5.
    assert log.first == [2.5, 2.5, 12.0]
    tpot2 = rs.tpot(2)
    assert log.done[:2] == [pytest.approx(2.5 + 10 * tpot2)] * 2
    assert rs.tpot(4) > rs.tpot(1)
    assert c.completed == 3


def test_kv_cache_capacity_holds_requests_back_and_a_full_queue_refuses() -> None:
    vt = VirtualTime()
    rs = ReplicaSpec(max_batch=8, batch_window=0.0, kv_capacity=250, max_waiting=2)
    c = InferenceCluster(vt, ClusterSpec(replicas=1, max_replicas=1, replica=rs))
    log = _Log()
    assert c.submit(log.job(vt)) and c.submit(log.job(vt))
    vt.run(until=0.0)  # both admitted: 220 of 250 KV tokens in use
    assert c.gauges()["kv_cache"] == pytest.approx(220 / 250)
    # The KV cache is full for a third: two wait, the next finds the queue full (503).
    assert [c.submit(log.job(vt)) for _ in range(3)] == [True, True, False]
    assert c.depth == 2 and c.refused == 1
    assert not c.submit(log.job(vt, prompt=300))  # larger than the whole KV cache
    vt.run()
    assert c.completed == 4
    assert c.gauges()["kv_cache"] == 0.0


def test_scale_out_takes_the_delay_and_stops_at_max_replicas_and_failures_drop_work() -> None:
    vt = VirtualTime()
    c = InferenceCluster(vt, ClusterSpec(replicas=2, max_replicas=3, scale_out_delay=90.0))
    assert c.scale_out(5) == 1
    assert c.scale_out(1) == 0  # one starting already fills max_replicas
    vt.run(until=89.0)
    assert c.up == 2
    vt.run(until=90.0)
    assert c.up == 3
    log = _Log()
    for _ in range(3):
        c.submit(log.job(vt, output=1000))
    vt.run(until=91.0)
    lost = c.fail()
    assert lost == 1 and log.failed == [503]
    assert c.up == 2 and c.replica_log[-1] == (91.0, 2)
    assert c.gauges()["queue_capacity"] == 2 * c.spec.replica.queue_capacity


# -- the launch day ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launch_day() -> launch.LaunchReport:
    sc = launch.LaunchScenario(strategies=("static", "static-high", "queue-depth"))
    return launch.LaunchReport(
        sc,
        [launch.run_strategy(sc, k) for k in sc.strategies],
        [launch.run_strategy(sc, "queue-depth", drill=True)],
    )


@pytest.mark.timeout(300)
def test_queue_depth_with_scale_out_keeps_interactive_fast_and_refuses_nothing_once_up(
    launch_day: launch.LaunchReport,
) -> None:
    sc = launch_day.scenario
    qd = launch_day.run("queue-depth")
    assert qd.p("interactive", 99) < 2.0
    assert qd.replicas_up_at is not None
    assert qd.replicas_up_at <= sc.surge_start + sc.cluster.scale_out_delay + 5 * sc.interval
    assert qd.refused_after(qd.replicas_up_at) == 0
    assert qd.classes["interactive"].refused == 0
    assert qd.refused_share() < 0.01
    assert qd.peak_replicas >= 3 * sc.cluster.replicas
    # The drill: a replica fails mid-surge; its requests are lost, nothing else changes.
    drill = launch_day.run("queue-depth", drill=True)
    assert drill.p("interactive", 99) < 2.0
    assert sum(c.failed for c in drill.classes.values()) > 0
    assert drill.refused_after(drill.replicas_up_at or 0.0) == 0


@pytest.mark.timeout(300)
def test_a_static_limit_refuses_a_large_share_or_lets_the_backend_queue_explode(
    launch_day: launch.LaunchReport,
) -> None:
    sc = launch_day.scenario
    static = launch_day.run("static")
    surge_arrivals = sc.surge * sc.nominal * sc.surge_for
    refused = sum(c.refused + c.backend_refused for c in static.classes.values())
    assert refused > 0.5 * surge_arrivals
    high = launch_day.run("static-high")
    full = sc.cluster.replicas * sc.cluster.replica.max_waiting
    assert high.max_depth == full  # the backend's queue filled up, then it said 503
    assert sum(c.backend_refused for c in high.classes.values()) > 0.3 * surge_arrivals
    assert high.p("interactive", 99) > 30.0
    assert high.peak_replicas == static.peak_replicas == sc.cluster.replicas


def test_the_launch_report_and_its_files(tmp_path: Path, launch_day: launch.LaunchReport) -> None:
    text = launch.format_launch(launch_day)
    assert "queue-depth + scale-out" in text and "drill" in text
    data = json.loads(launch.write_launch_json(launch_day, tmp_path / "l.json").read_text())
    assert [r["strategy"] for r in data["launch"]] == ["static", "static-high", "queue-depth"]
    assert data["timelines"]["launch"]["queue-depth"][0]["t"] == 10.0
    lines = launch.write_launch_csv(launch_day, tmp_path / "l.csv").read_text().splitlines()
    assert lines[0].startswith("run,strategy,t,goodput")
    png = launch.plot_launch(launch_day, tmp_path / "l.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


_Scenario = launch.LaunchScenario


def _small(seed: int = 1) -> launch.LaunchScenario:
    return _Scenario(
        cluster=ClusterSpec(replicas=1, max_replicas=3, replica=ReplicaSpec(max_batch=4)),
        before=60.0,
        surge_for=300.0,
        after=60.0,
        seed=seed,
    )


def test_runs_are_deterministic_for_a_seed() -> None:
    a = launch.run_launch(_small(), drill=False)
    b = launch.run_launch(_small(), drill=False)
    c = launch.run_launch(_small(seed=2), drill=False)
    assert [r.summary() for r in a.launch] == [r.summary() for r in b.launch]
    assert [r.summary() for r in a.launch] != [r.summary() for r in c.launch]
    assert [r.key for r in a.launch] == list(launch.STRATEGIES)


def test_cli_runs_the_launch_scenario(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launch, "LaunchScenario", lambda seed: _small(seed))
    assert cli(["lab", "--scenario", "launch", "--out", str(tmp_path), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "launch day" in out and "seed 3" in out
    assert {p.name for p in tmp_path.iterdir()} == {"launch.json", "launch.csv", "launch.png"}


def test_scenario_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        launch.LaunchScenario(strategies=("magic",))
    with pytest.raises(ValueError):
        launch.LaunchScenario(surge=0.0)
    with pytest.raises(ValueError):
        ClusterSpec(replicas=5, max_replicas=4)
    with pytest.raises(ValueError):
        ReplicaSpec(max_batch=0)
    assert lab.LaunchScenario is launch.LaunchScenario
