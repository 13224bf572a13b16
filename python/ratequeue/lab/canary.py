"""Canary rollouts in virtual time: a verbose candidate caught at 1 %, an equal one promoted.

User tasks arrive as a Poisson process (``rate`` per second) from ``users`` users. Each
task goes to the arm :class:`~ratequeue.Canary` routes its user to and makes that
model's calls; every call's tokens pass one shared provider quota (a
:class:`~ratequeue.Limiter` of ``tpm`` tokens per minute on the same
:class:`~ratequeue.ManualClock`): a call the quota refuses is rate limited and its
task gives no valid answer. A task ends after the sum of its calls' latencies, and is
booked on its arm then; the canary checks its gates every ``check_every`` seconds.

* The *verbose* candidate decomposes each task into 3-5 calls with 1.5x longer answers:
  the tokens-per-valid-answer gate rolls it back within the first stage (1 %).
* The *equal* candidate has stable's distributions: it must reach 100 % with no false
  rollback, in every one of ``runs`` seeded runs.

The table sets the quota a full rollout of the verbose candidate would have burned (and
the rate limiting it would have caused) against what the canary burned, over the time
a full staged rollout takes.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._ratequeue import Limiter, ManualClock, Rate
from ..canary import DEFAULT_GATES, Arm, Canary, CanaryRequest, Gate

__all__ = [
    "EQUAL",
    "STABLE",
    "VERBOSE",
    "CanaryReport",
    "CanaryRun",
    "CanaryScenario",
    "Model",
    "format_canary",
    "main",
    "plot_canary",
    "run_canary",
    "simulate",
    "write_canary_csv",
]


@dataclass(frozen=True)
class Model:
    """How a model serves a task: calls (uniform in ``calls``), lognormal tokens and
    latency per call (medians ``tokens``, ``latency``), share of valid answers."""

    name: str
    calls: tuple[int, int] = (1, 1)
    tokens: float = 600.0
    tokens_sigma: float = 0.5
    latency: float = 2.0
    latency_sigma: float = 0.4
    valid: float = 0.95


STABLE = Model("stable")
VERBOSE = Model("verbose candidate (3-5 calls, 1.5x longer answers)", calls=(3, 5), tokens=900.0)
EQUAL = Model("equal candidate")

Mode = Literal["canary", "shadow", "stable", "full"]


@dataclass(frozen=True)
class CanaryScenario:
    """The traffic, the quota and the rollout (times in seconds)."""

    rate: float = 5.0
    users: int = 100_000
    tpm: float = 300_000.0
    stages: tuple[float, ...] = (0.01, 0.05, 0.2, 0.5, 1.0)
    min_stage_time: float = 1800.0
    min_sample: int = 50
    threshold: float = 0.2
    confidence: float = 0.99
    check_every: float = 60.0
    sample_every: float = 60.0
    seed: int = 1
    runs: int = 100

    @property
    def schedule(self) -> float:
        """How long a rollout with no hold takes: every stage's minimum time."""
        return len(self.stages) * self.min_stage_time

    def gates(self) -> tuple[Gate, ...]:
        """The default gates at this scenario's threshold, sample and confidence."""
        return tuple(
            Gate(
                g.kpi,
                self.threshold,
                min_sample=self.min_sample,
                confidence=self.confidence,
                slack=g.slack,
            )
            for g in DEFAULT_GATES
        )


@dataclass
class CanaryRun:
    """One simulated run: what happened, what it cost, and the KPIs over time."""

    mode: Mode
    candidate: str
    seed: int
    duration: float
    state: str = "running"
    rolled_back_at: float | None = None
    completed_at: float | None = None
    tasks: int = 0
    valid: int = 0
    calls: int = 0
    rate_limited: int = 0
    tokens_requested: int = 0
    tokens_burned: dict[str, int] = field(default_factory=lambda: {"stable": 0, "candidate": 0})
    decisions: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, float | None]] = field(default_factory=list)

    @property
    def burned(self) -> int:
        """Tokens the quota admitted, both arms."""
        return sum(self.tokens_burned.values())


