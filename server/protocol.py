"""The HTTP/1.1 protocol of the admin server: uvicorn's httptools protocol, with bounds on what a client
can make the server hold.

The server runs on training nodes. uvicorn's httptools protocol keeps every header a client sends
until the header block ends, and it has no deadline for reading a request, so one client could grow
the server's memory (and push the OOM killer onto a trainer) before the app sees the request. This
protocol adds three bounds, each answered with a JSON error body and ``Connection: close``:

1. The request head (request line and headers) may hold at most ``max_head_bytes``. Past that the
   request is refused with 431 and the connection is closed. The head is counted as it arrives,
   so one long header line is caught too.
2. A request must arrive whole (head and body) within ``read_timeout`` seconds. The clock starts at
   its first byte, or when the connection opens for its first request. Past it the server answers
   408 (or only closes, when nothing of a request came) and closes the connection.
3. At most ``max_connections`` connections are open. One more is answered 503 and closed at once.

httptools and not h11: h11 bounds the head (``h11_max_incomplete_event_size``) but has no read
deadline either, and it sends record downloads slower (bench/api_bench.py's ceiling). This class
relies on uvicorn's ``HttpToolsProtocol`` internals (``parser``, ``url``, ``headers``, ``cycle``,
``pipeline``); tests/test_server_http.py holds them to that.

Never: reads a request body itself, or changes how a response is written.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from server.errors import Problem

__all__ = ["HttpLimits", "LimitedHttpToolsProtocol", "protocol_class"]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds of the HTTP layer. Sizes are bytes, durations seconds."""

    max_head_bytes: int = 32 * 1024
    read_timeout: float = 10.0
    max_connections: int = 64


class _Refusal(Exception):
    """Raised in a parser callback to stop parsing and refuse the request."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of :class:`HttpLimits` (see the module docstring).

    Build a subclass bound to limits with :func:`protocol_class`; uvicorn instantiates it per connection.
    """

    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False  # between the first byte of a request and the end of its headers
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._request_bytes = False  # a byte of the current request arrived
        self._refused = False

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                Problem(
                    503,
                    "too_many_connections",
                    2,
                    f"the server has {self.limits.max_connections} connections open",
                    "retry later, or reuse one connection for several requests",
                    retryable=True,
                )
            )
            return
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the refusal is on its way out; what still arrives is dropped
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _Refusal):
                self._refuse(e.__context__.problem)
                return
            self._bad_request()
            return
        except httptools.HttpParserError:
            self._bad_request()
            return
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no upgrade is served: the request is answered as a plain one
        if self._in_head:  # the chunk ended inside a head: all of it counts
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(self._head_problem())

    def _bad_request(self) -> None:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self._disarm_deadline()
        self.send_400_response(msg)

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._request_bytes = True, 0, True
        self._arm_deadline()

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_head_bytes:
            raise _Refusal(self._head_problem())
        self._in_head = False
        super().on_headers_complete()
        if self.pipeline:  # queued behind a response in progress: reading is paused until its turn
            self._disarm_deadline()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._request_bytes = False
        self._disarm_deadline()

    # ------------------------------------------------------------------ bounds
    def _head_problem(self) -> Problem:
        return Problem(
            431,
            "request_header_fields_too_large",
            2,
            f"the request line and headers exceed {self.limits.max_head_bytes} bytes",
            "requests of this API need a few short headers",
        )

    def _arm_deadline(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.limits.read_timeout, self._on_deadline)

    def _disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._refused:
            return
        if not self._request_bytes:  # an idle connection: nothing to answer
            self._refused = True
            self.transport.close()
            return
        self._refuse(
            Problem(
                408,
                "request_timeout",
                2,
                f"the request did not arrive whole within {self.limits.read_timeout:g} s",
                "send the request at once",
                retryable=True,
            )
        )

    def _refuse(self, problem: Problem) -> None:
        """Answer ``problem`` and close the connection; the request (if any) never reaches the app.
        A response already under way is cut short instead (an answer written into it would corrupt it)."""
        self._refused = True
        self._disarm_deadline()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # an app task waiting for the body sees a disconnect
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        body = json.dumps(problem.body()).encode()
        head = [
            STATUS_LINE[problem.status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
        ]
        if problem.retryable:
            head.append(b"retry-after: 5\r\n")
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self.transport.close()


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """A :class:`LimitedHttpToolsProtocol` bound to ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
