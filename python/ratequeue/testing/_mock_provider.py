"""A mock LLM provider on the loopback interface: it enforces its own RPM (and TPM) limit.

Each request is admitted by the provider's own token buckets (``rpm`` per minute,
``burst`` at once; ``tpm`` tokens per minute when given) or answered ``429 Too Many
Requests`` with ``Retry-After`` (whole seconds, as HTTP has it) and ``retry-after-ms``
(``retry_style`` picks one, an HTTP date or none) and rate-limit headers, as the big
providers do. It speaks OpenAI chat completions and responses and Anthropic messages,
JSON or SSE streams (``"stream": true``) with usage in each dialect; the rate-limit
headers follow ``dialect``: OpenAI ``x-ratelimit-*``, Anthropic ``anthropic-ratelimit-*``
(the default on ``/v1/messages``), the IETF ``RateLimit``/``RateLimit-Policy`` fields, or
none. An admitted request "generates" for ``gen_time`` seconds (a sleep in its own
server thread). ``fail_next(n)`` answers the next ``n`` completions with 429 whatever the
buckets say. A response created with ``"background": true`` is answered ``queued``
without its usage; ``GET /v1/responses/{id}`` answers it ``in_progress`` the first time
and ``completed`` with its usage after, ``POST /v1/responses/{id}/cancel`` answers it
``cancelled`` with its usage (the last ``MAX_BACKGROUND`` are kept; any other id is a
404). ``GET /stats`` returns the counters. It binds to a loopback address only,
so it never serves the network.

From the command line: ``python -m ratequeue mock-provider --rpm 100 --port 8000
--gen-time 1.5``; in-process (tests, notebooks)::

    with MockProvider(rpm=120, gen_time=0.1) as mock:
        urllib.request.urlopen(mock.url, data=b"{}")
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import email.utils
import ipaddress
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from .._ratequeue import Limiter, Rate

__all__ = ["COMPLETION_PATHS", "MockProvider", "default_burst", "serve"]

PATH = "/v1/chat/completions"
#: The paths answered as a completion (POST only); ``GET /stats`` gives the counters and
#: anything else is a 404.
COMPLETION_PATHS = frozenset({PATH, "/v1/completions", "/v1/messages", "/v1/responses"})
#: Largest request body read (bytes); a larger one is answered 413.
MAX_BODY = 1 << 20
#: Background responses kept for their polls (the oldest forgotten first).
MAX_BACKGROUND = 10_000
_RESPONSE = "/v1/responses/"
DIALECTS = ("auto", "openai", "anthropic", "ietf", "none")
RETRY_STYLES = ("both", "seconds", "ms", "date", "none")


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
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm
    # and the client's delayed ACK add ~40 ms to every answer.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> bytes | None:
        """The request body, or None (and a 413 sent) when it is too large."""
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = 0
        if n > MAX_BODY:
            # Drained in small pieces (up to 16 bodies' worth) so that the client reads
            # the answer rather than a reset; never kept.
            left = n if n <= 16 * MAX_BODY else 0
            while left > 0:
                got = self.rfile.read(min(left, 1 << 16))
                if not got:
                    break
                left -= len(got)
            self.close_connection = True
            self._error(413, "request_too_large", f"bodies are limited to {MAX_BODY} bytes", {})
            return None
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
        elif route.startswith(_RESPONSE):
            self._background(route[len(_RESPONSE) :], False)
        elif route in COMPLETION_PATHS:
            self._error(405, "method_not_allowed", f"use POST on {route}", {"Allow": "POST"})
        else:
            self._error(404, "not_found", f"no such path {route!r}", {})

    def do_POST(self) -> None:
        body = self._body()
        if body is None:
            return
        route = self._route()
        if route in COMPLETION_PATHS:
            self._complete(route, body)
        elif route.startswith(_RESPONSE) and route.endswith("/cancel"):
            self._background(route[len(_RESPONSE) : -len("/cancel")], True)
        else:
            self._error(404, "not_found", f"no such path {route!r}", {})

    def _other(self) -> None:
        if self.headers.get("Content-Length"):
            self._body()
        self._error(
            405, "method_not_allowed", f"{self.command} is not served", {"Allow": "GET, POST"}
        )

    do_PUT = do_DELETE = do_PATCH = _other

    def _complete(self, route: str, raw: bytes) -> None:
        mock = self.server.mock
        try:
            req = json.loads(raw) if raw else {}
        except ValueError:
            req = {}
        if not isinstance(req, dict):
            req = {}
        retried = (self.headers.get("x-stainless-retry-count") or "0").strip() not in ("", "0")
        status, payload, headers, gen = mock._decide(route, req, retried)
        if gen > 0:
            time.sleep(gen)
        if status == 200 and req.get("stream") is True:
            self._stream(_events(route, req, payload), headers)
        elif status == 200 and route == "/v1/responses" and req.get("background") is True:
            mock.background(payload)
            queued = {**payload, "status": "queued", "output": [], "usage": None}
            self._send(status, queued, headers)
        else:
            self._send(status, payload, headers)

    def _background(self, rid: str, cancel: bool) -> None:
        """A poll or cancel of a background response."""
        body = self.server.mock._poll(rid, cancel)
        if body is None:
            self._error(404, "not_found", f"no response {rid!r}", {})
        else:
            self._send(200, body, {})

    def _stream(self, events: Iterator[bytes], headers: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        delay = self.server.mock.stream_delay
        for ev in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            self.wfile.flush()
            if delay > 0:
                time.sleep(delay)
        self.wfile.write(b"0\r\n\r\n")


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
        tpm: float | None = None,
        dialect: str = "auto",
        retry_style: str = "both",
        output_tokens: int = 2,
        stream_delay: float = 0.0,
    ) -> None:
        _check_loopback(host)
        if dialect not in DIALECTS:
            raise ValueError(f"dialect={dialect!r} must be one of {DIALECTS}")
        if retry_style not in RETRY_STYLES:
            raise ValueError(f"retry_style={retry_style!r} must be one of {RETRY_STYLES}")
        if tpm is not None and (
            isinstance(tpm, bool)
            or not isinstance(tpm, (int, float))
            or not (math.isfinite(tpm) and tpm > 0)
        ):
            raise ValueError(f"tpm={tpm!r} must be a finite number > 0 or None")
        if (
            isinstance(output_tokens, bool)
            or not isinstance(output_tokens, int)
            or output_tokens < 0
        ):
            raise ValueError(f"output_tokens={output_tokens!r} must be an int >= 0")
        if not (math.isfinite(stream_delay) and stream_delay >= 0):
            raise ValueError(f"stream_delay must be finite and >= 0, got {stream_delay!r}")
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
        self.tpm = None if tpm is None else float(tpm)
        self.dialect = dialect
        self.retry_style = retry_style
        self.output_tokens = output_tokens
        self.stream_delay = float(stream_delay)
        rates = [Rate(self.rpm, per="minute", burst=self.burst)]
        if self.tpm is not None:
            rates.append(Rate(self.tpm, per="minute", unit="tokens"))
        self.limiter = Limiter(*rates)
        self._lock = threading.Lock()
        self.requests = 0
        self.ok = 0
        self.rate_limited = 0
        self.retried = 0  # requests an SDK marked as retries (x-stainless-retry-count > 0)
        self.tokens = 0
        self._fail = 0
        self._fail_after = 0.0
        self.admitted_at: list[float] = []  # time.monotonic() of each admitted request
        # Background responses: id -> (the completed body, polled before).
        self._responses: dict[str, tuple[dict[str, Any], bool]] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- the decision -------------------------------------------------------------------

    def fail_next(self, n: int, *, retry_after: float = 0.05) -> None:
        """Answer the next ``n`` completions with 429 (``retry_after`` seconds), whatever
        the buckets say."""
        with self._lock:
            self._fail, self._fail_after = int(n), float(retry_after)

    def background(self, body: dict[str, Any]) -> None:
        """Keep a background response's completed ``body`` for its polls."""
        with self._lock:
            self._responses[body["id"]] = (body, False)
            while len(self._responses) > MAX_BACKGROUND:
                del self._responses[next(iter(self._responses))]

    def _poll(self, rid: str, cancel: bool) -> dict[str, Any] | None:
        """A background response as a poll (or a cancel) finds it, or None."""
        with self._lock:
            kept = self._responses.get(rid)
            if kept is None:
                return None
            body, polled = kept
            if cancel:
                return {**body, "status": "cancelled"}
            if not polled:
                self._responses[rid] = (body, True)
                return {**body, "status": "in_progress", "output": [], "usage": None}
            return body

    def _usage(self, req: dict[str, Any]) -> tuple[int, int]:
        chars = sum(len(t) for t in _strings(req.get("messages", req.get("input", ""))))
        chars += sum(len(t) for t in _strings(req.get("system", req.get("instructions", ""))))
        out = self.output_tokens
        for f in ("max_completion_tokens", "max_output_tokens", "max_tokens"):
            v = req.get(f)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out = min(out, v)
                break
        return max(1, -(-chars // 4)), out

    def _decide(
        self, route: str = PATH, req: dict[str, Any] | None = None, retried: bool = False
    ) -> tuple[int, dict[str, Any], dict[str, str], float]:
        req = {} if req is None else req
        now = time.monotonic()
        usage = self._usage(req)
        with self._lock:
            forced = self._fail > 0
            if forced:
                self._fail -= 1
        if forced:
            admitted = False
        elif self.tpm is not None:
            cap = self.limiter.rates[1].burst
            admitted = self.limiter.try_acquire(tokens=min(cap, sum(usage)))
        else:
            admitted = self.limiter.try_acquire()
        with self._lock:
            self.requests += 1
            self.retried += retried
            n = self.requests
            if admitted:
                self.ok += 1
                self.tokens += sum(usage)
                self.admitted_at.append(now)
            else:
                self.rate_limited += 1
        if admitted:
            retry = 0.0
        elif forced:
            retry = self._fail_after
        else:
            retry = self.limiter.retry_after(**({"tokens": 1} if self.tpm is not None else {}))
        headers = self._limit_headers(route, retry if not admitted else None)
        if not admitted:
            headers.update(self._retry_headers(retry))
            error: dict[str, Any] = {
                "type": "error",
                "error": {
                    "type": "rate_limit_exceeded"
                    if route != "/v1/messages"
                    else "rate_limit_error",
                    "message": f"Rate limit of {self.rpm:g} requests per minute reached; "
                    f"retry after {retry:.3f} s",
                },
            }
            return 429, error, headers, 0.0
        return 200, _reply(route, n, req, usage), headers, self.gen_time

    def _limit_headers(self, route: str, reset: float | None) -> dict[str, str]:
        dialect = self.dialect
        if dialect == "auto":
            dialect = "anthropic" if route == "/v1/messages" else "openai"
        remaining = max(0, int(self.limiter.available()))
        reset_s = (
            reset if reset is not None else max(0.0, (self.burst - remaining) * 60.0 / self.rpm)
        )
        dims = [("requests", self.rpm, remaining)]
        if self.tpm is not None:
            dims.append(("tokens", self.tpm, max(0, int(self.limiter.available("tokens")))))
        h: dict[str, str] = {}
        if dialect == "openai":
            for d, limit, left in dims:
                h[f"x-ratelimit-limit-{d}"] = f"{limit:g}"
                h[f"x-ratelimit-remaining-{d}"] = str(left)
                h[f"x-ratelimit-reset-{d}"] = f"{reset_s:.3f}s"
        elif dialect == "anthropic":
            at = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(seconds=reset_s)
            stamp = at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
            for d, limit, left in dims:
                h[f"anthropic-ratelimit-{d}-limit"] = f"{limit:g}"
                h[f"anthropic-ratelimit-{d}-remaining"] = str(left)
                h[f"anthropic-ratelimit-{d}-reset"] = stamp
        elif dialect == "ietf":
            h["RateLimit-Policy"] = f'"default";q={self.rpm:g};w=60'
            h["RateLimit"] = f'"default";r={remaining};t={math.ceil(reset_s)}'
        return h

    def _retry_headers(self, retry: float) -> dict[str, str]:
        style = self.retry_style
        h: dict[str, str] = {}
        if style in ("both", "seconds"):
            h["Retry-After"] = str(max(1, math.ceil(retry)))
        if style in ("both", "ms"):
            h["retry-after-ms"] = str(max(1, math.ceil(retry * 1000)))
        if style == "date":
            # Whole seconds, rounded up: never earlier than the bucket allows.
            at = math.ceil(time.time() + max(1.0, retry))
            h["Retry-After"] = email.utils.formatdate(at, usegmt=True)
        return h

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
                "retried": self.retried,
                "tokens": self.tokens,
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


def _strings(v: Any, depth: int = 0) -> Iterator[str]:
    if depth > 32:
        return
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for k, x in v.items():
            if k not in ("role", "type"):
                yield from _strings(x, depth + 1)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x, depth + 1)


def _reply(route: str, n: int, req: dict[str, Any], usage: tuple[int, int]) -> dict[str, Any]:
    """The JSON body of a completion in the dialect of ``route``."""
    model = req.get("model") if isinstance(req.get("model"), str) else "mock"
    i, o = usage
    if route == "/v1/messages":
        return {
            "id": f"msg_mock{n}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": i, "output_tokens": o},
        }
    if route == "/v1/responses":
        return {
            "id": f"resp_mock{n}",
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": f"msg_mock{n}",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                }
            ],
            "usage": {"input_tokens": i, "output_tokens": o, "total_tokens": i + o},
        }
    return {
        "id": f"mock-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o},
    }


