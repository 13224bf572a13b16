"""httpx transports that route each request to a stable or a candidate transport.

Depends only on httpx's public transport API (``BaseTransport.handle_request``,
``AsyncBaseTransport.handle_async_request``). The user key comes from a header (default
``x-user-id``) or a function of the request; a request without one goes to stable.
Inside a ``with canary.request(key)`` block (or an arm the canary calls) the request's
arm is used and every HTTP call is booked on it (calls per user request). Tokens
are read from a JSON ``usage`` in answers of at most ``max_body`` bytes with a
``Content-Length`` (a streamed answer is not read: give ``usage``). A candidate that is
another endpoint or model gets its requests rewritten by ``candidate_request``
(:func:`to_endpoint`, :func:`with_model`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Protocol

import httpx

from .._cancel import within
from .._errors import Overloaded, WaitTimeout
from ._canary import Canary, CanaryRequest, _default_usage, current_request

__all__ = [
    "AsyncCanaryTransport",
    "AsyncTransport",
    "CanaryTransport",
    "SyncTransport",
    "to_endpoint",
    "with_model",
]

Key = Callable[[httpx.Request], object]
Rewrite = Callable[[httpx.Request], httpx.Request]


def _headers_without(request: httpx.Request, *names: str) -> list[tuple[bytes, bytes]]:
    drop = {n.encode() for n in names}
    return [(k, v) for k, v in request.headers.raw if k.lower() not in drop]


def to_endpoint(base_url: str) -> Rewrite:
    """A ``candidate_request`` that sends the candidate's requests to another scheme,
    host and port (path, query, headers and body kept; the body is not read)."""
    base = httpx.URL(base_url)
    if not base.host:
        raise ValueError(f"base_url={base_url!r} needs a scheme and a host")

    def rewrite(request: httpx.Request) -> httpx.Request:
        url = request.url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
        headers = [(b"Host", url.netloc), *_headers_without(request, "host")]
        return httpx.Request(request.method, url, headers=headers, stream=request.stream)

    return rewrite


def with_model(model: str, *, then: Rewrite | None = None) -> Rewrite:
    """A ``candidate_request`` that sets ``"model"`` in a JSON body (another model on the
    same endpoint); ``then`` rewrites further (e.g. :func:`to_endpoint`)."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model={model!r} must be a non-empty str")

    def rewrite(request: httpx.Request) -> httpx.Request:
        try:
            body = request.read()
        except RuntimeError:  # an async stream not read yet: left as it is
            return then(request) if then is not None else request
        try:
            data = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            data = None  # not JSON (nested past the parser's depth counts as not JSON)
        if isinstance(data, dict):
            data["model"] = model
            request = httpx.Request(
                request.method,
                request.url,
                headers=_headers_without(request, "content-length", "transfer-encoding"),
                content=json.dumps(data).encode(),
            )
        return then(request) if then is not None else request

    return rewrite


def _key_fn(key: str | Key) -> Key:
    if callable(key):
        return key
    if not isinstance(key, str):
        raise TypeError(f"key must be a header name or a function of the request, got {key!r}")
    header = key

    def from_header(request: httpx.Request) -> object:
        return request.headers.get(header)

    return from_header


def _tokens(response: httpx.Response, max_body: int) -> int:
    length = response.headers.get("content-length")
    if length is None or not length.isdigit() or int(length) > max_body:
        return 0
    if not response.is_stream_consumed:
        return 0  # never read here: a body we did not buffer
    if "json" not in response.headers.get("content-type", "json"):
        return 0
    try:
        return _default_usage(json.loads(response.content))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return 0  # a remote body nested past the parser's depth is not JSON


def _small(headers: httpx.Headers, max_body: int) -> bool:
    """True when a body has a Content-Length of at most ``max_body`` (or no body)."""
    if "transfer-encoding" in headers:
        return False
    length = headers.get("content-length", "0")
    return length.isdigit() and int(length) <= max_body


def _failed(req: CanaryRequest, exc: Exception) -> None:
    """Book a call that raised: a limiter's refusal is rate limited, the rest errors."""
    if isinstance(exc, (Overloaded, WaitTimeout)):
        req.call(rate_limited=True)
        req.finish(valid=False)
    else:
        req.call()
        req.finish(error=True)


class SyncTransport(Protocol):
    """What the sync router needs of an arm: httpx's ``BaseTransport`` interface (an
    ``httpx.HTTPTransport``, a ``ratequeue.httpx.RateLimitedTransport``...)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response: ...
    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """What the asyncio router needs of an arm: httpx's ``AsyncBaseTransport`` interface."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response: ...
    async def aclose(self) -> None: ...


def _copy(request: httpx.Request) -> httpx.Request:
    return httpx.Request(
        request.method, request.url, headers=request.headers, content=request.content
    )


