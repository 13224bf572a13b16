"""Launch day: a surge to 3x capacity for 30 minutes, strategies side by side.

Open-loop Poisson arrivals (20 % interactive, 80 % batch) reach an
:class:`~.cluster.InferenceCluster` through a ratequeue :class:`~ratequeue.Limiter` with
weighted classes (interactive 8 : batch 1) and per-class deadlines (interactive 30 s,
batch 300 s). The load is ``steady`` times the cluster's nominal capacity, then
``surge`` times it for ``surge_for`` seconds, then steady again. The drill fails one
replica in the middle of the surge. Every strategy sees the same arrivals:

* ``static`` -- a fixed rate at the nominal capacity: the backend is safe, the surge is
  refused;
* ``static-high`` -- a fixed rate at 3x nominal: nothing is held back, the backend's
  own queue explodes (long waits, then 503s);
* ``aimd`` / ``gradient2`` -- :class:`~ratequeue.Adaptive` on the rate, driven by drops
  and latency (time to first token), without scale-out;
* ``queue-depth`` -- :class:`~ratequeue.QueueDepth` on the backend's queue gauges with a
  scale-out hook: scale out at q >= 0.5, hold the rate at what the backend drains at
  q >= 0.8 (the surge waits, interactive first, in the bounded queue), shed only if the
  scale-out fails and q keeps rising.

Queue wait is arrival to admission into a batch (client queue plus backend queue).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from .._errors import Overloaded
from .._ratequeue import Rate
from ..adaptive import AIMD, Adaptive, Controller, Gradient2, QueueDepth, ScaleOut
from .cluster import ClusterSpec, InferenceCluster, Job, ReplicaSpec
from .engine import VirtualTime

__all__ = [
    "LaunchReport",
    "LaunchRun",
    "LaunchScenario",
    "format_launch",
    "main",
    "plot_launch",
    "run_launch",
    "run_strategy",
    "write_launch_csv",
    "write_launch_json",
]

CLASSES = {"interactive": 8.0, "batch": 1.0}
STRATEGIES = ("static", "static-high", "aimd", "gradient2", "queue-depth")
_LABELS = {
    "static": "static limit at nominal",
    "static-high": "static limit at 3x nominal",
    "aimd": "AIMD (drops, latency)",
    "gradient2": "Gradient2 (latency)",
    "queue-depth": "queue-depth + scale-out",
}


@dataclass(frozen=True)
class LaunchScenario:
    """The launch-day load against a cluster (times in seconds)."""

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    steady: float = 0.7
    surge: float = 3.0
    before: float = 600.0
    surge_for: float = 1800.0
    after: float = 1200.0
    interactive_share: float = 0.2
    interactive_timeout: float = 30.0
    batch_timeout: float = 300.0
    prompt_mean: float = 400.0
    output_mean: float = 100.0
    token_sigma: float = 0.6
    interval: float = 1.0
    bucket: float = 10.0
    strategies: tuple[str, ...] = STRATEGIES
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("steady", "surge", "surge_for", "interval", "bucket", "output_mean"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be a finite number > 0")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ValueError(f"strategies: unknown {unknown} (any of {', '.join(STRATEGIES)})")

    @property
    def nominal(self) -> float:
        """Requests per second the initial replicas serve when full."""
        rs = self.cluster.replica
        return self.cluster.replicas * rs.throughput(self.output_mean)

    @property
    def duration(self) -> float:
        return self.before + self.surge_for + self.after

    @property
    def surge_start(self) -> float:
        return self.before

    @property
    def fail_at(self) -> float:
        """When the drill fails a replica: the middle of the surge."""
        return self.before + self.surge_for / 2

    def rate_at(self, t: float) -> float:
        """Arrivals per second at time ``t``."""
        in_surge = self.before <= t < self.before + self.surge_for
        return self.nominal * (self.surge if in_surge else self.steady)


@dataclass(frozen=True, slots=True)
class _Req:
    t: float
    cls: str
    prompt: int
    output: int


def _workload(sc: LaunchScenario) -> list[_Req]:
    rng = random.Random(f"{sc.seed}/launch/arrivals")
    tok = random.Random(f"{sc.seed}/launch/tokens")
    s = sc.token_sigma

    def tokens(mean: float, top: int) -> int:
        mu = math.log(mean) - s * s / 2
        return max(1, min(top, round(tok.lognormvariate(mu, s))))

    out: list[_Req] = []
    edges = [0.0, sc.before, sc.before + sc.surge_for, sc.duration]
    for a, b in itertools.pairwise(edges):
        rate = sc.rate_at(a)
        t = a + rng.expovariate(rate)
        while t < b:
            cls = "interactive" if rng.random() < sc.interactive_share else "batch"
            out.append(_Req(t, cls, tokens(sc.prompt_mean, 4000), tokens(sc.output_mean, 1000)))
            t += rng.expovariate(rate)
    return out


@dataclass
class _ClassStats:
    arrivals: int = 0
    served: int = 0
    refused: int = 0
    backend_refused: int = 0
    failed: int = 0
    waits: list[float] = field(default_factory=list)


@dataclass
class LaunchRun:
    """One strategy on one workload: per-class figures, the timeline, the limit's log."""

    key: str
    label: str
    classes: dict[str, _ClassStats]
    timeline: list[dict[str, float]]
    refusal_times: list[float]
    replicas_up_at: float | None
    max_depth: int
    peak_replicas: int
    completed: int
    changes: int
    elapsed: float

    def p(self, cls: str, q: float) -> float:
        """Percentile ``q`` of class ``cls``'s queue wait (seconds; NaN when none)."""
        w = sorted(self.classes[cls].waits)
        if not w:
            return math.nan
        k = max(0, math.ceil(q / 100.0 * len(w)) - 1)
        return w[k]

    def refused_share(self, cls: str | None = None) -> float:
        """Share refused (client or backend) or failed, of one class or of all."""
        groups = [self.classes[cls]] if cls else list(self.classes.values())
        n = sum(c.arrivals for c in groups)
        bad = sum(c.refused + c.backend_refused + c.failed for c in groups)
        return bad / n if n else 0.0

    def refused_after(self, t: float) -> int:
        """Requests refused at or after time ``t``."""
        return sum(1 for x in self.refusal_times if x >= t)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "strategy": self.key,
            "label": self.label,
            "max_backend_depth": self.max_depth,
            "peak_replicas": self.peak_replicas,
            "completed": self.completed,
            "limit_changes": self.changes,
            "replicas_up_at": self.replicas_up_at,
            "refused_after_replicas_up": None
            if self.replicas_up_at is None
            else self.refused_after(self.replicas_up_at),
        }
        for cls, c in self.classes.items():
            out[cls] = {
                "arrivals": c.arrivals,
                "served": c.served,
                "refused": c.refused,
                "backend_refused": c.backend_refused,
                "failed": c.failed,
                "wait_p50": self.p(cls, 50),
                "wait_p99": self.p(cls, 99),
                "wait_max": max(c.waits) if c.waits else math.nan,
            }
        return out


