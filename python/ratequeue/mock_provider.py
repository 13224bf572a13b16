"""A mock LLM provider on the loopback interface: it enforces its own RPM limit.

Each request is admitted by the provider's own token bucket (``rpm`` per minute,
``burst`` at once) or answered ``429 Too Many Requests`` with ``Retry-After`` (whole
seconds, as HTTP has it), ``retry-after-ms`` and ``x-ratelimit-*`` headers, as the big
providers do. An admitted request "generates" for ``gen_time`` seconds (a sleep in its
own server thread) and gets a JSON body with ``usage``. ``GET /stats`` returns the
counters. It binds to a loopback address only, so it never serves the network.

From the command line: ``python -m ratequeue mock-provider --rpm 100 --port 8000
--gen-time 1.5``; in-process (tests, notebooks)::

    with MockProvider(rpm=120, gen_time=0.1) as mock:
        urllib.request.urlopen(mock.url, data=b"{}")
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from ._ratequeue import Limiter, Rate

__all__ = ["COMPLETION_PATHS", "MockProvider", "default_burst", "serve"]

PATH = "/v1/chat/completions"
#: The paths answered as a completion (POST only); ``GET /stats`` gives the counters and
#: anything else is a 404.
COMPLETION_PATHS = frozenset({PATH, "/v1/completions", "/v1/messages"})


def default_burst(rpm: float) -> int:
    """One second's worth of ``rpm`` (at least 1): the mock's bucket unless told."""
    return max(1, int(rpm // 60))


def _check_loopback(host: str) -> None:
    if host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"the mock provider binds to a loopback address only, got {host!r}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    mock: MockProvider


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _error(self, status: int, kind: str, message: str, headers: dict[str, str]) -> None:
        self._send(status, {"error": {"type": kind, "message": message}}, headers)

    def do_GET(self) -> None:
        route = self._route()
        if route == "/stats":
            self._send(200, self.server.mock.stats(), {})
        elif route in COMPLETION_PATHS:
            self._error(405, "method_not_allowed", f"use POST on {route}", {"Allow": "POST"})
        else:
            self._error(404, "not_found", f"no such path {route!r}", {})

    def do_POST(self) -> None:
        self._body()
        route = self._route()
        if route in COMPLETION_PATHS:
            self._complete()
        else:
            self._error(404, "not_found", f"no such path {route!r}", {})

    def _other(self) -> None:
        if self.headers.get("Content-Length"):
            self._body()
        self._error(
            405, "method_not_allowed", f"{self.command} is not served", {"Allow": "GET, POST"}
        )

    do_PUT = do_DELETE = do_PATCH = _other

    def _complete(self) -> None:
        mock = self.server.mock
        status, payload, headers, gen = mock._decide()
        if gen > 0:
            time.sleep(gen)
        self._send(status, payload, headers)


class MockProvider:
    """A local HTTP provider with an RPM limit and a generation time.

    ``port=0`` picks a free port (see :attr:`port` / :attr:`url` after :meth:`start`).
    ``burst`` defaults to one second's worth of the rate (at least 1).
    """

    def __init__(
        self,
        rpm: float,
        *,
        gen_time: float = 1.0,
        burst: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        _check_loopback(host)
        if isinstance(rpm, bool) or not isinstance(rpm, (int, float)):
            raise TypeError(f"rpm={rpm!r} must be a number of requests per minute")
        if not (math.isfinite(rpm) and rpm > 0):
            raise ValueError(f"rpm={rpm!r} must be a finite number > 0")
        if burst is not None and (
            isinstance(burst, bool) or not isinstance(burst, int) or burst < 1
        ):
            raise ValueError(f"burst={burst!r} must be an integer >= 1 or None")
        if not (math.isfinite(gen_time) and gen_time >= 0):
            raise ValueError(f"gen_time must be finite and >= 0, got {gen_time!r}")
        self.rpm = float(rpm)
        self.burst = default_burst(rpm) if burst is None else int(burst)
        self.gen_time = float(gen_time)
        self.host = host
        self._port = int(port)
        self.limiter = Limiter(Rate(self.rpm, per="minute", burst=self.burst))
        self._lock = threading.Lock()
        self.requests = 0
        self.ok = 0
        self.rate_limited = 0
        self.admitted_at: list[float] = []  # time.monotonic() of each admitted request
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- the decision -------------------------------------------------------------------

    def _decide(self) -> tuple[int, dict[str, Any], dict[str, str], float]:
        now = time.monotonic()
        admitted = self.limiter.try_acquire()
        with self._lock:
            self.requests += 1
            n = self.requests
            if admitted:
                self.ok += 1
                self.admitted_at.append(now)
            else:
                self.rate_limited += 1
        limits = {
            "x-ratelimit-limit-requests": f"{self.rpm:g}",
            "x-ratelimit-remaining-requests": str(int(self.limiter.available())),
        }
        if not admitted:
            retry = self.limiter.retry_after()
            limits["x-ratelimit-reset-requests"] = f"{retry:.3f}s"
            headers = {
                "Retry-After": str(max(1, math.ceil(retry))),
                "retry-after-ms": str(max(1, math.ceil(retry * 1000))),
                **limits,
            }
            error: dict[str, Any] = {
                "error": {
                    "type": "rate_limit_exceeded",
                    "message": f"Rate limit of {self.rpm:g} requests per minute reached; "
                    f"retry after {retry:.3f} s",
                }
            }
            return 429, error, headers, 0.0
        body: dict[str, Any] = {
            "id": f"mock-{n}",
            "object": "chat.completion",
            "model": "mock",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10},
        }
        return 200, body, limits, self.gen_time

    # -- running ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._server is not None:
            return int(self._server.server_address[1])
        return self._port

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The completions endpoint."""
        return self.base_url + PATH

    def start(self) -> MockProvider:
        if self._server is not None:
            return self
        server_cls = _Server
        if ":" in self.host:

            class _Server6(_Server):
                address_family = socket.AF_INET6

            server_cls = _Server6
        server = server_cls((self.host, self._port), _Handler)
        server.mock = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name="ratequeue-mock-provider",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rpm": self.rpm,
                "burst": self.burst,
                "gen_time": self.gen_time,
                "requests": self.requests,
                "ok": self.ok,
                "rate_limited": self.rate_limited,
            }

    def __enter__(self) -> MockProvider:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve(
    *,
    rpm: float,
    port: int = 8000,
    gen_time: float = 1.0,
    burst: int | None = None,
    host: str = "127.0.0.1",
    duration: float | None = None,
) -> int:
    """Run a mock provider in the foreground until Ctrl-C (or ``duration`` seconds)."""
    mock = MockProvider(rpm, gen_time=gen_time, burst=burst, host=host, port=port).start()
    print(
        f"mock provider on {mock.url} ({rpm:g} requests/minute, burst {mock.burst}, "
        f"generation {gen_time:g} s); Ctrl-C to stop",
        flush=True,
    )
    deadline = math.inf if duration is None else time.monotonic() + duration
    with contextlib.suppress(KeyboardInterrupt):
        while time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    mock.stop()
    print(json.dumps(mock.stats()), flush=True)
    return 0