def simulate(
    sc: CanaryScenario,
    candidate: Model,
    *,
    mode: Mode = "canary",
    seed: int | None = None,
    stable: Model = STABLE,
    until_decided: bool = False,
    duration: float | None = None,
) -> CanaryRun:
    """Run one rollout (``canary``; ``shadow``: answers from stable, the routed users'
    tasks copied to the candidate), or everyone on stable / on the candidate (``full``).

    ``until_decided`` stops a canary run at its rollback or completion (the seeded
    checks need nothing more); otherwise it runs for ``duration`` (default: the
    rollout's schedule).
    """
    seed = sc.seed if seed is None else seed
    horizon = sc.schedule if duration is None else duration
    if until_decided:
        horizon = max(horizon, 4 * sc.schedule)
    rng = random.Random(seed)
    clock = ManualClock()
    quota = Limiter(Rate(sc.tpm, per="minute", unit="tokens", burst=int(sc.tpm / 6)), clock=clock)

    def noop(request: object) -> None:
        return None

    canary = Canary(
        noop,
        noop,
        stages=sc.stages,
        min_stage_time=sc.min_stage_time,
        gates=sc.gates(),
        clock=clock,
        check_every=sc.check_every,
        salt=f"lab-{seed}",
        shadow=mode == "shadow",
    )
    run = CanaryRun(mode, candidate.name, seed, horizon)
    heap: list[tuple[float, int, Any, bool]] = []
    seq = 0
    next_sample = 0.0
    t = 0.0

    def sample(now: float) -> None:
        k = canary.kpis()
        s, c = k["stable"], k["candidate"]
        run.timeline.append(
            {
                "t": now,
                "fraction": canary.fraction
                if mode in ("canary", "shadow")
                else float(mode == "full"),
                "stable_tokens_per_valid_answer": _num(s.tokens_per_valid_answer),
                "candidate_tokens_per_valid_answer": _num(c.tokens_per_valid_answer),
                "stable_calls_per_request": _num(s.calls_per_request),
                "candidate_calls_per_request": _num(c.calls_per_request),
                "stable_rate_limited_share": _num(s.rate_limited_share),
                "candidate_rate_limited_share": _num(c.rate_limited_share),
            }
        )

    expo, randrange, randint, lognorm, uniform = (
        rng.expovariate,
        rng.randrange,
        rng.randint,
        rng.lognormvariate,
        rng.random,
    )
    try_acquire = quota.try_acquire
    push, pop = heapq.heappush, heapq.heappop
    shape = {
        arm: (m.calls, math.log(m.tokens), m.tokens_sigma, math.log(m.latency), m.latency_sigma)
        for arm, m in (("stable", stable), ("candidate", candidate))
    }
    burned = run.tokens_burned
    shadow = mode == "shadow"
    fixed: Arm | None = None
    if mode not in ("canary", "shadow"):
        fixed = "candidate" if mode == "full" else "stable"
    requested = calls_made = refused = tasks = valid = 0

    def serve(req: CanaryRequest) -> bool:
        nonlocal requested, calls_made, refused, seq
        arm = req.arm
        (lo, hi), mu, sigma, lat_mu, lat_sigma = shape[arm]
        ok = True
        latency = 0.0
        for _ in range(randint(lo, hi) if hi > lo else lo):
            tok = round(lognorm(mu, sigma)) or 1
            requested += tok
            calls_made += 1
            if try_acquire(tokens=tok):
                req.call(tok)
                burned[arm] += tok
            else:
                req.call(0, rate_limited=True)
                refused += 1
                ok = False
            latency += lognorm(lat_mu, lat_sigma)
        ok = ok and uniform() < (candidate.valid if arm == "candidate" else stable.valid)
        seq += 1
        push(heap, (t + latency, seq, req, ok))
        return ok

    while True:
        t += expo(sc.rate)
        while heap and heap[0][0] <= t:
            ft, _, req, ok = pop(heap)
            if ft > horizon:
                break
            clock.set(ft)
            req.finish(valid=ok)
        if t >= horizon:
            break
        clock.set(t)
        if next_sample <= t:
            while next_sample <= t:
                sample(next_sample)
                next_sample += sc.sample_every
            if until_decided and canary.state != "running":
                break
        user = randrange(sc.users)
        arm = canary.arm_for(user) if fixed is None else fixed
        ok = serve(CanaryRequest(canary, user, arm))
        tasks += 1
        valid += ok
        if shadow and canary.shadowed(user):
            serve(CanaryRequest(canary, user, "candidate", shadow=True))
    run.tokens_requested, run.calls, run.rate_limited = requested, calls_made, refused
    run.tasks, run.valid = tasks, valid
    run.state = canary.state if mode in ("canary", "shadow") else mode
    run.duration = min(horizon, clock.now())
    for d in canary.decisions:
        if d.action == "rollback":
            run.rolled_back_at = d.at
        elif d.action == "complete":
            run.completed_at = d.at
        if d.action != "hold":
            run.decisions.append(
                {
                    "at": d.at,
                    "action": d.action,
                    "from": d.fraction_before,
                    "to": d.fraction_after,
                    "reason": d.reason,
                }
            )
    return run


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


