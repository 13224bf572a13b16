"""The native body readers (``ratequeue_core::llm``) against the Python reference: the
usage of a response and the model, stream flag and character estimate of a request are
what a full ``json`` parse gives, on generated and mutated bodies; where the native
reader cannot tell (``False``) the reference decides."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx2
import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue._ratequeue import (
    _read_call_headers,
    _read_request,
    _read_response,
    _read_usage,
    _scan_response,
)
from ratequeue.httpx import RateLimitedTransport, TokenEstimator
from ratequeue.httpx._record import json_object, json_usage, json_usage_py
from ratequeue.httpx._wire import scan_response

# -- strategies ---------------------------------------------------------------------------

NAMES = st.sampled_from(
    [
        "usage",
        "response",
        "input_tokens",
        "output_tokens",
        "prompt_tokens",
        "completion_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "model",
        "messages",
        "input",
        "content",
        "role",
        "type",
        "id",
        "data",
        "image_url",
        "source",
        "file_data",
        "b64_json",
        "text",
        "stream",
        "stream_options",
        "include_usage",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "system",
        "tools",
    ]
)
TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ["data:image/png;base64,xx", "data:", "dat", "ü😀", "\ud800", "\udc00x", '"usage":{}']
    ),
)
INTS = st.one_of(
    st.integers(-5, 2**64 + 5),
    st.sampled_from([0, 2**63, 2**64 - 1, 2**64, 10**30, -(2**64)]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
KEYS = st.one_of(NAMES, st.text(max_size=6))


def _objects(children: Any) -> Any:
    # Lists of pairs: a key may repeat (a dict keeps the last value).
    return st.lists(st.tuples(KEYS, children), max_size=6)


VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=5), _objects(children)),
    max_leaves=40,
)


def dumps(v: Any, ascii_: bool, compact: bool) -> str:
    """JSON text of ``v``, where a list of pairs is an object (keys may repeat)."""
    sep = (",", ":") if compact else (", ", ": ")
    if isinstance(v, list) and v and all(isinstance(x, tuple) for x in v):
        inner = sep[0].join(
            json.dumps(k, ensure_ascii=ascii_) + sep[1] + dumps(x, ascii_, compact) for k, x in v
        )
        return "{" + inner + "}"
    if isinstance(v, list):
        return "[" + sep[0].join(dumps(x, ascii_, compact) for x in v) + "]"
    return json.dumps(v, ensure_ascii=ascii_)


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


@st.composite
def response_bodies(draw: Any) -> bytes:
    usage = draw(_objects(st.one_of(SCALARS, VALUES)))
    top: list[tuple[str, Any]] = draw(_objects(VALUES))
    top.insert(draw(st.integers(0, len(top))), ("usage", draw(st.one_of(st.just(usage), SCALARS))))
    if draw(st.booleans()):
        top.append(("response", [("usage", usage), ("x", draw(VALUES))]))
    return encode(dumps(top, draw(st.booleans()), draw(st.booleans())))


NESTED_BOUNDS = [
    ("generationConfig", ["maxOutputTokens", "max_output_tokens", "temperature"]),
    ("generation_config", ["max_output_tokens", "maxOutputTokens"]),
    ("inferenceConfig", ["maxTokens", "max_new_tokens", "topP"]),
    ("textGenerationConfig", ["maxTokenCount", "topP"]),
]


@st.composite
def request_bodies(draw: Any) -> bytes:
    top: list[tuple[str, Any]] = draw(_objects(VALUES))
    message = st.lists(
        st.tuples(
            st.sampled_from(["role", "content", "name", "type", "text", "image_url"]), VALUES
        ),
        max_size=4,
    )
    if draw(st.booleans()):
        top.append(("messages", draw(st.lists(message, max_size=4))))
    top.append(("model", draw(st.one_of(TEXT, SCALARS))))
    if draw(st.booleans()):
        top.append(("stream", draw(st.sampled_from([True, False, None, 1]))))
        so = draw(st.sampled_from([None, [], [("include_usage", True)], [("include_usage", 1)]]))
        top.append(("stream_options", so))
    for f in (
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "max_gen_len",
        "n",
        "best_of",
    ):
        if draw(st.booleans()):
            top.append((f, draw(st.one_of(INTS, SCALARS))))
    for c, names in NESTED_BOUNDS:  # nested bounds (Gemini, Bedrock), repeated or not
        for _ in range(draw(st.integers(0, 2))):
            inner = [(n, draw(st.one_of(INTS, SCALARS))) for n in names if draw(st.booleans())]
            top.append((c, draw(st.one_of(st.just(inner), SCALARS))))
    order = draw(st.permutations(range(len(top))))
    top = [top[i] for i in order]
    return encode(dumps(top, draw(st.booleans()), draw(st.booleans())))


@st.composite
def mutated(draw: Any, bodies: Any) -> bytes:
    """A body with a few bytes cut, inserted or replaced (JSON or not)."""
    b = bytearray(draw(bodies))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(b)))
        op = draw(st.sampled_from(["cut", "insert", "replace", "truncate"]))
        c = draw(st.sampled_from(list(b'{}[]",:\\u0 -.eE9\x00\xff\xc3tnfNI')))
        if op == "cut" and i < len(b):
            del b[i]
        elif op == "insert":
            b.insert(i, c)
        elif op == "replace" and i < len(b):
            b[i] = c
        elif op == "truncate":
            del b[i:]
    return bytes(b)


# -- the references -----------------------------------------------------------------------


def reference_request(data: bytes, cpt: int, default: int) -> Any:
    body = json_object(data)
    if body is None:
        return None
    m = body.get("model")
    so = body.get("stream_options")
    stream = body.get("stream") is True and not (
        isinstance(so, dict) and so.get("include_usage") is True
    )
    est = TokenEstimator(None, default_output_tokens=default, chars_per_token=cpt)(body, "/x")
    return (m if type(m) is str else None, stream, est.input_tokens, est.output_tokens)


def check_usage(data: bytes) -> None:
    want = json_usage_py(data)
    got = _read_usage(data)
    if got is not False:
        assert got == (None if want is None else tuple(want)), data
    assert json_usage(data) == want


def check_request(data: bytes, cpt: int = 4, default: int = 1024) -> Any:
    got = _read_request(data, cpt, default)
    if got is not False:
        assert got == reference_request(data, cpt, default), data
    return got


# -- agreement ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(response_bodies())
def test_usage_agrees_with_the_reference(data: bytes) -> None:
    check_usage(data)


@settings(max_examples=200, deadline=None)
@given(mutated(response_bodies()))
def test_usage_agrees_on_mutated_bodies(data: bytes) -> None:
    check_usage(data)


@settings(max_examples=200, deadline=None)
@given(request_bodies(), st.integers(1, 9), st.integers(0, 5000))
def test_request_agrees_with_the_reference(data: bytes, cpt: int, default: int) -> None:
    check_request(data, cpt, default)


@settings(max_examples=200, deadline=None)
@given(mutated(request_bodies()))
def test_request_agrees_on_mutated_bodies(data: bytes) -> None:
    check_request(data)


@pytest.mark.parametrize(
    "text",
    [
        '{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
        '{"us\\u0061ge": {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 9}}',
        '{"usage": {"input_tokens": -0, "output_tokens": 1e2}}',
        '{"usage": {"input_tokens": NaN, "prompt_tokens": 2}, "x": -Infinity}',
        '{"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "usage": {}}',
        '{"response": {"usage": {"input_tokens": 1}, "usage": 5}}',
        '{"x": "\\"usage\\": {\\"prompt_tokens\\": 1}"}',
        '  {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}\r\n',
        '{"usage": {"prompt_tokens": 1, "completion_tokens": 1}',
        '{"usage": {"prompt_tokens": true, "completion_tokens": false}}',
        '{"usage": {"input_tokens": 18446744073709551616, "output_tokens": 1}}',
        '{"usage": {"input_tokens": 18446744073709551615, "cache_read_input_tokens": 7}}',
    ],
)
def test_usage_cases(text: str) -> None:
    check_usage(text.encode())


def test_usage_other_encodings_defer_to_the_reference() -> None:
    body = '{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}'
    for data in (
        b"\xef\xbb\xbf" + body.encode(),
        body.encode("utf-16"),
        body.encode("utf-16-le"),
        body.encode("utf-32"),
        body.replace("}}", ', "s": "\ud800"}}').encode("utf-8", "surrogatepass"),
    ):
        # (A UTF-16 object without a BOM cannot spell "usage" in UTF-8: None, as the
        # reference's own first test says.)
        assert _read_usage(data) is (None if data[:2] == b"{\x00" else False)
        check_usage(data)


def test_huge_ints_defer_and_agree() -> None:
    for text in (
        '{"usage": {"prompt_tokens": 1, "completion_tokens": 2}, "n": 1%s}' % ("0" * 5000),
        '{"usage": {"prompt_tokens": 1%s, "completion_tokens": 2}}' % ("0" * 700),
    ):
        assert _read_usage(text.encode()) is False
        check_usage(text.encode())
        check_request(text.encode())


@pytest.mark.parametrize("levels", [127, 129, 900, 100_000])
def test_deep_bodies_never_overflow_the_stack(levels: int) -> None:
    usage = '"usage": {"prompt_tokens": 1, "completion_tokens": 2}'
    for text in (
        "{" + usage + ', "x": ' + "[" * levels + "1" + "]" * levels + "}",
        '{"x": ' + '{"a": ' * levels + '"y"' + "}" * levels + ", " + usage + "}",
    ):
        data = text.encode()
        if levels >= 128:
            assert _read_usage(data) is False
            assert _read_request(data, 4, 0) is False
        check_usage(data)  # the reference: parsed, or a RecursionError read as None
        check_request(data)


@pytest.mark.parametrize(
    "text",
    [
        '{"model": "gpt", "messages": [{"role": "user", "content": "héllo 😀"}], "max_tokens": 5}',
        '{"model": "g\\u00e9", "input": [1, 2, {"text": "\\ud83d\\ude00\\ud83d\\u0041"}]}',
        '{"messages": [{"content": [{"type": "image_url", "image_url": {"url": "data:x"}},'
        ' {"type": "text", "text": "data:abc"}, {"text": "\\u0064ata:no"}]}]}',
        '{"system": "s", "system": "longer", "messages": "x", "input": ["a"]}',
        '{"stream": true, "stream_options": {"include_usage": true}, "max_output_tokens": -1,'
        ' "max_tokens": 7}',
        '{"stream": true, "stream_options": {"include_usage": 1}}',
        '{"model": 5, "max_completion_tokens": 1.0, "max_tokens": true}',
        '{"model": "\\ud800"}',
        '{"a": ' + "[" * 64 + '"deep"' + "]" * 64 + "}",
        '{"a": ' + "[" * 65 + '"deep"' + "]" * 65 + "}",
        '{"a": ' + '{"k": ' * 63 + '"deep"' + "}" * 63 + "}",
        '{"a": ' + '{"k": ' * 64 + '"deep"' + "}" * 64 + "}",
        "[1, 2]",
        '{"a": 1',
        "",
    ],
)
def test_request_cases(text: str) -> None:
    check_request(encode(text))


def test_request_with_many_members_defers() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **{f"k{i}": "v" for i in range(1100)}}
    data = json.dumps(body).encode()
    assert _read_request(data, 4, 0) is False
    check_request(data)
    body = {f"k{i}": "v" * i for i in range(1000)}
    assert check_request(json.dumps(body).encode()) is not False


HEADER_NAMES = st.one_of(
    st.sampled_from(
        [
            b"content-type",
            b"ratelimit-policy",
            b"ratelimit",
            b"ratelimit-remaining",
            b"ratelimit-limit",
            b"x-ratelimit-remaining-tokens",
            b"x-ratelimit-remaining-requests",
            b"x-ratelimit-limit-tokens",
            b"x-ratelimit-reset-tokens",
            b"anthropic-ratelimit-tokens-remaining",
            b"anthropic-ratelimit-input-tokens-remaining",
            b"anthropic-ratelimit-tokens-limit",
            b"anthropic-ratelimit-remaining-x",
            b"x-ratelimit-remainingx",
            b"retry-after",
            b"",
        ]
    ),
    st.binary(max_size=8),
)
HEADER_VALUES = st.one_of(
    st.sampled_from(
        [b"0", b" 0 ", b"\x0b0\x0c", b"0.5", b"-1", b"00", b"10", b"", b'"a";r=0;t=1', b"r=10"]
    ),
    st.binary(max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=10))
def test_header_scan_agrees_with_the_reference(pairs: list[tuple[bytes, bytes]]) -> None:
    headers = [(k, k, v) for k, v in pairs]
    got = scan_response(headers)
    assert got == scan_response(headers, {})  # the Python scan, every name classified anew
    ctype = [v for k, v in pairs if k == b"content-type"]
    assert got[0] is (ctype[-1] if ctype else got[0])  # the header's own bytes object


def test_header_scan_of_other_shapes_is_the_reference() -> None:
    odd: Any = [(b"x-ratelimit-remaining-tokens", "x-ratelimit-remaining-tokens", b"0")]
    assert scan_response(odd) == scan_response(odd, {})  # not bytes: the Python scan
    assert scan_response([]) == (b"", False)


REQUEST_NAMES = st.one_of(
    st.sampled_from(
        [
            b"x-ratequeue-priority",
            b"x-ratequeue-task",
            b"x-ratequeue-account",
            b"idempotency-key",
            b"content-length",
            b"X-RateQueue-Task",
            b"content-type",
            b"host",
            b"",
        ]
    ),
    st.binary(max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(REQUEST_NAMES, st.binary(max_size=8)), max_size=10))
def test_request_headers_agree_with_the_reference(pairs: list[tuple[bytes, bytes]]) -> None:
    from ratequeue.httpx import _prepare

    headers = [(k, k, v) for k, v in pairs]
    got = _read_call_headers(headers)
    assert got == _prepare._read_request(headers)  # the Python reader
    length = [v for k, v in pairs if k == b"content-length"]
    assert got is not None and got[4] is (length[-1] if length else None)  # its own bytes


def test_request_headers_of_other_shapes_defer() -> None:
    odd: Any = [(b"idempotency-key", "idempotency-key", b"k")]
    assert _read_call_headers(odd) is None
    assert _read_call_headers([(b"a", b"b")]) is None  # type: ignore[list-item]
    assert _read_call_headers([]) == (None, None, None, None, None)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6),
    st.one_of(st.none(), response_bodies(), mutated(response_bodies())),
)
def test_response_read_is_the_scan_and_the_usage(
    pairs: list[tuple[bytes, bytes]], body: bytes | None
) -> None:
    headers = [(k, k, v) for k, v in pairs]
    scan = _scan_response(headers)
    assert scan is not None
    usage = None if body is None else _read_usage(body)
    assert _read_response(headers, body) == (*scan, usage)
    assert _read_response(headers) == (*scan, None)


def test_response_read_of_other_shapes_defers() -> None:
    odd: Any = [(b"content-type", "content-type", b"x")]
    assert _read_response(odd, b"{}") is None


# -- through the transport ----------------------------------------------------------------


def _answer(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(200, json={"usage": {"prompt_tokens": 7, "completion_tokens": 3}})


@pytest.mark.parametrize("native", [True, False])
def test_transport_estimate_and_settle_are_the_same_either_way(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratequeue.httpx import _prepare, _record, _transport

    if not native:
        monkeypatch.setattr(_prepare._Requests, "_new_reader", lambda self: None)
        monkeypatch.setattr(_prepare._Requests, "_read_body", lambda *a: False)
        monkeypatch.setattr(_prepare, "_body_facts", lambda *a: False)
        monkeypatch.setattr(_transport, "_read_response", lambda *a: None)
        monkeypatch.setattr(_prepare, "_call_headers", lambda hl: None)
        monkeypatch.setattr(_record, "_read_usage", lambda b: False)
    lim = rq.Limiter(rq.Rate(1000, per="minute"), rq.Rate(10**6, per="minute", unit="tokens"))
    t = RateLimitedTransport(httpx2.MockTransport(_answer), lim, estimator=TokenEstimator(None))
    client = httpx2.Client(transport=t)
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 41}], "max_tokens": 9}
    r = client.post("http://x/v1/chat/completions", json=body)
    rec = r.extensions["ratequeue"]
    assert rec.model == "m"
    assert tuple(rec.estimate) == (11 + 4, 9)
    assert tuple(rec.usage) == (7, 3)
    native_read = t._read_body(json.dumps(body).encode(), "/v1/chat/completions")
    assert (native_read is not False) is native
    assert (t._reader is not None) is native


def test_deep_request_through_the_transport() -> None:
    lim = rq.Limiter(rq.Rate(1000, per="minute"), rq.Rate(10**6, per="minute", unit="tokens"))
    t = RateLimitedTransport(httpx2.MockTransport(_answer), lim, estimator=TokenEstimator(None))
    client = httpx2.Client(transport=t)
    data = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("http://x/v1/chat/completions", content=data)
    assert r.status_code == 200
    assert sys.getrecursionlimit() < 100_000  # the reference parse gave up: no JSON object
    assert tuple(r.extensions["ratequeue"].estimate) == (0, 1024)
