"""review30: the native ``prepare`` removes the transport's own headers as the Python
``_prepare`` does: only those still there when it removes them."""

from __future__ import annotations

from typing import Any

import httpx
import ratequeue as rq
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx._wire import header_list


class _Dropping(httpx.Request):
    """A request whose body read drops its priority header (any Python that runs between
    the header scan and the removal: here the ``_content`` read, in general another thread
    while a long body is read detached)."""

    @property
    def _content(self) -> bytes:
        if "_body" not in self.__dict__:
            raise AttributeError("_content")  # not read yet (httpx's own test)
        if self.__dict__.get("armed") and "x-ratequeue-priority" in self.headers:
            del self.headers["x-ratequeue-priority"]
        return self.__dict__["_body"]  # type: ignore[no-any-return]

    @_content.setter
    def _content(self, v: bytes) -> None:
        self.__dict__["_body"] = v


def _transport() -> Any:
    llm = rq.Limiter(rq.Rate(1000, per="minute"), clock=rq.ManualClock())
    inner = httpx.MockTransport(lambda r: httpx.Response(200, json={}))
    return RateLimitedTransport(inner, llm)


def test_an_own_header_gone_before_its_removal_is_no_error() -> None:
    headers = {"x-ratequeue-priority": "high", "x-ratequeue-task": "t"}
    got = []
    for native in (False, True):
        t = _transport()
        if not native:
            t._reader = None
        req = _Dropping("POST", "http://p/x", headers=headers, content=b'{"a": 1}')
        header_list(req.headers)  # httpx's header type known as triples (read natively)
        req.__dict__["armed"] = True
        call = t._prepare(req, False)  # no KeyError (the reference tolerates it)
        got.append((call.priority, call.task, dict(req.headers)))
    assert got[0] == got[1] == ("high", "t", {"host": "p", "content-length": "8"})