class _Routing:
    def __init__(
        self,
        canary: Canary,
        key: str | Key,
        valid: Callable[[httpx.Response], bool] | None,
        usage: Callable[[httpx.Response], int] | None,
        max_body: int,
        candidate_request: Rewrite | None = None,
    ) -> None:
        if not isinstance(canary, Canary):
            raise TypeError(f"canary must be a ratequeue.Canary, got {canary!r}")
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 0:
            raise ValueError(f"max_body={max_body!r} must be an int >= 0")
        self.canary = canary
        self._key = _key_fn(key)
        self._valid = valid or (lambda r: r.status_code < 400)
        self._usage = usage
        self.max_body = max_body
        self._rewrite = candidate_request

    def _for_candidate(self, request: httpx.Request) -> httpx.Request:
        return request if self._rewrite is None else self._rewrite(request)

    def _outer(self) -> CanaryRequest | None:
        req = current_request()
        return req if req is not None and req.canary is self.canary else None

    def _own(self, request: httpx.Request) -> tuple[object, CanaryRequest]:
        key = self._key(request)
        if key is None or key == "":
            return None, self.canary.request("", arm="stable")  # no user: stable
        return key, self.canary.request(key)

    def _book(self, req: CanaryRequest, response: httpx.Response, own: bool) -> None:
        tokens = self._usage(response) if self._usage else _tokens(response, self.max_body)
        req.call(tokens, status=response.status_code)
        if own:
            req.finish(valid=bool(self._valid(response)))


class CanaryTransport(httpx.BaseTransport, _Routing):
    """Sends each request through ``stable`` or ``candidate`` as ``canary`` routes its
    user; in shadow mode a copy goes to ``candidate`` on a background thread and only
    stable's answer is returned."""

    def __init__(
        self,
        canary: Canary,
        stable: SyncTransport,
        candidate: SyncTransport,
        *,
        key: str | Key = "x-user-id",
        valid: Callable[[httpx.Response], bool] | None = None,
        usage: Callable[[httpx.Response], int] | None = None,
        max_body: int = 1 << 20,
        candidate_request: Rewrite | None = None,
    ) -> None:
        _Routing.__init__(self, canary, key, valid, usage, max_body, candidate_request)
        self.stable = stable
        self.candidate = candidate

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        outer = self._outer()
        if outer is not None:
            req, own = outer, False
        else:
            key, req = self._own(request)
            own = True
            if key is not None and self.canary.shadowed(key):
                if _small(request.headers, self.max_body):
                    request.read()
                    self._shadow(key, self._for_candidate(_copy(request)))
                else:
                    self.canary._drop_shadow()  # a streamed or large body is not copied
        if req.arm == "stable":
            inner = self.stable
        else:
            inner, request = self.candidate, self._for_candidate(request)
        try:
            response = inner.handle_request(request)
            if "content-length" in response.headers and _small(response.headers, self.max_body):
                response.read()
        except Exception as e:
            if own:
                _failed(req, e)
            raise
        self._book(req, response, own)
        return response

    def _shadow(self, key: object, request: httpx.Request) -> None:
        def job() -> None:
            req = CanaryRequest(self.canary, key, "candidate", shadow=True)
            try:
                response = self.candidate.handle_request(request)
                try:
                    if _small(response.headers, self.max_body):
                        response.read()
                finally:
                    response.close()
            except Exception as e:
                _failed(req, e)
                return
            self._book(req, response, True)

        if not self.canary._runner.submit(job):
            self.canary._drop_shadow()

    def close(self) -> None:
        self.stable.close()
        self.candidate.close()


class AsyncCanaryTransport(httpx.AsyncBaseTransport, _Routing):
    """The asyncio twin of :class:`CanaryTransport` (a shadow copy runs as a task,
    bounded by the canary's ``max_shadow`` and ``shadow_timeout``)."""

    def __init__(
        self,
        canary: Canary,
        stable: AsyncTransport,
        candidate: AsyncTransport,
        *,
        key: str | Key = "x-user-id",
        valid: Callable[[httpx.Response], bool] | None = None,
        usage: Callable[[httpx.Response], int] | None = None,
        max_body: int = 1 << 20,
        candidate_request: Rewrite | None = None,
    ) -> None:
        _Routing.__init__(self, canary, key, valid, usage, max_body, candidate_request)
        self.stable = stable
        self.candidate = candidate
        self._tasks: set[asyncio.Task[None]] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        outer = self._outer()
        if outer is not None:
            req, own = outer, False
        else:
            key, req = self._own(request)
            own = True
            if key is not None and self.canary.shadowed(key):
                if _small(request.headers, self.max_body):
                    await request.aread()
                    self._shadow(key, self._for_candidate(_copy(request)))
                else:
                    self.canary._drop_shadow()  # a streamed or large body is not copied
        if req.arm == "stable":
            ainner = self.stable
        else:
            ainner, request = self.candidate, self._for_candidate(request)
        try:
            response = await ainner.handle_async_request(request)
            if "content-length" in response.headers and _small(response.headers, self.max_body):
                await response.aread()
        except Exception as e:
            if own:
                _failed(req, e)
            raise
        self._book(req, response, own)
        return response

    def _shadow(self, key: object, request: httpx.Request) -> None:
        if len(self._tasks) >= self.canary._max_shadow:
            self.canary._drop_shadow()
            return
        task = asyncio.get_running_loop().create_task(self._run_shadow(key, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_shadow(self, key: object, request: httpx.Request) -> None:
        req = CanaryRequest(self.canary, key, "candidate", shadow=True)
        timeout = self.canary.shadow_timeout
        try:
            response = await within(self.candidate.handle_async_request(request), timeout)
            try:
                if _small(response.headers, self.max_body):
                    await within(response.aread(), timeout)
            finally:
                await response.aclose()
        except Exception as e:
            _failed(req, e)
            return
        self._book(req, response, True)

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await self.stable.aclose()
        await self.candidate.aclose()
