"""GET /v1/runs/{run}/recovery-plan: the pluggable recovery planner (501 when it cannot be loaded)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from server.models import RecoveryPlan
from server.node import Node
from server.routers._common import API_PREFIX, RunId, errors, get_node
from server.settings import Settings

__all__ = ["build"]


def build(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["recovery"])

    @router.get(
        "/runs/{run}/recovery-plan",
        response_model=RecoveryPlan,
        responses=errors(400, 404, 501, 502, 503),
        summary="Recovery plan for failed stages",
        description=f"Calls the planner `{settings.planner}`; answers 501 while it is not installed.",
    )
    async def recovery_plan(
        run: RunId,
        failed: list[Annotated[int, Field(ge=0, le=0xFFFF)]] = Query(
            ..., min_length=1, max_length=64, description="failed stage (repeat for several)"
        ),
        target_iteration: int | None = Query(
            None,
            ge=0,
            le=2**53 - 1,
            description="the iteration the survivors stand at: the replay stops before it "
            "(default: the first iteration not completely logged)",
        ),
        bandwidth_mbps: float | None = Query(
            None, ge=0.001, le=1e7, allow_inf_nan=False, description="fetch bandwidth for the time estimate, MB/s"
        ),
        workers: int | None = Query(None, ge=1, le=1024, description="parallel replay workers for the time estimate"),
        node: Node = Depends(get_node),
    ) -> RecoveryPlan:
        return await run_in_threadpool(
            lambda: node.plan(
                run, failed, target_iteration=target_iteration, bandwidth_mbps=bandwidth_mbps, workers=workers
            )
        )

    return router
