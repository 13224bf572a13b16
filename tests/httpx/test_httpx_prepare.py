"""The one-call request reader (``_RequestReader.read``) against the Python reference
(``_read_py``): own headers, body, model, estimate, costs and clamps are the same for
any request, transport settings and estimator; where the reader defers (None) the
reference prepares the call, and nothing was changed by the reader."""

from __future__ import annotations

import contextlib
import importlib
import json
from typing import Any

import pytest
import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue._ratequeue import _cap_output
from ratequeue.httpx import (
    CallBudget,
    Cap,
    Capped,
    Estimate,
    RateLimitedTransport,
    TokenEstimator,
    _wire,
    chars_estimate,
    using,
)
from ratequeue.httpx._body import nested_values, repeated, spliced
from ratequeue.httpx._caps import BOUND_NAMES, CapNotApplied, cap_fields, output_field
from ratequeue.httpx._estimate import OUTPUT_BOUNDS, OUTPUT_FIELDS
from ratequeue.httpx._prepare import _CAP_KEYS as CAP_KEYS
from ratequeue.httpx._prepare import _NESTED as NESTED
from ratequeue.httpx._record import json_object
from ratequeue.httpx._wire import header_list
from test_httpx_native import NESTED_BOUNDS, dumps, encode, mutated, request_bodies

OWN = st.sampled_from(
    [
        "x-ratequeue-priority",
        "X-RateQueue-Task",
        "x-ratequeue-account",
        "Idempotency-Key",
        "x-other",
        "content-type",
    ]
)
VALUES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=6).map(
    lambda v: v.encode("latin-1")
)


def _custom(body: dict[str, Any] | None, path: str) -> Estimate:
    return Estimate(3, 5)


def transport(mod: Any, units: str, burst: int, stream_usage: bool, est: Any, caps: bool) -> Any:
    rates = [rq.Rate(10**6, per="minute", burst=burst)]
    if units != "requests":
        for u in units.split("+"):
            rates.append(rq.Rate(10**6, per="minute", burst=burst, unit=u))
    return RateLimitedTransport(
        mod.MockTransport(lambda r: mod.Response(200, json={})),
        rq.Limiter(*rates, clock=rq.ManualClock()),
        estimator=est,
        stream_usage=stream_usage,
        caps=[Cap(7)] if caps else (),
    )


def request(mod: Any, method: str, path: str, headers: list[tuple[str, bytes]], body: Any) -> Any:
    if body == "stream":  # a body not read: its length known, its content not
        hs = [*headers, ("content-length", b"5")]
        return mod.Request(method, "http://p" + path, headers=hs, content=iter([b"12345"]))
    return mod.Request(method, "http://p" + path, headers=headers, content=body)


def sent(req: Any) -> tuple[Any, ...]:
    """What a request sends: headers, method, URL and body bytes (None: not read)."""
    return (list(req.headers.raw), req.method, str(req.url), getattr(req, "_content", None))


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["httpx", "httpx2"]),
    st.sampled_from(["POST", "PUT", "GET"]),
    st.sampled_from(
        ["/v1/chat/completions", "/v1/responses", "/x", "/v1/embeddings", "/model/a.embed-1/invoke"]
    ),
    st.lists(st.tuples(OWN, VALUES), max_size=4),
    st.one_of(st.none(), st.just("stream"), request_bodies(), mutated(request_bodies())),
    st.sampled_from(["requests", "requests+tokens", "input_tokens+output_tokens+images"]),
    st.sampled_from([1, 50, 10**6]),
    st.booleans(),
    st.sampled_from(["chars", "chars_estimate", "custom", "chars3"]),
    st.booleans(),
    st.booleans(),
)
def test_reader_agrees_with_the_reference(
    modname: str,
    method: str,
    path: str,
    headers: list[tuple[str, bytes]],
    body: Any,
    units: str,
    burst: int,
    stream_usage: bool,
    est_name: str,
    caps: bool,
    want: bool,
) -> None:
    mod = importlib.import_module(modname)
    est = {
        "chars": TokenEstimator(None),
        "chars_estimate": chars_estimate,
        "custom": _custom,
        "chars3": TokenEstimator(None, chars_per_token=3, default_output_tokens=17),
    }[est_name]
    t = transport(mod, units, burst, stream_usage, est, caps)
    req = request(mod, method, path, headers, body)
    header_list(req.headers)  # its type known to keep httpx's triples (the reference learns it)
    before = sent(req)
    got = t._reader.read(req, path, want, t.estimator)
    if got is None:
        assert sent(req) == before  # nothing changed
        return
    ref = request(mod, method, path, headers, body)
    want_read = t._read_py(ref, path, want)
    # The same request goes out: a stream asked for its usage, byte for byte.
    assert sent(req) == sent(ref)
    data_got, data_ref = got[8], want_read[8]
    assert got[:8] == want_read[:8]
    assert type(got[5]) is type(want_read[5])
    assert data_got == data_ref
    assert got[9] is want_read[9] is None
    assert got[10] is want_read[10]  # sent without a body


