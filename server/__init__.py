"""server: the admin REST API and the ``swiftlog`` CLI over one node's log store.

Public API::

    from server import Settings, create_app, Node, serve

``create_app(settings)`` builds the FastAPI app (see :mod:`server.app` for the endpoints);
``Node`` is what both the API and the CLI call; ``serve(settings)`` runs the app under uvicorn.
Names are imported on first use, so the CLI does not pay for FastAPI unless it serves.
Must never be imported by logstore/, trainer_client/ or replay/ (it sits at the top).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Settings", "create_app", "Node", "serve", "__version__"]

_LAZY = {"Settings": "server.settings", "create_app": "server.app", "Node": "server.node", "serve": "server.serve"}

if TYPE_CHECKING:
    from server.app import create_app
    from server.node import Node
    from server.serve import serve
    from server.settings import Settings


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
