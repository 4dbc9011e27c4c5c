"""GET /v1/runs/{run}/recovery-plan: the pluggable recovery planner (501 until replay/ lands)."""

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
        responses=errors(501),
        summary="Recovery plan for failed stages",
        description=f"Calls the planner `{settings.planner}`; answers 501 while it is not installed.",
    )
    async def recovery_plan(
        run: RunId,
        failed: list[Annotated[int, Field(ge=0, le=0xFFFF)]] = Query(
            ..., min_length=1, max_length=64, description="failed stage (repeat for several)"
        ),
        node: Node = Depends(get_node),
    ) -> RecoveryPlan:
        return await run_in_threadpool(node.plan, run, failed)

    return router
