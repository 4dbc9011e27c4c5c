"""Run the admin API under uvicorn, after the bind rules of :mod:`server.settings` have passed.

uvicorn runs the HTTP protocol of :mod:`server.protocol` (httptools with a bound on the request head,
a read deadline and a bound on open connections), on TLS when a certificate is given.
:func:`uvicorn_config` is that configuration, shared with the benchmark's bare app.

Never: binds a non-loopback address without a token (checked here again, right before binding,
whatever built the settings).
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import uvicorn

from logstore import segmap
from logstore.errors import ConfigError
from server.app import create_app
from server.protocol import HttpLimits, protocol_class
from server.settings import ENV_TLS_CERT, ENV_TOKEN, Settings, is_loopback

__all__ = ["serve", "uvicorn_config"]

logger = logging.getLogger(__name__)


def uvicorn_config(app: Any, settings: Settings) -> uvicorn.Config:
    """The uvicorn configuration ``swiftlog serve`` runs ``app`` with (loaded: the TLS files are read).

    Raises ConfigError naming a certificate or key that cannot be used."""
    limits = HttpLimits(
        max_head_bytes=settings.max_header_bytes,
        read_timeout=settings.request_read_timeout,
        max_connections=settings.max_connections,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol_class(limits),
        ws="none",
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        server_header=False,
        timeout_graceful_shutdown=10,
        proxy_headers=False,  # client addresses come from the socket, never from headers
        ssl_certfile=settings.tls_certfile,
        ssl_keyfile=settings.tls_keyfile,
    )
    try:
        config.load()
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"cannot use the TLS certificate {str(settings.tls_certfile)!r} / key {str(settings.tls_keyfile)!r}: {e}",
            hint="give a PEM certificate chain and its private key (--tls-cert, --tls-key)",
        ) from None
    return config


def serve(settings: Settings) -> None:
    """Serve until interrupted (SIGINT/SIGTERM shut down gracefully). Raises ConfigError, or
    OSError when the address cannot be bound."""
    if not is_loopback(settings.host) and settings.token is None:
        raise ConfigError(
            f"refusing to serve on non-loopback address {settings.host!r} without a token",
            hint=f"set {ENV_TOKEN} or pass --token, or bind 127.0.0.1",
        )
    if not is_loopback(settings.host) and settings.tls_certfile is None:
        logger.warning(
            "serving %s without TLS: the token crosses the network in clear (clients refuse to send it); "
            "pass --tls-cert/--tls-key (or %s)",
            settings.host,
            ENV_TLS_CERT,
        )
    server = uvicorn.Server(uvicorn_config(create_app(settings), settings))
    segmap.install()  # downloads send from maps of sealed segment files: nothing copied on the way
    try:
        server.run()
    finally:
        segmap.uninstall()
    if not server.started:
        raise OSError(f"could not start the server on {settings.host}:{settings.port} (address in use?)")
