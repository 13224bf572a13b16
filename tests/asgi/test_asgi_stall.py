"""The middleware's outcome of a request admitted at once when the host stalls meanwhile.

On a loaded machine ``test_prometheus_endpoint_exports_levels_and_outcomes`` counted a
request admitted at once as "queued": the middleware told the two apart by the wall time
its acquire took (over 0.5 ms = queued), and a preempted process takes longer than that
without ever waiting in a queue (fixed in 230ad90). Here the stall is simulated: the
middleware's timer moves 10 ms on every reading.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import ratequeue as rq
from asgi_helpers import call
from ratequeue.asgi import RateLimitMiddleware, client_ip


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_request_admitted_at_once_counts_as_admitted_however_long_the_host_stalls(
    clock: rq.ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    stalled = itertools.count(0.0, 0.010)
    monkeypatch.setattr(
        "ratequeue.asgi._middleware.time", SimpleNamespace(perf_counter=lambda: next(stalled))
    )
    users = rq.KeyedLimiter(rq.Rate(2, per="second", burst=2), clock=clock)
    mw = RateLimitMiddleware(ok_app, levels={"user": users}, keys={"user": client_ip()})
    assert asyncio.run(call(mw)).status == 200
    assert mw.stats()["/**"]["queued"] == 0
    assert mw.stats()["/**"]["admitted"] == 1
    assert mw.wait_histogram.count == 1
    assert mw.wait_histogram.max == 0.0  # admitted at once: no queue wait, however slow