def record_fields(call: Any, t: Any) -> dict[str, Any]:
    """Every slot of a record (CallRecord's and _Call's), its generated request id by
    shape, its request and estimator by identity."""
    out: dict[str, Any] = {}
    for cls in type(call).__mro__[:-1]:
        for name in cls.__slots__:
            v = getattr(call, name)  # every slot set: AttributeError otherwise
            if name == "request_id" and v.startswith(_wire._PREFIX):
                v = "<generated>" if v[len(_wire._PREFIX) :].isdigit() else v
            elif name == "_pending" and v is not None:
                v = (v[0], v[1] is t.estimator)
            elif name == "_request":
                v = type(v)
            out[name] = v
    out["types"] = (type(call), type(call._estimate), type(call._once))
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["httpx", "httpx2"]),
    st.sampled_from(["POST", "GET"]),
    st.sampled_from(["/v1/chat/completions", "/x", "/a%20b/x", "/a%2Fb", "", "/v1/Embeddings/"]),
    st.lists(st.tuples(OWN, VALUES), max_size=4),
    st.one_of(st.none(), st.just("stream"), request_bodies(), mutated(request_bodies())),
    st.sampled_from(["requests", "requests+tokens", "input_tokens+output_tokens+images"]),
    st.sampled_from(["chars", "custom"]),
    st.sampled_from([None, "p", ""]),
    st.sampled_from([None, 0.0, 2.5]),
    st.sampled_from(["default", "", "callable"]),
    st.sampled_from([None, "budget", "options"]),
    st.booleans(),
)
def test_prepare_agrees_with_the_reference(
    modname: str,
    method: str,
    path: str,
    headers: list[tuple[str, bytes]],
    body: Any,
    units: str,
    est_name: str,
    priority: str | None,
    timeout: float | None,
    account: str,
    context: str | None,
    is_async: bool,
) -> None:
    """The record ``_RequestReader.prepare`` makes is the one the Python ``_prepare``
    makes (with no native reader at all); where it defers, nothing was changed."""
    mod = importlib.import_module(modname)

    def make() -> Any:
        est = TokenEstimator(None) if est_name == "chars" else _custom
        t = transport(mod, units, 10**6, True, est, False)
        t.priority = priority
        t.timeout = timeout
        t.account = (lambda r: "acc") if account == "callable" else account
        return t

    t, ref_t = make(), make()
    ref_t._reader = None
    req = request(mod, method, path, headers, body)
    ref = request(mod, method, path, headers, body)
    header_list(req.headers)
    before = sent(req)
    with contextlib.ExitStack() as stack:
        if context == "budget":
            stack.enter_context(CallBudget(calls=10))
        elif context == "options":
            stack.enter_context(using(task="t"))
        assert t._reader is not None
        call = t._reader.prepare(
            req, t.estimator, is_async, t.priority, t.timeout, t.account, t.wait_histogram
        )
        if call is None:
            assert sent(req) == before  # nothing changed
            return
        assert context is None and account != "callable"
        want = ref_t._prepare(ref, is_async)
    assert sent(req) == sent(ref)
    # Granted at once by the native prepare (a Limiter, nobody queued, a priority it
    # knows): the permit of the costs the reference acquires after; else none yet.
    permit = call._permit
    assert want._permit is None
    if permit is not None:
        assert permit.costs == call._charged and permit.waited == 0.0
        assert t.wait_histogram.count == 1
        call._permit = None
    else:
        assert call.priority is not None and t.wait_histogram.count == 0  # not a class
    assert record_fields(call, t) == record_fields(want, ref_t)
    assert call._request is req
    assert call._chain is want._chain and call._once is not want._once


