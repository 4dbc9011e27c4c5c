"""The admin API application: ``create_app(settings)`` wires routers, auth, limits, errors and metrics.

Endpoints (all JSON unless said otherwise; ``/openapi.json`` has the full schema)::

    GET  /v1/health                              liveness, configuration
    GET  /v1/runs                                runs with a hot tier on this node
    GET  /v1/runs/{run}                          summary (cached a few seconds; ?fresh=true)
    GET  /v1/runs/{run}/records                  filtered, paginated listing
                                                 (?channel&kind&it_lo&it_hi&micro_batch&limit&cursor)
    GET  /v1/runs/{run}/records/{key}            one record's metadata and tensor statistics
    GET  /v1/runs/{run}/records/{key}/raw        the encoded record, application/octet-stream
    GET  /v1/runs/{run}/checkpoints              checkpoints and watermarks
    POST /v1/runs/{run}/checkpoints              register a durable checkpoint          (token)
    POST /v1/runs/{run}/gc                       GC: dry run unless {"confirm": true}   (token)
    POST /v1/runs/{run}/flush                    upload the writers' sealed segments    (token)
    GET  /v1/runs/{run}/recovery-plan?failed=k   pluggable planner; 501 if it cannot be loaded
    GET  /metrics                                Prometheus
    GET  /docs, /openapi.json                    the schema, rendered and as JSON

When reads need the token (``Settings.reads_need_token``), every endpoint needs it. Every error is
``{"error": {"code", "message", "hint", "key", "retryable"}}`` with a 4xx status for
bad input (never a 500), 404 for what does not exist, 409 for corrupt data, 5xx only for the
object store or a bug. Error bodies never name a path on the node: the store root reads ``<root>``,
a file:// cold tier ``<cold>``. Handlers are plain ``def`` functions: FastAPI runs them in its thread pool,
so a slow store read never stalls the event loop, and LMDB reads never block a training process
that writes the same store.

Never: binds a socket (that is :mod:`server.serve`), or writes records.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from logstore.errors import InvalidNameError, SwiftlogError
from logstore.keys import validate_run
from server.auth import require_read
from server.errors import Problem, classify, plain_message
from server.metrics import ServerMetrics
from server.middleware import BodyLimitMiddleware, HostOriginMiddleware, MetricsMiddleware
from server.models import ErrorResponse
from server.node import Node
from server.routers import checkpoints, health, maintenance, metrics, records, recovery, runs
from server.routers._common import DESCRIPTIONS
from server.settings import Settings

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 400: "bad_request"}


def _path_redactor(settings: Settings) -> Callable[[Problem], Problem]:
    """A function that writes the node's store root as ``<root>`` and a file:// cold tier's
    directory as ``<cold>`` in a Problem's words."""
    pairs: list[tuple[str, str]] = []
    for path, name in ((settings.root, "<root>"), (_cold_dir(settings.cold_url), "<cold>")):
        if path is not None:
            pairs += [(str(p), name) for p in {path, path.resolve()} if str(p) not in ("/", ".")]
    pairs.sort(key=lambda pair: -len(pair[0]))  # a longer path first: it may hold a shorter one

    def clean(text: str | None) -> str | None:
        if text:
            for path, name in pairs:
                text = text.replace(path, name)
        return text

    def redact(p: Problem) -> Problem:
        return dataclasses.replace(p, message=clean(p.message) or "", hint=clean(p.hint), key=clean(p.key))

    return redact


def _cold_dir(cold_url: str | None) -> Path | None:
    if cold_url is None or not cold_url.startswith("file://"):
        return None
    return Path(urlsplit(cold_url).path)


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
    return Problem(
        422,
        "invalid_request",
        2,
        "; ".join(parts)[:2000] or "invalid request",
        "see /openapi.json for the expected parameters and body",
    )


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


def _install_handlers(app: FastAPI, redact: Callable[[Problem], Problem]) -> None:
    @app.exception_handler(SwiftlogError)
    async def _swiftlog(request: Request, exc: SwiftlogError) -> JSONResponse:
        p = classify(exc)
        if p.status >= 500:
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, p.status, exc)
        return _respond(redact(p))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _respond(redact(_validation_problem(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        msg = str(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = f"no such endpoint: {request.method} {request.url.path}"
        resp = _respond(
            Problem(exc.status_code, code, 2, msg, "see /openapi.json" if exc.status_code in (404, 405) else None)
        )
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        if exc.status_code == 405:
            resp.headers["Allow"] = ", ".join(_allowed_methods(app, request.url.path)) or resp.headers.get("Allow", "")
        return resp

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return _respond(redact(classify(exc)))


_SAFE_METHODS = {"get", "head", "options"}


def _layer_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Write into ``schema`` the errors the HTTP layer gives, route by route: 421 (a foreign Host) on
    every route, 401 where the token is needed, 400 (a body that does not parse), 403, 413 and 415
    where a request may change state, and 422 in the API's own error body (FastAPI documents its own). Idempotent."""
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    if "ErrorResponse" not in components:
        defs = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(defs.pop("$defs", {}))
        components["ErrorResponse"] = defs
    for ops in schema.get("paths", {}).values():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            codes = {421}
            if op.get("security"):
                codes.add(401)
            if method not in _SAFE_METHODS:
                codes |= {400, 403, 413, 415}
            if "422" in responses:
                codes.add(422)
            for code in codes:
                content = {"application/json": {"schema": ref}}
                responses[str(code)] = {"description": DESCRIPTIONS[code], "content": content}
            op["responses"] = dict(sorted(responses.items()))
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


def _docs_router(title: str) -> APIRouter:
    """/openapi.json and /docs as routes of their own, so that they take the read dependency and have
    a route label in /metrics (FastAPI's built-in ones have neither)."""
    router = APIRouter(include_in_schema=False)

    @router.get("/openapi.json")
    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(request.app.openapi())

    @router.get("/docs")
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{title} - Swagger UI")

    return router


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
        openapi_url=None,  # served by _docs_router, behind the read dependency
        docs_url=None,
        redoc_url=None,
        generate_unique_id_function=lambda route: route.name,  # operationIds: the handlers' names
    )
    generate_schema = app.openapi
    app.openapi = lambda: _layer_errors(generate_schema())  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.node = node
    app.state.metrics = server_metrics
    read_deps = [Security(require_read)] if settings.reads_need_token else []
    for mod in (health, runs, records, checkpoints, maintenance, recovery, metrics):
        app.include_router(mod.build(settings), dependencies=read_deps)
    app.include_router(_docs_router(app.title), dependencies=read_deps)
    _install_handlers(app, _path_redactor(settings))
    app.add_middleware(records.RawDownloads, settings=settings, node=node)  # innermost: after every check below
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(HostOriginMiddleware, host_names=settings.host_names)  # before anything reads the request
    app.add_middleware(MetricsMiddleware, metrics=server_metrics)  # outermost: sees every response
    return app
