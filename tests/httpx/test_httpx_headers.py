"""Rate-limit header parsing: every dialect, malformed and hostile values ignored."""

from __future__ import annotations

import email.utils
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import (
    Quota,
    parse_duration,
    parse_instant,
    parse_rate_limit_headers,
    parse_retry_after,
)
from ratequeue.httpx._headers import MAX_VALUE, parse_number

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0s", 0.0),
        ("1.5", 1.5),
        ("250us", 250e-6),
        (" 7s ", 7.0),
        ("17ns", 17e-9),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "s", "1x", "-1s", "1s2", "m1s", "1s 2s", "inf", "nan", "1e999s", "1" * 40 + "s"]
)
def test_malformed_durations(text: str) -> None:
    assert parse_duration(text) is None


def test_instants() -> None:
    assert parse_instant("2027-01-15T08:00:30Z", NOW) == pytest.approx(30.0)
    assert parse_instant("2027-01-15T08:00:30.500+00:00", NOW) == pytest.approx(30.5)
    assert parse_instant("2027-01-15T09:00:30+01:00", NOW) == pytest.approx(30.0)
    assert parse_instant("2020-01-01T00:00:00Z", NOW) == 0.0  # in the past
    for bad in ("", "tomorrow", "2027-13-45T00:00:00Z", "30", "2027-01-15T08:00:30Z" * 10):
        assert parse_instant(bad, NOW) is None


def test_retry_after_seconds_and_dates() -> None:
    assert parse_retry_after("5", NOW) == 5.0
    assert parse_retry_after("0.25", NOW) == 0.25
    date = email.utils.formatdate(NOW + 20, usegmt=True)
    assert parse_retry_after(date, NOW) == pytest.approx(20.0)
    assert parse_retry_after(email.utils.formatdate(NOW - 20, usegmt=True), NOW) == 0.0
    for bad in ("", "-5", "soon", "5 seconds", "nan", "inf", "1e400", "Fri, 99 Foo 2027"):
        assert parse_retry_after(bad, NOW) is None


def test_numbers_are_finite_and_non_negative() -> None:
    assert parse_number("500") == 500.0
    for bad in ("-1", "1e999", "nan", "0x10", "", "1,000", "9" * 100):
        assert parse_number(bad) is None


def test_openai_headers() -> None:
    info = parse_rate_limit_headers(
        {
            "x-ratelimit-limit-requests": "500",
            "x-ratelimit-remaining-requests": "499",
            "x-ratelimit-reset-requests": "120ms",
            "x-ratelimit-limit-tokens": "90000",
            "x-ratelimit-remaining-tokens": "0",
            "x-ratelimit-reset-tokens": "6m0s",
            "content-type": "application/json",
        },
        now=NOW,
    )
    assert info.quotas["requests"] == Quota(500.0, 499.0, 0.12, 60.0)
    assert info.quotas["tokens"] == Quota(90000.0, 0.0, 360.0, 60.0)
    assert info.retry_after is None
    assert info.exhausted() == {"tokens": 360.0}
    assert info.wait() == 360.0


def test_anthropic_headers() -> None:
    info = parse_rate_limit_headers(
        [
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", "2027-01-15T08:00:12Z"),
            ("anthropic-ratelimit-input-tokens-limit", "40000"),
            ("anthropic-ratelimit-input-tokens-remaining", "39000"),
            ("anthropic-ratelimit-output-tokens-limit", "8000"),
            ("Retry-After", "12"),
        ],
        now=NOW,
    )
    assert info.quotas["requests"] == Quota(50.0, 0.0, 12.0, 60.0)
    assert info.quotas["input_tokens"].remaining == 39000.0
    assert info.quotas["output_tokens"].limit == 8000.0
    assert info.retry_after == 12.0


def test_retry_after_ms_wins_over_retry_after() -> None:
    info = parse_rate_limit_headers({"Retry-After": "2", "retry-after-ms": "1500"}, now=NOW)
    assert info.retry_after == 1.5
    info = parse_rate_limit_headers({"Retry-After": "2", "retry-after-ms": "soon"}, now=NOW)
    assert info.retry_after == 2.0


def test_ietf_structured_fields() -> None:
    info = parse_rate_limit_headers(
        {
            "RateLimit-Policy": '"burst";q=100;w=60, "daily";q=1000;w=86400',
            "RateLimit": '"daily";r=0;t=3600',
        },
        now=NOW,
    )
    assert info.quotas["requests"] == Quota(1000.0, 0.0, 3600.0, 86400.0)
    info = parse_rate_limit_headers({"RateLimit-Policy": '"default";q=10;w=1'}, now=NOW)
    assert info.quotas["requests"] == Quota(10.0, None, None, 1.0)


def test_ietf_older_drafts() -> None:
    info = parse_rate_limit_headers({"RateLimit": "limit=100, remaining=5, reset=30"}, now=NOW)
    assert info.quotas["requests"] == Quota(100.0, 5.0, 30.0, None)
    info = parse_rate_limit_headers(
        {"RateLimit-Limit": "100", "RateLimit-Remaining": "0", "RateLimit-Reset": "7"}, now=NOW
    )
    assert info.quotas["requests"] == Quota(100.0, 0.0, 7.0, None)
    assert info.wait() == 7.0


@pytest.mark.parametrize(
    "headers",
    [
        {"x-ratelimit-limit-requests": "lots", "x-ratelimit-reset-requests": "-3s"},
        {"x-ratelimit-remaining-requests": "-1", "x-ratelimit-limit-widgets": "5"},
        {"anthropic-ratelimit-requests-reset": "yesterday", "anthropic-ratelimit--limit": "5"},
        {"retry-after": "\x00\x01", "retry-after-ms": "1e999"},
        {"RateLimit": '"x";r=;t=abc', "RateLimit-Policy": ';;;,,,"'},
        {"RateLimit": ",".join(['"p";r=1;t=1'] * 10_000)},
        {"x-ratelimit-reset-tokens": "9" * 100_000 + "s"},
        {"x-ratelimit-": "1", "anthropic-ratelimit-": "1"},
    ],
)
def test_malformed_headers_are_ignored(headers: dict[str, str]) -> None:
    info = parse_rate_limit_headers(headers, now=NOW)
    for q in info.quotas.values():
        for v in (q.limit, q.remaining, q.reset, q.window):
            assert v is None or v >= 0
    assert info.retry_after is None or info.retry_after >= 0


def test_huge_values_cost_bounded_work() -> None:
    hostile = {
        "x-ratelimit-reset-requests": "1s" * 5_000_000,
        "retry-after": "9" * 10_000_000,
        "RateLimit-Policy": '"a";q=1;w=1,' * 1_000_000,
        "anthropic-ratelimit-tokens-reset": "2" * 10_000_000,
    }
    t0 = time.perf_counter()
    info = parse_rate_limit_headers(hostile, now=NOW)
    assert time.perf_counter() - t0 < 2.0  # wide: bounded work, not a speed claim
    assert not info
    assert len("1s" * 5_000_000) > MAX_VALUE


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-reset-tokens",
                "anthropic-ratelimit-tokens-reset",
                "anthropic-ratelimit-requests-remaining",
                "retry-after",
                "retry-after-ms",
                "ratelimit",
                "ratelimit-policy",
                "ratelimit-reset",
            ]
        ),
        st.text(max_size=80),
    )
)
def test_any_text_parses_or_is_ignored(headers: dict[str, str]) -> None:
    info = parse_rate_limit_headers(headers, now=NOW)
    w = info.wait()
    assert w is None or w >= 0
