"""The ``swiftlog`` typer app: every command group registered on one app, ``--version``.

Imported by :func:`server.cli.main`, which turns a missing server extra into one line (typer, rich, pydantic).
See :mod:`server.cli` for the command groups, the common options and the exit codes.

Never: imports the replay engine before ``swiftlog replay`` runs (about 2 s of torch.distributed start-up).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from server._version import version
from server.cli import agent, demo, groups, inspect, maintain, recover, serve, simulate

__all__ = ["app"]

_LAZY = "replay"


def _replay_installed() -> bool:
    return importlib.util.find_spec("replay") is not None  # top-level spec: imports nothing


def _load_replay_command() -> click.Command | None:
    """``swiftlog replay`` from server/cli/replay.py, built on demand."""
    try:
        from server.cli import replay as replay_cli
    except ImportError:
        return None
    sub = typer.Typer(add_completion=False)
    replay_cli.register(sub)
    cmd = typer.main.get_command(sub)
    if isinstance(cmd, click.Group):
        cmd = cmd.commands.get(_LAZY)
    return cmd


class _Group(TyperGroup):
    """Adds ``replay`` on first use: importing the replay engine pulls in
    torch.distributed.pipelining (about 2 s), which no other command needs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        return [*names, _LAZY] if _LAZY not in names and _replay_installed() else names

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == _LAZY and cmd_name not in self.commands:
            cmd = _load_replay_command()
            if cmd is not None:
                self.add_command(cmd, _LAZY)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    name="swiftlog",
    cls=_Group,
    help="Inspect and maintain swiftlog log stores; serve the admin API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _mod in (inspect, maintain, recover, groups, simulate, serve, demo, agent):
    _mod.register(app)


def _print_version(value: bool | None) -> None:
    if value:
        print(f"swiftlog {version()}")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool | None,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit"),
    ] = None,
) -> None:
    pass
