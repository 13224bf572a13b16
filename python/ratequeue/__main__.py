"""Command line: ``python -m ratequeue demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import demo as _demo


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ratequeue", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="a burst against a rate limit, unbounded and bounded")
    d.add_argument("--requests", type=int, default=500, help="size of the burst")
    d.add_argument("--rpm", type=float, default=100.0, help="requests per minute")
    d.add_argument("--burst", type=int, default=5, help="bucket capacity")
    d.add_argument("--max-wait", type=float, default=5.0, help="bound on the wait, seconds")
    args = parser.parse_args(argv)
    if args.command == "demo":
        print(_demo.run(args.requests, args.rpm, args.burst, args.max_wait))
    return 0


if __name__ == "__main__":
    sys.exit(main())
