"""GET /metrics: Prometheus exposition (unversioned, where scrapers look)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from server.metrics import CONTENT_TYPE
from server.settings import Settings

__all__ = ["build"]


def build(settings: Settings) -> APIRouter:
    router = APIRouter(tags=["metrics"])

    @router.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text format",
                "content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
            }
        },
        summary="Prometheus metrics",
    )
    async def metrics(request: Request) -> Response:
        return Response(content=await run_in_threadpool(request.app.state.metrics.render), media_type=CONTENT_TYPE)

    return router