@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
def test_the_common_call_is_prepared_natively(modname: str) -> None:
    """Outside budgets and call options, with a str account: one native crossing makes
    the record (own headers removed, an id generated or the SDK's key kept); inside
    either, or with an account callable, ``prepare`` defers to the Python ``_prepare``."""
    mod = importlib.import_module(modname)
    t = transport(mod, "requests+tokens", 10**6, True, TokenEstimator(None), False)
    t.timeout = 1.5
    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 40 + b'"}]}'
    hs = [("X-RateQueue-Priority", b"hi"), ("x-ratequeue-task", b"t"), ("x-other", b"1")]
    req = request(mod, "POST", "/v1/chat/completions", hs, body)
    header_list(req.headers)
    call = t._reader.prepare(
        req, t.estimator, True, t.priority, t.timeout, t.account, t.wait_histogram
    )
    assert call is not None
    assert (call.path, call.model, call.priority, call.task, call._account) == (
        "/v1/chat/completions",
        "m",
        "hi",
        "t",
        "default",
    )
    assert call._kw == {**call._charged, "timeout": 1.5, "priority": "hi"}
    assert call.request_id.startswith(_wire._PREFIX) and call._async is True
    assert not any(k.lower().startswith(b"x-ratequeue") for k, _ in req.headers.raw)
    assert req.headers["x-other"] == "1"
    ids = {t._prepare(request(mod, "POST", "/x", [], body), False).request_id for _ in range(3)}
    assert len(ids) == 3
    keyed = request(mod, "POST", "/x", [("Idempotency-Key", b"k1")], body)
    assert t._prepare(keyed, False).request_id == "k1"
    for ctx in (CallBudget(calls=5), using(task="u")):
        with ctx:
            req = request(mod, "POST", "/x", [], body)
            assert (
                t._reader.prepare(req, t.estimator, False, None, None, "a", t.wait_histogram)
                is None
            )
            assert t._prepare(req, False).task == ("u" if not isinstance(ctx, CallBudget) else None)
    req = request(mod, "POST", "/x", [], body)
    assert (
        t._reader.prepare(req, t.estimator, False, None, None, lambda r: "a", t.wait_histogram)
        is None
    )


def test_prepared_records_hold_and_free_what_they_reference() -> None:
    """The native record holds one reference to each value (none leaked, none freed
    early): the shared constants, the request and the estimator come back to their
    counts once the records are gone, and a collection with records alive is safe."""
    import gc
    import sys

    import httpx2
    from ratequeue.httpx._record import _NO_CHAIN

    t = transport(httpx2, "requests+tokens", 10**6, True, TokenEstimator(None), False)
    body = b'{"model":"m","messages":[]}'
    req = request(httpx2, "POST", "/v1/chat/completions", [], body)
    header_list(req.headers)
    before = (sys.getrefcount(_NO_CHAIN), sys.getrefcount(req), sys.getrefcount(t.estimator))
    calls = [
        t._reader.prepare(req, t.estimator, False, None, None, "a", t.wait_histogram)
        for _ in range(200)
    ]
    assert all(c is not None and c._chain is _NO_CHAIN and c._request is req for c in calls)
    assert sys.getrefcount(_NO_CHAIN) == before[0] + 200
    gc.collect()
    assert [c.path for c in calls[:2]] == ["/v1/chat/completions"] * 2
    del calls
    gc.collect()
    assert (
        sys.getrefcount(_NO_CHAIN),
        sys.getrefcount(req),
        sys.getrefcount(t.estimator),
    ) == before


