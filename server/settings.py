"""Settings of the admin server: one validated, immutable object built from flags, environment and defaults.

Which source wins: an explicit value (a ``swiftlog serve`` flag, a keyword to :meth:`Settings.from_env`)
beats the environment variable, which beats the default. Every environment variable is a named
constant below. :class:`EnvSettings` (pydantic-settings, prefix ``SWIFTLOG_``) is the one place
they are read; :meth:`Settings.from_env` puts the explicit values over them. The one-shot CLI
commands declare ``--root``, ``--cold-url`` and ``plan --planner`` with the same constants as
their environment variables, with the same precedence.

Security rules enforced here, before anything binds a socket:

- The server binds ``127.0.0.1`` by default and refuses any non-loopback ``host`` without a token.
- Mutating endpoints (every POST) need ``Authorization: Bearer <token>``. With no token configured
  they are refused (403), unless ``allow_insecure_loopback_writes`` is set, which lets loopback
  clients mutate without a token; it is refused together with a non-loopback host.
- Reading endpoints need the token too when ``require_token_for_reads`` is true; by default that
  is the case exactly when the host is not loopback. Then every endpoint needs it, ``/v1/health``,
  ``/metrics``, ``/docs`` and ``/openapi.json`` included.
- A request whose Host header names none of :attr:`Settings.host_names` is refused (DNS rebinding):
  the bound address, this machine's host name, the loopback names, and ``allowed_hosts``.
- TLS is on when ``tls_certfile`` is given; clients then reach the server over ``https://``.

Never: reads files, opens stores or touches the network; pydantic stays in this layer (the log
store's own configuration is a dataclass).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from logstore.cold import parse_cold_url
from logstore.errors import ConfigError, SwiftlogError

__all__ = [
    "Settings",
    "EnvSettings",
    "is_loopback",
    "ENV_ROOT",
    "ENV_COLD_URL",
    "ENV_COLD_OPTIONS",
    "ENV_TOKEN",
    "ENV_HOST",
    "ENV_PORT",
    "ENV_ALLOW_INSECURE_LOOPBACK_WRITES",
    "ENV_PLANNER",
    "ENV_ALLOWED_HOSTS",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "MIN_TOKEN_LENGTH",
]

ENV_PREFIX = "SWIFTLOG_"
ENV_ROOT = "SWIFTLOG_ROOT"  # the node's store root
ENV_COLD_URL = "SWIFTLOG_COLD_URL"  # file:///dir or s3://bucket/prefix
ENV_COLD_OPTIONS = "SWIFTLOG_COLD_OPTIONS"  # JSON object of fsspec storage options
ENV_TOKEN = "SWIFTLOG_TOKEN"  # bearer token for mutating endpoints
ENV_HOST = "SWIFTLOG_HOST"
ENV_PORT = "SWIFTLOG_PORT"
ENV_ALLOW_INSECURE_LOOPBACK_WRITES = "SWIFTLOG_ALLOW_INSECURE_LOOPBACK_WRITES"  # "1"/"true" to enable
ENV_PLANNER = "SWIFTLOG_PLANNER"  # "module:function" of the recovery planner
ENV_ALLOWED_HOSTS = "SWIFTLOG_ALLOWED_HOSTS"  # comma-separated host names and addresses clients may use
ENV_TLS_CERT = "SWIFTLOG_TLS_CERT"  # PEM certificate chain (may hold the key too)
ENV_TLS_KEY = "SWIFTLOG_TLS_KEY"  # PEM private key

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
MIN_TOKEN_LENGTH = 16

_TRUE = {"1", "true", "yes", "on"}
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_WILDCARDS = {"0.0.0.0", "::", ""}


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1); False for anything else,
    including names that merely resolve to loopback (never resolved: a name can change)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """``host`` as compared with Host headers: lower case, no brackets around an IPv6 address, no
    trailing dot."""
    return host.strip().strip("[]").rstrip(".").lower()


class Settings(BaseModel):
    """Everything the server needs; validated at construction, immutable afterwards.

    Sizes are bytes, durations seconds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: Path = Field(description="the node's store root (every run under it is served)")
    cold_url: str | None = Field(None, description="cold tier URL shared by the node's runs; None = hot only")
    cold_options: dict[str, Any] = Field(default_factory=dict, description="fsspec storage options of the cold tier")
    token: SecretStr | None = Field(None, description=f"bearer token (>= {MIN_TOKEN_LENGTH} characters)")
    allow_insecure_loopback_writes: bool = Field(
        False, description="with no token, let loopback clients use mutating endpoints (local development only)"
    )
    require_token_for_reads: bool | None = Field(
        None, description="reads need the token too; None = exactly when host is not loopback"
    )
    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="0 picks a free port")
    max_body_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024, description="largest accepted request body")
    default_page_size: int = Field(100, ge=1, le=100_000)
    max_page_size: int = Field(1000, ge=1, le=100_000)
    max_tensor_stats_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="records with more raw bytes get no min/max/mean/norm"
    )
    summary_ttl: float = Field(2.0, ge=0.0, le=3600.0, description="a run summary younger than this is served as is")
    summary_max_stale: float = Field(
        60.0, ge=0.0, le=86400.0, description="an older one is still served while a refresh runs, up to this age"
    )
    cold_refresh_interval: float = Field(
        3.0, ge=0.5, le=3600.0, description="seconds between background cold-tier listings of recently used runs"
    )
    max_open_runs: int = Field(
        64, ge=1, le=10_000, description="read-only stores kept open (least recently used closed)"
    )
    planner: str = Field("replay.plan:plan_recovery", description="'module:function' of the recovery planner")
    allowed_hosts: tuple[str, ...] = Field(
        (),
        description="more names and addresses clients may put in the Host header, besides the bound address, "
        "this machine's host name and the loopback names ('*.example.org' matches subdomains, '*' any name)",
    )
    tls_certfile: Path | None = Field(None, description="PEM certificate chain: serve https (the key may be in it)")
    tls_keyfile: Path | None = Field(None, description="PEM private key of tls_certfile")
    max_header_bytes: int = Field(32 * 1024, ge=1024, le=1024 * 1024, description="largest request line plus headers")
    request_read_timeout: float = Field(
        10.0, gt=0.0, le=3600.0, description="seconds a request (headers and body) may take to arrive"
    )
    max_connections: int = Field(64, ge=1, le=100_000, description="open connections; one more is answered 503")
    log_level: str = "info"

    @field_validator("token")
    @classmethod
    def _token_strength(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"token must have at least {MIN_TOKEN_LENGTH} characters (use e.g. `openssl rand -hex 24`)"
            )
        return v

    @field_validator("cold_url")
    @classmethod
    def _cold_url_form(cls, v: str | None) -> str | None:
        if v:
            try:
                parse_cold_url(v)  # as the cold tier parses it: a malformed URL never reaches a request
            except SwiftlogError as e:
                raise ValueError(f"{e.message} ({e.hint})" if e.hint else e.message) from None
        return v

    @field_validator("planner")
    @classmethod
    def _planner_form(cls, v: str) -> str:
        mod, sep, fn = v.partition(":")
        if not sep or not mod or not fn:
            raise ValueError(f"planner {v!r} must be 'module:function'")
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(host_name(h) for h in v if h.strip())
        for h in names:
            bare = h.removeprefix("*.")
            if h != "*" and (not bare or "*" in bare or not all(c.isalnum() or c in ".-_:" for c in bare)):
                raise ValueError(f"allowed host {h!r} must be a host name, an address, '*.domain' or '*'")
        return names

    @model_validator(mode="after")
    def _bind_rules(self) -> Settings:
        if self.require_token_for_reads and self.token is None:
            raise ValueError("require_token_for_reads needs a token: set one or drop the option")
        if self.default_page_size > self.max_page_size:
            raise ValueError(f"default_page_size {self.default_page_size} exceeds max_page_size {self.max_page_size}")
        if not is_loopback(self.host):
            if self.token is None:
                raise ValueError(
                    f"refusing to serve on non-loopback address {self.host!r} without a token: "
                    f"set {ENV_TOKEN} or pass --token, or bind 127.0.0.1"
                )
            if self.allow_insecure_loopback_writes:
                raise ValueError("allow_insecure_loopback_writes is only allowed with a loopback host")
        if self.tls_keyfile is not None and self.tls_certfile is None:
            raise ValueError("tls_keyfile needs tls_certfile (the certificate it belongs to)")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def reads_need_token(self) -> bool:
        if self.require_token_for_reads is None:
            return not is_loopback(self.host)
        return self.require_token_for_reads

    @property
    def host_names(self) -> tuple[str, ...]:
        """The names a Host header may carry: the bound address (unless it is a wildcard), this machine's
        host name, the loopback names and ``allowed_hosts``. A rebinding attacker's page sends its own
        name, never one of these."""
        bound = host_name(self.host)
        names = [] if bound in _WILDCARDS else [bound]
        return tuple(dict.fromkeys([*names, host_name(socket.gethostname()), *_LOOPBACK_NAMES, *self.allowed_hosts]))

    @property
    def scheme(self) -> str:
        return "https" if self.tls_certfile is not None else "http"

    @property
    def auth_mode(self) -> str:
        """ "token", "insecure-loopback" or "read-only" (mutations refused)."""
        if self.token is not None:
            return "token"
        return "insecure-loopback" if self.allow_insecure_loopback_writes else "read-only"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
        """Build settings: ``explicit`` values (None means "not given") over ``env`` (default
        ``os.environ``) over defaults. Raises ConfigError naming the bad value."""
        values = EnvSettings.read(env).settings_values()
        values.update({k: v for k, v in explicit.items() if v is not None})
        if "root" not in values:
            raise ConfigError("no store root given", hint=f"pass --root or set {ENV_ROOT}")
        return cls.build(**values)

    @classmethod
    def build(cls, **values: Any) -> Settings:
        """``Settings(**values)``, with pydantic's ValidationError turned into one ConfigError."""
        from pydantic import ValidationError

        try:
            return cls(**values)
        except ValidationError as e:
            msgs = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()
            )
            raise ConfigError(f"invalid server settings: {msgs}") from None


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.env_vars = parse_env_vars(env, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


class EnvSettings(BaseSettings):
    """The server's ``SWIFTLOG_*`` environment variables as set: the one place they are read.

    A variable that is unset or empty is None. Values stay strings here; :class:`Settings`
    validates them, so an error names the setting the same way whatever its source.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore", frozen=True)

    root: str | None = None
    cold_url: str | None = None
    cold_options: str | None = None
    token: str | None = None
    host: str | None = None
    port: str | None = None
    allow_insecure_loopback_writes: str | None = None
    planner: str | None = None
    allowed_hosts: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> EnvSettings:
        """The variables of ``env``, by default ``os.environ``."""
        if env is None:
            return cls()
        # model_validate would read os.environ as well; the fields are strings, there is nothing to validate
        return cls.model_construct(**_MappingEnvSource(cls, env)())

    def cold_options_value(self) -> Any:
        """``SWIFTLOG_COLD_OPTIONS`` decoded (None when unset). Raises ConfigError when it is not JSON."""
        if self.cold_options is None:
            return None
        try:
            return json.loads(self.cold_options)
        except ValueError as e:
            raise ConfigError(
                f"{ENV_COLD_OPTIONS} is not JSON: {e}", hint='write e.g. {"key": "...", "secret": "..."}'
            ) from None

    def settings_values(self) -> dict[str, Any]:
        """The variables that are set, as :class:`Settings` keywords."""
        values: dict[str, Any] = {
            "root": self.root,
            "cold_url": self.cold_url,
            "cold_options": self.cold_options_value(),
            "token": self.token,
            "host": self.host,
            "port": self.port,
            "planner": self.planner,
            "tls_certfile": self.tls_cert,
            "tls_keyfile": self.tls_key,
        }
        if self.allow_insecure_loopback_writes is not None:
            values["allow_insecure_loopback_writes"] = self.allow_insecure_loopback_writes.lower() in _TRUE
        if self.allowed_hosts is not None:
            values["allowed_hosts"] = tuple(self.allowed_hosts.split(","))
        return {k: v for k, v in values.items() if v is not None}
