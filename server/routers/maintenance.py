"""Garbage collection and flush of a run (mutating: both need the token)."""

from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Security
from starlette.concurrency import run_in_threadpool

from server.auth import require_write
from server.models import FlushResult, GcRequest, GcResult
from server.node import Node
from server.routers._common import API_PREFIX, RunId, errors, get_node
from server.settings import Settings

__all__ = ["build"]


def build(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["maintenance"])

    @router.post(
        "/runs/{run}/gc",
        response_model=GcResult,
        responses=errors(404, 502, 503, 507),
        dependencies=[Security(require_write)],
        summary="Garbage-collect below the checkpoint watermarks (dry run unless confirmed)",
        description=(
            "Without `confirm: true` nothing is deleted: the response lists what would be. With it, every record "
            "received by a stage below that stage's newest durable checkpoint is deleted from both tiers; nothing "
            "else ever is. Stale multipart uploads are aborted."
        ),
    )
    async def gc(run: RunId, body: GcRequest | None = Body(None), node: Node = Depends(get_node)) -> GcResult:
        return await run_in_threadpool(node.gc, run, confirm=bool(body and body.confirm))

    @router.post(
        "/runs/{run}/flush",
        response_model=FlushResult,
        responses=errors(404, 409, 502, 503, 507),
        dependencies=[Security(require_write)],
        summary="Upload the node's sealed segments to the cold tier",
        description=(
            "The server is not the writer: it uploads every segment its writers have sealed but not uploaded yet "
            "(idempotent; safe while they run). Open segments stay with their writer, which seals them at the next "
            "segment boundary, on its own flush or close, or when it restarts; they are listed in `open_segments`."
        ),
    )
    async def flush(run: RunId, node: Node = Depends(get_node)) -> FlushResult:
        return await run_in_threadpool(node.flush, run)

    return router