def test_a_record_type_prepare_cannot_fill_is_refused() -> None:
    """The native record is made only for a type whose slots are exactly the ones it
    sets; another layout is refused when the reader is built, never half-filled."""
    from ratequeue._ratequeue import _RequestReader
    from ratequeue.httpx._record import _CONSTANT_SLOTS, _Call

    class Extra(_Call):
        __slots__ = ("extra",)

    class Prop(_Call):
        __slots__ = ()
        priority = property(lambda self: None)  # type: ignore[assignment]

    t = transport(__import__("httpx2"), "requests", 10**6, True, TokenEstimator(None), False)
    for bad, consts in (
        (Extra, _CONSTANT_SLOTS),
        (_Call, _CONSTANT_SLOTS[1:]),
        (Prop, _CONSTANT_SLOTS),
        (_Call, (*_CONSTANT_SLOTS, ("nope", None))),
    ):
        with pytest.raises((ValueError, AttributeError)):
            _RequestReader(
                t._plan,
                t._unit_costs,
                set(),
                TokenEstimator,
                chars_estimate,
                t.estimator,
                Estimate,
                needs_body=True,
                stream_usage=True,
                caps=False,
                max_body=100,
                call=(bad, None, None, None, None, ("a", "b", "c"), consts),
            )


def test_the_estimate_is_made_of_its_own_type() -> None:
    """The native reader makes the estimate as ``tuple.__new__(type, (i, o))`` would,
    for a tuple subclass of a tuple's layout (made directly) and one with a ``__dict__``
    (through ``tuple.__new__``)."""
    import httpx2
    from ratequeue._ratequeue import _RequestReader

    class WithDict(tuple):  # type: ignore[type-arg]
        pass

    t = transport(httpx2, "requests+tokens", 10**6, True, TokenEstimator(None), False)
    body = b'{"model":"m","messages":[],"max_tokens":7}'
    for ty in (Estimate, WithDict):
        r = _RequestReader(
            t._plan,
            t._unit_costs,
            {type(httpx2.Headers())},
            TokenEstimator,
            chars_estimate,
            t.estimator,
            ty,
            needs_body=True,
            stream_usage=True,
            caps=False,
            max_body=1000,
        )
        req = request(httpx2, "POST", "/v1/chat/completions", [], body)
        got = r.read(req, "/v1/chat/completions", False, t.estimator)
        assert got is not None
        assert type(got[5]) is ty and tuple(got[5]) == (0, 7)


def test_the_common_call_is_read_natively() -> None:
    import httpx2

    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 40 + b'"}]}'
    for units in ("requests", "requests+tokens"):
        t = transport(httpx2, units, 10**6, True, TokenEstimator(None), False)
        req = request(httpx2, "POST", "/v1/chat/completions", [], body)
        header_list(req.headers)
        got = t._reader.read(req, "/v1/chat/completions", False, t.estimator)
        assert got is not None
        assert got[6] == (
            {"requests": 1, "tokens": 14 + 1024} if "tokens" in units else {"requests": 1}
        )


@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
def test_a_stream_is_asked_for_its_usage_natively_and_caps_take_the_reference(
    modname: str,
) -> None:
    mod = importlib.import_module(modname)
    t = transport(mod, "requests+tokens", 10**6, True, TokenEstimator(None), False)
    body = b'{"model":"m","stream":true }'
    req = request(mod, "POST", "/v1/chat/completions", [], body)
    header_list(req.headers)
    got = t._reader.read(req, "/v1/chat/completions", False, t.estimator)
    assert got is not None and got[4] == "m"
    assert req.content == b'{"model":"m","stream":true ,"stream_options":{"include_usage":true}}'
    assert req.headers["content-length"] == str(len(req.content))
    assert b"".join(req.stream) == req.content
    # One already there is merged into by the reference.
    req = request(mod, "POST", "/v1/chat/completions", [], b'{"stream":true,"stream_options":{}}')
    header_list(req.headers)
    assert t._reader.read(req, "/v1/chat/completions", False, t.estimator) is None
    c = mod.Client(transport=t)
    for content in (body, b'{"stream":true,"stream_options":{"x":1}}'):
        r = c.post("http://p/v1/chat/completions", content=content)
        assert json.loads(r.request.content)["stream_options"]["include_usage"] is True
    t = transport(mod, "requests+tokens", 10**6, True, TokenEstimator(None), True)
    req = request(mod, "POST", "/x", [], b'{"max_tokens":9}')
    assert t._reader.read(req, "/x", False, t.estimator) is None


