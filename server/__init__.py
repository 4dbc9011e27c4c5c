"""server: the admin REST API and the ``swiftlog`` CLI over one node's log store.

Public API::

    from server import Settings, create_app, Node, serve

``create_app(settings)`` builds the FastAPI app (see :mod:`server.app` for the endpoints);
``Node`` is what both the API and the CLI call; ``serve(settings)`` runs the app under uvicorn.
``__version__`` is the installed distribution's (``version`` in pyproject.toml, see ``_version.py``).
Names are imported on first use, so the CLI does not pay for FastAPI unless it serves, and an
install without the ``server`` extra can still import this package.

Never: imported by logstore/, trainer_client/ or replay/ (it sits at the top).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Settings", "create_app", "Node", "serve", "__version__"]

_LAZY = {"Settings": "server.settings", "create_app": "server.app", "Node": "server.node", "serve": "server.serve"}

if TYPE_CHECKING:
    from server.app import create_app
    from server.node import Node
    from server.serve import serve
    from server.settings import Settings


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from server._version import version

        return version()
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
