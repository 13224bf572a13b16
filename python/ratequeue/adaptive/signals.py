"""Backend gauges: a bounded Prometheus text parser and a scraper that reads at an interval.

An inference engine exports its load in the Prometheus text format (vLLM:
``vllm:num_requests_waiting``, ``vllm:gpu_cache_usage_perc``; TGI: ``tgi_queue_size``).
:func:`parse_prometheus_text` reads that format within fixed bounds (bytes, lines,
line length, samples): whatever a remote endpoint sends, memory and time stay bounded,
and a malformed line is counted and skipped, never fatal. :class:`PrometheusGauges`
scrapes an endpoint at most once per interval and maps metric names onto the gauges an
:class:`~ratequeue.adaptive.Adaptive` reads (``queue_depth``, ``kv_cache``, ...).
"""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "MAX_BYTES",
    "PrometheusGauges",
    "PrometheusText",
    "Sample",
    "parse_prometheus_text",
]

#: Default bound on a scraped body (bytes).
MAX_BYTES = 4 << 20
_MAX_LINE = 16 << 10
_MAX_LABELS = 64


@dataclass(frozen=True)
class Sample:
    """One sample line: metric name, labels and value."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass
class PrometheusText:
    """What was parsed: the samples kept, and how many lines were malformed or dropped."""

    samples: list[Sample] = field(default_factory=list)
    malformed: int = 0
    dropped: int = 0

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """The sum of ``name``'s samples whose labels include ``labels``; None if none."""
        total, found = 0.0, False
        for s in self.samples:
            if s.name == name and (
                not labels or all(s.labels.get(k) == v for k, v in labels.items())
            ):
                total += s.value
                found = True
        return total if found else None


def _is_name(text: str, colon: bool) -> bool:
    extra = "_:" if colon else "_"
    if not text or text[0].isdigit():
        return False
    return all(c.isascii() and (c.isalnum() or c in extra) for c in text)


def _value(text: str) -> float:
    t = text.strip()
    low = t.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    if not t or any(c not in "0123456789+-.eE" for c in t):
        raise ValueError(text)
    return float(t)


def _labels(body: str) -> dict[str, str] | None:
    """``a="x",b="y"`` (escapes ``\\\\``, ``\\"``, ``\\n``); None when malformed."""
    out: dict[str, str] = {}
    i, n = 0, len(body)
    while i < n:
        while i < n and body[i] in " ,":
            i += 1
        if i >= n:
            break
        eq = body.find("=", i)
        if eq < 0:
            return None
        key = body[i:eq].strip()
        if not _is_name(key, colon=False):
            return None
        i = eq + 1
        while i < n and body[i] == " ":
            i += 1
        if i >= n or body[i] != '"':
            return None
        i += 1
        chars: list[str] = []
        while True:
            if i >= n:
                return None
            c = body[i]
            if c == "\\":
                if i + 1 >= n:
                    return None
                nxt = body[i + 1]
                chars.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
                i += 2
                continue
            if c == '"':
                i += 1
                break
            chars.append(c)
            i += 1
        if len(out) >= _MAX_LABELS:
            return None
        out[key] = "".join(chars)
        while i < n and body[i] == " ":
            i += 1
        if i < n and body[i] != ",":
            return None
    return out


def _sample(line: str) -> Sample | None:
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        name = line[:brace].strip()
        labels = _labels(line[brace + 1 : close])
        if labels is None:
            return None
        rest = line[close + 1 :].split()
    else:
        parts = line.split()
        if not parts:
            return None
        name, labels, rest = parts[0], {}, parts[1:]
    if not _is_name(name, colon=True) or len(rest) not in (1, 2):
        return None
    try:
        value = _value(rest[0])
        if len(rest) == 2:
            int(rest[1])  # a timestamp in milliseconds
    except ValueError:
        return None
    return Sample(name, labels, value)


def parse_prometheus_text(
    text: str | bytes,
    *,
    names: Iterable[str] | None = None,
    max_bytes: int = MAX_BYTES,
    max_samples: int = 100_000,
    max_line: int = _MAX_LINE,
) -> PrometheusText:
    """Parse the Prometheus text exposition format (0.0.4), within bounds.

    Input longer than ``max_bytes`` is a ValueError (nothing parsed); lines longer than
    ``max_line`` characters and lines that do not parse are counted in ``malformed`` and
    skipped; ``names`` keeps only those metrics; past ``max_samples`` kept samples the
    rest are counted in ``dropped``. Comments (``# HELP``, ``# TYPE``) are skipped.
    """
    if isinstance(text, (bytes, bytearray)):
        if len(text) > max_bytes:
            raise ValueError(f"metrics text of {len(text)} bytes exceeds max_bytes={max_bytes}")
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
    elif len(text) > max_bytes:
        raise ValueError(f"metrics text of {len(text)} characters exceeds max_bytes={max_bytes}")
    wanted = None if names is None else frozenset(names)
    out = PrometheusText()
    for raw in text.split("\n"):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) > max_line:
            out.malformed += 1
            continue
        if wanted is not None:
            head = line.split("{", 1)[0].split(None, 1)[0]
            if head not in wanted:
                continue
        s = _sample(line)
        if s is None:
            out.malformed += 1
        elif len(out.samples) >= max_samples:
            out.dropped += 1
        else:
            out.samples.append(s)
    return out