def _sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def _events(route: str, req: dict[str, Any], body: dict[str, Any]) -> Iterator[bytes]:
    """The SSE events of a streamed completion, usage last, in the dialect of ``route``."""
    if route == "/v1/messages":
        u = body["usage"]
        start = {**body, "content": [], "stop_reason": None}
        start["usage"] = {"input_tokens": u["input_tokens"], "output_tokens": 1}
        yield _sse({"type": "message_start", "message": start}, "message_start")
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        yield _sse(block, "content_block_start")
        delta = {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "ok"},
        }
        yield _sse(delta, "content_block_delta")
        yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        done = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": u["output_tokens"]},
        }
        yield _sse(done, "message_delta")
        yield _sse({"type": "message_stop"}, "message_stop")
        return
    if route == "/v1/responses":
        created = {**body, "status": "in_progress", "output": [], "usage": None}
        yield _sse(
            {"type": "response.created", "sequence_number": 0, "response": created},
            "response.created",
        )
        text = {
            "type": "response.output_text.delta",
            "sequence_number": 1,
            "item_id": body["output"][0]["id"],
            "output_index": 0,
            "content_index": 0,
            "delta": "ok",
            "logprobs": [],
        }
        yield _sse(text, "response.output_text.delta")
        yield _sse(
            {"type": "response.completed", "sequence_number": 2, "response": body},
            "response.completed",
        )
        return
    chunk = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
    }
    yield _sse(
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}]}
    )
    yield _sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    so = req.get("stream_options")
    if isinstance(so, dict) and so.get("include_usage") is True:
        yield _sse({**chunk, "choices": [], "usage": body["usage"]})
    yield _sse("[DONE]")


def serve(
    *,
    rpm: float,
    port: int = 8000,
    gen_time: float = 1.0,
    burst: int | None = None,
    host: str = "127.0.0.1",
    duration: float | None = None,
    tpm: float | None = None,
    dialect: str = "auto",
    retry_style: str = "both",
) -> int:
    """Run a mock provider in the foreground until Ctrl-C (or ``duration`` seconds)."""
    mock = MockProvider(
        rpm,
        gen_time=gen_time,
        burst=burst,
        host=host,
        port=port,
        tpm=tpm,
        dialect=dialect,
        retry_style=retry_style,
    ).start()
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