def _controller(key: str, sc: LaunchScenario, hook: Callable[[ScaleOut], bool]) -> Controller:
    if key == "aimd":
        return AIMD(increase=sc.nominal / 50.0, timeout=5.0)
    if key == "gradient2":
        return Gradient2(queue_size=sc.nominal / 20.0)
    return QueueDepth(scale_out=hook)


def run_strategy(sc: LaunchScenario, key: str, *, drill: bool = False) -> LaunchRun:
    """Run strategy ``key`` on the scenario's arrivals (the drill fails a replica)."""
    started = time.perf_counter()
    vt = VirtualTime()
    cluster = InferenceCluster(vt, sc.cluster)
    rs: ReplicaSpec = sc.cluster.replica
    nominal = sc.nominal
    per_replica = rs.throughput(sc.output_mean)
    top = sc.cluster.max_replicas * per_replica
    initial = {"static": nominal, "static-high": 3.0 * nominal, "queue-depth": top}.get(
        key, nominal
    )
    reqs = _workload(sc)
    lim = vt.limiter(
        Rate(initial, per="second", burst=1),
        classes=CLASSES,
        max_wait=max(sc.interactive_timeout, sc.batch_timeout),
        max_queue=len(reqs) + 1,
    )

    def scale_out(req: ScaleOut) -> bool:
        have = cluster.up + cluster.starting
        need = math.ceil(req.demand * 1.5 / per_replica)
        return cluster.scale_out(max(1, need - have)) > 0

    adaptive: Adaptive | None = None
    if key not in ("static", "static-high"):
        adaptive = Adaptive(
            lim,
            _controller(key, sc, scale_out),
            interval=sc.interval,
            min_limit=nominal * 0.05,
            max_limit=top,
            shed_order=("batch", "interactive"),
            clock=vt.clock,
            name=key,
        )
    stats = {c: _ClassStats() for c in CLASSES}
    refusal_times: list[float] = []
    n_buckets = math.ceil(sc.duration / sc.bucket) + 1
    b_done = [0] * n_buckets
    b_refused = {c: [0] * n_buckets for c in CLASSES}
    b_waits: list[list[float]] = [[] for _ in range(n_buckets)]
    timeline: list[dict[str, float]] = []

    def bucket(t: float) -> int:
        return min(n_buckets - 1, int(t / sc.bucket))

    def refuse(req: _Req, backend: bool = False) -> None:
        st = stats[req.cls]
        if backend:
            st.backend_refused += 1
        else:
            st.refused += 1
        refusal_times.append(vt.now)
        b_refused[req.cls][bucket(vt.now)] += 1

    def arrive(req: _Req) -> None:
        stats[req.cls].arrivals += 1
        if adaptive is not None:
            adaptive.note_arrival()
            if not adaptive.admits(req.cls):
                refuse(req)
                return
        timeout = sc.interactive_timeout if req.cls == "interactive" else sc.batch_timeout
        try:
            vt.submit(lim, lambda ok, _w: granted(req, ok), priority=req.cls, timeout=timeout)
        except Overloaded:
            refuse(req)

    def granted(req: _Req, ok: bool) -> None:
        if not ok:
            refuse(req)
            return
        first: list[float] = []

        def on_first(t: float) -> None:
            first.append(t)
            st = stats[req.cls]
            st.served += 1
            wait = vt.now - req.t
            st.waits.append(wait)
            if req.cls == "interactive":
                b_waits[bucket(vt.now)].append(wait)

        def on_done() -> None:
            b_done[bucket(vt.now)] += 1
            if adaptive is not None:
                adaptive.observe(first[0] - job.arrived)

        def on_fail(status: int) -> None:
            stats[req.cls].failed += 1
            if adaptive is not None:
                adaptive.report(status)

        job = Job(req.prompt, req.output, on_first, on_done, on_fail)
        if not cluster.submit(job):
            refuse(req, backend=True)
            if adaptive is not None:
                adaptive.report(503)

    def control() -> None:
        if adaptive is not None:
            adaptive.set_gauges(**cluster.gauges())
            adaptive.step(force=True)
        if vt.now + sc.interval <= sc.duration:
            vt.after(sc.interval, control)

    def sample() -> None:
        i = bucket(vt.now) - 1
        if i >= 0:
            waits = sorted(b_waits[i])
            p99 = waits[max(0, math.ceil(0.99 * len(waits)) - 1)] if waits else math.nan
            timeline.append(
                {
                    "t": (i + 1) * sc.bucket,
                    "goodput": b_done[i] / sc.bucket,
                    "interactive_p99": p99,
                    "refused_interactive": b_refused["interactive"][i] / sc.bucket,
                    "refused_batch": b_refused["batch"][i] / sc.bucket,
                    "replicas": float(cluster.up),
                    "limit": float(lim.rates[0].amount),
                    "backend_depth": float(cluster.depth),
                    "client_waiting": float(lim.waiting),
                }
            )
        if vt.now + sc.bucket <= sc.duration + 1e-9:
            vt.after(sc.bucket, sample)

    for req in reqs:
        vt.at(req.t, partial(arrive, req))
    vt.at(sc.interval, control)
    vt.at(0.0, sample)
    if drill:
        vt.at(sc.fail_at, lambda: cluster.fail())
    vt.run()
    up_at = next(
        (t for t, n in cluster.replica_log if t > sc.surge_start and n > sc.cluster.replicas),
        None,
    )
    return LaunchRun(
        key=key,
        label=_LABELS[key],
        classes=stats,
        timeline=timeline,
        refusal_times=refusal_times,
        replicas_up_at=up_at,
        max_depth=cluster.max_depth,
        peak_replicas=max(n for _, n in cluster.replica_log),
        completed=cluster.completed,
        changes=0 if adaptive is None else len(adaptive.changes),
        elapsed=time.perf_counter() - started,
    )


