"""The lab's canary scenario: a verbose candidate rolled back at 1 %, an equal one promoted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from ratequeue.cli.main import main as cli
from ratequeue.lab import canary as lab

# A fast model of the scenario: the same stages, gates and models, with 2 tasks/s, 5 min
# per stage and a minimum sample of 30 (a smaller sample is the harder case for false
# rollbacks). One run simulates about 5,000 tasks through the real Canary.
FAST = lab.CanaryScenario(rate=2.0, users=20_000, tpm=120_000, min_stage_time=300, min_sample=30)


def test_the_verbose_candidate_is_rolled_back_in_the_first_stage() -> None:
    run = lab.simulate(FAST, lab.VERBOSE, seed=7)
    assert run.state == "rolled_back"
    rollback = run.decisions[-1]
    assert rollback["action"] == "rollback" and rollback["from"] == FAST.stages[0]
    assert run.rolled_back_at is not None and run.rolled_back_at < FAST.min_stage_time * 10
    # The first gates with enough sample trip: calls per request, tokens, latency.
    assert "calls_per_request" in rollback["reason"] or "tokens_per" in rollback["reason"]
    # After the rollback nobody is on the candidate: the timeline's fraction is 0.
    assert all(x["fraction"] == 0.0 for x in run.timeline if x["t"] > run.rolled_back_at + 1)


def test_the_canary_burns_a_sliver_of_what_a_full_rollout_would() -> None:
    hours = 4 * FAST.schedule
    stable = lab.simulate(FAST, lab.VERBOSE, mode="stable", seed=3, duration=hours)
    full = lab.simulate(FAST, lab.VERBOSE, mode="full", seed=3, duration=hours)
    canary = lab.simulate(FAST, lab.VERBOSE, seed=3, duration=hours)
    # The full rollout asks for 3-5x the calls and 1.5x the tokens per call: the quota
    # refuses most of it; the canary's extra spend is a few percent.
    assert full.tokens_requested > 4 * stable.tokens_requested
    assert full.rate_limited / full.calls > 0.4 and stable.rate_limited == 0
    assert canary.burned < 1.05 * stable.burned
    assert canary.tokens_burned["candidate"] < 0.05 * canary.burned
    assert canary.valid / canary.tasks > 0.9 > full.valid / full.tasks
    # In shadow mode every answer comes from stable; the copies are caught alike.
    shadow = lab.simulate(FAST, lab.VERBOSE, mode="shadow", seed=3, duration=hours)
    assert shadow.state == "rolled_back" and shadow.decisions[-1]["from"] == FAST.stages[0]
    assert shadow.valid / shadow.tasks == pytest.approx(stable.valid / stable.tasks, abs=0.01)
    assert 0 < shadow.tokens_burned["candidate"] < 0.05 * shadow.burned


@pytest.mark.parametrize(("candidate", "seeds"), [("equal", 100), ("verbose", 30)])
def test_seeded_rollouts_decide_right(candidate: str, seeds: int) -> None:
    model = lab.EQUAL if candidate == "equal" else lab.VERBOSE
    runs = [lab.simulate(FAST, model, seed=1000 + i, until_decided=True) for i in range(seeds)]
    states = [r.state for r in runs]
    if candidate == "equal":
        assert states == ["complete"] * 100  # no false rollback, every run reaches 100 %
        for r in runs:
            assert [d["to"] for d in r.decisions] == [0.05, 0.2, 0.5, 1.0, 1.0]
            assert all(d["at"] >= FAST.min_stage_time * (i + 1) for i, d in enumerate(r.decisions))
    else:
        assert states == ["rolled_back"] * seeds
        assert all(r.decisions[-1]["from"] == FAST.stages[0] for r in runs)


def test_report_table_plot_and_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = lab.run_canary(FAST, runs=3)
    text = lab.format_canary(report)
    assert "| full rollout of the candidate |" in text and "| canary |" in text
    assert "| canary in shadow mode (answers from stable) |" in text
    assert "rolled the candidate back" in text
    assert "| equal candidate | 3 | 3 | 0 | 0 |" in text
    png = lab.plot_canary(report, tmp_path / "canary.png")
    assert png.stat().st_size > 10_000
    assert lab.write_canary_csv(report, tmp_path / "c.csv").read_text().startswith("run,t,")
    json.dumps(report.to_dict())
    # The command line runs the full scenario (minutes): here, its fast model.
    monkeypatch.setattr(
        lab, "CanaryScenario", lambda seed, runs: dataclasses.replace(FAST, seed=seed, runs=2)
    )
    assert cli(["lab", "--scenario", "canary", "--out", str(tmp_path), "--formats", "json"]) == 0
    assert "canary" in capsys.readouterr().out
    assert json.loads((tmp_path / "canary.json").read_text())["canary"]["state"] == "rolled_back"
