"""Checkpoints of a run: list them, register a durable one, withdraw a registration (mutating: needs the token)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Security
from starlette.concurrency import run_in_threadpool

from server.auth import require_write
from server.models import Checkpoint, CheckpointList, CheckpointRequest, UnregisterRequest, UnregisterResult
from server.node import Node
from server.routers._common import API_PREFIX, RunId, errors, get_node
from server.settings import Settings

__all__ = ["build"]


def build(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["checkpoints"])

    @router.get(
        "/runs/{run}/checkpoints",
        response_model=CheckpointList,
        responses=errors(404, 502, 503),
        summary="Checkpoints and watermarks",
    )
    async def list_checkpoints(run: RunId, node: Node = Depends(get_node)) -> CheckpointList:
        return await run_in_threadpool(node.checkpoints, run)

    @router.post(
        "/runs/{run}/checkpoints",
        response_model=Checkpoint,
        status_code=201,
        responses=errors(400, 404, 502, 503, 507),
        dependencies=[Security(require_write)],
        summary="Register a durable checkpoint",
        description=(
            "Records that the stage's checkpoint at `iteration` is durable, i.e. readable by a replacement "
            "machine. From then on, records received by that stage below `iteration` are garbage (hidden from "
            "reads at once, deleted by the next confirmed GC)."
        ),
    )
    async def register_checkpoint(run: RunId, body: CheckpointRequest, node: Node = Depends(get_node)) -> Checkpoint:
        return await run_in_threadpool(node.register_checkpoint, run, body)

    @router.post(
        "/runs/{run}/checkpoints/unregister",
        response_model=UnregisterResult,
        responses=errors(400, 404, 502, 503, 507),
        dependencies=[Security(require_write)],
        summary="Withdraw a checkpoint registration (preview unless confirmed)",
        description=(
            "Without `confirm: true`, a preview that changes nothing: the registration, every watermark with it "
            "and without it, and what a GC would delete in each case. Confirmed, the registration is withdrawn: "
            "no plan starts from it, and the stage's watermark falls back to its newest registration left. "
            "Records a GC already deleted are not brought back. 404 when it is not registered."
        ),
    )
    async def unregister_checkpoint(
        run: RunId, body: UnregisterRequest, node: Node = Depends(get_node)
    ) -> UnregisterResult:
        return await run_in_threadpool(node.unregister_checkpoint, run, body)

    return router
