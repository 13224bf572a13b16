"""The demos.

``python -m ratequeue demo`` prints the first demo's table (below), then runs the lab's
default scenario (:func:`lab_demo`): a provider of 100 requests/minute (burst 5),
Poisson load from rho = 0.5 to 0.98 and a burst of 500 requests, with the strategies
side by side (naive retry on 429, an unbounded queue, a bounded wait, priority classes,
a pool of two providers), all in virtual time; it prints a table per load level with
M/M/1 and M/D/1 beside the measurements, and writes the plot, JSON and CSV to
``lab-out/``.

``python -m ratequeue demo --burst-only`` is the first demo (:func:`run`): 500 requests
at once against 100 requests/minute, on a manual clock. Unbounded, the last request
waits about five minutes; with ``max_wait=5`` nothing waits longer than five seconds and
the rest is refused at once, with its ``retry_after``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .._errors import Overloaded
from .._ratequeue import Limiter, ManualClock, Rate

__all__ = ["BurstResult", "burst", "lab_demo", "run"]


@dataclass(frozen=True)
class BurstResult:
    """Waits (seconds) of the admitted requests and the number refused."""

    waits: list[float]
    refused: int

    def percentile(self, q: float) -> float:
        """The q-th percentile (nearest rank) of the waits; 0.0 when none."""
        if not self.waits:
            return 0.0
        ordered = sorted(self.waits)
        rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
        return ordered[rank - 1]


def burst(requests: int, rpm: float, burst: int, max_wait: float | None) -> BurstResult:
    """Reserve ``requests`` at the same instant; collect waits and refusals."""
    limiter = Limiter(Rate(rpm, per="minute", burst=burst), clock=ManualClock())
    waits: list[float] = []
    refused = 0
    for _ in range(requests):
        try:
            waits.append(limiter.reserve(max_wait=max_wait).delay)
        except Overloaded:
            refused += 1
    return BurstResult(waits, refused)


def run(requests: int = 500, rpm: float = 100.0, burst_size: int = 5, max_wait: float = 5.0) -> str:
    """The demo's table as text."""
    head = f"{requests} requests at once against {rpm:g} requests/minute (burst {burst_size})"
    lines = [
        head,
        "",
        f"{'policy':<22}{'admitted':>9}{'refused':>9}"
        f"{'p50 s':>9}{'p95 s':>9}{'p99 s':>9}{'max s':>9}",
    ]
    for label, bound in (("unbounded queue", None), (f"max_wait={max_wait:g} s", max_wait)):
        r = burst(requests, rpm, burst_size, bound)
        lines.append(
            f"{label:<22}{len(r.waits):>9}{r.refused:>9}"
            + "".join(f"{r.percentile(q):>9.2f}" for q in (50, 95, 99))
            + f"{max(r.waits, default=0.0):>9.2f}"
        )
    lines += [
        "",
        "Unbounded, the queue hides a wait of minutes inside the call; bounded, every",
        "admitted request waits at most max_wait and the rest is refused at once",
        "(ratequeue.Overloaded, with retry_after) instead of timing out later.",
    ]
    return "\n".join(lines)


def lab_demo(
    *,
    rpm: float = 100.0,
    burst_capacity: int = 5,
    burst_requests: int = 500,
    max_wait: float = 5.0,
    per_level: int = 30_000,
    rhos: tuple[float, ...] | None = None,
    seed: int = 1,
    out: str | Path | None = "lab-out",
    plot: bool = True,
    progress: bool | None = None,
) -> str:
    """Run the lab's default scenario; return the text to print (tables and files)."""
    from .. import lab

    scenario = lab.Scenario(
        name="demo",
        limit=lab.ProviderLimit(rpm, burst_capacity),
        rhos=lab.DEFAULT_RHOS if rhos is None else rhos,
        requests=per_level,
        strategies=lab.default_strategies(max_wait=max_wait),
        burst=burst_requests,
        seed=seed,
    )
    report = lab.run_scenario(scenario, progress=progress)
    lines = [
        f"ratequeue lab: a provider of {rpm:g} requests/minute (burst {burst_capacity}), "
        f"open-loop Poisson load, {per_level:,} arrivals per level; the same arrivals "
        "for every strategy, run in virtual time through the real limiter, queue and pool.",
        "",
        lab.format_report(report),
    ]
    if out is not None:
        folder = Path(out)
        written = [
            lab.write_json(report, folder / "demo.json"),
            lab.write_csv(report, folder / "demo.csv"),
        ]
        if plot and importlib.util.find_spec("matplotlib") is not None:
            written.append(lab.plot(report, folder / "demo.png"))
        elif plot:
            lines.append('(no plot: install matplotlib, e.g. pip install "ratequeue[lab]")')
        lines.append("wrote " + ", ".join(str(p) for p in written))
    return "\n".join(lines)
