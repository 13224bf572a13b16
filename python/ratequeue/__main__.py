"""``python -m ratequeue``: the command line, :func:`ratequeue.cli.main.main`."""

import sys

from .cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
