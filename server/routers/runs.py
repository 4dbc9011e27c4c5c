"""GET /v1/runs and GET /v1/runs/{run}: the runs of this node and one run's summary."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from starlette.concurrency import run_in_threadpool

from server.models import RunList, RunSummary
from server.node import Node
from server.routers._common import API_PREFIX, RunId, errors, get_node
from server.settings import Settings

__all__ = ["build"]


def build(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["runs"])

    @router.get("/runs", response_model=RunList, summary="Runs with a hot tier on this node")
    async def list_runs(node: Node = Depends(get_node)) -> RunList:
        return await run_in_threadpool(node.runs)

    @router.get(
        "/runs/{run}",
        response_model=RunSummary,
        responses=errors(404, 503),
        summary="A run's summary",
        description=(
            "Stages, channels with iteration ranges per tier, records, raw and stored bytes, compression "
            f"ratio, checkpoints, watermarks and gaps. Served from a cache up to {settings.summary_ttl:g} s old "
            f"(up to {settings.summary_max_stale:g} s while it refreshes); `as_of` says when it was computed; "
            "`fresh=true` recomputes it."
        ),
    )
    async def run_summary(
        run: RunId, fresh: bool = Query(False, description="recompute now"), node: Node = Depends(get_node)
    ) -> RunSummary:
        return await run_in_threadpool(node.summary, run, fresh=fresh)

    return router
