"""Shared options, output and error handling of the ``swiftlog`` subcommands.

Every subcommand is thin: it parses its options, calls one :class:`server.node.Node` method inside
:func:`handle_errors`, and prints the result as rich tables or, with ``--json``, as the same JSON
the admin API returns. Expected errors print ``error: ...`` and ``hint: ...`` on stderr (never a
traceback) and exit with the codes of :mod:`server.errors`:
0 ok, 1 problems found, 2 usage or bad input, 3 not found, 4 unavailable.

Under ``--json`` an error is one JSON object on stdout instead, with the same exit code::

    {"error": {"type", "message", "hint", "exit_code", "key", "retryable"}}

``type`` is the admin API's error code where the error has one (``run_not_found``...), ``usage``
for an option the parser refused, else the exit code's name (``bad_input``, ``not_found``,
``unavailable``, ``problems``). stdout, because a script that asked for JSON reads stdout: it
gets one document either way and tells them apart by the exit code or the ``error`` key; stderr
keeps the warnings. Every subcommand is a :class:`Command`, which does this also for the errors
the option parser raises before the command runs.

Never: prints a traceback for an expected error; mixes plain text into stdout under ``--json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from typer.core import TyperCommand

from logstore.cold import parse_cold_url
from logstore.errors import ConfigError, SwiftlogError
from server.errors import EXIT_INTERRUPTED, EXIT_NOT_FOUND, EXIT_PROBLEMS, EXIT_UNAVAILABLE, EXIT_USAGE, classify
from server.node import Node
from server.settings import ENV_COLD_OPTIONS, ENV_COLD_URL, ENV_ROOT, EnvSettings

__all__ = [
    "RootOpt",
    "RunOpt",
    "OptionalRunOpt",
    "RankOpt",
    "StagesPerRankOpt",
    "StageStyleOpt",
    "failed_ranks",
    "ColdUrlOpt",
    "ColdOptionOpt",
    "JsonOpt",
    "Command",
    "console",
    "err_console",
    "fail",
    "handle_errors",
    "check_cold_url",
    "cold_url_param",
    "deprecated_alias",
    "make_node",
    "parse_cold_options",
    "parse_kv",
    "print_json",
    "human_bytes",
]

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

# typer >= 0.20 carries its own copy of click (typer._click), older ones use click: either way these
# are the classes typer's own BadParameter derives from
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_EXIT_NAMES = {
    EXIT_PROBLEMS: "problems",
    EXIT_USAGE: "bad_input",
    EXIT_NOT_FOUND: "not_found",
    EXIT_UNAVAILABLE: "unavailable",
}
_json_errors: ContextVar[bool] = ContextVar("swiftlog_json_errors", default=False)  # the running command's --json


def cold_url_param(value: str | None) -> str | None:
    """Typer callback of every ``--cold-url``: a malformed URL is a usage error (exit 2) naming it,
    before anything is opened. Returns the value unchanged; the store parses it the same way."""
    if value:
        try:
            parse_cold_url(value)
        except SwiftlogError as e:
            hint = f" ({e.hint})" if e.hint else ""
            raise typer.BadParameter(f"{e.message}{hint}") from None
    return value


RootOpt = Annotated[Path, typer.Option("--root", envvar=ENV_ROOT, help="the node's store root", show_default=False)]
RunOpt = Annotated[str, typer.Option("--run", "-r", help="run id")]
# a rank that holds several stages (multi-stage schedules): its pp position, and how the schedule placed them
RankOpt = Annotated[
    list[int] | None,
    typer.Option("--rank", min=0, max=0xFFFF, help="multi-stage schedules: a failed rank's pp position (repeat)"),
]
StagesPerRankOpt = Annotated[int, typer.Option("--stages-per-rank", min=1, max=64, help="stages per rank")]
StageStyleOpt = Annotated[str, typer.Option("--stage-style", help="how stages sit on ranks: loop or v")]


def failed_ranks(stages: list[int] | None, ranks: list[int] | None, per_rank: int, style: str) -> dict[str, Any]:
    """The planner's options for ``--rank`` (none without it); a usage error naming ``--stage``
    when neither a stage nor a rank is given."""
    if not stages and not ranks:
        raise fail(
            "missing option '--stage' / '-s'",
            hint="name the failed stage: -s 2 (repeat for several), or a rank of several: --rank 1 --stages-per-rank 2",
            error_type="usage",
        )
    if style not in ("loop", "v"):
        raise fail(f"--stage-style must be loop or v, got {style!r}", error_type="usage")
    return {"failed_ranks": ranks, "stages_per_rank": per_rank, "stage_style": style} if ranks else {}


OptionalRunOpt = Annotated[str | None, typer.Option("--run", "-r", help="run id")]
ColdUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--cold-url", envvar=ENV_COLD_URL, callback=cold_url_param, help="cold tier: file:///dir or s3://bucket/prefix"
    ),
]
ColdOptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--cold-option",
        help=f"cold tier storage option KEY=VALUE (repeatable; JSON values; {ENV_COLD_OPTIONS} holds a JSON object)",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print machine-readable JSON instead of tables")]


def fail(
    message: str,
    *,
    hint: str | None = None,
    code: int = EXIT_USAGE,
    error_type: str | None = None,
    key: str | None = None,
    retryable: bool = False,
) -> typer.Exit:
    """Report an error; return the Exit (``code``) to raise. Under the running command's ``--json``:
    one JSON object on stdout (see the module docstring; ``error_type`` is its ``type``, by default
    the exit code's name). Otherwise ``error:`` and ``hint:`` lines on stderr."""
    if _json_errors.get():
        body = {
            "type": error_type or _EXIT_NAMES.get(code, "error"),
            "message": message,
            "hint": hint,
            "exit_code": code,
            "key": key,
            "retryable": retryable,
        }
        print_json({"error": body})
    else:
        err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
        if hint:
            err_console.print(f"[yellow]hint:[/] {hint}", markup=True, soft_wrap=True)
    return typer.Exit(code)


def _asks_json(args: Sequence[str]) -> bool:
    """Whether raw command-line ``args`` hold ``--json`` (before a ``--``)."""
    args = list(args)
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def _parser_error(e: Exception) -> typer.Exit:
    """An error of the option parser (a missing option, a bad value), reported as :func:`fail` does."""
    ctx = getattr(e, "ctx", None)
    hint = f"see '{ctx.command_path} --help'" if ctx is not None else None
    kind = "usage" if isinstance(e, _UsageError) else None
    return fail(e.format_message(), hint=hint, code=e.exit_code, error_type=kind)  # type: ignore[attr-defined]


class Command(TyperCommand):
    """A ``swiftlog`` subcommand: under ``--json`` every error it reports is one JSON object on stdout,
    the option parser's too (a missing option, a bad ``--cold-url``). Exit codes are unchanged."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        as_json = _asks_json(args)  # before parsing: the parser consumes args
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _ClickException as e:
            if not as_json:
                raise
            token = _json_errors.set(True)
            try:
                raise _parser_error(e) from None
            finally:
                _json_errors.reset(token)

    def invoke(self, ctx: Any) -> Any:
        token = _json_errors.set(bool(ctx.params.get("json_out")))
        try:
            return super().invoke(ctx)
        except _ClickException as e:  # e.g. a BadParameter raised by the command itself
            if not _json_errors.get():
                raise
            raise _parser_error(e) from None
        finally:
            _json_errors.reset(token)


def deprecated_alias(new: Any, old: Any, *, new_flag: str, old_flag: str) -> Any:
    """The value of an option given under its deprecated spelling ``old_flag`` (a hidden option that
    still works), with a note on stderr, or ``new`` when the old one was not given. Both at once
    is a usage error."""
    if old is None or old == []:
        return new
    if new is not None and new != []:
        raise fail(f"{old_flag} and {new_flag} name the same thing", hint=f"pass {new_flag} only ({old_flag} is old)")
    err_console.print(f"[yellow]note:[/] {old_flag} is deprecated; use {new_flag}", markup=True, soft_wrap=True)
    return old


@contextmanager
def handle_errors() -> Iterator[None]:
    """Turn swiftlog errors into a message and an exit code; let everything else crash loudly."""
    try:
        yield
    except SwiftlogError as e:
        p = classify(e)
        msg = p.message if p.key is None or p.key in p.message else f"{p.message} [{p.key}]"
        raise fail(msg, hint=p.hint, code=p.exit_code, error_type=p.code, key=p.key, retryable=p.retryable) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


def parse_cold_options(items: list[str] | None) -> dict[str, Any]:
    """``SWIFTLOG_COLD_OPTIONS`` (a JSON object) updated by ``--cold-option KEY=VALUE`` flags."""
    opts: dict[str, Any] = {}
    try:
        loaded = EnvSettings.read().cold_options_value()
    except ConfigError as e:
        raise fail(e.message, hint=e.hint) from None
    if loaded is not None:
        if not isinstance(loaded, dict):
            raise fail(f"{ENV_COLD_OPTIONS} must be a JSON object")
        opts.update(loaded)
    opts.update(parse_kv(items, "--cold-option"))
    return opts


def parse_kv(items: list[str] | None, what: str) -> dict[str, Any]:
    """``KEY=VALUE`` flags as a dict; values are JSON when they parse, else strings.
    Raises the usage Exit naming ``what`` for an item without ``=``."""
    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise fail(f"{what} {item!r} is not KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def check_cold_url(cold_url: str | None) -> None:
    """A ``file://`` cold tier a reading command is given must exist (a mistyped one would read as
    an empty cold tier, silently). Other URLs are checked by their first request."""
    if cold_url and cold_url.startswith("file://") and not os.path.isdir(cold_url[len("file://") :]):
        raise fail(
            f"cold tier directory {cold_url[len('file://') :]!r} does not exist",
            hint=f"check --cold-url / {ENV_COLD_URL}",
            code=EXIT_NOT_FOUND,
        )


def make_node(root: Path, cold_url: str | None = None, cold_options: list[str] | None = None) -> Node:
    """A Node over ``root`` (which must exist), with summaries always computed fresh."""
    if not root.is_dir():
        raise fail(
            f"store root {str(root)!r} does not exist", hint=f"pass --root or set {ENV_ROOT}", code=EXIT_NOT_FOUND
        )
    check_cold_url(cold_url)
    return Node(
        root, cold_url=cold_url, cold_options=parse_cold_options(cold_options), summary_ttl=0.0, summary_max_stale=0.0
    )


def print_json(obj: BaseModel | dict[str, Any] | list[Any]) -> None:
    """JSON on stdout, exactly as the API would return it."""
    text = obj.model_dump_json(indent=2) if isinstance(obj, BaseModel) else json.dumps(obj, indent=2)
    print(text, flush=True)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"
