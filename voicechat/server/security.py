"""Who may talk to the server: the Host allow-list, the Origin check and the API key.

`SecurityMiddleware` wraps the whole ASGI app, so every route and every WebSocket upgrade
(whichever dialect handles it) is checked the same way before any handler runs:

* Host: the request's `Host` must name this server (the loopback names, the bound address,
  or a name added with `--allow-host`); otherwise HTTP 421. A web page on a foreign domain
  whose name was re-pointed at 127.0.0.1 (DNS rebinding) sends its own name as Host.
* Origin (WebSocket upgrades only): absent (non-browser clients), the page's own origin, or
  one listed with `--allow-origin`, compared after normalising scheme, host and port;
  `null` (sandboxed frames, file: pages) is refused. Otherwise HTTP 403.
* Key (WebSocket upgrades and `/metrics`): `Authorization: Bearer KEY` or the subprotocol
  `voicechat.bearer.KEY`; otherwise HTTP 401.

No web dependencies at import time beyond the standard library: `voicechat serve` validates
its flags with `check_api_key` / `check_bind` before loading anything.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import string
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
BEARER_SUBPROTOCOL = "voicechat.bearer."
# RFC 7230 `tchar`: what a Sec-WebSocket-Protocol token (the browser's way to carry the key) may hold.
TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~")
DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
# Paths whose HTTP GET needs the key when one is set (the WebSocket upgrades always do).
KEYED_HTTP_PATHS = ("/metrics",)


def check_api_key(key: str | None) -> str | None:
    """None or a usable key; a key a client could not send (or that guards nothing) raises ValueError."""
    if key is None:
        return None
    if not isinstance(key, str) or key == "":
        raise ValueError("the API key is empty; pass a non-empty --api-key (or unset VOICECHAT_API_KEY)")
    bad = sorted({c for c in key if c not in TOKEN_CHARS})
    if bad:
        shown = ", ".join(repr(c) for c in bad[:5])
        raise ValueError(
            f"the API key holds characters a browser cannot send in a WebSocket subprotocol ({shown}); "
            "use letters, digits and !#$%&'*+-.^_`|~ only (no whitespace)"
        )
    return key


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, insecure: bool) -> None:
    """Binding beyond loopback without a key is refused unless `insecure` says so."""
    if not is_loopback(host) and api_key is None and not insecure:
        raise ValueError(
            f"--host {host} makes the server reachable from other machines, and no --api-key is set: "
            "anyone there could use it. Set --api-key KEY (and --tls-cert/--tls-key), or pass --insecure"
        )


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header value -> (lower-case name, port or None); None when it is not a host[:port]."""
    value = value.strip()
    if not value or any(c in value for c in "/?#@ \t\\"):
        return None
    try:
        parts = urlsplit("//" + value)
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name:
        return None
    return name.lower().rstrip("."), port


def normalize_origin(value: str) -> tuple[str, str, int] | None:
    """An Origin ("scheme://host[:port]") -> (scheme, host, port) with the default port filled in; None when
    it is not one (including the opaque origin `null`)."""
    value = value.strip()
    if value.lower() == "null":
        return None
    try:
        parts = urlsplit(value)
        scheme, name, port = parts.scheme.lower(), parts.hostname, parts.port
    except ValueError:
        return None
    if scheme not in DEFAULT_PORTS or not name or parts.path not in ("", "/") or parts.query or parts.username:
        return None
    return scheme, name.lower().rstrip("."), port if port is not None else DEFAULT_PORTS[scheme]


def excerpt(value, limit: int = 40) -> str:
    """A short, escaped (ASCII, JSON-quoted) excerpt of client input for error messages and logs."""
    try:
        if isinstance(value, str):
            text = value
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
            return f"<an integer of {value.bit_length()} bits>"
        else:
            text = json.dumps(value, allow_nan=True)
    except Exception:  # a value json cannot show: name its type only
        return f"<{type(value).__name__}>"
    cut = text[:limit]
    shown = json.dumps(cut)
    return shown + ("..." if len(text) > limit else "")