@dataclass
class CanaryReport:
    """The scenario's runs: verbose candidate (three ways), and the seeded checks."""

    scenario: CanaryScenario
    stable: CanaryRun
    full: CanaryRun
    canary: CanaryRun
    shadow: CanaryRun
    equal: CanaryRun
    equal_runs: list[CanaryRun]
    verbose_runs: list[CanaryRun]

    def to_dict(self) -> dict[str, Any]:
        def summary(r: CanaryRun) -> dict[str, Any]:
            return {k: v for k, v in r.__dict__.items() if k not in ("timeline", "decisions")} | {
                "decisions": r.decisions
            }

        return {
            "scenario": self.scenario.__dict__,
            "stable": summary(self.stable),
            "full": summary(self.full),
            "canary": summary(self.canary),
            "shadow": summary(self.shadow),
            "equal": summary(self.equal),
            "equal_runs": [summary(r) for r in self.equal_runs],
            "verbose_runs": [summary(r) for r in self.verbose_runs],
        }


def run_canary(sc: CanaryScenario | None = None, *, runs: int | None = None) -> CanaryReport:
    """The verbose candidate all-stable / full rollout / canary / shadow canary on one
    seed, the equal candidate's rollout, and ``runs`` seeded rollouts of each."""
    sc = sc or CanaryScenario()
    n = sc.runs if runs is None else runs
    return CanaryReport(
        scenario=sc,
        stable=simulate(sc, VERBOSE, mode="stable"),
        full=simulate(sc, VERBOSE, mode="full"),
        canary=simulate(sc, VERBOSE),
        shadow=simulate(sc, VERBOSE, mode="shadow"),
        equal=simulate(sc, EQUAL, duration=sc.schedule + 4 * sc.min_stage_time),
        equal_runs=[
            simulate(sc, EQUAL, seed=sc.seed + 1000 + i, until_decided=True) for i in range(n)
        ],
        verbose_runs=[
            simulate(sc, VERBOSE, seed=sc.seed + 1000 + i, until_decided=True) for i in range(n)
        ],
    )


def _fmt_tokens(n: float) -> str:
    return f"{n / 1e6:.2f} M"


def format_canary(report: CanaryReport) -> str:
    """The quota table, the decisions and the seeded checks, as Markdown."""
    sc = report.scenario
    base = report.stable.burned
    lines = [
        f"Canary rollout: {sc.rate:g} tasks/s from {sc.users} users, shared quota "
        f"{sc.tpm:,.0f} tokens/min, stages {', '.join(f'{f:.0%}' for f in sc.stages)}, "
        f"{sc.min_stage_time / 60:g} min per stage, gates at +{sc.threshold:.0%} "
        f"(min sample {sc.min_sample}, confidence {sc.confidence}), seed {sc.seed}.",
        "",
        f"Quota over the {sc.schedule / 3600:g} h a full staged rollout takes "
        f"(candidate: {VERBOSE.name}):",
        "",
        "| run | tokens asked | tokens burned | burned vs all-stable | candidate tokens "
        "| rate-limited calls | valid answers |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = (
        ("all stable", report.stable),
        ("full rollout of the candidate", report.full),
        ("canary", report.canary),
        ("canary in shadow mode (answers from stable)", report.shadow),
    )
    for label, r in rows:
        lines.append(
            f"| {label} | {_fmt_tokens(r.tokens_requested)} | {_fmt_tokens(r.burned)} "
            f"| {r.burned / base - 1:+.1%} | {_fmt_tokens(r.tokens_burned['candidate'])} "
            f"| {r.rate_limited / max(1, r.calls):.1%} | {r.valid / max(1, r.tasks):.1%} |"
        )
    c = report.canary
    lines.append("")
    if c.rolled_back_at is not None:
        lines.append(
            f"The canary rolled the candidate back after {c.rolled_back_at / 60:.1f} min "
            f"at {c.decisions[-1]['from']:.0%}: {c.decisions[-1]['reason']}."
        )
    else:
        lines.append(f"The canary did not roll the candidate back (state {c.state}).")
    lines.append("")
    lines.append("Decisions of the equal candidate's rollout:")
    lines.append("")
    for d in report.equal.decisions:
        lines.append(
            f"- {d['at'] / 60:6.1f} min  {d['action']:8s} {d['from']:.0%} -> {d['to']:.0%}"
        )

    def seeded(runs: list[CanaryRun], label: str) -> list[str]:
        if not runs:
            return []
        done = [r for r in runs if r.state == "complete"]
        back = [r for r in runs if r.state == "rolled_back"]
        first = [r for r in back if r.decisions and r.decisions[-1]["from"] == sc.stages[0]]
        out = [
            f"| {label} | {len(runs)} | {len(done)} | {len(back)} | {len(first)} | "
            + (
                f"{statistics.median(r.completed_at or 0.0 for r in done) / 3600:.2f} h"
                if done
                else "-"
            )
            + " | "
            + (
                f"{statistics.median(r.rolled_back_at or 0.0 for r in back) / 60:.1f} min"
                if back
                else "-"
            )
            + " |"
        ]
        return out

    lines += [
        "",
        "Seeded rollouts (each until its rollback or completion):",
        "",
        "| candidate | runs | reached 100 % | rolled back | in the first stage "
        "| median time to 100 % | median time to rollback |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *seeded(report.equal_runs, EQUAL.name),
        *seeded(report.verbose_runs, "verbose candidate"),
    ]
    return "\n".join(lines) + "\n"


