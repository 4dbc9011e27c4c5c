"""ASGI middleware of the admin server: Host and Origin checks, request-size bound, request metrics.

All are plain ASGI (no BaseHTTPMiddleware): they never buffer a response body, so record
downloads stream through untouched.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import Problem

__all__ = ["HostOriginMiddleware", "BodyLimitMiddleware", "MetricsMiddleware"]

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


async def _send_problem(send: Send, problem: Problem) -> None:
    body = json.dumps(problem.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": problem.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _split_host(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` of a Host header or an origin as (lower-case name without brackets or a trailing
    dot, port or None); None when it is not of that form."""
    try:
        parts = urlsplit(f"//{value}")
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if (
        not name
        or parts.username is not None
        or parts.password is not None
        or parts.path
        or parts.query
        or parts.fragment
    ):
        return None
    return name.rstrip(".").lower(), port


class HostOriginMiddleware:
    """Refuse a request whose Host header names none of ``host_names`` (421: DNS rebinding), and a
    state-changing request (any method but GET, HEAD, OPTIONS) sent from a page of another origin
    (403: CSRF).

    A name in ``host_names`` matches itself; ``*.example.org`` matches its subdomains; ``*`` matches
    any name. Another origin is an ``Origin`` header other than this request's own scheme, host and
    port, or ``Sec-Fetch-Site`` other than ``same-origin`` or ``none``. A request without either
    (curl, httpx, a replay) is not a browser's cross-site request and passes.
    """

    def __init__(self, app: ASGIApp, host_names: tuple[str, ...]) -> None:
        self.app = app
        self.any_host = "*" in host_names
        self.names = frozenset(h for h in host_names if not h.startswith("*"))
        self.suffixes = tuple(h[1:] for h in host_names if h.startswith("*."))

    def _allowed(self, name: str) -> bool:
        return self.any_host or name in self.names or name.endswith(self.suffixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            name: value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in (b"host", b"origin", b"sec-fetch-site")
        }
        host = _split_host(headers.get(b"host", ""))
        if host is None or not self._allowed(host[0]):
            got = headers.get(b"host")
            await _send_problem(
                send,
                Problem(
                    421,
                    "misdirected_request",
                    2,
                    f"this server does not answer to the host {got[:100]!r}"
                    if got
                    else "the request has no Host header",
                    "use the server's name or address; an operator adds names with --allowed-host",
                ),
            )
            return
        if scope.get("method") not in _SAFE_METHODS and not self._same_origin(scope, host, headers):
            await _send_problem(
                send,
                Problem(
                    403,
                    "cross_origin_request",
                    2,
                    "a state-changing request from a page of another origin is refused",
                    "send it from a program (curl, swiftlog), not from a web page",
                ),
            )
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _same_origin(scope: Scope, host: tuple[str, int | None], headers: dict[bytes, str]) -> bool:
        site = headers.get(b"sec-fetch-site")
        if site is not None and site.lower() not in ("same-origin", "none"):
            return False
        origin = headers.get(b"origin")
        if origin is None:
            return True
        scheme, sep, rest = origin.partition("://")
        theirs = _split_host(rest) if sep else None
        if theirs is None:  # "null" (a sandboxed page, a file) or garbage
            return False
        mine = scope.get("scheme", "http")
        default = _DEFAULT_PORTS.get(mine)
        return (
            scheme.lower() == mine
            and theirs[0] == host[0]
            and (theirs[1] or _DEFAULT_PORTS.get(scheme.lower())) == (host[1] or default)
        )


class BodyLimitMiddleware:
    """Refuse request bodies above ``max_bytes`` with a JSON 413, and bodies that are not JSON
    with a 415 (every body of this API is a JSON document; curl's ``-d`` sends a form unless told).

    A declared Content-Length above the bound is refused before the app runs; a chunked body is
    counted as it is read and the read fails with 413 once it crosses the bound.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _problem(self) -> Problem:
        return Problem(
            413,
            "payload_too_large",
            2,
            f"request body exceeds {self.max_bytes} bytes",
            "request bodies of this API are small JSON documents",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_body, content_type = False, b""
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    await _send_problem(send, Problem(400, "bad_request", 2, "invalid Content-Length header"))
                    return
                if int(value) > self.max_bytes:
                    await _send_problem(send, self._problem())
                    return
                has_body = has_body or int(value) > 0
            elif name == b"transfer-encoding":
                has_body = True
            elif name == b"content-type":
                content_type = value
        mime = content_type.split(b";")[0].strip().lower()
        if (
            has_body
            and scope.get("method") in ("POST", "PUT", "PATCH")
            and not (mime == b"application/json" or mime.endswith(b"+json"))
        ):
            got = content_type.decode("latin-1")[:100] or "none"
            await _send_problem(
                send,
                Problem(
                    415,
                    "unsupported_media_type",
                    2,
                    f"the request body must be JSON, sent as Content-Type: application/json (got {got!r})",
                    "e.g. curl -H 'Content-Type: application/json' -d '{\"confirm\": true}' ...",
                ),
            )
            return
        seen = 0
        limit = self.max_bytes

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body exceeds {limit} bytes")
            return msg

        await self.app(scope, limited, send)


class MetricsMiddleware:
    """Count requests and time them, labelled by method, route template and status.

    Unmatched paths share one ``route="unmatched"`` label so that a scan of random URLs cannot
    blow up the label set.
    """

    def __init__(self, app: ASGIApp, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            label = getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
            self.metrics.observe(scope.get("method", "?"), label, status, time.perf_counter() - start)
