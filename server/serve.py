"""Run the admin API under uvicorn, after the bind rules of :mod:`server.settings` have passed.

Never binds a non-loopback address without a token (checked here again, right before binding,
whatever built the settings).
"""

from __future__ import annotations

import logging

import uvicorn

from logstore.errors import ConfigError
from server.app import create_app
from server.settings import ENV_TOKEN, Settings, is_loopback

__all__ = ["serve"]

logger = logging.getLogger(__name__)


def serve(settings: Settings) -> None:
    """Serve until interrupted (SIGINT/SIGTERM shut down gracefully). Raises ConfigError, or
    OSError when the address cannot be bound."""
    if not is_loopback(settings.host) and settings.token is None:
        raise ConfigError(
            f"refusing to serve on non-loopback address {settings.host!r} without a token",
            hint=f"set {ENV_TOKEN} or pass --token, or bind 127.0.0.1",
        )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        server_header=False,
        timeout_graceful_shutdown=10,
        proxy_headers=False,  # client addresses come from the socket, never from headers
    )
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        raise OSError(f"could not start the server on {settings.host}:{settings.port} (address in use?)")
