"""Keeps web pages from driving a server that listens on this machine.

A page in the user's browser can send requests to `http://127.0.0.1:8000`, and can make its own
host name resolve there (DNS rebinding) to read the answers too. Three checks close that, as ASGI
middleware in front of every route:

- **Host.** The `Host` header must name localhost, an IP address, or a host name the server was
  told to accept (the one it is bound to, `allowed_hosts`). A rebinding page's requests carry
  the page's own host name, so they are refused (400 `invalid_host`). An IP address cannot be
  rebound, so any is accepted: that keeps a server bound to `0.0.0.0` reachable by its addresses.
  The port is not checked: a request reaches this server on its own port whatever the header
  says, while port forwarding legitimately makes clients name another.
- **Content type.** A page can POST cross-origin without the browser asking the server first
  only with the bodies of an HTML form (`text/plain`, form encodings, or no type at all). A POST
  whose `Content-Type` is not `application/json` is refused (415 `unsupported_media_type`), so
  such a request never reaches the engine.
- **CORS, opt-in.** With no `cors_origins`, no CORS header is ever sent, so browsers let no
  other page read an answer or send a JSON POST. Each origin listed (`http://localhost:3000`)
  gets its preflight `OPTIONS` answered and may read the answers: for browser front ends.

Refusals are OpenAI error objects, like every other error of the server.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ANY_HOST = "*"
# How long a browser may cache a preflight answer, in seconds.
PREFLIGHT_MAX_AGE = 600
_ORIGIN = re.compile(r"^https?://[^/?#@\s]+$")


def host_name(host_header: str) -> str | None:
    """The host name of a `Host` header value, lowercase, without its port or trailing dot;
    None when the value is malformed."""
    value = host_header.strip().lower()
    if value.startswith("["):  # an IPv6 address: "[::1]:8000"
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, separator, port = value.partition(":")
        rest = separator + port
    if rest and not (rest[0] == ":" and rest[1:].isdigit()):
        return None
    name = name.removesuffix(".")
    return name or None


def bound_host_names(bind_address: str) -> list[str]:
    """The host names to accept for a server listening on `bind_address`: the address itself
    when it is a name (`mybox.lan`); none for an IP address, which is accepted anyway."""
    try:
        ipaddress.ip_address(bind_address.strip("[]"))
    except ValueError:
        return [bind_address]
    return []


def _is_ip_address(name: str) -> bool:
    try:
        if name.startswith("[") and name.endswith("]"):
            ipaddress.IPv6Address(name[1:-1])
        else:
            ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return True


def normalized_origin(origin: str) -> str:
    """An origin as browsers send it in `Origin` (`http://localhost:3000`: scheme, host,
    optional port; lowercase, no path). Raises ValueError for anything else, wildcards included:
    the allow-list names each front end."""
    normal = origin.strip().lower().removesuffix("/")
    if not _ORIGIN.match(normal):
        raise ValueError(
            f"CORS origin {origin!r} is not an origin such as 'http://localhost:3000' "
            "(scheme, host and optional port; wildcards are not accepted)"
        )
    return normal


def _is_json(content_type: str | None) -> bool:
    if content_type is None:
        return False
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json"


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return JSONResponse({"error": body}, status_code=status)


class GuardPolicy:
    """What `HTTPGuard` accepts, checked when built so that a bad setting fails at start-up.

    `allowed_hosts`: host names accepted in `Host` besides localhost and IP addresses (`*`
    accepts any host, for a server behind a proxy that checks it). `cors_origins`: the origins
    whose pages may call the API."""

    def __init__(self, *, allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()):
        hosts = set()
        for host in allowed_hosts:
            name = host if host == ANY_HOST else host_name(host)
            if name is None:
                raise ValueError(f"allowed host {host!r} is not a host name")
            hosts.add(name)
        self.allowed_hosts = frozenset(hosts | {"localhost"})
        self.cors_origins = frozenset(normalized_origin(origin) for origin in cors_origins)

    def host_allowed(self, host_header: str | None) -> bool:
        if ANY_HOST in self.allowed_hosts:
            return True
        name = host_name(host_header) if host_header is not None else None
        if name is None:
            return False
        return name in self.allowed_hosts or _is_ip_address(name)


class HTTPGuard:
    """ASGI middleware applying the Host, content-type and CORS rules of this module."""

    def __init__(self, app: ASGIApp, policy: GuardPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        response = self._refusal(scope["method"], headers)
        origin = headers.get("origin", "").lower()
        cors = origin in self.policy.cors_origins
        if response is None and cors and _is_preflight(scope["method"], headers):
            response = _preflight(origin, headers)
        if response is not None:
            if cors:
                _add_cors_headers(response.headers, origin)
            await response(scope, receive, send)
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                _add_cors_headers(MutableHeaders(scope=message), origin)
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(self, method: str, headers: Headers) -> Response | None:
        host = headers.get("host")
        if not self.policy.host_allowed(host):
            shown = "missing" if host is None else repr(host[:100])
            return _error(
                400,
                f"the Host header ({shown}) is not a name this server answers to (a web page "
                "may be trying to reach it); if it should be, start the server with "
                "--allowed-host NAME",
                "invalid_host",
            )
        content_type = headers.get("content-type")
        if method == "POST" and not _is_json(content_type):
            shown = "none" if content_type is None else repr(content_type[:100])
            return _error(
                415,
                f"the body must be JSON sent with 'Content-Type: application/json' (got {shown})",
                "unsupported_media_type",
            )
        return None


def _is_preflight(method: str, headers: Headers) -> bool:
    return method == "OPTIONS" and "access-control-request-method" in headers


def _preflight(origin: str, headers: Headers) -> Response:
    allow = {
        "Access-Control-Allow-Methods": "GET, POST",
        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE),
    }
    # The origin is trusted: whatever headers its page wants to send (Authorization, the SDKs'
    # own) are allowed.
    requested = headers.get("access-control-request-headers")
    if requested:
        allow["Access-Control-Allow-Headers"] = requested
    return Response(status_code=204, headers=allow)


def _add_cors_headers(headers: MutableHeaders, origin: str) -> None:
    headers["Access-Control-Allow-Origin"] = origin
    # Let the page read Retry-After (of a 503) and any other header, not only the safelisted.
    headers["Access-Control-Expose-Headers"] = "*"
    headers.add_vary_header("Origin")
