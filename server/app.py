"""The admin API application: ``create_app(settings)`` wires routers, auth, limits, errors and metrics.

Endpoints (all JSON unless said otherwise; ``/openapi.json`` has the full schema)::

    GET  /v1/health                              liveness, configuration
    GET  /v1/runs                                runs with a hot tier on this node
    GET  /v1/runs/{run}                          summary (cached a few seconds; ?fresh=true)
    GET  /v1/runs/{run}/records                  filtered, paginated listing (?channel&kind&it_lo&it_hi&micro_batch&limit&cursor)
    GET  /v1/runs/{run}/records/{key}            one record's metadata and tensor statistics
    GET  /v1/runs/{run}/records/{key}/raw        the encoded record, application/octet-stream
    GET  /v1/runs/{run}/checkpoints              checkpoints and watermarks
    POST /v1/runs/{run}/checkpoints              register a durable checkpoint          (token)
    POST /v1/runs/{run}/gc                       GC: dry run unless {"confirm": true}   (token)
    POST /v1/runs/{run}/flush                    upload the writers' sealed segments    (token)
    GET  /v1/runs/{run}/recovery-plan?failed=k   pluggable planner; 501 if it cannot be loaded
    GET  /metrics                                Prometheus

Every error is ``{"error": {"code", "message", "hint", "key", "retryable"}}`` with a 4xx status for
bad input (never a 500), 404 for what does not exist, 409 for corrupt data, 5xx only for the
object store or a bug. Handlers are plain ``def`` functions: FastAPI runs them in its thread pool,
so a slow store read never stalls the event loop, and LMDB reads never block a training process
that writes the same store.

Never: binds a socket (that is :mod:`server.serve`), or writes records.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from logstore.errors import InvalidNameError, SwiftlogError
from logstore.keys import validate_run
from server.auth import require_read
from server.errors import Problem, classify, plain_message
from server.metrics import ServerMetrics
from server.middleware import BodyLimitMiddleware, HostOriginMiddleware, MetricsMiddleware
from server.node import Node
from server.routers import checkpoints, health, maintenance, metrics, records, recovery, runs
from server.settings import Settings

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 400: "bad_request"}


def _respond(p: Problem) -> JSONResponse:
    headers = {}
    if p.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if p.retryable:
        headers["Retry-After"] = "5"
    return JSONResponse(p.body(), status_code=p.status, headers=headers)


def _validation_problem(exc: RequestValidationError) -> Problem:
    parts: list[str] = []
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ())]
        if loc[:2] == ["path", "run"]:  # say what a run id may be, in the store's own words
            try:
                validate_run(err.get("input"))
            except InvalidNameError as e:
                return Problem(422, "invalid_name", 2, plain_message(e), e.hint)
        where = ".".join(loc) or "request"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return Problem(422, "invalid_request", 2, "; ".join(parts)[:2000] or "invalid request",
                   "see /openapi.json for the expected parameters and body")  # fmt: skip


def _allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every documented method of every route template matching ``path`` (for a 405's Allow)."""
    index = getattr(app.state, "allow_index", None)
    if index is None:
        index = []
        for template, ops in app.openapi()["paths"].items():
            parts = re.split(r"(\{[^}]+\})", template)
            rx = "".join(("(.+)" if p == "{key}" else "[^/]+") if p.startswith("{") else re.escape(p) for p in parts)
            index.append((re.compile(f"^{rx}$"), {m.upper() for m in ops}))
        app.state.allow_index = index
    return sorted({m for rx, methods in index if rx.match(path) for m in methods})


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(SwiftlogError)
    async def _swiftlog(request: Request, exc: SwiftlogError) -> JSONResponse:
        p = classify(exc)
        if p.status >= 500:
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, p.status, exc)
        return _respond(p)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _respond(_validation_problem(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        msg = str(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = f"no such endpoint: {request.method} {request.url.path}"
        resp = _respond(Problem(exc.status_code, code, 2, msg, "see /openapi.json" if exc.status_code in (404, 405) else None))
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        if exc.status_code == 405:
            resp.headers["Allow"] = ", ".join(_allowed_methods(app, request.url.path)) or resp.headers.get("Allow", "")
        return resp

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return _respond(classify(exc))


def create_app(settings: Settings, *, node: Node | None = None) -> FastAPI:
    """The ASGI app over ``settings.root``. ``node`` lets a caller share an existing Node.

    The app owns the Node it creates and closes it on shutdown.
    """
    from server import __version__

    owned = node is None
    node = node or Node.from_settings(settings)
    server_metrics = ServerMetrics(node)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:
            node.close()

    app = FastAPI(
        title="swiftlog admin API",
        version=__version__,
        description=(
            "Admin REST API over one node's swiftlog log store: runs, records, raw record download for replay, "
            "checkpoints, GC, flush to the cold tier, recovery plans and metrics. Mutating endpoints need "
            "`Authorization: Bearer <token>`."
        ),
        lifespan=lifespan,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.node = node
    app.state.metrics = server_metrics
    read_deps = [Security(require_read)] if settings.reads_need_token else []
    app.include_router(health.build(settings))
    for mod in (runs, records, checkpoints, maintenance, recovery):
        app.include_router(mod.build(settings), dependencies=read_deps)
    app.include_router(metrics.build(settings))
    _install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(HostOriginMiddleware, host_names=settings.host_names)  # before anything reads the request
    app.add_middleware(MetricsMiddleware, metrics=server_metrics)  # outermost: sees every response
    return app
