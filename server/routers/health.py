"""GET /v1/health: liveness and what this server serves (never touches a store)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from server.models import Health
from server.node import Node
from server.routers._common import API_PREFIX, get_node
from server.settings import Settings

__all__ = ["build"]


def build(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["health"])

    @router.get("/health", response_model=Health, summary="Liveness and configuration")
    async def health(node: Node = Depends(get_node)) -> Health:
        from server import __version__

        root_exists = await run_in_threadpool(node.root.is_dir)
        return Health(
            version=__version__,
            root=str(node.root),
            root_exists=root_exists,
            cold_tier=node.cold_url is not None,
            runs=len(await run_in_threadpool(node.run_names)) if root_exists else 0,
            auth=settings.auth_mode,  # type: ignore[arg-type]
        )

    return router
