"""ASGI middleware: a Policy per HTTP request, the IETF RateLimit fields on every
response, queueing before refusing, and token costs settled from the response.

Pure ASGI (no dependency): works under any ASGI server and framework (Starlette,
FastAPI, Litestar). See the README section "Servers (ASGI)".
"""

from __future__ import annotations

from ._fields import PROBLEM_TYPE, QUOTA_UNITS
from ._keys import (
    KeyFunc,
    Scope,
    api_key,
    bearer_subject,
    bearer_token,
    client_ip,
    first_of,
    header,
)
from ._middleware import ASGIApp, RateLimitMiddleware
from ._rules import Rule, content_length
from ._tokens import OpenAITokens, UsageScanner

__all__ = [
    "PROBLEM_TYPE",
    "QUOTA_UNITS",
    "ASGIApp",
    "KeyFunc",
    "OpenAITokens",
    "RateLimitMiddleware",
    "Rule",
    "Scope",
    "UsageScanner",
    "api_key",
    "bearer_subject",
    "bearer_token",
    "client_ip",
    "content_length",
    "first_of",
    "header",
]
