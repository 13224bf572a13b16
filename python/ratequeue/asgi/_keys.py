"""Key functions: who a request counts against, read from the ASGI scope, bounded.

Every function takes the scope and returns a str key or None (no key: the request counts
against the shared anonymous key). Header values longer than ``max_length`` bytes are no
key; forwarding headers are read only from configured trusted proxies, and only their last
``max_hops`` entries.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

__all__ = [
    "KeyFunc",
    "Scope",
    "api_key",
    "bearer_subject",
    "bearer_token",
    "client_ip",
    "first_of",
    "header",
]

Scope = MutableMapping[str, Any]
KeyFunc = Callable[[Scope], str | None]

#: Longest header value read as a key (bytes).
MAX_KEY_LENGTH = 256
#: Longest bearer token decoded (bytes).
MAX_TOKEN_LENGTH = 8192

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def header_values(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of a header (lower-case name), in order."""
    return [v for k, v in scope.get("headers", ()) if k == name]


def header_value(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a header, or None."""
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v)
    return None


def _name(name: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise TypeError(f"header name must be a non-empty str, got {name!r}")
    return name.lower().encode("latin-1")


def _decode(value: bytes | None, max_length: int) -> str | None:
    if value is None or len(value) > max_length:
        return None
    s = value.decode("latin-1").strip()
    return s or None


def header(name: str, *, max_length: int = MAX_KEY_LENGTH) -> KeyFunc:
    """The value of a request header (e.g. a tenant id); None when absent or too long."""
    raw = _name(name)

    def key(scope: Scope) -> str | None:
        return _decode(header_value(scope, raw), max_length)

    key.__qualname__ = f"header({name!r})"
    return key


def api_key(name: str = "x-api-key", *, max_length: int = MAX_KEY_LENGTH) -> KeyFunc:
    """An API key header, as the key ``"apikey:<value>"``; None when absent or too long."""
    raw = _name(name)

    def key(scope: Scope) -> str | None:
        v = _decode(header_value(scope, raw), max_length)
        return None if v is None else "apikey:" + v

    return key


def _bearer(scope: Scope) -> str | None:
    v = header_value(scope, b"authorization")
    if v is None or len(v) > MAX_TOKEN_LENGTH + 7:
        return None
    scheme, _, token = v.decode("latin-1").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def bearer_token() -> KeyFunc:
    """The whole bearer token (an opaque token is its own key): ``"bearer:<token>"``."""

    def key(scope: Scope) -> str | None:
        t = _bearer(scope)
        return None if t is None else "bearer:" + t

    return key


def _unverified_claims(token: str) -> Mapping[str, Any] | None:
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1]
    try:
        data = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        claims = json.loads(data)
    except (binascii.Error, ValueError, RecursionError):  # deep nesting is no claim set
        return None
    return claims if isinstance(claims, dict) else None


def bearer_subject(
    decode: Callable[[str], Mapping[str, Any] | None] | None = None,
    *,
    claim: str = "sub",
    unverified: bool = False,
    max_length: int = MAX_KEY_LENGTH,
) -> KeyFunc:
    """The subject claim of a bearer JWT as ``"sub:<value>"``.

    ``decode(token)`` must verify the token and return its claims (or None, or raise
    ValueError). Reading the claim without verifying (``unverified=True``) lets anyone
    spend another subject's quota, so it is only for tokens a proxy in front verified.
    """
    if decode is None and not unverified:
        raise ValueError("bearer_subject needs decode= (verifying the token) or unverified=True")

    def key(scope: Scope) -> str | None:
        token = _bearer(scope)
        if token is None:
            return None
        try:
            claims = decode(token) if decode is not None else _unverified_claims(token)
        except ValueError:
            return None
        if not claims:
            return None
        sub = claims.get(claim)
        if isinstance(sub, int) and not isinstance(sub, bool):
            sub = str(sub)
        if not isinstance(sub, str) or not sub or len(sub) > max_length:
            return None
        return "sub:" + sub

    return key


def first_of(*funcs: KeyFunc) -> KeyFunc:
    """The first key any of ``funcs`` finds (e.g. API key, else client address)."""
    if not funcs:
        raise ValueError("first_of needs at least one key function")

    def key(scope: Scope) -> str | None:
        for f in funcs:
            k = f(scope)
            if k is not None:
                return k
        return None

    return key


def _parse_ip(s: str) -> _Address | None:
    s = s.strip().strip('"')
    if s.startswith("["):  # "[v6]" or "[v6]:port"
        end = s.find("]")
        s = s[1:end] if end > 0 else ""
    elif s.count(":") == 1:  # "v4:port"
        s = s.split(":", 1)[0]
    try:
        return ipaddress.ip_address(s)
    except ValueError:
        return None


def _forwarded_for(values: list[bytes]) -> list[str]:
    """The ``for=`` of each element of Forwarded (RFC 7239), in order."""
    out: list[str] = []
    for v in values:
        for element in v.decode("latin-1").split(","):
            found = ""
            for pair in element.split(";"):
                k, _, val = pair.strip().partition("=")
                if k.strip().lower() == "for":
                    found = val.strip()
            out.append(found)
    return out


def client_ip(
    trusted_proxies: Iterable[str] = (),
    *,
    header: str = "x-forwarded-for",
    max_hops: int = 8,
    ipv6_prefix: int = 64,
    max_header_bytes: int = 4096,
) -> KeyFunc:
    """The client's address as ``"ip:<address>"``.

    The peer address, unless the peer is a trusted proxy (an address or network in
    ``trusted_proxies``): then the forwarding header (``x-forwarded-for`` or
    ``forwarded``) is read from the right, skipping trusted proxies, at most ``max_hops``
    entries; the first untrusted address is the client. A header longer than
    ``max_header_bytes`` or an unparsable entry stops the walk at the last trusted hop.
    IPv6 clients are keyed by their ``/ipv6_prefix`` network (a host owns a /64).
    """
    nets: list[_Network] = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies]
    hname = _name(header)
    if hname not in (b"x-forwarded-for", b"forwarded"):
        raise ValueError(f"header={header!r} must be 'x-forwarded-for' or 'forwarded'")
    if not 1 <= max_hops <= 64:
        raise ValueError(f"max_hops={max_hops!r} must be from 1 to 64")
    if not 0 <= ipv6_prefix <= 128:
        raise ValueError(f"ipv6_prefix={ipv6_prefix!r} must be from 0 to 128")

    def trusted(a: _Address) -> bool:
        return any(a in n for n in nets)

    def render(a: _Address) -> str:
        if isinstance(a, ipaddress.IPv6Address):
            if a.ipv4_mapped is not None:
                return "ip:" + str(a.ipv4_mapped)
            if ipv6_prefix < 128:
                net = ipaddress.IPv6Network((a, ipv6_prefix), strict=False)
                return "ip:" + str(net)
        return "ip:" + str(a)

    def key(scope: Scope) -> str | None:
        client = scope.get("client")
        if not client:
            return None
        host = str(client[0])
        if not nets and ":" not in host:
            return "ip:" + host[:MAX_KEY_LENGTH]  # the server's own IPv4 peer address
        peer = _parse_ip(host)
        if peer is None:
            return "ip:" + host[:MAX_KEY_LENGTH]
        if not nets or not trusted(peer):
            return render(peer)
        values = header_values(scope, hname)
        if not values or sum(len(v) for v in values) > max_header_bytes:
            return render(peer)
        if hname == b"forwarded":
            hops = _forwarded_for(values)
        else:
            hops = [h for v in values for h in v.decode("latin-1").split(",")]
        last = peer
        for hop in reversed(hops[-max_hops:]):
            a = _parse_ip(hop)
            if a is None:
                break
            if not trusted(a):
                return render(a)
            last = a
        return render(last)

    return key
