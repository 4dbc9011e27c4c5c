"""The ``swiftlog`` command line: thin subcommands over :class:`server.node.Node`.

One module per subcommand group (litestream's layout)::

    inspect.py     ls, stat, show, export
    maintain.py    verify, gc, flush, unregister
    recover.py     plan
    serve.py       serve
    demo.py        demo
    replay/cli.py  replay (lives with the replay engine; loaded on first use, see _Group)

Common options: ``--root`` (env SWIFTLOG_ROOT), ``--run/-r``, ``--cold-url`` (env SWIFTLOG_COLD_URL;
a malformed URL is refused before anything runs), ``--json`` on every inspection command. One
spelling per concept across commands: ``--stage/-s`` a failed (or, in the demo, killed) stage,
``--target-iteration/-t``, ``--workers/-w`` replay processes, ``--output/-o``. An old spelling
stays as a hidden option that still works and prints a deprecation note (``plan --failed/-f``,
``demo --replay-workers``).

Exit codes: 0 ok, 1 problems found, 2 usage or bad input, 3 not found, 4 unavailable. Under
``--json`` an error is one JSON object on stdout (``{"error": {"type", "message", "hint",
"exit_code", ...}}``, see ``_common.py``), with the same exit code.
"""

from __future__ import annotations

import importlib.util
import logging

import click
import typer
from typer.core import TyperGroup

from server.cli import demo, inspect, maintain, recover, serve

__all__ = ["app", "main"]

_LAZY = "replay"


def _replay_installed() -> bool:
    return importlib.util.find_spec("replay") is not None  # top-level spec: imports nothing


def _load_replay_command() -> click.Command | None:
    """``swiftlog replay`` from replay/cli.py, built on demand."""
    try:
        from replay import cli as replay_cli
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
for _mod in (inspect, maintain, recover, serve, demo):
    _mod.register(app)


def main() -> None:
    """Console-script entry point (``swiftlog = "server.cli:main"``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