@dataclass
class LaunchReport:
    """Every strategy on the launch day, and on the drill (a replica failing mid-surge)."""

    scenario: LaunchScenario
    launch: list[LaunchRun]
    drill: list[LaunchRun]

    def run(self, key: str, *, drill: bool = False) -> LaunchRun:
        for r in self.drill if drill else self.launch:
            if r.key == key:
                return r
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        sc = self.scenario
        return {
            "scenario": {
                "nominal_rps": sc.nominal,
                "replicas": sc.cluster.replicas,
                "max_replicas": sc.cluster.max_replicas,
                "scale_out_delay_s": sc.cluster.scale_out_delay,
                "steady": sc.steady,
                "surge": sc.surge,
                "surge_for_s": sc.surge_for,
                "seed": sc.seed,
            },
            "launch": [r.summary() for r in self.launch],
            "drill": [r.summary() for r in self.drill],
        }


def run_launch(
    sc: LaunchScenario | None = None, *, drill: bool = True, launch: bool = True
) -> LaunchReport:
    """Every strategy of ``sc`` on the launch day and (``drill``) on the drill."""
    sc = sc if sc is not None else LaunchScenario()
    runs = [run_strategy(sc, k) for k in sc.strategies] if launch else []
    drills = [run_strategy(sc, k, drill=True) for k in sc.strategies] if drill else []
    return LaunchReport(sc, runs, drills)