@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
def test_own_headers_are_removed_and_read(modname: str) -> None:
    mod = importlib.import_module(modname)
    sent: list[Any] = []
    lim = rq.Limiter(rq.Rate(10**6, per="minute"), classes={"p": 1}, clock=rq.ManualClock())
    t = RateLimitedTransport(
        mod.MockTransport(lambda r: sent.append(r) or mod.Response(200, json={})), lim
    )
    c = mod.Client(transport=t)
    h = {"x-ratequeue-priority": "p", "X-RateQueue-Task": "t", "x-ratequeue-account": "a"}
    r = c.post("http://p/x", json={"a": 1}, headers={**h, "Idempotency-Key": "k"})
    rec = r.extensions["ratequeue"]
    assert (rec.priority, rec.task, rec._account, rec.request_id) == ("p", "t", "a", "k")
    assert not any(k.lower().startswith("x-ratequeue") for k in sent[-1].headers)


def test_a_burst_past_64_bits_keeps_the_reference() -> None:
    import httpx2

    lim = rq.Limiter(rq.Rate(10**6, per="minute", burst=10**6), clock=rq.ManualClock())
    t = RateLimitedTransport(httpx2.MockTransport(lambda r: httpx2.Response(200)), lim)
    t._plan = (("requests", 0, 2**70),)
    assert t._new_reader() is None


# -- the output cap, written natively -------------------------------------------------------

BOUNDS = st.one_of(
    st.integers(-5, 300),
    st.sampled_from([True, False, None, 1.0, "9", 2**64 + 1, -(2**70), [], {}]),
)


@st.composite
def capped_bodies(draw: Any) -> bytes:
    """Request bodies whose output bounds repeat, nest, are escaped or not ints."""
    base = json.loads(draw(request_bodies()).decode("utf-8", "surrogatepass") or "{}")
    top: list[tuple[str, Any]] = [(k, v) for k, v in base.items()] if isinstance(base, dict) else []
    for _ in range(draw(st.integers(0, 4))):
        f = draw(st.sampled_from(OUTPUT_FIELDS))
        value = draw(st.one_of(BOUNDS, st.just([(f, 500)])))  # a nested object of the same key
        top.insert(draw(st.integers(0, len(top))), (f, value))
    for _ in range(draw(st.integers(0, 2))):  # choices
        f = draw(st.sampled_from(["n", "best_of"]))
        value = draw(st.one_of(st.integers(1, 5), st.integers(1, 5), BOUNDS))
        top.insert(draw(st.integers(0, len(top))), (f, value))
    for c, names in NESTED_BOUNDS:  # a container of nested bounds, rarely repeated
        for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2]))):
            inner = [(n, draw(BOUNDS)) for n in names if draw(st.booleans())]
            value = draw(st.one_of(st.just(inner), st.just(inner), BOUNDS))
            top.insert(draw(st.integers(0, len(top))), (c, value))
    text = dumps(top, draw(st.booleans()), draw(st.booleans()))
    if draw(st.booleans()):  # escaped keys
        text = text.replace('"max_tokens"', '"max\\u005ftokens"')
    if draw(st.booleans()):
        text = " \n" + text.replace(",", " ,\t") + "\r\n"
    return encode(text)


def reference_cap(data: bytes, limit: int, path: str) -> Any:
    """What the Python path does: the capped body's bytes and the cap applied (None:
    nothing changes; False: the body is not a UTF-8 object ``spliced`` reads)."""
    body = json_object(data)
    if body is None:
        return False
    try:
        capped, fields = cap_fields(
            body, path, limit, repeated(data, CAP_KEYS), nested_values(data, NESTED)
        )
    except CapNotApplied as e:
        return str(e)
    if capped is None:
        return None
    new = spliced(data, fields)
    return False if new is None else (new, capped, body)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(capped_bodies(), mutated(capped_bodies())),
    st.integers(1, 400),
    st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/messages",
            "/v1beta/models/g:generateContent",
            "/model/m/converse",
        ]
    ),
)
def test_native_cap_is_the_reference_byte_for_byte(data: bytes, limit: int, path: str) -> None:
    got = _cap_output(data, limit, BOUND_NAMES.index(output_field(path)))
    want = reference_cap(data, limit, path)
    if got is False:  # deferred: huge ints, other encodings, not an object
        return
    if want is None or got is None or type(got) is str:
        assert got == want  # unchanged, or refused for the same reason
        return
    assert want is not False and type(want) is not str
    new, capped, body = want
    assert got[0] == new
    assert Capped(BOUND_NAMES[got[1]], got[2], got[3]) == capped
    assert json.loads(got[0]) == body  # valid JSON, the capped object
    # every occurrence of a repeated n / best_of counts; null is one choice
    top = json.loads(got[0], object_pairs_hook=list)
    choices = max([1] + [v for k, v in top if k in ("n", "best_of") and v is not None])
    assert got[3] == limit // choices
    for p in OUTPUT_BOUNDS:  # never raised; a negative one replaced
        v = body.get(p[0]) if len(p) == 1 else (body.get(p[0]) or {}).get(p[1])
        if type(v) is int:
            assert 0 <= v <= got[3]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("modname", ["httpx", "httpx2"])
