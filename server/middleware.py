"""ASGI middleware of the admin server: request-size bound and request metrics.

Both are plain ASGI (no BaseHTTPMiddleware): they never buffer a response body, so record
downloads stream through untouched.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import Problem

__all__ = ["BodyLimitMiddleware", "MetricsMiddleware"]


async def _send_problem(send: Send, problem: Problem) -> None:
    body = json.dumps(problem.body()).encode()
    await send({"type": "http.response.start", "status": problem.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


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
        return Problem(413, "payload_too_large", 2, f"request body exceeds {self.max_bytes} bytes",
                       "request bodies of this API are small JSON documents")  # fmt: skip

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
        if has_body and scope.get("method") in ("POST", "PUT", "PATCH") and not (mime == b"application/json" or mime.endswith(b"+json")):
            got = content_type.decode("latin-1")[:100] or "none"
            await _send_problem(send, Problem(415, "unsupported_media_type", 2, f"the request body must be JSON, sent as Content-Type: application/json (got {got!r})",
                                              "e.g. curl -H 'Content-Type: application/json' -d '{\"confirm\": true}' ..."))  # fmt: skip
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
