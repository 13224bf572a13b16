"""The leaner call path keeps every answer: the estimate's character count, header
scans once their tables of names are full, counters, settling each call once."""

from __future__ import annotations

import importlib
import json
import threading
from typing import Any

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import RateLimitedTransport, _wire
from ratequeue.httpx import _prepare as transport_mod
from ratequeue.httpx._estimate import _MAX_DEPTH, _SKIP, _chars
from ratequeue.httpx._record import json_object

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-x", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 9}


@pytest.fixture(params=["httpx", "httpx2"])
def mod(request: pytest.FixtureRequest) -> Any:
    return importlib.import_module(request.param)


def reference_chars(v: Any, depth: int = 0) -> int:
    """The documented count, one container per frame: strings at any depth, containers
    down to _MAX_DEPTH, skipping the keys in _SKIP and ``data:`` strings."""
    if isinstance(v, str):
        return 0 if v.startswith("data:") else len(v) + 1
    if depth > _MAX_DEPTH:
        return 0
    if isinstance(v, dict):
        return sum(
            reference_chars(x, depth + 1)
            for k, x in v.items()
            if k not in _SKIP and isinstance(x, (str, list, dict))
        )
    if isinstance(v, list):
        return sum(reference_chars(x, depth + 1) for x in v if isinstance(x, (str, list, dict)))
    return 0


KEYS = st.sampled_from(["model", "role", "content", "type", "text", "data", "name", "input"])
LEAVES = st.one_of(
    st.text(max_size=8), st.just("data:image"), st.integers(), st.none(), st.booleans()
)
TREES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(TREES)
def test_chars_counts_what_the_reference_counts(v: Any) -> None:
    assert _chars(v) == reference_chars(v)


@pytest.mark.parametrize("depth", range(_MAX_DEPTH - 4, _MAX_DEPTH + 5))
@pytest.mark.parametrize("shape", ["dicts", "lists", "both"])
def test_chars_stops_at_the_same_depth(depth: int, shape: str) -> None:
    v: Any = "leaf string"
    for i in range(depth):
        v = {"k": v} if shape == "dicts" or (shape == "both" and i % 2) else [v]
    for body in (v, {"messages": v}, [v, "x"]):
        assert _chars(body) == reference_chars(body)


def test_response_scan_when_its_table_of_names_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_wire, "_KNOWN", dict(_wire._KNOWN))
    # (The native scan classifies names by their bytes and keeps no table: the Python
    # scan, which the transport runs for headers that are not lists of byte triples,
    # is the one whose table fills.)
    for i in range(_wire._KNOWN_MAX):
        _wire.scan_response([(b"x", f"x-junk-{i}".encode(), b"1")], _wire._KNOWN)
    assert len(_wire._KNOWN) == _wire._KNOWN_MAX
    pairs = [
        (b"X-New", b"x-new", b"1"),
        (b"Content-Type", b"content-type", b"text/event-stream"),
        (b"X", b"x-ratelimit-remaining-images", b"0"),
    ]
    for known in (None, _wire._KNOWN):
        assert _wire.scan_response(pairs, known) == (b"text/event-stream", True)
        assert _wire.scan_response(pairs[:2], known) == (b"text/event-stream", False)
    assert len(_wire._KNOWN) == _wire._KNOWN_MAX


def test_request_headers_when_their_table_is_full(
    mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport_mod, "_READ", dict(transport_mod._READ))
    sent: list[Any] = []

    def answer(req: Any) -> Any:
        sent.append(req)
        return mod.Response(200, json={"usage": {"prompt_tokens": 1, "completion_tokens": 2}})

    lim = rq.Limiter(rq.Rate(10**6, per="minute", burst=10**6), clock=rq.ManualClock())
    c = mod.Client(transport=RateLimitedTransport(mod.MockTransport(answer), lim))
    for i in range(transport_mod._READ_MAX):
        c.post("http://p" + CHAT, json=BODY, headers={f"x-junk-{i}": "1"})
        # The Python reader (for header lists that are not httpx's triples) fills its
        # table; the native reader that httpx's lists take keeps none.
        transport_mod._read_request([(b"X", f"x-junk-{i}".encode(), b"1")])
    assert len(transport_mod._READ) == transport_mod._READ_MAX
    hl = [(b"X-New", b"x-new", b"1"), (b"Idempotency-Key", b"idempotency-key", b"k-0")]
    assert transport_mod._read_request(hl) == (None, None, None, "k-0", None)
    assert len(transport_mod._READ) == transport_mod._READ_MAX
    r = c.post(
        "http://p" + CHAT,
        json=BODY,
        headers={"x-novel": "1", "Idempotency-Key": "k-1", "X-RateQueue-Task": "t"},
    )
    rec = r.extensions["ratequeue"]
    assert (rec.request_id, rec.task) == ("k-1", "t")
    assert "x-ratequeue-task" not in sent[-1].headers


def test_stats_count_calls_sent_and_refused(mod: Any) -> None:
    lim = rq.Limiter(rq.Rate(2, per="minute", burst=2), clock=rq.ManualClock())
    answer = mod.MockTransport(lambda req: mod.Response(200, json={}))
    t = RateLimitedTransport(answer, lim, timeout=0)
    c = mod.Client(transport=t, base_url="http://p")
    c.post(CHAT, json=BODY)
    c.post(CHAT, json=BODY)
    with pytest.raises(rq.Overloaded):
        c.post(CHAT, json=BODY)
    s = t.stats()
    assert (s["calls"], s["sent"]) == (3, 2)


def test_each_call_settles_once_under_racing_closers(mod: Any) -> None:
    lim = rq.Limiter(
        rq.Rate(10**6, per="minute", burst=10**6),
        rq.Rate(10**6, per="minute", burst=10**6, unit="tokens"),
        clock=rq.ManualClock(),
    )

    class Permit:
        def __init__(self) -> None:
            self.settles: list[dict[str, int]] = []

        def settle(self, **kw: int) -> None:
            self.settles.append(kw)

    answer = mod.MockTransport(lambda req: mod.Response(200, json={}))
    t = RateLimitedTransport(answer, lim)
    c = mod.Client(transport=t, base_url="http://p")
    for _ in range(20):
        r = c.post(CHAT, json=BODY)
        call = r.extensions["ratequeue"]
        assert call._once == []  # settled when the body was read
        call._once.append(None)  # open again, with a permit that counts its settles
        call._done = False
        call._permit = permit = Permit()
        barrier = threading.Barrier(4)

        def settle(call: Any = call, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            t._settle(call, None, 200)

        threads = [threading.Thread(target=settle) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert permit.settles == [{"tokens": 0}]


def test_json_object_of_what_clients_send() -> None:
    data = json.dumps(BODY).encode()
    assert json_object(data) == BODY
    assert json_object(data + b" \r\n") == BODY
    assert json_object(data + b"\x0c") is None  # not JSON whitespace: json.loads refuses it
    assert json_object(b"{" * 100_000) is None
