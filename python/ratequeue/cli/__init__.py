"""The tools around the library: ``python -m ratequeue`` and what its subcommands run.

- :mod:`ratequeue.cli.main`: the command line (``demo``, ``lab``, ``loadtest``,
  ``mock-provider``, ``quota``); ``main(argv)`` returns the exit status.
- :mod:`ratequeue.cli.demo`: the first burst demo and the lab's default scenario.
- :mod:`ratequeue.cli.loadtest`: real-time open-loop load against an HTTP endpoint.
"""

__all__: list[str] = []