def test_caps_through_the_transport_either_way(
    native: bool, modname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratequeue.httpx import _prepare

    if not native:
        monkeypatch.setattr(_prepare, "_cap_output", lambda *a: False)
    mod = importlib.import_module(modname)
    sent: list[Any] = []
    lim = rq.Limiter(
        rq.Rate(10**6, per="minute"),
        rq.Rate(10**6, per="minute", unit="tokens"),
        clock=rq.ManualClock(),
    )
    t = RateLimitedTransport(
        mod.MockTransport(lambda r: sent.append(r) or mod.Response(200, json={})),
        lim,
        estimator=TokenEstimator(None),
        caps=[Cap(100, route="/chat/completions"), Cap(20, task="summary")],
    )
    c = mod.Client(transport=t)
    data = (
        b'{"model":"m","max_tokens" : 4000,"messages":[{"role":"user","content":"\\u00fc'
        + b"x" * 39
        + b'"}]}'
    )
    r = c.post("http://p/v1/chat/completions", content=data)
    rec = r.extensions["ratequeue"]
    assert (rec.capped.field, rec.capped.requested, rec.capped.sent) == ("max_tokens", 4000, 100)
    assert tuple(rec.estimate) == (10 + 4, 100)
    if native:  # the one number rewritten, every other byte kept
        assert sent[-1].content == data.replace(b"4000", b"100")
    assert json.loads(sent[-1].content)["max_tokens"] == 100
    assert int(sent[-1].headers["content-length"]) == len(sent[-1].content)
    with using(task="summary"):
        r = c.post("http://p/v1/chat/completions", content=data)
    assert json.loads(sent[-1].content)["max_tokens"] == 20
    r = c.post("http://p/v1/chat/completions", content=b'{"model":"m","max_tokens":7}')
    assert r.extensions["ratequeue"].capped is None
    assert sent[-1].content == b'{"model":"m","max_tokens":7}'
    r = c.post("http://p/v1/chat/completions", content=b'{"model":"m"}')
    assert sent[-1].content == b'{"model":"m","max_completion_tokens":100}'
    assert tuple(r.extensions["ratequeue"].estimate)[1] == 100


def test_a_path_that_is_not_utf8_never_raises() -> None:
    import httpx2

    t = transport(httpx2, "requests+tokens", 10**6, True, TokenEstimator(None), False)
    for body in (b'{"stream":true}', b'{"model":"m"}'):
        req = request(httpx2, "POST", "/v1/chat/completions", [], body)
        header_list(req.headers)
        got = t._reader.read(req, "/\ud800/chat/completions", False, t.estimator)
        assert (got is None) is (body == b'{"stream":true}')


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("caps", (Cap(1),)),
        ("stream_usage", False),
        ("max_body", 0),
        ("ledger", None),
        ("limit", rq.Limiter(rq.Rate(1, per="second"))),
        ("units", frozenset({"requests"})),
        ("upstream", None),
    ],
)
def test_settings_read_at_construction_cannot_be_changed_on_a_live_transport(
    name: str, value: Any
) -> None:
    """The native request reader, the cap table and the units are made from these when
    the transport is built: assigning one later would leave them deciding with the old
    value, so it raises instead of diverging silently."""
    import httpx2

    t = transport(httpx2, "requests+tokens", 10**6, True, TokenEstimator(None), True)
    before = getattr(t, name)
    with pytest.raises(AttributeError, match=f"{name}.*new transport"):
        setattr(t, name, value)
    assert getattr(t, name) is before
    t.timeout = 2.0  # the rest stays settable
    assert t.timeout == 2.0
