"""Shared by the background-response tests (``tests/httpx/test_httpx_background*.py``):
a scripted Responses API, the transport over it, and readers of its streams."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import threading
from typing import Any

import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport

MODS = ["httpx", "httpx2"]


BURST = 100_000


USED = {"input_tokens": 900, "output_tokens": 20_000}


STREAM = {"stream": True}


SPENT = 20_900


class Provider:
    """A Responses API: creations answer ``queued``; each response completes at its
    ``done``-th poll (or when cancelled), reporting ``usage``."""

    def __init__(self, done: int = 3, usage: dict[str, int] | None = None) -> None:
        self.done = done
        self.usage = usage or USED
        self.made = 0
        self.polls: dict[str, int] = {}
        self.streamed = False  # answer polls with a stream (not read yet)

    def __call__(self, request: Any) -> Any:
        mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
        path = request.url.path
        if path.endswith("/chat/completions"):
            return mod.Response(200, json={"usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        if request.method == "POST" and path.endswith("/responses"):
            self.made += 1
            rid = f"resp_{self.made}"
            self.polls[rid] = 0
            return mod.Response(200, json={"id": rid, "status": "queued", "usage": None})
        rid = path.split("/responses/", 1)[1].split("/")[0]
        n = self.polls.get(rid, 0) + 1
        self.polls[rid] = n
        if path.endswith("/cancel"):
            body = {"id": rid, "status": "cancelled", "usage": self.usage}
        elif n >= self.done:
            body = {"id": rid, "status": "completed", "usage": self.usage}
        else:
            body = {"id": rid, "status": "in_progress", "usage": None}
        if self.streamed:
            data = json.dumps(body).encode()
            headers = {"content-type": "application/json"}
            return mod.Response(200, headers=headers, stream=_Once(mod, data))
        return mod.Response(200, json=body)


def _Once(mod: Any, data: bytes, cut: bool = False) -> Any:
    """``data`` as one chunk; ``cut``: then the connection drops (a read error)."""

    class Once(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc]
        def __iter__(self) -> Any:
            yield data
            if cut:
                raise mod.ReadError("connection dropped")

        async def __aiter__(self) -> Any:
            yield data
            if cut:
                raise mod.ReadError("connection dropped")

    return Once()


def through(
    mod: Any, native: bool, provider: Any, **kw: Any
) -> tuple[RateLimitedTransport, Any, rq.Limiter]:
    lim = rq.Limiter(
        rq.Rate(1000, per="second", burst=1000),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    t = RateLimitedTransport(mod.MockTransport(provider), lim, timeout=0.0, **kw)
    if not native:
        t._reader = None
        t._native_settle = False
        t._native_stream = False
    return t, mod.Client(transport=t), lim


_BODY = {"model": "m", "input": "x" * 400, "background": True}


def create(client: Any, **extra: Any) -> Any:
    return client.post("http://p/v1/responses", json=_BODY | extra)


def estimate_of(record: Any) -> int:
    return int(record.estimate.input_tokens + record.estimate.output_tokens)


def poll_until_done(client: Any, rid: str) -> list[Any]:
    records = []
    while True:
        r = client.get(f"http://p/v1/responses/{rid}")
        records.append(r.extensions["ratequeue"])
        if r.json()["status"] == "completed":
            return records


class Ledger:
    """Records each request's hold and its one settle (a second settle fails)."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[int, int]] = {}
        self.settled: dict[str, tuple[int, int]] = {}

    def hold(self, request_id: str, account: str, **kw: Any) -> None:
        self.held[request_id] = (kw["input_tokens"], kw["output_tokens"])

    def settle(self, request_id: str, **kw: Any) -> None:
        assert request_id in self.held and request_id not in self.settled
        self.settled[request_id] = (kw["input_tokens"], kw["output_tokens"])

    def release(self, request_id: str) -> None:
        assert request_id in self.held and request_id not in self.settled
        self.settled[request_id] = (0, 0)


def through_policy(mod: Any, provider: Any, slots: int = 1, **kw: Any) -> tuple[Any, rq.Limiter]:
    """A client over a Policy of ``slots`` concurrency slots and ``through``'s limiter."""
    lim = rq.Limiter(
        rq.Rate(100, per="second", burst=100),
        rq.Rate(BURST, per="minute", burst=BURST, unit="tokens"),
        clock=rq.ManualClock(),
    )
    policy = rq.Policy({"conc": rq.Concurrency(slots), "cluster": lim})
    t = RateLimitedTransport(
        mod.MockTransport(provider),
        policy,
        upstream=lim,
        units=["requests", "tokens"],
        timeout=0.0,
        **kw,
    )
    return mod.Client(transport=t), lim


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _started(rid: str, kind: str = "response.created", background: bool = True) -> dict[str, Any]:
    response = {"id": rid, "status": "queued", "background": background, "usage": None}
    return {"type": kind, "response": response}