def _f(x: float | None, width: int = 7) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>{width}}"
    if abs(x) < 10:
        return f"{x:>{width}.2f}"
    if abs(x) < 1000:
        return f"{x:>{width}.1f}"
    return f"{x:>{width}.0f}"


def _table(runs: Sequence[LaunchRun], sc: LaunchScenario) -> list[str]:
    head = (
        f"{'strategy':<28}{'int p50':>8}{'int p99':>8}{'bat p99':>8}{'refused':>9}"
        f"{'int ref':>9}{'bat ref':>9}{'failed':>7}{'max depth':>10}{'replicas':>9}"
        f"{'ref after up':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        failed = sum(c.failed for c in r.classes.values())
        after = "-" if r.replicas_up_at is None else str(r.refused_after(r.replicas_up_at))
        lines.append(
            f"{r.label:<28}{_f(r.p('interactive', 50), 8)}{_f(r.p('interactive', 99), 8)}"
            f"{_f(r.p('batch', 99), 8)}{r.refused_share() * 100:8.1f}%"
            f"{r.refused_share('interactive') * 100:8.1f}%{r.refused_share('batch') * 100:8.1f}%"
            f"{failed:>7}{r.max_depth:>10}{r.peak_replicas:>9}{after:>13}"
        )
    return lines


def format_launch(report: LaunchReport) -> str:
    """Both tables (launch day, drill) with a line on the scenario."""
    sc = report.scenario
    c = sc.cluster
    parts = [
        f"launch day: {c.replicas} replicas (max {c.max_replicas}, new ones serve after "
        f"{c.scale_out_delay:g} s), nominal {sc.nominal:.1f} req/s; load {sc.steady:g}x, then "
        f"{sc.surge:g}x for {sc.surge_for / 60:g} min from t = {sc.before / 60:g} min, then "
        f"{sc.steady:g}x; {sc.interactive_share * 100:g} % interactive (deadline "
        f"{sc.interactive_timeout:g} s), batch deadline {sc.batch_timeout:g} s; seed {sc.seed}.",
        "queue wait (s) = arrival to admission into a batch; refused = client refusals, "
        "backend 503s and failed requests, as a share of arrivals.",
    ]
    for title, runs in (
        ("launch day", report.launch),
        (f"drill: one replica fails at t = {sc.fail_at / 60:g} min", report.drill),
    ):
        if runs:
            parts.append("")
            parts.append(title)
            parts.extend(_table(runs, sc))
    return "\n".join(parts)


def plot_launch(report: LaunchReport, path: str | Path) -> Path:
    """Goodput, interactive p99 wait, refusals by class, replicas and the limit over
    time, launch day on the left and the drill on the right. Needs matplotlib."""
    try:
        from matplotlib.backends.backend_agg import (  # type: ignore[import-not-found, unused-ignore]
            FigureCanvasAgg,
        )
        from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError('plotting needs matplotlib: pip install "ratequeue[lab]"') from e
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    columns = [(t, r) for t, r in (("launch day", report.launch), ("drill", report.drill)) if r]
    fig = Figure(figsize=(7.5 * len(columns), 15), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(5, len(columns), sharex=True, squeeze=False)
    sc = report.scenario
    for col, (title, runs) in enumerate(columns):
        ax = axes[:, col]
        for i, r in enumerate(runs):
            colour = f"C{i}"
            t = [x["t"] / 60 for x in r.timeline]
            ax[0].plot(t, [x["goodput"] for x in r.timeline], color=colour, label=r.label)
            ax[1].plot(t, [x["interactive_p99"] for x in r.timeline], color=colour)
            ax[2].plot(t, [x["refused_batch"] for x in r.timeline], color=colour)
            ax[2].plot(t, [x["refused_interactive"] for x in r.timeline], "--", color=colour)
            ax[3].plot(t, [x["replicas"] for x in r.timeline], color=colour)
            ax[4].plot(t, [x["limit"] for x in r.timeline], color=colour)
        demand = [sc.rate_at(x * sc.bucket) for x in range(int(sc.duration / sc.bucket) + 1)]
        grid = [x * sc.bucket / 60 for x in range(len(demand))]
        ax[0].plot(grid, demand, ":", color="grey", label="arrivals")
        ax[0].set_title(title)
        ax[0].set_ylabel("goodput (req/s)")
        ax[1].set_ylabel("interactive p99\nqueue wait (s)")
        ax[1].set_yscale("symlog", linthresh=1.0)
        ax[1].axhline(2.0, color="grey", lw=0.8, ls=":")
        ax[2].set_ylabel("refused/s\n(batch solid,\ninteractive dashed)")
        ax[3].set_ylabel("replicas up")
        ax[4].set_ylabel("limit (req/s)")
        ax[4].set_xlabel("minutes")
        for a in ax:
            a.grid(True, alpha=0.3)
            a.axvspan(sc.before / 60, (sc.before + sc.surge_for) / 60, color="orange", alpha=0.06)
        ax[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(str(p))
    return p


def write_launch_json(report: LaunchReport, path: str | Path) -> Path:
    """The summary of every run and its timeline, as JSON (NaN as null)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    data = report.to_dict()
    data["timelines"] = {
        name: {r.key: r.timeline for r in runs}
        for name, runs in (("launch", report.launch), ("drill", report.drill))
    }
    p.write_text(json.dumps(clean(data), indent=1) + "\n")
    return p


def write_launch_csv(report: LaunchReport, path: str | Path) -> Path:
    """Every run's timeline, one line per (run, strategy, time bucket)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        w: csv.DictWriter[str] | None = None
        for name, runs in (("launch", report.launch), ("drill", report.drill)):
            for r in runs:
                for row in r.timeline:
                    line = {"run": name, "strategy": r.key, **row}
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
) -> str:
    """``python -m ratequeue lab --scenario launch``: run, write files, return the text."""
    report = run_launch(LaunchScenario(seed=seed))
    text = format_launch(report)
    folder = Path(out)
    written: list[Path] = []
    if "json" in formats:
        written.append(write_launch_json(report, folder / "launch.json"))
    if "csv" in formats:
        written.append(write_launch_csv(report, folder / "launch.csv"))
    if "png" in formats:
        written.append(plot_launch(report, folder / "launch.png"))
    if written:
        text += "\nwrote " + ", ".join(str(p) for p in written)
    return text
