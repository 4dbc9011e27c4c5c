"""``swiftlog serve``: the admin REST API over one node's store root, under uvicorn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from server.cli._common import ColdOptionOpt, ColdUrlOpt, RootOpt, fail, handle_errors, parse_cold_options
from server.planner import DEFAULT_PLANNER
from server.settings import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ENV_ALLOW_INSECURE_LOOPBACK_WRITES,
    ENV_ALLOWED_HOSTS,
    ENV_HOST,
    ENV_PLANNER,
    ENV_PORT,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TOKEN,
    Settings,
)

__all__ = ["register"]


def serve(
    root: RootOpt,
    host: Annotated[
        str, typer.Option("--host", envvar=ENV_HOST, help="address to bind; non-loopback needs --token")
    ] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", envvar=ENV_PORT, min=0, max=65535)] = DEFAULT_PORT,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar=ENV_TOKEN,
            help="bearer token for mutating endpoints (prefer the env var)",
            show_default=False,
        ),
    ] = None,
    allow_insecure_loopback_writes: Annotated[
        bool,
        typer.Option(
            "--allow-insecure-loopback-writes",
            envvar=ENV_ALLOW_INSECURE_LOOPBACK_WRITES,
            help="without a token, let loopback clients call mutating endpoints (local development only)",
        ),
    ] = False,
    require_token_for_reads: Annotated[
        bool | None,
        typer.Option(
            "--require-token-for-reads/--no-require-token-for-reads",
            help="reads need the token too (default: exactly when --host is not loopback)",
            show_default=False,
        ),
    ] = None,
    cold_url: ColdUrlOpt = None,
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
        str, typer.Option("--planner", envvar=ENV_PLANNER, help="module:function of the recovery planner")
    ] = DEFAULT_PLANNER,
    log_level: Annotated[str, typer.Option("--log-level", help="critical/error/warning/info/debug")] = "info",
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host",
            help="a name or address clients use for this server (repeat; '*.example.org', '*'); "
            f"{ENV_ALLOWED_HOSTS} takes a comma-separated list (--host, this machine's name and loopback names always are)",
            show_default=False,
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", envvar=ENV_TLS_CERT, help="PEM certificate chain: serve https", show_default=False),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option("--tls-key", envvar=ENV_TLS_KEY, help="PEM private key of --tls-cert", show_default=False),
    ] = None,
    max_header_bytes: Annotated[int, typer.Option("--max-header-bytes", help="largest request line plus headers")] = 32
    * 1024,
    request_read_timeout: Annotated[
        float, typer.Option("--request-read-timeout", help="seconds a request may take to arrive whole")
    ] = 10.0,
    max_connections: Annotated[int, typer.Option("--max-connections", help="open connections; one more gets 503")] = 64,
) -> None:
    """Serve the admin REST API (see /docs and /openapi.json). Binds 127.0.0.1 unless told otherwise."""
    if not root.is_dir():
        raise fail(
            f"store root {str(root)!r} does not exist",
            hint="create it or point --root at the node's store root",
            code=3,
        )
    with handle_errors():
        settings = Settings.build(
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
            allowed_hosts=_allowed_hosts(allowed_host),
            tls_certfile=tls_cert,
            tls_keyfile=tls_key,
            max_header_bytes=max_header_bytes,
            request_read_timeout=request_read_timeout,
            max_connections=max_connections,
        )
        from server.serve import serve as run_server

        try:
            run_server(settings)
        except OSError as e:
            raise fail(f"cannot serve on {host}:{port}: {e}", hint="pick another --port", code=4) from None


def _allowed_hosts(flags: list[str] | None) -> tuple[str, ...]:
    """--allowed-host values, else the environment's comma-separated list."""
    if flags:
        return tuple(flags)
    return tuple(os.environ.get(ENV_ALLOWED_HOSTS, "").split(","))


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
