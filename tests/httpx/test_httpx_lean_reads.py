"""The leaner reads give the answers of the plain ones: a body's usage is what a full
parse finds, whatever the usage object holds; a remaining count says exhausted exactly
when the plain rule does."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from ratequeue.httpx import usage_from_json
from ratequeue.httpx._record import json_usage
from ratequeue.httpx._wire import scan_response

VALUES = st.sampled_from([None, -1, 0, 5, 10**12, True, 1.5, "3", [], {}])
USAGE = st.dictionaries(
    st.sampled_from(
        [
            "prompt_tokens",
            "completion_tokens",
            "input_tokens",
            "output_tokens",
            "cache_read_input_tokens",
            "total_tokens",
        ]
    ),
    VALUES,
    max_size=6,
)


@settings(max_examples=400, deadline=None)
@given(USAGE, st.booleans(), st.booleans())
def test_usage_read_is_the_full_parse_for_any_usage_object(
    usage: dict[str, Any], nested: bool, compact: bool
) -> None:
    body: dict[str, Any] = {"id": "c", "choices": [{"message": {"content": "ok"}}]}
    if nested:
        body["response"] = {"usage": usage}
    else:
        body["usage"] = usage
    seps = (",", ":") if compact else (", ", ": ")
    data = json.dumps(body, separators=seps).encode()
    assert json_usage(data) == usage_from_json(json.loads(data))


def plain_rule(v: bytes) -> bool:
    s = v.strip()
    return s == b"0" or s.startswith((b"0.", b"-"))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=6) | st.sampled_from([b"0", b" 0", b"0.0", b"-1", b"10", b"", b" "]))
def test_a_remaining_count_is_exhausted_as_the_plain_rule_says(v: bytes) -> None:
    pairs = [
        (b"Content-Type", b"content-type", b"application/json"),
        (b"x-ratelimit-remaining-tokens", b"x-ratelimit-remaining-tokens", v),
    ]
    assert scan_response(pairs) == (b"application/json", plain_rule(v))