class Streamed:
    """``stream=True, background=True``: the creation's stream names the response, then
    the connection drops before its usage; a resumed stream (``GET …?stream=true``) ends
    with it (or drops again: ``resumed_cut``); ``ends``: the creation's stream ends
    there, without a usage (done: a completed event too long to read, say)."""

    def __init__(
        self,
        background: bool = True,
        resumed_cut: bool = False,
        ends: bool = False,
        failed: bool = False,
    ) -> None:
        self.background = background
        self.resumed_cut = resumed_cut
        self.ends = ends
        self.failed = failed  # the resumed stream ends with response.failed, no usage

    def __call__(self, request: Any) -> Any:
        mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
        headers = {"content-type": "text/event-stream"}
        if request.method == "POST":
            body = _sse(_started("resp_7", background=self.background))
            return mod.Response(200, headers=headers, stream=_Once(mod, body, not self.ends))
        done = {"id": "resp_7", "status": "completed", "background": True, "usage": USED}
        events = [_started("resp_7", "response.in_progress")]
        if self.failed:
            failed = {**done, "status": "failed", "usage": None}
            events.append({"type": "response.failed", "response": failed})
        elif not self.resumed_cut:
            events.append({"type": "response.completed", "response": done})
        return mod.Response(
            200, headers=headers, stream=_Once(mod, _sse(*events), self.resumed_cut)
        )


def _stream(mod: Any, client: Any, method: str, url: str, **kw: Any) -> Any:
    """The record of a streamed call read to its end, or to its connection's drop."""
    with client.stream(method, url, **kw) as r, contextlib.suppress(mod.ReadError):
        r.read()
    return r.extensions["ratequeue"]


class Chunks:
    """A creation streamed in ``events`` chunks (one event each); a poll answers the
    response ``completed`` with its usage (JSON)."""

    def __init__(self, *events: dict[str, Any], cut: bool = False) -> None:
        self.events = events
        self.cut = cut
        self.running = False  # polls answer in_progress, without a usage
        self.before_first: Any = None  # run before the stream's first chunk

    def __call__(self, request: Any) -> Any:
        mod = importlib.import_module(type(request).__module__.split(".", 1)[0])
        if request.method == "POST" and b'"stream"' not in request.content:
            return mod.Response(200, json={"id": "resp_7", "status": "queued", "usage": None})
        if request.method == "POST":
            chunks = [_sse(e) for e in self.events]
            cut, first = self.cut, self.before_first

            class Stream(mod.SyncByteStream, mod.AsyncByteStream):  # type: ignore[misc]
                def __iter__(self) -> Any:
                    if first is not None:
                        first()
                    yield from chunks
                    if cut:
                        raise mod.ReadError("connection dropped")

                async def __aiter__(self) -> Any:
                    for c in chunks:
                        yield c
                    if cut:
                        raise mod.ReadError("connection dropped")

            headers = {"content-type": "text/event-stream"}
            return mod.Response(200, headers=headers, stream=Stream())
        if self.running:
            return mod.Response(200, json={"id": "resp_7", "status": "in_progress"})
        done = {"id": "resp_7", "status": "completed", "background": True, "usage": USED}
        return mod.Response(200, json=done)


_COMPLETED = {
    "type": "response.completed",
    "response": {"id": "resp_7", "status": "completed", "background": True, "usage": USED},
}


def _open(client: Any, body: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """A creation streamed, read up to its first event (it names the response): the
    response, its chunks left and its record."""
    req = client.build_request("POST", "http://p/v1/responses", json=body or _BODY | STREAM)
    r = client.send(req, stream=True)
    chunks = r.iter_raw()
    next(chunks)
    return r, chunks, r.extensions["ratequeue"]


def _drain(mod: Any, r: Any, chunks: Any) -> None:
    with contextlib.suppress(mod.ReadError):
        for _ in chunks:
            pass
    r.close()


def close_in_a_collection(transport: Any) -> None:
    """``transport`` closed by the garbage collector, as an SDK client's ``__del__`` does
    (the client in a reference cycle, then a collection)."""

    class SDKClient:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            transport.close()

    SDKClient()
    gc.collect()


def hanging(ledger_type: type[Any], entered: threading.Event, release: threading.Event) -> Any:
    """A ``ledger_type`` whose settle never answers until ``release`` (``entered`` set
    first): a dead connection without a timeout."""

    class Hanging(ledger_type):  # type: ignore[misc,valid-type]
        def settle(self, request_id: str, **kw: Any) -> None:
            entered.set()
            release.wait(30)
            super().settle(request_id, **kw)

    return Hanging()
