"""Recovery planning: GET /v1/runs/{run}/recovery-plan (the pluggable recovery planner, 501 when it
cannot be loaded), GET /v1/runs/{run}/profile (the run's measured costs) and
GET /v1/runs/{run}/logging-groups (logging groups chosen from them within a storage budget)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from server.models import CostProfile, LoggingGroupPlan, RecoveryPlan
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
            [], max_length=64, description="failed stage (repeat for several; or name failed ranks)"
        ),
        rank: list[Annotated[int, Field(ge=0, le=0xFFFF)]] = Query(
            [], max_length=64, description="multi-stage schedules: a failed rank's pp position (repeat for several)"
        ),
        stages_per_rank: int | None = Query(None, ge=1, le=64, description="stages each rank holds (with rank)"),
        stage_style: Literal["loop", "v"] | None = Query(None, description="how stages are placed on ranks"),
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
                run,
                failed,
                target_iteration=target_iteration,
                bandwidth_mbps=bandwidth_mbps,
                workers=workers,
                failed_ranks=rank,
                stages_per_rank=stages_per_rank,
                stage_style=stage_style,
            )
        )

    @router.get(
        "/runs/{run}/profile",
        response_model=CostProfile,
        responses=errors(400, 404, 502, 503),
        summary="The run's measured cost profile",
        description="What `swiftlog profile` measured and saved: the logging-group planner's input.",
    )
    async def profile(run: RunId, node: Node = Depends(get_node)) -> CostProfile:
        return CostProfile(**await run_in_threadpool(node.profile, run))

    @router.get(
        "/runs/{run}/logging-groups",
        response_model=LoggingGroupPlan,
        responses=errors(400, 404, 502, 503),
        summary="Logging groups chosen from the run's profile within a storage budget",
        description="Exactly one budget: `budget_bytes`, `budget_fraction` (of logging every boundary) or "
        "`disk_fraction` with `disk_bytes`. 400 names the storage the cheapest grouping needs when none fits.",
    )
    async def logging_groups(
        run: RunId,
        budget_bytes: float | None = Query(None, ge=0, le=1e18, allow_inf_nan=False, description="bytes per interval"),
        budget_fraction: float | None = Query(None, ge=0, le=1e3, allow_inf_nan=False),
        disk_fraction: float | None = Query(None, gt=0, le=1, allow_inf_nan=False),
        disk_bytes: float | None = Query(None, gt=0, le=1e18, allow_inf_nan=False),
        failures_per_domain_hour: float | None = Query(None, gt=0, le=1e6, allow_inf_nan=False),
        recovery: Literal["kill", "in_place"] = Query("kill"),
        max_recovery_s: float | None = Query(None, gt=0, le=1e9, allow_inf_nan=False),
        node: Node = Depends(get_node),
    ) -> LoggingGroupPlan:
        options = {
            "budget_bytes": budget_bytes,
            "budget_fraction": budget_fraction,
            "disk_fraction": disk_fraction,
            "disk_bytes": disk_bytes,
            "failures_per_domain_hour": failures_per_domain_hour,
            "max_recovery_s": max_recovery_s,
        }
        chosen = {k: v for k, v in options.items() if v is not None}
        return LoggingGroupPlan(**await run_in_threadpool(lambda: node.plan_groups(run, recovery=recovery, **chosen)))

    return router