Fetch = Callable[[str, float, int], bytes]


def _http_get(url: str, timeout: float, max_bytes: int) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body: bytes = resp.read(max_bytes + 1)
    if len(body) > max_bytes:
        raise ValueError(f"{url}: body exceeds max_bytes={max_bytes}")
    return body


class PrometheusGauges:
    """Backend gauges read from a Prometheus text endpoint, at most once per ``interval``.

    ``metrics`` maps a gauge name (``queue_depth``, ``queue_capacity``, ``kv_cache``,
    ...) to a metric name, or to ``(metric name, {label: value})``; the value is the sum
    of the matching samples. Calling the object returns the latest readings, scraping
    first when the last scrape is ``interval`` seconds old; a failed scrape (network,
    timeout, too large) is counted in ``errors`` and leaves no stale reading behind once
    ``max_age`` seconds have passed since the last good one. ``constants`` are added to
    every reading (e.g. the backend's ``queue_capacity``).
    """

    def __init__(
        self,
        url: str,
        metrics: Mapping[str, str | tuple[str, Mapping[str, str]]],
        *,
        interval: float = 5.0,
        timeout: float = 2.0,
        max_bytes: int = MAX_BYTES,
        max_age: float | None = None,
        constants: Mapping[str, float] | None = None,
        fetch: Fetch | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url={url!r} must be an http(s) URL")
        if not metrics:
            raise ValueError("metrics: name at least one gauge")
        self.url = url
        self.metrics: dict[str, tuple[str, dict[str, str]]] = {}
        for gauge, spec in metrics.items():
            metric, labels = (spec, {}) if isinstance(spec, str) else (spec[0], dict(spec[1]))
            if not _is_name(metric, colon=True):
                raise ValueError(f"metrics[{gauge!r}]: {metric!r} is not a metric name")
            self.metrics[gauge] = (metric, labels)
        for name, v in (("interval", interval), ("timeout", timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}={v!r} must be a number > 0")
            if not math.isfinite(v):
                raise ValueError(f"{name}={v!r} must be finite")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes!r} must be an integer >= 1")
        self.interval = float(interval)
        self.timeout = float(timeout)
        self.max_bytes = max_bytes
        self.max_age = 3.0 * self.interval if max_age is None else float(max_age)
        self.constants = {k: float(v) for k, v in (constants or {}).items()}
        self._fetch: Fetch = fetch if fetch is not None else _http_get
        self._clock = clock
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._last_try = -math.inf
        self._last_ok = -math.inf
        self.scrapes = 0
        self.errors = 0
        self.malformed = 0
        self.last_error: str | None = None

    def scrape(self) -> dict[str, float]:
        """Read the endpoint now; returns the readings (raises on failure)."""
        body = self._fetch(self.url, self.timeout, self.max_bytes)
        parsed = parse_prometheus_text(
            body,
            names={m for m, _ in self.metrics.values()},
            max_bytes=self.max_bytes,
        )
        values = dict(self.constants)
        for gauge, (metric, labels) in self.metrics.items():
            v = parsed.value(metric, labels)
            if v is not None and math.isfinite(v):
                values[gauge] = v
        with self._lock:
            self.malformed += parsed.malformed
        return values

    def __call__(self) -> dict[str, float]:
        """The latest readings, scraping first when they are ``interval`` old."""
        now = self._clock()
        with self._lock:
            due = now - self._last_try >= self.interval
            if due:
                self._last_try = now
        if due:
            try:
                values = self.scrape()
            except Exception as e:  # network, timeout, oversize: counted, never raised
                with self._lock:
                    self.errors += 1
                    self.last_error = f"{type(e).__name__}: {e}"
            else:
                with self._lock:
                    self.scrapes += 1
                    self._values = values
                    self._last_ok = now
        with self._lock:
            if now - self._last_ok > self.max_age:
                return {}
            return dict(self._values)
