"""Routers of the admin API, one module per resource; each exposes ``build(settings) -> APIRouter``."""

from server.routers import checkpoints, health, maintenance, metrics, records, recovery, runs

__all__ = ["health", "runs", "records", "checkpoints", "maintenance", "recovery", "metrics"]