def plot_canary(report: CanaryReport, path: str | Path) -> Path:
    """Tokens per valid answer and calls per request per arm over time, the rollout
    fraction, the rollback marked; verbose candidate left, equal candidate right."""
    try:
        from matplotlib.backends.backend_agg import (  # type: ignore[import-not-found, unused-ignore]
            FigureCanvasAgg,
        )
        from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError('plotting needs matplotlib: pip install "ratequeue[lab]"') from e
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(13, 9), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2, sharex="col", squeeze=False)
    for col, (title, run) in enumerate(
        (("verbose candidate: rolled back", report.canary), ("equal candidate", report.equal))
    ):
        ax = axes[:, col]
        t = [x["t"] / 60 for x in run.timeline]  # type: ignore[operator]
        for arm, colour in (("stable", "C0"), ("candidate", "C3")):
            ax[0].plot(
                t,
                [x[f"{arm}_tokens_per_valid_answer"] for x in run.timeline],
                color=colour,
                label=arm,
            )
            ax[1].plot(t, [x[f"{arm}_calls_per_request"] for x in run.timeline], color=colour)
        ax[2].step(t, [x["fraction"] for x in run.timeline], where="post", color="k")
        ax[0].set_title(title)
        ax[0].set_ylabel("tokens per valid answer\n(median, cumulative)")
        ax[1].set_ylabel("calls per request\n(mean, cumulative)")
        ax[2].set_ylabel("candidate share")
        ax[2].set_yscale("symlog", linthresh=0.01)
        ax[2].set_ylim(0, 1.3)
        ax[2].set_xlabel("minutes")
        for d in run.decisions:
            style = {"rollback": ("red", "-"), "advance": ("grey", ":"), "complete": ("green", "-")}
            colour, ls = style.get(d["action"], ("grey", ":"))
            for a in ax:
                a.axvline(d["at"] / 60, color=colour, ls=ls, lw=1.2)
        if run.rolled_back_at is not None:
            ax[0].annotate(
                f"rollback at {run.rolled_back_at / 60:.0f} min",
                (run.rolled_back_at / 60, 0.9),
                xycoords=("data", "axes fraction"),
                color="red",
                xytext=(5, 0),
                textcoords="offset points",
            )
        for a in ax:
            a.grid(True, alpha=0.3)
        ax[0].legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(str(p))
    return p


def write_canary_csv(report: CanaryReport, path: str | Path) -> Path:
    """The timelines of the verbose canary run and the equal candidate's run."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        w: csv.DictWriter[str] | None = None
        for name, run in (("verbose", report.canary), ("equal", report.equal)):
            for row in run.timeline:
                line = {"run": name, **row}
                if w is None:
                    w = csv.DictWriter(f, fieldnames=list(line))
                    w.writeheader()
                w.writerow(line)
    return p


def main(
    *,
    out: str | Path = "lab-out",
    formats: Sequence[str] = ("json", "csv", "png"),
    seed: int = 1,
    runs: int = 100,
) -> str:
    """``python -m ratequeue lab --scenario canary``: run, write files, return the text."""
    report = run_canary(CanaryScenario(seed=seed, runs=runs))
    text = format_canary(report)
    folder = Path(out)
    written: list[Path] = []
    if "json" in formats:
        path = folder / "canary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        written.append(path)
    if "csv" in formats:
        written.append(write_canary_csv(report, folder / "canary.csv"))
    if "png" in formats:
        written.append(plot_canary(report, folder / "canary.png"))
    if written:
        text += "\nwrote " + ", ".join(str(p) for p in written)
    return text