@dataclass
class ServerSecurity:
    api_key: str | None = None
    allowed_origins: tuple = ()  # "scheme://host[:port]" strings; "*" allows any
    allowed_hosts: tuple = ()  # extra Host names (besides loopback and the bound address); "*" allows any
    bound_host: str = "127.0.0.1"

    def __post_init__(self):
        self.api_key = check_api_key(self.api_key)
        self._origins = set()
        for o in self.allowed_origins:
            if o == "*":
                continue
            n = normalize_origin(o)
            if n is None:
                raise ValueError(
                    f"--allow-origin {o!r} is not an origin; expected scheme://host[:port] "
                    "(http, https, ws or wss) or '*'"
                )
            self._origins.add(n)
        names = set(LOOPBACK_NAMES)
        if self.bound_host not in ("0.0.0.0", "::", ""):
            names.add(self.bound_host.lower().strip("[]"))
        for h in self.allowed_hosts:
            if h == "*":
                continue
            parsed = split_host(h)
            if parsed is None or parsed[1] is not None:
                raise ValueError(f"--allow-host {h!r} is not a host name; expected a name or address without a port")
            names.add(parsed[0].strip("[]"))
        self._hosts = names

    def host_ok(self, host: str | None) -> bool:
        if "*" in self.allowed_hosts:
            return True
        parsed = split_host(host or "")
        return parsed is not None and parsed[0].strip("[]") in self._hosts

    def origin_ok(self, origin: str | None, host: str | None, scheme: str = "http") -> bool:
        if origin is None:  # non-browser clients send no Origin
            return True
        if "*" in self.allowed_origins and origin.strip().lower() != "null":
            return True
        n = normalize_origin(origin)
        if n is None:
            return False
        if n in self._origins:
            return True
        # Same origin as the page this server serves: the Host the browser connected to, with the
        # port the request's scheme implies when the Host has none.
        h = split_host(host or "")
        if h is None:
            return False
        page_scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        port = h[1] if h[1] is not None else DEFAULT_PORTS.get(page_scheme, 80)
        return n == (page_scheme, h[0], port)

    def key_ok(self, headers) -> bool:
        if self.api_key is None:
            return True
        given = None
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        else:  # browsers cannot set headers on a WebSocket: the key may ride as a subprotocol
            for proto in headers.get("sec-websocket-protocol", "").split(","):
                proto = proto.strip()
                if proto.startswith(BEARER_SUBPROTOCOL):
                    given = proto[len(BEARER_SUBPROTOCOL) :]
        return bool(given) and hmac.compare_digest(given.encode(), self.api_key.encode())


class SecurityMiddleware:
    """ASGI middleware: Host on every HTTP request and upgrade; Origin and key on every upgrade; key on the
    keyed HTTP paths. Refusals are counted in `metrics.sessions_refused{reason}` (when metrics are given)."""

    def __init__(self, app, security: ServerSecurity, metrics=None):
        self.app, self.security, self.metrics = app, security, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        sec = self.security
        ws = scope["type"] == "websocket"
        if not sec.host_ok(headers.get("host")):
            return await self._refuse(
                scope,
                receive,
                send,
                421,
                "host",
                f"Host {excerpt(headers.get('host'))} is not served here (see voicechat serve --allow-host)",
            )
        if ws and not sec.origin_ok(headers.get("origin"), headers.get("host"), scope.get("scheme", "ws")):
            return await self._refuse(
                scope,
                receive,
                send,
                403,
                "origin",
                f"Origin {excerpt(headers.get('origin'))} is not allowed (see voicechat serve --allow-origin)",
            )
        if (ws or scope.get("path") in KEYED_HTTP_PATHS) and not sec.key_ok(headers):
            return await self._refuse(
                scope, receive, send, 401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer KEY'"
            )
        return await self.app(scope, receive, send)

    async def _refuse(self, scope, receive, send, status: int, reason: str, message: str) -> None:
        from starlette.responses import JSONResponse

        if self.metrics is not None and scope["type"] == "websocket":  # counts refused sessions, not page loads
            self.metrics.sessions_refused.labels(reason=reason).inc()
        body = {"type": "error", "error": {"code": reason, "message": message}}
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            # No denial-response extension: refuse the handshake (the client sees 403).
            await send({"type": "websocket.close", "code": 1008})
            return
        await JSONResponse(body, status_code=status)(scope, receive, send)
