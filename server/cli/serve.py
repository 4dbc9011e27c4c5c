"""``swiftlog serve``: the admin REST API over one node's store root, under uvicorn.

A flag beats its environment variable, which beats the default: :meth:`Settings.from_env` reads the
``SWIFTLOG_*`` variables (every flag here that has one defaults to None, "not given").
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from server.cli._common import ColdOptionOpt, cold_url_param, fail, handle_errors, parse_cold_options
from server.errors import EXIT_NOT_FOUND, EXIT_UNAVAILABLE
from server.planner import DEFAULT_PLANNER
from server.settings import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ENV_ALLOW_INSECURE_LOOPBACK_WRITES,
    ENV_ALLOWED_HOSTS,
    ENV_COLD_URL,
    ENV_HOST,
    ENV_PLANNER,
    ENV_PORT,
    ENV_ROOT,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TOKEN,
    Settings,
)

__all__ = ["register"]


def serve(
    root: Annotated[
        Path | None, typer.Option("--root", help=f"the node's store root (env {ENV_ROOT})", show_default=False)
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            help=f"address to bind; non-loopback needs --token (env {ENV_HOST})",
            show_default=DEFAULT_HOST,
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option("--port", min=0, max=65535, help=f"env {ENV_PORT}", show_default=str(DEFAULT_PORT)),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help=f"bearer token for mutating endpoints (prefer the env var {ENV_TOKEN})",
            show_default=False,
        ),
    ] = None,
    allow_insecure_loopback_writes: Annotated[
        bool | None,
        typer.Option(
            "--allow-insecure-loopback-writes",
            help="without a token, let loopback clients call mutating endpoints (local development only; "
            f"env {ENV_ALLOW_INSECURE_LOOPBACK_WRITES})",
            show_default=False,
        ),
    ] = None,
    require_token_for_reads: Annotated[
        bool | None,
        typer.Option(
            "--require-token-for-reads/--no-require-token-for-reads",
            help="reads need the token too (default: exactly when --host is not loopback)",
            show_default=False,
        ),
    ] = None,
    cold_url: Annotated[
        str | None,
        typer.Option(
            "--cold-url",
            callback=cold_url_param,
            help=f"cold tier: file:///dir or s3://bucket/prefix (env {ENV_COLD_URL})",
            show_default=False,
        ),
    ] = None,
    cold_option: ColdOptionOpt = None,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="largest request body")] = 64 * 1024,
    page_size: Annotated[int, typer.Option("--page-size", help="default records per page")] = 100,
    max_page_size: Annotated[int, typer.Option("--max-page-size", help="largest records page")] = 1000,
    summary_ttl: Annotated[
        float, typer.Option("--summary-ttl", help="seconds a run summary is served from cache")
    ] = 2.0,
    cold_refresh_interval: Annotated[
        float, typer.Option("--cold-refresh-interval", help="seconds between background cold-tier listings")
    ] = 3.0,
    planner: Annotated[
        str | None,
        typer.Option(
            "--planner",
            help=f"module:function of the recovery planner (env {ENV_PLANNER})",
            show_default=DEFAULT_PLANNER,
        ),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="critical/error/warning/info/debug")] = "info",
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host",
            help="a name or address clients use for this server (repeat; '*.example.org', '*'); "
            f"{ENV_ALLOWED_HOSTS} takes a comma-separated list "
            "(--host, this machine's name and loopback names always are)",
            show_default=False,
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", help=f"PEM certificate chain: serve https (env {ENV_TLS_CERT})", show_default=False),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option("--tls-key", help=f"PEM private key of --tls-cert (env {ENV_TLS_KEY})", show_default=False),
    ] = None,
    max_header_bytes: Annotated[int, typer.Option("--max-header-bytes", help="largest request line plus headers")] = 32
    * 1024,
    request_read_timeout: Annotated[
        float, typer.Option("--request-read-timeout", help="seconds a request may take to arrive whole")
    ] = 10.0,
    max_connections: Annotated[int, typer.Option("--max-connections", help="open connections; one more gets 503")] = 64,
) -> None:
    """Serve the admin REST API (see /docs and /openapi.json). Binds 127.0.0.1 unless told otherwise."""
    with handle_errors():
        settings = Settings.from_env(
            root=root,
            host=host,
            port=port,
            token=token,
            allow_insecure_loopback_writes=allow_insecure_loopback_writes,
            require_token_for_reads=require_token_for_reads,
            cold_url=cold_url,
            cold_options=parse_cold_options(cold_option),
            max_body_bytes=max_body_bytes,
            default_page_size=page_size,
            max_page_size=max_page_size,
            summary_ttl=summary_ttl,
            cold_refresh_interval=cold_refresh_interval,
            planner=planner,
            log_level=log_level,
            allowed_hosts=tuple(allowed_host) if allowed_host else None,
            tls_certfile=tls_cert,
            tls_keyfile=tls_key,
            max_header_bytes=max_header_bytes,
            request_read_timeout=request_read_timeout,
            max_connections=max_connections,
        )
    if not settings.root.is_dir():
        raise fail(
            f"store root {str(settings.root)!r} does not exist",
            hint="create it or point --root at the node's store root",
            code=EXIT_NOT_FOUND,
        )
    with handle_errors():
        from server.serve import serve as run_server

        try:
            run_server(settings)
        except OSError as e:
            raise fail(
                f"cannot serve on {settings.host}:{settings.port}: {e}",
                hint="pick another --port",
                code=EXIT_UNAVAILABLE,
            ) from None


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
