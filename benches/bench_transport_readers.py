"""The transport's body and header readers alone, native against the Python reference,
in one process (best of 5 repeats of ``--calls`` calls, µs per call of wall time)::

    .venv/bin/python benches/bench_transport_readers.py [--calls 20000]

The bodies and headers are those of ``bench_transport.py`` (a 388-byte chat request, a
197-byte chat completion, 8 response headers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_transport as bt
import httpx2
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx._record import json_object, json_usage, json_usage_py
from ratequeue.httpx._wire import _KNOWN, header_list, scan_response


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    n = ap.parse_args().calls
    t = RateLimitedTransport(httpx2.MockTransport(bt.answer), bt.roomy())
    t.estimator.load(60)  # type: ignore[attr-defined]
    path = "/v1/chat/completions"
    data = json.dumps(bt.BODY).encode()
    answer = json.dumps(bt.ANSWER).encode()
    headers = header_list(bt.answer(httpx2.Request("POST", "http://x" + path)).headers)
    assert t._read_body(data, path) is not False, "the native request read is not in use"
    rows = [
        (
            "request: model + estimate",
            lambda: t._read_body(data, path),
            lambda: t.estimator(json_object(data), path),
        ),
        ("response: usage", lambda: json_usage(answer), lambda: json_usage_py(answer)),
        (
            "response: header scan",
            lambda: scan_response(headers),
            lambda: scan_response(headers, _KNOWN),
        ),
    ]
    print(f"load {os.getloadavg()[0]:.2f}, {n} calls, best of 5\n")
    print("| step | native µs | Python reference µs | saved µs |")
    print("|---|---:|---:|---:|")
    total = 0.0
    for name, native, ref in rows:
        a, b = (min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6 for f in (native, ref))
        total += b - a
        print(f"| {name} | {a:.2f} | {b:.2f} | {b - a:.2f} |")
    print(f"| all three | | | {total:.2f} |")


if __name__ == "__main__":
    main()
