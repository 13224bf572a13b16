"""Command line of ratequeue.

``python -m ratequeue demo``            the lab's default scenario: tables, plot, JSON, CSV
``python -m ratequeue demo --burst-only`` the first demo: one burst, unbounded vs bounded
``python -m ratequeue lab ...``           a scenario of your own, in virtual time
``python -m ratequeue lab --scenario launch`` launch day: a 3x surge, adaptive limits
``python -m ratequeue lab --scenario canary`` a verbose model caught by a canary rollout
``python -m ratequeue loadtest CONFIG``   real-time open-loop load against an HTTP endpoint
``python -m ratequeue mock-provider ...`` a local provider that enforces an RPM limit (429)
``python -m ratequeue quota ...``         the quota ledger: show, usage, export, compensate
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import demo as _demo


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None


def _number(kind: type[int] | type[float], low: float, *, strict: bool = True) -> Any:
    """An argparse type: a finite number > ``low`` (>= with ``strict=False``)."""

    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not math.isfinite(v) or v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low:g}, got {text}"
            )
        return v

    parse.__name__ = kind.__name__
    return parse


#: argparse types: a finite number > 0 (``_INT``, ``_FLOAT``) or >= 0 (``_INT0``, ``_FLOAT0``).
_INT, _FLOAT = _number(int, 0), _number(float, 0)
_INT0, _FLOAT0 = _number(int, 0, strict=False), _number(float, 0, strict=False)


def _options(p: argparse.ArgumentParser, *rows: tuple[str, Any, Any, str | None]) -> None:
    """Adds an option per ``(flag, type or None for text, default, help)``."""
    for flag, kind, default, text in rows:
        p.add_argument(flag, type=kind, default=default, help=text)


def _positive_floats(text: str) -> tuple[float, ...]:
    values = _floats(text)
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers > 0 separated by commas, got {text!r}")
    return values


def _port(text: str) -> int:
    v = _number(int, 0, strict=False)(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text}")
    return int(v)


_FORMATS = ("json", "csv", "png")


def _formats(text: str) -> tuple[str, ...]:
    chosen = tuple(f.strip().lower() for f in text.split(",") if f.strip())
    bad = [f for f in chosen if f not in _FORMATS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown format(s) {bad} (any of {', '.join(_FORMATS)})")
    return chosen


def _progress(args: argparse.Namespace) -> bool | None:
    flag: bool | None = args.progress
    return flag


def _add_progress(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false")


def _run_demo(args: argparse.Namespace) -> int:
    # The first demo, then (unless --burst-only) the lab's scenario on the same provider.
    print(_demo.run(args.requests, args.rpm, args.burst, args.max_wait))
    if args.burst_only:
        return 0
    print()
    print(
        _demo.lab_demo(
            rpm=args.rpm,
            burst_capacity=args.burst,
            burst_requests=args.requests,
            max_wait=args.max_wait,
            per_level=args.per_level,
            rhos=args.rho,
            seed=args.seed,
            out=None if args.no_files else args.out,
            plot=not args.no_plot,
            progress=_progress(args),
        )
    )
    return 0


def _run_lab(args: argparse.Namespace) -> int:
    from .. import lab

    if args.scenario == "launch":
        print(lab.launch.main(out=args.out, formats=args.formats, seed=args.seed))
        return 0
    if args.scenario == "canary":
        print(lab.canary.main(out=args.out, formats=args.formats, seed=args.seed))
        return 0

    strategies: list[lab.Strategy] = []
    for key in args.strategies.split(","):
        key = key.strip()
        if key == "naive":
            strategies.append(
                lab.NaiveRetry(
                    base=args.backoff_base, cap=args.backoff_cap, max_attempts=args.max_attempts
                )
            )
        elif key == "queue":
            strategies.append(lab.Queue())
        elif key == "bounded":
            strategies.append(lab.Queue(max_wait=args.max_wait, key="bounded"))
        elif key == "priority":
            strategies.append(lab.Priority())
        elif key == "pool":
            strategies.append(lab.PoolStrategy(k=args.pool, max_wait=args.max_wait))
        elif key:
            raise ValueError(f"unknown strategy {key!r} (naive, queue, bounded, priority, pool)")
    scenario = lab.Scenario(
        name=args.name,
        limit=lab.ProviderLimit(args.rpm, args.burst),
        rhos=args.rho,
        requests=args.requests,
        arrivals=lab.parse_arrivals(args.arrivals),
        service=lab.parse_service(args.service),
        interactive_share=args.interactive_share,
        strategies=tuple(strategies),
        burst=args.burst_requests,
        warmup=args.warmup,
        seed=args.seed,
    )
    report = lab.run_scenario(scenario, progress=_progress(args))
    print(lab.format_report(report))
    out = Path(args.out)
    written = []
    if "json" in args.formats:
        written.append(lab.write_json(report, out / f"{args.name}.json"))
    if "csv" in args.formats:
        written.append(lab.write_csv(report, out / f"{args.name}.csv"))
    if "png" in args.formats:
        written.append(lab.plot(report, out / f"{args.name}.png"))
    if written:
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _run_loadtest(args: argparse.Namespace) -> int:
    from . import loadtest

    return loadtest.main(args.config, out=args.out, quiet=args.quiet)


_MOCK_DIALECTS = ("auto", "openai", "anthropic", "ietf", "none")


def _run_mock(args: argparse.Namespace) -> int:
    from ..testing import _mock_provider as mock_provider

    return mock_provider.serve(
        rpm=args.rpm,
        port=args.port,
        gen_time=args.gen_time,
        burst=args.burst,
        host=args.host,
        duration=args.duration,
        tpm=args.tpm,
        dialect=args.dialect,
        retry_style=args.retry_style,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ratequeue", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the lab's default scenario (or --burst-only)")
    d.add_argument("--burst-only", action="store_true", help="only the first burst demo")
    _options(
        d,
        ("--requests", _INT, 500, "size of the burst (500)"),
        ("--rpm", _FLOAT, 100.0, "requests per minute (100)"),
        ("--burst", _INT, 5, "bucket capacity (5)"),
        ("--max-wait", _FLOAT0, 5.0, "bound on the wait, seconds (5)"),
        ("--per-level", _INT, 30_000, "arrivals per load level"),
        ("--rho", _positive_floats, None, "load levels, e.g. 0.5,0.9,0.98"),
        ("--seed", int, 1, None),
        ("--out", None, "lab-out", "folder for demo.png/json/csv (lab-out)"),
    )
    d.add_argument("--no-plot", action="store_true", help="skip the PNG")
    d.add_argument("--no-files", action="store_true", help="write nothing, print only")
    _add_progress(d)
    d.set_defaults(func=_run_demo)

    lb = sub.add_parser("lab", help="run a scenario of your own in virtual time")
    lb.add_argument("--name", default="lab", help="scenario name, used for file names")
    lb.add_argument(
        "--scenario",
        choices=("levels", "launch", "canary"),
        default="levels",
        help="levels: load levels from these options; launch: the launch-day surge "
        "against a virtual inference cluster, adaptive strategies side by side; canary: a "
        "verbose candidate model rolled back by the canary's KPI gates",
    )
    _options(
        lb,
        ("--rpm", _FLOAT, 100.0, "provider limit, requests/minute"),
        ("--burst", _INT, 1, "provider bucket capacity"),
        ("--rho", _positive_floats, (0.5, 0.7, 0.8, 0.9, 0.95, 0.98), None),
        ("--requests", _INT, 20_000, "arrivals per load level"),
        (
            "--arrivals",
            None,
            "poisson",
            "poisson | constant | batches:SIZE | onoff:ON:OFF | replay:FILE",
        ),
        (
            "--service",
            None,
            "lognormal:2:0.5",
            "constant:S | exponential:MEAN | lognormal:MEAN:SIGMA",
        ),
        ("--strategies", None, "naive,queue,bounded,priority,pool", None),
        ("--max-wait", _FLOAT0, 5.0, None),
        ("--pool", _INT, 2, "providers in the pool"),
        ("--interactive-share", _FLOAT0, 0.2, None),
        ("--backoff-base", _FLOAT, 1.0, None),
        ("--backoff-cap", _FLOAT, 60.0, None),
        ("--max-attempts", _INT, None, None),
        ("--burst-requests", _INT0, 0, "also run a burst of N"),
        ("--warmup", _FLOAT0, 0.05, "share of each level unmeasured"),
        ("--seed", int, 1, None),
        ("--out", None, "lab-out", None),
        ("--formats", _formats, _FORMATS, "any of json,csv,png"),
    )
    _add_progress(lb)
    lb.set_defaults(func=_run_lab)

    lt = sub.add_parser("loadtest", help="real-time open-loop load from a JSON config")
    lt.add_argument("config", help="path of the JSON config (see docs/lab.md)")
    lt.add_argument("--out", default=None, help="write the results as JSON here")
    lt.add_argument("--quiet", action="store_true", help="no progress lines")
    lt.set_defaults(func=_run_loadtest)

    mp = sub.add_parser("mock-provider", help="a local HTTP provider enforcing an RPM limit")
    mp.add_argument("--rpm", type=_FLOAT, required=True, help="its limit, requests per minute")
    _options(
        mp,
        ("--port", _port, 8000, "port on 127.0.0.1 (0: any free)"),
        ("--gen-time", _FLOAT0, 1.0, "generation time, seconds"),
        ("--burst", _INT, None, "bucket capacity (rpm/60, >= 1)"),
        ("--host", None, "127.0.0.1", "loopback address to bind"),
        ("--duration", _FLOAT, None, "stop after this many seconds"),
        ("--tpm", _FLOAT, None, "its token limit, tokens per minute"),
    )
    mp.add_argument(
        "--dialect",
        choices=_MOCK_DIALECTS,
        default="auto",
        help="rate-limit headers: auto (Anthropic on /v1/messages, OpenAI elsewhere), ...",
    )
    mp.add_argument(
        "--retry-style",
        choices=("both", "seconds", "ms", "date", "none"),
        default="both",
        help="how a 429 says when to retry: Retry-After and/or retry-after-ms, a date, none",
    )
    mp.set_defaults(func=_run_mock)

    from ..ledger.cli import add_quota_parser

    add_quota_parser(sub)

    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, OSError) as e:
        # Bad input found past argparse (an arrival spec, a config file, a port in use):
        # a usage error, not a traceback.
        sub.choices[args.command].error(str(e))
    return code


if __name__ == "__main__":
    sys.exit(main())
